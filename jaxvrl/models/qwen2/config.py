"""Qwen2 and Qwen2.5 configuration: `config.json` (`Qwen2ForCausalLM`) read into the shared
text-only config (`causal_lm.CausalLMConfig`): biases on q, k and v (none on o); sliding-window attention is refused.
Keys a config leaves out take transformers' defaults.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jaxvrl.models.causal_lm import CausalLMConfig

# transformers' Qwen2Config defaults
DEFAULTS = dict(
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=22016,
    num_hidden_layers=32,
    num_attention_heads=32,
    hidden_act="silu",
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
)


@dataclasses.dataclass(frozen=True)
class Qwen2Config(CausalLMConfig):
    model_type: ClassVar[str] = "qwen2"
    architecture: ClassVar[str] = "Qwen2ForCausalLM"
    DEFAULTS: ClassVar[dict] = DEFAULTS
    BIAS: ClassVar[tuple[bool, bool] | None] = (True, False)
    QK_NORM: ClassVar[bool] = False
