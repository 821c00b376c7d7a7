"""Qwen2.5-VL configuration: frozen dataclasses read from (and written to) HF `config.json`.

Both layouts HF has used are read: the nested one of transformers >= 4.53 (`text_config`,
`vision_config`, `rope_parameters`) and the flat one of the original checkpoints (text keys at
the top level, `rope_scaling` with `type: "mrope"`, `rope_theta`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jaxvrl.models.config import (
    TextConfig,
    VisionConfig,
    fields_of,
    text_from_dict,
    text_sizes,
    vision_from_dict,
)
from jaxvrl.models.family_config import VLConfig


@dataclasses.dataclass(frozen=True)
class Qwen2_5_VLConfig(VLConfig):
    model_type: ClassVar[str] = "qwen2_5_vl"
    architecture: ClassVar[str] = "Qwen2_5_VLForConditionalGeneration"
    text: TextConfig = TextConfig()
    vision: VisionConfig = VisionConfig()

    # ------------------------------------------------------------------ HF I/O
    @classmethod
    def from_hf_dict(cls, d: dict, source: str = "config.json") -> Qwen2_5_VLConfig:
        cls.check_type(d, source)
        text_d = dict(d.get("text_config") or {})
        # Flat (original) layout: text keys live at the top level.
        for key in fields_of(TextConfig) | {"rope_scaling", "rope_parameters", "rope_theta"}:
            if key in d and key not in text_d:
                text_d[key] = d[key]
        text = text_from_dict(text_d, source)
        vision = vision_from_dict(dict(d.get("vision_config") or {}), source)
        known = fields_of(TextConfig) | {"rope_scaling", "rope_parameters", "rope_theta"}
        return cls(text=text, vision=vision, **cls.shared_from_hf(d, text_d, known))

    def to_hf_dict(self) -> dict:
        t, v = self.text, self.vision
        eos = self.eos_json
        d = self.shared_to_hf()
        d.update(
            {
                "text_config": {
                    "model_type": "qwen2_5_vl_text",
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
                "vision_config": {
                    "model_type": "qwen2_5_vl_vision",
                    "depth": v.depth,
                    "hidden_size": v.hidden_size,
                    "intermediate_size": v.intermediate_size,
                    "num_heads": v.num_heads,
                    "in_channels": v.in_channels,
                    "patch_size": v.patch_size,
                    "spatial_merge_size": v.spatial_merge_size,
                    "temporal_patch_size": v.temporal_patch_size,
                    "tokens_per_second": v.tokens_per_second,
                    "window_size": v.window_size,
                    "out_hidden_size": v.out_hidden_size,
                    "fullatt_block_indexes": list(v.fullatt_block_indexes),
                    "hidden_act": v.hidden_act,
                    "rope_parameters": {"rope_type": "axial", "rope_theta": v.rope_theta},
                },
            }
        )
        return d
