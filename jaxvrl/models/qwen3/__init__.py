"""Qwen3 (dense) in Flax NNX with parity to `transformers`.

model = jaxvrl.models.load("/path/to/Qwen3-8B")
out = model(input_ids, attention_mask)
jaxvrl.models.save(model, "/tmp/export")
"""

from jaxvrl.models.causal_lm import processor, rope_index, vision_inputs
from jaxvrl.models.interface import Family
from jaxvrl.models.qwen3.config import Qwen3Config
from jaxvrl.models.qwen3.model import Qwen3
from jaxvrl.models.qwen3.weights import KEY_TABLE, KEYS

FAMILY = Family(
    model_type="qwen3",
    architecture="Qwen3ForCausalLM",
    config_from_hf=Qwen3Config.from_hf_dict,
    model=Qwen3,
    keys=KEYS,
    rope_index=rope_index,
    vision_inputs=vision_inputs,
    processor=processor,
)

__all__ = ["FAMILY", "KEYS", "KEY_TABLE", "Qwen3", "Qwen3Config", "rope_index"]
