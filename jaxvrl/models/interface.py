"""What the rest of the package needs from a model, declared once.

A family (Qwen2.5-VL, Qwen2-VL, Qwen3-VL, ...) is a package `jaxvrl/models/<model_type>/`
whose `FAMILY` is a `Family`: how to read its `config.json`, build its module, map its HF
tensor names, compute its position ids and the host layout of its patches, and the settings of
its image/video processor. `family(model_type)` finds it by the `model_type` of `config.json`
(imported on first use). Code outside `jaxvrl/models/` reaches a model only through this
module and `jaxvrl.models`: the `Model` protocol below, `Family`, and the shared layouts
(`KVCache`, `PagedKVCache`, `VisionInputs`).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
from collections.abc import Callable
from typing import Any, Protocol

import jax
from flax import struct

from jaxvrl.config import ConfigError
from jaxvrl.models import weights
from jaxvrl.models.weights import KeyTable

# model_type (config.json) -> the package of its family
FAMILIES: dict[str, str] = {
    "qwen2_5_vl": "jaxvrl.models.qwen2_5_vl",
    "qwen2_vl": "jaxvrl.models.qwen2_vl",
    "qwen3_vl": "jaxvrl.models.qwen3_vl",
    "llama": "jaxvrl.models.llama",
    "qwen2": "jaxvrl.models.qwen2",
    "qwen3": "jaxvrl.models.qwen3",
}

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclasses.dataclass(frozen=True)
class ProcessorSettings:
    """The image/video processor of a family: patches of `patch_size` pixels, `merge_size` x
    `merge_size` of them merged into one token, `temporal_patch_size` frames per patch,
    normalised by `image_mean` / `image_std`; images resized to multiples of patch x merge
    within [min_pixels, max_pixels], video frames within the video limits."""

    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    video_min_pixels: int = 128 * 28 * 28
    video_max_pixels: int = 768 * 28 * 28
    # Qwen3-VL: each frame group of a video gets its timestamp text and its own vision span,
    # and the video limits bound all of a video's frames together
    video_timestamps: bool = False

    @property
    def factor(self) -> int:
        """Image sides are multiples of this many pixels."""
        return self.patch_size * self.merge_size

    @property
    def black(self) -> tuple[float, ...]:
        """A black pixel after normalisation, per channel: (0 - mean) / std."""
        return tuple(-m / s for m, s in zip(self.image_mean, self.image_std))

    @property
    def patch_dim(self) -> int:
        """Values in one flattened patch: 3 x temporal x patch x patch."""
        return 3 * self.temporal_patch_size * self.patch_size**2


@struct.dataclass
class ModelOutput:
    """logits: float32[B, T, V] (None if not asked); hidden: [B, T, D] final-norm states;
    cache: the updated KV cache or None; vision_mass / text_mass: float32[L, B, T] or None."""

    logits: jax.Array | None
    hidden: jax.Array
    cache: Any = None
    vision_mass: jax.Array | None = None
    text_mass: jax.Array | None = None

    @classmethod
    def of(cls, logits, hidden, cache, stats, per_key: bool) -> ModelOutput:
        """From the text decoder's outputs: stats is None, (A_V, A_X), or with per_key (the
        pass was given key_queries) the per-key masses, returned in vision_mass."""
        if stats is None or per_key:
            return cls(logits, hidden, cache, stats)
        return cls(logits, hidden, cache, stats[0], stats[1])


def decoder_outputs(model, x, position_ids, attention_mask, *, return_logits=True, **kw):
    """What every family's `forward` ends with: its text decoder (`model.model`) over the
    input embeddings x [B, T, D] (cache, pools, forms, deepstack, key_queries, packing in
    `kw`, as `TextDecoder.__call__` takes them) and the `ModelOutput`."""
    hidden, cache, stats = model.model(x, position_ids, attention_mask, **kw)
    logits = model.logits(hidden) if return_logits else None
    return ModelOutput.of(logits, hidden, cache, stats, kw.get("key_queries") is not None)


class Model(Protocol):
    """Every family's module (an `nnx.Module`).

    `model(input_ids, attention_mask, pixel_values=..., image_grid_thw=...,
    pixel_values_videos=..., video_grid_thw=...)` on host arrays, and the traceable
    `model.forward(input_ids, attention_mask, position_ids, images=, videos=, cache=, pools=,
    return_logits=, forms=, key_queries=, packing=)` (packing: a `Packing`, the rows run
    padding-free and the outputs come back packed) with position ids from `Family.rope_index` and `VisionInputs`
    from `Family.vision_inputs`; both return a `ModelOutput`. `model.model` is the text
    decoder (`embed_tokens`, `layers`, `layer(i)`, `norm`); `model.visual` the vision tower.
    """

    config: Any
    dtype: Any

    def forward(self, input_ids, attention_mask, position_ids, **kw) -> ModelOutput: ...

    def logits(self, hidden: jax.Array, head=None) -> jax.Array: ...

    def set_dtype(self, dtype) -> None: ...

    def set_attention(self, name: str, block: int = 512) -> None: ...

    def set_remat_policy(self, policy: str) -> None: ...


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family.

    model_type / architecture: `config.json`'s names. config_from_hf(d, source) -> config
    (with `.text`, `.vision`, the special token ids, `to_hf_dict()`); model(cfg, dtype=,
    param_dtype=, rngs=, remat_policy=, attention=, scan_layers=) -> a `Model`; keys: the HF
    key table; rope_index(input_ids, attention_mask, cfg, image_grid_thw, video_grid_thw,
    second_per_grid_ts) -> (position_ids int32[3, B, T], deltas int32[B]); vision_inputs(
    pixel_values, grid_thw, vision_cfg, num_patches) -> VisionInputs; processor(cfg) ->
    ProcessorSettings; lora_prefix: the module holding the text decoder's projections;
    vision_prefix: the vision tower's."""

    model_type: str
    architecture: str
    config_from_hf: Callable[[dict, str], Any]
    model: Callable[..., Model]
    keys: KeyTable
    rope_index: Callable
    vision_inputs: Callable
    processor: Callable[[Any], ProcessorSettings]
    lora_prefix: str = "model"
    vision_prefix: str = "visual"


