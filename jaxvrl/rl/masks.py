"""Token scores and masks of TPRL/VPPO (arXiv 2510.09285; docs/algorithms.md): visual
dependency, the top-p perception mask (TGF), the entropy mask. Arrays are [B, T] with an
explicit completion mask m (float or bool, > 0 on completion tokens); float32 math; jit-able
with static shapes."""

from __future__ import annotations

import fractions

import jax
import jax.numpy as jnp

ENTROPY_SCOPES = ("sequence", "batch")  # top entropy tokens per row, or over the batch

# ceil(n * p) in floating point rounds 10 * 0.3 = 3.0000000000000004 up to 4, so a static top_p
# is read as the fraction num/den its decimal text writes (denominator below 2^31: exact for
# decimals of up to nine digits, within ~1e-18 beyond) and k is found by exact integer products.
_MAX_DENOMINATOR = 2**31 - 1
_WINDOW = 4  # the float32 estimate of n * p is within 4 of k for n < 2^24


def visual_dependency(logp_aug: jax.Array, logp: jax.Array, mask: jax.Array) -> jax.Array:
    """Per-token visual dependency S_t (docs/algorithms.md, "Perturbed image and visual
    dependency").

    d = clip(logp(o_t | I') - logp(o_t | I), -20, 20); S_t = clip(exp(d) - d - 1, 0, 10): a
    single-sample k3 estimate of KL(pi(.|I) || pi(.|I')). logp_aug, logp: float32[B, T] log-probs
    of the sampled tokens under the perturbed and the clean image. Returns float32[B, T], 0 on
    padding, with no gradient.
    """
    d = jnp.clip(logp_aug.astype(jnp.float32) - logp.astype(jnp.float32), -20.0, 20.0)
    s = jnp.clip(jnp.exp(d) - d - 1.0, 0.0, 10.0)
    return jax.lax.stop_gradient(jnp.where(mask > 0, s, 0.0))


def top_k_count(n: jax.Array, top_p: float) -> jax.Array:
    """k = ceil(n * top_p) as int32 within [0, n]; n: int[...] token counts (below 2^24).

    A Python-number top_p is read as its decimal text (0.3 is 3/10) and k is exact: the
    smallest of the candidates around the float32 estimate with k * den >= n * num, the
    products compared exactly in two 32-bit halves (so any top_p > 0 keeps at least one of
    n >= 1 tokens). A traced top_p falls back to float32 with a relative tolerance of 1e-6
    below integers."""
    n = n.astype(jnp.int32)
    if not isinstance(top_p, (int, float)):
        x = n.astype(jnp.float32) * top_p
        return jnp.clip(jnp.ceil(x - 1e-6 * jnp.maximum(x, 1.0)).astype(jnp.int32), 0, n)
    frac = fractions.Fraction(str(float(top_p))).limit_denominator(_MAX_DENOMINATOR)
    num, den = frac.numerator, frac.denominator
    if num <= 0:
        return jnp.zeros_like(n)
    if num >= den:
        return n
    est = jnp.floor(n.astype(jnp.float32) * jnp.float32(num / den)).astype(jnp.int32)
    k = jnp.clip(est[..., None] + jnp.arange(-_WINDOW, _WINDOW + 1), 0, n[..., None])
    need = _wide_product(n.astype(jnp.uint32), num)
    enough = _wide_at_least(_wide_product(k.astype(jnp.uint32), den), need, axis=-1)
    return jnp.min(jnp.where(enough, k, n[..., None]), axis=-1)


def _wide_product(a: jax.Array, b: int) -> tuple[jax.Array, jax.Array]:
    """(high, low) uint32 halves of the exact product of uint32 a and a Python int b, both
    below 2^31: 16-bit limbs, each partial product within 32 bits."""
    a0, a1 = a & 0xFFFF, a >> 16
    b0, b1 = jnp.uint32(b & 0xFFFF), jnp.uint32(b >> 16)
    low0, mid = a0 * b0, a1 * b0 + a0 * b1
    low = low0 + (mid << 16)
    return a1 * b1 + (mid >> 16) + (low < low0).astype(jnp.uint32), low


def _wide_at_least(x: tuple, y: tuple, axis: int) -> jax.Array:
    """x >= y for (high, low) halves; y broadcast along `axis` of x."""
    (xh, xl), (yh, yl) = x, (jnp.expand_dims(y[0], axis), jnp.expand_dims(y[1], axis))
    return (xh > yh) | ((xh == yh) & (xl >= yl))


