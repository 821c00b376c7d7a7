"""The text decoder every family shares: GQA (q/k/v and o biases, per-head q/k RMSNorm and a
sliding window where the config asks), RoPE over positions int[B, T] or 3-D M-RoPE over
int[3, B, T] (in sections, or interleaved), RMSNorm, gated MLP, KV cache, and DeepStack
(vision features added after the first layers, Qwen3-VL).

The decoder can also return attention statistics: for every layer and query position, the
heads-averaged attention mass on a vision pool and a text pool of keys
(docs/algorithms.md#attention-statistics). They are reduced inside each layer, so no
[L, heads, T, S] tensor outlives its layer.

Two attention paths, each behind its own function. Without a cache (training forward passes,
scoring) every layer calls `jaxvrl.models.attention.attend` with the decoder's implementation
(`attention`: auto | xla | flash | splash | cudnn), key validity from the attention mask and
causality by index, so no [B, T, S] mask is built and the blocked implementations never hold
a [T, S] block of logits. A prefill into an empty cache (`KVCache.init`) runs the same way,
its keys and values written into the cache after the layers (`KVCache.filled`): blocked
kernels and the sequence split serve prefills too. With a written cache (the sampler's decode
steps) the layer writes its keys and values into the cache and attends over it through
`jaxvrl.models.cached_attention.attend_cache`, under one bool[B, T, S] mask per call: "dense"
by default, or the implementation of the caller's decode-step hook (`step`, see
`TextDecoder.__call__`), which may also run a view of each layer with its projections
replaced. The layers themselves take no hook.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from jaxvrl.models.attention import attend, attend_key_masses
from jaxvrl.models.cache import KEY_ORDER, KVCache, PagedKVCache, PagedLayer
from jaxvrl.models.cached_attention import attend_cache
from jaxvrl.models.config import TextConfig
from jaxvrl.models.layers import (
    RMSNorm,
    apply_rope,
    attention_implementation,
    layer_at,
    linear,
    remat,
    rope_inv_freq,
    scan_layers,
    stacked,
)
from jaxvrl.models.moe import SparseMoE, feed_forward, scanned_layer_kind, sparse_layers
from jaxvrl.models.packing import Packing
from jaxvrl.parallel.sharding import constrain

# the layer keywords that ask for a fourth output, the routing dict
ROUTING = {"router", "experts", "replay"}
# logical axes of the residual stream [B, T, D]
RESIDUAL = ("batch", "length", "act_embed")


def mrope_axes(cfg: TextConfig) -> np.ndarray:
    """The position axis (0 temporal, 1 height, 2 width) of each of the head_dim / 2 rotary
    frequencies: in sections of mrope_section (the last section running on where they sum to
    less), or interleaved (Qwen3-VL: frequency i takes height where i % 3 == 1 and i < 3 *
    section[1], width where i % 3 == 2 and i < 3 * section[2], else time)."""
    half = cfg.head_dim // 2
    if cfg.mrope_interleaved:
        axis = np.zeros(half, np.int64)
        for a in (1, 2):
            axis[a : 3 * cfg.mrope_section[a] : 3] = a
        return axis
    axis = np.repeat(np.arange(len(cfg.mrope_section)), cfg.mrope_section)[:half]
    return np.pad(axis, (0, half - len(axis)), mode="edge")


def rope_cos_sin(position_ids: jax.Array, cfg: TextConfig, dtype):
    """cos, sin: [B, T, head_dim] from the family's positions: int[B, T] for RoPE
    (mrope_section ()), int[3, B, T] (temporal, height, width) for M-RoPE.

    With M-RoPE, frequency i takes its position from axis `mrope_axes(cfg)[i]`. Each run of
    frequencies on one axis is a static slice times that axis's positions, and interleaved
    axes a sum of the three axes' products under static 0/1 masks: no gather over the three
    axes, which the TPU compiler spent seconds of a 7B step's compile on.
    """
    rank = 3 if cfg.mrope_section else 2
    if position_ids.ndim != rank:
        kind = "int[3, B, T] (M-RoPE)" if cfg.mrope_section else "int[B, T] (RoPE)"
        raise ValueError(f"positions must be {kind}, got shape {position_ids.shape}")
    inv_freq = rope_inv_freq(cfg, position_ids)
    pos = position_ids.astype(jnp.float32)
    if not cfg.mrope_section:
        freqs = pos[..., None] * inv_freq  # [B, T, hd/2]
    elif cfg.mrope_interleaved:  # the masked products are exact: x * 0 = 0, x + 0 = x
        axis = mrope_axes(cfg)
        freqs = sum(pos[a][..., None] * jnp.where(axis == a, inv_freq, 0.0) for a in range(3))
    else:
        axis = mrope_axes(cfg)
        runs = np.flatnonzero(np.diff(axis, prepend=-1, append=-1))  # where the axis changes
        freqs = jnp.concatenate(
            [pos[axis[a]][..., None] * inv_freq[a:b] for a, b in zip(runs[:-1], runs[1:])],
            axis=-1,
        )  # [B, T, hd/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    if cfg.rope_attention_factor != 1.0:  # YaRN's scale, on cos and sin as transformers has it
        cos, sin = cos * cfg.rope_attention_factor, sin * cfg.rope_attention_factor
    return cos.astype(dtype), sin.astype(dtype)


@struct.dataclass
class DeepStack:
    """Vision features added to the residual stream after the first K decoder layers
    (Qwen3-VL's DeepStack): after layer k < K, the stream gains `features[k]`.

    features: [K, B, T, D], each level's merged vision tokens at their image and video pad
    tokens and zeros elsewhere, laid out like the residual stream (`Model.embed` places them
    once per forward pass: no gather inside the layers, and in the scan no branch).
    """

    features: jax.Array

    @property
    def levels(self) -> int:
        return self.features.shape[0]

    def add(self, x: jax.Array, k) -> jax.Array:
        """x [B, T, D] plus level k's features (k may be traced)."""
        return x + self.features[k].astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: TextConfig, *, dtype, param_dtype, rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        d, hd, bias = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.q_proj = linear(d, cfg.num_attention_heads * hd, bias=bias, **kw)
        self.k_proj = linear(d, cfg.num_key_value_heads * hd, bias=bias, **kw)
        self.v_proj = linear(d, cfg.num_key_value_heads * hd, bias=bias, **kw)
        self.o_proj = linear(cfg.num_attention_heads * hd, d, bias=cfg.output_bias, **kw)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, param_dtype=param_dtype)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.n_heads, self.n_kv, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            hd,
        )
        self.sliding = cfg.sliding_window

    def project(self, x):
        """q [B, T, N*H], k and v [B, T, K*H] (a decode step's view may fuse the three)."""
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def __call__(
        self,
        x,
        cos,
        sin,
        mask,
        kv=None,
        pools=None,
        *,
        implementation="xla",
        block=512,
        queries=None,
        segmented=False,
        last_query=False,
    ):
        """x: [B, T, D]; kv: None, (k_cache, v_cache, index, key_layout) to write the new keys
        at `index` and attend over the whole cache (see KVCache), or a `PagedLayer` (each row
        writes at its own slot and attends over its pages); mask: without kv, bool[B, T] key
        validity (the T tokens attend causally to each other), with kv, bool[B, T, S] which
        cached keys each query sees; implementation: without kv the `attend` implementation
        (block: its block size, queries and keys), with kv the `attend_cache` one (a name or
        a callable); queries: None, or bool[B, T] (without kv):
        stats are then the keys' attention masses from those queries, float32[B, T]
        (`attend_key_masses`); segmented: without kv, `mask` is int32[B, T] segment ids of
        packed rows (0: an empty slot), and queries see only keys of their own segment;
        last_query: without kv, with pools, the pool masses of each row's last query only
        (stats [B, 1]: what a prefill keeps), by one query's dense attention beside the
        implementation's. Returns (out, (k, v), stats); k, v are the updated caches when kv
        is given."""
        b, t, _ = x.shape
        q, k, v = self.project(x)
        if kv is not None and t == 1:
            # A decode step: the projections keep their own [B, 1, N*H] layout. Left to
            # fuse with the attention, XLA's TPU compiler asked for q_proj's weight in a
            # heads-major layout and copied the whole weight at every step (measured in
            # docs/scaling.md, "Rollouts").
            q, k, v = jax.lax.optimization_barrier((q, k, v))
        q = q.reshape(b, t, self.n_heads, self.head_dim)
        k = k.reshape(b, t, self.n_kv, self.head_dim)
        v = v.reshape(b, t, self.n_kv, self.head_dim)
        if self.qk_norm:  # per head, before the rotary
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q = constrain(q, ("batch", "length", "heads", None))
        scale = self.head_dim**-0.5
        if kv is None and queries is not None:  # a diagnostic pass: where the queries look
            out, stats = attend_key_masses(
                q, k, v, scale=scale, key_valid=mask, queries=queries,
                implementation=implementation, block=block, sliding=self.sliding,
            )  # fmt: skip
            return self.o_proj(out.reshape(b, t, -1)), (k, v), stats
        if kv is None:
            valid = mask > 0 if segmented else mask
            segments = dict(q_segments=mask, k_segments=mask) if segmented else {}
            pos = jnp.arange(t)
            if self.sliding:  # a token's position: the valid tokens before it
                pos = jnp.cumsum(valid, axis=1, dtype=jnp.int32) - 1
                segments.update(q_positions=pos, k_positions=pos, sliding=self.sliding)
            last = last_query and pools is not None and not segmented
            out, stats = attend(
                q,
                k,
                v,
                scale=scale,
                key_valid=valid,
                **segments,
                causal=True,
                pools=None if last else pools,
                implementation=implementation,
                block_q=block,
                block_k=block,
            )
            if last:  # the last query's masses: one query over every key, densely
                _, stats = attend(
                    q[:, -1:], k, v, scale=scale, key_valid=valid, q_positions=pos[..., -1:],
                    k_positions=pos, causal=True, pools=pools, sliding=self.sliding,
                )  # fmt: skip
            return self.o_proj(out.reshape(b, t, -1)), (k, v), stats
        g = self.n_heads // self.n_kv
        qg = q.reshape(b, t, self.n_kv, g, self.head_dim)
        if isinstance(kv, PagedLayer):  # each row writes at its own slot, reads its pages
            kv = kv.store(k, v)
            new_kv, table, key_layout = (kv.k, kv.v), kv.table, kv.key_layout
        else:
            k_cache, v_cache, index, key_layout = kv
            k = _write(k_cache, k, index, key_layout)  # [B, K, H, S] or [B, K, S, H]
            new_kv, table = (k, _write(v_cache, v, index, "BKSH")), None  # v [B, K, S, H]
        out, stats = attend_cache(
            qg, *new_kv, mask, scale=scale, dtype=x.dtype, pools=pools, table=table,
            implementation=implementation, key_layout=key_layout,
        )  # fmt: skip
        return self.o_proj(out.reshape(b, t, -1)), new_kv, stats


