"""Rollout sampling: a jitted KV-cache decoder."""

from jaxvrl.sampling.layout import (
    Layout,
    RolloutParams,
    decode_bytes,
    rollout_dtype,
    rollout_mesh,
    rollout_sizes,
)
from jaxvrl.sampling.sampler import (
    SampleOutput,
    Sampler,
    SamplingConfig,
    filter_logits,
    generate,
    generation_config,
    sample,
)

__all__ = [
    "Layout",
    "RolloutParams",
    "decode_bytes",
    "rollout_dtype",
    "rollout_mesh",
    "rollout_sizes",
    "SampleOutput",
    "Sampler",
    "SamplingConfig",
    "filter_logits",
    "generate",
    "generation_config",
    "sample",
]
