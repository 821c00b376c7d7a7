"""Qwen3-VL-MoE's HF tensor names <-> param paths: Qwen3-VL's table (`qwen3_vl.weights`) with
each sparse layer's router `mlp.gate.weight` (the dense MLP's row) and its experts fused,
`mlp.experts.gate_up_proj` [E, 2F, D] (gate's F rows first) and `mlp.experts.down_proj`
[E, D, F] as transformers' save_pretrained writes them (the published checkpoints hold them
[E, D, 2F] and [E, F, D], which the loader reads too: `weights` kind "experts")."""

from jaxvrl.models.qwen3_vl.weights import KEY_ALIASES, KEY_TABLE, T
from jaxvrl.models.weights import KeyTable

EXPERT_ROWS: tuple[tuple[str, str, str], ...] = (
    (
        f"{T}.layers.{{i}}.mlp.experts.{{proj}}",
        "model.layers.{i}.mlp.experts.{proj}.kernel",
        "experts",
    ),
)

KEYS = KeyTable((*KEY_TABLE, *EXPERT_ROWS), KEY_ALIASES)
