"""RL math of SPEC sections 2-7 as pure functions (rewards and filters on the host)."""

from jaxvrl.rl.advantages import (
    discounted_returns,
    gae,
    group_advantages,
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
    ReplayBuffer,
    dynamic_sampling_keep,
    expand_groups,
    mask_truncated_completions,
    online_filter_keep,
    soft_overlong_punishment,
    stage_reward_weights,
)
from jaxvrl.rl.losses import (
    AdaptiveKLController,
    FixedKLController,
    agg_loss,
    entropy_penalty,
    kl_penalty,
    policy_loss,
    value_loss,
)
from jaxvrl.rl.masks import (
    entropy_token_mask,
    token_entropy,
    top_p_token_mask,
    visual_dependency,
)
from jaxvrl.rl.shaping import trajectory_scaling

__all__ = [
    "AdaptiveKLController",
    "FixedKLController",
    "ReplayBuffer",
    "agg_loss",
    "attention_metrics",
    "discounted_returns",
    "dynamic_sampling_keep",
    "entropy_penalty",
    "entropy_token_mask",
    "expand_groups",
    "gae",
    "group_advantages",
    "kl_penalty",
    "layer_indices",
    "mask_truncated_completions",
    "mdi_balance_reward",
    "online_filter_keep",
    "per_token_vgr",
    "policy_loss",
    "reinforce_plus_plus",
    "sequence_mdi",
    "soft_overlong_punishment",
    "stage_reward_weights",
    "token_entropy",
    "top_p_token_mask",
    "trajectory_scaling",
    "value_loss",
    "vgr_token_weights",
    "visual_dependency",
    "whiten",
]
