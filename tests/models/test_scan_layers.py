"""Scanned layers (`scan_layers=True`: stacked params run by a scan) against the unrolled
reference on one tiny checkpoint: logits, attention statistics and gradients (remat inside
the scan), HF save and load, LoRA, the KV-cache paths and the sampler's greedy tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxvrl.models import lora
from jaxvrl.models import qwen2_5_vl as q
from jaxvrl.models.weights import stacked_path
from jaxvrl.sampling import generate
from tests.models import hf_tiny as T
from tests.models.export_check import same_tensors


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("scan_layers")
    # 3 layers; 4 vision blocks with full attention at 1 and 3 (two window/full repeats)
    T.build(path, seed=7, layers=3, v_depth=4, fullatt=(1, 3))
    return path


@pytest.fixture(scope="module")
def models(ckpt):
    scanned, unrolled = q.load(ckpt), q.load(ckpt, scan_layers=False)
    assert scanned.model.layers.mlp.up_proj.kernel.shape[0] == 3
    assert scanned.visual.blocks.attn.qkv.kernel.shape[0] == 4
    return scanned, unrolled


@pytest.fixture(scope="module")
def batch(models):
    """Row 0: an image whose 3x5 merged units do not divide the window; row 1: a video."""
    cfg = models[0].config
    rng = np.random.default_rng(0)
    image, video = [1, 6, 10], [2, 4, 4]
    rows = [T.prompt(rng, images=[image]) + [40, 41], T.prompt(rng, videos=[video]) + [42]]
    ids, mask = T.left_pad(rows)
    pos, _ = q.get_rope_index(ids, mask, cfg, np.array([image]), np.array([video]))
    pools = q.attention_pools(ids, mask, ids.shape[1] - 1, **T.POOL_IDS)
    return dict(
        input_ids=jnp.asarray(ids),
        attention_mask=jnp.asarray(mask),
        position_ids=jnp.asarray(pos),
        images=q.vision_inputs(T.patches(rng, [image]), [image], cfg.vision),
        videos=q.vision_inputs(T.patches(rng, [video]), [video], cfg.vision),
        pools={k: jnp.asarray(v) for k, v in pools.items()},
    )


def _forward(model, b):
    b = dict(b)
    return model.forward(b.pop("input_ids"), b.pop("attention_mask"), b.pop("position_ids"), **b)


def _close(a, b, rtol=2e-6):
    a, b = np.asarray(a), np.asarray(b)
    np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * max(np.abs(b).max(), 1e-6))


def _flat(state) -> dict:
    return {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(state)}


def _as_scanned(unrolled_state, scanned_state) -> dict:
    """Per-layer leaves of an unrolled model's state stacked into the scanned layout."""
    groups: dict = {}
    for path, x in _flat(unrolled_state).items():
        target, i = stacked_path(path)
        groups.setdefault(target, []).append((i, x))
    out = {}
    for path, items in groups.items():
        items.sort(key=lambda t: -1 if t[0] is None else t[0])
        out[path] = items[0][1] if items[0][0] is None else jnp.stack([x for _, x in items])
    assert set(out) == set(_flat(scanned_state))
    return out


@pytest.mark.parametrize("attention", ["xla", "flash"])
def test_logits_and_attention_statistics_equal(models, batch, attention):
    for m in models:
        m.set_attention(attention, block=8)  # flash: windows span and skip several blocks
    try:
        a, b = (_forward(m, batch) for m in models)
    finally:
        for m in models:
            m.set_attention("auto")
    _close(a.logits, b.logits)
    assert a.vision_mass.shape == (3, *batch["input_ids"].shape)
    _close(a.vision_mass, b.vision_mass)
    _close(a.text_mass, b.text_mass)


def test_full_attention_blocks_pad_little(models):
    # the kernel's block for the tower's full-attention blocks: halved from the model's while
    # padding to whole blocks would add more than 1/16 of the patches
    visual = models[0].visual
    block, visual.attention_block = visual.attention_block, 512
    try:
        assert visual.full_block(3136) == 256  # 784 px: 3,328 padded, not 3,584
        assert visual.full_block(3584) == 512 and visual.full_block(3500) == 512
        assert visual.full_block(1100) == 128 and visual.full_block(40) == 128
    finally:
        visual.attention_block = block


@pytest.mark.parametrize("policy", ["full", "dots_saveable"])
def test_gradients_equal_with_remat_inside_the_scan(models, batch, policy):
    w = jax.random.normal(jax.random.key(0), (*batch["input_ids"].shape, 300))

    def grads(model):
        graphdef, params = nnx.split(model, nnx.Param)

        def loss(p):
            return jnp.sum(_forward(nnx.merge(graphdef, p), batch).logits * w)

        return jax.jit(jax.grad(loss))(params)

    scanned, unrolled = models
    scanned.set_remat_policy(policy)
    try:
        g_scan = grads(scanned)
    finally:
        scanned.set_remat_policy("none")
    g_ref = _as_scanned(grads(unrolled), g_scan)
    for path, x in _flat(g_scan).items():
        _close(x, g_ref[path], rtol=1e-5)


def test_hf_save_equal_and_load_round_trip(models, ckpt, tmp_path):
    scanned, unrolled = models
    q.save(scanned, tmp_path / "scanned")
    q.save(unrolled, tmp_path / "unrolled")
    same_tensors(ckpt, tmp_path / "scanned")
    same_tensors(ckpt, tmp_path / "unrolled")
    again = _flat(nnx.state(q.load(tmp_path / "scanned"), nnx.Param))
    for path, x in _flat(nnx.state(scanned, nnx.Param)).items():
        np.testing.assert_array_equal(again[path], x, err_msg=path)


