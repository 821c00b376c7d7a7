"""Rollout sampling: a jitted KV-cache decoder."""

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
    "SampleOutput",
    "Sampler",
    "SamplingConfig",
    "filter_logits",
    "generate",
    "generation_config",
    "sample",
]
