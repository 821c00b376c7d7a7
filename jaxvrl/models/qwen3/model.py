"""Qwen3ForCausalLM in Flax NNX: the shared text-only module (`causal_lm.CausalLM`)."""

from jaxvrl.models.causal_lm import CausalLM


class Qwen3(CausalLM):
    """Qwen3ForCausalLM. Built like `CausalLM` (same arguments)."""
