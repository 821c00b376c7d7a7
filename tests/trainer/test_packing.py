"""Padding-free passes: the packed step equals the padded one.

A batch mixing a text-only prompt, one image, two images and a video, left-padded prompts and
completions from 1 token to max_new_tokens: the forward's hidden states and attention masses
per completion token, then a whole TPRL + VGR step (perturbed-image pass paired with the
old-policy pass, 2 micro-batches, 2 mini-batches x 2 epochs) give the padded step's updated
parameters, metrics and token weights. The completion axis is cut to the batch's bucket
(Dr.GRPO still divides by max_new_tokens). The plans of 50 steps of random lengths stay within
a handful of shapes, and a step compiles once per shape.

Tolerance: float32; packing changes the shapes of the matmuls and the attention's blocks, so
sums round differently (observed ~1e-7 on parameters after 4 SGD updates).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxvrl import models
from jaxvrl.models import attention_pools
from jaxvrl.parallel import runtime
from jaxvrl.sampling.sampler import row_vision_inputs
from jaxvrl.trainer import packing
from jaxvrl.trainer.passes import completion_hidden, micro_split
from jaxvrl.trainer.rollout import assemble
from jaxvrl.trainer.step import make_train_step
from tests.helpers import G, init_state, step_config
from tests.models import hf_tiny as T

MAX_NEW = 8
# each prompt's vision, G rows each: text only, one image, two images, a video
PROMPTS = (
    {},
    {"images": [[1, 4, 4]]},
    {"images": [[1, 2, 4], [1, 4, 2]]},
    {"videos": [[2, 4, 4]]},
)


def mixed_batch(model, seed: int = 0, lengths=None):
    """8 rows (4 prompts x G) of PROMPTS, completions of `lengths` tokens (default: random
    from 1 to MAX_NEW, one row at MAX_NEW), sampler log-probs and the attention pools; host
    arrays."""
    cfg = model.config
    rng = np.random.default_rng(seed)
    rows, image_grids, video_grids = [], [], []
    for spec in PROMPTS:
        p = T.prompt(rng, spec.get("images", ()), spec.get("videos", ()), text_len=(2, 7))
        for _ in range(G):
            rows.append(p)
            image_grids += spec.get("images", [])
            video_grids += spec.get("videos", [])
    ids, mask = T.left_pad(rows, length=max(len(r) for r in rows) + 16)  # a prompt bucket
    image_grids, video_grids = np.array(image_grids), np.array(video_grids)
    pos, deltas = models.rope_index(cfg, ids, mask, image_grids, video_grids)
    dim = models.processor(cfg).patch_dim
    pv = lambda grids: rng.normal(size=(int(np.prod(grids, -1).sum()), dim)).astype(np.float32)  # noqa: E731
    images = row_vision_inputs(pv(image_grids), image_grids, ids, T.IMAGE, cfg)
    videos = row_vision_inputs(pv(video_grids), video_grids, ids, T.VIDEO, cfg)
    b = len(rows)
    if lengths is None:
        lengths = rng.integers(1, MAX_NEW + 1, b)
        lengths[rng.integers(b)] = MAX_NEW
    comp = (np.arange(MAX_NEW)[None] < np.asarray(lengths)[:, None]).astype(np.float32)
    tokens = rng.integers(20, 280, (b, MAX_NEW))
    has_image = np.array([bool(s) for s in PROMPTS for _ in range(G)])
    batch = assemble(
        ids, mask, pos, deltas, tokens, comp, rng.normal(size=b), has_image,
        images=images,
        pools=attention_pools(ids, mask, ids.shape[1], **T.POOL_IDS),
        old_logprobs=(rng.normal(size=(b, MAX_NEW)) * 0.3 - 2.0) * comp,
    )  # fmt: skip
    return batch.replace(videos=videos)


TPRL = {
    "prompts_per_step": 4,
    "rollout.max_new_tokens": MAX_NEW,
    "tprl.enable_perception_filtering": True,
    "tprl.enable_entropy_filtering": True,
    "tprl.enable_trajectory_reweighting": True,
    "vgr.enable_token_weights": True,
    "optim.micro_batches": 2,
    "actor.global_batch_size": 2,
    "actor.ppo_epochs": 2,
}


def on_device(batch):
    return jax.tree.map(jnp.asarray, batch)


def test_forward_outputs_per_completion_token_equal_padded(model):
    """completion_hidden on packed rows: the log-probs and entropies of every real completion
    token (the head reads only those, per device group) and both attention masses equal the
    padded forward's (2 groups of 2 buffers)."""
    batch = mixed_batch(model, seed=1)
    cfg = step_config(dict(TPRL, **{"optim.micro_batches": 1, "actor.global_batch_size": None}))
    fitted = packing.fit_batch(batch, jax.random.key(0), cfg)
    n = fitted.completion_length
    padded = on_device(batch)
    want_h, want = completion_hidden(model, padded, pools=True)
    length = int(batch.input_ids.shape[1]) + 16  # buffers longer than a row: any length holds
    lengths = batch.attention_mask.sum(1)
    placed = [packing.first_fit(x, length) for x in np.split(lengths, 2)]  # 2 device groups
    start, buffers = np.concatenate([p[0] for p in placed]), max(p[1] for p in placed)
    packed = on_device(fitted).replace(pack_start=jnp.asarray(start), pack_groups=2,
                                       pack_buffers=buffers, pack_length=length)  # fmt: skip
    assert np.any(start % length)  # some rows share a buffer
    got_h, got = completion_hidden(model, packed, pools=True)
    m = batch.completion_mask[:, :n] > 0
    assert not batch.completion_mask[:, n:].any()
    assert got_h.hidden.shape[:2] == (2, fitted.pack_completions)  # real tokens, per group
    for a, b in zip(got_h.logprobs(model, 0.7, entropy="value"),
                    want_h.logprobs(model, 0.7, entropy="value")):  # fmt: skip
        np.testing.assert_allclose(np.asarray(a)[m], np.asarray(b)[:, :n][m], atol=2e-5)
        assert np.all(np.asarray(a)[~m] == 0)
    for name in ("vision_mass", "text_mass"):
        a, b = np.asarray(getattr(got, name)), np.asarray(getattr(want, name))[:, :, :n]
        np.testing.assert_allclose(a[:, m], b[:, m], atol=1e-6)
    assert np.asarray(want.vision_mass)[:, m].max() > 0.05  # the masses are not all zero


