"""Qwen3-VL-MoE (Qwen3-VL-30B-A3B) in Flax NNX with parity to `transformers`: Qwen3-VL's
vision tower, DeepStack and interleaved M-RoPE, with the text decoder's sparse layers running
`jaxvrl.models.moe.SparseMoE`.

model = jaxvrl.models.load("/path/to/Qwen3-VL-30B-A3B-Instruct")
"""

import dataclasses

from jaxvrl.models.qwen3_vl import FAMILY as QWEN3_VL
from jaxvrl.models.qwen3_vl_moe.config import Qwen3VLMoeConfig
from jaxvrl.models.qwen3_vl_moe.weights import KEYS

FAMILY = dataclasses.replace(
    QWEN3_VL,
    model_type=Qwen3VLMoeConfig.model_type,
    architecture=Qwen3VLMoeConfig.architecture,
    config_from_hf=Qwen3VLMoeConfig.from_hf_dict,
    keys=KEYS,
)

__all__ = ["FAMILY", "KEYS", "Qwen3VLMoeConfig"]
