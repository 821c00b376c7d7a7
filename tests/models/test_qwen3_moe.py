"""Qwen3-MoE (sparse mixture-of-experts layers) against transformers on tiny random
checkpoints saved with save_pretrained (per-expert tensors, as the published checkpoints hold
them) and read by our loader: float32 logits of left-padded rows (all layers sparse, and
dense layers mixed in), greedy tokens of HF `generate`, the grouped-matmul experts against
the dense reference, scanned against unrolled layers, an export transformers loads to the
same logits, QLoRA's quantized experts and a QLoRA run's export, the load-balancing loss
against a numpy formula and transformers', and the Qwen3-30B-A3B preset's parameter count."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxvrl import models as M
from jaxvrl.config import ConfigError
from jaxvrl.models import lora, moe
from jaxvrl.models.layers import GatedMLP
from jaxvrl.sampling import generate
from tests.models import hf_tiny_text as T
from tests.models.export_check import export_equals_checkpoint, run_export_equals_merged
from tests.models.test_qwen2_5_vl_parity import assert_close
from tests.models.test_text_families import hf_logits, ours
from tests.tolerance import assert_reduction_close, term_scale

EXPERTS, TOP_K = 8, 2


def build(path, seed=0, **kw):
    """A tiny Qwen3MoeForCausalLM (hidden 32, head_dim 16, 8 experts of width 16, top 2)
    saved at `path`, its expert weights spread so that each expert's output counts."""
    cfg = dict(head_dim=16, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
               moe_intermediate_size=16, norm_topk_prob=True)  # fmt: skip
    return build_spread("qwen3_moe", path, seed, (".experts.",), **cfg, **kw)


def build_spread(model_type: str, path, seed: int, spread: tuple[str, ...], **kw):
    """A tiny random `model_type` model (hf_tiny_text's config with `kw`) saved at `path`,
    the weights whose names hold one of `spread` drawn from N(0, 0.3) so that each counts."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = T.make_config(model_type, **kw)
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    T._spread(hf)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if any(s in name for s in spread):
                p.normal_(0.0, 0.3)
    hf.save_pretrained(path)
    return hf


def routed_otherwise(route):
    """`moe.route` as a sampler whose numerics route otherwise would: its own choice (no
    recorded selection given) is the experts ranked 2..k+1 by the router; a given selection
    is routed as `route` routes it."""

    def other(logits, top_k, normalize, selected=None):
        if selected is None:
            probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
            selected = jax.lax.top_k(probs, top_k + 1)[1][:, 1:]
        return route(logits, top_k, normalize, selected)

    return other


@pytest.fixture(scope="module")
def sparse(tmp_path_factory):
    """(HF model, our model (scanned layers), path): two layers, both sparse."""
    path = tmp_path_factory.mktemp("qwen3_moe")
    hf = build(path)
    return hf, M.load(path), path


def set_experts(model, name: str) -> None:
    for _, node in nnx.iter_graph(model):
        if isinstance(node, moe.SparseMoE):
            node.implementation = name


def test_logits_and_config(sparse):
    """Left-padded rows; the checkpoint's per-expert tensors fill the stacked experts."""
    hf, model, path = sparse
    cfg = model.config
    t = cfg.text
    assert (t.num_experts, t.num_experts_per_tok, t.moe_intermediate_size) == (EXPERTS, TOP_K, 16)
    assert t.norm_topk_prob and t.qk_norm and moe.sparse_layers(t) == (True, True)
    assert model.model.layers.mlp.experts.gate_proj.kernel.shape == (2, EXPERTS, 32, 16)
    assert M.load_config(path) == cfg and type(cfg).from_hf_dict(cfg.to_hf_dict()) == cfg
    with open(path / "config.json") as f:
        assert "num_local_experts" in json.load(f)  # what transformers writes for num_experts
    ids, mask = T.prompts(seed=1)
    assert_close(ours(model, ids, mask).logits, hf_logits(hf, ids, mask), mask)


def test_dense_layers_mixed_in(tmp_path):
    """mlp_only_layers: layer 1 of 3 keeps the dense MLP (unrolled layers); a scanned model
    of mixed layers is refused in one line."""
    hf = build(tmp_path, seed=1, layers=3, mlp_only_layers=[1])
    model = M.load(tmp_path, scan_layers=False)
    assert moe.sparse_layers(model.config.text) == (True, False, True)
    assert isinstance(model.model.layers[1].mlp, GatedMLP)
    ids, mask = T.prompts(seed=2)
    assert_close(ours(model, ids, mask).logits, hf_logits(hf, ids, mask), mask)
    with pytest.raises(ConfigError, match="scan_layers=true needs decoder layers alike"):
        M.load(tmp_path)


