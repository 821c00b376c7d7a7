"""Rollout sampling: a jitted KV-cache decoder."""

from jaxvrl.sampling.sampler import (
    SampleOutput,
    SamplingConfig,
    filter_logits,
    generate,
    make_sampler,
    release_decode_buffer,
    sample,
)

__all__ = [
    "SampleOutput",
    "SamplingConfig",
    "filter_logits",
    "generate",
    "make_sampler",
    "release_decode_buffer",
    "sample",
]
