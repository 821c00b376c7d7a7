"""Trajectory advantage shaping (TAS, SPEC section 3)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def trajectory_scaling(scores: jax.Array, mask: jax.Array, beta_min: float = 0.8) -> jax.Array:
    """alpha float32[B] with mean 1 over rows that have completion tokens.

    S_i = mean of scores over row i's completion tokens; n_i = (S_i - min) / (max - min) over
    the batch; mu = mean n; beta_max = beta_min + (1 - beta_min) / mu;
    alpha_i = beta_min + (beta_max - beta_min) n_i. If max - min < 1e-6, alpha = 1. Under jit
    on sharded arrays, min/max/mean run over the global batch. Rows without completion tokens
    get alpha = 1 and are left out of min/max/mean.
    """
    m = (mask > 0).astype(jnp.float32)
    count = jnp.sum(m, axis=-1)
    row = count > 0
    s = jnp.sum(scores.astype(jnp.float32) * m, axis=-1) / jnp.maximum(count, 1.0)
    lo = jnp.min(jnp.where(row, s, jnp.inf))
    hi = jnp.max(jnp.where(row, s, -jnp.inf))
    spread = hi - lo
    ok = spread >= 1e-6
    n = jnp.where(row, (s - lo) / jnp.where(ok, spread, 1.0), 0.0)
    mu = jnp.sum(n) / jnp.maximum(jnp.sum(row), 1)
    beta_max = beta_min + (1.0 - beta_min) / jnp.where(mu > 0, mu, 1.0)
    alpha = beta_min + (beta_max - beta_min) * n
    return jax.lax.stop_gradient(jnp.where(ok & row, alpha, 1.0))
