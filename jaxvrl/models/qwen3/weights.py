"""Qwen3ForCausalLM's HF tensor names <-> param paths: the text-only table (`model.`,
`lm_head`; see `jaxvrl.models.weights`)."""

from jaxvrl.models.causal_lm import KEY_TABLE, KEYS

__all__ = ["KEYS", "KEY_TABLE"]
