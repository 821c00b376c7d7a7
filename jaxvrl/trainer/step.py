"""The fused train step: one XLA program from a rollout batch to updated parameters.

Order inside the program (SPEC sections 2-5):
1. no-grad passes over the batch, in micro-batches: old policy (log-probs, entropy, attention
   masses), perturbed image (TPRL), reference policy (KL; with LoRA the same weights with the
   adapters off), critic values (GAE);
2. batch-level rules on [B, N] arrays: token-level rewards (score on the last completion token,
   minus kl_coef * KL(old || ref) with KL-in-reward), advantages (GAE or group estimators),
   visual dependency, perception/entropy masks, TAS, VGR weights;
3. gradients of the critic's clipped value loss and of the policy loss, each accumulated over
   micro-batches with global denominators, then both optax updates (the policy's only after
   the critic warm-up steps). With LoRA only the adapters are differentiated and updated. A
   non-finite loss or gradient skips the update (counted in metrics).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from jaxvrl import rl
from jaxvrl.models import lora
from jaxvrl.trainer import critic as critic_lib
from jaxvrl.trainer.policy import (
    RolloutBatch,
    blacken_patches,
    completion_hidden,
    completion_logprobs,
)


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Everything the step needs, read from the ConfigDict by train.py only."""

    group_size: int
    temperature: float = 1.0
    micro_batches: int = 1
    adv_estimator: str = "grpo"
    norm_adv_by_std: bool = True
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_dual: float = 3.0
    loss_agg_mode: str = "token-mean"
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "low_var_kl"
    entropy_coef: float = 0.0
    use_entropy_penalty: bool = False
    entropy_penalty_coef: float = 0.0
    perception_filtering: bool = False
    top_p_perception_tokens: float = 0.2
    black_prob: float = 0.5
    entropy_filtering: bool = False
    top_p_entropy_tokens: float = 0.2
    entropy_filter_scope: str = "sequence"
    trajectory_reweighting: bool = False
    trajectory_scaling_min: float = 0.8
    token_weights: bool = False
    token_weight_clip: tuple[float, float] = (0.2, 3.0)
    token_weight_smooth_sigma: float = 0.0
    token_weight_last_k_layers: int = 0
    token_weight_layer_set: str = "all"
    # GAE and the critic (adv_estimator="gae")
    gamma: float = 1.0
    lam: float = 1.0
    critic_lr: float = 1e-5
    critic_grad_clip: float = 1.0
    critic_warmup_steps: int = 0  # the policy is not updated before this step
    critic_share_backbone: bool = False  # value head on the policy's hidden states
    cliprange_value: float = 0.5
    value_loss_coef: float = 0.5
    # KL subtracted from the token-level reward (verl's use_kl_in_reward)
    use_kl_in_reward: bool = False
    kl_in_reward_type: str = "kl"
    kl_ctrl_type: str = "fixed"  # fixed | adaptive
    kl_target: float = 0.1
    kl_horizon: int = 10000
    # LoRA: only the adapters (and the vision tower with lora_train_vision) are trained
    lora: bool = False
    lora_train_vision: bool = False

    @property
    def needs_perturbed(self) -> bool:
        return self.perception_filtering or self.trajectory_reweighting

    @property
    def needs_ref(self) -> bool:
        return (self.use_kl_loss and self.kl_loss_coef > 0) or self.use_kl_in_reward

    @property
    def shapes_tokens(self) -> bool:
        """Whether token masks, token weights or TAS read per-token old-policy quantities."""
        return self.needs_perturbed or self.entropy_filtering or self.token_weights

    @property
    def shaping_in_loss(self) -> bool:
        """Masks, weights and TAS computed inside the loss pass from its own (stop-gradient)
        log-probs, entropies and attention masses: possible when that pass sees the whole
        batch at once (one micro-batch; batch-level statistics stay batch-level)."""
        return self.shapes_tokens and self.micro_batches == 1 and not self.old_pass

    @property
    def old_pass(self) -> bool:
        """Whether a no-grad old-policy pass runs before the loss. The step makes one update
        per batch, so the old policy is the current one, and the loss pass can supply the old
        log-probs (old = stop_gradient(logp), as TRL does), entropies and attention masses
        itself: the extra forward is needed only for what must be known before the loss (the
        KL in the reward, the critic's values) or for token shaping over several
        micro-batches, whose statistics span the whole batch."""
        return (
            self.use_kl_in_reward or self.critic or (self.shapes_tokens and self.micro_batches > 1)
        )

    @property
    def critic(self) -> bool:
        return self.adv_estimator == "gae"

    @property
    def trainable(self):
        """nnx filter of the policy's (and critic backbone's) trained params."""
        return lora.trainable_filter(self.lora, self.lora_train_vision)


