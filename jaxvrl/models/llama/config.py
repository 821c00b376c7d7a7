"""Llama (Llama 2, Llama 3.x, DeepSeek-LLM/Math) configuration: `config.json` (`LlamaForCausalLM`) read into the shared
text-only config (`causal_lm.CausalLMConfig`): no q/k/v biases (config.json's attention_bias puts one on q, k, v and o); rope scaling
default, linear, dynamic (NTK) or llama3.
Keys a config leaves out take transformers' defaults.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jaxvrl.models.causal_lm import CausalLMConfig

# transformers' LlamaConfig defaults
DEFAULTS = dict(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    hidden_act="silu",
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    bos_token_id=1,
    eos_token_id=2,
)


@dataclasses.dataclass(frozen=True)
class LlamaConfig(CausalLMConfig):
    model_type: ClassVar[str] = "llama"
    architecture: ClassVar[str] = "LlamaForCausalLM"
    DEFAULTS: ClassVar[dict] = DEFAULTS
    BIAS: ClassVar[tuple[bool, bool] | None] = None
    QK_NORM: ClassVar[bool] = False
