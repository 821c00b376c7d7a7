"""Qwen3-VL-MoE configuration: Qwen3-VL's (`jaxvrl.models.qwen3_vl.config`) with sparse
mixture-of-experts feed-forwards in the text decoder.

text_config adds transformers' expert keys (num_experts, written `num_local_experts`;
num_experts_per_tok, moe_intermediate_size, decoder_sparse_step, mlp_only_layers,
router_aux_loss_coef). transformers' Qwen3-VL-MoE router always renormalises the top k
(there is no norm_topk_prob key), and its checkpoints hold each layer's experts fused
(`experts.gate_up_proj`), so both are fixed here. Keys a config leaves out take transformers'
Qwen3VLMoeTextConfig defaults; the vision tower's are Qwen3-VL's.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jaxvrl.models import moe
from jaxvrl.models.config import TextConfig
from jaxvrl.models.qwen3_vl.config import MROPE_SECTION, Qwen3VLConfig

# transformers' Qwen3VLMoeTextConfig defaults where they differ from TextConfig's
TEXT_DEFAULTS = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=24,
    num_attention_heads=16,
    rope_theta=500000.0,
    num_experts=60,
    num_experts_per_tok=4,
    moe_intermediate_size=1408,
    decoder_sparse_step=1,
    mlp_only_layers=(),
    router_aux_loss_coef=0.001,
)
# what every Qwen3-VL-MoE decoder is, whatever its config.json says
FIXED = dict(norm_topk_prob=True, fused_gate_up=True)


@dataclasses.dataclass(frozen=True)
class Qwen3VLMoeConfig(Qwen3VLConfig):
    model_type: ClassVar[str] = "qwen3_vl_moe"
    architecture: ClassVar[str] = "Qwen3VLMoeForConditionalGeneration"
    text_defaults: ClassVar[dict] = TEXT_DEFAULTS
    text: TextConfig = TextConfig(
        **TEXT_DEFAULTS,
        num_key_value_heads=16,
        mrope_section=tuple(MROPE_SECTION),
        attention_bias=False,
        qk_norm=True,
        mrope_interleaved=True,
        **FIXED,
    )

    @classmethod
    def text_fields(cls, text_d: dict, source: str) -> dict:
        """The experts' fields of text_config `text_d` (defaults applied)."""
        return moe.config_fields(text_d | {"norm_topk_prob": True}, source) | FIXED

    def text_hf(self) -> dict:
        t = self.text
        out = {k: getattr(t, k) for k in moe.MOE_KEYS if k != "norm_topk_prob"}
        return out | {"mlp_only_layers": list(t.mlp_only_layers)}
