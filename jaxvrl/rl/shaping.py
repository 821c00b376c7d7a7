"""Trajectory advantage shaping (TAS; VPPO, arXiv 2510.09285;
docs/algorithms.md#trajectory-advantage-shaping-tas)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _reduce(x: jax.Array, op: str, axis_name: str | None) -> jax.Array:
    if axis_name is None:
        return x
    return {"min": jax.lax.pmin, "max": jax.lax.pmax, "sum": jax.lax.psum}[op](x, axis_name)


def trajectory_scaling(
    scores: jax.Array,
    mask: jax.Array,
    beta_min: float = 0.8,
    *,
    row_mask: jax.Array | None = None,
    axis_name: str | None = None,
) -> jax.Array:
    """TAS factors alpha: float32[B], mean 1 over the rows taking part.

    S_i = mean of scores float32[B, T] over row i's completion tokens (mask [B, T]);
    n_i = (S_i - min) / (max - min); mu = mean n; beta_max = beta_min + (1 - beta_min) / mu;
    alpha_i = beta_min + (beta_max - beta_min) n_i. If max - min < 1e-6, alpha = 1.

    min / max / mean run over the global batch: under jit on sharded arrays that is automatic;
    inside shard_map / pmap / vmap pass the mapped `axis_name`. Rows taking part are those with
    >= 1 completion token and, if given, row_mask bool[B] (e.g. rows with an image); other rows
    get alpha = 1 and do not enter min / max / mean. No gradient flows through alpha.
    """
    m = (mask > 0).astype(jnp.float32)
    count = jnp.sum(m, axis=-1)
    row = count > 0
    if row_mask is not None:
        row = row & row_mask.astype(bool)
    s = jnp.sum(scores.astype(jnp.float32) * m, axis=-1) / jnp.maximum(count, 1.0)
    lo = _reduce(jnp.min(jnp.where(row, s, jnp.inf)), "min", axis_name)
    hi = _reduce(jnp.max(jnp.where(row, s, -jnp.inf)), "max", axis_name)
    spread = hi - lo
    # No spread (or fewer than two distinct rows): the formula is 0/0, shaping is off.
    ok = spread >= 1e-6
    n = jnp.where(row, (s - lo) / jnp.where(ok, spread, 1.0), 0.0)
    n_rows = _reduce(jnp.sum(row).astype(jnp.float32), "sum", axis_name)
    mu = _reduce(jnp.sum(n), "sum", axis_name) / jnp.maximum(n_rows, 1.0)
    # ok implies the max row has n = 1, so mu >= 1 / n_rows > 0.
    beta_max = beta_min + (1.0 - beta_min) / jnp.where(mu > 0, mu, 1.0)
    alpha = beta_min + (beta_max - beta_min) * n
    return jax.lax.stop_gradient(jnp.where(ok & row, alpha, 1.0))
