"""The Qwen3-VL presets (the published config.json of Qwen/Qwen3-VL-{2B,4B,8B,32B}-Instruct):
our abstract build of each, transformers' model of the same config.json on the meta device and
the published size agree on the parameter count."""

from __future__ import annotations

import json
import math

import jax
import pytest
from flax import nnx

from jaxvrl import models as M
from jaxvrl.models import qwen3_vl as q3

# name: (billions of parameters as the model cards round the checkpoint's, tied head)
PUBLISHED = {
    "qwen3-vl-2b": (2.13, True),
    "qwen3-vl-4b": (4.44, True),
    "qwen3-vl-8b": (8.77, False),
    "qwen3-vl-32b": (33.4, False),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_have_the_published_parameter_counts(name):
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    assert name in M.preset_names()
    with open(f"{M.PRESETS}/{name}.json") as f:
        d = json.load(f)
    cfg = M.config_from_hf(d, name)
    assert isinstance(cfg, q3.Qwen3VLConfig)
    billions, tied = PUBLISHED[name]
    assert cfg.tie_word_embeddings == tied and cfg.text.head_dim == 128
    assert cfg.vision.out_hidden_size == cfg.text.hidden_size
    model = nnx.eval_shape(lambda: M.Model(cfg, rngs=nnx.Rngs(0)))
    ours = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    with torch.device("meta"):
        hf = Qwen3VLForConditionalGeneration(Qwen3VLConfig(**d))
    assert ours == sum(p.numel() for p in hf.parameters())
    assert abs(ours / 1e9 - billions) <= 0.01 * billions, ours
