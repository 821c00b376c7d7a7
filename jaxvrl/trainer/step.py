"""The fused train step: one XLA program from a rollout batch to updated parameters.

Order inside the program (SPEC sections 2-5):
1. no-grad passes over the batch, in micro-batches: old policy (log-probs, entropy, attention
   masses), perturbed image (TPRL), reference policy (KL);
2. batch-level rules on [B, N] arrays: advantages, visual dependency, perception/entropy
   masks, TAS, VGR weights;
3. gradient of the loss accumulated over micro-batches with global denominators, then the
   optax update. A non-finite loss or gradient skips the update (counted in metrics).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from jaxvrl import rl
from jaxvrl.trainer.policy import (
    RolloutBatch,
    blacken_patches,
    completion_logits,
    token_entropy,
    token_logprobs,
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

    @property
    def needs_perturbed(self) -> bool:
        return self.perception_filtering or self.trajectory_reweighting

    @property
    def needs_ref(self) -> bool:
        return self.use_kl_loss and self.kl_loss_coef > 0


@struct.dataclass
class TrainState:
    params: Any
    opt_state: Any
    step: jax.Array
    skipped: jax.Array  # updates skipped for a non-finite loss or gradient


def _split_rows(tree, m: int):
    """[B, ...] -> [m, B/m, ...] on every array whose leading axis is the batch."""
    return jax.tree.map(lambda x: x.reshape((m, x.shape[0] // m) + x.shape[1:]), tree)


def _row_tree(batch: RolloutBatch):
    """The parts of a batch with a leading row axis (position_ids has it second)."""
    return dataclasses.replace(batch, position_ids=jnp.moveaxis(batch.position_ids, 1, 0))


def _micro(batch: RolloutBatch, m: int):
    rows = _split_rows(_row_tree(batch), m)
    return dataclasses.replace(rows, position_ids=jnp.moveaxis(rows.position_ids, 2, 1))


def _no_grad_passes(graphdef, params, ref_params, batch: RolloutBatch, rng, cfg: StepConfig):
    """Old-policy, perturbed and reference quantities, each float32[B, N] (masses [L, B, N])."""
    model = nnx.merge(graphdef, params)
    ref = nnx.merge(graphdef, ref_params) if cfg.needs_ref else None
    perturb = cfg.needs_perturbed and batch.images is not None
    # Blacken on the whole batch (not per micro-batch) so the split never changes the draw.
    aug = blacken_patches(batch.images, rng, cfg.black_prob) if perturb else None
    m = cfg.micro_batches

    def one(args):
        mb, aug_mb = args
        tokens = mb.input_ids[:, -mb.completion_length :]
        logits, out = completion_logits(model, mb, pools=cfg.token_weights)
        res = {
            "old_logp": token_logprobs(logits, tokens, cfg.temperature),
            "entropy": token_entropy(logits, cfg.temperature),
        }
        if cfg.token_weights:
            n = mb.completion_length
            res["vision_mass"] = out.vision_mass[:, :, -n - 1 : -1]
            res["text_mass"] = out.text_mass[:, :, -n - 1 : -1]
        if aug_mb is not None:
            logits_aug, _ = completion_logits(model, mb, images=aug_mb)
            res["aug_logp"] = token_logprobs(logits_aug, tokens, cfg.temperature)
        if ref is not None:
            logits_ref, _ = completion_logits(ref, mb)
            res["ref_logp"] = token_logprobs(logits_ref, tokens, cfg.temperature)
        return res

    micro_aug = None if aug is None else _split_rows(aug, m)
    res = jax.lax.map(one, (_micro(batch, m), micro_aug))
    res = jax.tree.map(jax.lax.stop_gradient, res)

    def merge_rows(x):
        if x.ndim == 4:  # masses [m, L, b, N] -> [L, B, N]
            return jnp.moveaxis(x, 0, 1).reshape(x.shape[1], -1, x.shape[-1])
        return x.reshape((-1,) + x.shape[2:])

    return jax.tree.map(merge_rows, res)


def _shaping(batch: RolloutBatch, passes: dict, cfg: StepConfig):
    """Advantages, token mask and token weights for the whole batch (SPEC sections 2-4)."""
    mask = batch.completion_mask
    metrics = {}
    adv = rl.group_advantages(
        batch.rewards,
        cfg.group_size,
        estimator=cfg.adv_estimator,
        norm_by_std=cfg.norm_adv_by_std,
        baseline=batch.baseline,
    )
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
            adv = adv * alpha
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


def _loss(params, graphdef, mb: RolloutBatch, aux: dict, cfg: StepConfig):
    """Loss of one micro-batch, already scaled by its share of the global denominator."""
    model = nnx.merge(graphdef, params)
    tokens = mb.input_ids[:, -mb.completion_length :]
    logits, _ = completion_logits(model, mb)
    logp = token_logprobs(logits, tokens, cfg.temperature)
    mask = mb.completion_mask
    loss, metrics = rl.policy_loss(
        logp,
        aux["old_logp"],
        aux["advantages"],
        mask,
        clip_ratio_low=cfg.clip_ratio_low,
        clip_ratio_high=cfg.clip_ratio_high,
        clip_ratio_dual=cfg.clip_ratio_dual,
        loss_agg_mode=cfg.loss_agg_mode,
        token_mask=aux.get("token_mask"),
        token_weights=aux.get("token_weights"),
    )
    metrics = {"pg_loss": loss, **metrics}
    agg = lambda x: rl.agg_loss(x, mask, cfg.loss_agg_mode)  # noqa: E731
    if cfg.needs_ref:
        kl = rl.kl_penalty(logp, aux["ref_logp"], cfg.kl_loss_type)
        metrics["kl_loss"] = agg(kl)
        loss = loss + cfg.kl_loss_coef * metrics["kl_loss"]
    if cfg.entropy_coef:
        metrics["entropy_loss"] = agg(token_entropy(logits, cfg.temperature))
        loss = loss - cfg.entropy_coef * metrics["entropy_loss"]
    if cfg.use_entropy_penalty:
        metrics["entropy_penalty"] = agg(-logp)
        loss = loss + cfg.entropy_penalty_coef * metrics["entropy_penalty"]
    scale = aux["share"]
    return loss * scale, jax.tree.map(lambda x: x * scale, metrics)


def build_train_step(graphdef, tx: optax.GradientTransformation, cfg: StepConfig):
    """The step function, not jitted: step(state, ref_params, batch, rng) -> (state, metrics,
    extras). For callers that jit it themselves (with shardings on a mesh)."""

    def step(state: TrainState, ref_params, batch: RolloutBatch, rng):
        passes = _no_grad_passes(graphdef, state.params, ref_params, batch, rng, cfg)
        adv, token_mask, weights, metrics = _shaping(batch, passes, cfg)
        mask = batch.completion_mask
        total = _denominator(cfg.loss_agg_mode, mask, weights)
        aux = {"old_logp": passes["old_logp"], "advantages": adv}
        if "ref_logp" in passes:
            aux["ref_logp"] = passes["ref_logp"]
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
        grad_fn = jax.value_and_grad(_loss, has_aux=True)

        def accumulate(carry, xs):
            mb, a = xs
            (loss, mets), grads = grad_fn(state.params, graphdef, mb, a, cfg)
            g_acc, l_acc, m_acc = carry
            return (
                jax.tree.map(jnp.add, g_acc, grads),
                l_acc + loss,
                jax.tree.map(jnp.add, m_acc, mets),
            ), None

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        first_mb = jax.tree.map(lambda x: x[0], (_micro(batch, m), micro_aux))
        mets0 = jax.eval_shape(lambda: grad_fn(state.params, graphdef, *first_mb, cfg)[0][1])
        mets0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), mets0)
        (grads, loss, loss_metrics), _ = jax.lax.scan(
            accumulate, (zeros, jnp.zeros(()), mets0), (_micro(batch, m), micro_aux)
        )
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        updates, new_opt = tx.update(grads, state.opt_state, state.params)
        new_params = optax.apply_updates(state.params, updates)
        pick = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
        new_state = TrainState(
            params=pick(new_params, state.params),
            opt_state=pick(new_opt, state.opt_state),
            step=state.step + 1,
            skipped=state.skipped + (~finite).astype(jnp.int32),
        )
        ent = jnp.sum(passes["entropy"] * mask) / jnp.maximum(mask.sum(), 1)
        metrics.update(loss_metrics)
        metrics.update(
            loss=loss,
            grad_norm=grad_norm,
            entropy=ent,
            nonfinite=(~finite).astype(jnp.int32),
            advantage_mean=jnp.mean(adv),
        )
        if "ref_logp" in passes:
            kl = rl.kl_penalty(passes["old_logp"], passes["ref_logp"], cfg.kl_loss_type)
            metrics["kl"] = jnp.sum(kl * mask) / jnp.maximum(mask.sum(), 1)
        return new_state, metrics, {"advantages": adv, "token_weights": weights}

    return step


def make_train_step(graphdef, tx: optax.GradientTransformation, cfg: StepConfig):
    """build_train_step jitted with the state donated. One compilation per batch shape."""
    return jax.jit(build_train_step(graphdef, tx, cfg), donate_argnums=(0,))
