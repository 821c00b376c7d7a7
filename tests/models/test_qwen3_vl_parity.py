"""Float32 parity of the Flax Qwen3-VL against transformers on tiny random checkpoints: logits
(text, images, a video, both, a left-padded batch, tied and untied heads), greedy tokens of HF
`generate`, sampled log-probs against a teacher-forced pass, attention statistics against HF
eager attentions, export that transformers loads, and scanned against unrolled layers."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxvrl import models as M
from jaxvrl.models import qwen3_vl as q3
from jaxvrl.models.weights import stacked_path
from jaxvrl.sampling import generate
from tests.models import hf_tiny_qwen3_vl as T
from tests.models.export_check import export_equals_checkpoint
from tests.models.hf_tiny import IM_END, POOL_IDS, left_pad, token_types
from tests.models.test_qwen2_5_vl_parity import assert_close
from tests.models.test_qwen2_5_vl_stats_io import _masses_from_hf


def hf_inputs(ids, mask=None, images=(), videos=(), pv=None, pvv=None):
    kw = dict(input_ids=torch.tensor(ids), mm_token_type_ids=torch.tensor(token_types(ids)))
    if mask is not None:
        kw["attention_mask"] = torch.tensor(mask)
    if len(images):
        kw["pixel_values"] = torch.tensor(pv)
        kw["image_grid_thw"] = torch.tensor(np.array(images))
    if len(videos):
        kw["pixel_values_videos"] = torch.tensor(pvv)
        kw["video_grid_thw"] = torch.tensor(np.array(videos))
    return kw


def hf_logits(hf, *args, **kw):
    with torch.no_grad():
        return hf(**hf_inputs(*args, **kw)).logits.numpy()


@nnx.jit
def _forward(model, ids, mask, pos, images, videos, pools, cache):
    return model.forward(ids, mask, pos, images=images, videos=videos, pools=pools, cache=cache)


def ours(model, ids, mask=None, images=(), videos=(), pv=None, pvv=None, pools=None, cache=None):
    """The model's outputs for HF-style inputs, through one jitted forward pass (a compile per
    shape, cheaper here than the eager call's many small ones)."""
    cfg = model.config
    mask = np.ones_like(ids) if mask is None else mask
    grids = [np.array(g).reshape(-1, 3) if len(g) else None for g in (images, videos)]
    pos, _ = M.rope_index(cfg, ids, mask, *grids)
    vision = [None if g is None else M.vision_inputs(cfg, x, g) for g, x in zip(grids, (pv, pvv))]
    return _forward(model, ids, mask, pos, *vision, pools, cache)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen3_vl")
    hf = T.build(path)
    return hf, M.load(path), path


@pytest.fixture(scope="module")
def mixed():
    """Left-padded rows: two images of different sizes (one with an odd 3 x 5 merged grid);
    a video of 2 frame groups; an image with a video of 3; text only."""
    rng = np.random.default_rng(0)
    per_row = [([[1, 6, 10], [1, 4, 8]], []), ([], [[2, 4, 6]]), ([[1, 6, 4]], [[3, 2, 4]])]
    rows = [T.prompt(rng, images=i, videos=v) for i, v in per_row]
    ids, mask = left_pad([*rows, T.prompt(rng, text_len=(5, 6))])
    images = [g for i, _ in per_row for g in i]
    videos = [g for _, v in per_row for g in v]
    return dict(
        ids=ids,
        mask=mask,
        images=images,
        videos=videos,
        pv=T.patches(rng, images),
        pvv=T.patches(rng, videos),
    )


def test_config_and_rope_index(tiny, mixed):
    hf, model, path = tiny
    cfg = model.config
    assert M.load_config(path) == cfg and isinstance(model, M.Model)
    t, v = cfg.text, cfg.vision
    assert (t.head_dim, t.qk_norm, t.attention_bias, t.mrope_interleaved) == (24, True, False, True)
    assert (v.patch_size, v.num_position_embeddings, v.deepstack_visual_indexes) == (16, 36, (0, 2))
    assert q3.Qwen3VLConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    m = mixed
    ours_pos, deltas = M.rope_index(cfg, m["ids"], m["mask"], m["images"], m["videos"])
    kw = hf_inputs(m["ids"], m["mask"])
    ref, ref_deltas = hf.model.get_rope_index(
        kw["input_ids"],
        kw["mm_token_type_ids"],
        torch.tensor(m["images"]),
        torch.tensor(m["videos"]),
        kw["attention_mask"],
    )
    valid = m["mask"].astype(bool)
    np.testing.assert_array_equal(ours_pos[:, valid], ref.numpy()[:, valid])
    np.testing.assert_array_equal(deltas, ref_deltas.numpy()[:, 0])


