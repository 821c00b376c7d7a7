"""Qwen2-VL for conditional generation, in Flax NNX.

The modules are Qwen2.5-VL's (`Qwen2_5_VL`: the shared `VisionTower`, `TextDecoder` and
`lm_head`); what differs is carried by the config (LayerNorm blocks with a plain quick-GELU
MLP, a LayerNorm merger, no window attention) and by the position ids, whose video time is
the frame index (`get_rope_index`).
"""

from __future__ import annotations

import numpy as np

from jaxvrl.models.interface import ModelOutput
from jaxvrl.models.positions import get_rope_index as _rope_index
from jaxvrl.models.qwen2_5_vl.model import Qwen2_5_VL


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


class Qwen2VL(Qwen2_5_VL):
    """`Qwen2_5_VL` built from a `Qwen2VLConfig`; the HF-like call computes Qwen2-VL's
    position ids."""

    def __call__(
        self,
        input_ids,
        attention_mask=None,
        pixel_values=None,
        image_grid_thw=None,
        pixel_values_videos=None,
        video_grid_thw=None,
        second_per_grid_ts=None,
        *,
        position_ids=None,
        pools: dict | None = None,
    ) -> ModelOutput:
        """Forward on host arrays (numpy or concrete jax). Left- or right-padded batches."""
        if position_ids is None:
            mask = None if attention_mask is None else np.asarray(attention_mask)
            position_ids, _ = get_rope_index(
                np.asarray(input_ids), mask, self.config, image_grid_thw, video_grid_thw
            )
        return super().__call__(
            input_ids,
            attention_mask,
            pixel_values,
            image_grid_thw,
            pixel_values_videos,
            video_grid_thw,
            position_ids=position_ids,
            pools=pools,
        )
