"""Advantage estimators (docs/algorithms.md#advantages). Group = the G consecutive rows of one
prompt."""

from __future__ import annotations

import jax
import jax.numpy as jnp

ESTIMATORS = ("grpo", "rloo", "remax", "reinforce_plus_plus", "gae")


def whiten(x: jax.Array, mask: jax.Array, shift_mean: bool = True) -> jax.Array:
    """(x - mean) / sqrt(var + 1e-8) over the masked entries of the whole array, var with
    Bessel's correction (n - 1, at least 1); shift_mean=False adds the mean back. float32[...],
    0 where mask is 0."""
    m = (mask > 0).astype(jnp.float32)
    n = jnp.sum(m)
    mean = jnp.sum(x * m) / jnp.maximum(n, 1.0)
    var = jnp.sum(jnp.square(x - mean) * m) / jnp.maximum(n - 1.0, 1.0)
    out = (x - mean) * jax.lax.rsqrt(var + 1e-8)
    if not shift_mean:
        out = out + mean
    return jnp.where(m > 0, out, 0.0)


def group_advantages(
    rewards: jax.Array,
    group_size: int,
    estimator: str = "grpo",
    norm_by_std: bool = True,
    baseline: jax.Array | None = None,
    eps: float = 1e-6,
    *,
    mask: jax.Array | None = None,
    gamma: float = 1.0,
) -> jax.Array:
    """Advantages from sequence rewards float32[B], rows in groups of G = group_size
    consecutive rows (one prompt). Returns float32[B] (broadcast over t by the loss), or
    float32[B, T] for reinforce_plus_plus.

    grpo: (R - mean_g) / (std_g + eps), std with Bessel's correction; a group of one gets 0.
      norm_by_std=False gives Dr.GRPO: R - mean_g.
    rloo: R_i - mean of the other G - 1 rewards (0 for G = 1).
    remax: R - baseline, the greedy completion's reward: baseline [B] or [B / G] (per prompt).
    reinforce_plus_plus: see reinforce_plus_plus(); needs mask [B, T], uses gamma.
    """
    r = rewards.astype(jnp.float32)
    if estimator == "remax":
        if baseline is None:
            raise ValueError("remax needs the greedy baseline rewards")
        base = baseline.astype(jnp.float32)
        if base.shape[0] != r.shape[0]:
            base = jnp.repeat(base, group_size, total_repeat_length=r.shape[0])
        return r - base
    if estimator == "reinforce_plus_plus":
        if mask is None:
            raise ValueError("reinforce_plus_plus needs the completion mask [B, T]")
        return reinforce_plus_plus(r, mask, gamma)
    if r.shape[0] % group_size:
        raise ValueError(f"{r.shape[0]} rows are not a whole number of groups of {group_size}")
    # centred on each group's first reward: the formulas are shift-invariant, and a group of
    # equal rewards is then exactly 0 (float32's mean of G equal values such as 0.1 is off by
    # a rounding step, which the division by a std of ~1e-7 would blow up to ~0.3)
    g = r.reshape(-1, group_size)
    g = g - g[:, :1]
    mean = jnp.mean(g, axis=1, keepdims=True)
    if estimator == "grpo":
        if not norm_by_std:
            return (g - mean).reshape(-1)
        if group_size < 2:
            return jnp.zeros_like(r)
        std = jnp.std(g, axis=1, keepdims=True, ddof=1)
        return ((g - mean) / (std + eps)).reshape(-1)
    if estimator == "rloo":
        if group_size < 2:
            return jnp.zeros_like(r)
        others = (jnp.sum(g, axis=1, keepdims=True) - g) / (group_size - 1)
        return (g - others).reshape(-1)
    raise ValueError(
        f"unknown group estimator {estimator!r}; gae needs a critic: use gae() "
        f"(all estimators: {ESTIMATORS})"
    )


def discounted_returns(token_rewards: jax.Array, mask: jax.Array, gamma: float) -> jax.Array:
    """G_t = r_t + gamma G_{t+1} over completion tokens (padding resets the sum and is 0):
    float32[B, T] from token_rewards float32[B, T]."""
    m = (mask > 0).astype(jnp.float32)

    def body(carry, x):
        r, mt = x
        ret = r + gamma * carry * mt
        return ret * mt, ret * mt

    _, out = jax.lax.scan(body, jnp.zeros(m.shape[0]), (token_rewards.T * m.T, m.T), reverse=True)
    return out.T


def last_token_rewards(rewards: jax.Array, mask: jax.Array) -> jax.Array:
    """[B] sequence rewards placed on each row's last completion token: float32[B, T]."""
    pos = jnp.arange(mask.shape[1])[None, :]
    last = jnp.max(jnp.where(mask > 0, pos, -1), axis=-1)
    return jnp.where(pos == last[:, None], rewards[:, None].astype(jnp.float32), 0.0)


def reinforce_plus_plus(rewards: jax.Array, mask: jax.Array, gamma: float = 1.0) -> jax.Array:
    """REINFORCE++: per-token discounted return of the sequence reward, whitened over the
    batch's completion tokens. float32[B, T]."""
    returns = discounted_returns(last_token_rewards(rewards, mask), mask, gamma)
    return whiten(returns, mask)


def gae(
    rewards: jax.Array, values: jax.Array, mask: jax.Array, gamma: float, lam: float
) -> tuple[jax.Array, jax.Array]:
    """Generalised advantage estimation over completion tokens.

    delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1}, V after the last
    completion token is 0. Returns (whitened advantages, returns = A + V before whitening),
    each float32[B, T].
    """
    m = (mask > 0).astype(jnp.float32)
    r = rewards.astype(jnp.float32) * m
    v = values.astype(jnp.float32) * m
    next_v = jnp.concatenate([v[:, 1:], jnp.zeros_like(v[:, :1])], axis=1)

    def body(carry, x):
        delta, mt, mnext = x
        adv = delta + gamma * lam * carry * mnext
        return adv * mt, adv * mt

    next_m = jnp.concatenate([m[:, 1:], jnp.zeros_like(m[:, :1])], axis=1)
    delta = r + gamma * next_v - v
    _, adv = jax.lax.scan(body, jnp.zeros(m.shape[0]), (delta.T, m.T, next_m.T), reverse=True)
    adv = adv.T
    returns = (adv + v) * m
    return whiten(adv, m), returns
