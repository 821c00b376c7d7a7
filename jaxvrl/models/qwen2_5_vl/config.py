"""Qwen2.5-VL configuration: frozen dataclasses read from (and written to) HF `config.json`.

Both layouts HF has used are read: the nested one of transformers >= 4.53 (`text_config`,
`vision_config`, `rope_parameters`) and the flat one of the original checkpoints (text keys at
the top level, `rope_scaling` with `type: "mrope"`, `rope_theta`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, ClassVar

from jaxvrl.config import ConfigError
from jaxvrl.models.config import (
    TextConfig,
    VisionConfig,
    fields_of,
    freeze,
    jsonable,
    text_from_dict,
    thaw,
    vision_from_dict,
)

MODEL_TYPES = ("qwen2_5_vl",)


@dataclasses.dataclass(frozen=True)
class Qwen2_5_VLConfig:
    model_type: ClassVar[str] = "qwen2_5_vl"
    text: TextConfig = TextConfig()
    vision: VisionConfig = VisionConfig()
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 151643
    eos_token_id: int | tuple[int, ...] | None = 151645
    # Anything else in config.json (kept so that export writes it back).
    extra: tuple[tuple[str, Any], ...] = ()

    # ------------------------------------------------------------------ HF I/O
    @classmethod
    def from_hf_dict(cls, d: dict, source: str = "config.json") -> Qwen2_5_VLConfig:
        model_type = d.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ConfigError(
                f"{source}: model_type {model_type!r} is not supported (supported: {MODEL_TYPES})"
            )
        text_d = dict(d.get("text_config") or {})
        # Flat (original) layout: text keys live at the top level.
        for key in fields_of(TextConfig) | {"rope_scaling", "rope_parameters", "rope_theta"}:
            if key in d and key not in text_d:
                text_d[key] = d[key]
        text = text_from_dict(text_d, source)
        vision = vision_from_dict(dict(d.get("vision_config") or {}), source)
        tie = bool(d.get("tie_word_embeddings", False) or text_d.get("tie_word_embeddings", False))
        known = (
            {
                "text_config",
                "vision_config",
                "model_type",
                "image_token_id",
                "video_token_id",
                "vision_start_token_id",
                "vision_end_token_id",
                "tie_word_embeddings",
            }
            | fields_of(TextConfig)
            | {"rope_scaling", "rope_parameters", "rope_theta"}
        )
        extra = tuple(sorted((k, v) for k, v in d.items() if k not in known and jsonable(v)))
        eos = text_d.get("eos_token_id", d.get("eos_token_id", 151645))
        return cls(
            text=text,
            vision=vision,
            image_token_id=int(d.get("image_token_id", 151655)),
            video_token_id=int(d.get("video_token_id", 151656)),
            vision_start_token_id=int(d.get("vision_start_token_id", 151652)),
            vision_end_token_id=int(d.get("vision_end_token_id", 151653)),
            tie_word_embeddings=tie,
            bos_token_id=text_d.get("bos_token_id", d.get("bos_token_id")),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            extra=tuple((k, freeze(v)) for k, v in extra),
        )

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> Qwen2_5_VLConfig:
        file = os.path.join(os.fspath(path), "config.json")
        if not os.path.exists(file):
            raise ConfigError(f"{file}: not found (an HF checkpoint directory needs config.json)")
        with open(file) as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{file}: not valid JSON ({e})") from e
        return cls.from_hf_dict(d, source=file)

    def to_hf_dict(self) -> dict:
        t, v = self.text, self.vision
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        d = {k: thaw(val) for k, val in self.extra}
        d.update(
            {
                "architectures": ["Qwen2_5_VLForConditionalGeneration"],
                "model_type": "qwen2_5_vl",
                "image_token_id": self.image_token_id,
                "video_token_id": self.video_token_id,
                "vision_start_token_id": self.vision_start_token_id,
                "vision_end_token_id": self.vision_end_token_id,
                "tie_word_embeddings": self.tie_word_embeddings,
                "text_config": {
                    "model_type": "qwen2_5_vl_text",
                    "vocab_size": t.vocab_size,
                    "hidden_size": t.hidden_size,
                    "intermediate_size": t.intermediate_size,
                    "num_hidden_layers": t.num_hidden_layers,
                    "num_attention_heads": t.num_attention_heads,
                    "num_key_value_heads": t.num_key_value_heads,
                    "hidden_act": t.hidden_act,
                    "rms_norm_eps": t.rms_norm_eps,
                    "max_position_embeddings": t.max_position_embeddings,
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
