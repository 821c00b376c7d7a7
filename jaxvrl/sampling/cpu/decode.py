"""A decode step's CPU forms: the weights it multiplies by, and its cached attention.

A decode step multiplies one token per row by every weight of the text decoder and the LM
head. On XLA's CPU backend that is fastest with each weight held as rows [out, in] (the
matmul's row operand), or packed into the CPU kernel's panels (`kernels.rows_by_weight`),
with q/k/v and gate/up fused into one weight each. `DecodeWeights` holds those copies: an
explicit pytree that the sampler's caller prepares once per set of parameters
(`prepare`, jitted by `Sampler.decode_weights`) and keeps between calls, so the packed buffer
is reused rather than faulted in afresh.

`DecodeForms` is the decode step's hook that the model applies in one place (the `step`
argument of `Model.forward`, see `TextDecoder.__call__`); the layers take no argument for it.
Its `attention` is the CPU form of the cached attention, an implementation of
`jaxvrl.models.cached_attention.attend_cache` like the dense one; its `layer(i, layer)` gives
the decoder a view of layer i whose projections (`Attention.project`, `o_proj`,
`GatedMLP.gate_up`, `down_proj`) multiply by the decode weights. The view is a new module
over the same parameters: the model's own modules are never changed, and the layers run
their own code (norms, rotary, cache writes) around the replaced products.

Shapes: B rows, K key/value heads, G query heads per kv head, H head dim, S cache length.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from jaxvrl.models.layers import masked_softmax, pool_masses
from jaxvrl.sampling.cpu import kernels

# A decoder layer's fused weights (`_weights`) and what each replaces in a view of the layer:
# (its module, the attribute), called as the module calls its own.
_PROJECTIONS = {
    "qkv": ("self_attn", "project"),
    "o": ("self_attn", "o_proj"),
    "gate_up": ("mlp", "gate_up"),
    "down": ("mlp", "down_proj"),
}

# The product-and-reduce form is used up to this K: for a 151936-row LM head at B = 8 it beat
# the matmul at K = 128 and 256 and lost at 512 and 896 (bench/RESULTS.md, sampler section).
_PRODUCT_MAX_K = 384


def rows_by_weight(w_rows: jax.Array, x: jax.Array) -> jax.Array:
    """x [..., K] times w_rows [N, K] -> [..., N], in XLA (where the CPU kernel does not apply).

    For K <= _PRODUCT_MAX_K, sum_k w_rows[n, k] * x[m, k] as a product and a reduction over
    k, the middle axis of [N, K, M] (XLA's CPU backend runs it 1.2-1.4x faster than an M = B
    matmul); above it (w_rows @ x^T)^T. Either way a barrier keeps XLA from folding the
    transpose back into the computation, which on the CPU re-packs the whole weight every
    call (the matmul) or makes the reduction's output [M, N] (the product), both much slower.
    """
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[-1] <= _PRODUCT_MAX_K:
        y = jnp.sum(w_rows[:, :, None] * x2.T[None], axis=1)
    else:
        y = w_rows @ x2.T
    y = jax.lax.optimization_barrier(y).T
    return y.reshape(x.shape[:-1] + (w_rows.shape[0],))


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one (fused) weight of `DecodeWeights` lies: its outputs `n_out`, split into
    `sizes` (q, k, v or gate, up), its dtype (the products' output), and its offset in the
    packed buffer (packed weights)."""

    n_out: int
    sizes: tuple[int, ...]
    dtype: str
    offset: int = -1


