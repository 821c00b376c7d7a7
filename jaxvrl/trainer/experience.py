"""The experience phase of the train step: everything read from the old policy, computed once
per rollout batch over the whole batch before the first update, and held fixed across the
updates.

1. no-grad passes over the batch, in micro-batches: old policy (log-probs, entropy, attention
   masses), perturbed image (TPRL), reference policy (KL; with LoRA the same weights with the
   adapters off), critic values (GAE);
2. batch-level rules on [B, N] arrays: token-level rewards (score on the last completion token,
   minus kl_coef * KL(old || ref) with KL-in-reward), advantages (GAE or group estimators),
   the token methods (trainer/methods.py: visual dependency, perception/entropy masks, TAS,
   VGR weights); batch statistics (top-p over the batch, TAS min/max, whitening) span every
   row;
3. the ratio's old log-probs (the sampler's or the recomputed ones) and the rollout
   correction between the two.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx, struct

from jaxvrl import models, rl
from jaxvrl.models import lora
from jaxvrl.trainer import critic as critic_lib
from jaxvrl.trainer import methods
from jaxvrl.trainer.passes import (
    RolloutBatch,
    batch_rows,
    completion_hidden,
    interleave_rows,
    micro_split,
    paired_packing,
    perturbed_vision,
    router_mismatch,
    split_rows,
    take_rows,
    unpair_rows,
)
from jaxvrl.trainer.state import StepConfig, TrainState, join, split_trainable


@struct.dataclass
class Passes:
    """The no-grad passes' outputs, float32[B, N] (masses [L, B, N]); None where not run:
    the old policy's log-probs, entropies and attention masses, the perturbed image's
    log-probs, the reference's log-probs, the critic's values; route_mismatch float32[B, L]
    (a batch with the sampler's routes): per token, the sparse layers whose router would
    route it otherwise than the sampler did."""

    old_logp: jax.Array | None = None
    entropy: jax.Array | None = None
    vision_mass: jax.Array | None = None
    text_mass: jax.Array | None = None
    aug_logp: jax.Array | None = None
    ref_logp: jax.Array | None = None
    values: jax.Array | None = None
    route_mismatch: jax.Array | None = None


@struct.dataclass
class Rows:
    """What each update reads of a batch row, float32[B] or [B, N]; None where off.

    advantages; old_logp: the ratio's denominator (None: the loss pass's own, detached);
    ref_logp; aug_logp (shaping inside the loss pass); token_mask; token_weights; is_weights
    (rollout correction); old_values and returns (the critic's targets)."""

    advantages: jax.Array
    old_logp: jax.Array | None = None
    ref_logp: jax.Array | None = None
    aug_logp: jax.Array | None = None
    token_mask: jax.Array | None = None
    token_weights: jax.Array | None = None
    is_weights: jax.Array | None = None
    old_values: jax.Array | None = None
    returns: jax.Array | None = None


@struct.dataclass
class Extras:
    """What the markdown logs show of a step's rows: advantages [B] or [B, N], token weights
    [B, N] (None without VGR weights)."""

    advantages: jax.Array
    token_weights: jax.Array | None = None


@struct.dataclass
class Experience:
    """What the updates read, fixed for the step: rows, the batch's scalar metrics, the
    extras for the logs, and the KL-in-reward coefficient for the next step (None without
    KL in the reward)."""

    rows: Rows
    metrics: dict
    extras: Extras
    kl_coef: jax.Array | None = None


def no_grad_passes(
    graphdef, params, ref_params, batch: RolloutBatch, rng, cfg: StepConfig, critic=None
):
    """The no-grad passes over the batch (`Passes`). critic: None or (full backbone State or
    None when shared, head)."""
    model = nnx.merge(graphdef, params)
    ref = nnx.merge(graphdef, ref_params) if cfg.needs_ref else None
    perturb = cfg.needs_perturbed and (batch.images is not None or batch.videos is not None)
    # Blacken on the whole batch (not per micro-batch) so the split never changes the draw:
    # aug = the perturbed (images, videos)
    black = models.processor(model.config).black if perturb else None
    aug = perturbed_vision(batch, rng, cfg.tprl.black_prob, black) if perturb else None
    m = cfg.micro_batches
    # the old policy's log-probs and entropies: the sampler's, or a clean pass's
    clean = cfg.old_pass and not cfg.sampler_shaping
    if cfg.sampler_shaping and batch.old_entropy is None:
        raise ValueError(
            "the batch carries no sampler entropies (RolloutBatch.old_entropy): "
            "actor.shaping_source=sampler reads them; sample with entropies or set "
            "actor.shaping_source=recompute"
        )
    if cfg.sampler_shaping and cfg.needs_attention and batch.old_vision_mass is None:
        raise ValueError(
            "the batch carries no sampler attention masses (RolloutBatch.old_vision_mass): "
            "actor.shaping_source=sampler reads them for the token weights; sample with "
            "pools or set actor.shaping_source=recompute"
        )

    # the policy's passes over the rollout replay its routes (actor.routing_replay)
    policy_routing = "replay" if cfg.actor.routing_replay else "fresh"

    def one(args):
        mb, aug_mb = args
        logprobs = lambda m, c: c.logprobs(m, cfg.temperature)[0]  # noqa: E731
        res = {}
        per_row = aug_mb is not None and all(
            x.pixel_values.ndim == 3 for x in aug_mb if x is not None
        )
        paired = clean and per_row
        if aug_mb is not None:
            aug_mb = mb.replace(images=aug_mb[0], videos=aug_mb[1])
        if clean:
            # with a perturbed pass, the clean and the perturbed rows run as one batch of
            # interleaved rows: one forward reads each layer's weights once for both
            both = paired_packing(interleave_rows(mb, aug_mb)) if paired else mb
            routing = "replay" if cfg.actor.routing_replay else "compare"
            comp, out = completion_hidden(model, both, pools=cfg.needs_attention, routing=routing)
            logp, entropy = comp.logprobs(model, cfg.temperature, entropy="value")
            if paired:
                (logp, res["aug_logp"]), (entropy, _) = unpair_rows(logp), unpair_rows(entropy)
            res["old_logp"], res["entropy"] = logp, entropy
            if out.route_mismatch is not None:
                mismatch = out.route_mismatch
                res["route_mismatch"] = unpair_rows(mismatch)[0] if paired else mismatch
            if cfg.needs_attention:
                for name in ("vision_mass", "text_mass"):
                    mass = getattr(out, name)  # [L, rows, N]
                    res[name] = unpair_rows(mass, axis=1)[0] if paired else mass
            if critic is not None and critic[0] is None:
                values = comp.per_row(critic_lib.head_values(comp.hidden, critic[1]))
                res["values"] = unpair_rows(values)[0] if paired else values
        if aug_mb is not None and not paired:
            comp = completion_hidden(model, aug_mb, routing=policy_routing)[0]
            res["aug_logp"] = logprobs(model, comp)
        if ref is not None:
            res["ref_logp"] = logprobs(ref, completion_hidden(ref, mb)[0])
        if critic is not None and critic[0] is not None:
            res["values"] = critic_lib.values(graphdef, critic[0], critic[1], mb)
        return res

    sampled = (batch.old_logprobs, batch.old_entropy)
    # [B, L, N] -> [L, B, N], as the passes give them
    sampled_masses = [None if x is None else jnp.moveaxis(x, 1, 0)
                      for x in (batch.old_vision_mass, batch.old_text_mass)]  # fmt: skip
    # the passes do not read them
    batch = batch.replace(
        old_logprobs=None, old_entropy=None, old_vision_mass=None, old_text_mass=None
    )
    order = batch.pack_order
    if order is not None:  # packed micro-batches take the rows in the plan's balanced order
        starts = batch.pack_start
        batch = batch_rows(batch.replace(pack_order=None, pack_start=None), order)
        batch = batch.replace(pack_start=starts)
        aug = None if aug is None else take_rows(aug, order)
    micro_aug = None if aug is None else split_rows(aug, m)
    res = jax.lax.map(one, (micro_split(batch, m), micro_aug))
    res = jax.tree.map(jax.lax.stop_gradient, res)

    back = None if order is None else jnp.argsort(order)

    def merge_rows(x):
        if x.ndim == 4:  # masses [m, L, b, N] -> [L, B, N]
            x = jnp.moveaxis(x, 0, 1).reshape(x.shape[1], -1, x.shape[-1])
            return x if back is None else jnp.take(x, back, axis=1)
        x = x.reshape((-1,) + x.shape[2:])
        return x if back is None else jnp.take(x, back, axis=0)

    res = jax.tree.map(merge_rows, res)  # every row back in its place
    if cfg.sampler_shaping:
        res["old_logp"], res["entropy"] = sampled
        if cfg.needs_attention:
            res["vision_mass"], res["text_mass"] = sampled_masses
    return Passes(**res)


def advantages(batch: RolloutBatch, passes: Passes, cfg: StepConfig, kl_coef):
    """(advantages float32[B] or [B, N], returns [B, N] or None, metrics).

    Token-level rewards: the score on each row's last completion token, minus kl_coef * KL_t
    with KL-in-reward. GAE reads them with the critic's values; the group estimators read
    their row sums (verl), REINFORCE++ their discounted returns, REMAX with KL-in-reward
    each token's return less the greedy baseline (verl; without it, the row's reward less the
    baseline on every token)."""
    mask = batch.completion_mask
    metrics = {}
    if cfg.algorithm.use_kl_in_reward:
        token_rewards, kl_m = rl.kl_in_reward(
            batch.rewards,
            passes.old_logp,
            passes.ref_logp,
            mask,
            kl_coef,
            kind=cfg.algorithm.kl_penalty,
        )
        seq_rewards = kl_m["seq_rewards"]
        metrics.update(kl_reward=kl_m["kl"], kl_coef=kl_m["kl_coef"])
    else:
        token_rewards = rl.last_token_rewards(batch.rewards, mask)
        seq_rewards = batch.rewards
    returns = None
    if cfg.has_critic:
        adv, returns = rl.gae(
            token_rewards, passes.values, mask, cfg.algorithm.gamma, cfg.algorithm.lam
        )
        m = jnp.maximum(mask.sum(), 1)
        metrics.update(
            values_mean=jnp.sum(passes.values * mask) / m,
            returns_mean=jnp.sum(returns * mask) / m,
        )
    elif cfg.algorithm.adv_estimator == "reinforce_plus_plus":
        returns_t = rl.discounted_returns(token_rewards, mask, cfg.algorithm.gamma)
        adv = rl.whiten(returns_t, mask)
    elif cfg.algorithm.adv_estimator == "remax" and cfg.algorithm.use_kl_in_reward:
        # verl: each token's return (the rewards from it to the end) less the greedy baseline
        returns_t = rl.discounted_returns(token_rewards, mask, 1.0)
        adv = (returns_t - batch.baseline[:, None]) * mask
    else:
        adv = rl.group_advantages(
            seq_rewards,
            cfg.group_size,
            estimator=cfg.algorithm.adv_estimator,
            norm_by_std=cfg.algorithm.norm_adv_by_std,
            baseline=batch.baseline,
        )
    return adv, returns, metrics


def shaping(batch: RolloutBatch, passes: Passes, cfg: StepConfig, adv):
    """(advantages with TAS, token mask or None, token weights or None, metrics) for the
    whole batch: the token methods switched on (`cfg.terms`, trainer/methods.py) over the
    batch's columns and the passes' outputs."""
    cols = {
        "completion_mask": batch.completion_mask,
        "has_image": batch.has_image,
        "pools": batch.pools,
    }
    for f in dataclasses.fields(passes):  # the outputs of the passes that ran
        if getattr(passes, f.name) is not None:
            cols[f.name] = getattr(passes, f.name)
    return methods.shape(cfg.terms, cols, dict(cfg.options), adv)


def _next_kl_coef(kl_coef, kl, rows, cfg: StepConfig):
    """The KL controller's next beta, with n = the batch's rows with completion tokens
    (verl's n_steps, its batch size): the adaptive one's beta (1 + clip(KL / target - 1,
    -0.2, 0.2) n / horizon), the fixed one's beta."""
    k = cfg.algorithm.kl_ctrl
    if k.type == "fixed":
        ctrl = rl.FixedKLController(kl_coef)
    else:
        ctrl = rl.AdaptiveKLController(kl_coef, k.target_kl, k.horizon)
    return ctrl.update(kl, rows)


def _old_logprobs(batch: RolloutBatch, passes: Passes, cfg: StepConfig, metrics: dict):
    """(the ratio's old log-probs or None, is_weights or None) from the sampler or the
    recompute pass; metrics of the two's difference when both exist (logged under rollout/),
    and of the weights applied (rollout_is, rollout_is_band; logged under train/)."""
    sampler = batch.old_logprobs
    corrects = cfg.algorithm.rollout_is or cfg.algorithm.rollout_is_band is not None
    if (cfg.sampler_old or corrects) and sampler is None:
        raise ValueError(
            "the batch carries no sampler log-probs (RolloutBatch.old_logprobs): several "
            "updates per batch read them as the old log-probs, and rollout_is (and "
            "rollout_is_band) weighs them; assemble the batch with the sampler's log-probs "
            "or set old_logprobs='recompute'"
        )
    recomputed = cfg.old_pass and not cfg.sampler_shaping  # else the loss pass's own, exact
    old = sampler if cfg.sampler_old else passes.old_logp if recomputed else None
    if sampler is None or passes.old_logp is None or cfg.sampler_shaping:
        return old, None
    w, m = rl.rollout_correction(
        passes.old_logp,
        sampler,
        batch.completion_mask,
        cfg.algorithm.rollout_is,
        cfg.algorithm.rollout_is_threshold,
        cfg.algorithm.rollout_is_band,
    )
    # the applied weights' metrics are the train step's (train/rollout_is_*), the rest the
    # two log-probs' difference (rollout/)
    metrics.update({k if k.startswith("rollout_is_") else f"rollout/{k}": v for k, v in m.items()})
    return old, w


def experience(graphdef, state: TrainState, ref_params, batch: RolloutBatch, rng, cfg):
    """Experience of one rollout batch under the policy of `state` (no gradients). `rng`
    blackens the perturbed image's patches. With LoRA, ref_params is ignored (the reference
    is the base weights: adapters off)."""
    _, frozen = split_trainable(state.params, cfg)
    if cfg.needs_ref and cfg.uses_lora:
        ref_params = lora.lora_off(state.params)
    elif ref_params is not None and cfg.actor.offload_reference:  # held in host memory
        ref_params = jax.device_put(ref_params, jax.memory.Space.Device)
    critic = None
    if cfg.has_critic:
        cp = state.critic_params
        backbone = None if cfg.critic.share_backbone else join(cp["backbone"], frozen)
        critic = (backbone, cp["head"])
    passes = no_grad_passes(graphdef, state.params, ref_params, batch, rng, cfg, critic)
    adv, returns, metrics = advantages(batch, passes, cfg, state.kl_coef)
    token_mask = weights = None
    if not cfg.shaping_in_loss:  # else masks, weights and TAS come out of the loss pass
        adv, token_mask, weights, shaping_metrics = shaping(batch, passes, cfg, adv)
        metrics.update(shaping_metrics)
    old_logp, is_weights = _old_logprobs(batch, passes, cfg, metrics)
    rows = Rows(
        advantages=adv,
        old_logp=old_logp,
        ref_logp=passes.ref_logp,
        aug_logp=passes.aug_logp if cfg.shaping_in_loss else None,
        token_mask=token_mask,
        token_weights=weights,
        is_weights=is_weights,
        old_values=passes.values if cfg.has_critic else None,
        returns=returns,
    )
    mask = batch.completion_mask
    tokens = jnp.maximum(mask.sum(), 1)
    if passes.route_mismatch is not None:
        metrics["router_mismatch"] = router_mismatch(passes.route_mismatch, batch)
    if cfg.old_pass:  # else the loss passes report the entropy and the KL
        metrics["entropy"] = jnp.sum(passes.entropy * mask) / tokens
        if passes.ref_logp is not None:
            kl = rl.kl_penalty(passes.old_logp, passes.ref_logp, cfg.actor.kl_loss_type)
            metrics["kl"] = jnp.sum(kl * mask) / tokens
    kl_coef = None
    if cfg.algorithm.use_kl_in_reward:
        real = jnp.sum(mask.sum(axis=1) > 0)  # padding rows (unfilled groups) are not rows
        kl_coef = _next_kl_coef(state.kl_coef, metrics["kl_reward"], real, cfg)
    return Experience(rows, metrics, Extras(adv, weights), kl_coef)