def test_ragged_experts_equal_the_dense_reference():
    """The grouped matmul over tokens sorted by expert against every expert on every token
    (an expert left without tokens among them), outputs and gradients."""
    rng = np.random.default_rng(0)
    n, d, f = 13, 32, 16
    x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
    kernels = tuple(
        jnp.asarray(rng.normal(size=s) / math.sqrt(s[1]), jnp.float32)
        for s in ((EXPERTS, d, f), (EXPERTS, d, f), (EXPERTS, f, d))
    )
    logits = jnp.asarray(rng.normal(size=(n, EXPERTS)), jnp.float32).at[:, 5].set(-1e3)
    weights, experts = moe.route(logits, TOP_K, True)
    assert not np.any(np.asarray(experts) == 5)
    a = moe.ragged_experts(x, weights, experts, kernels, jax.nn.silu)
    b = moe.dense_experts(x, weights, experts, kernels, jax.nn.silu)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(np.abs(b).max()))
    # and their gradients (the training pass) in x, the routing weights and the kernels

    def grads(run):
        def f(x, weights, kernels):
            return jnp.sum(jnp.sin(run(x, weights, experts, kernels, jax.nn.silu)))

        return jax.tree.leaves(jax.grad(f, argnums=(0, 1, 2))(x, weights, kernels))

    for ga, gb in zip(grads(moe.ragged_experts), grads(moe.dense_experts)):
        np.testing.assert_allclose(ga, gb, rtol=1e-4, atol=1e-5 * float(np.abs(gb).max()))
    # a fused gate_up [E, D, 2F] (gate's columns first): one grouped matmul, its output split
    fused = (jnp.concatenate(kernels[:2], axis=-1), kernels[2])
    for run, want in ((moe.ragged_experts, a), (moe.dense_experts, b)):
        got = run(x, weights, experts, fused, jax.nn.silu)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * float(np.abs(b).max()))


def test_model_with_dense_experts(sparse):
    """The model's logits with the experts' grouped matmuls and with the dense reference."""
    _, model, _ = sparse
    ids, mask = T.prompts(seed=3)
    ragged = np.asarray(ours(model, ids, mask).logits)
    set_experts(model, "dense")
    try:
        dense = np.asarray(ours(model, ids, mask).logits)
    finally:
        set_experts(model, "ragged")
    np.testing.assert_allclose(ragged, dense, rtol=1e-5, atol=1e-5 * np.abs(dense).max())


def test_route_as_transformers():
    """Softmax over the experts in float32, top k, renormalised where asked; a recorded
    selection takes the live router's weights."""
    logits = jnp.asarray([[1.0, 3.0, 2.0, 0.0]], jnp.bfloat16)
    p = np.exp([1.0, 3.0, 2.0, 0.0]) / np.exp([1.0, 3.0, 2.0, 0.0]).sum()
    w, e = moe.route(logits, 2, False)
    assert w.dtype == jnp.float32 and e.tolist() == [[1, 2]]
    np.testing.assert_allclose(w, [[p[1], p[2]]], rtol=1e-6)
    w, _ = moe.route(logits, 2, True)
    np.testing.assert_allclose(w, [[p[1] / (p[1] + p[2]), p[2] / (p[1] + p[2])]], rtol=1e-6)
    w, e = moe.route(logits, 2, False, selected=jnp.asarray([[0, 3]]))
    assert e.tolist() == [[0, 3]]
    np.testing.assert_allclose(w, [[p[0], p[3]]], rtol=1e-6)


def test_scanned_and_unrolled_layers_agree(sparse):
    _, scanned, path = sparse
    unrolled = M.load(path, scan_layers=False)
    assert unrolled.model.layers[0].mlp.experts.up_proj.kernel.shape == (EXPERTS, 32, 16)
    ids, mask = T.prompts(seed=4)
    a, b = ours(scanned, ids, mask).logits, ours(unrolled, ids, mask).logits
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())


def test_export_loads_in_transformers(sparse, tmp_path):
    """The export's tensors are the checkpoint's (per expert), its config names the experts,
    and transformers computes the same logits from it."""
    from transformers import AutoModelForCausalLM

    hf, model, path = sparse
    exported = export_equals_checkpoint(model, path, tmp_path)
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in exported
    back = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(back) is type(hf) and back.config.num_experts == EXPERTS
    assert back.config.norm_topk_prob and back.config.num_experts_per_tok == TOP_K
    ids, mask = T.prompts(seed=1)
    np.testing.assert_array_equal(hf_logits(back, ids, mask), hf_logits(hf, ids, mask))