@struct.dataclass
class DecodeWeights:
    """The decoder's weights for decode steps, by name ("3.qkv", "3.o", "3.gate_up",
    "3.down" for layer 3, "head"): packed into `buf` (float32[size], the CPU kernel's panels;
    `packed`) or as rows [out, in] in `rows`; fused biases in `bias`. A projection that is not
    a plain nnx.Linear (a LoRA or quantized layer) has no entry: the layer runs its own.
    `max_rows`: the most rows per call the kernel layout serves (0 for rows)."""

    buf: jax.Array | None
    rows: dict
    bias: dict
    slots: dict = struct.field(pytree_node=False)  # name -> Slot
    packed: bool = struct.field(pytree_node=False, default=False)

    def matmul(self, name: str, x: jax.Array):
        """The named weight's outputs for x [..., in]: one array, or a tuple of its parts."""
        slot = self.slots[name]
        dtype = jnp.dtype(slot.dtype)
        if self.packed:
            x2 = x.reshape(-1, x.shape[-1])
            y = kernels.rows_by_weight(self.buf, x2, slot.n_out, slot.offset)
            y = y.reshape(x.shape[:-1] + (slot.n_out,)).astype(dtype)
        else:
            y = rows_by_weight(self.rows[name], x.astype(dtype))
        if name in self.bias:
            y = y + self.bias[name]
        if len(slot.sizes) == 1:
            return y
        return tuple(jnp.split(y, np.cumsum(slot.sizes)[:-1], axis=-1))


def _plain(*mods) -> bool:
    return all(type(m) is nnx.Linear for m in mods)


def _fused(lins) -> tuple[jax.Array, jax.Array | None, tuple[int, ...]]:
    """(kernel [in, sum of outs], bias or None, outs) of nnx.Linear layers sharing an input."""
    dtype = lins[0].dtype or lins[0].kernel[...].dtype
    sizes = tuple(int(lin.kernel.shape[1]) for lin in lins)
    kernels_ = [lin.kernel[...].astype(dtype) for lin in lins]
    w = kernels_[0] if len(kernels_) == 1 else jnp.concatenate(kernels_, axis=1)
    bias = None
    if any(lin.bias is not None for lin in lins):
        parts = [
            jnp.zeros((n,), dtype) if lin.bias is None else lin.bias[...]
            for lin, n in zip(lins, sizes)
        ]
        bias = jnp.concatenate(parts).astype(dtype)
    return w, bias, sizes


def _weights(model) -> dict:
    """name -> (weight, columns, bias, sizes): the fusable plain projections of the text
    decoder and the LM head (weight [in, out] with columns, else [out, in])."""
    out = {}
    for i in range(model.config.text.num_hidden_layers):
        layer = model.model.layer(i)  # scanned layers: layer i's slice of the stacked params
        a, m = layer.self_attn, layer.mlp
        groups = {
            "qkv": (a.q_proj, a.k_proj, a.v_proj),
            "o": (a.o_proj,),
            # a mixture-of-experts feed-forward (no gate_proj) runs its own code
            "gate_up": (getattr(m, "gate_proj", None), getattr(m, "up_proj", None)),
            "down": (getattr(m, "down_proj", None),),
        }
        for name, lins in groups.items():
            if _plain(*lins):
                w, bias, sizes = _fused(lins)
                out[f"{i}.{name}"] = (w, True, bias, sizes)
    if model.config.tie_word_embeddings:
        emb = model.model.embed_tokens
        table = emb.embedding[...].astype(emb.dtype or emb.embedding[...].dtype)
        out["head"] = (table, False, None, (int(table.shape[0]),))
    elif _plain(model.lm_head):
        w, _, sizes = _fused((model.lm_head,))
        out["head"] = (w, True, None, sizes)
    return out


def uses_kernel(rows: int, dtype) -> bool:
    """Whether decode weights for `rows` rows of `dtype` are packed for the CPU kernel."""
    return kernels.applies(rows, dtype or jnp.float32)


