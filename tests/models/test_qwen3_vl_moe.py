"""Qwen3-VL-MoE against transformers on one tiny random checkpoint saved with save_pretrained
(2 sparse layers of 4 experts, top 2; a 2-block vision tower with DeepStack at block 0) and
read by our loader: float32 logits of a left-padded batch with an image, a video and text
only, greedy tokens of HF `generate` on an image prompt, an export transformers loads to the
same logits, the published checkpoints' expert layout, nf4 QLoRA's quantized fused experts
and a QLoRA run's export, and the Qwen3-VL-30B-A3B preset's parameter count."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxvrl import models as M
from jaxvrl.models import lora, moe
from jaxvrl.parallel.sharding import param_axes
from jaxvrl.sampling import generate
from tests.models import hf_tiny_qwen3_vl as T
from tests.models.export_check import export_equals_checkpoint
from tests.models.hf_tiny import IM_END, IMAGE, VEND, VIDEO, VSTART, left_pad
from tests.models.test_qwen2_5_vl_parity import assert_close
from tests.models.test_qwen3_vl_parity import hf_inputs, hf_logits, ours

EXPERTS, TOP_K, WIDTH, HIDDEN = 4, 2, 48, 64
GATE_UP = "model.language_model.layers.{}.mlp.experts.gate_up_proj"
DOWN = "model.language_model.layers.{}.mlp.experts.down_proj"


def build(path, seed=0):
    """A tiny Qwen3VLMoeForConditionalGeneration saved at `path` (the shapes of
    tests/trainer/test_families.py's Qwen3-VL with experts), its weights spread so that each
    expert's output counts."""
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
            "mrope_interleaved": True}  # fmt: skip
    text = dict(
        vocab_size=300, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_parameters=rope,
        num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=WIDTH,
        bos_token_id=None, eos_token_id=IM_END,
    )  # fmt: skip
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  patch_size=T.PATCH, num_position_embeddings=16, deepstack_visual_indexes=[0])  # fmt: skip
    cfg = Qwen3VLMoeConfig(
        text_config=text, vision_config=vision, tie_word_embeddings=False, image_token_id=IMAGE,
        video_token_id=VIDEO, vision_start_token_id=VSTART, vision_end_token_id=VEND,
    )  # fmt: skip
    torch.manual_seed(seed)
    hf = Qwen3VLMoeForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if ".experts." in name:
                p.normal_(0.0, 0.3)
            elif name.endswith("weight") and p.ndim >= 2:
                p.mul_(3.0)
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    hf.save_pretrained(path)
    return hf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(HF model, our model (scanned layers), path)."""
    path = tmp_path_factory.mktemp("qwen3_vl_moe")
    hf = build(path)
    return hf, M.load(path), path


@pytest.fixture(scope="module")
def batch():
    """Left-padded rows: an image (6 x 8 patches); a video of 2 frame groups; text only."""
    rng = np.random.default_rng(0)
    images, videos = [[1, 6, 8]], [[2, 4, 4]]
    rows = [T.prompt(rng, images=images), T.prompt(rng, videos=videos), T.prompt(rng)]
    ids, mask = left_pad(rows)
    vision = dict(
        images=images, videos=videos, pv=T.patches(rng, images), pvv=T.patches(rng, videos)
    )
    return ids, mask, vision


def test_config_and_checkpoint_layout(tiny):
    """The expert keys are read (num_local_experts as transformers writes num_experts), the
    router renormalises, and save_pretrained's experts are fused [E, 2F, D] and [E, D, F]."""
    _, model, path = tiny
    cfg = model.config
    t, v = cfg.text, cfg.vision
    sizes = (t.num_experts, t.num_experts_per_tok, t.moe_intermediate_size)
    assert sizes == (EXPERTS, TOP_K, WIDTH)
    assert t.norm_topk_prob and t.fused_gate_up and moe.sparse_layers(t) == (True, True)
    assert v.deepstack_visual_indexes == (0,) and t.mrope_interleaved
    assert M.load_config(path) == cfg and type(cfg).from_hf_dict(cfg.to_hf_dict()) == cfg
    with open(path / "config.json") as f:
        assert "num_local_experts" in json.load(f)["text_config"]
    tensors = load_file(path / "model.safetensors")
    assert tensors[GATE_UP.format(0)].shape == (EXPERTS, 2 * WIDTH, HIDDEN)
    assert tensors[DOWN.format(1)].shape == (EXPERTS, HIDDEN, WIDTH)
    experts = model.model.layers.mlp.experts
    assert experts.gate_up_proj.kernel.shape == (2, EXPERTS, HIDDEN, 2 * WIDTH)
    assert experts.down_proj.kernel.shape == (2, EXPERTS, WIDTH, HIDDEN)
    # the fused kernel is split like a dense MLP's up projection
    fused = "model.layers.mlp.experts.gate_up_proj.kernel"
    assert param_axes(fused, 4) == ("layers", "experts", "embed", "mlp")