def test_greedy_tokens_match_hf_generate(sparse):
    hf, model, _ = sparse
    ids, mask = T.prompts(seed=2)
    out = generate(model, ids, mask, max_new_tokens=6, temperature=0.0)
    np.testing.assert_array_equal(np.asarray(out.tokens), T.hf_greedy(hf, ids, mask, 6))


def _numpy_balance_loss(logits, top_k, mask):
    """Switch Transformer's loss written out: E * sum_e f_e P_e over the valid tokens of
    every layer, f_e the top-k assignments to e per token, P_e e's mean probability."""
    logits = np.asarray(logits, np.float64)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    layers, n, e = p.shape
    f, prob, rows = np.zeros(e), np.zeros(e), 0.0
    for layer in range(layers):
        for t in range(n):
            if mask[t]:
                for j in np.argsort(-p[layer, t])[:top_k]:
                    f[j] += 1
                prob += p[layer, t]
                rows += 1
    return e * np.sum((f / rows) * (prob / rows))


def test_load_balancing_loss():
    """Against the formula in numpy and transformers' `load_balancing_loss_func`, with and
    without padding."""
    import torch
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 10, EXPERTS)).astype(np.float32)
    mask = (np.arange(10) >= 3).astype(np.int64)  # a left-padded row of 10
    for m in (None, mask):
        got = moe.load_balancing_loss(jnp.asarray(logits), TOP_K, m)
        want = _numpy_balance_loss(logits, TOP_K, np.ones(10) if m is None else m)
        hf = load_balancing_loss_func(
            tuple(torch.tensor(x) for x in logits),
            EXPERTS,
            TOP_K,
            None if m is None else torch.tensor(m)[None],
        )
        # a sum of E products of terms of order k / E and 1 / E
        scale = term_scale(np.full(EXPERTS, TOP_K / EXPERTS**2))
        assert_reduction_close(got, want, EXPERTS * scale)
        assert_reduction_close(got, float(hf), EXPERTS * scale)
    uniform = moe.load_balancing_loss(jnp.zeros((1, 4, EXPERTS)), TOP_K)
    np.testing.assert_allclose(uniform, TOP_K, rtol=1e-6)  # balanced: E * E * (k/E) * (1/E)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_experts_per_tok": 9}, "num_experts_per_tok 9 must be in"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step must be positive"),
    ],
)
def test_unsupported_configs_are_refused(change, message):
    d = {"model_type": "qwen3_moe", "num_hidden_layers": 1, "num_experts": 8} | change
    with pytest.raises(ConfigError, match=message):
        M.config_from_hf(d)


