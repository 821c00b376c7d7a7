"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B: sparse layers with a shared expert, q/k/v
biases by config.json's qkv_bias) against transformers on tiny random checkpoints saved with
save_pretrained and read by our loader: float32 logits of left-padded rows (a dense layer
and a sparse one by decoder_sparse_step), which the shared expert moves, greedy tokens of HF
`generate`, scanned against unrolled layers, exports transformers loads to the same logits,
the config's keys written back, the shared expert's sharding axes, refusals, and the
published models' parameter counts, total and active."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxvrl import models as M
from jaxvrl.config import ConfigError
from jaxvrl.models import moe
from jaxvrl.models.layers import GatedMLP
from jaxvrl.sampling import generate
from tests.models import hf_tiny_text as T
from tests.models.export_check import export_equals_checkpoint
from tests.models.test_qwen2_5_vl_parity import assert_close
from tests.models.test_qwen3_moe import build_spread
from tests.models.test_text_families import (
    hf_logits,
    ours,
    sampled_logprobs_match_teacher_forcing_and_slots,
)

EXPERTS, TOP_K, SHARED = 6, 2, 24


def build(path, seed=0, **kw):
    """A tiny Qwen2MoeForCausalLM (hidden 32, 6 experts of width 16, top 2 not renormalised,
    a shared expert of width 24, q/k/v biases) saved at `path`, its experts' weights, the
    shared expert's and its gate's spread so that each expert's output and the gate's
    sigmoid count."""
    cfg = dict(num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=16,
               shared_expert_intermediate_size=SHARED, norm_topk_prob=False, qkv_bias=True)  # fmt: skip
    return build_spread("qwen2_moe", path, seed, (".experts.", ".shared_expert"), **cfg, **kw)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """(HF model, our model (unrolled layers), path): layer 0 dense, layer 1 sparse
    (decoder_sparse_step 2)."""
    path = tmp_path_factory.mktemp("qwen2_moe_mixed")
    hf = build(path, decoder_sparse_step=2)
    return hf, M.load(path, scan_layers=False), path


@pytest.fixture(scope="module")
def sparse(tmp_path_factory):
    """(HF model, our model (scanned layers), path): two layers, both sparse."""
    path = tmp_path_factory.mktemp("qwen2_moe_sparse")
    hf = build(path, seed=1)
    return hf, M.load(path), path


def test_logits_and_config(mixed):
    """Left-padded rows through a dense and a sparse layer; the config reads and writes back
    the shared expert's width and qkv_bias."""
    hf, model, path = mixed
    cfg = model.config
    t = cfg.text
    assert (t.num_experts, t.num_experts_per_tok, t.shared_expert_intermediate_size) == (
        EXPERTS, TOP_K, SHARED,
    )  # fmt: skip
    assert (t.attention_bias, t.output_bias, t.qk_norm, t.norm_topk_prob) == (
        True, False, False, False,
    )  # fmt: skip
    assert moe.sparse_layers(t) == (False, True)
    dense, block = model.model.layers[0].mlp, model.model.layers[1].mlp
    assert isinstance(dense, GatedMLP) and isinstance(block.shared_expert, GatedMLP)
    assert block.shared_expert.up_proj.kernel.shape == (32, SHARED)
    assert block.shared_expert_gate.kernel.shape == (32, 1)
    assert M.load_config(path) == cfg and type(cfg).from_hf_dict(cfg.to_hf_dict()) == cfg
    d = cfg.to_hf_dict()
    assert (d["shared_expert_intermediate_size"], d["qkv_bias"]) == (SHARED, True)
    assert (d["decoder_sparse_step"], d["architectures"]) == (2, ["Qwen2MoeForCausalLM"])
    ids, mask = T.prompts(seed=1)
    assert_close(ours(model, ids, mask).logits, hf_logits(hf, ids, mask), mask)


def test_the_shared_expert_counts(mixed):
    """The same weights without the shared expert's output (its down_proj zeroed) give other
    logits: a block that skipped its shared expert would fail the parity above."""
    _, model, _ = mixed
    graphdef, state = nnx.split(model)
    off = nnx.merge(graphdef, jax.tree.map(jnp.array, state))
    down = off.model.layers[1].mlp.shared_expert.down_proj.kernel
    down[...] = jnp.zeros_like(down[...])
    ids, mask = T.prompts(seed=1)
    a, b = np.asarray(ours(model, ids, mask).logits), np.asarray(ours(off, ids, mask).logits)
    assert np.abs(a - b)[mask > 0].max() > 0.05 * np.abs(a).max()


def test_greedy_tokens_match_hf_generate(mixed):
    hf, model, _ = mixed
    ids, mask = T.prompts(seed=3)
    out = generate(model, ids, mask, max_new_tokens=6, temperature=0.0)
    np.testing.assert_array_equal(np.asarray(out.tokens), T.hf_greedy(hf, ids, mask, 6))


def test_sampled_logprobs_match_teacher_forcing_and_slots(sparse):
    """Sampled at temperature 1 (scanned layers, the CPU decode forms), the log-probs equal
    HF's teacher-forced pass and the refilling slots sample the same tokens."""
    hf, model, _ = sparse
    sampled_logprobs_match_teacher_forcing_and_slots(hf, model)


