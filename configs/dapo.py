"""DAPO (arXiv 2503.14476): token-mean loss, clip-higher (0.2 / 0.28), dynamic sampling,
no KL; 2 policy updates per rollout batch (mini-batches of half the prompts), so the clipping
acts from the second update on.

    python -m jaxvrl.train --config configs/dapo.py

A real model and data: add --config.model.path=/ckpt/Qwen2.5-VL-3B-Instruct
--config.data.train_files=train.jsonl; with long completions also the overlong buffer, e.g.
--config.filter.overlong_buffer_len=256 --config.filter.max_num_gen_batches=4. Sizes of verl's
Qwen2.5-VL-7B GRPO example (512 prompts x 5 samples per rollout batch, 128 prompts per
update: 4 updates): --config.prompts_per_step=512 --config.rollout.num_generations=5
--config.actor.global_batch_size=128 (optim.micro_batches to fit the memory).
"""

from configs import base
from jaxvrl.config import half_divisor


def get_config(arg=None):
    c = base.get_config(arg)
    c.name = "dapo"
    c.actor.loss_agg_mode = "token-mean"
    c.actor.clip_ratio_high = 0.28
    # half the prompts per update (an odd count: its largest divisor below half); follows
    # prompts_per_step when that is overridden
    c.actor.global_batch_size = half_divisor(c.get_ref("prompts_per_step"))
    c.filter.dynamic_sampling = True
    return c
