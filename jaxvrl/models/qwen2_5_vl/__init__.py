"""Qwen2.5-VL in Flax NNX with exact parity to `transformers`.

model = jaxvrl.models.load("/path/to/Qwen2.5-VL-3B-Instruct")
out = model(input_ids, attention_mask, pixel_values=pv, image_grid_thw=grid)
jaxvrl.models.save(model, "/tmp/export")
"""

from jaxvrl.models.cache import KVCache, PagedKVCache
from jaxvrl.models.config import ConfigError, TextConfig, VisionConfig
from jaxvrl.models.interface import Family, ModelOutput, ProcessorSettings, load, save
from jaxvrl.models.patches import VisionInputs, stack_vision_inputs, vision_inputs
from jaxvrl.models.positions import attention_pools, get_rope_index
from jaxvrl.models.qwen2_5_vl.config import Qwen2_5_VLConfig
from jaxvrl.models.qwen2_5_vl.weights import KEY_TABLE, KEYS
from jaxvrl.models.vision import VisionTower


def processor(cfg: Qwen2_5_VLConfig) -> ProcessorSettings:
    v = cfg.vision
    return ProcessorSettings(v.patch_size, v.spatial_merge_size, v.temporal_patch_size)


FAMILY = Family(
    model_type="qwen2_5_vl",
    architecture="Qwen2_5_VLForConditionalGeneration",
    config_from_hf=Qwen2_5_VLConfig.from_hf_dict,
    keys=KEYS,
    rope_index=get_rope_index,
    vision_inputs=vision_inputs,
    processor=processor,
    encoder=VisionTower,
)

__all__ = [
    "FAMILY",
    "KEYS",
    "KEY_TABLE",
    "ConfigError",
    "KVCache",
    "PagedKVCache",
    "ModelOutput",
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
