"""The rollout's layout on one device (`Sampler.prepare`): parameters that need nothing are
used as they are; `dtype` samples what a model built in that compute dtype samples; LoRA
adapters are merged into their base weights, and the merged model samples what
`lora.merge_lora` of the policy samples, with the log-probs of the unmerged policy. (Meshes:
tests/parallel/test_mesh_step.py.)

Tolerance: merging sums W + A B in float32 before the matmul where the unmerged layer adds
x A B to x W: the same numbers up to float32 rounding of the logits (~1e-6), so the log-probs
agree to 1e-5 (observed ~1e-6) and the sampled tokens are equal.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxvrl.models import lora, qwen2_5_vl
from jaxvrl.models.config import TextConfig
from jaxvrl.sampling import RolloutParams, Sampler, decode_bytes, rollout_dtype, rollout_sizes
from jaxvrl.sampling.sampler import generation_config, sample
from tests.models import hf_tiny
from tests.sampling.test_prefill import inputs, prompts

N = 6


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    path = tmp_path_factory.mktemp("layout_model")
    hf_tiny.build(path, seed=4)
    return path


@pytest.fixture(scope="module")
def batch(path):
    model = qwen2_5_vl.load(path)
    ids, mask, vis = prompts("two_images", np.random.default_rng(5))
    return inputs(model, ids, mask, **vis)


def _cfg(model):
    return generation_config(model.config, max_new_tokens=N, temperature=1.0, eos_token_ids=())


def _sample(sampler, params, batch, g=2):
    args, kw = batch
    out = sampler(params, *args, jax.random.key(3), num_samples=g, **kw)
    return jax.tree.map(np.asarray, out)


def test_parameters_that_need_nothing_are_used_as_they_are(path):
    model = qwen2_5_vl.load(path)
    graphdef, params = nnx.split(model)
    ready = Sampler(graphdef, _cfg(model)).prepare(params)
    assert isinstance(ready, RolloutParams) and ready.params is params
    assert ready.graphdef == graphdef
    # prepared parameters pass through a sampler of the same layout, not another's
    assert Sampler(graphdef, _cfg(model)).prepare(ready) is ready
    with pytest.raises(ValueError, match="prepared for"):
        Sampler(graphdef, _cfg(model), dtype="bfloat16").prepare(ready)


def test_a_rollout_dtype_samples_what_a_model_built_in_it_samples(path, batch):
    model = qwen2_5_vl.load(path)  # float32 compute and weights
    graphdef, params = nnx.split(model)
    sampler = Sampler(graphdef, _cfg(model), dtype=jnp.bfloat16)
    ready = sampler.prepare(params)
    floats = [x for x in jax.tree.leaves(ready.params) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert floats and all(x.dtype == jnp.bfloat16 for x in floats)
    assert nnx.merge(ready.graphdef, ready.params).dtype == jnp.bfloat16
    got = _sample(sampler, ready, batch)

    ref = qwen2_5_vl.load(path, dtype=jnp.bfloat16, param_dtype=jnp.float32)
    rgraph, rparams = nnx.split(ref)
    want = _sample(Sampler(rgraph, _cfg(ref)), rparams, batch)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.logprobs, want.logprobs)
    np.testing.assert_array_equal(got.vision_mass, want.vision_mass)
    # and it is not float32's: the dtype took effect
    f32 = _sample(Sampler(graphdef, _cfg(model)), params, batch)
    assert np.abs(f32.logprobs - got.logprobs).max() > 1e-4


def test_lora_is_merged_for_sampling(path, batch):
    model = qwen2_5_vl.load(path)
    lora.apply_lora(model, 4, 8.0, 0.0, "q_proj,up_proj", seed=1)
    for m in lora.lora_modules(model):  # B = 0 at init: make the adapters count
        b = m.lora_b[...]
        m.lora_b[...] = 0.05 * jax.random.normal(jax.random.key(b.size), b.shape, b.dtype)
    graphdef, params = nnx.split(model)
    sampler = Sampler(graphdef, _cfg(model))
    ready = sampler.prepare(params)
    merged = nnx.merge(ready.graphdef, ready.params)
    assert not lora.wrapped(merged)
    got = _sample(sampler, ready, batch)

    mgraph, mparams = nnx.split(lora.merge_lora(model))
    want = _sample(Sampler(mgraph, _cfg(model)), mparams, batch)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.logprobs, want.logprobs)

    # the unmerged policy (a sampler whose prepare is bypassed: its own program per call)
    args, kw = batch
    raw = jax.jit(
        lambda p: sample(
            graphdef, p, *args, jax.random.key(3), cfg=_cfg(model), num_samples=2, **kw
        )
    )(params)
    np.testing.assert_array_equal(np.asarray(raw.tokens), got.tokens)
    np.testing.assert_allclose(np.asarray(raw.logprobs), got.logprobs, atol=1e-5)
    assert np.abs(got.logprobs).max() > 0.1  # not a test of zeros


def _sizes(data: int, tensor: int, expert: int = 1) -> dict:
    return {"data": data, "fsdp": 1, "expert": expert, "sequence": 1, "tensor": tensor}


def test_rollout_sizes_and_dtype():
    assert rollout_sizes(8, 2) == _sizes(2, 4)  # a host per group
    assert rollout_sizes(8, 1) == _sizes(1, 8)
    assert rollout_sizes(8, 2, data=-1, tensor=1) == _sizes(8, 1)
    # the cache splits by KV head: a host's devices, as many as divide the KV heads
    assert rollout_sizes(8, 1, kv_heads=2) == _sizes(4, 2)
    assert rollout_sizes(16, 2, kv_heads=4) == _sizes(4, 4)
    assert rollout_sizes(8, 2, kv_heads=4) == _sizes(2, 4)
    with pytest.raises(ValueError, match="does not divide"):
        rollout_sizes(8, 1, tensor=3)
    # with the bytes a decode step reads: a group past the KV heads when the weights outweigh
    # the cache each of its devices then holds whole (per device, w / t + c * t / devices;
    # w / t + c / devices where t divides the KV heads)
    w, c = decode_bytes(TextConfig(), rows=64, length=2048, dtype=jnp.bfloat16)  # 3B sizes
    assert w == 2 * (36 * (2048 * (2048 + 512) + 2048 * 2048 + 3 * 2048 * 11008) + 2048 * 151936)
    assert c == 2 * 2 * 36 * 256 * 64 * 2048
    assert rollout_sizes(16, 4, kv_heads=2, weight_bytes=w, cache_bytes=c)["tensor"] == 4
    assert rollout_sizes(16, 4, kv_heads=2, weight_bytes=w, cache_bytes=64 * c)["tensor"] == 2
    # 16 devices, t = 4: 1.54 + 1.21 GB per device against 3.09 + 0.30 at t = 2; one host of
    # 8: 3.09 + 0.60 at t = 2 against 1.54 + 2.42 at t = 4 and 0.77 + 4.83 at t = 8
    assert rollout_sizes(8, 1, kv_heads=2, weight_bytes=w, cache_bytes=c)["tensor"] == 2
    assert rollout_sizes(8, 1, kv_heads=2, weight_bytes=w, cache_bytes=c / 2)["tensor"] == 4
    # an expert axis: tensor groups within what is left of a host by its expert groups
    assert rollout_sizes(8, 1, kv_heads=4, expert=4) == _sizes(1, 2, expert=4)
    assert rollout_sizes(16, 2, kv_heads=4, expert=2) == _sizes(2, 4, expert=2)
    assert rollout_sizes(8, 1, tensor=1, expert=2) == _sizes(4, 1, expert=2)
    assert rollout_sizes(16, 4, kv_heads=4, expert=16) == _sizes(1, 1, expert=16)  # over hosts
    with pytest.raises(ValueError, match="does not divide"):
        rollout_sizes(8, 1, tensor=4, expert=3)
    # a mixture of experts: every layer's attention, and the router and the experts its rows
    # can reach (min(E, rows x k)) where a layer is sparse (here every second one)
    moe = TextConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=100, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=2,
    )  # fmt: skip
    attention = 64 * (64 + 2 * 32) + 64 * 64
    for rows, reached in ((2, 4), (64, 8)):
        w, c = decode_bytes(moe, rows=rows, length=10, dtype=jnp.float32)
        sparse = 64 * 8 + reached * 3 * 64 * 32
        assert w == 4 * (4 * attention + 2 * sparse + 2 * 3 * 64 * 96 + 64 * 100), rows
        assert c == 4 * 2 * 4 * 32 * rows * 10
    assert rollout_dtype("auto", None, jnp.float32) is None  # this CPU: the model's
    assert rollout_dtype("bfloat16", None, jnp.float32) == "bfloat16"
    assert rollout_dtype("float32", None, jnp.float32) is None
    with pytest.raises(ValueError, match="rollout dtype"):
        rollout_dtype("fp8", None, jnp.float32)
