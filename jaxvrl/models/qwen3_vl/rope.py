"""Qwen3-VL's M-RoPE position ids: the shared rope index with every video cut into one grid
per temporal patch (t = 1). Qwen3-VL's prompts give each group of frames its own vision span
after its timestamp text (`<1.3 seconds><|vision_start|>...<|vision_end|>`), so each span is
placed like an image and time is told by the text, not by the temporal position."""

from __future__ import annotations

import numpy as np

from jaxvrl.models import positions


def split_video_grids(video_grid_thw) -> np.ndarray | None:
    """int64[sum t, 3]: each video grid (t, h, w) as t grids (1, h, w), in order."""
    if video_grid_thw is None:
        return None
    grid = np.asarray(video_grid_thw, np.int64).reshape(-1, 3)
    out = np.repeat(grid, grid[:, 0], axis=0)
    out[:, 0] = 1
    return out


def get_rope_index(
    input_ids,
    attention_mask,
    cfg,
    image_grid_thw=None,
    video_grid_thw=None,
    second_per_grid_ts=None,
) -> tuple[np.ndarray, np.ndarray]:
    """(position_ids int32[3, B, T], deltas int32[B]) like transformers' Qwen3-VL
    `get_rope_index` (see `positions.get_rope_index`); second_per_grid_ts is not read."""
    return positions.get_rope_index(
        input_ids, attention_mask, cfg, image_grid_thw, split_video_grids(video_grid_thw)
    )
