"""DAPO: token-mean loss, clip-higher (0.2 / 0.28), dynamic sampling, no KL.

python -m jaxvrl.train --config configs/dapo.py
"""

from configs import base


def get_config(arg=None):
    c = base.get_config(arg)
    c.name = "dapo"
    c.algorithm.loss_agg_mode = "token-mean"
    c.algorithm.clip_ratio_high = 0.28
    c.filter.dynamic_sampling = True
    return c