def test_text_only(tiny):
    hf, model, _ = tiny
    ids = np.random.default_rng(1).integers(0, 290, (2, 11))
    assert_close(ours(model, ids).logits, hf_logits(hf, ids))


def test_images_and_videos_in_a_left_padded_batch(tiny, mixed):
    hf, model, _ = tiny
    m = dict(mixed)
    ids, mask = m.pop("ids"), m.pop("mask")
    got, ref = ours(model, ids, mask, **m).logits, hf_logits(hf, ids, mask, **m)
    for row in range(len(ids)):  # two images; a video; an image and a video; text
        assert_close(got[row : row + 1], ref[row : row + 1], mask[row : row + 1])


def test_tied_embeddings_and_export(tmp_path, mixed):
    """A tied head: logits, and the export transformers loads back to the same logits. The
    DeepStack blocks listed out of order and one twice (1, 0, 1): transformers takes them in
    block order, once each, through the merger at each block's first place in the list."""
    from transformers import Qwen3VLForConditionalGeneration

    hf = T.build(tmp_path / "tied", seed=5, tie=True, layers=2, deepstack=(1, 0, 1), positions=16)
    model = M.load(tmp_path / "tied")
    assert model.config.tie_word_embeddings and not hasattr(model, "lm_head")
    m = dict(mixed)
    ids, mask = m.pop("ids"), m.pop("mask")
    ref = hf_logits(hf, ids, mask, **m)
    assert_close(ours(model, ids, mask, **m).logits, ref, mask)
    M.save(model, tmp_path / "export")
    back = Qwen3VLForConditionalGeneration.from_pretrained(tmp_path / "export").eval()
    assert (
        back.lm_head.weight.data_ptr() == back.model.language_model.embed_tokens.weight.data_ptr()
    )
    np.testing.assert_array_equal(hf_logits(back, ids, mask, **m), ref)


def test_untied_export_round_trip(tiny, mixed, tmp_path):
    from transformers import Qwen3VLForConditionalGeneration

    hf, model, path = tiny
    export_equals_checkpoint(model, path, tmp_path / "export")
    cfg = json.loads((tmp_path / "export" / "config.json").read_text())
    assert cfg["text_config"]["rope_parameters"]["mrope_interleaved"] is True
    back = Qwen3VLForConditionalGeneration.from_pretrained(tmp_path / "export").eval()
    m = dict(mixed)
    ids, mask = m.pop("ids"), m.pop("mask")
    np.testing.assert_array_equal(hf_logits(back, ids, mask, **m), hf_logits(hf, ids, mask, **m))


@pytest.fixture(scope="module")
def unrolled(tiny):
    return M.load(tiny[2], scan_layers=False)


def test_scanned_and_unrolled_layers_and_a_stacked_cache_agree(tiny, unrolled, mixed):
    """The unrolled model's logits equal the scanned one's, and so do the hidden states of a
    prefill over a stacked cache (the scan, DeepStack's level times 1 or 0 in every layer; the
    sampler's per-layer cache runs the loop, `test_greedy_tokens_match_hf_generate`)."""
    scanned = tiny[1]
    m = dict(mixed)
    ids, mask = m.pop("ids"), m.pop("mask")
    a = ours(scanned, ids, mask, **m)
    b = ours(unrolled, ids, mask, **m)
    scale = np.abs(b.logits).max()
    np.testing.assert_allclose(a.logits, b.logits, rtol=1e-5, atol=1e-5 * scale)
    cache = M.KVCache.init(scanned.config.text, *ids.shape, stacked=True)
    c = ours(scanned, ids, mask, **m, cache=cache)
    assert c.cache.stacked
    valid = mask > 0
    np.testing.assert_allclose(c.hidden[valid], a.hidden[valid], rtol=1e-5, atol=1e-5)


def test_gradients_equal_scanned_and_unrolled_with_remat(tiny, unrolled):
    """Remat inside the scans and DeepStack in the scan: the scanned model's gradients equal
    the unrolled one's, the DeepStack mergers' and the position table's included."""
    scanned = tiny[1]
    cfg = scanned.config
    ids, mask, vision = _generation_batch()
    pos, _ = M.rope_index(cfg, ids, mask, vision["images"], vision["videos"])
    images = M.vision_inputs(cfg, vision["pv"], vision["images"])
    videos = M.vision_inputs(cfg, vision["pvv"], vision["videos"])
    w = jax.random.normal(jax.random.key(0), (*ids.shape, cfg.text.vocab_size))

    def grads(model):
        graphdef, params = nnx.split(model, nnx.Param)

        def loss(p):
            out = nnx.merge(graphdef, p).forward(ids, mask, pos, images=images, videos=videos)
            return jnp.sum(out.logits * w)

        flat = nnx.to_flat_state(jax.jit(jax.grad(loss))(params))
        return {".".join(map(str, k)): np.asarray(v.get_value()) for k, v in flat}

    scanned.set_remat_policy("dots_saveable")
    try:
        got = grads(scanned)
    finally:
        scanned.set_remat_policy("none")
    per_layer: dict = {}
    for path_, g in grads(unrolled).items():
        target, i = stacked_path(path_)
        per_layer.setdefault(target, {})[i] = g
    assert set(per_layer) == set(got)
    for target, by_layer in per_layer.items():
        want = (
            by_layer[None]
            if None in by_layer
            else np.stack([by_layer[i] for i in sorted(by_layer)])
        )
        scale = np.abs(want).max()
        assert scale > 0, target
        np.testing.assert_allclose(got[target], want, atol=1e-5 * scale, err_msg=target)