def test_logits_with_an_image_a_video_and_left_padding(tiny, batch):
    hf, model, _ = tiny
    ids, mask, vision = batch
    got, ref = ours(model, ids, mask, **vision).logits, hf_logits(hf, ids, mask, **vision)
    for row in range(len(ids)):  # an image; a video; text
        assert_close(got[row : row + 1], ref[row : row + 1], mask[row : row + 1])


def test_greedy_tokens_match_hf_generate(tiny, batch):
    """The sampler's prefill (per-layer cache, DeepStack) and decode steps on an image prompt."""
    hf, model, _ = tiny
    ids, mask, vision = batch
    ids, mask, n = ids[:1], mask[:1], 6
    pv, grid = vision["pv"], np.array(vision["images"])
    out = generate(
        model, ids, mask, pixel_values=pv, image_grid_thw=grid, max_new_tokens=n,
        temperature=0.0,
    )  # fmt: skip
    with torch.no_grad():
        ref = hf.generate(
            **hf_inputs(ids, mask, images=vision["images"], pv=pv),
            max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
        )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(out.tokens), ref[:, ids.shape[1] :].numpy())


def test_export_loads_in_transformers(tiny, batch, tmp_path):
    """The export's tensors are the checkpoint's (the fused experts as save_pretrained writes
    them), and transformers computes the same logits from it."""
    from transformers import Qwen3VLMoeForConditionalGeneration

    hf, model, path = tiny
    export_equals_checkpoint(model, path, tmp_path)
    back = Qwen3VLMoeForConditionalGeneration.from_pretrained(tmp_path).eval()
    assert back.config.text_config.num_experts == EXPERTS
    ids, mask, vision = batch
    np.testing.assert_array_equal(
        hf_logits(back, ids, mask, **vision), hf_logits(hf, ids, mask, **vision)
    )


def test_published_expert_layout_loads(tiny, tmp_path):
    """The published checkpoints hold the experts [E, D, 2F] and [E, F, D]: the same params."""
    _, model, path = tiny
    tensors = load_file(path / "model.safetensors")
    for i in range(2):
        for key in (GATE_UP.format(i), DOWN.format(i)):
            tensors[key] = np.ascontiguousarray(tensors[key].swapaxes(1, 2))
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    published = M.load(tmp_path)
    a, b = nnx.state(model, nnx.Param), nnx.state(published, nnx.Param)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)


def test_preset_has_the_published_parameter_count():
    """Qwen3-VL-30B-A3B: 31.07B parameters, as transformers counts them on the meta device;
    its vision tower is transformers' Qwen3VLMoeConfig default (27 blocks of 1152, DeepStack
    at 8, 16, 24)."""
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    assert "qwen3-vl-30b-a3b" in M.preset_names()
    with open(f"{M.PRESETS}/qwen3-vl-30b-a3b.json") as f:
        d = json.load(f)
    cfg = M.config_from_hf(d, "qwen3-vl-30b-a3b")
    t, v = cfg.text, cfg.vision
    assert (t.hidden_size, t.num_hidden_layers, t.num_experts, t.num_experts_per_tok) == (
        2048, 48, 128, 8,
    )  # fmt: skip
    assert (t.moe_intermediate_size, t.num_attention_heads, t.num_key_value_heads) == (768, 32, 4)
    assert (t.head_dim, t.vocab_size) == (128, 151936) and all(moe.sparse_layers(t))
    default = Qwen3VLMoeConfig().vision_config
    assert (v.depth, v.hidden_size, v.deepstack_visual_indexes) == (
        default.depth, default.hidden_size, tuple(default.deepstack_visual_indexes),
    )  # fmt: skip
    model = nnx.eval_shape(lambda: M.Model(cfg, rngs=nnx.Rngs(0)))
    count = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    with torch.device("meta"):
        hf = Qwen3VLMoeForConditionalGeneration(Qwen3VLMoeConfig(**d))
    assert count == sum(p.numel() for p in hf.parameters())
    assert abs(count / 1e9 - 31.07) <= 0.01 * 31.07, count
    # what a token multiplies by (the AOT tool's model FLOPs): 8 of the 128 experts' weights
    from jaxvrl.aot.plan import active_count

    share = 8 / 128
    active = sum(p.numel() * (share if ".experts." in n else 1) for n, p in hf.named_parameters())
    assert active_count(nnx.state(model, nnx.Param), cfg) == round(active)
    assert 3.0e9 < active < 4.5e9, active  # "A3B": about 3B active in the text decoder


