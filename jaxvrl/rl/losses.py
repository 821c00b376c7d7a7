"""Policy, KL, entropy and value losses (SPEC section 5). float32 math, [B, T] arrays."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_KINDS = ("kl", "abs", "mse", "low_var_kl")


def agg_loss(values: jax.Array, mask: jax.Array, mode: str) -> jax.Array:
    """Aggregate per-token values [B, T] with a (possibly weighted) mask [B, T].

    token-mean: sum(m l) / sum(m); seq-mean-token-mean: mean over rows of sum_t(m l)/sum_t m;
    seq-mean-token-sum: mean over rows of sum_t(m l); seq-mean-token-sum-norm:
    sum(m l) / (rows * T). "rows" are the rows with at least one completion token.
    """
    m = mask.astype(jnp.float32)
    ml = values.astype(jnp.float32) * m
    if mode == "token-mean":
        return jnp.sum(ml) / jnp.maximum(jnp.sum(m), 1e-8)
    row_sum = jnp.sum(ml, axis=-1)
    row_mass = jnp.sum(m, axis=-1)
    rows = row_mass > 0
    n_rows = jnp.maximum(jnp.sum(rows), 1).astype(jnp.float32)
    if mode == "seq-mean-token-mean":
        per_row = jnp.where(rows, row_sum / jnp.where(rows, row_mass, 1.0), 0.0)
        return jnp.sum(per_row) / n_rows
    if mode == "seq-mean-token-sum":
        return jnp.sum(row_sum) / n_rows
    if mode == "seq-mean-token-sum-norm":
        return jnp.sum(row_sum) / (n_rows * values.shape[-1])
    raise ValueError(f"unknown loss_agg_mode {mode!r} (one of {AGG_MODES})")


def policy_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_dual: float = 3.0,
    loss_agg_mode: str = "token-mean",
    token_mask: jax.Array | None = None,
    token_weights: jax.Array | None = None,
) -> tuple[jax.Array, dict]:
    """Clipped surrogate with dual clip. advantages: [B] (one per row) or [B, T].

    r = exp(clip(logp - old, -20, 20)); l = max(-A r, -A clip(r, 1 - low, 1 + high)); for
    A < 0, l = min(l, -dual A). token_mask multiplies l (the denominator still counts every
    completion token); token_weights replace m by m w in numerator and denominator.
    Returns (loss, metrics) with clip fractions, approx KL (k1: old - logp) and ratio mean.
    """
    m = (mask > 0).astype(jnp.float32)
    a = advantages.astype(jnp.float32)
    a = a[:, None] if a.ndim == 1 else a
    log_ratio = jnp.clip(logp.astype(jnp.float32) - old_logp.astype(jnp.float32), -20.0, 20.0)
    ratio = jnp.exp(log_ratio)
    l1 = -a * ratio
    l2 = -a * jnp.clip(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clipped = jnp.maximum(l1, l2)
    l3 = -a * clip_ratio_dual
    dual = jnp.minimum(clipped, l3)
    loss_t = jnp.where(a < 0, dual, clipped)
    if token_mask is not None:
        loss_t = loss_t * token_mask.astype(jnp.float32)
    agg_mask = m if token_weights is None else m * token_weights.astype(jnp.float32)
    loss = agg_loss(loss_t, agg_mask, loss_agg_mode)
    tm = lambda x: agg_loss(x.astype(jnp.float32), m, "token-mean")  # noqa: E731
    metrics = {
        "clip_frac": tm(l2 > l1),
        "clip_frac_high": tm((l2 > l1) & (a > 0)),
        "clip_frac_low": tm((l2 > l1) & (a < 0)),
        "dual_clip_frac": tm((a < 0) & (clipped > l3)),
        "approx_kl": tm(-log_ratio),
        "ratio_mean": tm(ratio),
    }
    return loss, metrics


def kl_penalty(logp: jax.Array, ref_logp: jax.Array, kind: str = "low_var_kl") -> jax.Array:
    """Per-token KL estimate with x = logp - ref_logp: kl x, abs |x|, mse x^2/2,
    low_var_kl clip(exp(-x) + x - 1, -10, 10) with the exponent clamped to +-20."""
    x = logp.astype(jnp.float32) - ref_logp.astype(jnp.float32)
    if kind == "kl":
        return x
    if kind == "abs":
        return jnp.abs(x)
    if kind == "mse":
        return 0.5 * jnp.square(x)
    if kind == "low_var_kl":
        e = jnp.clip(-x, -20.0, 20.0)
        return jnp.clip(jnp.exp(e) - e - 1.0, -10.0, 10.0)
    raise ValueError(f"unknown KL kind {kind!r} (one of {KL_KINDS})")


def entropy_penalty(logp: jax.Array, mask: jax.Array, mode: str) -> jax.Array:
    """Seed 004's entropy penalty term agg(-logp) (multiply by entropy_penalty_coef, add)."""
    return agg_loss(-logp, mask, mode)


def value_loss(
    values: jax.Array,
    old_values: jax.Array,
    returns: jax.Array,
    mask: jax.Array,
    clip_range: float = 0.2,
    loss_agg_mode: str = "token-mean",
) -> tuple[jax.Array, dict]:
    """Clipped value loss 0.5 max((V - R)^2, (clip(V, V_old +- c) - R)^2), aggregated."""
    v = values.astype(jnp.float32)
    clipped = old_values + jnp.clip(v - old_values, -clip_range, clip_range)
    l1 = jnp.square(v - returns)
    l2 = jnp.square(clipped - returns)
    loss = 0.5 * agg_loss(jnp.maximum(l1, l2), mask, loss_agg_mode)
    frac = agg_loss((l2 > l1).astype(jnp.float32), mask, "token-mean")
    return loss, {"vf_clip_frac": frac}


@dataclasses.dataclass
class FixedKLController:
    """KL coefficient that never changes (host side)."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> float:
        del current_kl, n_steps
        return self.value


@dataclasses.dataclass
class AdaptiveKLController:
    """beta <- beta (1 + e n_steps / horizon), e = clip(KL / target - 1, -0.2, 0.2)."""

    value: float
    target: float
    horizon: int

    def update(self, current_kl: float, n_steps: int) -> float:
        e = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + e * n_steps / self.horizon
        return self.value