def prepare(model, rows: int, reuse: DecodeWeights | None = None) -> DecodeWeights:
    """`model`'s decode weights for calls of `rows` rows (traceable; jit it with `reuse`
    donated: its buffer is packed in place where the sizes agree)."""
    packed = uses_kernel(rows, model.dtype)
    weights = _weights(model)
    slots, rows_, bias = {}, {}, {}
    size = 0
    for name, (w, columns, b, sizes) in weights.items():
        k, n = w.shape if columns else w.shape[::-1]
        if packed:
            slots[name] = Slot(n, sizes, str(w.dtype), size)
            size += kernels.packed_size(n, k)
        else:
            slots[name] = Slot(n, sizes, str(w.dtype))
            rows_[name] = w.T if columns else w
        if b is not None:
            bias[name] = b
    buf = None
    if packed:
        old = None if reuse is None else reuse.buf
        buf = old if old is not None and old.shape == (size,) else kernels.empty(size)
        for name, (w, columns, _, _) in weights.items():
            buf = kernels.pack_into(buf, w, slots[name].offset, columns=columns)
    return DecodeWeights(buf, rows_, bias, slots, packed)


def attention(qg, k, v, mask, *, scale: float, pools, dtype):
    """A decode step's attention over the cache (an `attend_cache` implementation), the
    model's masked softmax: qg [B, 1, K, G, H], keys [B, K, H, S], values [B, K, S, H], mask
    bool[B, 1, S] -> (out [B, 1, K, G, H] in `dtype`, stats (A_V, A_X) float32[B, 1] or None).

    Without pools, in float32, the CPU kernel (`kernels.decode_attention`); otherwise
    products and reductions over a middle axis (in float32, like the matmuls'
    accumulation), which XLA's CPU backend runs about twice as fast as its batched M = G
    matmuls."""
    f32 = jnp.float32
    if pools is None and qg.dtype == f32 and k.dtype == f32 and kernels.usable():
        out = kernels.decode_attention(qg[:, 0], k, v, mask[:, 0], scale)  # [B, K, G, H]
        return out[:, None].astype(dtype), None
    q1 = qg[:, 0].astype(f32)  # [B, K, G, H]
    logits = jnp.sum(q1[..., None] * k.astype(f32)[:, :, None], axis=3)  # [B, K, G, S]
    logits = logits[:, :, :, None].astype(qg.dtype)  # [B, K, G, 1, S]
    probs = masked_softmax(logits * scale, mask[:, None, None])
    stats = pool_masses(probs, pools) if pools is not None else None
    pv, vv = probs.astype(dtype), v.astype(dtype)
    prod = pv[:, :, :, 0, :, None].astype(f32) * vv.astype(f32)[:, :, None]  # [B, K, G, S, H]
    return jnp.sum(prod, axis=3)[:, None].astype(dtype), stats


@dataclasses.dataclass(frozen=True)
class DecodeForms:
    """The CPU forms of a decode step, built inside the sampler's trace from explicit
    `weights` (None: the model's own matmuls) and, with `cpu_attention`, the CPU form of the
    cached attention (`attention`); the model takes it as its decode-step hook."""

    weights: DecodeWeights | None
    cpu_attention: bool = True  # the CPU form of the cached attention
    cached: str = "dense"  # else: the `attend_cache` implementation, by name

    @property
    def attention(self):
        """The cached attention's `attend_cache` implementation: the CPU form (looked up
        when traced; None switches it off) or `cached`."""
        cpu = attention if self.cpu_attention else None
        return self.cached if cpu is None else cpu

    def layer(self, i: int, layer):
        """Decoder layer i to run: `layer`, or a view of it whose plain projections multiply
        by the decode weights (fused q/k/v and gate/up; LoRA or quantized ones stay)."""
        w = self.weights
        names = [] if w is None else [n for n in _PROJECTIONS if f"{i}.{n}" in w.slots]
        if not names:
            return layer
        view = nnx.merge(*nnx.split(layer))  # new modules over the same parameters
        for name in names:
            module, attr = _PROJECTIONS[name]
            setattr(getattr(view, module), attr, functools.partial(w.matmul, f"{i}.{name}"))
        return view

    def head(self, hidden: jax.Array) -> jax.Array | None:
        """float32[B, V] logits, or None where the model's own head runs."""
        w = self.weights
        if w is None or "head" not in w.slots:
            return None
        dtype = jnp.dtype(w.slots["head"].dtype)
        return w.matmul("head", hidden.astype(dtype)).astype(jnp.float32)