def test_scanned_and_unrolled_layers_agree(sparse):
    """Stacked shared experts [L, D, S] in the scan against each layer's own."""
    _, scanned, path = sparse
    assert scanned.model.layers.mlp.shared_expert.gate_proj.kernel.shape == (2, 32, SHARED)
    unrolled = M.load(path, scan_layers=False)
    ids, mask = T.prompts(seed=4)
    a, b = ours(scanned, ids, mask).logits, ours(unrolled, ids, mask).logits
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())


@pytest.mark.parametrize("name", ["mixed", "sparse"])
def test_export_loads_in_transformers(name, request, tmp_path):
    """The export's tensors are the checkpoint's (the shared expert's and its gate's under
    their HF names, stacked layers or not), and transformers computes the same logits."""
    from transformers import AutoModelForCausalLM

    hf, model, path = request.getfixturevalue(name)
    exported = export_equals_checkpoint(model, path, tmp_path)
    assert "model.layers.1.mlp.shared_expert.down_proj.weight" in exported
    assert exported["model.layers.1.mlp.shared_expert_gate.weight"].shape == (1, 32)
    back = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(back) is type(hf)
    assert back.config.shared_expert_intermediate_size == SHARED and back.config.qkv_bias
    ids, mask = T.prompts(seed=1)
    np.testing.assert_array_equal(hf_logits(back, ids, mask), hf_logits(hf, ids, mask))


def test_qkv_bias_and_the_shared_expert_are_the_configs():
    """qkv_bias false: no q/k/v biases; a shared expert's width of 0: no shared expert."""
    d = {"model_type": "qwen2_moe", "num_hidden_layers": 1, "hidden_size": 32,
         "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4,
         "moe_intermediate_size": 8}  # fmt: skip
    assert M.config_from_hf(d).text.attention_bias
    cfg = M.config_from_hf(d | {"qkv_bias": False, "shared_expert_intermediate_size": 0})
    assert not cfg.text.attention_bias and not cfg.text.output_bias
    assert cfg.to_hf_dict()["qkv_bias"] is False
    model = nnx.eval_shape(lambda: M.Model(cfg, rngs=nnx.Rngs(0), scan_layers=False))
    layer = model.model.layers[0]
    assert layer.self_attn.q_proj.bias is None and layer.mlp.shared_expert is None


def test_the_shared_expert_shards_like_the_dense_mlp():
    """Its kernels (stacked, or one layer's QLoRA qvalue under a LoRA wrapper) take the dense
    MLP's logical axes; its gate, the router's."""
    from jaxvrl.parallel.sharding import param_axes

    for proj in ("gate_proj", "up_proj", "down_proj"):
        want = param_axes(f"model.layers.mlp.{proj}.kernel", 3)
        assert param_axes(f"model.layers.mlp.shared_expert.{proj}.kernel", 3) == want
        assert param_axes(f"model.layers.0.mlp.shared_expert.{proj}.base.qvalue", 2) == want[1:]
    assert param_axes("model.layers.mlp.shared_expert_gate.kernel", 3) == (
        "layers", "embed", None,
    )  # fmt: skip


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"use_sliding_window": True, "max_window_layers": 0},
            "use_sliding_window=true with max_window_layers=0 of 1 layers: sliding-window",
        ),
        ({"shared_expert_intermediate_size": -1}, "shared_expert_intermediate_size must be"),
    ],
)
def test_unsupported_configs_are_refused(change, message):
    """In one line naming the file and the key."""
    d = {"model_type": "qwen2_moe", "num_hidden_layers": 1} | change
    with pytest.raises(ConfigError, match=f"^config.json: .*{message}") as e:
        M.config_from_hf(d)
    assert "\n" not in str(e.value)


# Qwen2-57B-A14B's sizes where transformers' defaults (Qwen1.5-MoE-A2.7B's) differ
QWEN2_57B = dict(
    hidden_size=3584, intermediate_size=18944, moe_intermediate_size=2560,
    shared_expert_intermediate_size=20480, num_experts=64, num_experts_per_tok=8,
    num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
)  # fmt: skip
# name: (config.json's sizes, billions of parameters as the model cards round them, total
# and active)
PUBLISHED = {"Qwen1.5-MoE-A2.7B": ({}, 14.3, 2.7), "Qwen2-57B-A14B": (QWEN2_57B, 57.4, 14.0)}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_parameter_counts(name):
    """As transformers counts them on the meta device; active: the shared expert whole, k of
    the E routed experts (`aot.plan.active_count`)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from jaxvrl.aot.plan import active_count

    sizes, total, active = PUBLISHED[name]
    d = {"model_type": "qwen2_moe"} | sizes
    cfg = M.config_from_hf(d, name)
    model = nnx.eval_shape(lambda: M.Model(cfg, rngs=nnx.Rngs(0)))
    params = nnx.state(model, nnx.Param)
    count = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**d))
    assert count == sum(p.numel() for p in hf.parameters())
    assert abs(count / 1e9 - total) <= 0.01 * total, count
    assert abs(active_count(params, cfg) / 1e9 - active) <= 0.02 * active
