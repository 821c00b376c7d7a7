"""LoRA adapters: parameter count by formula, a fresh adapter and `lora_off` leave the base
model's logits exactly, merged HF export has the LoRA model's logits, target matching."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxvrl.models import lora
from jaxvrl.models import qwen2_5_vl as q
from tests.models import hf_tiny as T


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("lora_model")
    T.build(path, seed=5)
    return path


def _inputs(model):
    rng = np.random.default_rng(0)
    g = [[1, 4, 4]]
    ids, mask = T.left_pad([T.prompt(rng, images=g, text_len=(4, 7)) for _ in range(2)])
    pv = np.concatenate([T.patches(rng, g)] * 2)
    pos, _ = q.get_rope_index(ids, mask, model.config, np.array(g * 2))
    vis = q.vision_inputs(pv, np.array(g * 2), model.config.vision)
    return jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(pos), vis


def _logits(model, inputs):
    ids, mask, pos, vis = inputs
    return np.asarray(model.forward(ids, mask, pos, images=vis).logits)


def _randomise_b(model, seed=1):
    """Non-zero B (a fresh adapter is exactly the identity)."""
    for i, m in enumerate(lora.lora_modules(model)):
        b = m.lora_b[...]
        m.lora_b[...] = 0.05 * jax.random.normal(jax.random.key(seed + i), b.shape, b.dtype)


def test_trainable_count_equals_formula(ckpt):
    model = q.load(ckpt)
    cfg = model.config.text
    rank = 4
    wrapped = lora.apply_lora(model, rank, 8.0, 0.0, ("q_proj", "v_proj", "down_proj"))
    d, hd = cfg.hidden_size, cfg.head_dim
    per_layer = rank * (
        (d + cfg.num_attention_heads * hd)
        + (d + cfg.num_key_value_heads * hd)
        + (cfg.intermediate_size + d)
    )
    assert len(wrapped) == 3  # scanned layers: one stacked site per projection
    assert all(n.startswith("model.layers.") for n in wrapped)  # never the vision tower
    assert lora.lora_param_count(model) == cfg.num_hidden_layers * per_layer
    _, params = nnx.split(model, nnx.Param)
    trainable, frozen = lora.split_params(params, lora.trainable_filter(True))
    assert sum(x.size for x in jax.tree.leaves(trainable)) == cfg.num_hidden_layers * per_layer
    visual = lora.split_params(params, lora.trainable_filter(True, train_vision=True))[0]
    n_vis = sum(x.size for x in jax.tree.leaves(nnx.state(model.visual, nnx.Param)))
    assert sum(x.size for x in jax.tree.leaves(visual)) == n_vis + cfg.num_hidden_layers * per_layer
    print(
        f"\nLoRA rank {rank}: {lora.lora_param_count(model)} trainable of "
        f"{sum(x.size for x in jax.tree.leaves(params))}"
    )


def test_fresh_adapter_and_lora_off_are_the_base_model(ckpt):
    base = q.load(ckpt)
    inputs = _inputs(base)
    want = _logits(base, inputs)
    model = q.load(ckpt)
    lora.apply_lora(model, 8, 16.0, 0.05, ("q_proj", "v_proj"))
    np.testing.assert_array_equal(_logits(model, inputs), want)  # B = 0
    _randomise_b(model)
    assert np.abs(_logits(model, inputs) - want).max() > 1e-4
    graphdef, params = nnx.split(model, nnx.Param)
    off = nnx.merge(graphdef, lora.lora_off(params))
    np.testing.assert_array_equal(_logits(off, inputs), want)


def _export_merged(model, params, path):
    """The policy (`params` on `model`'s graph) saved as an HF checkpoint with its LoRA
    adapters merged into the base weights (W + A B alpha / r)."""
    q.save(lora.merge_lora(nnx.merge(nnx.graphdef(model), params)), path)


def test_merged_export_logits_equal_lora_model(ckpt, tmp_path):
    model = q.load(ckpt)
    lora.apply_lora(model, 8, 16.0, 0.05, ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj"))
    _randomise_b(model)
    inputs = _inputs(model)
    want = _logits(model, inputs)
    _, params = nnx.split(model, nnx.Param)
    _export_merged(model, params, tmp_path / "merged")
    merged = q.load(tmp_path / "merged")
    assert not lora.lora_modules(merged)
    np.testing.assert_allclose(_logits(merged, inputs), want, atol=2e-5, rtol=1e-5)


def test_targets_by_regex_and_errors(ckpt):
    model = q.load(ckpt, scan_layers=False)  # per-layer paths: a regex can pick layers
    wrapped = lora.apply_lora(model, 2, 4.0, 0.0, (r"model\.layers\.0\..*_proj",))
    assert wrapped and all(n.startswith("model.layers.0.") for n in wrapped)
    assert len(wrapped) == 7  # q, k, v, o, gate, up, down
    with pytest.raises(ValueError, match="match no Linear"):
        lora.apply_lora(q.load(ckpt), 2, 4.0, 0.0, ("qproj",))
    with pytest.raises(ValueError, match="no layer index"):  # scanned: no per-layer paths
        lora.apply_lora(q.load(ckpt), 2, 4.0, 0.0, (r"model\.layers\.0\..*_proj",))


@pytest.mark.parametrize("qtype", ["int8", "nf4"])
def test_qlora_quantized_base_and_merged_export(ckpt, tmp_path, qtype):
    pytest.importorskip("qwix")
    base = q.load(ckpt)
    inputs = _inputs(base)
    model = q.load(ckpt)
    lora.apply_lora(model, 8, 16.0, 0.0, ("q_proj", "v_proj"), quantize=qtype, quant_tile=32)
    attn = model.model.layer(0).self_attn
    assert isinstance(attn.q_proj.base, lora.QuantLinear)
    assert isinstance(attn.k_proj, lora.QuantLinear)  # frozen layers are quantized too
    assert isinstance(model.model.layer(0).mlp.down_proj, lora.QuantLinear)
    _, params = nnx.split(model, nnx.Param)
    trainable, frozen = lora.split_params(params, lora.trainable_filter(True))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(trainable))
    assert sum(x.size for x in jax.tree.leaves(trainable)) == lora.lora_param_count(model)
    err = np.abs(_logits(model, inputs) - _logits(base, inputs)).max()
    assert 0 < err < (1.0 if qtype == "int8" else 5.0)  # quantization error, not garbage
    _randomise_b(model)
    want = _logits(model, inputs)
    _, params = nnx.split(model, nnx.Param)
    _export_merged(model, params, tmp_path / "merged")
    merged = q.load(tmp_path / "merged")
    np.testing.assert_allclose(_logits(merged, inputs), want, atol=5e-5, rtol=1e-5)