def _step(model, cfg, batch, key):
    graphdef, _ = nnx.split(model, nnx.Param)
    tx = optax.sgd(0.3)
    state, metrics, extras = make_train_step(graphdef, tx, cfg)(
        init_state(model, tx), None, on_device(batch), key
    )
    params = {str(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state.params)}
    return params, jax.device_get(metrics), jax.device_get(extras)


@pytest.mark.parametrize("values", [{}, {"actor.loss_agg_mode": "seq-mean-token-sum-norm"}])
def test_packed_step_equals_padded_step(model, values):
    cfg = step_config(dict(TPRL, **values))
    assert cfg.old_pass and cfg.updates == 4  # the paired clean + perturbed pass runs
    batch = mixed_batch(model, seed=2)
    key = jax.random.key(4)
    fitted = packing.fit_batch(batch, key, cfg)
    assert fitted.completion_length < MAX_NEW or batch.completion_mask.all(1).any()
    assert fitted.pack_start is not None and fitted.update_starts.shape == (4, 4)
    want_p, want_m, want_x = _step(model, cfg, batch, key)
    got_p, got_m, got_x = _step(model, cfg, fitted, key)
    moved = max(float(np.abs(want_p[k] - p0).max()) for k, p0 in _initial(model).items())
    assert moved > 1e-3
    for k, v in want_p.items():
        np.testing.assert_allclose(got_p[k], v, atol=2e-6, err_msg=k)
    # the loss, and with token-mean every metric, does not depend on which rows share a
    # micro-batch; the other modes' metrics (per-micro-batch token means weighted by rows)
    # do: compare those with padded rows in the plan's micro-batches
    np.testing.assert_allclose(got_m["loss"], want_m["loss"], rtol=2e-5, atol=2e-6)
    assert set(got_m) == set(want_m)
    if values:  # the padded step over the plan's micro-batches
        same = fitted.replace(pack_start=None, update_starts=None, pack_order=None)
        _, want_m, _ = _step(model, cfg, same, key)
    for k, v in want_m.items():
        np.testing.assert_allclose(got_m[k], v, rtol=2e-5, atol=2e-6, err_msg=k)
    n = fitted.completion_length
    m = batch.completion_mask[:, :n] > 0
    np.testing.assert_allclose(got_x.token_weights[m], want_x.token_weights[:, :n][m], rtol=2e-5)
    np.testing.assert_allclose(got_x.advantages, want_x.advantages, rtol=2e-5, atol=1e-6)


