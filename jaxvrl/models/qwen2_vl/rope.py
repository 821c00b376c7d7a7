"""Qwen2-VL's M-RoPE position ids: the shared rope index with a video's time as its frame
index (Qwen2.5-VL's counts seconds)."""

from __future__ import annotations

import numpy as np

from jaxvrl.models.positions import get_rope_index as _rope_index


def get_rope_index(
    input_ids,
    attention_mask,
    cfg,
    image_grid_thw=None,
    video_grid_thw=None,
    second_per_grid_ts=None,
) -> tuple[np.ndarray, np.ndarray]:
    """Qwen2-VL's M-RoPE position ids int32[3, B, T] and deltas int32[B] (see
    `jaxvrl.models.positions.get_rope_index`): a video's temporal index is its frame index;
    second_per_grid_ts is accepted for the common signature and not read."""
    del second_per_grid_ts
    return _rope_index(
        input_ids, attention_mask, cfg, image_grid_thw, video_grid_thw, timed_video=False
    )
