"""Qwen2-VL in Flax NNX with exact parity to `transformers`.

model = jaxvrl.models.load("/path/to/Qwen2-VL-2B-Instruct")
out = model(input_ids, attention_mask, pixel_values=pv, image_grid_thw=grid)
jaxvrl.models.save(model, "/tmp/export")
"""

import functools

from jaxvrl.models import positions
from jaxvrl.models.interface import CLIP_MEAN, CLIP_STD, Family, ProcessorSettings
from jaxvrl.models.patches import vision_inputs
from jaxvrl.models.qwen2_vl.config import Qwen2VLConfig
from jaxvrl.models.qwen2_vl.weights import KEY_TABLE, KEYS
from jaxvrl.models.vision import VisionTower

# Qwen2-VL's M-RoPE position ids: the shared rope index with a video's temporal index its
# frame index (second_per_grid_ts is accepted for the common signature and not read)
get_rope_index = functools.partial(positions.get_rope_index, timed_video=False)


def processor(cfg: Qwen2VLConfig) -> ProcessorSettings:
    v = cfg.vision
    return ProcessorSettings(
        v.patch_size, v.spatial_merge_size, v.temporal_patch_size, CLIP_MEAN, CLIP_STD
    )


FAMILY = Family(
    model_type="qwen2_vl",
    architecture="Qwen2VLForConditionalGeneration",
    config_from_hf=Qwen2VLConfig.from_hf_dict,
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
    "Qwen2VLConfig",
    "get_rope_index",
    "processor",
]
