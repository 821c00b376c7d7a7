"""Policy, KL, entropy and value losses (docs/algorithms.md, from #policy-loss on). float32
math, [B, T] arrays."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxvrl.rl.advantages import last_token_rewards

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_KINDS = ("kl", "abs", "mse", "low_var_kl")
KL_CONTROLLERS = ("fixed", "adaptive")  # the KL-in-reward coefficient: constant or adaptive_kl_coef


def agg_denominator(mask: jax.Array, mode: str) -> jax.Array:
    """What `mode` divides by on these rows: sum of the (weighted) mask for token-mean, else
    the number of rows with >= 1 completion token. Sum it over micro-batches (or psum it over
    devices) and pass it to agg_loss(denominator=...) to make the micro-batch losses add up
    to the whole-batch loss. float32[]."""
    m = mask.astype(jnp.float32)
    if mode == "token-mean":
        return jnp.sum(m)
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r} (one of {AGG_MODES})")
    return jnp.sum(jnp.sum(m, axis=-1) > 0).astype(jnp.float32)


def agg_loss(
    values: jax.Array,
    mask: jax.Array,
    mode: str,
    denominator: jax.Array | None = None,
    horizon: int | None = None,
) -> jax.Array:
    """Aggregate per-token values float32[B, T] with a (possibly weighted) mask [B, T].

    token-mean (DAPO): sum(m l) / sum(m); seq-mean-token-mean (GRPO): mean over rows of
    sum_t(m l) / sum_t m; seq-mean-token-sum: mean over rows of sum_t(m l);
    seq-mean-token-sum-norm (Dr.GRPO): sum(m l) / (rows * T), T = `horizon` (the longest
    completion allowed, max_new_tokens; default values.shape[-1], the padded length: pass
    it where the completion axis is cut to the batch). "rows" are the rows with at least one completion token;
    an empty row adds nothing. `denominator` replaces sum(m) resp. rows by a global count from
    agg_denominator(). Returns float32[].
    """
    m = mask.astype(jnp.float32)
    ml = values.astype(jnp.float32) * m
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r} (one of {AGG_MODES})")
    den = agg_denominator(m, mode) if denominator is None else denominator
    # An all-padding batch gives 0, not NaN (its numerator is 0 too).
    den = jnp.maximum(jnp.asarray(den, jnp.float32), 1e-8)
    if mode == "token-mean":
        return jnp.sum(ml) / den
    row_sum = jnp.sum(ml, axis=-1)
    if mode == "seq-mean-token-mean":
        row_mass = jnp.sum(m, axis=-1)
        per_row = jnp.where(row_mass > 0, row_sum / jnp.where(row_mass > 0, row_mass, 1.0), 0.0)
        return jnp.sum(per_row) / den
    if mode == "seq-mean-token-sum":
        return jnp.sum(row_sum) / den
    return jnp.sum(row_sum) / (den * (values.shape[-1] if horizon is None else horizon))


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
    denominator: jax.Array | None = None,
    horizon: int | None = None,
) -> tuple[jax.Array, dict]:
    """PPO clipped surrogate with dual clip (docs/algorithms.md#policy-loss). logp, old_logp,
    mask: [B, T]; advantages: float32[B] (one per row) or float32[B, T].

    r = exp(clip(logp - old, -20, 20)); l = max(-A r, -A clip(r, 1 - low, 1 + high)); for
    A < 0, l = min(l, -dual A). DAPO: high = 0.28, token-mean; GRPO: seq-mean-token-mean.
    token_mask [B, T] multiplies l (the denominator still counts every completion token);
    token_weights [B, T] replace m by m w in numerator and denominator; denominator: the
    global count from agg_denominator(m or m w, mode) for micro-batching; horizon: T of
    seq-mean-token-sum-norm (`agg_loss`).

    Returns (loss float32[], metrics): clip_frac (either side), clip_frac_high (A > 0,
    r > 1 + high), clip_frac_low (A < 0, r < 1 - low), dual_clip_frac, approx_kl
    (k1 = mean(old - logp)), approx_kl_k3 (mean(r - 1 - log r)), ratio_mean; all token means
    over the completion mask.
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
    loss_t = jnp.where(a < 0, jnp.minimum(clipped, l3), clipped)
    if token_mask is not None:
        loss_t = loss_t * token_mask.astype(jnp.float32)
    agg_mask = m if token_weights is None else m * token_weights.astype(jnp.float32)
    loss = agg_loss(loss_t, agg_mask, loss_agg_mode, denominator, horizon)
    tm = lambda x: agg_loss(x.astype(jnp.float32), m, "token-mean")
    # Gradients never flow into the metrics.
    log_ratio, ratio = jax.lax.stop_gradient(log_ratio), jax.lax.stop_gradient(ratio)
    is_clipped = jax.lax.stop_gradient(l2 > l1)
    metrics = {
        "clip_frac": tm(is_clipped),
        "clip_frac_high": tm(is_clipped & (a > 0)),
        "clip_frac_low": tm(is_clipped & (a < 0)),
        "dual_clip_frac": tm(jax.lax.stop_gradient((a < 0) & (clipped > l3))),
        "approx_kl": tm(-log_ratio),
        "approx_kl_k3": tm(ratio - 1.0 - log_ratio),
        "ratio_mean": tm(ratio),
    }
    return loss, metrics


def rollout_correction(
    old_logp: jax.Array,
    sampler_logp: jax.Array,
    mask: jax.Array,
    level: str | None = None,
    threshold: float = 2.0,
    band: tuple[float, float] | None = None,
) -> tuple[jax.Array | None, dict]:
    """Truncated importance weights for sampling in other numerics than training (verl's
    rollout_is), with IcePop's band. old_logp: the recomputed old policy's log-probs,
    sampler_logp: the sampler's, mask: [B, T]. With d = old - sampler, the ratio r_t =
    exp(d_t) at level "token" (and with level None), exp(sum_t m d_t) on every token of the
    row at "sequence"; exponents clamped to +-20. The weight: min(r, threshold) ("token",
    "sequence") or 1 (None), times 0 where `band` = (lo, hi) is set and r lies outside
    [lo, hi]. None with neither a level nor a band.

    Returns (weights float32[B, T] or None (the loss multiplies its per-token terms by them),
    metrics): logprob_abs_diff_mean / _max of |d| over the mask; with weights is_weight_mean
    and rollout_is_mean (token mean of the weights), rollout_is_clip_frac (share of tokens
    whose ratio exceeds the threshold, truncated; 0 with level None), and with a band
    rollout_is_band_frac (share of tokens the band masks)."""
    m = (mask > 0).astype(jnp.float32)
    d = (old_logp.astype(jnp.float32) - sampler_logp.astype(jnp.float32)) * m
    metrics = {
        "logprob_abs_diff_mean": agg_loss(jnp.abs(d), m, "token-mean"),
        "logprob_abs_diff_max": jnp.max(jnp.abs(d)),
    }
    if level is None and band is None:
        return None, metrics
    if level in (None, "token"):
        log_r = d
    elif level == "sequence":
        log_r = jnp.broadcast_to(jnp.sum(d, axis=-1, keepdims=True), d.shape)
    else:
        raise ValueError(f"unknown rollout_is level {level!r} (token | sequence | None)")
    r = jnp.exp(jnp.clip(log_r, -20.0, 20.0))
    if level is None:
        w, truncated = jnp.ones_like(r), jnp.zeros_like(r)
    else:
        w, truncated = jnp.minimum(r, threshold), (r > threshold).astype(jnp.float32)
    if band is not None:
        lo, hi = band
        outside = ((r < lo) | (r > hi)).astype(jnp.float32)
        w = w * (1.0 - outside)
        metrics["rollout_is_band_frac"] = agg_loss(outside, m, "token-mean")
    w = w * m
    metrics["is_weight_mean"] = agg_loss(w, m, "token-mean")
    metrics["rollout_is_mean"] = metrics["is_weight_mean"]
    metrics["rollout_is_clip_frac"] = agg_loss(truncated, m, "token-mean")
    return jax.lax.stop_gradient(w), metrics


def kl_penalty(logp: jax.Array, ref_logp: jax.Array, kind: str = "low_var_kl") -> jax.Array:
    """Per-token KL estimate, float32[B, T], with x = logp - ref_logp: kl x, abs |x|,
    mse x^2 / 2, low_var_kl clip(exp(-x) + x - 1, -10, 10) with the exponent -x clamped to
    +-20 (k3; equals TRL's exp(ref - logp) - (ref - logp) - 1)."""
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


def kl_in_reward(
    rewards: jax.Array,
    logp: jax.Array,
    ref_logp: jax.Array,
    mask: jax.Array,
    beta: float | jax.Array,
    kind: str = "kl",
) -> tuple[jax.Array, dict]:
    """KL subtracted from the reward (`use_kl_in_reward`): the sequence reward float32[B] sits
    on each row's last completion token and every token pays beta * KL_t (KL_t from
    kl_penalty of the rollout policy's logp vs the reference, [B, T]).

    Returns (token_rewards float32[B, T], metrics): seq_rewards [B] = R - beta sum_t KL_t
    (for group estimators; a row without a token in `mask`, a truncated one left out of the
    loss, keeps its R there, as in the group's statistics without KL-in-reward), kl = mean
    over rows of the per-row token-mean KL (feed it to the adaptive controller), kl_coef = beta.
    """
    m = (mask > 0).astype(jnp.float32)
    kl = kl_penalty(logp, ref_logp, kind) * m
    token_rewards = last_token_rewards(rewards, m) - beta * kl
    rows = jnp.sum(m, -1) > 0
    per_row = jnp.sum(kl, -1) / jnp.maximum(jnp.sum(m, -1), 1.0)
    metrics = {
        "seq_rewards": rewards - beta * jnp.sum(kl, -1),
        "kl": jnp.sum(per_row) / jnp.maximum(jnp.sum(rows), 1),
        "kl_coef": jnp.asarray(beta, jnp.float32),
    }
    return token_rewards, metrics


def entropy_bonus(
    entropy: jax.Array,
    mask: jax.Array,
    mode: str,
    coef: float = 1.0,
    denominator=None,
    horizon: int | None = None,
) -> jax.Array:
    """Term to add to the loss for the entropy bonus: -coef * agg(H), H float32[B, T] the
    policy's per-token entropy (`entropy_coef`); denominator, horizon: as `agg_loss`'s.
    float32[]."""
    return -coef * agg_loss(entropy, mask, mode, denominator, horizon)


def entropy_penalty(
    logp: jax.Array,
    mask: jax.Array,
    mode: str,
    coef: float = 1.0,
    denominator=None,
    horizon: int | None = None,
) -> jax.Array:
    """Term to add to the loss for the entropy penalty (VPPO): coef * agg(-logp), logp
    float32[B, T] of the sampled tokens (`entropy_penalty_coef`, VPPO 0.06); denominator,
    horizon: as `agg_loss`'s. float32[]."""
    return coef * agg_loss(-logp, mask, mode, denominator, horizon)


def value_loss(
    values: jax.Array,
    old_values: jax.Array,
    returns: jax.Array,
    mask: jax.Array,
    clip_range: float = 0.2,
    loss_agg_mode: str = "token-mean",
    denominator: jax.Array | None = None,
) -> tuple[jax.Array, dict]:
    """Clipped critic loss 0.5 agg(max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)).

    values, old_values, returns, mask: [B, T]. Returns (loss float32[], metrics: vf_clip_frac
    = token share where the clipped term is larger, vpred_mean)."""
    m = (mask > 0).astype(jnp.float32)
    v = values.astype(jnp.float32)
    old = old_values.astype(jnp.float32)
    ret = returns.astype(jnp.float32)
    clipped = old + jnp.clip(v - old, -clip_range, clip_range)
    l1 = jnp.square(v - ret)
    l2 = jnp.square(clipped - ret)
    loss = 0.5 * agg_loss(jnp.maximum(l1, l2), m, loss_agg_mode, denominator)
    metrics = {
        "vf_clip_frac": agg_loss(
            jax.lax.stop_gradient(l2 > l1).astype(jnp.float32), m, "token-mean"
        ),
        "vpred_mean": agg_loss(jax.lax.stop_gradient(v), m, "token-mean"),
    }
    return loss, metrics


def adaptive_kl_coef(
    beta: float, current_kl: float, target: float, horizon: int, n_steps: int
) -> float:
    """beta (1 + e n_steps / horizon) with e = clip(KL / target - 1, -0.2, 0.2): Python
    numbers on the host, or jax arrays (jit-able, as the train step calls it)."""
    e = current_kl / target - 1.0
    e = jnp.clip(e, -0.2, 0.2) if isinstance(e, jax.Array) else min(max(e, -0.2), 0.2)
    return beta * (1.0 + e * n_steps / horizon)


@dataclasses.dataclass
class FixedKLController:
    """KL coefficient that never changes (on the host, or inside jit on an array)."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> float:
        del current_kl, n_steps
        return self.value


@dataclasses.dataclass
class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al.; verl): see adaptive_kl_coef (on the host, or
    inside jit on arrays: the train step builds one per step from its state's beta)."""

    value: float
    target: float
    horizon: int

    def update(self, current_kl: float, n_steps: int) -> float:
        self.value = adaptive_kl_coef(self.value, current_kl, self.target, self.horizon, n_steps)
        return self.value