def test_stacked_lora_equals_per_layer_lora(ckpt, batch, tmp_path):
    targets = ("q_proj", "v_proj", "down_proj")
    scanned, unrolled = q.load(ckpt), q.load(ckpt, scan_layers=False)
    assert len(lora.apply_lora(scanned, 4, 8.0, 0.0, targets)) == 3
    assert len(lora.apply_lora(unrolled, 4, 8.0, 0.0, targets)) == 9
    assert lora.lora_param_count(scanned) == lora.lora_param_count(unrolled)
    for i, m in enumerate(lora.lora_modules(unrolled)):  # B != 0: adapters that matter
        m.lora_b[...] = 0.05 * jax.random.normal(jax.random.key(i), m.lora_b.shape)
    graphdef, params = nnx.split(scanned, nnx.Param)
    stacked = _as_scanned(nnx.state(unrolled, nnx.Param), params)
    flat = [(p, v.replace(stacked[".".join(map(str, p))])) for p, v in nnx.to_flat_state(params)]
    scanned = nnx.merge(graphdef, nnx.from_flat_state(flat))
    _close(_forward(scanned, batch).logits, _forward(unrolled, batch).logits)
    q.save(lora.merge_lora(scanned), tmp_path / "scanned")
    q.save(lora.merge_lora(unrolled), tmp_path / "unrolled")
    same_tensors(tmp_path / "scanned", tmp_path / "unrolled")


def test_stacked_and_per_layer_caches_agree(models, batch):
    """Prefill then two decode steps: the scanned model over a stacked cache (the scan) and
    over a per-layer cache (the loop over layer slices), and the unrolled model."""
    cfg = models[0].config.text
    ids, mask, pos = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
    b, p = ids.shape

    def run(model, stacked):
        cache = q.KVCache.init(cfg, b, p + 2, stacked=stacked)
        out = model.forward(
            ids, mask, pos, images=batch["images"], videos=batch["videos"], cache=cache
        )
        hidden = [out.hidden]
        for t in range(2):
            step_pos = jnp.broadcast_to(pos.max() + 1 + t, (3, b, 1))
            out = model.forward(ids[:, -1:], jnp.ones((b, 1), jnp.int32), step_pos, cache=out.cache)
            hidden.append(out.hidden)
        assert out.cache.stacked == stacked
        return hidden

    scanned, unrolled = models
    ref = run(unrolled, False)
    for stacked in (True, False):
        for got, want in zip(run(scanned, stacked), ref):
            _close(got, want)


@pytest.mark.parametrize("stacked", [True, False])
def test_a_prefill_into_an_empty_cache_equals_attending_over_the_cache(models, batch, stacked):
    """A prefill into an empty cache runs as a forward pass and fills the cache after the
    layers (`KVCache.filled`); the same cache marked written takes the cached attention over
    it: the same hidden states, keys, values, key mask and next slot, and the same next
    decode step."""
    scanned = models[0]
    cfg = scanned.config.text
    ids, mask, pos = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
    b, p = ids.shape
    empty = q.KVCache.init(cfg, b, p + 2, stacked=stacked)
    vision = dict(images=batch["images"], videos=batch["videos"])
    filled = scanned.forward(ids, mask, pos, **vision, cache=empty)
    cached = scanned.forward(ids, mask, pos, **vision, cache=empty.replace(empty=False))
    assert not filled.cache.empty and not cached.cache.empty
    valid = np.asarray(mask) > 0
    _close(np.asarray(filled.hidden)[valid], np.asarray(cached.hidden)[valid], rtol=1e-5)
    for a, c in zip(jax.tree.leaves(filled.cache), jax.tree.leaves(cached.cache)):
        _close(a, c, rtol=1e-5)
    step_pos = jnp.broadcast_to(pos.max() + 1, (3, b, 1))
    one = jnp.ones((b, 1), jnp.int32)
    a, c = (scanned.forward(ids[:, -1:], one, step_pos, cache=o.cache) for o in (filled, cached))
    _close(a.logits, c.logits, rtol=1e-5)
    # with pools the prefill keeps each row's last query's masses only ([L, B, 1], the query
    # that predicts the first token): those of a forward pass at its last position
    pools = {"vision": np.random.default_rng(0).random((b, p)) < 0.5, "prompt": valid}
    pools["text"] = valid & ~pools["vision"]
    wider = {k: np.pad(v, ((0, 0), (0, 2))) for k, v in pools.items()}  # the cache's slots
    full = scanned.forward(ids, mask, pos, **vision, pools=pools)
    first = scanned.forward(ids, mask, pos, **vision, cache=empty, pools=wider)
    for name in ("vision_mass", "text_mass"):
        got, want = getattr(first, name), getattr(full, name)
        assert got.shape == (cfg.num_hidden_layers, b, 1), got.shape
        _close(got, np.asarray(want)[:, :, -1:], rtol=1e-5)


def test_sampler_greedy_tokens_equal(models):
    rng = np.random.default_rng(3)
    grid = [1, 4, 6]
    ids, mask = T.left_pad([T.prompt(rng, images=[grid]), T.prompt(rng, images=[grid])[2:]])
    pv = np.concatenate([T.patches(rng, [grid])] * 2)
    kw = dict(
        max_new_tokens=6,
        temperature=0.0,
        eos_token_ids=T.IM_END,
        pixel_values=pv,
        image_grid_thw=np.array([grid, grid]),
    )
    a, b = (generate(m, ids, mask, **kw) for m in models)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    np.testing.assert_allclose(np.asarray(a.logprobs), np.asarray(b.logprobs), atol=1e-5)