def _write(cache: jax.Array, new: jax.Array, index, layout: str) -> jax.Array:
    """`cache` (a layer's keys or values in `layout`, `KEY_ORDER`) with new [B, T, K, H]
    written at slots [index, index + T)."""
    order = KEY_ORDER[layout]
    at = [0, 0, 0, 0]
    at[order.index(1)] = index  # where the slots axis lies
    return jax.lax.dynamic_update_slice(cache, new.transpose(order).astype(cache.dtype), at)


class DecoderLayer(nnx.Module):
    """sparse: the feed-forward is the mixture-of-experts block (`moe.feed_forward`).

    Routing (sparse layers): `router` (the router logits [B*T, E]), `experts` (the router's
    own top-k int32[B*T, k]) ask for a fourth output, a dict of those; `given` int[B*T, k]
    (a recorded selection) adds "mismatch" bool[B*T] to it (`SparseMoE.apply`), and
    `replay` routes by `given`. A dense layer's fourth output is {}."""

    def __init__(self, cfg: TextConfig, *, dtype, param_dtype, rngs, sparse: bool = False):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.post_attention_layernorm = RMSNorm(
            cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype
        )
        self.self_attn = Attention(cfg, **kw)
        self.mlp = feed_forward(cfg, sparse, **kw)

    def __call__(
        self,
        x,
        cos,
        sin,
        mask,
        kv=None,
        pools=None,
        given=None,
        *,
        implementation="xla",
        block=512,
        queries=None,
        segmented=False,
        router=False,
        experts=False,
        replay=False,
        last_query=False,
    ):
        x_in = self.input_layernorm(x)
        kw = dict(implementation=implementation, block=block, queries=queries, segmented=segmented)
        if last_query:
            kw["last_query"] = True
        h, new_kv, stats = self.self_attn(x_in, cos, sin, mask, kv, pools, **kw)
        x = x + h
        routing = router or experts or given is not None
        if isinstance(self.mlp, SparseMoE):
            # the real tokens (a key mask or segment ids [B, T]; a cache's [B, T, S]: all)
            valid = mask > 0 if mask is not None and mask.ndim == 2 else None
            y = self.post_attention_layernorm(x)
            h, aux = self.mlp.apply(y, given, replay=replay, valid=valid)
            if not routing:
                return constrain(x + h, RESIDUAL), new_kv, stats
            wanted = {"logits": router, "experts": experts, "mismatch": given is not None,
                      "dropped": True}  # fmt: skip
            aux = {k: v for k, v in aux.items() if wanted[k]}
            return constrain(x + h, RESIDUAL), new_kv, stats, aux
        x = x + self.mlp(self.post_attention_layernorm(x))
        if routing:
            return constrain(x, RESIDUAL), new_kv, stats, {}
        return constrain(x, RESIDUAL), new_kv, stats


