"""What the train step is configured by and what it carries between steps: StepConfig (the
values of the run's config the step reads, typed and frozen) and TrainState (donated to every
step)."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any

import jax
from flax import nnx, struct

from jaxvrl.config import get
from jaxvrl.models import lora
from jaxvrl.trainer.methods import SHAPING_KINDS, TOKEN_METHODS, Term, active

# the ratio's old log-probs: the rollout's, or a no-grad pass before the first update
OLD_LOGPROBS = ("sampler", "recompute")
ROLLOUT_IS = (None, "token", "sequence")  # verl's rollout correction: off, per token, per row


# The config groups the step reads, each field the config key of its name (configs/base.py
# documents them). The token methods' keys are not here: `StepConfig.options` holds the keys
# the token methods' table declares.
@dataclasses.dataclass(frozen=True)
class RolloutSettings:
    num_generations: int
    temperature: float
    max_new_tokens: int
    partial: bool  # rows carried across steps: tokens of earlier policies in the batch
    devices: int  # > 0: one-step-off training, every batch sampled one update behind


@dataclasses.dataclass(frozen=True)
class OptimSettings:
    micro_batches: int
    grad_clip: float


@dataclasses.dataclass(frozen=True)
class ActorSettings:
    global_batch_size: int | None
    ppo_epochs: int
    old_logprobs: str
    shaping_source: str
    loss_agg_mode: str
    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_dual: float
    kl_loss_type: str  # the logged `kl` metric's estimator
    padding_free: bool
    dynamic_batching: bool
    max_token_len_per_device: int | None
    router_aux_loss_coef: float
    routing_replay: bool
    offload_optimizer: bool
    offload_reference: bool


@dataclasses.dataclass(frozen=True)
class KLControlSettings:
    type: str
    target_kl: float
    horizon: int


@dataclasses.dataclass(frozen=True)
class AlgorithmSettings:
    adv_estimator: str
    norm_adv_by_std: bool
    gamma: float
    lam: float
    use_kl_in_reward: bool
    kl_penalty: str
    kl_ctrl: KLControlSettings
    rollout_is: str | None
    rollout_is_threshold: float
    rollout_is_band: tuple[float, float] | None


@dataclasses.dataclass(frozen=True)
class CriticSettings:
    lr: float
    warmup_steps: int
    grad_clip: float
    cliprange_value: float
    value_loss_coef: float
    share_backbone: bool


@dataclasses.dataclass(frozen=True)
class LoraSettings:
    rank: int
    train_vision: bool
    dropout: float


@dataclasses.dataclass(frozen=True)
class TprlSettings:
    black_prob: float  # the perturbed image's patch blackening (the pass, not a term)


@dataclasses.dataclass(frozen=True)
class ReplayBufferSettings:
    enable: bool


@dataclasses.dataclass(frozen=True)
class FilterSettings:
    replay_buffer: ReplayBufferSettings


def _frozen(value):
    """A config value as a hashable one (lists as tuples)."""
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value


def _read(cls, node):
    """An instance of the settings dataclass `cls` from config group `node`: each field the
    key of its name (a nested settings class: a nested group)."""
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        value = node[f.name]
        if dataclasses.is_dataclass(hints[f.name]):
            value = _read(hints[f.name], value)
        values[f.name] = _frozen(value)
    return cls(**values)


def _set(obj, parts: list[str], value):
    """A copy of settings `obj` with the dotted key `parts` set, or None if it has none."""
    names = {f.name for f in dataclasses.fields(obj)}
    if not parts or parts[0] not in names:
        return None
    if len(parts) == 1:
        return dataclasses.replace(obj, **{parts[0]: _frozen(value)})
    inner = getattr(obj, parts[0])
    inner = _set(inner, parts[1:], value) if dataclasses.is_dataclass(inner) else None
    return None if inner is None else dataclasses.replace(obj, **{parts[0]: inner})


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """The train step's settings: exactly the config values the step reads, typed and
    frozen (hashable: the step is built for one), by group as `cfg.actor.clip_ratio_low`
    (the keys of configs/base.py); the token methods' table with the values of the keys it
    declares (`options`); and what follows from them (the properties below). Built once from
    the run's ConfigDict by `of`."""

    prompts_per_step: int
    rollout: RolloutSettings
    optim: OptimSettings
    actor: ActorSettings
    algorithm: AlgorithmSettings
    critic: CriticSettings
    lora: LoraSettings
    tprl: TprlSettings
    filter: FilterSettings
    table: tuple[Term, ...] = TOKEN_METHODS  # every token method; `terms`: those switched on
    options: tuple[tuple[str, Any], ...] = ()  # (dotted key, value) of every key `table` reads

    @classmethod
    def of(cls, c, table: tuple[Term, ...] = TOKEN_METHODS) -> StepConfig:
        """From the run's ConfigDict `c`, with the token methods of `table`."""
        hints = typing.get_type_hints(cls)
        groups = {
            name: _read(hint, c[name])
            for name, hint in hints.items()
            if dataclasses.is_dataclass(hint)
        }
        options = {}
        for term in table:
            for key in term.keys:
                try:
                    options[key] = _frozen(get(c, key))
                except (KeyError, AttributeError):
                    raise KeyError(
                        f"token method {term.name!r} reads config key {key!r}, which the "
                        "config does not have (declare it in configs/base.py)"
                    ) from None
        return cls(c.prompts_per_step, **groups, table=table, options=tuple(options.items()))

    def with_values(self, values: Mapping) -> StepConfig:
        """A copy with the dotted keys of `values` set, e.g. {"optim.micro_batches": 2}."""
        cfg = self
        for key, value in values.items():
            options = dict(cfg.options)
            known = key in options
            if known:
                options[key] = _frozen(value)
                cfg = dataclasses.replace(cfg, options=tuple(options.items()))
            new = _set(cfg, key.split("."), value)
            if new is None and not known:
                raise KeyError(f"the train step reads no config key {key!r}")
            cfg = cfg if new is None else new
        return cfg

    def option(self, key: str):
        """The value of a key the token methods' table declares."""
        return dict(self.options)[key]

    @property
    def terms(self) -> tuple[Term, ...]:
        """The token methods switched on, with the columns they read, in table order."""
        return active(self.table, dict(self.options))

    def reads(self, *names: str) -> bool:
        """Whether a token method switched on reads one of the columns `names`."""
        return any(name in t.reads for t in self.terms for name in names)

    @property
    def group_size(self) -> int:
        return self.rollout.num_generations

    @property
    def temperature(self) -> float:
        """The sampling temperature the log-probs are taken at (greedy, 0, samples at 1)."""
        t = self.rollout.temperature
        return t if t > 0 else 1.0

    @property
    def micro_batches(self) -> int:
        return self.optim.micro_batches

    @property
    def mini_batches(self) -> int:
        """Policy updates per epoch: prompts_per_step / actor.global_batch_size (None: one)."""
        gbs = self.actor.global_batch_size
        return 1 if gbs is None else max(1, self.prompts_per_step // gbs)

    @property
    def epochs(self) -> int:
        return self.actor.ppo_epochs

    @property
    def uses_lora(self) -> bool:
        """Only the adapters (and the vision tower with lora.train_vision) are trained."""
        return self.lora.rank > 0

    @property
    def updates(self) -> int:
        """Policy updates per rollout batch."""
        return self.mini_batches * self.epochs

    @property
    def needs_perturbed(self) -> bool:
        """Whether a token method reads the perturbed image's log-probs."""
        return self.reads("aug_logp")

    @property
    def needs_attention(self) -> bool:
        """Whether a token method reads attention masses (the batch carries the pools)."""
        return self.reads("vision_mass", "text_mass")

    @property
    def needs_ref(self) -> bool:
        return self.reads("ref_logp") or self.algorithm.use_kl_in_reward

    @property
    def grad_entropy(self) -> bool:
        """Whether a loss term reads the policy's entropy (its gradient flows)."""
        return any(t.kind == "loss" and "entropy" in t.reads for t in self.terms)

    @property
    def shapes_tokens(self) -> bool:
        """Whether token masks, token weights or TAS read per-token old-policy quantities."""
        return any(t.kind in SHAPING_KINDS for t in self.terms)

    @property
    def shaping_in_loss(self) -> bool:
        """Masks, weights and TAS computed inside the loss pass from its own (stop-gradient)
        log-probs, entropies and attention masses: possible when that pass sees the whole
        batch at once under the old policy (one update, one micro-batch; batch-level
        statistics stay batch-level)."""
        return self.shapes_tokens and not self.old_pass

    @property
    def old_pass(self) -> bool:
        """Whether a no-grad old-policy pass runs before the first update. With one update per
        batch the old policy is the current one, and the loss pass can supply the old
        log-probs (old = stop_gradient(logp), as TRL does), entropies and attention masses
        itself: the extra forward is needed only for what must be known before the loss (the
        KL in the reward, the critic's values), for token shaping that spans several
        micro-batches or updates or that LoRA dropout would reach (the loss pass drops adapter
        inputs; the perturbed pass and the shaping's old policy do not), or when asked for
        (old_logprobs="recompute")."""
        split = self.micro_batches > 1 or self.updates > 1 or self.actor.dynamic_batching
        dropout = self.uses_lora and self.lora.dropout > 0
        return (
            self.algorithm.use_kl_in_reward
            or self.has_critic
            or self.actor.old_logprobs == "recompute"
            or (self.shapes_tokens and (split or dropout))
        )

    @property
    def sampler_old(self) -> bool:
        """Whether the ratio's old log-probs are the sampler's (RolloutBatch.old_logprobs):
        several updates read them, fixed, and so does a batch sampled by an earlier policy
        (`behind`: each token's behaviour policy is the one that sampled it); one update of a
        batch sampled by the current policy uses its own, exact."""
        off_policy = self.updates > 1 or self.behind
        return off_policy and self.actor.old_logprobs == "sampler"

    @property
    def sampler_shaping(self) -> bool:
        """Whether the old-policy quantities token shaping reads (log-probs, entropies and
        attention masses) are the sampler's (RolloutBatch.old_logprobs, old_entropy,
        old_vision_mass, old_text_mass) rather than a no-grad clean pass's: with an
        old-policy pass to replace, actor.old_logprobs sampler (the sampler drew the batch
        from the old policy), actor.shaping_source sampler ("auto" is resolved when a run
        starts, else counts as recompute) and nothing else reading the clean pass (the
        critic, the KL in the reward, groups replayed from an earlier policy, batches
        sampled behind the policy they train). With one update the ratio still takes the
        loss pass's own log-probs."""
        return (
            self.old_pass
            and self.actor.old_logprobs == "sampler"
            and self.actor.shaping_source == "sampler"
            and not self.has_critic
            and not self.algorithm.use_kl_in_reward
            and not self.filter.replay_buffer.enable
            and not self.behind
        )

    @property
    def behind(self) -> bool:
        """Whether batches hold tokens sampled by an earlier policy than the one they train:
        rows carried across steps (rollout.partial) or one-step-off training
        (rollout.devices)."""
        return self.rollout.partial or self.rollout.devices > 0

    @property
    def has_critic(self) -> bool:
        return self.algorithm.adv_estimator == "gae"

    @property
    def trainable(self):
        """nnx filter of the policy's (and critic backbone's) trained params."""
        return lora.trainable_filter(self.uses_lora, self.lora.train_vision)


@struct.dataclass
class TrainState:
    params: Any  # every policy weight (with LoRA: base + adapters), an nnx.State
    opt_state: Any  # of the trainable part only
    step: jax.Array  # rollout batches trained on
    skipped: jax.Array  # updates skipped for a non-finite loss or gradient
    # {"backbone": trainable part (absent with a shared backbone), "head": {"kernel", "bias"}}
    critic_params: Any = None
    critic_opt_state: Any = None
    kl_coef: Any = None  # float32[] KL-in-reward coefficient (adaptive controller updates it)


def split_trainable(params, cfg: StepConfig):
    """params -> (trainable, frozen); frozen is None for full fine-tuning."""
    if not cfg.uses_lora:
        return params, None
    return lora.split_params(params, cfg.trainable)


def join(trainable, frozen):
    return trainable if frozen is None else nnx.merge_state(trainable, frozen)
