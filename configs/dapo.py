"""DAPO (arXiv 2503.14476): token-mean loss, clip-higher (0.2 / 0.28), dynamic sampling,
no KL.

    python -m jaxvrl.train --config configs/dapo.py

A real model and data: add --config.model.path=/ckpt/Qwen2.5-VL-3B-Instruct
--config.data.train_files=train.jsonl; with long completions also the overlong buffer, e.g.
--config.filter.overlong_buffer_len=256 --config.filter.max_num_gen_batches=4.
"""

from configs import base


def get_config(arg=None):
    c = base.get_config(arg)
    c.name = "dapo"
    c.actor.loss_agg_mode = "token-mean"
    c.actor.clip_ratio_high = 0.28
    c.filter.dynamic_sampling = True
    return c
