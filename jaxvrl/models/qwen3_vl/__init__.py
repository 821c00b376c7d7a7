"""Qwen3-VL (dense) in Flax NNX with parity to `transformers`.

model = jaxvrl.models.load("/path/to/Qwen3-VL-2B-Instruct")
out = model(input_ids, attention_mask, pixel_values=pv, image_grid_thw=grid)
jaxvrl.models.save(model, "/tmp/export")
"""

from jaxvrl.models.interface import Family, ProcessorSettings
from jaxvrl.models.patches import vision_inputs
from jaxvrl.models.qwen3_vl.config import Qwen3VLConfig
from jaxvrl.models.qwen3_vl.rope import get_rope_index, split_video_grids
from jaxvrl.models.qwen3_vl.weights import KEY_TABLE, KEYS
from jaxvrl.models.vision import VisionTower

# the published checkpoints' preprocessor_config.json / video_preprocessor_config.json; the
# video limits bound all of a video's frames together (t x h x w, transformers' rule)
MEAN_STD = (0.5, 0.5, 0.5)
MIN_PIXELS, MAX_PIXELS = 65536, 16777216
VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS = 4096, 25165824


def processor(cfg: Qwen3VLConfig) -> ProcessorSettings:
    v = cfg.vision
    return ProcessorSettings(
        patch_size=v.patch_size,
        merge_size=v.spatial_merge_size,
        temporal_patch_size=v.temporal_patch_size,
        image_mean=MEAN_STD,
        image_std=MEAN_STD,
        min_pixels=MIN_PIXELS,
        max_pixels=MAX_PIXELS,
        video_min_pixels=VIDEO_MIN_PIXELS,
        video_max_pixels=VIDEO_MAX_PIXELS,
        video_timestamps=True,
    )


FAMILY = Family(
    model_type="qwen3_vl",
    architecture="Qwen3VLForConditionalGeneration",
    config_from_hf=Qwen3VLConfig.from_hf_dict,
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
    "Qwen3VLConfig",
    "get_rope_index",
    "processor",
    "split_video_grids",
    "vision_inputs",
]
