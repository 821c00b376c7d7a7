"""Token masks and scores of TPRL/VPPO (SPEC section 3): visual dependency, top-p perception
mask, entropy mask. Arrays are [B, T] with an explicit completion mask; float32 math."""

from __future__ import annotations

import jax
import jax.numpy as jnp

# ceil(n * p) must not round 10 * 0.3 = 3.0000000000000004 up to 4.
_CEIL_EPS = 1e-6


def visual_dependency(logp_aug: jax.Array, logp: jax.Array, mask: jax.Array) -> jax.Array:
    """S_t = clip(exp(d) - d - 1, 0, 10), d = clip(logp(o_t|I') - logp(o_t|I), -20, 20).

    A single-sample k3 estimate of KL(pi(.|I) || pi(.|I')). float32[B, T], 0 on padding, no
    gradient."""
    d = jnp.clip(logp_aug.astype(jnp.float32) - logp.astype(jnp.float32), -20.0, 20.0)
    s = jnp.clip(jnp.exp(d) - d - 1.0, 0.0, 10.0)
    return jax.lax.stop_gradient(jnp.where(mask > 0, s, 0.0))


def top_k_count(n: jax.Array, top_p: float) -> jax.Array:
    """k = ceil(n * top_p) as int32, robust to float error, within [0, n]."""
    k = jnp.ceil(n.astype(jnp.float32) * top_p - _CEIL_EPS).astype(jnp.int32)
    return jnp.clip(k, 0, n.astype(jnp.int32))


def top_p_token_mask(scores: jax.Array, mask: jax.Array, top_p: float) -> jax.Array:
    """Per row, 1 on the k = ceil(n * top_p) completion tokens with the largest score, where n
    is the row's completion-token count; exactly k per row, ties to the earlier position.

    scores, mask: [B, T]. Returns float32[B, T]."""
    valid = mask > 0
    key = jnp.where(valid, scores.astype(jnp.float32), -jnp.inf)
    key = jnp.where(jnp.isnan(key), -jnp.inf, key)
    # A stable sort of -score puts equal scores in position order; padding (+inf) goes last.
    order = jnp.argsort(-key, axis=-1, stable=True)
    rank = jnp.argsort(order, axis=-1, stable=True)
    k = top_k_count(jnp.sum(valid, axis=-1), top_p)
    return ((rank < k[:, None]) & valid).astype(jnp.float32)


def entropy_token_mask(
    entropy: jax.Array, mask: jax.Array, top_p: float, scope: str = "sequence"
) -> jax.Array:
    """Keep the top `top_p` highest-entropy completion tokens, per row ("sequence") or over
    the whole batch ("batch", arXiv 2506.01939). float32[B, T]."""
    if scope == "sequence":
        return top_p_token_mask(entropy, mask, top_p)
    if scope == "batch":
        flat = top_p_token_mask(entropy.reshape(1, -1), mask.reshape(1, -1), top_p)
        return flat.reshape(entropy.shape)
    raise ValueError(f"entropy_filter_scope must be 'sequence' or 'batch', got {scope!r}")


def token_entropy(logits: jax.Array) -> jax.Array:
    """Entropy of softmax(logits) over the last axis, float32[...]."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)
