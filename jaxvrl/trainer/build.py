"""From the ConfigDict to the pieces of the train step: StepConfig, the optimizer and the
initial TrainState. train.py calls these; they are the one place that maps config keys onto
the step (PPO critic and LoRA plug in here)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxvrl.trainer.step import StepConfig, TrainState


def step_config(c) -> StepConfig:
    a, p, t, v = c.algorithm, c.actor, c.tprl, c.vgr
    return StepConfig(
        group_size=c.rollout.num_generations,
        temperature=c.rollout.temperature if c.rollout.temperature > 0 else 1.0,
        micro_batches=c.optim.micro_batches,
        adv_estimator=a.adv_estimator,
        norm_adv_by_std=a.norm_adv_by_std,
        clip_ratio_low=p.clip_ratio_low,
        clip_ratio_high=p.clip_ratio_high,
        clip_ratio_dual=p.clip_ratio_dual,
        loss_agg_mode=p.loss_agg_mode,
        use_kl_loss=p.use_kl_loss,
        kl_loss_coef=p.kl_loss_coef,
        kl_loss_type=p.kl_loss_type,
        entropy_coef=p.entropy_coef,
        use_entropy_penalty=p.use_entropy_penalty,
        entropy_penalty_coef=p.entropy_penalty_coef,
        perception_filtering=t.enable_perception_filtering,
        top_p_perception_tokens=t.top_p_perception_tokens,
        black_prob=t.black_prob,
        entropy_filtering=t.enable_entropy_filtering,
        top_p_entropy_tokens=t.top_p_entropy_tokens,
        entropy_filter_scope=t.entropy_filter_scope,
        trajectory_reweighting=t.enable_trajectory_reweighting,
        trajectory_scaling_min=t.trajectory_scaling_min,
        token_weights=v.enable_token_weights,
        token_weight_clip=tuple(v.token_weight_clip),
        token_weight_smooth_sigma=v.token_weight_smooth_sigma,
        token_weight_last_k_layers=v.token_weight_last_k_layers,
        token_weight_layer_set=v.layer_set,
    )


def make_optimizer(o) -> optax.GradientTransformation:
    """o: the `optim` ConfigDict group."""
    lr = optax.linear_schedule(0.0, o.lr, o.warmup_steps) if o.warmup_steps else o.lr
    return optax.chain(
        optax.clip_by_global_norm(o.grad_clip),
        optax.adamw(lr, weight_decay=o.weight_decay),
    )


def init_train_state(model, c):
    """-> (graphdef, tx, state, ref_params): the model split into graph and trainable params,
    the optimizer, the step-0 TrainState and the reference policy's params (None when no
    reference pass is needed)."""
    tx = make_optimizer(c.optim)
    graphdef, params = nnx.split(model, nnx.Param)
    ref_params = jax.tree.map(jnp.array, params) if step_config(c).needs_ref else None
    # distinct buffers: the step donates the state, and one buffer cannot be donated twice
    state = TrainState(params, tx.init(params), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))
    return graphdef, tx, state, ref_params
