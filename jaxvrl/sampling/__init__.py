"""Rollout sampling: a jitted KV-cache decoder."""

from jaxvrl.sampling.layout import (
    Layout,
    RolloutParams,
    decode_bytes,
    prefill_mesh,
    rollout_dtype,
    rollout_mesh,
    rollout_sizes,
)
from jaxvrl.sampling.sampler import Sampler, generate, generation_config, sample
from jaxvrl.sampling.steps import SampleOutput, SamplingConfig, filter_logits

__all__ = [
    "Layout",
    "RolloutParams",
    "decode_bytes",
    "prefill_mesh",
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
