"""Qwen2-VL configuration: frozen dataclasses read from (and written to) HF `config.json`.

Both layouts HF has used are read: the nested one of transformers >= 4.53 (`text_config`,
`vision_config`, `rope_parameters`) and the flat one of the published checkpoints (text keys
at the top level, `rope_scaling` with `type: "mrope"`, `rope_theta`). Keys a config leaves
out take transformers' Qwen2-VL defaults (`configuration_qwen2_vl.py`).

The vision tower is the shared one (`jaxvrl.models.vision`) with LayerNorms, a plain quick-GELU
MLP of `embed_dim * mlp_ratio` and no window attention; HF's vision keys map onto
`VisionConfig` as embed_dim -> hidden_size and hidden_size (the merger's output, the text
width) -> out_hidden_size.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jaxvrl.config import ConfigError
from jaxvrl.models.config import (
    TextConfig,
    VisionConfig,
    fields_of,
    text_from_dict,
    text_sizes,
)
from jaxvrl.models.family_config import VLConfig

# transformers' Qwen2VLTextConfig defaults where they differ from TextConfig's
TEXT_DEFAULTS = dict(
    vocab_size=152064,
    hidden_size=8192,
    intermediate_size=29568,
    num_hidden_layers=80,
    num_attention_heads=64,
    max_position_embeddings=32768,
    rms_norm_eps=1e-5,
)
# transformers' Qwen2VLVisionConfig defaults
VISION_DEFAULTS = dict(
    depth=32,
    embed_dim=1280,
    hidden_size=3584,
    hidden_act="quick_gelu",
    mlp_ratio=4,
    num_heads=16,
    in_channels=3,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
)
ROPE_KEYS = {"rope_scaling", "rope_parameters", "rope_theta"}


@dataclasses.dataclass(frozen=True)
class Qwen2VLConfig(VLConfig):
    model_type: ClassVar[str] = "qwen2_vl"
    architecture: ClassVar[str] = "Qwen2VLForConditionalGeneration"
    text: TextConfig = TextConfig()
    vision: VisionConfig = VisionConfig(
        hidden_size=1280,
        intermediate_size=5120,
        out_hidden_size=2048,
        hidden_act="quick_gelu",
        window_size=0,
        fullatt_block_indexes=(),
        norm="layer",
        mlp="plain",
    )

    # ------------------------------------------------------------------ HF I/O
    @classmethod
    def from_hf_dict(cls, d: dict, source: str = "config.json") -> Qwen2VLConfig:
        cls.check_type(d, source)
        text_d = dict(d.get("text_config") or {})
        # Flat (published) layout: text keys live at the top level.
        for key in fields_of(TextConfig) | ROPE_KEYS:
            if key in d and key not in text_d:
                text_d[key] = d[key]
        for key, value in TEXT_DEFAULTS.items():
            if text_d.get(key) is None:
                text_d[key] = value
        if text_d.get("num_key_value_heads") is None:
            text_d["num_key_value_heads"] = text_d["num_attention_heads"]
        text = text_from_dict(text_d, source)
        vision = vision_from_hf(dict(d.get("vision_config") or {}), source)
        known = fields_of(TextConfig) | ROPE_KEYS
        shared = cls.shared_from_hf(d, text_d, known, bos=151643)
        return cls(text=text, vision=vision, **shared)

    def to_hf_dict(self) -> dict:
        t = self.text
        eos = self.eos_json
        d = self.shared_to_hf()
        d.update(
            {
                "text_config": {
                    "model_type": "qwen2_vl_text",
                    **text_sizes(t),
                    "rope_parameters": {
                        "rope_type": "default",
                        "rope_theta": t.rope_theta,
                        "mrope_section": list(t.mrope_section),
                    },
                    "bos_token_id": self.bos_token_id,
                    "eos_token_id": eos,
                    "tie_word_embeddings": self.tie_word_embeddings,
                },
                "vision_config": vision_to_hf(self.vision),
            }
        )
        return d


def vision_from_hf(d: dict, source: str) -> VisionConfig:
    """The shared `VisionConfig` of a Qwen2-VL `vision_config` dictionary."""
    d = {k: v for k, v in d.items() if v is not None}
    if "in_chans" in d and "in_channels" not in d:  # the published checkpoints' name
        d["in_channels"] = d["in_chans"]
    for hf_name, name in (("num_attention_heads", "num_heads"), ("num_hidden_layers", "depth")):
        if hf_name in d and name not in d:
            d[name] = d[hf_name]
    d = {**VISION_DEFAULTS, **d}
    embed = int(d["embed_dim"])
    rope = d.get("rope_parameters") or {}
    cfg = VisionConfig(
        depth=int(d["depth"]),
        hidden_size=embed,
        intermediate_size=int(embed * d["mlp_ratio"]),
        num_heads=int(d["num_heads"]),
        in_channels=int(d["in_channels"]),
        patch_size=int(d["patch_size"]),
        spatial_merge_size=int(d["spatial_merge_size"]),
        temporal_patch_size=int(d["temporal_patch_size"]),
        out_hidden_size=int(d["hidden_size"]),
        hidden_act=d["hidden_act"],
        rope_theta=float(rope.get("rope_theta", VisionConfig.rope_theta)),
        window_size=0,
        fullatt_block_indexes=(),
        norm="layer",
        mlp="plain",
    )
    if cfg.hidden_size % cfg.num_heads:
        raise ConfigError(f"{source}: vision embed_dim not divisible by num_heads")
    return cfg


def vision_to_hf(v: VisionConfig) -> dict:
    """`vision_from_hf`'s inverse: the `vision_config` transformers reads."""
    ratio = v.intermediate_size / v.hidden_size
    return {
        "model_type": "qwen2_vl_vision",
        "depth": v.depth,
        "embed_dim": v.hidden_size,
        "hidden_size": v.out_hidden_size,
        "mlp_ratio": int(ratio) if ratio == int(ratio) else ratio,
        "num_heads": v.num_heads,
        "in_channels": v.in_channels,
        "patch_size": v.patch_size,
        "spatial_merge_size": v.spatial_merge_size,
        "temporal_patch_size": v.temporal_patch_size,
        "hidden_act": v.hidden_act,
        "rope_parameters": {"rope_type": "axial", "rope_theta": v.rope_theta},
    }
