"""TPRL / VPPO (arXiv 2510.09285): perception filtering from a perturbed-image pass, entropy
filtering and trajectory advantage shaping (TAS), on DAPO (2 policy updates per rollout batch;
the masks, TAS and advantages are computed once per batch and held fixed across them).

    python -m jaxvrl.train --config configs/tprl.py

A real model and data: add --config.model.path=/ckpt/Qwen2.5-VL-7B-Instruct
--config.data.train_files=train.jsonl --config.tprl.top_p_perception_tokens=0.2
--config.tprl.top_p_entropy_tokens=0.2 (the values for long completions). VPPO's
published sizes (384 prompts x 5 samples per rollout batch, 128 prompts per update: 3
updates): --config.prompts_per_step=384 --config.rollout.num_generations=5
--config.actor.global_batch_size=128.
"""

from configs import dapo


def get_config(arg=None):
    c = dapo.get_config(arg)
    c.name = "tprl"
    c.tprl.enable_perception_filtering = True
    c.tprl.enable_entropy_filtering = True
    c.tprl.enable_trajectory_reweighting = True
    c.tprl.top_p_perception_tokens = 0.4  # completions of the built-in task are ~10 tokens
    c.tprl.top_p_entropy_tokens = 0.4
    return c