class TextDecoder(nnx.Module):
    """Embedding, decoder layers and final norm.

    scan_layers: the layers are one `DecoderLayer` whose parameters have a leading layer axis
    [L, ...] (`layers.stacked`), run by a scan (`layers.scan_layers`) so the layer program
    is traced and compiled once; else `nnx.List` of L layers run by a Python loop (the
    reference: the same arithmetic, unrolled).
    """

    def __init__(self, cfg: TextConfig, *, dtype, param_dtype, rngs, scan_layers: bool = True):
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        self.cfg = cfg
        self.embed_tokens = nnx.Embed(
            cfg.vocab_size,
            cfg.hidden_size,
            dtype=dtype,
            param_dtype=param_dtype,
            embedding_init=nnx.initializers.normal(0.02),
            rngs=rngs,
        )
        n = cfg.num_hidden_layers
        if scan_layers:
            sparse = scanned_layer_kind(cfg)
            self.layers = stacked(lambda r: DecoderLayer(cfg, rngs=r, sparse=sparse, **kw), n, rngs)
        else:
            self.layers = nnx.List(
                [DecoderLayer(cfg, rngs=rngs, sparse=s, **kw) for s in sparse_layers(cfg)]
            )
        self.scan_layers = scan_layers
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.dtype = dtype
        self.remat_policy = "none"  # see Model.set_remat_policy
        self.attention = "auto"  # see Model.set_attention
        self.attention_block = 512

    def layer(self, i: int) -> DecoderLayer:
        """Layer i (with scan_layers a view on the i-th slice of the stacked parameters)."""
        return layer_at(self.layers, i) if self.scan_layers else self.layers[i]

    def __call__(
        self,
        x,
        position_ids,
        attention_mask,
        cache: KVCache | None = None,
        pools=None,
        step=None,
        deepstack: DeepStack | None = None,
        key_queries=None,
        packing: Packing | None = None,
        router_logits: bool = False,
        routes=None,
        replay_routes: bool = False,
        record_routes: bool = False,
    ):
        """x: input embeddings [B, T, D]; position_ids the family's positions (int[B, T] or int[3, B, T]); attention_mask [B, T];
        deepstack: vision features added after the first layers (prompts with vision tokens:
        forward passes and prefills), or None; key_queries: None, or bool[B, T] (no cache):
        stats are then where those queries attend, per layer and key, float32[L, B, T] (the
        heads-averaged probabilities summed over the queries), in place of (A_V, A_X).

        Without a cache, queries attend causally over the T given tokens (through `attend`,
        with the decoder's `attention` implementation); so do the T tokens of a prefill into an
        empty cache (`KVCache.empty`), whose keys and values are then written at slots [0, T).
        With a written cache, the T tokens are written at `cache.index` and attend over every
        valid cached key up to their own slot (through `attend_cache`). Returns (hidden [B, T, D], new cache or None, stats or None) where
        stats is (A_V, A_X), each float32[L, B, T].

        With scan_layers the layers run as a scan, over a stacked cache when there is one; a
        per-layer (tuple) cache, and a `step` hook, run a Python loop over the layers instead
        (the CPU decode steps, see KVCache).

        step: None, or a decode step's hook (the sampler's CPU forms, which live there, not
        here), applied in this one place: `step.attention` is the `attend_cache`
        implementation of the cached attention (a name or a callable), and
        `step.layer(i, layer)` the layer to run as layer i: `layer` itself, or a view of it
        whose projections (`Attention.project`, `o_proj`, `GatedMLP.gate_up`, `down_proj`)
        are replaced, e.g. by packed weights. The layers' own signatures take no hook.

        packing: None, or a `Packing` of the B rows (no cache, no key_queries): the real tokens
        run packed into its K buffers [K, T'] with their own positions, pools and DeepStack
        slots, attention inside each row's segment; hidden [K, T', D] and stats [L, K, T']
        come back packed (`Packing.take` reads them per row).

        Routing (models with sparse mixture-of-experts layers; L' of them): router_logits (no
        cache), record_routes (with or without a cache) and routes (no cache: a recorded
        selection int[B, T, L', k], packed with the rows) ask for a fourth output, a dict of
        [L', N, ...] arrays (N = B * T, or the packed slots; {} where no layer is sparse):
        "logits" the router logits [L', N, E], "experts" each router's own top k int32
        [L', N, k], with routes "mismatch" bool[L', N] (that top k differs from the given
        one, as sets), and on an expert mesh axis "dropped" float32[L'] (`moe.expert_parallel`). replay_routes: the sparse layers route by `routes` (their
        experts, the live router's weights). Without these no routing leaves the layers.
        """
        segmented = packing is not None
        if segmented:
            if cache is not None or key_queries is not None:
                raise ValueError("packed rows run without a cache or key_queries")
            x = packing.pack(x)
            position_ids = packing.pack(position_ids, axis=position_ids.ndim - 2)
            pools = None if pools is None else {k: packing.pack(v) for k, v in pools.items()}
            if deepstack is not None:
                deepstack = deepstack.replace(features=packing.pack(deepstack.features, axis=1))
            attention_mask = packing.segments
            routes = None if routes is None else packing.pack(routes)
        if routes is not None:  # [B, T, L', k] -> [L', N, k]
            routes = jnp.moveaxis(routes.reshape((-1,) + routes.shape[2:]), 1, 0)
        elif replay_routes:
            raise ValueError("replay_routes needs the routes to replay")
        t = x.shape[1]
        cos, sin = rope_cos_sin(position_ids, self.cfg, self.dtype)
        valid = attention_mask.astype(bool)
        x = constrain(x, RESIDUAL)
        extra = {} if key_queries is None else {"queries": jnp.asarray(key_queries, bool)}
        if segmented:
            extra["segmented"] = True
        if router_logits:
            extra["router"] = True
        if routes is not None:
            extra["replay"] = replay_routes
        if extra and cache is not None:
            names = {"queries": "key_queries", "segmented": "segmented", "router": "router_logits",
                     "replay": "routes"}  # fmt: skip
            asked = ", ".join(v for k, v in names.items() if k in extra)
            raise ValueError(f"{asked}: only for a forward pass without a cache")
        if record_routes:
            extra["experts"] = True
        # a prefill into an empty cache runs as a forward pass; its keys and values are
        # written into the cache after the layers (`KVCache.filled`)
        fill = isinstance(cache, KVCache) and cache.empty and step is None
        if fill and pools is not None:  # a prefill's masses: its rows' last queries' only
            extra["last_query"] = True
        if cache is None or fill:
            implementation = attention_implementation(self.attention)
        else:
            implementation = "dense" if step is None else step.attention
        layer_call = functools.partial(
            DecoderLayer.__call__,
            implementation=implementation,
            block=self.attention_block,
            **extra,
        )
        if isinstance(cache, PagedKVCache):
            if deepstack is not None:
                raise ValueError("a paged cache runs decode steps, which have no vision tokens")
            return self._paged(layer_call, x, cos, sin, valid, cache, pools, step)
        run = None if fill else cache  # the cache the layers attend over
        if run is None:
            # key validity [B, T] (or the segment ids); `attend` adds causality block by block
            mask = attention_mask if segmented else valid
            if fill and pools is not None:  # the keys are the T tokens, slots [0, T)
                pools = {k: v[:, :t] for k, v in pools.items()}
        else:
            key_mask = jax.lax.dynamic_update_slice(cache.key_mask, valid, (0, cache.index))
            q_pos = cache.index + jnp.arange(t)
            k_pos = jnp.arange(cache.key_mask.shape[1])
            mask = (k_pos[None, :] <= q_pos[:, None])[None] & key_mask[:, None, :]
            mask = self._window(mask, key_mask, q_pos[None])
        scanned = self.scan_layers and step is None and (run is None or run.stacked)
        args = (layer_call, x, cos, sin, mask, run, pools)
        if scanned:
            x, kv, stats, *router = self._scan(*args, deepstack, routes, keep=fill)
        else:
            x, kv, stats, *router = self._loop(*args, step, deepstack, routes, keep=fill)
        x = self.norm(x)
        if fill:
            new_cache = cache.filled(*kv, valid)
        elif cache is None:
            new_cache = None
        else:
            k, v = kv
            new_cache = cache.replace(
                k=k, v=v, key_mask=key_mask, index=cache.index + t, empty=False
            )
        return (x, new_cache, stats, *router)

    def _window(self, mask, key_mask, q_slot):
        """With a sliding window, mask bool[B, T, S] (queries at cache slots q_slot int[B|1, T]
        over the slots of key_mask bool[B, S]) keeps only keys fewer than the window's
        positions back: a token's position is the number of valid keys before it, so gaps
        in the cache (padding, a prompt padded to whole pages) do not count."""
        w = self.cfg.sliding_window
        if not w:
            return mask
        rank = jnp.cumsum(key_mask, axis=1, dtype=jnp.int32)  # [B, S]
        q_rank = jnp.take_along_axis(
            rank, jnp.broadcast_to(q_slot, (rank.shape[0], q_slot.shape[1])), axis=1
        )
        return mask & (rank[:, None, :] > q_rank[:, :, None] - w)

    def _paged(self, layer_call, x, cos, sin, valid, cache: PagedKVCache, pools, step):
        """One decode step (T = 1) over a paged cache: each row's token is written at its
        own slot and attends over its valid keys (the slots before it hold only its past)."""
        b, t = x.shape[:2]
        if t != 1:
            raise ValueError(f"a paged cache takes one token per row, got {t}")
        keys = cache.valid.at[jnp.arange(b), cache.write].set(valid[:, 0])
        mask = self._window(keys[:, None, :], keys, cache.write[:, None])
        x, (ks, vs), stats, *router = self._loop(layer_call, x, cos, sin, mask, cache, pools, step)
        new = cache.replace(k=ks, v=vs, valid=keys, write=cache.write + 1)
        return self.norm(x), new, stats, *router

    def _scan(
        self, layer_call, x, cos, sin, mask, cache, pools, deepstack=None, routes=None, keep=False
    ):
        """The layers as one scan: remat inside the body, the stacked cache's layers as xs,
        the new caches (keep, without a cache: the layers' keys and values) and the
        statistics as ys. With DeepStack, each layer's index rides
        along as xs too, and every layer adds its level times 1 (layers below
        `deepstack.levels`) or 0 (the others: x + 0 = x exactly): one layer program and no
        branch (a `lax.cond` there was priced, and its collectives counted, at its costlier
        branch in every layer by the aot cost model)."""
        call = remat(layer_call, self.remat_policy, prevent_cse=False)
        if deepstack is not None:
            features = constrain(deepstack.features, (None, *RESIDUAL))

        def body(layer, x, xs):
            kv_xs, i, given = xs
            kv = None if cache is None else (*kv_xs, cache.index, cache.key_layout)
            x, kv, stats, *router = call(layer, x, cos, sin, mask, kv, pools, given)
            if deepstack is not None:
                level = features[jnp.minimum(i, deepstack.levels - 1)].astype(x.dtype)
                x = x + level * (i < deepstack.levels).astype(x.dtype)
            return x, (kv if cache is not None or keep else None, stats, *router)

        kv_xs = None if cache is None else (cache.k, cache.v)
        index = None if deepstack is None else jnp.arange(self.cfg.num_hidden_layers)
        if routes is not None and not routes.shape[0]:  # no sparse layer: nothing to route
            routes = None
        x, (kv, stats, *router) = scan_layers(self.layers, body, x, (kv_xs, index, routes))
        return (x, kv, stats, *router)  # routing (when asked) stacked [L, ...]

    def _loop(
        self, layer_call, x, cos, sin, mask, cache, pools, step, deepstack=None, routes=None,
        keep=False,
    ):  # fmt: skip
        """The layers one by one (unrolled), each as `step.layer` gives it where there is a
        hook; a stacked cache gives back a stacked one, a paged one its pages, keep (without
        a cache) the layers' keys and values."""
        call = remat(layer_call, self.remat_policy)
        ks, vs, all_stats, routers = [], [], [], []
        sparse = sparse_layers(self.cfg)
        for i in range(self.cfg.num_hidden_layers):
            layer = self.layer(i)
            kv = None if cache is None else cache.layer(i)
            given = routes[sum(sparse[:i])] if routes is not None and sparse[i] else None
            if step is None:
                x, (k, v), stats, *router = call(layer, x, cos, sin, mask, kv, pools, given)
            else:  # decode steps only: nothing to differentiate
                view = step.layer(i, layer)
                x, (k, v), stats, *router = layer_call(view, x, cos, sin, mask, kv, pools)
            routers += [r for r in router if r]  # the sparse layers'
            if deepstack is not None and i < deepstack.levels:
                x = deepstack.add(x, i)
            ks.append(k)
            vs.append(v)
            if stats is not None:
                all_stats.append(stats)
        kv = (tuple(ks), tuple(vs)) if keep else None
        if cache is not None:
            kv = (jnp.stack(ks), jnp.stack(vs)) if cache.stacked else (tuple(ks), tuple(vs))
        stats = jax.tree.map(lambda *s: jnp.stack(s), *all_stats) if all_stats else None
        if not ROUTING & set(layer_call.keywords):
            return x, kv, stats
        return x, kv, stats, jax.tree.map(lambda *r: jnp.stack(r), *routers) if routers else {}
