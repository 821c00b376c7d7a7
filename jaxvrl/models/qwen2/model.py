"""Qwen2ForCausalLM in Flax NNX: the shared text-only module (`causal_lm.CausalLM`)."""

from jaxvrl.models.causal_lm import CausalLM


class Qwen2(CausalLM):
    """Qwen2ForCausalLM. Built like `CausalLM` (same arguments)."""
