"""GRPO: group-normalised advantages, seq-mean-token-mean loss, no KL (the base defaults).

    python -m jaxvrl.train --config configs/grpo.py

A real model and data: add --config.model.path=/ckpt/Qwen2.5-VL-3B-Instruct
--config.data.train_files=train.jsonl --config.data.val_files=val.jsonl. Dr.GRPO:
--config.algorithm.norm_adv_by_std=false --config.actor.loss_agg_mode=seq-mean-token-sum-norm.
"""

from configs import base


def get_config(arg=None):
    c = base.get_config(arg)
    c.name = "grpo"
    return c
