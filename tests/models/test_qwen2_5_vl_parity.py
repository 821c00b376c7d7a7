"""Float32 parity of the Flax Qwen2.5-VL against transformers on tiny random checkpoints, with
the dense ("xla") and the blocked ("flash") attention."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxvrl.models import qwen2_5_vl as q
from tests.models import hf_tiny as T
from tests.models.test_attention import needs_gpu


def hf_logits(hf, ids, mask=None, images=(), videos=(), pv=None, pvv=None, spg=None):
    kw = dict(input_ids=torch.tensor(ids), mm_token_type_ids=torch.tensor(T.token_types(ids)))
    if mask is not None:
        kw["attention_mask"] = torch.tensor(mask)
    if images:
        kw["pixel_values"] = torch.tensor(pv)
        kw["image_grid_thw"] = torch.tensor(np.array(images))
    if videos:
        kw["pixel_values_videos"] = torch.tensor(pvv)
        kw["video_grid_thw"] = torch.tensor(np.array(videos))
        if spg is not None:
            kw["second_per_grid_ts"] = torch.tensor(spg)
    with torch.no_grad():
        return hf(**kw).logits.numpy()


def assert_close(ours, ref, mask=None):
    ours = np.asarray(ours)
    assert ours.shape == ref.shape
    if mask is not None:
        ours, ref = ours[mask.astype(bool)], ref[mask.astype(bool)]
    diff = np.abs(ours - ref).max()
    scale = np.abs(ref).max()
    assert scale > 0.5, f"reference logits too small to be a meaningful check ({scale})"
    assert diff <= 1e-3 * scale, f"max |diff| {diff} > 1e-3 * {scale}"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    hf = T.build(path)
    return hf, q.load(path), path


@pytest.fixture(params=["xla", "flash"])
def tiny_attention(request, tiny):
    """`tiny` with each attention implementation; flash with 8-token blocks, so that rows,
    images and windows span several blocks and the masks skip some."""
    hf, model, path = tiny
    model.set_attention(request.param, block=8)
    yield hf, model, path
    model.set_attention("auto")


def test_text_only(tiny_attention):
    hf, model, _ = tiny_attention
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 290, (2, 11))
    assert_close(model(ids).logits, hf_logits(hf, ids))


def test_one_image_with_window_padding(tiny_attention):
    hf, model, _ = tiny_attention
    rng = np.random.default_rng(1)
    grid = [1, 6, 10]  # 3x5 merged units: neither side divides the 2-unit window
    ids = np.array([T.prompt(rng, images=[grid])])
    pv = T.patches(rng, [grid])
    out = model(ids, pixel_values=pv, image_grid_thw=np.array([grid]))
    assert_close(out.logits, hf_logits(hf, ids, images=[grid], pv=pv))


def test_two_images_of_different_sizes(tiny_attention):
    hf, model, _ = tiny_attention
    rng = np.random.default_rng(2)
    grids = [[1, 4, 8], [1, 10, 6]]
    ids = np.array([T.prompt(rng, images=grids)])
    pv = T.patches(rng, grids)
    out = model(ids, pixel_values=pv, image_grid_thw=np.array(grids))
    assert_close(out.logits, hf_logits(hf, ids, images=grids, pv=pv))


def test_video_with_second_per_grid_ts(tiny_attention):
    hf, model, _ = tiny_attention
    rng = np.random.default_rng(3)
    grids = [[3, 4, 6]]
    spg = [1.7]
    ids = np.array([T.prompt(rng, videos=grids)])
    pvv = T.patches(rng, grids)
    out = model(
        ids, pixel_values_videos=pvv, video_grid_thw=np.array(grids), second_per_grid_ts=spg
    )
    assert_close(out.logits, hf_logits(hf, ids, videos=grids, pvv=pvv, spg=spg))


def test_image_and_video_together(tiny):
    hf, model, _ = tiny
    rng = np.random.default_rng(4)
    images, videos = [[1, 6, 4]], [[2, 4, 4]]
    ids = np.array([T.prompt(rng, images=images, videos=videos)])
    pv, pvv = T.patches(rng, images), T.patches(rng, videos)
    out = model(
        ids,
        pixel_values=pv,
        image_grid_thw=np.array(images),
        pixel_values_videos=pvv,
        video_grid_thw=np.array(videos),
        second_per_grid_ts=[0.5],
    )
    ref = hf_logits(hf, ids, images=images, videos=videos, pv=pv, pvv=pvv, spg=[0.5])
    assert_close(out.logits, ref)


def test_left_padded_batch(tiny_attention):
    hf, model, _ = tiny_attention
    rng = np.random.default_rng(5)
    grids = [[1, 4, 4], [1, 8, 6], [1, 2, 2]]
    rows = [
        T.prompt(rng, images=[grids[0]], text_len=(2, 3)),
        T.prompt(rng, images=grids[1:], text_len=(9, 10)),
        T.prompt(rng, text_len=(4, 5)),
    ]
    ids, mask = T.left_pad(rows)
    pv = T.patches(rng, grids)
    out = model(ids, mask, pixel_values=pv, image_grid_thw=np.array(grids))
    ref = hf_logits(hf, ids, mask, images=grids, pv=pv)
    assert_close(out.logits, ref, mask)
    # Each row alone gives the same logits as inside the padded batch.
    alone = model(np.array([rows[0]]), pixel_values=pv[:16], image_grid_thw=np.array(grids[:1]))
    n = len(rows[0])
    np.testing.assert_allclose(
        np.asarray(out.logits)[0, -n:], np.asarray(alone.logits)[0], atol=2e-5
    )


@pytest.mark.parametrize(
    "kw",
    [
        dict(tie=True),
        dict(heads=4, kv_heads=4, mrope=(4, 2, 2), hidden=64, layers=3),
        dict(
            heads=8,
            kv_heads=2,
            hidden=128,
            mrope=(2, 3, 3),
            v_depth=4,
            fullatt=(0, 3),
            window=112,
            v_heads=4,
            v_hidden=64,
        ),
    ],
    ids=["tied", "mha", "gqa4-window112"],
)
def test_other_configs(tmp_path, kw):
    hf = T.build(tmp_path, seed=7, **kw)
    model = q.load(tmp_path)
    assert model.config.tie_word_embeddings == kw.get("tie", False)
    rng = np.random.default_rng(6)
    grids = [[1, 10, 14], [1, 4, 2]]
    ids, mask = T.left_pad([T.prompt(rng, images=grids), T.prompt(rng, text_len=(8, 9))])
    pv = T.patches(rng, grids)
    out = model(ids, mask, pixel_values=pv, image_grid_thw=np.array(grids))
    assert_close(out.logits, hf_logits(hf, ids, mask, images=grids, pv=pv), mask)


def test_jitted_forward_matches_eager(tiny):
    import jax
    from flax import nnx

    _, model, _ = tiny
    rng = np.random.default_rng(8)
    grids = [[1, 6, 10]]
    ids, mask = T.left_pad([T.prompt(rng, images=grids), T.prompt(rng, text_len=(30, 31))])
    pv = T.patches(rng, grids)
    eager = model(ids, mask, pixel_values=pv, image_grid_thw=np.array(grids))
    pos, _ = q.get_rope_index(ids, mask, model.config, np.array(grids))
    vi = jax.tree.map(jax.numpy.asarray, q.vision_inputs(pv, grids, model.config.vision, 64))

    @nnx.jit
    def fwd(m, ids, mask, pos, vi):
        return m.forward(ids, mask, pos, images=vi).logits

    jitted = fwd(model, ids, mask, pos, vi)  # padded to 64 patches: padding must not leak
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(eager.logits), atol=2e-5)


def test_per_row_vision_layout_matches_packed(tiny):
    """Rows with their own padded patch arrays give the packed batch's logits."""
    _, model, _ = tiny
    rng = np.random.default_rng(9)
    grids = [[[1, 4, 4]], [[1, 2, 6], [1, 4, 2]]]
    rows = [T.prompt(rng, images=g) for g in grids]
    ids, mask = T.left_pad(rows)
    pvs = [T.patches(rng, g) for g in grids]
    packed = model(
        ids, mask, pixel_values=np.concatenate(pvs), image_grid_thw=np.concatenate(grids)
    )
    pos, _ = q.get_rope_index(ids, mask, model.config, np.concatenate(grids))
    per_row = q.stack_vision_inputs(
        [q.vision_inputs(pv, g, model.config.vision, num_patches=32) for pv, g in zip(pvs, grids)]
    )
    import jax

    out = model.forward(ids, mask, pos, images=jax.tree.map(jax.numpy.asarray, per_row))
    m = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(out.logits)[m], np.asarray(packed.logits)[m], atol=2e-5)


