"""Rollout sampling: a jitted KV-cache decoder."""

from jaxvrl.sampling.sampler import (
    SampleOutput,
    SamplingConfig,
    filter_logits,
    generate,
    make_sampler,
    sample,
)

__all__ = ["SampleOutput", "SamplingConfig", "filter_logits", "generate", "make_sampler", "sample"]