@struct.dataclass
class TrainState:
    params: Any  # every policy weight (with LoRA: base + adapters), an nnx.State
    opt_state: Any  # of the trainable part only
    step: jax.Array
    skipped: jax.Array  # updates skipped for a non-finite loss or gradient
    # {"backbone": trainable part (absent with a shared backbone), "head": {"kernel", "bias"}}
    critic_params: Any = None
    critic_opt_state: Any = None
    kl_coef: Any = None  # float32[] KL-in-reward coefficient (adaptive controller updates it)


def split_trainable(params, cfg: StepConfig):
    """params -> (trainable, frozen); frozen is None for full fine-tuning."""
    if not cfg.lora:
        return params, None
    return lora.split_params(params, cfg.trainable)


def join(trainable, frozen):
    return trainable if frozen is None else nnx.merge_state(trainable, frozen)


def _split_rows(tree, m: int):
    """[B, ...] -> [m, B/m, ...] on every array whose leading axis is the batch."""
    return jax.tree.map(lambda x: x.reshape((m, x.shape[0] // m) + x.shape[1:]), tree)


def _row_tree(batch: RolloutBatch):
    """The parts of a batch with a leading row axis (position_ids has it second)."""
    return dataclasses.replace(batch, position_ids=jnp.moveaxis(batch.position_ids, 1, 0))


def _micro(batch: RolloutBatch, m: int):
    rows = _split_rows(_row_tree(batch), m)
    return dataclasses.replace(rows, position_ids=jnp.moveaxis(rows.position_ids, 2, 1))


def _no_grad_passes(
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
        if cfg.old_pass:
            hidden, out = completion_hidden(model, mb, pools=cfg.token_weights)
            res["old_logp"], res["entropy"] = completion_logprobs(
                model, hidden, tokens, cfg.temperature, entropy="value"
            )
            if cfg.token_weights:
                n = mb.completion_length
                res["vision_mass"] = out.vision_mass[:, :, -n - 1 : -1]
                res["text_mass"] = out.text_mass[:, :, -n - 1 : -1]
            if critic is not None and critic[0] is None:
                res["values"] = critic_lib.head_values(hidden, critic[1])
        if aug_mb is not None:
            res["aug_logp"] = logprobs(model, completion_hidden(model, mb, images=aug_mb)[0])
        if ref is not None:
            res["ref_logp"] = logprobs(ref, completion_hidden(ref, mb)[0])
        if critic is not None and critic[0] is not None:
            res["values"] = critic_lib.values(graphdef, critic[0], critic[1], mb)
        return res

    micro_aug = None if aug is None else _split_rows(aug, m)
    res = jax.lax.map(one, (_micro(batch, m), micro_aug))
    res = jax.tree.map(jax.lax.stop_gradient, res)

    def merge_rows(x):
        if x.ndim == 4:  # masses [m, L, b, N] -> [L, B, N]
            return jnp.moveaxis(x, 0, 1).reshape(x.shape[1], -1, x.shape[-1])
        return x.reshape((-1,) + x.shape[2:])

    return jax.tree.map(merge_rows, res)


def _advantages(batch: RolloutBatch, passes: dict, cfg: StepConfig, kl_coef):
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


def _shaping(batch: RolloutBatch, passes: dict, cfg: StepConfig, adv):
    """Token mask, token weights and TAS-scaled advantages for the whole batch (SPEC 2-4)."""
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


def _denominator(mode: str, mask, weights):
    """What `mode` divides by on these rows; micro-batch losses are rescaled by their share of
    the global denominator, so their sum is exactly the whole-batch loss."""
    if mode == "token-mean":
        return jnp.sum(mask if weights is None else mask * weights)
    return jnp.sum(jnp.any(mask > 0, axis=-1)).astype(jnp.float32)


def _loss(trainable, frozen, graphdef, mb: RolloutBatch, aux: dict, cfg: StepConfig, head=None):
    """Loss of one micro-batch, already scaled by its share of the global denominator. With
    `head` (critic on the shared backbone) plus value_loss_coef * the clipped value loss."""
    model = nnx.merge(graphdef, join(trainable, frozen))
    if "dropout_key" in aux:  # LoRA dropout, in the gradient pass only
        lora.set_dropout_key(model, aux["dropout_key"])
    tokens = mb.input_ids[:, -mb.completion_length :]
    in_loss = cfg.shaping_in_loss
    hidden, out = completion_hidden(model, mb, pools=in_loss and cfg.token_weights)
    want_entropy = cfg.entropy_coef or not cfg.old_pass
    logp, entropy = completion_logprobs(
        model,
        hidden,
        tokens,
        cfg.temperature,
        entropy=("grad" if cfg.entropy_coef else "value") if want_entropy else "none",
    )
    mask = mb.completion_mask
    sg = jax.lax.stop_gradient
    old_logp = aux["old_logp"] if cfg.old_pass else sg(logp)
    adv, token_mask, weights = aux["advantages"], aux.get("token_mask"), aux.get("token_weights")
    shaping_metrics = {}
    if in_loss:  # the whole batch is here: shape it from this pass's own quantities
        local = {"old_logp": old_logp, "entropy": sg(entropy)}
        if "aug_logp" in aux:
            local["aug_logp"] = aux["aug_logp"]
        if cfg.token_weights:
            n = mb.completion_length
            local["vision_mass"] = sg(out.vision_mass[:, :, -n - 1 : -1])
            local["text_mass"] = sg(out.text_mass[:, :, -n - 1 : -1])
        adv, token_mask, weights, shaping_metrics = _shaping(mb, local, cfg, adv)
    loss, metrics = rl.policy_loss(
        logp,
        old_logp,
        adv,
        mask,
        clip_ratio_low=cfg.clip_ratio_low,
        clip_ratio_high=cfg.clip_ratio_high,
        clip_ratio_dual=cfg.clip_ratio_dual,
        loss_agg_mode=cfg.loss_agg_mode,
        token_mask=token_mask,
        token_weights=weights,
    )
    metrics = {"pg_loss": loss, **metrics}
    agg = lambda x: rl.agg_loss(x, mask, cfg.loss_agg_mode)  # noqa: E731
    if cfg.use_kl_loss and cfg.kl_loss_coef > 0:
        kl = rl.kl_penalty(logp, aux["ref_logp"], cfg.kl_loss_type)
        metrics["kl_loss"] = agg(kl)
        loss = loss + cfg.kl_loss_coef * metrics["kl_loss"]
    if cfg.entropy_coef:
        metrics["entropy_loss"] = agg(entropy)
        loss = loss - cfg.entropy_coef * metrics["entropy_loss"]
    if cfg.use_entropy_penalty:
        metrics["entropy_penalty"] = agg(-logp)
        loss = loss + cfg.entropy_penalty_coef * metrics["entropy_penalty"]
    scale = aux["share"]
    loss, metrics = loss * scale, jax.tree.map(lambda x: x * scale, metrics)
    if in_loss:  # one micro-batch: share = 1, nothing to rescale
        metrics.update(shaping_metrics)
        metrics["extras"] = {"advantages": adv, "token_weights": weights}
    if not cfg.old_pass:  # token sums of what the old pass would have given, for the metrics
        metrics["old_sums"] = {"entropy": jnp.sum(sg(entropy) * mask)}
        if "ref_logp" in aux:
            kl = rl.kl_penalty(sg(logp), aux["ref_logp"], cfg.kl_loss_type)
            metrics["old_sums"]["kl"] = jnp.sum(kl * mask)
    if head is not None:
        vf, vmets = critic_lib.value_loss_terms(
            critic_lib.head_values(hidden, head), aux, mask, cfg.cliprange_value
        )
        loss = loss + cfg.value_loss_coef * vf
        metrics.update(vmets)
    return loss, metrics


def _accumulate(grad_fn, params, micro_xs):
    """Sum of (loss, metrics) and gradients of grad_fn(params, *xs) over the micro-batches."""
    first = jax.tree.map(lambda x: x[0], micro_xs)
    mets0 = jax.eval_shape(lambda: grad_fn(params, *first)[0][1])
    mets0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), mets0)

    def body(carry, xs):
        (loss, mets), grads = grad_fn(params, *xs)
        g_acc, l_acc, m_acc = carry
        return (
            jax.tree.map(jnp.add, g_acc, grads),
            l_acc + loss,
            jax.tree.map(jnp.add, m_acc, mets),
        ), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    (grads, loss, mets), _ = jax.lax.scan(body, (zeros, jnp.zeros(()), mets0), micro_xs)
    return grads, loss, mets


def _apply(tx, grads, opt_state, params, ok):
    """optax update where `ok`, else the old params and optimizer state."""
    updates, new_opt = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    pick = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)  # noqa: E731
    return pick(new_params, params), pick(new_opt, opt_state)


def _critic_update(graphdef, state: TrainState, frozen, batch, returns, passes, cfg):
    """Critic gradient over the micro-batches and its optax update (skipped if non-finite)."""
    m = cfg.micro_batches
    mask = batch.completion_mask
    total = jnp.sum(mask > 0).astype(jnp.float32)
    aux = _split_rows({"old_values": passes["values"], "returns": returns}, m)

    def fn(cp, mb, a):
        return critic_lib.loss(
            cp, frozen, graphdef, mb, a, cfg.cliprange_value, cfg.value_loss_coef, total
        )

    grad_fn = jax.value_and_grad(fn, has_aux=True)
    grads, loss, mets = _accumulate(grad_fn, state.critic_params, (_micro(batch, m), aux))
    norm = optax.tree.norm(grads)
    ok = jnp.isfinite(loss) & jnp.isfinite(norm)
    ctx = critic_lib.make_optimizer(cfg.critic_lr, cfg.critic_grad_clip)
    params, opt = _apply(ctx, grads, state.critic_opt_state, state.critic_params, ok)
    mets = dict(mets, critic_grad_norm=norm, critic_nonfinite=(~ok).astype(jnp.int32))
    return params, opt, mets


def _head_update(state: TrainState, g_head, cfg: StepConfig):
    """The shared-backbone critic: only the value head is the critic optimizer's."""
    norm = optax.tree.norm(g_head)
    ok = jnp.isfinite(norm)
    ctx = critic_lib.make_optimizer(cfg.critic_lr, cfg.critic_grad_clip)
    head, opt = _apply(ctx, {"head": g_head}, state.critic_opt_state, state.critic_params, ok)
    return head, opt, {"critic_grad_norm": norm, "critic_nonfinite": (~ok).astype(jnp.int32)}


def _next_kl_coef(kl_coef, kl, rows: int, cfg: StepConfig):
    """The adaptive controller's beta (1 + clip(KL / target - 1, -0.2, 0.2) n / horizon), with
    n = rows of the batch (verl's n_steps); the fixed controller keeps beta."""
    if cfg.kl_ctrl_type == "fixed":
        return kl_coef
    e = jnp.clip(kl / cfg.kl_target - 1.0, -0.2, 0.2)
    return kl_coef * (1.0 + e * rows / cfg.kl_horizon)


def _policy_grads(graphdef, state, trainable, frozen, batch, micro_aux, cfg: StepConfig):
    """(grads of the trainable params, grads of the shared value head or None, loss,
    metrics) over the micro-batches. A separate critic's warm-up skips the computation."""
    m = cfg.micro_batches
    xs = (_micro(batch, m), micro_aux)
    if cfg.critic and cfg.critic_share_backbone:
        head = state.critic_params["head"]
        grad_fn = jax.value_and_grad(
            lambda p, mb, a: _loss(p[0], frozen, graphdef, mb, a, cfg, head=p[1]), has_aux=True
        )
        (grads, g_head), loss, mets = _accumulate(grad_fn, (trainable, head), xs)
        return grads, g_head, loss, mets
    grad_fn = jax.value_and_grad(
        lambda p, mb, a: _loss(p, frozen, graphdef, mb, a, cfg), has_aux=True
    )
    run = lambda: _accumulate(grad_fn, trainable, xs)  # noqa: E731
    if not (cfg.critic and cfg.critic_warmup_steps > 0):
        grads, loss, mets = run()
        return grads, None, loss, mets
    # during the warm-up the policy's loss and metrics read 0 (policy_updated = 0)
    shapes = jax.eval_shape(run)
    zeros = lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)  # noqa: E731
    grads, loss, mets = jax.lax.cond(state.step >= cfg.critic_warmup_steps, run, zeros)
    return grads, None, loss, mets


