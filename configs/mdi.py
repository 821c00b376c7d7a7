"""MDI (arXiv 2508.10552): GRPO with rewards mc_idx 4 : think_format 1 : MDI attention balance 1.

    python -m jaxvrl.train --config configs/mdi.py

A real model and A-OKVQA: add --config.model.path=/ckpt/Qwen2.5-VL-3B-Instruct
--config.data.train_files=aokvqa/train.jsonl --config.data.image_dir=aokvqa.
"""

from configs import base


def get_config(arg=None):
    c = base.get_config(arg)
    c.name = "mdi"
    c.reward.funcs = ("mc_idx", "think_format", "mdi")
    c.reward.weights = (4.0, 1.0, 1.0)
    c.reward.mdi_balance_ratio = 2.0
    return c
