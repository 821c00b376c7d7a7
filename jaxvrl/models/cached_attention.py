"""Attention over a KV cache, behind one function, `attend_cache`, with implementations chosen
by name or given as a callable.

Without a cache, and in a prefill into an empty one, the decoder attends through
`jaxvrl.models.attention.attend`. Over a written cache (the sampler's decode steps) each layer
writes its new keys and values into it (`jaxvrl.models.cache`) and attends here, under the mask
bool[B, T, S] the decoder builds once per call (valid keys, causality by slot, the window).

The arrays are in the caches' layouts: queries grouped by key/value head qg [B, T, K, G, H],
keys [B, K, H, S] or [B, K, S, H] (`KVCache.key_layout`), values [B, K, S, H]; or, with
`table` int32[B, n], pages [P, K, H, ps] (or [P, K, ps, H]) and [P, K, ps, H] that row b
reads in the order table[b] (`PagedKVCache`, S = n * ps). Implementations:

- "dense": two einsums around the model's masked softmax (pages gathered first); everywhere;
- "tpu": one query per row (more fall back to "dense") in one Pallas TPU kernel that keeps
  scores on chip and reads only the written blocks (`jaxvrl.models.cached_kernels`;
  "tpu_interpret" runs it on the CPU); over pages with keys by slot, a kernel that copies
  each row's pages from where they lie, up to its last visible slot (`tpu_paged_decode`);
- "gpu": pages with keys by slot read in place by a Pallas Triton kernel (`gpu_paged_decode`;
  "gpu_interpret" on the CPU), else as "dense";
- a callable impl(qg, k, v, mask, *, scale, pools, dtype) -> (out, stats) over the dense
  layouts, keys positions-minor (the CPU kernel, `jaxvrl.sampling.cpu.decode.attention`).

Letters: B batch, T queries, S cache slots, K key/value heads, G query heads per K, H head dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxvrl.models import cached_kernels
from jaxvrl.models.cache import KEY_AXES
from jaxvrl.models.layers import masked_softmax, pool_masses
from jaxvrl.parallel.sharding import constrain


def _dense(qg, k, v, mask, *, scale, pools, dtype, key_layout="BKHS"):
    """The reference: out [B, T, K, G, H] in `dtype`, stats (A_V, A_X) or None."""
    logits = jnp.einsum(f"BTKGH,{key_layout}->BKGTS", qg, k.astype(qg.dtype))
    probs = masked_softmax(logits * scale, mask[:, None, None])
    stats = pool_masses(probs, pools) if pools is not None else None
    # [B, K, G, T, H] then [B, T, ...]: asked for in [B, T, ...] order, XLA's CPU backend
    # multiplied by the transposed cache, several times slower
    out = jnp.einsum("BKGTS,BKSH->BKGTH", probs.astype(dtype), v.astype(dtype))
    return out.transpose(0, 3, 1, 2, 4), stats


def _decode_kernel(interpret: bool):
    def impl(qg, k, v, mask, *, scale, pools, dtype, key_layout="BKHS"):
        kw = dict(scale=scale, pools=pools, dtype=dtype, key_layout=key_layout)
        if qg.shape[1] != 1:  # the kernel takes decode steps' single queries
            return _dense(qg, k, v, mask, **kw)
        return cached_kernels.tpu_decode(qg, k, v, mask, **kw, interpret=interpret)

    return impl


IMPLEMENTATIONS = {
    "dense": _dense,
    "tpu": _decode_kernel(False),
    "tpu_interpret": _decode_kernel(True),
    "gpu": _dense,  # a dense cache on GPUs: XLA's form; pages: the kernel below
    "gpu_interpret": _dense,
}
# decode steps over pages with the keys by slot, read where they lie
PAGED = {
    "tpu": cached_kernels.tpu_paged_decode,
    "tpu_interpret": functools.partial(cached_kernels.tpu_paged_decode, interpret=True),
    "gpu": cached_kernels.gpu_paged_decode,
    "gpu_interpret": functools.partial(cached_kernels.gpu_paged_decode, interpret=True),
}


def gather_pages(k_pages, v_pages, table, key_layout: str = "BKHS"):
    """Every row's keys [B, K, H, n * ps] and values [B, K, n * ps, H] (the dense cache's
    layouts) from pages [P, K, H, ps] and [P, K, ps, H] in the order of its table int32[B, n];
    key_layout "BKSH": keys [B, K, n * ps, H] from pages [P, K, ps, H]."""
    b, n = table.shape

    def by_slot(pages):  # [P, K, ps, H] -> [B, K, n * ps, H]
        x = pages[table]  # [B, n, K, ps, H]
        return x.transpose(0, 2, 1, 3, 4).reshape(b, x.shape[2], n * x.shape[3], x.shape[4])

    if key_layout == "BKHS":
        kk = k_pages[table]  # [B, n, K, H, ps]
        kk = kk.transpose(0, 2, 3, 1, 4).reshape(b, kk.shape[2], kk.shape[3], n * kk.shape[4])
    else:
        kk = by_slot(k_pages)
    return kk, by_slot(v_pages)


def attend_cache(
    qg: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    *,
    scale: float,
    dtype,
    pools: dict | None = None,
    table: jax.Array | None = None,
    implementation="dense",
    key_layout: str = "BKHS",
):
    """Queries qg [B, T, K, G, H] over a layer's cache: keys k [B, K, H, S] (key_layout
    "BKHS") or [B, K, S, H] ("BKSH") and values v [B, K, S, H], or with `table` int32[B, n]
    pages k [P, K, H, ps] (or [P, K, ps, H]) and v [P, K, ps, H];
    mask bool[B, T, S]: which cache slots each query sees; pools: None or the
    {"vision", "text", "prompt"} bool[B, S] key pools; implementation: a name of
    IMPLEMENTATIONS or a callable (see the module docstring).

    Returns (out [B, T, K, G, H] in `dtype`, stats: (A_V, A_X) float32[B, T] with pools, else
    None)."""
    kw = dict(scale=scale, pools=pools, dtype=dtype)
    paged = table is not None and key_layout == "BKSH" and qg.shape[1] == 1
    if paged and isinstance(implementation, str) and implementation in PAGED:
        return PAGED[implementation](qg, k, v, table, mask, **kw)
    if isinstance(implementation, str):
        if implementation not in IMPLEMENTATIONS:
            known = ", ".join(IMPLEMENTATIONS)
            raise ValueError(f"unknown cached attention {implementation!r}; known: {known}")
        implementation = IMPLEMENTATIONS[implementation]
        kw["key_layout"] = key_layout
    elif key_layout != "BKHS":  # a callable reads the keys positions-minor
        k, key_layout = jnp.swapaxes(k, -1, -2), "BKHS"
    if table is not None:
        k, v = gather_pages(k, v, table, key_layout)
    # the cache stays split like the rows (and over kv heads with tensor parallelism)
    k, v = constrain(k, KEY_AXES[key_layout]), constrain(v, KEY_AXES["BKSH"])
    return implementation(qg, k, v, mask, **kw)
