"""Seeds 001/003: DAPO with VGR attention-derived token weights on the loss mask.

python -m jaxvrl.train --config configs/vgr.py
"""

from configs import dapo


def get_config(arg=None):
    c = dapo.get_config(arg)
    c.name = "vgr"
    c.vgr.enable_token_weights = True
    c.vgr.token_weight_last_k_layers = 2
    return c
