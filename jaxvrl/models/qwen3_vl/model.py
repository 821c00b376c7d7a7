"""Qwen3-VL (dense) for conditional generation, in Flax NNX.

The module is Qwen2.5-VL's (`Qwen2_5_VL`: the shared vision tower and text decoder, built from
the config's Qwen3 settings) with DeepStack: the tower's DeepStack levels, gathered at the
image/video pad tokens like its merged output, are added to the residual stream after the
first decoder layers (`decoder.DeepStack`). Position ids follow Qwen3-VL's rope index (`rope`).

model = jaxvrl.models.load("/path/to/Qwen3-VL-2B-Instruct")
out = model(input_ids, attention_mask, pixel_values=pv, image_grid_thw=grid)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxvrl.models.cache import KVCache
from jaxvrl.models.decoder import DeepStack
from jaxvrl.models.interface import ModelOutput, decoder_outputs
from jaxvrl.models.patches import VisionInputs, vision_inputs
from jaxvrl.models.qwen2_5_vl.model import Qwen2_5_VL
from jaxvrl.models.qwen3_vl.rope import get_rope_index


def _slots(inputs: VisionInputs, is_pad: jax.Array, count: int) -> jax.Array:
    """int32[B, T]: for each pad token, the row of the tower's flattened window-order output
    [count, D] it takes (the k-th pad of a row, or of the batch when packed, takes the
    processor's k-th merged token)."""
    reverse = jnp.asarray(inputs.reverse_index)
    if inputs.pixel_values.ndim == 3:  # per row: [B, U] outputs
        units = reverse.shape[1]
        rank = jnp.clip(jnp.cumsum(is_pad, axis=1) - 1, 0, units - 1)
        rows = jnp.arange(is_pad.shape[0])[:, None] * units
        return rows + jnp.take_along_axis(reverse, rank, axis=1)
    rank = jnp.cumsum(is_pad.reshape(-1)).reshape(is_pad.shape) - 1
    return reverse[jnp.clip(rank, 0, count - 1)]


class Qwen3VL(Qwen2_5_VL):
    """Qwen3VLForConditionalGeneration. Built like `Qwen2_5_VL` (same arguments)."""

    def vision_embed(
        self, input_ids, images: VisionInputs | None, videos: VisionInputs | None
    ) -> tuple[jax.Array, DeepStack | None]:
        """Token embeddings [B, T, D] with image/video pad tokens replaced by the tower's
        merged outputs, in order (packed or per-row inputs, as `Qwen2_5_VL.embed`), and the
        DeepStack levels of the same tokens (None without vision inputs)."""
        cfg = self.config
        x = self.model.embed_tokens(input_ids)
        levels, slots, valid, offset = [], jnp.zeros(input_ids.shape, jnp.int32), None, 0
        for inputs, token in ((images, cfg.image_token_id), (videos, cfg.video_token_id)):
            if inputs is None:
                continue
            is_pad = input_ids == token
            feats, deep = self.visual.features(inputs)
            feats = feats.reshape(-1, feats.shape[-1])  # [M, D], window order
            slot = _slots(inputs, is_pad, feats.shape[0])
            x = jnp.where(is_pad[..., None], feats[slot].astype(x.dtype), x)
            if deep is not None:
                levels.append(deep.reshape(deep.shape[0], -1, deep.shape[-1]))
                slots = jnp.where(is_pad, slot + offset, slots)
                valid = is_pad if valid is None else valid | is_pad
                offset += feats.shape[0]
        if not levels:
            return x, None
        return x, DeepStack(jnp.concatenate(levels, axis=1), slots, valid)

    def embed(self, input_ids, images: VisionInputs | None, videos: VisionInputs | None):
        """Token embeddings with the vision tokens' features (without DeepStack)."""
        return self.vision_embed(input_ids, images, videos)[0]

    def forward(
        self,
        input_ids,
        attention_mask,
        position_ids,
        *,
        images: VisionInputs | None = None,
        videos: VisionInputs | None = None,
        cache: KVCache | None = None,
        pools: dict | None = None,
        return_logits: bool = True,
        forms=None,
        key_queries=None,
        packing=None,
    ) -> ModelOutput:
        """Traceable forward pass, as `Qwen2_5_VL.forward`: input_ids/attention_mask [B, T],
        position_ids int[3, B, T] from Qwen3-VL's rope index; vision inputs add their
        DeepStack levels after the first decoder layers (forward passes and prefills with a
        cache alike; decode steps have none). key_queries: as `Qwen2_5_VL.forward`'s."""
        x, deepstack = self.vision_embed(input_ids, images, videos)
        return decoder_outputs(
            self,
            x,
            position_ids,
            attention_mask,
            return_logits=return_logits,
            cache=cache,
            pools=pools,
            forms=forms,
            deepstack=deepstack,
            key_queries=key_queries,
            packing=packing,
        )

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
        """Forward on host arrays (numpy or concrete jax); left- or right-padded batches.
        second_per_grid_ts is not read (frames are placed by their timestamp text)."""
        input_ids = np.asarray(input_ids)
        if attention_mask is None:
            attention_mask = np.ones_like(input_ids)
        attention_mask = np.asarray(attention_mask)
        if position_ids is None:
            position_ids, _ = get_rope_index(
                input_ids, attention_mask, self.config, image_grid_thw, video_grid_thw
            )
        vcfg = self.config.vision
        images = videos = None
        if pixel_values is not None:
            images = jax.tree.map(jnp.asarray, vision_inputs(pixel_values, image_grid_thw, vcfg))
        if pixel_values_videos is not None:
            videos = vision_inputs(pixel_values_videos, video_grid_thw, vcfg)
            videos = jax.tree.map(jnp.asarray, videos)
        return self.forward(
            jnp.asarray(input_ids),
            jnp.asarray(attention_mask),
            jnp.asarray(position_ids),
            images=images,
            videos=videos,
            pools=None if pools is None else {k: jnp.asarray(v) for k, v in pools.items()},
        )
