"""What the rest of the package needs from a model, declared once.

Every family runs the one `Model` (`jaxvrl.models.model`: a text decoder, an optional vision
encoder, a head); a family is a `Family` (`jaxvrl.models.families`) that `family(model_type)`
finds by the `model_type` of `config.json`. Code outside `jaxvrl/models/` reaches a model
only through this module and `jaxvrl.models`: the `Model` protocol below, `Family`, the
positions' rank-free rules (`jaxvrl.models.positions`) and the shared layouts (`KVCache`,
`PagedKVCache`, `VisionInputs`).
"""

from __future__ import annotations

from typing import Any, Protocol

import jax

from jaxvrl.models import weights
from jaxvrl.models.families import (
    CLIP_MEAN,
    CLIP_STD,
    FAMILIES,
    Family,
    ProcessorSettings,
    config_from_hf,
    family,
    family_of,
    load_config,
    supported,
)
from jaxvrl.models.model import Model as _Module
from jaxvrl.models.model import ModelOutput


class Model(Protocol):
    """Every family's module (an `nnx.Module`).

    `model(input_ids, attention_mask, pixel_values=..., image_grid_thw=...,
    pixel_values_videos=..., video_grid_thw=...)` on host arrays, and the traceable
    `model.forward(input_ids, attention_mask, position_ids, images=, videos=, cache=, pools=,
    return_logits=, step=, key_queries=, packing=, router_logits=, routes=, replay_routes=,
    record_routes=)` (packing: a `Packing`, the rows run padding-free and the outputs come
    back packed; the routing keywords: a mixture of experts' routes recorded and replayed)
    with positions from `Family.rope_index`
    and `VisionInputs` from `Family.vision_inputs`; both return a `ModelOutput`.
    `model.model` is the text decoder (`embed_tokens`, `layers`, `layer(i)`, `norm`);
    `model.visual` the vision encoder, None for a text-only family.
    """

    config: Any
    dtype: Any

    def forward(self, input_ids, attention_mask, position_ids, **kw) -> ModelOutput: ...

    def logits(self, hidden: jax.Array, head=None) -> jax.Array: ...

    def set_dtype(self, dtype) -> None: ...

    def set_attention(self, name: str, block: int = 512) -> None: ...

    def set_remat_policy(self, policy: str) -> None: ...

    def set_expert_capacity(self, capacity: float) -> None: ...


def load(
    path, dtype=None, param_dtype=None, attention: str = "auto", scan_layers: bool = True
) -> Model:
    """The model of an HF checkpoint directory (config.json + *.safetensors), of the family its
    config.json names, without torch. dtype: compute dtype (default float32); param_dtype:
    stored parameter dtype (default: dtype); attention: the attention implementation (see
    `Model.set_attention`); scan_layers: stacked layers run by a scan (the same outputs)."""
    import jax.numpy as jnp

    cfg = load_config(path)
    dtype = jnp.float32 if dtype is None else dtype
    return weights.load(
        path,
        family_of(cfg),
        _Module,
        cfg,
        dtype=dtype,
        param_dtype=param_dtype,
        attention=attention,
        scan_layers=scan_layers,
    )


def save(model: Model, path, *, tokenizer_dir=None, dtype=None, max_shard_bytes=None) -> None:
    """Writes `model` as an HF checkpoint directory transformers loads (config.json and
    safetensors, sharded past `max_shard_bytes`, default 5 GB); tokenizer_dir: copy the
    tokenizer and processor files from there too; dtype: cast the tensors."""
    weights.save(
        model,
        path,
        family_of(model).keys,
        tokenizer_dir=tokenizer_dir,
        dtype=dtype,
        max_shard_bytes=weights.SHARD_BYTES if max_shard_bytes is None else max_shard_bytes,
    )


__all__ = [
    "CLIP_MEAN",
    "CLIP_STD",
    "FAMILIES",
    "Family",
    "Model",
    "ModelOutput",
    "ProcessorSettings",
    "config_from_hf",
    "family",
    "family_of",
    "load",
    "load_config",
    "save",
    "supported",
]
