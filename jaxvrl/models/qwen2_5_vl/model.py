"""Qwen2.5-VL for conditional generation, in Flax NNX.

Two entry points:
- `model(input_ids, attention_mask, pixel_values, image_grid_thw, ...)`: the HF-like call on
  numpy/jax arrays; grids are read on the host.
- `model.forward(input_ids, attention_mask, position_ids, images=..., videos=..., cache=...)`:
  traceable under `jax.jit`; every grid-dependent index comes precomputed (`VisionInputs`,
  `get_rope_index`), so shapes are static.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxvrl.models.attention import resolve
from jaxvrl.models.cache import KVCache
from jaxvrl.models.decoder import TextDecoder
from jaxvrl.models.interface import ModelOutput, decoder_outputs
from jaxvrl.models.layers import linear, remat
from jaxvrl.models.patches import VisionInputs, vision_inputs
from jaxvrl.models.positions import get_rope_index
from jaxvrl.models.qwen2_5_vl.config import Qwen2_5_VLConfig
from jaxvrl.models.vision import VisionTower


class Qwen2_5_VL(nnx.Module):
    def __init__(
        self,
        cfg: Qwen2_5_VLConfig,
        *,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs | None = None,
        remat_policy: str = "none",
        attention: str = "auto",
        scan_layers: bool = True,
    ):
        """scan_layers (config `model.scan_layers`): decoder layers and vision blocks stacked
        on a leading layer axis and run by a scan (compiled once), else unrolled; the same
        outputs either way. Part of the param tree: `model.layers.self_attn.q_proj.kernel`
        [L, D, N*H] rather than `model.layers.3.self_attn.q_proj.kernel` [D, N*H]."""
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.config = cfg
        self.dtype = dtype
        self.scan_layers = scan_layers
        self.visual = VisionTower(cfg.vision, scan_layers=scan_layers, **kw)
        self.model = TextDecoder(cfg.text, scan_layers=scan_layers, **kw)
        if not cfg.tie_word_embeddings:
            self.lm_head = linear(cfg.text.hidden_size, cfg.text.vocab_size, bias=False, **kw)
        self.set_remat_policy(remat_policy)
        self.set_attention(attention)

    def set_remat_policy(self, policy: str) -> None:
        """Gradient checkpointing of every decoder layer and vision block: none | full |
        dots_saveable | dots_with_no_batch_dims_saveable (config `model.remat_policy`).
        Part of the graphdef, so set it before `nnx.split`."""
        remat(lambda: None, policy)  # validates the name
        self.model.remat_policy = policy
        self.visual.remat_policy = policy

    def set_dtype(self, dtype) -> None:
        """The compute dtype of every layer (the sampler's `rollout.dtype`); the parameters
        keep theirs, cast where they are used. Part of the graphdef, so set it before
        `nnx.split`."""
        dtype = jnp.dtype(dtype)
        for _, node in nnx.iter_graph(self):
            if isinstance(node, nnx.Module) and "dtype" in vars(node):
                node.dtype = dtype

    def set_attention(self, name: str, block: int = 512) -> None:
        """The attention implementation of the text decoder's and the vision tower's forward
        passes without a KV cache (config `model.attention`): auto | xla | flash | splash |
        cudnn, see `jaxvrl.models.attention`. "auto" is resolved when a program is traced, for
        the platform of the devices it is compiled for: splash on TPUs, flash on GPUs, xla on
        the CPU. The vision tower's window blocks run the banded dense form with any but xla,
        its full-attention blocks flash in place of cudnn (see `vision.py`); the KV-cache path (the sampler's prefill and decode steps) keeps its dense form. block:
        the query and key block size of flash and splash (splash rounds it up to a multiple
        of 128). Part of the graphdef, so set it before `nnx.split`."""
        resolve(name, "cpu")  # validates the name
        if block < 1:
            raise ValueError(f"attention block size must be positive, got {block}")
        for tower in (self.model, self.visual):
            tower.attention = name
            tower.attention_block = int(block)

    # ------------------------------------------------------------------ traceable core
    def embed(self, input_ids, images: VisionInputs | None, videos: VisionInputs | None):
        """Token embeddings with image/video pad tokens replaced by the tower's outputs, in
        order.

        Packed inputs (pixel_values [N, C*T*P*P]): the k-th pad token of the batch takes the
        k-th merged patch. Per-row inputs (pixel_values [B, N, C*T*P*P], every VisionInputs
        field with a leading batch axis): row b's k-th pad token takes row b's k-th merged
        patch; the tower runs per row, so attention costs B*N^2 rather than (B*N)^2 and rows
        can be split into micro-batches.
        """
        cfg = self.config
        x = self.model.embed_tokens(input_ids)
        for inputs, token in ((images, cfg.image_token_id), (videos, cfg.video_token_id)):
            if inputs is None:
                continue
            is_pad = input_ids == token
            # the tower's features in window order; the k-th pad takes the processor's k-th,
            # found through reverse_index: one gather of features (and one backward scatter)
            feats = self.visual.window_order(inputs).astype(x.dtype)
            reverse = jnp.asarray(inputs.reverse_index)
            if inputs.pixel_values.ndim == 3:  # feats [B, U, D]
                rank = jnp.clip(jnp.cumsum(is_pad, axis=1) - 1, 0, feats.shape[1] - 1)
                slot = jnp.take_along_axis(reverse, rank, axis=1)
                picked = jnp.take_along_axis(feats, slot[..., None], axis=1)
            else:  # feats [U, D]
                rank = jnp.cumsum(is_pad.reshape(-1)).reshape(is_pad.shape) - 1
                picked = feats[reverse[jnp.clip(rank, 0, feats.shape[0] - 1)]]
            x = jnp.where(is_pad[..., None], picked, x)
        return x

    @property
    def head(self) -> nnx.Module:
        """The vocabulary projection: `lm_head`, or the token embedding when tied."""
        return self.model.embed_tokens if self.config.tie_word_embeddings else self.lm_head

    def logits(self, hidden: jax.Array, head: nnx.Module | None = None) -> jax.Array:
        """float32[..., V] from final hidden states, through `head` (default: `self.head`; a
        copy of it, e.g. gathered once outside a loop over token chunks)."""
        head = self.head if head is None else head
        out = head.attend(hidden) if self.config.tie_word_embeddings else head(hidden)
        return out.astype(jnp.float32)

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
        """input_ids int[B, T]; attention_mask int[B, T]; position_ids int[3, B, T].

        pools: optional {"vision", "text", "prompt"} bool[B, S] key masks (S = T, or the cache
        length with a cache) to return per-layer attention masses (see `attention_pools`).
        forms: a decode step's replacements for the text layers' projections and cached
        attention (see `TextDecoder.__call__`), or None. key_queries: None, or bool[B, T]
        (no cache, no pools): a diagnostic pass whose `vision_mass` is then float32[L, B, T],
        each key's attention mass from those queries (heads-averaged probabilities summed
        over the queries, per layer), and text_mass None. packing: None, or a `Packing` of
        the rows (no cache): the decoder runs on its packed buffers, and hidden [K, T', D] and
        the masses [L, K, T'] come back packed (`Packing.take` reads them per row).
        """
        return decoder_outputs(
            self,
            self.embed(input_ids, images, videos),
            position_ids,
            attention_mask,
            return_logits=return_logits,
            cache=cache,
            pools=pools,
            forms=forms,
            key_queries=key_queries,
            packing=packing,
        )

    # ------------------------------------------------------------------ HF-like call
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
        input_ids = np.asarray(input_ids)
        if attention_mask is None:
            attention_mask = np.ones_like(input_ids)
        attention_mask = np.asarray(attention_mask)
        if position_ids is None:
            position_ids, _ = get_rope_index(
                input_ids,
                attention_mask,
                self.config,
                image_grid_thw,
                video_grid_thw,
                second_per_grid_ts,
            )
        images = videos = None
        if pixel_values is not None:
            images = vision_inputs(pixel_values, image_grid_thw, self.config.vision)
        if pixel_values_videos is not None:
            videos = vision_inputs(pixel_values_videos, video_grid_thw, self.config.vision)
        return self.forward(
            jnp.asarray(input_ids),
            jnp.asarray(attention_mask),
            jnp.asarray(position_ids),
            images=_to_device(images),
            videos=_to_device(videos),
            pools=None if pools is None else {k: jnp.asarray(v) for k, v in pools.items()},
        )


def _to_device(vi: VisionInputs | None) -> VisionInputs | None:
    return None if vi is None else jax.tree.map(jnp.asarray, vi)
