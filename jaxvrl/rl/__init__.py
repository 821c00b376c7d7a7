"""RL math (docs/algorithms.md) as pure functions: jnp on [B, T] arrays with an explicit
completion mask (jit-able, no host sync), rewards and rollout filters on the host."""

from jaxvrl.rl import rewards
from jaxvrl.rl.advantages import (
    discounted_returns,
    gae,
    group_advantages,
    last_token_rewards,
    reinforce_plus_plus,
    whiten,
)
from jaxvrl.rl.attention import (
    attention_metrics,
    layer_indices,
    mdi_balance_reward,
    per_token_vgr,
    sequence_mdi,
    vgr_token_weights,
)
from jaxvrl.rl.filters import (
    DynamicSampler,
    ReplayBuffer,
    dynamic_sampling_keep,
    mask_truncated_completions,
    online_filter_keep,
    soft_overlong_punishment,
    stage_reward_weights,
)
from jaxvrl.rl.losses import (
    AdaptiveKLController,
    FixedKLController,
    adaptive_kl_coef,
    agg_denominator,
    agg_loss,
    entropy_bonus,
    entropy_penalty,
    kl_in_reward,
    kl_penalty,
    policy_loss,
    rollout_correction,
    value_loss,
)
from jaxvrl.rl.masks import (
    entropy_token_mask,
    token_entropy,
    top_k_count,
    top_p_token_mask,
    union_token_mask,
    visual_dependency,
)
from jaxvrl.rl.shaping import trajectory_scaling

__all__ = [
    "AdaptiveKLController",
    "DynamicSampler",
    "FixedKLController",
    "ReplayBuffer",
    "adaptive_kl_coef",
    "agg_denominator",
    "agg_loss",
    "attention_metrics",
    "discounted_returns",
    "dynamic_sampling_keep",
    "entropy_bonus",
    "entropy_penalty",
    "entropy_token_mask",
    "gae",
    "group_advantages",
    "kl_in_reward",
    "kl_penalty",
    "last_token_rewards",
    "layer_indices",
    "mask_truncated_completions",
    "mdi_balance_reward",
    "online_filter_keep",
    "per_token_vgr",
    "policy_loss",
    "reinforce_plus_plus",
    "rollout_correction",
    "rewards",
    "sequence_mdi",
    "soft_overlong_punishment",
    "stage_reward_weights",
    "token_entropy",
    "top_k_count",
    "top_p_token_mask",
    "trajectory_scaling",
    "union_token_mask",
    "value_loss",
    "vgr_token_weights",
    "visual_dependency",
    "whiten",
]