def _initial(model):
    _, params = nnx.split(model, nnx.Param)
    return {str(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(params)}


def _key(fitted) -> tuple:
    exp = (fitted.pack_buffers, fitted.pack_length, fitted.pack_completions)
    return fitted.completion_length, exp, tuple(fitted.update_pack)


def test_plans_of_random_lengths_stay_in_a_few_shapes(model):
    """50 steps of log-normal completion lengths (median a quarter of max_new_tokens): every
    plan places each micro-batch's rows inside its buffers without overlap, with fewer slots
    than the padded rows; a run's `StepShapes` keeps them to a handful of shapes (programs),
    each step's at most `slack` times the slots of its own best plan."""
    cfg = step_config(TPRL)
    batch = mixed_batch(model)
    b = batch.input_ids.shape[0]
    rng = np.random.default_rng(0)
    run, alone = packing.StepShapes(), set()
    for s in range(50):
        one = _random_lengths(batch, rng)
        lengths, p = one.completion_mask.sum(1).astype(int), batch.input_ids.shape[1] - MAX_NEW
        best = packing.fit_batch(one, jax.random.key(s), cfg)
        fitted = packing.fit_batch(one, jax.random.key(s), cfg, shapes=run)
        alone.add(_key(best))
        m = cfg.micro_batches
        own, took = (packing.shape_cost((p, k[0], m, *k[1:]), cfg) for k in map(_key, (best, fitted)))
        assert took <= run.slack * own and fitted.completion_length >= best.completion_length
        upd_buffers, upd_length, _ = fitted.update_pack
        real = fitted.attention_mask.sum(1)
        unit = -(-fitted.input_ids.shape[1] // packing.SPANS)  # a quarter of a padded row
        exp_shape = (fitted.pack_buffers, fitted.pack_length)
        for (k, t), rows in ((exp_shape, 4), ((upd_buffers, upd_length), 2)):
            assert t % unit == 0 and t <= 4 * packing.SPANS * unit
            # fewer slots than the padded rows of a micro-batch (4 in the experience's, 2 in
            # an update's)
            assert k * t < rows * fitted.input_ids.shape[1]
        starts = [fitted.pack_start] + list(fitted.update_starts)
        orders = [fitted.pack_order] + list(fitted.update_rows)
        # each pass reads a permutation of its rows: the experience all of them, each
        # update those of `update_order`
        assert sorted(fitted.pack_order) == list(range(b))
        for mine, want in zip(fitted.update_rows, np.asarray(_order(s, b, cfg))):
            assert sorted(mine) == sorted(want)
        for i, (start, order) in enumerate(zip(starts, orders)):
            k, t = exp_shape if i == 0 else (upd_buffers, upd_length)
            for rows, st in zip(np.split(order, cfg.micro_batches), np.split(start, 2)):
                used = np.zeros(k * t, int)
                for r, a in zip(rows, st):
                    assert a // t == (a + real[r] - 1) // t
                    used[a : a + real[r]] += 1
                assert used.max() == 1
            # the head's slots hold each device group's completion tokens
            assert max(int(lengths[rows].sum()) for rows in np.split(order, 2)) <= (
                fitted.pack_completions if i == 0 else fitted.update_pack[2]
            )
    # completion buckets x buffer counts 1, 2, 4 (rows of an experience micro-batch) x
    # buffer lengths: alone, the plans meet many of them; the run compiles a handful
    assert {k[1][0] for k in alone} <= {1, 2, 4} and {k[2][0] for k in alone} <= {1, 2}, alone
    assert len(run.seen) <= 4 < len(alone), (run.seen, alone)
    # a checkpoint keeps them (JSON), so a resumed run takes the shapes this run would
    back = packing.StepShapes.from_json(json.loads(json.dumps(run.to_json())))
    assert back.seen == run.seen


def _random_lengths(batch, rng):
    """The batch with log-normal completion lengths (median a quarter of MAX_NEW)."""
    b = batch.input_ids.shape[0]
    lengths = np.clip(np.round(rng.lognormal(np.log(MAX_NEW / 4), 0.8, b)), 1, MAX_NEW)
    comp = (np.arange(MAX_NEW)[None] < lengths[:, None]).astype(np.float32)
    mask = batch.attention_mask.copy()
    mask[:, batch.input_ids.shape[1] - MAX_NEW :] = comp
    return batch.replace(completion_mask=comp, attention_mask=mask)


@pytest.mark.parametrize("mode", ["padded", "dynamic"])
def test_a_run_reuses_its_shapes_without_packing_or_with_dynamic_batching(model, mode):
    """Padded rows: a batch takes a compiled completion-column count at least its own
    bucket, within `slack` of its own columns' cost; dynamic batching: a reused shape keeps
    the batch's own micro-batch count (its token budget)."""
    over = {"actor.padding_free": False} if mode == "padded" else {
        "actor.dynamic_batching": True, "actor.max_token_len_per_device": 60,
        "actor.global_batch_size": None}  # fmt: skip
    cfg = step_config(dict(TPRL, **over))
    batch, rng = mixed_batch(model), np.random.default_rng(1)
    prompt = batch.input_ids.shape[1] - MAX_NEW
    run, alone = packing.StepShapes(), set()
    for s in range(30):
        one = _random_lengths(batch, rng)
        best = packing.fit_batch(one, jax.random.key(s), cfg)
        fitted = packing.fit_batch(one, jax.random.key(s), cfg, shapes=run)
        alone.add(runtime.shape_key(best))
        n, own = fitted.completion_length, best.completion_length
        assert own <= n <= MAX_NEW and fitted.micro_batches == best.micro_batches
        if mode == "padded":
            assert prompt + n <= run.slack * (prompt + own)
    assert len(run.seen) < len(alone), (run.seen, alone)


def _order(seed, b, cfg):
    from jaxvrl.trainer.update import update_order

    return update_order(jax.random.key(seed), b, cfg.epochs, cfg.mini_batches)


def test_a_step_compiles_once_per_shape(model):
    graphdef, _ = nnx.split(model, nnx.Param)
    tx = optax.sgd(0.1)
    cfg = step_config({"prompts_per_step": 4, "rollout.max_new_tokens": MAX_NEW})
    step = make_train_step(graphdef, tx, cfg)
    state = init_state(model, tx)
    shapes = set()
    for s, longest in enumerate([8, 3, 8, 3, 2]):
        lengths = np.minimum(np.arange(8) % longest + 1, longest)
        fitted = packing.fit_batch(mixed_batch(model, 0, lengths), jax.random.key(s), cfg)
        shapes.add(runtime.shape_key(fitted))
        state, _, _ = step(state, None, on_device(fitted), jax.random.key(s))
    assert step._cache_size() == len(shapes) < 5


def test_micro_batches_split_the_plan_with_the_rows(model):
    cfg = step_config(TPRL)
    fitted = packing.fit_batch(mixed_batch(model), jax.random.key(0), cfg)
    split = micro_split(on_device(fitted).replace(update_starts=None, update_rows=None), 2)
    assert split.pack_start.shape == (2, 4) and split.pack_buffers == fitted.pack_buffers


def _gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


@pytest.mark.skipif(not _gpu(), reason="cuDNN attention needs a GPU")
@pytest.mark.parametrize("attention", ["cudnn", "flash"])
def test_packed_forward_on_a_gpu(ckpt, attention):
    """bfloat16 on a GPU: packed rows through cuDNN's (segment ids as its mask) or the flash
    attention give the padded dense forward's completion log-probs."""
    from jaxvrl.models import qwen2_5_vl as q

    batch = mixed_batch(q.load(ckpt), seed=3)
    cfg = step_config(dict(TPRL, **{"optim.micro_batches": 1, "actor.global_batch_size": None}))
    fitted = packing.fit_batch(batch, jax.random.key(0), cfg)
    n = fitted.completion_length
    m = batch.completion_mask[:, :n] > 0
    dense = q.load(ckpt, dtype=jnp.bfloat16, attention="xla")
    model = q.load(ckpt, dtype=jnp.bfloat16, attention=attention)
    want = completion_hidden(dense, on_device(batch))[0].logprobs(dense, 1.0)[0]
    got = completion_hidden(model, on_device(fitted))[0].logprobs(model, 1.0)[0]
    want, got = np.asarray(want)[:, :n][m], np.asarray(got)[m]
    assert np.abs(got - want).max() <= 3e-2 * np.abs(want).max()


def test_dynamic_batching_takes_the_fewest_micro_batches_within_the_budget(model):
    """actor.dynamic_batching: the micro-batch count is the fewest whose packed slots per
    device fit actor.max_token_len_per_device (smaller budgets, more micro-batches; one row
    per micro-batch at the least), and the step with the batch's count equals the step
    configured with that count."""
    batch = mixed_batch(model, seed=4)
    base = dict(TPRL, **{"actor.global_batch_size": None, "actor.ppo_epochs": 1})
    counts, middle = [], None
    for budget in (10_000, 240, 120, 60, 1):
        cfg = step_config(dict(base, **{"actor.dynamic_batching": True,
                                        "actor.max_token_len_per_device": budget}))  # fmt: skip
        fitted = packing.fit_batch(batch, jax.random.key(0), cfg)
        slots = fitted.pack_buffers * fitted.pack_length
        assert slots <= budget or fitted.micro_batches == 8
        if fitted.micro_batches > 1:  # one micro-batch fewer would not fit
            fewer = packing.plan_packing(
                batch.attention_mask.sum(1), fitted.input_ids.shape[1], jax.random.key(0), cfg,
                micro_batches=fitted.micro_batches // 2,
            )  # fmt: skip
            assert fewer["pack_buffers"] * fewer["pack_length"] > budget
        counts.append(fitted.micro_batches)
        middle = budget if middle is None and 1 < fitted.micro_batches < 8 else middle
    assert counts[0] == 1 and counts[-1] == 8 and counts == sorted(counts), counts
    assert middle is not None, counts
    cfg = step_config(dict(base, **{"actor.dynamic_batching": True,
                                    "actor.max_token_len_per_device": middle}))  # fmt: skip
    dynamic = packing.fit_batch(batch, jax.random.key(0), cfg)
    m = dynamic.micro_batches
    fixed_cfg = step_config(dict(base, **{"optim.micro_batches": m}))
    fixed = packing.fit_batch(batch, jax.random.key(0), fixed_cfg)
    assert 1 < m < 8 and fixed.micro_batches == 0
    got_p, got_m, _ = _step(model, cfg, dynamic, jax.random.key(1))
    want_p, want_m, _ = _step(model, fixed_cfg, fixed, jax.random.key(1))
    for k, v in want_p.items():
        np.testing.assert_array_equal(got_p[k], v, err_msg=k)
    assert float(got_m["loss"]) == float(want_m["loss"])
