"""Qwen3 (dense) configuration: `config.json` (`Qwen3ForCausalLM`) read into the shared
text-only config (`causal_lm.CausalLMConfig`): per-head q/k RMSNorm before the rotary, an explicit head_dim, config.json's
attention_bias on q, k, v and o; sliding-window attention is refused.
Keys a config leaves out take transformers' defaults.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jaxvrl.models.causal_lm import CausalLMConfig

# transformers' Qwen3Config defaults
DEFAULTS = dict(
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=22016,
    num_hidden_layers=32,
    num_attention_heads=32,
    head_dim=128,
    hidden_act="silu",
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
)


@dataclasses.dataclass(frozen=True)
class Qwen3Config(CausalLMConfig):
    model_type: ClassVar[str] = "qwen3"
    architecture: ClassVar[str] = "Qwen3ForCausalLM"
    DEFAULTS: ClassVar[dict] = DEFAULTS
    BIAS: ClassVar[tuple[bool, bool] | None] = None
    QK_NORM: ClassVar[bool] = True
