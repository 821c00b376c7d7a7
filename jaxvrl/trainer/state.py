"""What the train step is configured by and what it carries between steps: StepConfig (the
run's config, frozen) and TrainState (donated to every step)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import ml_collections
from flax import nnx, struct

from jaxvrl.config import set_values
from jaxvrl.models import lora

# the ratio's old log-probs: the rollout's, or a no-grad pass before the first update
OLD_LOGPROBS = ("sampler", "recompute")
ROLLOUT_IS = (None, "token", "sequence")  # verl's rollout correction: off, per token, per row


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """The train step's settings: the run's ConfigDict, frozen (hashable), read by group as
    `cfg.actor.clip_ratio_low` (the keys of configs/base.py, nothing copied), and what
    follows from it (the properties below)."""

    config: ml_collections.FrozenConfigDict

    @classmethod
    def of(cls, c: ml_collections.ConfigDict) -> StepConfig:
        return cls(ml_collections.FrozenConfigDict(c))

    def with_values(self, values) -> StepConfig:
        """A copy with the dotted keys of `values` set, e.g. {"optim.micro_batches": 2}."""
        return StepConfig.of(set_values(self.config.as_configdict(), values))

    def __getattr__(self, name: str):  # a group of the config: cfg.actor, cfg.tprl, ...
        if name == "config":  # not yet set (copying, unpickling)
            raise AttributeError(name)
        return getattr(self.config, name)

    @property
    def group_size(self) -> int:
        return self.config.rollout.num_generations

    @property
    def temperature(self) -> float:
        """The sampling temperature the log-probs are taken at (greedy, 0, samples at 1)."""
        t = self.config.rollout.temperature
        return t if t > 0 else 1.0

    @property
    def micro_batches(self) -> int:
        return self.config.optim.micro_batches

    @property
    def mini_batches(self) -> int:
        """Policy updates per epoch: prompts_per_step / actor.global_batch_size (None: one)."""
        gbs = self.config.actor.global_batch_size
        return 1 if gbs is None else max(1, self.config.prompts_per_step // gbs)

    @property
    def epochs(self) -> int:
        return self.config.actor.ppo_epochs

    @property
    def uses_lora(self) -> bool:
        """Only the adapters (and the vision tower with lora.train_vision) are trained."""
        return self.config.lora.rank > 0

    @property
    def updates(self) -> int:
        """Policy updates per rollout batch."""
        return self.mini_batches * self.epochs

    @property
    def needs_perturbed(self) -> bool:
        return self.tprl.enable_perception_filtering or self.tprl.enable_trajectory_reweighting

    @property
    def needs_ref(self) -> bool:
        return (
            self.actor.use_kl_loss and self.actor.kl_loss_coef > 0
        ) or self.algorithm.use_kl_in_reward

    @property
    def shapes_tokens(self) -> bool:
        """Whether token masks, token weights or TAS read per-token old-policy quantities."""
        return (
            self.needs_perturbed
            or self.tprl.enable_entropy_filtering
            or self.vgr.enable_token_weights
        )

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
        micro-batches or updates, or when asked for (old_logprobs="recompute")."""
        split = self.micro_batches > 1 or self.updates > 1 or self.actor.dynamic_batching
        return (
            self.algorithm.use_kl_in_reward
            or self.has_critic
            or self.actor.old_logprobs == "recompute"
            or (self.shapes_tokens and split)
        )

    @property
    def sampler_old(self) -> bool:
        """Whether the ratio's old log-probs are the sampler's (RolloutBatch.old_logprobs):
        several updates read them, fixed; one update uses the current policy's, exact."""
        return self.updates > 1 and self.actor.old_logprobs == "sampler"

    @property
    def sampler_shaping(self) -> bool:
        """Whether the old-policy log-probs and entropies token shaping reads are the
        sampler's (RolloutBatch.old_logprobs, old_entropy) rather than a no-grad clean
        pass's: with an old-policy pass to replace, actor.old_logprobs sampler (the sampler
        drew the batch from the old policy), actor.shaping_source sampler ("auto" is
        resolved when a run starts, else counts as recompute) and nothing else reading the
        clean pass (VGR masses, the critic, the KL in the reward, groups replayed from an
        earlier policy). With one update the ratio still takes the loss pass's own
        log-probs."""
        return (
            self.old_pass
            and self.actor.old_logprobs == "sampler"
            and self.actor.shaping_source == "sampler"
            and not self.vgr.enable_token_weights
            and not self.has_critic
            and not self.algorithm.use_kl_in_reward
            and not self.filter.replay_buffer.enable
        )

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
