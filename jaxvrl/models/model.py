"""The one model of every family: a text decoder (`model`), an optional vision encoder
(`visual`, None for text-only families) and a head (`lm_head`, the tied token embedding, or
a sequence classifier's `score`).

Two entry points:
- `model(input_ids, attention_mask, pixel_values, image_grid_thw, ...)`: the HF-like call on
  numpy/jax arrays; grids are read on the host and positions come from the family.
- `model.forward(input_ids, attention_mask, position_ids, images=..., videos=..., cache=...)`:
  traceable under `jax.jit`; every grid-dependent index comes precomputed (`VisionInputs`,
  the family's positions), so shapes are static.

A family is its config (what the decoder and the encoder are built from), its key table and
its positions (`Family`); nothing here is specific to one.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from jaxvrl.models.attention import resolve
from jaxvrl.models.cache import KVCache
from jaxvrl.models.decoder import DeepStack, TextDecoder
from jaxvrl.models.families import family_of
from jaxvrl.models.layers import linear, remat
from jaxvrl.models.moe import SparseMoE
from jaxvrl.models.patches import VisionInputs


@struct.dataclass
class ModelOutput:
    """logits: float32[B, T, V] (None if not asked); hidden: [B, T, D] final-norm states;
    cache: the updated KV cache or None; vision_mass / text_mass: float32[L, B, T] or None;
    router_logits: the sparse layers' router logits [L', N, E] where the pass asked for them
    (`forward(router_logits=True)`), else None; routes: their routers' own top k int32
    [L', N, k] (`forward(record_routes=True)`), else None; route_mismatch: bool[L', N] where
    that top k differs from the given `routes`' (`forward(routes=...)`), else None;
    expert_dropped: float32[L'], each sparse layer's share of (token, expert) pairs its
    expert-parallel dispatch left out (`moe.expert_parallel`), where routing was asked for
    on an expert mesh axis, else None."""

    logits: jax.Array | None
    hidden: jax.Array
    cache: Any = None
    vision_mass: jax.Array | None = None
    text_mass: jax.Array | None = None
    router_logits: jax.Array | None = None
    routes: jax.Array | None = None
    route_mismatch: jax.Array | None = None
    expert_dropped: jax.Array | None = None

    @classmethod
    def of(cls, logits, hidden, cache, stats, per_key: bool) -> ModelOutput:
        """From the text decoder's outputs: stats is None, (A_V, A_X), or with per_key (the
        pass was given key_queries) the per-key masses, returned in vision_mass."""
        if stats is None or per_key:
            return cls(logits, hidden, cache, stats)
        return cls(logits, hidden, cache, stats[0], stats[1])


def _slots(inputs: VisionInputs, is_pad: jax.Array, count: int) -> jax.Array:
    """int32[B, T]: for each pad token, the encoder output it takes (the k-th pad of a row,
    or of the batch when packed, takes the processor's k-th merged token): per row, its
    index in the row's window-order outputs [U]; packed, its row of the flattened outputs
    [count, D]."""
    reverse = jnp.asarray(inputs.reverse_index)
    if inputs.pixel_values.ndim == 3:  # per row: [B, U] outputs
        units = reverse.shape[1]
        rank = jnp.clip(jnp.cumsum(is_pad, axis=1) - 1, 0, units - 1)
        return jnp.take_along_axis(reverse, rank, axis=1)
    rank = jnp.cumsum(is_pad.reshape(-1)).reshape(is_pad.shape) - 1
    return reverse[jnp.clip(rank, 0, count - 1)]


def _place(feats: jax.Array, slot: jax.Array, rows: bool) -> jax.Array:
    """[..., B, T, D]: the encoder outputs `_slots` names, from feats [..., B, U, D] (per row:
    a gather within each row, which stays on the devices holding the row) or [..., U, D]
    (packed)."""
    if rows:
        index = slot.reshape((1,) * (feats.ndim - 3) + slot.shape + (1,))
        return jnp.take_along_axis(feats, index, axis=-2)
    return feats[..., slot, :]


class Model(nnx.Module):
    """Built from a family's config: `Model(cfg, dtype=, param_dtype=, rngs=, remat_policy=,
    attention=, scan_layers=)`; see `jaxvrl.models.interface.Model` for what it offers."""

    def __init__(
        self,
        cfg,
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
        encoder = family_of(cfg).encoder
        self.visual = (
            None if encoder is None else encoder(cfg.vision, scan_layers=scan_layers, **kw)
        )
        self.model = TextDecoder(cfg.text, scan_layers=scan_layers, **kw)
        if self._labels:
            self.score = linear(cfg.text.hidden_size, self._labels, bias=False, **kw)
        elif not cfg.tie_word_embeddings:
            self.lm_head = linear(cfg.text.hidden_size, cfg.text.vocab_size, bias=False, **kw)
        self.set_remat_policy(remat_policy)
        self.set_attention(attention)

    @property
    def position_rank(self) -> int:
        """The rank of the family's positions: 2 (int[B, T], RoPE) or 3 (int[3, B, T],
        M-RoPE); `positions.continue_positions(model.position_rank, start, n)` continues
        them while decoding."""
        return 3 if self.config.text.mrope_section else 2

    @property
    def _labels(self) -> int | None:
        return getattr(self.config, "num_labels", None)

    @property
    def _towers(self) -> tuple[nnx.Module, ...]:
        return (self.model,) if self.visual is None else (self.model, self.visual)

    def set_remat_policy(self, policy: str) -> None:
        """Gradient checkpointing of every decoder layer and vision block: none | full |
        dots_saveable | dots_with_no_batch_dims_saveable (config `model.remat_policy`).
        Part of the graphdef, so set it before `nnx.split`."""
        remat(lambda: None, policy)  # validates the name
        for tower in self._towers:
            tower.remat_policy = policy

    def set_dtype(self, dtype) -> None:
        """The compute dtype of every layer (the sampler's `rollout.dtype`); the parameters
        keep theirs, cast where they are used. Part of the graphdef, so set it before
        `nnx.split`."""
        dtype = jnp.dtype(dtype)
        for _, node in nnx.iter_graph(self):
            if isinstance(node, nnx.Module) and "dtype" in vars(node):
                node.dtype = dtype

    def set_expert_capacity(self, capacity: float) -> None:
        """How many (token, expert) pairs each device sends each other device on an expert
        mesh axis, as a multiple of its pairs / the axis's size (config
        `model.expert_capacity`; 0: all its pairs, none dropped; see `moe.expert_parallel`).
        Part of the graphdef, so set it before `nnx.split`."""
        if capacity < 0:
            raise ValueError(f"expert capacity must be >= 0, got {capacity}")
        for _, node in nnx.iter_graph(self):
            if isinstance(node, SparseMoE):
                node.capacity = float(capacity)

    @property
    def expert_capacity(self) -> float:
        """The sparse layers' `set_expert_capacity` (0.0 for a model without experts)."""
        return next((n.capacity for _, n in nnx.iter_graph(self) if isinstance(n, SparseMoE)), 0.0)

    def set_attention(self, name: str, block: int = 512) -> None:
        """The attention implementation of the decoder's and the vision encoder's forward
        passes (config `model.attention`): auto | xla | flash | splash | cudnn, see
        `jaxvrl.models.attention`. "auto" is resolved when a program is traced, for the
        platform of the devices it is compiled for: splash on TPUs, flash on GPUs, xla on the
        CPU. The vision tower's window blocks run the banded dense form with any but xla, its
        full-attention blocks flash in place of cudnn (see `vision.py`); so does the sampler's
        prefill (into an empty cache), while decode steps attend over the cache in its dense
        form. block: the query and
        key block size of flash and splash (splash rounds it up to a multiple of 128). Part
        of the graphdef, so set it before `nnx.split`."""
        resolve(name, "cpu")  # validates the name
        if block < 1:
            raise ValueError(f"attention block size must be positive, got {block}")
        for tower in self._towers:
            tower.attention = name
            tower.attention_block = int(block)

    # ------------------------------------------------------------------ traceable core
    def embed(
        self, input_ids, images: VisionInputs | None = None, videos: VisionInputs | None = None
    ) -> tuple[jax.Array, DeepStack | None]:
        """Token embeddings [B, T, D] with image/video pad tokens replaced by the encoder's
        merged outputs, in order, and the DeepStack levels of the same tokens (None without
        vision inputs or DeepStack).

        Packed inputs (pixel_values [N, C*T*P*P]): the k-th pad token of the batch takes the
        k-th merged patch. Per-row inputs (pixel_values [B, N, C*T*P*P], every VisionInputs
        field with a leading batch axis): row b's k-th pad token takes row b's k-th merged
        patch; the encoder runs per row, so attention costs B*N^2 rather than (B*N)^2 and
        rows can be split into micro-batches."""
        cfg = self.config
        x = self.model.embed_tokens(input_ids)
        media = [(m, t) for m, t in ((images, "image"), (videos, "video")) if m is not None]
        if media and self.visual is None:
            raise ValueError(f"{cfg.architecture} takes no images or videos")
        levels = None
        for inputs, kind in media:
            is_pad = input_ids == getattr(cfg, f"{kind}_token_id")
            # the encoder's features in window order; the k-th pad takes the processor's
            # k-th, found through reverse_index: one gather (and one backward scatter)
            feats, deep = self.visual.features(inputs)  # [(B,) U, D], window order
            rows = inputs.pixel_values.ndim == 3
            slot = _slots(inputs, is_pad, feats.shape[-2])
            x = jnp.where(is_pad[..., None], _place(feats, slot, rows).astype(x.dtype), x)
            if deep is not None:  # the DeepStack levels at the same tokens: [K, B, T, D]
                deep = _place(deep, slot, rows).astype(x.dtype)
                placed = jnp.where(is_pad[..., None], deep, jnp.zeros((), x.dtype))
                levels = placed if levels is None else jnp.where(is_pad[..., None], deep, levels)
        if levels is None:
            return x, None
        return x, DeepStack(levels)

    @property
    def head(self) -> nnx.Module:
        """The vocabulary projection: `lm_head`, or the token embedding when tied; a
        classifier's `score`."""
        if self._labels:
            return self.score
        return self.model.embed_tokens if self._tied else self.lm_head

    @property
    def _tied(self) -> bool:
        return self.config.tie_word_embeddings and not self._labels

    def logits(self, hidden: jax.Array, head: nnx.Module | None = None) -> jax.Array:
        """float32[..., V] (a classifier: [..., num_labels]) from final hidden states, through
        `head` (default `self.head`; a copy of it, e.g. gathered once outside a loop over
        token chunks)."""
        head = self.head if head is None else head
        out = head.attend(hidden) if self._tied else head(hidden)
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
        step=None,
        key_queries=None,
        packing=None,
        router_logits: bool = False,
        routes=None,
        replay_routes: bool = False,
        record_routes: bool = False,
    ) -> ModelOutput:
        """input_ids int[B, T]; attention_mask int[B, T]; position_ids: the family's
        positions of the tokens (`Family.rope_index`: int[B, T] for RoPE, int[3, B, T] for
        M-RoPE). Vision inputs add their DeepStack levels after the first decoder layers
        where the family has them (forward passes and prefills alike; decode steps have no
        vision inputs).

        pools: optional {"vision", "text", "prompt"} bool[B, S] key masks (S = T, or the cache
        length with a cache) to return per-layer attention masses (see `attention_pools`).
        step: a decode step's hook, which chooses the cached attention's implementation and
        may run views of the text layers with their projections replaced (see
        `TextDecoder.__call__`), or None. key_queries: None, or bool[B, T]
        (no cache, no pools): a diagnostic pass whose `vision_mass` is then float32[L, B, T],
        each key's attention mass from those queries (heads-averaged probabilities summed
        over the queries, per layer), and text_mass None. packing: None, or a `Packing` of
        the rows (no cache): the decoder runs on its packed buffers, and hidden [K, T', D] and
        the masses [L, K, T'] come back packed (`Packing.take` reads them per row).
        router_logits (no cache): the output also carries the sparse layers' router logits
        [L', N, E] over the decoder's tokens (N = B * T, or the packed slots). record_routes:
        it carries their routes (each router's own top k). routes (no cache): a recorded
        selection int[B, T, L', k] (a rollout's); the output carries where the routers
        would choose otherwise, and with replay_routes the sparse layers route by it
        (`TextDecoder.__call__`).
        """
        x, deepstack = self.embed(input_ids, images, videos)
        hidden, cache, stats, *router = self.model(
            x,
            position_ids,
            attention_mask,
            cache=cache,
            pools=pools,
            step=step,
            deepstack=deepstack,
            key_queries=key_queries,
            packing=packing,
            router_logits=router_logits,
            routes=routes,
            replay_routes=replay_routes,
            record_routes=record_routes,
        )
        logits = self.logits(hidden) if return_logits else None
        out = ModelOutput.of(logits, hidden, cache, stats, key_queries is not None)
        if not router:
            return out
        got = router[0]
        return out.replace(
            router_logits=got.get("logits"),
            routes=got.get("experts"),
            route_mismatch=got.get("mismatch"),
            expert_dropped=got.get("dropped"),
        )

    def classify(
        self, input_ids, attention_mask, position_ids, pad_token_id: int | None = None
    ) -> jax.Array:
        """A sequence classifier's logits float32[B, num_labels] at each row's last real token
        (the last attention_mask 1: left or right padding) that is not `pad_token_id`, as
        transformers reads them (a text ending in the pad token, e.g. an EOS that pads, is
        read before it); a row of pad tokens only at its last real token."""
        out = self.forward(input_ids, attention_mask, position_ids, return_logits=False)
        t = jnp.arange(input_ids.shape[1])
        real = attention_mask > 0
        if pad_token_id is not None:
            kept = real & (input_ids != pad_token_id)
            real = jnp.where(kept.any(axis=1, keepdims=True), kept, real)
        last = jnp.argmax(jnp.where(real, t, -1), axis=1)  # [B]
        hidden = jnp.take_along_axis(out.hidden, last[:, None, None], axis=1)[:, 0]  # [B, D]
        return self.logits(hidden)

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
        """Forward on host arrays (numpy or concrete jax); left- or right-padded batches."""
        family = family_of(self.config)
        if self.visual is None and (pixel_values is not None or pixel_values_videos is not None):
            raise ValueError(f"{self.config.architecture} takes no images or videos")
        input_ids = np.asarray(input_ids)
        if attention_mask is None:
            attention_mask = np.ones_like(input_ids)
        attention_mask = np.asarray(attention_mask)
        if position_ids is None:
            position_ids, _ = family.rope_index(
                input_ids,
                attention_mask,
                self.config,
                image_grid_thw,
                video_grid_thw,
                second_per_grid_ts,
            )
        media = {}
        for name, pv, grid in (
            ("images", pixel_values, image_grid_thw),
            ("videos", pixel_values_videos, video_grid_thw),
        ):
            if pv is not None:
                vi = family.vision_inputs(pv, grid, self.config.vision)
                media[name] = jax.tree.map(jnp.asarray, vi)
        return self.forward(
            jnp.asarray(input_ids),
            jnp.asarray(attention_mask),
            jnp.asarray(position_ids),
            pools=None if pools is None else {k: jnp.asarray(v) for k, v in pools.items()},
            **media,
        )