def family(model_type: str) -> Family:
    """The family registered for `model_type` (a config.json's), imported on first use."""
    if model_type not in FAMILIES:
        raise ConfigError(
            f"model_type {model_type!r} is not supported (supported: {', '.join(FAMILIES)})"
        )
    return importlib.import_module(FAMILIES[model_type]).FAMILY


def family_of(cfg) -> Family:
    """The family of a model config (or of a model: its `.config`)."""
    cfg = getattr(cfg, "config", cfg)
    return family(cfg.model_type)


def config_from_hf(d: dict, source: str = "config.json"):
    """A model config from a config.json dictionary, by its `model_type`."""
    model_type = d.get("model_type")
    if model_type not in FAMILIES:
        raise ConfigError(
            f"{source}: model_type {model_type!r} is not supported "
            f"(supported: {', '.join(FAMILIES)})"
        )
    return family(model_type).config_from_hf(d, source)


def load_config(path):
    """The model config of an HF checkpoint directory (its config.json)."""
    file = os.path.join(os.fspath(path), "config.json")
    if not os.path.exists(file):
        raise ConfigError(f"{file}: not found (an HF checkpoint directory needs config.json)")
    with open(file) as f:
        try:
            d = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{file}: not valid JSON ({e})") from e
    return config_from_hf(d, source=file)


def load(
    path, dtype=None, param_dtype=None, attention: str = "auto", scan_layers: bool = True
) -> Model:
    """The model of an HF checkpoint directory (config.json + *.safetensors), of the family its
    config.json names, without torch. dtype: compute dtype (default float32); param_dtype:
    stored parameter dtype (default: dtype); attention: the attention implementation (see
    `Model.set_attention`); scan_layers: stacked layers run by a scan (the same outputs)."""
    import jax.numpy as jnp

    cfg = load_config(path)
    dtype = jnp.float32 if dtype is None else dtype
    return weights.load(
        path,
        family_of(cfg),
        cfg,
        dtype=dtype,
        param_dtype=param_dtype,
        attention=attention,
        scan_layers=scan_layers,
    )


def save(model: Model, path, *, tokenizer_dir=None, dtype=None, max_shard_bytes=None) -> None:
    """Writes `model` as an HF checkpoint directory transformers loads (config.json and
    safetensors, sharded past `max_shard_bytes`, default 5 GB); tokenizer_dir: copy the
    tokenizer and processor files from there too; dtype: cast the tensors."""
    weights.save(
        model,
        path,
        family_of(model).keys,
        tokenizer_dir=tokenizer_dir,
        dtype=dtype,
        max_shard_bytes=weights.SHARD_BYTES if max_shard_bytes is None else max_shard_bytes,
    )
