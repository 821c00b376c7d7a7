"""Qwen2.5-VL in Flax NNX with exact parity to `transformers`.

model = jaxvrl.models.qwen2_5_vl.load("/path/to/Qwen2.5-VL-3B-Instruct")
out = model(input_ids, attention_mask, pixel_values=pv, image_grid_thw=grid)
jaxvrl.models.qwen2_5_vl.save(model, "/tmp/export")
"""

from jaxvrl.models.qwen2_5_vl.config import ConfigError, Qwen2_5_VLConfig, TextConfig, VisionConfig
from jaxvrl.models.qwen2_5_vl.model import ModelOutput, Qwen2_5_VL
from jaxvrl.models.qwen2_5_vl.positions import attention_pools, get_rope_index
from jaxvrl.models.qwen2_5_vl.text import KVCache, PagedKVCache
from jaxvrl.models.qwen2_5_vl.vision import VisionInputs, stack_vision_inputs, vision_inputs
from jaxvrl.models.qwen2_5_vl.weights import KEY_TABLE, load, save

__all__ = [
    "KEY_TABLE",
    "ConfigError",
    "KVCache",
    "PagedKVCache",
    "ModelOutput",
    "Qwen2_5_VL",
    "Qwen2_5_VLConfig",
    "TextConfig",
    "VisionConfig",
    "VisionInputs",
    "attention_pools",
    "get_rope_index",
    "load",
    "save",
    "stack_vision_inputs",
    "vision_inputs",
]