def _ordered_bits(x: jax.Array) -> jax.Array:
    """uint32 keys in the order of the float32 values: a < b <=> key(a) < key(b), -inf lowest,
    +inf highest (NaN must be mapped to a number first; -0.0 sorts just below 0.0)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    negative = (bits >> 31) == 1
    return jnp.where(negative, ~bits, bits | jnp.uint32(1 << 31))


def _kth_smallest(keys: jax.Array, valid: jax.Array, k: jax.Array, bits: int) -> jax.Array:
    """uint32[B]: per row, the smallest v with #{t : valid[t] and keys[t] <= v} >= k (k >= 1;
    keys uint32[B, T] below 2**bits). Radix selection: one count over the row per bit, from the
    highest bit down, instead of a sort."""

    def one_bit(i, v):
        bit = jnp.uint32(bits - 1) - i.astype(jnp.uint32)
        low = (jnp.uint32(1) << bit) - jnp.uint32(1)  # v's bit is 0: is the answer <= v | low?
        count = jnp.sum(valid & (keys <= (v | low)[:, None]), axis=-1)
        return jnp.where(count >= k, v, v | (jnp.uint32(1) << bit))

    return jax.lax.fori_loop(0, bits, one_bit, jnp.zeros(keys.shape[0], jnp.uint32))


def top_p_token_mask(scores: jax.Array, mask: jax.Array, top_p: float) -> jax.Array:
    """Perception mask (TGF, VPPO): per row, 1 on the k = ceil(n * top_p) completion tokens
    with the largest score, n = the row's completion-token count.

    Exactly k per row (k is clipped to [0, n]); equal scores go to the earlier position (-0.0
    and 0.0 are equal; a NaN score counts as -inf); padding is never selected. scores, mask:
    [B, T]. Returns float32[B, T].

    The k-th largest score is found by radix selection on the scores' bits (32 counts over
    the row), then the earliest of the scores equal to it by a selection on positions: exact,
    and with no multi-key sort and scatter (an order of magnitude faster on the CPU).
    """
    b, t = scores.shape
    valid = mask > 0
    k = top_k_count(jnp.sum(valid, axis=-1), top_p)
    x = scores.astype(jnp.float32)
    x = jnp.where(jnp.isnan(x), -jnp.inf, jnp.where(x == 0, 0.0, x))
    keys = ~_ordered_bits(x)  # ascending keys = descending scores
    v = _kth_smallest(keys, valid, k, 32)[:, None]
    above = valid & (keys < v)  # fewer than k of them, by v's minimality
    ties = valid & (keys == v)
    need = k - jnp.sum(above, axis=-1)  # >= 1 where k >= 1
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.uint32), (b, t))
    last = _kth_smallest(pos, ties, need, max(1, (t - 1).bit_length()))[:, None]
    chosen = above | (ties & (pos <= last) & (need > 0)[:, None])
    return chosen.astype(jnp.float32)


def entropy_token_mask(
    entropy: jax.Array, mask: jax.Array, top_p: float, scope: str = "sequence"
) -> jax.Array:
    """Entropy mask (arXiv 2506.01939): keep the top `top_p` highest-entropy completion
    tokens per row (scope "sequence": k = ceil(n_row * top_p)) or over the whole
    batch (scope "batch": k = ceil(N * top_p), N = all completion tokens; ties go to the earlier
    position in row-major order). entropy, mask: [B, T]. Returns float32[B, T]."""
    if scope == "sequence":
        return top_p_token_mask(entropy, mask, top_p)
    if scope == "batch":
        flat = top_p_token_mask(entropy.reshape(1, -1), mask.reshape(1, -1), top_p)
        return flat.reshape(entropy.shape)
    raise ValueError(f"entropy_filter_scope must be one of {ENTROPY_SCOPES}, got {scope!r}")


def token_entropy(logits: jax.Array, temperature: float = 1.0) -> jax.Array:
    """Entropy of softmax(logits / temperature) over the last axis: float32[...] from
    float[..., V]."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def union_token_mask(*masks: jax.Array | None) -> jax.Array | None:
    """Union of token masks (perception and entropy masks together); None if none."""
    present = [m.astype(jnp.float32) for m in masks if m is not None]
    if not present:
        return None
    out = present[0]
    for m in present[1:]:
        out = jnp.maximum(out, m)
    return out