def test_preset_has_the_published_parameter_count():
    """Qwen3-30B-A3B: 30.5B parameters (the model card's), as transformers counts them on
    the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    assert "qwen3-30b-a3b" in M.preset_names()
    with open(f"{M.PRESETS}/qwen3-30b-a3b.json") as f:
        d = json.load(f)
    cfg = M.config_from_hf(d, "qwen3-30b-a3b")
    t = cfg.text
    assert (t.num_experts, t.num_experts_per_tok, t.num_hidden_layers) == (128, 8, 48)
    assert all(moe.sparse_layers(t))
    model = nnx.eval_shape(lambda: M.Model(cfg, rngs=nnx.Rngs(0)))
    count = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**d))
    assert count == sum(p.numel() for p in hf.parameters())
    assert abs(count / 1e9 - 30.5) <= 0.01 * 30.5, count


def randomise_adapters(model, seed=0) -> None:
    """Non-zero B (a fresh adapter is exactly the identity: nothing to merge)."""
    rng = np.random.default_rng(seed)
    for m in lora.lora_modules(model):
        m.lora_b[...] = rng.normal(0, 0.1, m.lora_b.shape).astype(np.float32)


def dequantized_experts(model):
    """A copy of `model` whose expert projections are plain ExpertKernels holding
    `lora.dequantize` of their stored fields (the other quantized layers left as they are)."""
    copy = nnx.merge(*nnx.split(model))
    sites = [
        (node, name, q)
        for _, node in nnx.iter_graph(copy)
        if isinstance(node, moe.Experts)
        for name, q in vars(node).items()
        if isinstance(q, lora.QuantExpertKernel)
    ]
    for node, name, q in sites:
        plain = moe.ExpertKernel(1, 1, 1, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
        w = lora.dequantize(q.qvalue[...], q.scale[...], None, q.qtype, jnp.float32)
        plain.kernel = nnx.Param(w)
        setattr(node, name, plain)
    return copy


def check_quantized_experts(model, shapes: dict, dtype) -> None:
    """Every expert param of `model` is a frozen QuantParam qvalue or scale of the given
    {path: (qvalue shape, scale shape)} and stored dtype, split over the experts axis; no
    float expert kernel is left and none is trainable."""
    from jaxvrl.parallel.sharding import param_axes

    params = nnx.state(model, nnx.Param)
    experts = {
        ".".join(map(str, path)): v for path, v in nnx.to_flat_state(params) if "experts" in path
    }
    assert experts and all(isinstance(v, lora.QuantParam) for v in experts.values())
    assert {n.rsplit(".", 1)[-1] for n in experts} == {"qvalue", "scale"}  # no float kernel
    for name, (qshape, sshape) in shapes.items():
        q, s = experts[f"{name}.qvalue"], experts[f"{name}.scale"]
        assert (q.shape, q.dtype, s.shape, s.dtype) == (qshape, dtype, sshape, jnp.float32)
        for leaf in ("qvalue", "scale"):
            axes = param_axes(f"{name}.{leaf}", len(qshape))
            assert axes[len(qshape) - 3] == "experts", (name, axes)
    trainable, _ = lora.split_params(params, lora.trainable_filter(True))
    flat = nnx.to_flat_state(trainable)
    assert flat and not [path for path, _ in flat if "experts" in path]


@pytest.fixture(scope="module")
def qlora(sparse):
    """The scanned model of `sparse` under int8 QLoRA (tiles of 16 input rows), adapters on
    q_proj with non-zero B."""
    pytest.importorskip("qwix")
    _, _, path = sparse
    model = M.load(path)
    lora.apply_lora(model, 4, 8.0, 0.0, ("q_proj",), quantize="int8", quant_tile=16)
    randomise_adapters(model)
    return model


def test_qlora_quantizes_the_experts(sparse, qlora):
    """int8 QLoRA stores every expert projection quantized per layer, expert and output channel
    (gate and up in tiles of 16 of their 32 input rows, down untiled: 16 rows), frozen; the
    model runs on the dequantized kernels: its logits are those of the model holding them as
    float kernels, and near the float model's."""
    _, base, _ = sparse
    e = "model.layers.mlp.experts"
    shapes = {
        f"{e}.gate_proj": ((2, EXPERTS, 32, 16), (2, EXPERTS, 2, 16)),
        f"{e}.up_proj": ((2, EXPERTS, 32, 16), (2, EXPERTS, 2, 16)),
        f"{e}.down_proj": ((2, EXPERTS, 16, 32), (2, EXPERTS, 1, 32)),
    }
    check_quantized_experts(qlora, shapes, jnp.int8)
    ids, mask = T.prompts(seed=1)
    got = np.asarray(ours(qlora, ids, mask).logits)
    want = np.asarray(ours(dequantized_experts(qlora), ids, mask).logits)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    frozen = lora.lora_off(nnx.state(qlora, nnx.Param))  # B = 0: the quantized base model
    off = np.asarray(ours(nnx.merge(nnx.graphdef(qlora), frozen), ids, mask).logits)
    ref = np.asarray(ours(base, ids, mask).logits)
    err = np.abs(off - ref)[mask.astype(bool)].max() / np.abs(ref).max()
    assert 0 < err < 0.1, err  # int8 quantization error, not garbage


def test_qlora_run_exports_the_merged_experts(sparse, qlora, tmp_path):
    """A QLoRA run's checkpoint exports (`jaxvrl.export`) the merged model: float experts
    under their per-expert HF names, which transformers loads to the merged model's logits."""
    from transformers import AutoModelForCausalLM

    hf, _, path = sparse
    merged = lora.merge_lora(qlora)
    kernel = merged.model.layers.mlp.experts.down_proj
    assert type(kernel) is moe.ExpertKernel and kernel.kernel.dtype == jnp.float32
    assert not lora.wrapped(merged)
    ids, mask = T.prompts(seed=1)
    got = np.asarray(ours(merged, ids, mask).logits)
    want = np.asarray(ours(qlora, ids, mask).logits)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    settings = {"alpha": 8.0, "quantize": "int8"}
    exported = run_export_equals_merged(qlora, path, tmp_path, settings)
    assert exported["model.layers.1.mlp.experts.7.down_proj.weight"].dtype == np.float32
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(back) is type(hf)
    assert_close(got, hf_logits(back, ids, mask), mask)
