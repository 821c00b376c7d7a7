"""Models: one interface over every family (`jaxvrl.models.interface`).

model = jaxvrl.models.load("/path/to/checkpoint")   # the family config.json's model_type names
out = model(input_ids, attention_mask, pixel_values=pv, image_grid_thw=grid)  # a `Model`
jaxvrl.models.save(model, "/tmp/export")            # an HF directory transformers loads

`DTYPES`: the compute and parameter dtypes a config may name; `EMBEDDED` (`EMBEDDED_TEXT`): the
tiny vision-language (text-only) checkpoint shipped in the package; `preset_names`: the
published configs shipped without weights (shapes for `python -m jaxvrl.aot`).
"""

import os

import jax.numpy as jnp

from jaxvrl.config import ConfigError
from jaxvrl.models import positions
from jaxvrl.models.cache import KVCache, PagedKVCache
from jaxvrl.models.interface import (
    FAMILIES,
    Family,
    ModelOutput,
    ProcessorSettings,
    config_from_hf,
    family,
    family_of,
    load,
    load_config,
    save,
    supported,
)
from jaxvrl.models.model import Model  # every family's module (the protocol: interface.Model)
from jaxvrl.models.packing import Packing, gather_rows, gather_slots
from jaxvrl.models.patches import VisionInputs, stack_vision_inputs
from jaxvrl.models.positions import attention_pools, continue_positions

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")
PRESETS = os.path.join(ASSETS, "presets")
EMBEDDED = os.path.join(ASSETS, "tiny_qwen2_5_vl")  # the tiny checkpoint of the embedded default
EMBEDDED_FAMILY = "qwen2_5_vl"  # its model_type
# the tiny text-only checkpoint of the built-in text task (configs/math_grpo.py, text_ppo.py)
EMBEDDED_TEXT = os.path.join(ASSETS, "tiny_llama")
EMBEDDED_TEXT_FAMILY = "llama"


def preset_names() -> tuple[str, ...]:
    return tuple(sorted(f[: -len(".json")] for f in os.listdir(PRESETS) if f.endswith(".json")))


def rope_index(
    cfg,
    input_ids,
    attention_mask,
    image_grid_thw=None,
    video_grid_thw=None,
    second_per_grid_ts=None,
):
    """The family's positions of a batch of prompts for the model of `cfg` (int32[B, T] for
    RoPE, int32[3, B, T] for M-RoPE) and deltas int32[B], by its rope index (see `Family`)."""
    return family_of(cfg).rope_index(
        input_ids, attention_mask, cfg, image_grid_thw, video_grid_thw, second_per_grid_ts
    )


def _vision_family(cfg) -> Family:
    fam = family_of(cfg)
    if fam.encoder is None:
        raise ConfigError(
            f"{fam.architecture} is a text-only model with no vision tower: rows must not "
            "hold images or videos"
        )
    return fam


def vision_inputs(cfg, pixel_values, grid_thw, num_patches=None) -> VisionInputs:
    """The host layout of packed patches for the model of `cfg` (see `Family`)."""
    return _vision_family(cfg).vision_inputs(pixel_values, grid_thw, cfg.vision, num_patches)


def vision_token_ids(cfg) -> tuple[int, ...]:
    """The ids of the special tokens that stand for images and videos (pads, vision start and
    end) in the model of `cfg`; () for a text-only model."""
    if family_of(cfg).encoder is None:
        return ()
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return tuple(getattr(cfg, n) for n in names if getattr(cfg, n, None) is not None)


def processor(cfg) -> ProcessorSettings | None:
    """The image/video processor settings of the model of `cfg`; None for a text-only model
    (no vision tower reads pixels)."""
    fam = family_of(cfg)
    return None if fam.processor is None else fam.processor(cfg)


__all__ = [
    "Packing",
    "ASSETS",
    "DTYPES",
    "EMBEDDED",
    "EMBEDDED_FAMILY",
    "EMBEDDED_TEXT",
    "EMBEDDED_TEXT_FAMILY",
    "FAMILIES",
    "PRESETS",
    "Family",
    "KVCache",
    "Model",
    "ModelOutput",
    "PagedKVCache",
    "ProcessorSettings",
    "VisionInputs",
    "attention_pools",
    "continue_positions",
    "positions",
    "config_from_hf",
    "family",
    "family_of",
    "gather_rows",
    "gather_slots",
    "load",
    "load_config",
    "preset_names",
    "processor",
    "rope_index",
    "save",
    "stack_vision_inputs",
    "supported",
    "vision_inputs",
    "vision_token_ids",
]
