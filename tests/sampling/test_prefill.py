"""One prefill per prompt: sampling R prompts G times each (`num_samples=G`) gives the tokens,
log-probs and attention masses of prefilling the R * G repeated rows, with the vision tower
run once per prompt; a row's draws do not depend on the other rows of the call."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxvrl.models import qwen2_5_vl
from jaxvrl.sampling import Sampler
from jaxvrl.sampling.sampler import generation_config, row_vision_inputs
from tests.models import hf_tiny

N = 8
G = 3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("prefill_model")
    hf_tiny.build(path, seed=5)
    return qwen2_5_vl.load(path)


@pytest.fixture(scope="module")
def sampler(model):
    cfg = generation_config(
        model.config, max_new_tokens=N, temperature=1.0, eos_token_ids=hf_tiny.IM_END
    )
    return Sampler(nnx.graphdef(model), cfg)


def prompts(kind: str, rng):
    """(ids, mask, vision kwargs) of two prompts [a, b] of the given kind, both left-padded."""
    images, videos = {"text": ([], []), "image": ([[1, 4, 4]], []), "video": ([], [[2, 4, 4]])}.get(
        kind, ([[1, 4, 4], [1, 2, 2]], [])
    )
    a = hf_tiny.prompt(rng, images=images, videos=videos, text_len=(3, 5))
    b_images = [[1, 4, 6]] if kind == "two_images" else []
    b = hf_tiny.prompt(rng, images=b_images, text_len=(9, 12))
    ids, mask = hf_tiny.left_pad([a, b], length=max(len(a), len(b)) + 2)
    grids = images + b_images
    kw = {}
    if grids:
        kw.update(image_grid_thw=np.array(grids), pixel_values=hf_tiny.patches(rng, grids))
    if videos:
        kw.update(
            video_grid_thw=np.array(videos),
            pixel_values_videos=hf_tiny.patches(rng, videos),
            second_per_grid_ts=np.array([1.0]),
        )
    return ids, mask, kw


def inputs(model, ids, mask, pixel_values=None, image_grid_thw=None, pixel_values_videos=None,
           video_grid_thw=None, second_per_grid_ts=None):  # fmt: skip
    """The sampler's arguments for host prompts (as `generate` lays them out), with pools."""
    cfg = model.config
    pos, deltas = qwen2_5_vl.get_rope_index(
        ids, mask, cfg, image_grid_thw, video_grid_thw, second_per_grid_ts
    )
    images = row_vision_inputs(pixel_values, image_grid_thw, ids, cfg.image_token_id, cfg)
    videos = row_vision_inputs(pixel_values_videos, video_grid_thw, ids, cfg.video_token_id, cfg)
    pools = qwen2_5_vl.attention_pools(ids, mask, ids.shape[1], **hf_tiny.POOL_IDS)
    args = (ids, mask, pos, deltas)
    kw = dict(images=images, videos=videos, pools=pools)
    return jax.tree.map(jnp.asarray, (args, kw))


def repeated(args, kw, g: int):
    """The same inputs with each row repeated g times in a row (the old rollout layout)."""
    ids, mask, pos, deltas = args
    args = (*(jnp.repeat(x, g, axis=0) for x in (ids, mask)), jnp.repeat(pos, g, axis=1))
    kw = jax.tree.map(lambda x: jnp.repeat(x, g, axis=0), kw)
    return (*args, jnp.repeat(deltas, g, axis=0)), kw


def run(sampler, model, args, kw, key, **how):
    out = sampler(nnx.state(model), *args, key, **kw, **how)
    return jax.tree.map(np.asarray, out)


def assert_same(a, b):
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.mask, b.mask)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    np.testing.assert_allclose(a.vision_mass, b.vision_mass, atol=1e-5)
    np.testing.assert_allclose(a.text_mass, b.text_mass, atol=1e-5)


@pytest.mark.parametrize("kind", ["text", "image", "two_images", "video"])
def test_one_prefill_per_prompt_equals_repeated_rows(model, sampler, kind):
    ids, mask, vis = prompts(kind, np.random.default_rng(1))
    args, kw = inputs(model, ids, mask, **vis)
    key = jax.random.key(7)
    once = run(sampler, model, args, kw, key, num_samples=G)
    rows = run(sampler, model, *repeated(args, kw, G), key, num_samples=G, prefill_once=False)
    assert once.tokens.shape == (2 * G, N)
    assert once.vision_mass.shape[1] == 2 * G
    assert_same(once, rows)
    assert once.mask.sum() > 2 * G
    # the G samples of a prompt differ (their own keys), as do the prompts
    assert len({tuple(t) for t in once.tokens}) > G


def test_a_prompts_samples_do_not_depend_on_the_other_prompts(model, sampler):
    rng = np.random.default_rng(2)
    ids, mask, vis = prompts("image", rng)
    key = jax.random.key(3)
    both = run(sampler, model, *inputs(model, ids, mask, **vis), key, num_samples=2)
    # prompt a alone, at the same width (prompt b has no image: every image is a's)
    alone = run(sampler, model, *inputs(model, ids[:1], mask[:1], **vis), key, num_samples=2)
    np.testing.assert_array_equal(both.tokens[:2], alone.tokens)
    np.testing.assert_allclose(both.logprobs[:2], alone.logprobs, atol=1e-5)
    np.testing.assert_allclose(both.vision_mass[:, :2], alone.vision_mass, atol=1e-5)


def test_one_sample_per_row_is_the_row_api(model, sampler):
    """G = 1: B rows in, B rows out; a row's tokens are its own whatever the batch."""
    ids, mask, vis = prompts("text", np.random.default_rng(4))
    key = jax.random.key(5)
    two = run(sampler, model, *inputs(model, ids, mask), key)
    one = run(sampler, model, *inputs(model, ids[:1], mask[:1]), key)
    assert two.tokens.shape == (2, N)
    np.testing.assert_array_equal(two.tokens[:1], one.tokens)
    np.testing.assert_allclose(two.logprobs[:1], one.logprobs, atol=1e-5)


def test_the_vision_tower_runs_once_per_prompt(model, tower_rows):
    rows = tower_rows  # at trace time: rows reaching the tower
    ids, mask, vis = prompts("two_images", np.random.default_rng(6))
    args, kw = inputs(model, ids, mask, **vis)
    cfg = generation_config(model.config, max_new_tokens=2, temperature=1.0)
    sampler = Sampler(nnx.graphdef(model), cfg)  # traced here: `tower_rows` emptied the caches
    key = jax.random.key(0)
    out = run(sampler, model, args, kw, key, num_samples=G)
    assert rows == [2] and out.tokens.shape == (2 * G, 2)
    rows.clear()
    run(sampler, model, *repeated(args, kw, G), key, num_samples=G, prefill_once=False)
    assert rows == [2 * G]
