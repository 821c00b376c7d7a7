"""Llama (Llama 2, Llama 3.x, DeepSeek-LLM/Math) in Flax NNX with parity to `transformers`.

model = jaxvrl.models.load("/path/to/Llama-3.1-8B")
out = model(input_ids, attention_mask)
jaxvrl.models.save(model, "/tmp/export")
"""

from jaxvrl.models.causal_lm import processor, rope_index, vision_inputs
from jaxvrl.models.interface import Family
from jaxvrl.models.llama.config import LlamaConfig
from jaxvrl.models.llama.model import Llama
from jaxvrl.models.llama.weights import KEY_TABLE, KEYS

FAMILY = Family(
    model_type="llama",
    architecture="LlamaForCausalLM",
    config_from_hf=LlamaConfig.from_hf_dict,
    model=Llama,
    keys=KEYS,
    rope_index=rope_index,
    vision_inputs=vision_inputs,
    processor=processor,
)

__all__ = ["FAMILY", "KEYS", "KEY_TABLE", "Llama", "LlamaConfig", "rope_index"]
