"""GRPO (seq-mean-token-mean, group-normalised advantages).

python -m jaxvrl.train --config configs/grpo.py
"""

from configs import base


def get_config(arg=None):
    c = base.get_config(arg)
    c.name = "grpo"
    return c
