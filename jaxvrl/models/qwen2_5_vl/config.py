"""Qwen2.5-VL configuration: frozen dataclasses read from (and written to) HF `config.json`.

Both layouts HF has used are read: the nested one of transformers >= 4.53 (`text_config`,
`vision_config`, `rope_parameters`) and the flat one of the original checkpoints (text keys at
the top level, `rope_scaling` with `type: "mrope"`, `rope_theta`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from jaxvrl.config import ConfigError

MODEL_TYPES = ("qwen2_5_vl",)
# Gradient checkpointing of decoder layers and vision blocks (`model.remat_policy`).
REMAT_POLICIES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable")


def checkpoint_policy(name: str):
    """The jax.checkpoint policy for a REMAT_POLICIES name ("full": save nothing)."""
    import jax

    if name not in REMAT_POLICIES or name == "none":
        raise ValueError(f"remat_policy {name!r} is not one of {REMAT_POLICIES[1:]}")
    if name == "full":
        return None
    return getattr(jax.checkpoint_policies, name)


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    depth: int = 32
    hidden_size: int = 1280
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    tokens_per_second: float = 2
    window_size: int = 112
    out_hidden_size: int = 2048
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Flattened size of one patch: C x T x P x P (1176 for Qwen2.5-VL)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size**2

    @property
    def window_units(self) -> int:
        """Merge units along one side of an attention window."""
        return self.window_size // self.spatial_merge_size // self.patch_size

    @property
    def window_patches(self) -> int:
        """Patches in a whole attention window (64 for Qwen2.5-VL); edge windows hold fewer."""
        return self.window_units**2 * self.merge_unit


@dataclasses.dataclass(frozen=True)
class TextConfig:
    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 11008
    num_hidden_layers: int = 36
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    mrope_section: tuple[int, int, int] = (16, 24, 24)
    max_position_embeddings: int = 128000

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclasses.dataclass(frozen=True)
class Qwen2_5_VLConfig:
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
        for key in _fields(TextConfig) | {"rope_scaling", "rope_parameters", "rope_theta"}:
            if key in d and key not in text_d:
                text_d[key] = d[key]
        text = _text_from_dict(text_d, source)
        vision = _vision_from_dict(dict(d.get("vision_config") or {}), source)
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
            | _fields(TextConfig)
            | {"rope_scaling", "rope_parameters", "rope_theta"}
        )
        extra = tuple(sorted((k, v) for k, v in d.items() if k not in known and _jsonable(v)))
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
            extra=tuple((k, _freeze(v)) for k, v in extra),
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
        d = {k: _thaw(val) for k, val in self.extra}
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


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _jsonable(v) -> bool:
    try:
        json.dumps(v)
        return True
    except TypeError:
        return False


def _freeze(v):
    return json.dumps(v, sort_keys=True)


def _thaw(v):
    return json.loads(v)


def _text_from_dict(d: dict, source: str) -> TextConfig:
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise ConfigError(
            f"{source}: text rope type {rope_type!r} is not supported (only default/mrope)"
        )
    theta = rope.get("rope_theta", d.get("rope_theta", TextConfig.rope_theta))
    kw = {k: d[k] for k in _fields(TextConfig) if k in d and d[k] is not None}
    kw.pop("rope_theta", None)
    kw.pop("mrope_section", None)
    cfg = TextConfig(
        **kw,
        rope_theta=float(theta),
        mrope_section=tuple(rope.get("mrope_section", TextConfig.mrope_section)),
    )
    if cfg.hidden_size % cfg.num_attention_heads:
        raise ConfigError(f"{source}: hidden_size not divisible by num_attention_heads")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ConfigError(f"{source}: num_attention_heads not divisible by num_key_value_heads")
    if 2 * sum(cfg.mrope_section) != cfg.head_dim:
        raise ConfigError(
            f"{source}: mrope_section {cfg.mrope_section} must sum to head_dim/2 = {cfg.head_dim // 2}"
        )
    if d.get("use_sliding_window"):
        raise ConfigError(f"{source}: use_sliding_window=true is not supported")
    return cfg


def _vision_from_dict(d: dict, source: str) -> VisionConfig:
    rope = d.get("rope_parameters") or {}
    kw = {k: d[k] for k in _fields(VisionConfig) if k in d and d[k] is not None}
    if "num_attention_heads" in d and "num_heads" not in d:
        kw["num_heads"] = d["num_attention_heads"]
    if "fullatt_block_indexes" in kw:
        kw["fullatt_block_indexes"] = tuple(kw["fullatt_block_indexes"])
    kw["rope_theta"] = float(rope.get("rope_theta", VisionConfig.rope_theta))
    cfg = VisionConfig(**kw)
    if cfg.hidden_size % cfg.num_heads:
        raise ConfigError(f"{source}: vision hidden_size not divisible by num_heads")
    if cfg.window_size % (cfg.spatial_merge_size * cfg.patch_size):
        raise ConfigError(
            f"{source}: vision window_size {cfg.window_size} must be a multiple of "
            f"spatial_merge_size * patch_size"
        )
    return cfg
