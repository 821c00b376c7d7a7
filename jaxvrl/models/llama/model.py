"""LlamaForCausalLM in Flax NNX: the shared text-only module (`causal_lm.CausalLM`)."""

from jaxvrl.models.causal_lm import CausalLM


class Llama(CausalLM):
    """LlamaForCausalLM. Built like `CausalLM` (same arguments)."""
