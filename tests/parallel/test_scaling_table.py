"""docs/scaling_table.py: its parameter counts equal the Flax model's (jax.eval_shape on the
real 3B/7B/32B configs, no memory used), and docs/scaling.md shows its current output."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import jax
import pytest
from flax import nnx

from jaxvrl.models.qwen2_5_vl import Qwen2_5_VL, Qwen2_5_VLConfig, TextConfig, VisionConfig
from tests.parallel.common import ROOT

SCRIPT = os.path.join(ROOT, "docs", "scaling_table.py")


def _table_module():
    spec = importlib.util.spec_from_file_location("scaling_table", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["scaling_table"] = mod
    spec.loader.exec_module(mod)
    return mod


T = _table_module()


@pytest.mark.parametrize("size", T.SIZES, ids=lambda s: s.name)
def test_param_counts_match_the_flax_model(size):
    d = size.hidden
    cfg = Qwen2_5_VLConfig(
        text=TextConfig(
            vocab_size=size.vocab,
            hidden_size=d,
            intermediate_size=size.intermediate,
            num_hidden_layers=size.layers,
            num_attention_heads=size.heads,
            num_key_value_heads=size.kv_heads,
        ),
        vision=VisionConfig(
            depth=size.v_depth,
            hidden_size=size.v_hidden,
            intermediate_size=size.v_intermediate,
            num_heads=size.v_heads,
            out_hidden_size=d,
        ),
        tie_word_embeddings=size.tied,
    )
    abstract = nnx.eval_shape(lambda: Qwen2_5_VL(cfg, rngs=nnx.Rngs(0)))
    visual = sum(x.size for x in jax.tree.leaves(nnx.state(abstract.visual, nnx.Param)))
    total = sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    assert visual == T.vision_params(size)
    assert total == T.params(size)


def test_document_shows_the_scripts_output():
    out = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, check=True)
    with open(os.path.join(ROOT, "docs", "scaling.md")) as f:
        doc = f.read()
    assert out.stdout.strip() in doc, "rerun: python docs/scaling_table.py (docs/scaling.md)"


def test_more_fsdp_devices_shrink_the_state_not_the_activations():
    s, w = T.SIZES[1], T.Workload()
    a, b = T.per_device(s, 4, 1, w), T.per_device(s, 8, 1, w)
    assert b["optimizer"] * 2 == pytest.approx(a["optimizer"])
    assert b["activations"] == a["activations"]
    assert T.per_device(s, 4, 2, w)["kv_cache"] * 2 == pytest.approx(a["kv_cache"])
