"""The model families, by the `model_type` of their `config.json`.

Every family runs the one `jaxvrl.models.model.Model` (a text decoder, an optional vision
encoder, a head). A family is a `Family`: how to read its `config.json`, its HF key table, its
positions (int[B, T] for RoPE, int[3, B, T] for M-RoPE; see `positions`) and, for
vision-language families, its vision encoder, the host layout of its patches and its
image/video processor. A text-only family is one entry of `text.TEXT_FAMILIES`; a
vision-language family is a package `jaxvrl/models/<model_type>/` whose `FAMILY` is a
`Family` (imported on first use).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
from collections.abc import Callable
from typing import Any, Protocol

from jaxvrl.config import ConfigError
from jaxvrl.models import text
from jaxvrl.models.weights import KeyTable

# model_type (config.json) -> the package of its vision-language family; the text-only
# families are the entries of `text.TEXT_FAMILIES`
FAMILIES: dict[str, str] = {
    "qwen2_5_vl": "jaxvrl.models.qwen2_5_vl",
    "qwen2_vl": "jaxvrl.models.qwen2_vl",
    "qwen3_vl": "jaxvrl.models.qwen3_vl",
    "qwen3_vl_moe": "jaxvrl.models.qwen3_vl_moe",
}

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclasses.dataclass(frozen=True)
class ProcessorSettings:
    """The image/video processor of a family: patches of `patch_size` pixels, `merge_size` x
    `merge_size` of them merged into one token, `temporal_patch_size` frames per patch,
    normalised by `image_mean` / `image_std`; images resized to multiples of patch x merge
    within [min_pixels, max_pixels], video frames within the video limits; the special
    tokens that stand for images and videos in its prompts."""

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
    # the family's special tokens: an image's (video's) pad, repeated once per merged token,
    # inside a vision span
    image_pad: str = "<|image_pad|>"
    video_pad: str = "<|video_pad|>"
    vision_start: str = "<|vision_start|>"
    vision_end: str = "<|vision_end|>"

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


class VisionEncoder(Protocol):
    """What the model asks of a family's vision encoder (`Family.encoder`, built as
    `encoder(cfg.vision, dtype=, param_dtype=, rngs=, scan_layers=)`; `VisionTower` is every
    family's today). Its host-side half is `Family.vision_inputs`, which lays out patches,
    grids, windows and the reverse index as `VisionInputs`; the model then replaces the k-th
    image (video) pad token with the k-th merged feature, and adds the DeepStack levels
    where there are some. remat_policy, attention and attention_block are set by the
    model's setters."""

    def features(self, inputs: Any) -> tuple[Any, Any]:
        """(merged features [U, D] (packed inputs) or [B, U, D] (per row), in the order
        `inputs.reverse_index` reads; DeepStack levels [K, ...] of the same shape, or None)."""
        ...


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family.

    model_type / architecture: `config.json`'s names. config_from_hf(d, source) -> config
    (with `.text`, `.vision` (None: text only), the special token ids, `to_hf_dict()`); keys:
    the HF key table; rope_index(input_ids, attention_mask, cfg, image_grid_thw,
    video_grid_thw, second_per_grid_ts) -> (positions, deltas int32[B]): positions int32[B, T]
    (RoPE) or int32[3, B, T] (M-RoPE), the family's own rank, which the rest of the package
    carries without reading (see `positions.continue_positions`); encoder: the vision
    encoder's module class, built from `cfg.vision` (None: text only); vision_inputs(
    pixel_values, grid_thw, vision_cfg, num_patches) -> VisionInputs, the encoder's host-side
    preparation; processor(cfg) -> ProcessorSettings (None: text only); lora_prefix: the
    module holding the text decoder's projections; vision_prefix: the encoder's."""

    model_type: str
    architecture: str
    config_from_hf: Callable[[dict, str], Any]
    keys: KeyTable
    rope_index: Callable
    vision_inputs: Callable | None = None
    processor: Callable[[Any], ProcessorSettings] | None = None
    encoder: Callable[..., VisionEncoder] | None = None
    lora_prefix: str = "model"
    vision_prefix: str = "visual"


def _text_family(entry: text.TextFamily) -> Family:
    return Family(
        model_type=entry.model_type,
        architecture=entry.architecture,
        config_from_hf=text.CausalLMConfig.from_hf_dict,
        keys=text.KEYS,
        rope_index=text.rope_index,
    )


def supported() -> tuple[str, ...]:
    """Every model_type a config.json may name."""
    return (*FAMILIES, *text.TEXT_FAMILIES)


def family(model_type: str) -> Family:
    """The family registered for `model_type` (a config.json's), imported on first use."""
    if model_type in text.TEXT_FAMILIES:
        return _text_family(text.TEXT_FAMILIES[model_type])
    if model_type not in FAMILIES:
        raise ConfigError(
            f"model_type {model_type!r} is not supported (supported: {', '.join(supported())})"
        )
    return importlib.import_module(FAMILIES[model_type]).FAMILY


def family_of(cfg) -> Family:
    """The family of a model config (or of a model: its `.config`)."""
    cfg = getattr(cfg, "config", cfg)
    return family(cfg.model_type)


def config_from_hf(d: dict, source: str = "config.json"):
    """A model config from a config.json dictionary, by its `model_type`."""
    model_type = d.get("model_type")
    if model_type not in supported():
        raise ConfigError(
            f"{source}: model_type {model_type!r} is not supported "
            f"(supported: {', '.join(supported())})"
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