def _generation_batch():
    """Left-padded prompts: an image and a video of 2 frame groups; a video of 3."""
    rng = np.random.default_rng(9)
    images, videos = [[1, 4, 6]], [[2, 4, 4], [3, 2, 4]]
    rows = [
        T.prompt(rng, images=images, videos=videos[:1]),
        T.prompt(rng, videos=videos[1:], text_len=(7, 8)),
    ]
    ids, mask = left_pad(rows, pad=0)
    return (
        ids,
        mask,
        dict(images=images, videos=videos, pv=T.patches(rng, images), pvv=T.patches(rng, videos)),
    )


def _generate(model, ids, mask, vision, **kw):
    return generate(
        model,
        ids,
        mask,
        pixel_values=vision["pv"],
        image_grid_thw=np.array(vision["images"]),
        pixel_values_videos=vision["pvv"],
        video_grid_thw=np.array(vision["videos"]),
        **kw,
    )


def test_greedy_tokens_match_hf_generate(tiny):
    """The sampler's prefill (per-layer cache: DeepStack in the loop) and decode steps."""
    hf, model, _ = tiny
    ids, mask, vision = _generation_batch()
    n = 6
    out = _generate(model, ids, mask, vision, max_new_tokens=n, temperature=0.0)
    with torch.no_grad():
        ref = hf.generate(
            **hf_inputs(ids, mask, **vision),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    np.testing.assert_array_equal(np.asarray(out.tokens), ref[:, ids.shape[1] :].numpy())


def test_sampled_logprobs_match_teacher_forcing(tiny):
    hf, model, _ = tiny
    ids, mask, vision = _generation_batch()
    rng = jax.random.key(3)
    out = _generate(
        model, ids, mask, vision, max_new_tokens=5, temperature=1.0, eos_token_ids=IM_END, rng=rng
    )
    tokens, keep = np.asarray(out.tokens), np.asarray(out.mask) > 0
    full = np.concatenate([ids, tokens], axis=1)
    full_mask = np.concatenate([mask, keep.astype(mask.dtype)], axis=1)
    hf_full = hf_logits(hf, full, full_mask, **vision)  # the teacher-forced pass
    logp = jax.nn.log_softmax(hf_full[:, ids.shape[1] - 1 : -1], axis=-1)
    want = np.take_along_axis(np.asarray(logp), tokens[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(np.asarray(out.logprobs)[keep], want[keep], atol=2e-4)


def test_attention_statistics_match_hf_eager(tiny):
    from transformers import Qwen3VLForConditionalGeneration

    _, model, path = tiny
    hf = Qwen3VLForConditionalGeneration.from_pretrained(path, attn_implementation="eager")
    rng = np.random.default_rng(4)
    images, videos = [[1, 4, 6]], [[2, 2, 4]]
    rows = [
        T.prompt(rng, images=images) + [40, 41, 42],
        T.prompt(rng, videos=videos) + [43],
    ]
    ids, mask = left_pad(rows)
    prompt_len = ids.shape[1] - 1
    kw = dict(images=images, videos=videos, pv=T.patches(rng, images), pvv=T.patches(rng, videos))
    pools = M.attention_pools(ids, mask, prompt_len, **POOL_IDS)
    out = ours(model, ids, mask, pools=pools, **kw)
    with torch.no_grad():
        ref = hf(**hf_inputs(ids, mask, **kw), output_attentions=True)
    assert len(ref.attentions) == model.config.text.num_hidden_layers
    ref_v, ref_x = _masses_from_hf(ref.attentions, pools)
    valid = mask.astype(bool) & (np.arange(ids.shape[1]) > np.argmax(mask, 1)[:, None])
    for got, want in ((out.vision_mass, ref_v), (out.text_mass, ref_x)):
        np.testing.assert_allclose(np.asarray(got)[:, valid], want[:, valid], atol=1e-5)
    after = np.cumsum(np.isin(ids, [T.IMAGE, T.VIDEO]), axis=1) > 0  # from the first pad on
    assert np.all(np.asarray(out.vision_mass)[:, valid & after] > 0)
