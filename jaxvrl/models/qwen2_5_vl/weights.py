"""Qwen2.5-VL's HF tensor names <-> param paths (see `jaxvrl.models.weights`)."""

from jaxvrl.models.weights import KeyTable

KEY_TABLE: tuple[tuple[str, str, str], ...] = (
    ("visual.patch_embed.proj.weight", "visual.patch_embed.kernel", "patch"),
    ("visual.blocks.{i}.{norm}.weight", "visual.blocks.{i}.{norm}.weight", "copy"),
    ("visual.blocks.{i}.attn.{proj}.weight", "visual.blocks.{i}.attn.{proj}.kernel", "linear"),
    ("visual.blocks.{i}.attn.{proj}.bias", "visual.blocks.{i}.attn.{proj}.bias", "copy"),
    ("visual.blocks.{i}.mlp.{proj}.weight", "visual.blocks.{i}.mlp.{proj}.kernel", "linear"),
    ("visual.blocks.{i}.mlp.{proj}.bias", "visual.blocks.{i}.mlp.{proj}.bias", "copy"),
    ("visual.merger.ln_q.weight", "visual.merger.ln_q.weight", "copy"),
    ("visual.merger.mlp.0.weight", "visual.merger.fc1.kernel", "linear"),
    ("visual.merger.mlp.0.bias", "visual.merger.fc1.bias", "copy"),
    ("visual.merger.mlp.2.weight", "visual.merger.fc2.kernel", "linear"),
    ("visual.merger.mlp.2.bias", "visual.merger.fc2.bias", "copy"),
    ("model.embed_tokens.weight", "model.embed_tokens.embedding", "copy"),
    ("model.layers.{i}.{norm}.weight", "model.layers.{i}.{norm}.weight", "copy"),
    (
        "model.layers.{i}.self_attn.{proj}.weight",
        "model.layers.{i}.self_attn.{proj}.kernel",
        "linear",
    ),
    ("model.layers.{i}.self_attn.{proj}.bias", "model.layers.{i}.self_attn.{proj}.bias", "copy"),
    ("model.layers.{i}.mlp.{proj}.weight", "model.layers.{i}.mlp.{proj}.kernel", "linear"),
    ("model.norm.weight", "model.norm.weight", "copy"),
    ("lm_head.weight", "lm_head.kernel", "linear"),
)

# Prefixes of transformers 4.5x saves (`Qwen2_5_VLModel` nesting) -> the canonical layout.
KEY_ALIASES: tuple[tuple[str, str], ...] = (
    (r"^model\.language_model\.", "model."),
    (r"^model\.visual\.", "visual."),
)

KEYS = KeyTable(KEY_TABLE, KEY_ALIASES)
