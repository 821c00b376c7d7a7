"""What the train step is configured by and what it carries between steps: StepConfig (read
from the ConfigDict by build.py only) and TrainState (donated to every step)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx, struct

from jaxvrl.models import lora

OLD_LOGPROBS = ("sampler", "recompute")
ROLLOUT_IS = (None, "token", "sequence")


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Everything the step needs, read from the ConfigDict by train.py only."""

    group_size: int
    temperature: float = 1.0
    micro_batches: int = 1
    # Several policy updates per rollout batch: each of `epochs` epochs walks the batch in
    # `mini_batches` mini-batches (rows shuffled between epochs), one optax update each.
    mini_batches: int = 1
    epochs: int = 1
    # Old log-probs of the ratio: "sampler" (the rollout's, carried in the batch) or
    # "recompute" (a no-grad pass of the policy before the first update).
    old_logprobs: str = "sampler"
    # Truncated importance weight min(exp(recomputed - sampler), threshold) on the loss, per
    # token or per sequence, for sampling in other numerics than training (recompute only).
    rollout_is: str | None = None
    rollout_is_threshold: float = 2.0
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

    def __post_init__(self):
        if self.old_logprobs not in OLD_LOGPROBS:
            raise ValueError(f"old_logprobs={self.old_logprobs!r}: one of {OLD_LOGPROBS}")
        if self.rollout_is not in ROLLOUT_IS:
            raise ValueError(f"rollout_is={self.rollout_is!r}: one of {ROLLOUT_IS}")
        if self.rollout_is and self.old_logprobs != "recompute":
            raise ValueError("rollout_is needs old_logprobs='recompute' (it weighs the two)")
        if min(self.mini_batches, self.epochs, self.micro_batches) < 1:
            raise ValueError("mini_batches, epochs and micro_batches must be >= 1")

    @property
    def updates(self) -> int:
        """Policy updates per rollout batch."""
        return self.mini_batches * self.epochs

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
        split = self.micro_batches > 1 or self.updates > 1
        return (
            self.use_kl_in_reward
            or self.critic
            or self.old_logprobs == "recompute"
            or (self.shapes_tokens and split)
        )

    @property
    def sampler_old(self) -> bool:
        """Whether the ratio's old log-probs are the sampler's (RolloutBatch.old_logprobs):
        several updates read them, fixed; one update uses the current policy's, exact."""
        return self.updates > 1 and self.old_logprobs == "sampler"

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
    step: jax.Array  # rollout batches trained on
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
