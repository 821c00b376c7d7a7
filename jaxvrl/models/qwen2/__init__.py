"""Qwen2 and Qwen2.5 in Flax NNX with parity to `transformers`.

model = jaxvrl.models.load("/path/to/Qwen2.5-7B-Instruct")
out = model(input_ids, attention_mask)
jaxvrl.models.save(model, "/tmp/export")
"""

from jaxvrl.models.causal_lm import processor, rope_index, vision_inputs
from jaxvrl.models.interface import Family
from jaxvrl.models.qwen2.config import Qwen2Config
from jaxvrl.models.qwen2.model import Qwen2
from jaxvrl.models.qwen2.weights import KEY_TABLE, KEYS

FAMILY = Family(
    model_type="qwen2",
    architecture="Qwen2ForCausalLM",
    config_from_hf=Qwen2Config.from_hf_dict,
    model=Qwen2,
    keys=KEYS,
    rope_index=rope_index,
    vision_inputs=vision_inputs,
    processor=processor,
)

__all__ = ["FAMILY", "KEYS", "KEY_TABLE", "Qwen2", "Qwen2Config", "rope_index"]
