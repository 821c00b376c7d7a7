"""Qwen2-VL's HF tensor names <-> param paths (see `jaxvrl.models.weights`): Qwen2.5-VL's
table plus the biases of the vision tower's LayerNorms (blocks' norm1/norm2, merger's ln_q);
the blocks' fc1/fc2 fall under its `mlp.{proj}` rows."""

from jaxvrl.models.qwen2_5_vl.weights import KEY_ALIASES
from jaxvrl.models.qwen2_5_vl.weights import KEY_TABLE as QWEN2_5_VL_KEY_TABLE
from jaxvrl.models.weights import KeyTable

KEY_TABLE: tuple[tuple[str, str, str], ...] = QWEN2_5_VL_KEY_TABLE + (
    ("visual.blocks.{i}.{norm}.bias", "visual.blocks.{i}.{norm}.bias", "copy"),
    ("visual.merger.ln_q.bias", "visual.merger.ln_q.bias", "copy"),
)

KEYS = KeyTable(KEY_TABLE, KEY_ALIASES)
