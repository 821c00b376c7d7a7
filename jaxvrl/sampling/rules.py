"""Token selection rules for one decode step, written for the CPU as much as for accelerators.

Every function takes float32 logits [B, V]. They avoid the operations that dominate a decode
step on the XLA CPU backend at V ~ 150k: a full sort (~250 ms at B=8), `jnp.argmax` (a variadic
reduce, ~4 ms) and V random numbers per row (~13 ms); each rule below is a few vectorised
passes over the logits instead.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -1e30
_TOP_P_CANDIDATES = 64  # the nucleus is looked for among these first (exact when it fits)
_BLOCKS = 256  # inverse-CDF sampling: blocks per row


def first_argmax(x: jax.Array) -> jax.Array:
    """int32[B]: index of the first maximum of each row of float[B, V] (like `jnp.argmax`)."""
    v = x.shape[-1]
    top = jnp.max(x, axis=-1, keepdims=True)
    return jnp.min(jnp.where(x == top, jnp.arange(v, dtype=jnp.int32), v), axis=-1)


def token_logprob(logits: jax.Array, tokens: jax.Array, temperature: float) -> jax.Array:
    """float32[B]: log-prob of tokens int[B] under softmax(logits / temperature), the model's
    full distribution (no top-k/top-p renormalisation, suppressed tokens in the normaliser):
    what a teacher-forced pass computes."""
    x = logits / temperature if temperature != 1.0 else logits
    top = jnp.max(x, axis=-1)
    total = jnp.sum(jnp.exp(x - top[:, None]), axis=-1)
    return jnp.take_along_axis(x, tokens[:, None], axis=-1)[:, 0] - (top + jnp.log(total))


def token_entropy(logits: jax.Array, temperature: float) -> jax.Array:
    """float32[B]: entropy of softmax(logits / temperature) over the full vocabulary, as a
    sum of non-negative terms p (lse - x) (what the trainer's passes compute)."""
    x = logits / temperature if temperature != 1.0 else logits
    top = jnp.max(x, axis=-1, keepdims=True)
    e = jnp.exp(x - top)
    total = jnp.sum(e, axis=-1, keepdims=True)
    gap = top + jnp.log(total) - x  # -log p >= 0
    return jnp.sum(e / total * gap, axis=-1)


def top_k_filter(logits: jax.Array, k: int) -> jax.Array:
    """Keep each row's k largest logits (ties at the k-th value are kept), others NEG_INF."""
    if not k or k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = jax.lax.top_k(logits, k)[0][:, -1:]
    return jnp.where(logits < kth, NEG_INF, logits)


def _nucleus_threshold_fast(probs, vals, top_p):
    del probs
    cum = jnp.cumsum(vals, axis=-1)
    j = jnp.sum(cum < top_p, axis=-1, keepdims=True)
    return jnp.take_along_axis(vals, jnp.minimum(j, vals.shape[-1] - 1), axis=-1)


def _nucleus_threshold_bisect(probs, vals, top_p):
    del vals
    # Non-negative float32 values order like their int32 bit patterns: bisect on the bits for
    # the largest threshold t (an actual probability) with mass(probs >= t) >= top_p.
    keys = jax.lax.bitcast_convert_type(probs, jnp.int32)
    b = probs.shape[0]
    lo = jnp.zeros((b, 1), jnp.int32)  # mass(keys >= lo) = 1 >= top_p
    hi = jnp.max(keys, axis=-1, keepdims=True) + 1  # mass(keys >= hi) = 0 < top_p

    def body(_, lh):
        lo, hi = lh
        mid = lo + (hi - lo) // 2
        mass = jnp.sum(jnp.where(keys >= mid, probs, 0.0), axis=-1, keepdims=True)
        ok = mass >= top_p
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, _ = jax.lax.fori_loop(0, 32, body, (lo, hi))
    return jax.lax.bitcast_convert_type(lo, jnp.float32)


def top_p_filter(logits: jax.Array, top_p: float) -> jax.Array:
    """Nucleus filtering: keep the smallest set of most probable tokens whose probability
    reaches top_p (always at least one; ties at the boundary are kept), others NEG_INF.

    Exact: a row's threshold comes from its top 64 probabilities when they reach top_p, else
    from a 32-step bisection on its probabilities' bit patterns (no sort; run only when some
    row needs it). The choice is each row's own, so a row's kept set does not depend on the
    other rows of the call (the two round differently at a mass within float32 rounding of
    top_p).
    """
    if top_p >= 1.0:
        return logits
    return nucleus_filter(logits, jnp.float32(top_p))


def nucleus_filter(logits: jax.Array, p: jax.Array) -> jax.Array:
    """`top_p_filter` at a traced mass p < 1 (float32[]): one program for every p."""
    probs = jax.nn.softmax(logits, axis=-1)
    vals = jax.lax.top_k(probs, min(_TOP_P_CANDIDATES, probs.shape[-1]))[0]  # sorted, desc
    fits = jnp.sum(vals, axis=-1, keepdims=True) >= p  # [B, 1]
    fast = _nucleus_threshold_fast(probs, vals, p)
    thr = jax.lax.cond(
        jnp.all(fits),
        lambda: fast,
        lambda: jnp.where(fits, fast, _nucleus_threshold_bisect(probs, vals, p)),
    )
    return jnp.where(probs >= thr, logits, NEG_INF)


def row_uniforms(keys: jax.Array, index) -> jax.Array:
    """float32[B] in [0, 1): row b's number from its own key keys[b] folded with `index` (the
    token index; one for every row or int[B], each row's own), so that a row's draw depends
    on neither the batch's size nor its order."""
    index = jnp.broadcast_to(jnp.asarray(index, jnp.int32), keys.shape)
    return jax.vmap(lambda k, i: jax.random.uniform(jax.random.fold_in(k, i)))(keys, index)


def categorical_from_uniform(u: jax.Array, logits: jax.Array) -> jax.Array:
    """int32[B]: one sample per row from softmax(logits), by two-level inverse-CDF sampling
    (block masses, then within the chosen block) with the uniform number u float32[B] of each
    row. Entries at NEG_INF are never chosen."""
    b, v = logits.shape
    size = -(-v // _BLOCKS)
    p = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
    p = jnp.pad(p, ((0, 0), (0, _BLOCKS * size - v))).reshape(b, _BLOCKS, size)
    block_mass = jnp.sum(p, axis=-1)  # [B, blocks]
    cum = jnp.cumsum(block_mass, axis=-1)
    u = u[:, None] * cum[:, -1:]
    blk = _first_above(cum, u, block_mass > 0)
    inner = jnp.take_along_axis(p, blk[:, None, None], axis=1)[:, 0]  # [B, size]
    before = jnp.take_along_axis(cum - block_mass, blk[:, None], axis=1)
    j = _first_above(jnp.cumsum(inner, axis=-1), u - before, inner > 0)
    return (blk * size + j).astype(jnp.int32)


def _first_above(cum, u, positive):
    """First index with cum > u, clamped to the indices with positive mass (float rounding can
    put u just outside [0, total))."""
    n = cum.shape[-1]
    idx = jnp.arange(n)
    i = jnp.sum(cum <= u, axis=-1)
    first = jnp.min(jnp.where(positive, idx, n - 1), axis=-1)
    last = jnp.max(jnp.where(positive, idx, 0), axis=-1)
    return jnp.clip(i, first, last)
