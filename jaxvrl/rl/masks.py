"""Token scores and masks of TPRL/VPPO (arXiv 2510.09285; docs/algorithms.md): visual
dependency, the top-p perception mask (TGF), the entropy mask. Arrays are [B, T] with an
explicit completion mask m (float or bool, > 0 on completion tokens); float32 math; jit-able
with static shapes."""

from __future__ import annotations

import fractions

import jax
import jax.numpy as jnp

# ceil(n * p) in floating point rounds 10 * 0.3 = 3.0000000000000004 up to 4, so a static top_p
# is read as the nearest fraction num/den with den <= 10^4 (exact for decimals of up to four
# digits) and k is computed in int32 without overflow.
_MAX_DENOMINATOR = 10_000


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
    """k = ceil(n * top_p) as int32 within [0, n]; n: int[...] token counts.

    A Python-number top_p is exact (see _MAX_DENOMINATOR); a traced top_p falls back to
    float32 with a 1e-6 tolerance below integers."""
    n = n.astype(jnp.int32)
    if isinstance(top_p, (int, float)):
        frac = fractions.Fraction(str(float(top_p))).limit_denominator(_MAX_DENOMINATOR)
        num, den = frac.numerator, frac.denominator
        q, r = n // den, n % den  # n*num/den = q*num + r*num/den, and r*num < 10^8
        k = q * num + (r * num + den - 1) // den
    else:
        k = jnp.ceil(n.astype(jnp.float32) * top_p - 1e-6).astype(jnp.int32)
    return jnp.clip(k, 0, n)


def _descending_rank(scores: jax.Array, valid: jax.Array) -> jax.Array:
    """int32[B, T] rank of each position when sorting by (padding last, score descending,
    position ascending); 0 = best. A NaN score counts as -inf (still above padding)."""
    b, t = scores.shape
    key = -scores.astype(jnp.float32)
    # Equal scores made bit-identical (-0.0 vs 0.0, NaN vs -inf), so that ties are broken
    # by position alone whatever float order the backend's sort uses.
    key = jnp.where(key == 0, 0.0, key)
    key = jnp.where(jnp.isnan(key), jnp.inf, key)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    _, _, order = jax.lax.sort(
        ((~valid).astype(jnp.int32), key, pos), dimension=1, num_keys=2, is_stable=True
    )
    rows = jnp.arange(b, dtype=jnp.int32)[:, None]
    return jnp.zeros((b, t), jnp.int32).at[rows, order].set(pos)


def top_p_token_mask(scores: jax.Array, mask: jax.Array, top_p: float) -> jax.Array:
    """Perception mask (TGF, VPPO): per row, 1 on the k = ceil(n * top_p) completion tokens
    with the largest score, n = the row's completion-token count.

    Exactly k per row (k is clipped to [0, n]); equal scores go to the earlier position;
    padding is never selected. scores, mask: [B, T]. Returns float32[B, T].
    """
    valid = mask > 0
    rank = _descending_rank(scores, valid)
    k = top_k_count(jnp.sum(valid, axis=-1), top_p)
    return ((rank < k[:, None]) & valid).astype(jnp.float32)


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
    raise ValueError(f"entropy_filter_scope must be 'sequence' or 'batch', got {scope!r}")


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