def build_train_step(graphdef, tx: optax.GradientTransformation, cfg: StepConfig):
    """The step function, not jitted: step(state, ref_params, batch, rng) -> (state, metrics,
    extras). For callers that jit it themselves (with shardings on a mesh). With LoRA,
    ref_params is ignored (the reference is the base weights: adapters off)."""

    def step(state: TrainState, ref_params, batch: RolloutBatch, rng):
        trainable, frozen = split_trainable(state.params, cfg)
        if cfg.needs_ref and cfg.lora:
            ref_params = lora.lora_off(state.params)
        critic = None
        if cfg.critic:
            cp = state.critic_params
            backbone = None if cfg.critic_share_backbone else join(cp["backbone"], frozen)
            critic = (backbone, cp["head"])
        k_drop = jax.random.fold_in(rng, 1)  # LoRA dropout; `rng` itself blackens patches
        passes = _no_grad_passes(graphdef, state.params, ref_params, batch, rng, cfg, critic)
        adv, returns, metrics = _advantages(batch, passes, cfg, state.kl_coef)
        if cfg.shaping_in_loss:  # masks, weights and TAS come out of the loss pass
            token_mask = weights = None
        else:
            adv, token_mask, weights, shaping_metrics = _shaping(batch, passes, cfg, adv)
            metrics.update(shaping_metrics)
        mask = batch.completion_mask
        total = _denominator(cfg.loss_agg_mode, mask, weights)
        aux = {"advantages": adv}
        if cfg.old_pass:
            aux["old_logp"] = passes["old_logp"]
        for k in ("ref_logp", "aug_logp"):
            if k in passes:
                aux[k] = passes[k]
        if token_mask is not None:
            aux["token_mask"] = token_mask
        if weights is not None:
            aux["token_weights"] = weights
        m = cfg.micro_batches
        micro_aux = _split_rows(aux, m)
        micro_mask = _split_rows(mask, m)
        micro_w = None if weights is None else _split_rows(weights, m)
        shares = jax.vmap(lambda mk, w: _denominator(cfg.loss_agg_mode, mk, w))(
            micro_mask, micro_w
        ) / jnp.maximum(total, 1e-8)
        micro_aux["share"] = shares
        if cfg.lora:
            micro_aux["dropout_key"] = jax.random.split(k_drop, m)
        shared = cfg.critic and cfg.critic_share_backbone
        if shared:
            vaux = {"old_values": passes["values"], "returns": returns}
            micro_aux.update(_split_rows(vaux, m))
            micro_aux["vf_total"] = jnp.full((m,), jnp.sum(mask > 0), jnp.float32)
        grads, g_head, loss, loss_metrics = _policy_grads(
            graphdef, state, trainable, frozen, batch, micro_aux, cfg
        )
        extras = loss_metrics.pop("extras", None)
        if extras is not None:
            adv, weights = extras["advantages"], extras["token_weights"]
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        update = finite & (state.step >= cfg.critic_warmup_steps) if cfg.critic else finite
        new_trainable, new_opt = _apply(tx, grads, state.opt_state, trainable, update)
        new_state = state.replace(
            params=join(new_trainable, frozen),
            opt_state=new_opt,
            step=state.step + 1,
            skipped=state.skipped + (~finite).astype(jnp.int32),
        )
        if shared:
            cparams, copt, cmets = _head_update(state, g_head, cfg)
            new_state = new_state.replace(critic_params=cparams, critic_opt_state=copt)
            metrics.update(cmets)
            metrics["policy_updated"] = update.astype(jnp.int32)
        elif cfg.critic:
            cparams, copt, cmets = _critic_update(
                graphdef, state, frozen, batch, returns, passes, cfg
            )
            new_state = new_state.replace(critic_params=cparams, critic_opt_state=copt)
            metrics.update(cmets)
            metrics["policy_updated"] = update.astype(jnp.int32)
        if cfg.use_kl_in_reward:
            new_state = new_state.replace(
                kl_coef=_next_kl_coef(state.kl_coef, metrics["kl_reward"], mask.shape[0], cfg)
            )
        tokens = jnp.maximum(mask.sum(), 1)
        old_sums = loss_metrics.pop("old_sums", None)
        if old_sums is None:
            ent = jnp.sum(passes["entropy"] * mask) / tokens
        else:
            ent = old_sums["entropy"] / tokens
        metrics.update(loss_metrics)
        metrics.update(
            loss=loss,
            grad_norm=grad_norm,
            entropy=ent,
            nonfinite=(~finite).astype(jnp.int32),
            advantage_mean=jnp.sum(adv * mask) / jnp.maximum(mask.sum(), 1)
            if adv.ndim == 2
            else jnp.mean(adv),
        )
        if old_sums is not None and "kl" in old_sums:
            metrics["kl"] = old_sums["kl"] / tokens
        elif "ref_logp" in passes:
            kl = rl.kl_penalty(passes["old_logp"], passes["ref_logp"], cfg.kl_loss_type)
            metrics["kl"] = jnp.sum(kl * mask) / tokens
        return new_state, metrics, {"advantages": adv, "token_weights": weights}

    return step


def make_train_step(graphdef, tx: optax.GradientTransformation, cfg: StepConfig):
    """build_train_step jitted with the state donated. One compilation per batch shape."""
    return jax.jit(build_train_step(graphdef, tx, cfg), donate_argnums=(0,))
