"""DAPO with VGR attention-derived token weights on the loss mask.

    python -m jaxvrl.train --config configs/vgr.py

A real model and data: add --config.model.path=/ckpt/Qwen2.5-VL-7B-Instruct
--config.data.train_files=train.jsonl --config.vgr.token_weight_last_k_layers=4.
"""

from configs import dapo


def get_config(arg=None):
    c = dapo.get_config(arg)
    c.name = "vgr"
    c.vgr.enable_token_weights = True
    c.vgr.token_weight_clip = (0.2, 3.0)
    c.vgr.token_weight_last_k_layers = 2  # the embedded model has 4 layers
    return c