@needs_gpu
def test_cudnn_model_on_a_gpu(tiny):
    """The bfloat16 model with cuDNN attention in the text decoder gives the dense attention's
    logits and greedy tokens on a left-padded batch with images (the kernel on a GPU)."""
    _, _, path = tiny
    import jax.numpy as jnp

    rng = np.random.default_rng(10)
    grids = [[1, 6, 10], [1, 4, 4]]
    rows = [T.prompt(rng, images=grids[:1], text_len=(5, 6)), T.prompt(rng, images=grids[1:])]
    ids, mask = T.left_pad(rows)
    pv = T.patches(rng, grids)
    out = {}
    for name in ("xla", "cudnn"):
        model = q.load(path, dtype=jnp.bfloat16, attention=name)
        out[name] = np.float32(
            model(ids, mask, pixel_values=pv, image_grid_thw=np.array(grids)).logits
        )
    m = mask.astype(bool)
    scale = np.abs(out["xla"][m]).max()
    assert np.abs(out["cudnn"][m] - out["xla"][m]).max() <= 3e-2 * scale
    np.testing.assert_array_equal(out["cudnn"][m].argmax(-1), out["xla"][m].argmax(-1))


def test_long_video_positions_at_frame_rates_whose_interval_rounds(tiny):
    """A video's temporal positions, tokens_per_second x second_per_grid_ts x frame group,
    computed in float32 as transformers does with its processor's float32 seconds: at 25 fps
    (2 / 25 s a group) the 25th group's product is 4 in float32 (3.99... in float64)."""
    from jaxvrl import models as M

    hf, model, _ = tiny
    rng = np.random.default_rng(6)
    for fps, groups in ((25.0, 26), (12.5, 51), (29.0, 30), (2.0, 8)):
        grids = [[groups, 2, 2]]
        spg = np.array([2 / fps], np.float32)  # what the processors hand over
        ids = np.array([T.prompt(rng, videos=grids)])
        mask = np.ones_like(ids)
        ours, deltas = M.rope_index(model.config, ids, mask, None, np.array(grids), spg)
        ref, ref_deltas = hf.model.get_rope_index(
            torch.tensor(ids),
            torch.tensor(T.token_types(ids)),
            None,
            torch.tensor(grids),
            torch.tensor(spg),
            torch.tensor(mask),
        )
        np.testing.assert_array_equal(ours, ref.numpy(), err_msg=f"fps {fps}")
        np.testing.assert_array_equal(deltas, ref_deltas.numpy()[:, 0], err_msg=f"fps {fps}")
