"""Qwen3-VL configuration: frozen dataclasses read from (and written to) HF `config.json`.

transformers' layout (`text_config`, `vision_config`; the text rope under `rope_parameters`
or, as the published checkpoints have it, `rope_scaling` with `rope_theta` beside it). Keys a
config leaves out take transformers' Qwen3-VL defaults (`configuration_qwen3_vl.py`).

The text decoder is the shared one with Qwen3's pieces: an explicit head_dim, no attention
biases, per-head q/k RMSNorm, interleaved M-RoPE (transformers' Qwen3-VL rotary interleaves
whatever `mrope_interleaved` says). The vision tower is the shared one with LayerNorms, a plain
GELU(tanh) MLP, full attention in every block, a patch bias, learned position embeddings and
the DeepStack mergers.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jaxvrl.models.config import (
    TextConfig,
    VisionConfig,
    text_from_dict,
    text_sizes,
    vision_from_dict,
)
from jaxvrl.models.family_config import VLConfig

# transformers' Qwen3VLTextConfig defaults where they differ from TextConfig's
TEXT_DEFAULTS = dict(
    hidden_size=4096,
    intermediate_size=22016,
    num_hidden_layers=32,
    num_attention_heads=32,
    head_dim=128,
    rope_theta=500000.0,
)
# transformers' Qwen3VLVisionConfig defaults
VISION_DEFAULTS = dict(
    depth=27,
    hidden_size=1152,
    hidden_act="gelu_pytorch_tanh",
    intermediate_size=4304,
    num_heads=16,
    in_channels=3,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    out_hidden_size=3584,
    num_position_embeddings=2304,
    deepstack_visual_indexes=(8, 16, 24),
)
# what every Qwen3-VL tower is, whatever its config.json says
VISION_FIXED = dict(
    window_size=0, fullatt_block_indexes=(), norm="layer", mlp="plain", patch_bias=True
)
MROPE_SECTION = [24, 20, 20]


@dataclasses.dataclass(frozen=True)
class Qwen3VLConfig(VLConfig):
    model_type: ClassVar[str] = "qwen3_vl"
    architecture: ClassVar[str] = "Qwen3VLForConditionalGeneration"
    # transformers' text config defaults (Qwen3-VL-MoE has its own)
    text_defaults: ClassVar[dict] = TEXT_DEFAULTS
    text: TextConfig = TextConfig(
        **TEXT_DEFAULTS,
        num_key_value_heads=32,
        mrope_section=tuple(MROPE_SECTION),
        attention_bias=False,
        qk_norm=True,
        mrope_interleaved=True,
    )
    vision: VisionConfig = VisionConfig(**VISION_DEFAULTS, **VISION_FIXED)

    @classmethod
    def from_hf_dict(cls, d: dict, source: str = "config.json") -> Qwen3VLConfig:
        cls.check_type(d, source)
        text_d = dict(d.get("text_config") or {})
        rope = dict(text_d.get("rope_parameters") or text_d.get("rope_scaling") or {})
        defaults = cls.text_defaults
        rope.setdefault("rope_theta", text_d.get("rope_theta", defaults["rope_theta"]))
        rope.setdefault("mrope_section", MROPE_SECTION)
        rope["mrope_interleaved"] = True
        text_d = {k: v for k, v in defaults.items() if k != "rope_theta"} | text_d
        text_d["rope_parameters"] = rope
        if text_d.get("num_key_value_heads") is None:
            text_d["num_key_value_heads"] = text_d.get("num_attention_heads")
        bias = bool(text_d.get("attention_bias", False))
        more = cls.text_fields(text_d, source)
        text = text_from_dict(text_d, source, output_bias=bias, qk_norm=True, **more)
        vision_d = VISION_DEFAULTS | dict(d.get("vision_config") or {}) | VISION_FIXED
        vision = vision_from_dict(vision_d, source)
        # the top level's tie_word_embeddings wins over the text part's (transformers' rule)
        tie = d.get("tie_word_embeddings", text_d.get("tie_word_embeddings", False))
        shared = cls.shared_from_hf(d, text_d, set())
        return cls(text=text, vision=vision, **dict(shared, tie_word_embeddings=bool(tie)))

    @classmethod
    def text_fields(cls, text_d: dict, source: str) -> dict:
        """TextConfig fields read from text_config besides the dense decoder's (none)."""
        return {}

    def text_hf(self) -> dict:
        """text_config's keys besides the dense decoder's (none)."""
        return {}

    def to_hf_dict(self) -> dict:
        t, v = self.text, self.vision
        eos = self.eos_json
        d = self.shared_to_hf()
        d.update(
            {
                "text_config": {
                    "model_type": f"{self.model_type}_text",
                    **text_sizes(t),
                    "head_dim": t.head_dim,
                    "attention_bias": t.attention_bias,
                    "rope_parameters": {
                        "rope_type": "default",
                        "rope_theta": t.rope_theta,
                        "mrope_section": list(t.mrope_section),
                        "mrope_interleaved": True,
                    },
                    "bos_token_id": self.bos_token_id,
                    "eos_token_id": eos,
                    "tie_word_embeddings": self.tie_word_embeddings,
                    **self.text_hf(),
                },
                "vision_config": {
                    "model_type": f"{self.model_type}_vision",
                    "depth": v.depth,
                    "hidden_size": v.hidden_size,
                    "hidden_act": v.hidden_act,
                    "intermediate_size": v.intermediate_size,
                    "num_heads": v.num_heads,
                    "in_channels": v.in_channels,
                    "patch_size": v.patch_size,
                    "spatial_merge_size": v.spatial_merge_size,
                    "temporal_patch_size": v.temporal_patch_size,
                    "out_hidden_size": v.out_hidden_size,
                    "num_position_embeddings": v.num_position_embeddings,
                    "deepstack_visual_indexes": list(v.deepstack_visual_indexes),
                    "rope_parameters": {"rope_type": "axial", "rope_theta": v.rope_theta},
                },
            }
        )
        return d
