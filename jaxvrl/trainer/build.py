"""From the ConfigDict to the pieces of the train step: StepConfig, the optimizer and the
initial TrainState (PPO critic and LoRA plug in here). train.py calls these."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxvrl.config import ConfigError
from jaxvrl.models import lora
from jaxvrl.sampling.layout import rollout_dtype
from jaxvrl.trainer import critic as critic_lib
from jaxvrl.trainer.methods import TOKEN_METHODS, Term
from jaxvrl.trainer.state import StepConfig, TrainState, split_trainable


def step_config(c, mesh=None, table: tuple[Term, ...] = TOKEN_METHODS) -> StepConfig:
    """The train step's settings: what it reads of the run's config, with the token methods
    of `table` and actor.shaping_source "auto" resolved for the rollout on `mesh` (None: one
    device): "sampler" where the rollout computes in model.dtype, else "recompute"."""
    cfg = StepConfig.of(c, table)
    if c.actor.shaping_source != "auto":
        return cfg
    same = rollout_dtype(c.rollout.dtype, mesh, c.model.dtype) is None
    return cfg.with_values({"actor.shaping_source": "sampler" if same else "recompute"})


def learning_rate(o, total_steps: int, updates_per_step: int = 1):
    """The policy's learning rate by optimizer update count: linear warm-up from 0 over
    `warmup_steps`, then constant, or cosine decay to `lr * min_lr_ratio` at `total_steps`.
    Steps are rollout steps: with several updates per step, the schedule reads the update
    count // updates_per_step (verl steps its scheduler once per rollout batch)."""
    warm = int(o.warmup_steps)
    per_step = _schedule(o, total_steps, warm)
    if updates_per_step == 1 or not callable(per_step):
        return per_step
    return lambda count: per_step(count // updates_per_step)


SCHEDULES = ("constant", "cosine")


def _schedule(o, total_steps: int, warm: int):
    if o.schedule == "constant":
        return optax.linear_schedule(0.0, o.lr, warm) if warm else o.lr
    if o.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0 if warm else o.lr,
            peak_value=o.lr,
            warmup_steps=warm,
            decay_steps=max(int(total_steps), warm + 1),
            end_value=o.lr * float(o.min_lr_ratio),
        )
    raise ValueError(f"optim.schedule={o.schedule!r}: expected 'constant' or 'cosine'")


def make_optimizer(
    o, total_steps: int = 1, updates_per_step: int = 1
) -> optax.GradientTransformation:
    """o: the `optim` ConfigDict group: clip by global norm, then AdamW with `betas`."""
    s = optimizer_settings(o, total_steps, updates_per_step)
    b1, b2 = s.betas
    lr = learning_rate(s, s.total_steps or 1, s.updates_per_step)
    return optax.chain(
        optax.clip_by_global_norm(s.grad_clip),
        optax.adamw(lr, b1=b1, b2=b2, weight_decay=s.weight_decay),
    )


def optimizer_settings(o, total_steps: int = 1, updates_per_step: int = 1) -> OptimizerSettings:
    """Every value `make_optimizer(o, total_steps, updates_per_step)` reads, hashable: equal
    settings make optimizers that compute the same (a later run's step program may be an
    earlier run's, `runtime.kept_program`)."""
    cosine = o.schedule == "cosine"  # the only schedule that reads total_steps
    return OptimizerSettings(
        str(o.schedule),
        float(o.lr),
        int(o.warmup_steps),
        float(o.min_lr_ratio) if cosine else None,
        int(total_steps) if cosine else None,
        tuple(float(b) for b in o.betas),
        o.grad_clip if o.grad_clip is None else float(o.grad_clip),
        float(o.weight_decay),
        int(updates_per_step),
    )


@dataclasses.dataclass(frozen=True)
class OptimizerSettings:
    """The values an optimizer is made from (`optimizer_settings`)."""

    schedule: str
    lr: float
    warmup_steps: int
    min_lr_ratio: float | None
    total_steps: int | None
    betas: tuple[float, ...]
    grad_clip: float | None
    weight_decay: float
    updates_per_step: int


def apply_lora(model, c) -> list[str]:
    """Wrap the text decoder's target projections of `model` in place (lora.rank > 0); the
    sampler's nnx.graphdef(model) then includes the adapters. Returns the wrapped paths."""
    lc = c.lora
    if lc.rank <= 0 or any(isinstance(n, lora.LoRALinear) for _, n in nnx.iter_graph(model)):
        return []
    try:
        return lora.apply_lora(
            model,
            lc.rank,
            lc.alpha,
            lc.dropout,
            tuple(lc.target_modules),
            seed=c.seed,
            quantize=lc.quantize,  # QLoRA: int8 | int4 | nf4
        )
    except ValueError as e:  # target modules that name no projection of this model
        raise ConfigError(f"config.{e}") from None


def init_train_state(model, c):
    """-> (graphdef, tx, state, ref_params): the model split into graph and params, the
    optimizer, the step-0 TrainState and the reference policy's params (None when no
    reference pass is needed, and with LoRA, whose reference is the base weights).

    With lora.rank > 0 the model is first wrapped with LoRA adapters in place, so
    nnx.graphdef(model) and state.params (base + adapters) go together to the sampler as
    before; the optimizer state holds the adapters only. With adv_estimator="gae" the state
    carries the critic (its trained params and optimizer state); with use_kl_in_reward the
    KL coefficient."""
    cfg = step_config(c)
    if apply_lora(model, c):
        n = lora.lora_param_count(model)
        print(f"LoRA rank {c.lora.rank}: {n / 1e6:.3f}M trainable params", flush=True)
    tx = make_optimizer(c.optim, c.total_steps, cfg.updates)
    graphdef, params = nnx.split(model, nnx.Param)
    ref_params = None
    if cfg.needs_ref and not cfg.uses_lora:
        # distinct buffers: the step donates the state, and one buffer cannot be donated twice
        ref_params = jax.tree.map(jnp.array, params)
    trainable, _ = split_trainable(params, cfg)
    state = TrainState(
        params, tx.init(trainable), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32)
    )
    if cfg.has_critic:
        hidden = model.config.text.hidden_size
        cp = critic_lib.init_params(trainable, hidden, c.seed, cfg.critic.share_backbone)
        ctx = critic_lib.make_optimizer(cfg.critic.lr, cfg.critic.grad_clip)
        state = state.replace(critic_params=cp, critic_opt_state=ctx.init(cp))
    if cfg.algorithm.use_kl_in_reward:
        state = state.replace(kl_coef=jnp.asarray(c.algorithm.kl_ctrl.kl_coef, jnp.float32))
    return graphdef, tx, state, ref_params


def sampling_params(state: TrainState):
    """What the sampler takes with nnx.graphdef(model): the policy's full params."""
    return state.params