def test_replayed_routes_give_the_sampled_logprobs(tiny, batch, monkeypatch):
    """A sampler whose routers pick the experts ranked 2..k+1 (a stand-in for numerics that
    route otherwise) on rows with an image, a video and text: a teacher-forced pass that
    replays its recorded routes (vision tokens, DeepStack, M-RoPE) gives its log-probs, and
    says where its routers would have chosen otherwise."""
    from tests.models.test_qwen3_moe import routed_otherwise

    _, model, _ = tiny
    ids, mask, vision = batch
    grids = [np.array(vision[k]) for k in ("images", "videos")]
    n = 5
    with monkeypatch.context() as mp:
        mp.setattr(moe, "route", routed_otherwise(moe.route))
        out = generate(
            model, ids, mask, pixel_values=vision["pv"], image_grid_thw=grids[0],
            pixel_values_videos=vision["pvv"], video_grid_thw=grids[1], max_new_tokens=n,
            temperature=1.0, rng=jax.random.key(2), routes=True,
        )  # fmt: skip
    done = np.asarray(out.mask).astype(mask.dtype)
    full, full_mask = np.concatenate([ids, out.tokens], 1), np.concatenate([mask, done], 1)
    pos, _ = M.rope_index(model.config, full, full_mask, *grids)
    media = [
        M.vision_inputs(model.config, x, g) for x, g in zip((vision["pv"], vision["pvv"]), grids)
    ]

    def logprobs(replay: bool):
        o = model.forward(
            full, full_mask, pos, images=media[0], videos=media[1], routes=out.routes,
            replay_routes=replay,
        )  # fmt: skip
        logits = np.asarray(o.logits[:, ids.shape[1] - 1 : -1], np.float64)
        lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
        chosen = np.take_along_axis(logits, np.asarray(out.tokens)[..., None], -1)[..., 0]
        gap = np.where(done > 0, chosen - lse - np.asarray(out.logprobs), 0.0)
        real = np.asarray(full_mask).reshape(-1) > 0
        return np.abs(gap).max(), np.asarray(o.route_mismatch)[:, real].mean()

    # (routed afresh it is not: tests/trainer/test_routing_replay.py)
    gap, mismatch = logprobs(True)
    assert gap <= 5e-6 * 6 and mismatch > 0.5  # log-sum-exps of ~6 (300 tokens)


def test_nf4_qlora_on_unscanned_fused_experts(tiny, tmp_path):
    """nf4 QLoRA on unrolled layers stores each layer's fused experts quantized (gate_up
    [E, D, 2F] in tiles of 32 of D's 64 rows; down [E, F, D] untiled: 32 does not divide F's
    48), frozen; a sparse block runs on the dequantized kernels; a run's export holds the
    merged model's fused experts."""
    pytest.importorskip("qwix")
    from tests.models.export_check import run_export_equals_merged
    from tests.models.test_qwen3_moe import (
        check_quantized_experts,
        dequantized_experts,
        randomise_adapters,
    )

    _, _, path = tiny
    model = M.load(path, scan_layers=False)
    lora.apply_lora(model, 4, 8.0, 0.0, ("q_proj",), quantize="nf4", quant_tile=32)
    randomise_adapters(model)
    shapes = {
        f"model.layers.{i}.mlp.experts.{name}": shape
        for i in range(2)
        for name, shape in (
            ("gate_up_proj", ((EXPERTS, HIDDEN, 2 * WIDTH), (EXPERTS, 2, 2 * WIDTH))),
            ("down_proj", ((EXPERTS, WIDTH, HIDDEN), (EXPERTS, 1, HIDDEN))),
        )
    }
    check_quantized_experts(model, shapes, jnp.int4)  # nf4's 4-bit codes, as int4 bits
    block = model.model.layers[1].mlp  # a sparse block (the model's logits: test_qwen3_moe)
    x = jax.random.normal(jax.random.key(0), (2, 5, HIDDEN))
    run = nnx.jit(lambda m, x: m(x))
    got, want = np.asarray(run(block, x)), np.asarray(run(dequantized_experts(block), x))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    settings = {"alpha": 8.0, "quantize": "nf4"}
    exported = run_export_equals_merged(model, path, tmp_path, settings)
    assert exported[GATE_UP.format(1)].shape == (EXPERTS, 2 * WIDTH, HIDDEN)
