"""Sharding rules cover LoRA-wrapped and QLoRA-quantized text projections: every weight-like
leaf of a wrapped decoder layer gets the logical axes of the Linear it came from."""

from __future__ import annotations

import importlib.util

import jax
import pytest
from flax import nnx

from jaxvrl.models import lora
from jaxvrl.models.qwen2_5_vl import load
from jaxvrl.parallel.sharding import leaf_name, param_axes
from jaxvrl.train import EMBEDDED

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# (projection, D_in axis, D_out axis)
AXES = {
    "q_proj": ("embed", "heads"),
    "k_proj": ("embed", "heads"),
    "v_proj": ("embed", "heads"),
    "o_proj": ("heads", "embed"),
    "gate_proj": ("embed", "mlp"),
    "up_proj": ("embed", "mlp"),
    "down_proj": ("mlp", "embed"),
}


def expected(name: str, ndim: int):
    """Per-layer axes after the stacked layers' leading "layers" axis."""
    proj = next(p for p in AXES if f".{p}." in name)
    din, dout = AXES[proj]
    leaf = name.rsplit(".", 1)[-1]
    return ("layers",) + {
        "kernel": (din, dout),
        "qvalue": (din, dout),
        "scale": (None, dout),
        "bias": (dout,),
        "lora_a": (din, None),
        "lora_b": (None, dout),
    }[leaf][: ndim - 1]


def text_layer_leaves(quantize: str):
    model = load(EMBEDDED)
    lora.apply_lora(model, 4, 8.0, 0.0, TARGETS, quantize=quantize, quant_tile=32)
    state = nnx.state(model, nnx.Param)
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        name = leaf_name(path)
        if name.startswith("model.layers.") and "layernorm" not in name:
            out[name] = x.ndim
    return out


@pytest.mark.parametrize(
    "quantize",
    [
        "none",
        pytest.param(
            "int8",
            marks=pytest.mark.skipif(
                importlib.util.find_spec("qwix") is None, reason="QLoRA needs qwix"
            ),
        ),
    ],
)
def test_wrapped_projections_keep_their_axes(quantize):
    leaves = text_layer_leaves(quantize)
    kinds = {n.rsplit(".", 1)[-1] for n in leaves}
    assert {"lora_a", "lora_b"} <= kinds
    assert ("qvalue" in kinds and "scale" in kinds) == (quantize != "none")
    for name, ndim in leaves.items():
        assert param_axes(name, ndim) == expected(name, ndim), name
