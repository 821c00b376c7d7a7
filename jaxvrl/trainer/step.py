"""The fused train step: one XLA program from a rollout batch to updated parameters, in two
phases (verl's compute_log_prob, then update_policy):

1. experience (`trainer/experience.py`): no gradients, the whole batch, once: old-policy,
   perturbed-image, reference and critic passes; advantages, token masks, TAS, VGR weights;
   the ratio's old log-probs (the sampler's or recomputed) and the rollout correction;
2. update (`trainer/update.py`): a `lax.scan` over epochs x mini-batches, each a micro-batch
   accumulated gradient, an optax update and the critic's update on the same rows.

With one update per batch the old policy is the current one: the loss pass supplies the old
log-probs itself (and, on one micro-batch, the token shaping), so no old-policy pass runs
unless the KL in the reward, the critic or old_logprobs="recompute" needs it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxvrl.trainer.experience import experience
from jaxvrl.trainer.state import StepConfig, TrainState, join, split_trainable
from jaxvrl.trainer.update import update, update_order

__all__ = [
    "StepConfig",
    "TrainState",
    "build_train_step",
    "join",
    "make_train_step",
    "split_trainable",
    "update_order",
]


def build_train_step(graphdef, tx: optax.GradientTransformation, cfg: StepConfig):
    """The step function, not jitted: step(state, ref_params, batch, rng) -> (state, metrics,
    extras). For callers that jit it themselves (with shardings on a mesh). With LoRA,
    ref_params is ignored (the reference is the base weights: adapters off).

    rng: blackens the perturbed image (itself), draws LoRA dropout (fold_in 1) and orders the
    rows of the updates (fold_in 2, `update_order`). extras: `Extras` (advantages and token
    weights) for the markdown logs."""

    def step(state: TrainState, ref_params, batch, rng):
        cfg_ = cfg
        if batch.micro_batches and batch.micro_batches != cfg.micro_batches:
            # dynamic batching: this batch's micro-batch count (a program per count)
            cfg_ = cfg.with_values({"optim.micro_batches": batch.micro_batches})
        return run(state, ref_params, batch, rng, cfg_)

    def run(state, ref_params, batch, rng, cfg):
        rows_only = batch.replace(update_starts=None, update_rows=None)
        exp = experience(graphdef, state, ref_params, rows_only, rng, cfg)
        new_state, metrics, extras = update(graphdef, tx, state, exp, batch, rng, cfg)
        if exp.kl_coef is not None:
            new_state = new_state.replace(kl_coef=exp.kl_coef)
        extras = exp.extras if extras is None else extras
        adv, mask = extras.advantages, batch.completion_mask
        if adv.ndim == 2:
            adv_mean = jnp.sum(adv * mask) / jnp.maximum(mask.sum(), 1)
        else:  # over the rows with completion tokens (not the padding groups')
            real = jnp.any(mask > 0, axis=-1)
            adv_mean = jnp.sum(adv * real) / jnp.maximum(real.sum(), 1)
        metrics = {**exp.metrics, **metrics, "advantage_mean": adv_mean}
        return new_state, metrics, extras

    return step


def make_train_step(graphdef, tx: optax.GradientTransformation, cfg: StepConfig):
    """build_train_step jitted with the state donated. One compilation per batch shape."""
    return jax.jit(build_train_step(graphdef, tx, cfg), donate_argnums=(0,))
