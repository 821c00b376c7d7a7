"""The experience phase of the train step: everything read from the old policy, computed once
per rollout batch over the whole batch before the first update, and held fixed across the
updates.

1. no-grad passes over the batch, in micro-batches: old policy (log-probs, entropy, attention
   masses), perturbed image (TPRL), reference policy (KL; with LoRA the same weights with the
   adapters off), critic values (GAE);
2. batch-level rules on [B, N] arrays: token-level rewards (score on the last completion token,
   minus kl_coef * KL(old || ref) with KL-in-reward), advantages (GAE or group estimators),
   visual dependency, perception/entropy masks, TAS, VGR weights; batch statistics (top-p
   over the batch, TAS min/max, whitening) span every row;
3. the ratio's old log-probs (the sampler's or the recomputed ones) and the rollout
   correction between the two.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxvrl import rl
from jaxvrl.models import lora
from jaxvrl.trainer import critic as critic_lib
from jaxvrl.trainer.policy import (
    RolloutBatch,
    blacken_patches,
    completion_hidden,
    completion_logprobs,
    interleave_rows,
    micro_split,
    split_rows,
    unpair_rows,
)
from jaxvrl.trainer.state import StepConfig, TrainState, join, split_trainable


@dataclasses.dataclass
class Experience:
    """What the updates read, fixed for the step.

    rows: per-row arrays, float32[B] or [B, N]: advantages, and as configured old_logp (the
    ratio's denominator; absent: the loss pass's own, detached), ref_logp, aug_logp (shaping
    inside the loss pass), token_mask, token_weights, is_weights, old_values, returns.
    metrics: scalars of the batch. extras: advantages and token weights for the markdown logs.
    kl_coef: the KL-in-reward coefficient for the next step (None without KL in the reward).
    """

    rows: dict
    metrics: dict
    extras: dict
    kl_coef: jax.Array | None = None


def no_grad_passes(
    graphdef, params, ref_params, batch: RolloutBatch, rng, cfg: StepConfig, critic=None
):
    """Old-policy, perturbed, reference and critic quantities, each float32[B, N] (masses
    [L, B, N]). critic: None or (full backbone State or None when shared, head)."""
    model = nnx.merge(graphdef, params)
    ref = nnx.merge(graphdef, ref_params) if cfg.needs_ref else None
    perturb = cfg.needs_perturbed and batch.images is not None
    # Blacken on the whole batch (not per micro-batch) so the split never changes the draw.
    aug = blacken_patches(batch.images, rng, cfg.black_prob) if perturb else None
    m = cfg.micro_batches

    def one(args):
        mb, aug_mb = args
        tokens = mb.input_ids[:, -mb.completion_length :]
        logprobs = lambda m, h, **kw: completion_logprobs(  # noqa: E731
            m, h, tokens, cfg.temperature, **kw
        )[0]
        res = {}
        paired = cfg.old_pass and aug_mb is not None and aug_mb.pixel_values.ndim == 3
        if cfg.old_pass:
            # with a perturbed pass, the clean and the perturbed rows run as one batch of
            # interleaved rows: one forward reads each layer's weights once for both
            both = interleave_rows(mb, mb.replace(images=aug_mb)) if paired else mb
            hidden, out = completion_hidden(model, both, pools=cfg.token_weights)
            logp, entropy = completion_logprobs(
                model,
                hidden,
                jnp.repeat(tokens, 2, axis=0) if paired else tokens,
                cfg.temperature,
                entropy="value",
            )
            if paired:
                (logp, res["aug_logp"]), (entropy, _) = unpair_rows(logp), unpair_rows(entropy)
                hidden = unpair_rows(hidden)[0]
            res["old_logp"], res["entropy"] = logp, entropy
            if cfg.token_weights:
                n = mb.completion_length
                for name in ("vision_mass", "text_mass"):
                    mass = getattr(out, name)  # [L, rows, T]
                    mass = unpair_rows(mass, axis=1)[0] if paired else mass
                    res[name] = mass[:, :, -n - 1 : -1]
            if critic is not None and critic[0] is None:
                res["values"] = critic_lib.head_values(hidden, critic[1])
        if aug_mb is not None and not paired:
            res["aug_logp"] = logprobs(model, completion_hidden(model, mb, images=aug_mb)[0])
        if ref is not None:
            res["ref_logp"] = logprobs(ref, completion_hidden(ref, mb)[0])
        if critic is not None and critic[0] is not None:
            res["values"] = critic_lib.values(graphdef, critic[0], critic[1], mb)
        return res

    micro_aug = None if aug is None else split_rows(aug, m)
    batch = batch.replace(old_logprobs=None)  # the passes do not read it
    res = jax.lax.map(one, (micro_split(batch, m), micro_aug))
    res = jax.tree.map(jax.lax.stop_gradient, res)

    def merge_rows(x):
        if x.ndim == 4:  # masses [m, L, b, N] -> [L, B, N]
            return jnp.moveaxis(x, 0, 1).reshape(x.shape[1], -1, x.shape[-1])
        return x.reshape((-1,) + x.shape[2:])

    return jax.tree.map(merge_rows, res)


def advantages(batch: RolloutBatch, passes: dict, cfg: StepConfig, kl_coef):
    """(advantages float32[B] or [B, N], returns [B, N] or None, metrics).

    Token-level rewards: the score on each row's last completion token, minus kl_coef * KL_t
    with KL-in-reward. GAE reads them with the critic's values; the group estimators read
    their row sums (verl), REINFORCE++ their discounted returns."""
    mask = batch.completion_mask
    metrics = {}
    if cfg.use_kl_in_reward:
        token_rewards, kl_m = rl.kl_in_reward(
            batch.rewards,
            passes["old_logp"],
            passes["ref_logp"],
            mask,
            kl_coef,
            kind=cfg.kl_in_reward_type,
        )
        seq_rewards = kl_m["seq_rewards"]
        metrics.update(kl_reward=kl_m["kl"], kl_coef=kl_m["kl_coef"])
    else:
        token_rewards = rl.last_token_rewards(batch.rewards, mask)
        seq_rewards = batch.rewards
    returns = None
    if cfg.critic:
        adv, returns = rl.gae(token_rewards, passes["values"], mask, cfg.gamma, cfg.lam)
        m = jnp.maximum(mask.sum(), 1)
        metrics.update(
            values_mean=jnp.sum(passes["values"] * mask) / m,
            returns_mean=jnp.sum(returns * mask) / m,
        )
    elif cfg.adv_estimator == "reinforce_plus_plus":
        returns_t = rl.discounted_returns(token_rewards, mask, cfg.gamma)
        adv = rl.whiten(returns_t, mask)
    else:
        adv = rl.group_advantages(
            seq_rewards,
            cfg.group_size,
            estimator=cfg.adv_estimator,
            norm_by_std=cfg.norm_adv_by_std,
            baseline=batch.baseline,
        )
    return adv, returns, metrics


def shaping(batch: RolloutBatch, passes: dict, cfg: StepConfig, adv):
    """(advantages with TAS, token mask or None, token weights or None, metrics) for the
    whole batch: visual dependency, perception / entropy masks, TAS, VGR weights."""
    mask = batch.completion_mask
    metrics = {}
    token_mask = None
    if "aug_logp" in passes:
        score = rl.visual_dependency(passes["aug_logp"], passes["old_logp"], mask)
        metrics["sensitivity_score_mean"] = jnp.sum(score * mask) / jnp.maximum(mask.sum(), 1)
        if cfg.perception_filtering:
            token_mask = rl.top_p_token_mask(score, mask, cfg.top_p_perception_tokens)
        if cfg.trajectory_reweighting:
            # rows without an image have no visual dependency: alpha = 1, left out of the mean
            alpha = rl.trajectory_scaling(
                score, mask, cfg.trajectory_scaling_min, row_mask=batch.has_image
            )
            metrics["scaling_factor_mean"] = jnp.mean(alpha)
            adv = adv * (alpha if adv.ndim == 1 else alpha[:, None])
    if cfg.entropy_filtering:
        ent_mask = rl.entropy_token_mask(
            passes["entropy"], mask, cfg.top_p_entropy_tokens, scope=cfg.entropy_filter_scope
        )
        token_mask = ent_mask if token_mask is None else jnp.maximum(token_mask, ent_mask)
    if token_mask is not None:
        metrics["perception_token_fraction"] = jnp.sum(token_mask * mask) / jnp.maximum(
            mask.sum(), 1
        )
    weights = None
    if cfg.token_weights:
        vgr = rl.per_token_vgr(
            passes["vision_mass"],
            passes["text_mass"],
            batch.pools["vision"].sum(-1),
            batch.pools["text"].sum(-1),
            layer_set=cfg.token_weight_layer_set,
            last_k=cfg.token_weight_last_k_layers,
        )
        weights = rl.vgr_token_weights(
            vgr,
            mask,
            clip=cfg.token_weight_clip,
            smooth_sigma=cfg.token_weight_smooth_sigma,
            has_image=batch.has_image,
        )
        metrics["token_weight_mean"] = jnp.sum(weights * mask) / jnp.maximum(mask.sum(), 1)
    return adv, token_mask, weights, metrics


def _next_kl_coef(kl_coef, kl, rows: int, cfg: StepConfig):
    """The adaptive controller's beta (1 + clip(KL / target - 1, -0.2, 0.2) n / horizon), with
    n = rows of the batch (verl's n_steps); the fixed controller keeps beta."""
    if cfg.kl_ctrl_type == "fixed":
        return kl_coef
    e = jnp.clip(kl / cfg.kl_target - 1.0, -0.2, 0.2)
    return kl_coef * (1.0 + e * rows / cfg.kl_horizon)


def _old_logprobs(batch: RolloutBatch, passes: dict, cfg: StepConfig, rows: dict, metrics):
    """rows["old_logp"] (and is_weights) from the sampler or the recompute pass; metrics of
    the two's difference when both exist (logged under rollout/)."""
    sampler = batch.old_logprobs
    if (cfg.sampler_old or cfg.rollout_is) and sampler is None:
        raise ValueError(
            "the batch carries no sampler log-probs (RolloutBatch.old_logprobs): several "
            "updates per batch read them as the old log-probs, and rollout_is weighs them; "
            "assemble the batch with the sampler's log-probs or set old_logprobs='recompute'"
        )
    if cfg.sampler_old:
        rows["old_logp"] = sampler
    elif cfg.old_pass:
        rows["old_logp"] = passes["old_logp"]
    if sampler is None or "old_logp" not in passes:
        return
    w, m = rl.rollout_correction(
        passes["old_logp"],
        sampler,
        batch.completion_mask,
        cfg.rollout_is,
        cfg.rollout_is_threshold,
    )
    metrics.update({f"rollout/{k}": v for k, v in m.items()})
    if w is not None:
        rows["is_weights"] = w


def experience(graphdef, state: TrainState, ref_params, batch: RolloutBatch, rng, cfg):
    """Experience of one rollout batch under the policy of `state` (no gradients). `rng`
    blackens the perturbed image's patches. With LoRA, ref_params is ignored (the reference
    is the base weights: adapters off)."""
    _, frozen = split_trainable(state.params, cfg)
    if cfg.needs_ref and cfg.lora:
        ref_params = lora.lora_off(state.params)
    critic = None
    if cfg.critic:
        cp = state.critic_params
        backbone = None if cfg.critic_share_backbone else join(cp["backbone"], frozen)
        critic = (backbone, cp["head"])
    passes = no_grad_passes(graphdef, state.params, ref_params, batch, rng, cfg, critic)
    adv, returns, metrics = advantages(batch, passes, cfg, state.kl_coef)
    token_mask = weights = None
    if not cfg.shaping_in_loss:  # else masks, weights and TAS come out of the loss pass
        adv, token_mask, weights, shaping_metrics = shaping(batch, passes, cfg, adv)
        metrics.update(shaping_metrics)
    rows = {"advantages": adv}
    _old_logprobs(batch, passes, cfg, rows, metrics)
    keep = ("ref_logp", "aug_logp") if cfg.shaping_in_loss else ("ref_logp",)
    rows.update({k: passes[k] for k in keep if k in passes})
    if token_mask is not None:
        rows["token_mask"] = token_mask
    if weights is not None:
        rows["token_weights"] = weights
    if cfg.critic:
        rows.update(old_values=passes["values"], returns=returns)
    mask = batch.completion_mask
    tokens = jnp.maximum(mask.sum(), 1)
    if cfg.old_pass:  # else the loss passes report the entropy and the KL
        metrics["entropy"] = jnp.sum(passes["entropy"] * mask) / tokens
        if "ref_logp" in passes:
            kl = rl.kl_penalty(passes["old_logp"], passes["ref_logp"], cfg.kl_loss_type)
            metrics["kl"] = jnp.sum(kl * mask) / tokens
    kl_coef = None
    if cfg.use_kl_in_reward:
        kl_coef = _next_kl_coef(state.kl_coef, metrics["kl_reward"], mask.shape[0], cfg)
    extras = {"advantages": adv, "token_weights": weights}
    return Experience(rows, metrics, extras, kl_coef)
