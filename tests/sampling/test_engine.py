"""Slots that refill over a paged cache (`engine.prefill_slots` / `decode_slots`, `SamplingConfig.slots`): the
completions, log-probs and attention masses of the static sampler (every row decoded at once,
one prefill per prompt), for slot counts smaller than the rows and not dividing them, page
sizes that divide neither the prompt nor the completion length, on text, image, two-image and
video prompts, left-padded; a prompt's samples share its prefill (its vision tower runs once).

Rows end at different lengths: every 9th token id ends a row, so lengths spread over the
whole range of max_new_tokens (and some rows are truncated).

Tolerance: the paged cache holds the same keys as the dense one, in another order and with
other (masked) gaps, so softmax sums run in another order: log-probs and masses agree to
1e-5 (observed ~1e-7); the sampled tokens are equal.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from jaxvrl.models import qwen2_5_vl
from jaxvrl.sampling import Sampler
from jaxvrl.sampling.sampler import generation_config
from tests.models import hf_tiny
from tests.sampling.test_prefill import inputs, prompts

N = 10
G = 3
EOS = tuple(range(3, 290, 9))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine_model")
    hf_tiny.build(path, seed=5)
    return qwen2_5_vl.load(path)


def _cfg(model, temperature=1.0, **kw):
    cfg = generation_config(model.config, max_new_tokens=N, temperature=temperature)
    return dataclasses.replace(cfg, **{"eos_token_ids": EOS, "check_every": 4, **kw})


def _run(model, cfg, args, kw, key=7):
    out = Sampler(nnx.graphdef(model), cfg)(
        nnx.state(model), *args, jax.random.key(key), num_samples=G, **kw
    )
    return jax.tree.map(np.asarray, out)


def _same(got, want):
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.mask, want.mask)
    np.testing.assert_array_equal(got.truncated, want.truncated)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)
    m = want.mask[None] > 0  # the static sampler also records masses after a row's end
    for a, b in ((got.vision_mass, want.vision_mass), (got.text_mass, want.text_mass)):
        np.testing.assert_allclose(np.where(m, a, 0), np.where(m, b, 0), atol=1e-5)


# (prompt kind, slots, page size, halvings): 5 and 4 slots do not divide the 6 rows; the page
# sizes divide neither the prompts' lengths nor N (one image: the greedy and limits tests
# below); 5 slots narrow to 2, then 1, 4 slots to 2 once no row waits
CASES = [("text", 1, 3, 0), ("two_images", 5, 7, 2), ("video", 4, 6, 1)]


@pytest.mark.parametrize("kind,slots,page,narrow", CASES)
def test_slots_sample_what_the_static_sampler_samples(model, kind, slots, page, narrow):
    ids, mask, vis = prompts(kind, np.random.default_rng(11))
    args, kw = inputs(model, ids, mask, **vis)
    want = _run(model, _cfg(model), args, kw)
    lengths = want.mask.sum(1)
    assert want.tokens.shape == (2 * G, N) and len(set(lengths.tolist())) > 2, lengths
    # checked at every step: the tail of 10 tokens is short for a narrowed loop to show
    cfg = _cfg(model, slots=slots, page_size=page, narrow=narrow, narrow_to=1,
               check_every=1 if narrow else 4)  # fmt: skip
    got, times = Sampler(nnx.graphdef(model), cfg).timed(
        nnx.state(model), *args, jax.random.key(7), num_samples=G, **kw
    )
    got = jax.tree.map(np.asarray, got)
    _same(got, want)
    # every token took a slot for a step; the longest row took a step per token; with one
    # slot nothing idles: a step per token
    assert got.steps * min(slots, 2 * G) >= lengths.sum() and got.steps >= lengths.max()
    assert slots > 1 or got.steps == lengths.sum()
    if narrow:  # the slots x steps run: fewer than every step at all slots, no fewer than tokens
        assert lengths.sum() <= times["decode_work"] < got.steps * slots, times
    else:
        assert "decode_work" not in times


def test_row_counts_halve_in_whole_row_groups():
    from jaxvrl.sampling.steps import SamplingConfig, widths

    def ladder(rows, groups, narrow, least=1):
        return widths(rows, groups, SamplingConfig(4, narrow=narrow, narrow_to=least))

    assert ladder(256, 2, 3) == [256, 128, 64, 32] == ladder(256, 2, 9, least=32)
    assert ladder(6, 2, 5) == [6, 4, 2]  # 3 rounded up to the 2 groups
    assert ladder(5, 1, 9) == [5, 2, 1] and ladder(8, 8, 2) == [8] and ladder(7, 1, 0) == [7]
    assert ladder(64, 1, 9, least=8) == [64, 32, 16, 8] and ladder(12, 1, 9, least=8) == [12]


@pytest.mark.parametrize("kind", ["video", "two_images"])
def test_the_static_sampler_narrowed_samples_what_it_samples_whole(model, kind):
    """The static sampler's loop halved (6 rows: 3, then 2, then 1 as rows end; checked at
    every step): each row's tokens, log-probs, entropies and masses where they were, fewer
    rows x steps run."""
    ids, mask, vis = prompts(kind, np.random.default_rng(11))
    args, kw = inputs(model, ids, mask, **vis)
    want = _run(model, _cfg(model, check_every=1, entropies=True), args, kw)
    cfg = _cfg(model, narrow=3, narrow_to=1, check_every=1, entropies=True)
    got, times = Sampler(nnx.graphdef(model), cfg).timed(
        nnx.state(model), *args, jax.random.key(7), num_samples=G, **kw
    )
    got = jax.tree.map(np.asarray, got)
    _same(got, want)
    assert got.steps == want.steps
    np.testing.assert_allclose(got.entropies * want.mask, want.entropies * want.mask, atol=1e-5)
    assert want.mask.sum() <= times["decode_work"] < 2 * G * got.steps, times


def _gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


@pytest.mark.parametrize(
    "slots,attention,page",
    [(0, "tpu_interpret", 10), (4, "tpu_interpret", 10), (0, "dense", 10), (4, "dense", 10),
     (4, "gpu_interpret", 8),
     pytest.param(4, "gpu", 8, marks=pytest.mark.skipif(not _gpu(), reason="needs a GPU"))],
)  # fmt: skip
def test_accelerator_decode_forms_sample_what_the_cpu_form_samples(model, slots, attention, page):
    """Decode steps through the Pallas TPU kernels (in Pallas's interpreters: over the
    static sampler's cache, and over the slots engine's pages read where they lie), the GPU
    paged kernel (its interpreter; compiled on a GPU, where "auto" is the dense form, at full
    float32 matmul precision) or the dense form, with the keys positions second-minor (as on
    accelerators): completions, log-probs and masses are those of the CPU form
    (`decode_attention` "auto" on the CPU, keys positions-minor)."""
    from jaxvrl.sampling import steps

    ids, mask, vis = prompts("image", np.random.default_rng(13))
    args, kw = inputs(model, ids, mask, **vis)
    with jax.default_matmul_precision("highest"):
        want = _run(model, _cfg(model, slots=slots, page_size=page), args, kw)
        cfg = _cfg(model, slots=slots, page_size=page, decode_attention=attention)
        assert steps.key_layout(cfg) == "BKSH"
        _same(_run(model, cfg, args, kw), want)


def test_greedy_slots_and_more_slots_than_rows(model):
    ids, mask, vis = prompts("image", np.random.default_rng(12))
    args, kw = inputs(model, ids, mask, **vis)
    want = _run(model, _cfg(model, 0.0), args, kw)
    _same(_run(model, _cfg(model, 0.0, slots=64, page_size=5), args, kw), want)


def test_the_vision_tower_runs_once_per_prompt_with_slots(model, tower_rows):
    rows = tower_rows  # at trace time: rows reaching the tower
    ids, mask, vis = prompts("two_images", np.random.default_rng(6))
    args, kw = inputs(model, ids, mask, **vis)
    out = _run(model, _cfg(model, slots=2, page_size=4), args, kw)
    assert rows == [2] and out.tokens.shape == (2 * G, N)


def test_row_limits_end_rows_truncated_in_both_samplers(model):
    ids, mask, vis = prompts("image", np.random.default_rng(14))
    args, kw = inputs(model, ids, mask, **vis)
    limits = np.array([1, 3, 10, 2, 7, 5], np.int32)
    cfg = _cfg(model)
    want = _run(model, cfg, args, kw)  # without limits
    got = {}
    for slots in (0, 4):
        c = dataclasses.replace(cfg, slots=slots, page_size=4)
        got[slots] = _run(model, c, args, dict(kw, limits=limits))
    _same(got[4], got[0])
    lengths = want.mask.sum(1)
    np.testing.assert_array_equal(got[0].mask.sum(1), np.minimum(lengths, limits))
    cut = lengths > limits  # rows the limits shortened: truncated, their tokens a prefix
    assert cut.any() and got[0].truncated[cut].all()
    for b in range(len(limits)):
        k = int(got[0].mask[b].sum())
        np.testing.assert_array_equal(got[0].tokens[b, :k], want.tokens[b, :k])


@pytest.mark.parametrize(
    "groups,need",
    [((0, 0, 0, 1, 1, 1), 1), ((-1, 1, 0, 1, 0, -1), 1)],  # prompt-major; any rows, any order
)
def test_a_call_stopped_by_its_groups_leaves_the_rest_part_way(model, groups, need):
    ids, mask, vis = prompts("image", np.random.default_rng(15))
    args, kw = inputs(model, ids, mask, **vis)
    cfg = _cfg(model, slots=4, page_size=4)
    want = _run(model, cfg, args, kw)  # every row to its end
    groups = np.asarray(groups, np.int32)
    narrowed = dataclasses.replace(cfg, narrow=1, narrow_to=2)  # 2 slots once no row waits
    got = _run(model, narrowed, args, dict(kw, groups=groups, need=np.int32(need)))
    ended = got.ended
    whole = [gid for gid in set(groups.tolist()) - {-1} if ended[groups == gid].all()]
    assert len(whole) >= need and not ended.all(), (ended, groups)
    # ended rows are the full run's; the others a prefix of it, their log-probs the same
    for b in range(len(groups)):
        k = int(got.mask[b].sum())
        assert (k == want.mask[b].sum()) if ended[b] else (k < want.mask[b].sum())
        np.testing.assert_array_equal(got.tokens[b, :k], want.tokens[b, :k])
        np.testing.assert_allclose(got.logprobs[b, :k], want.logprobs[b, :k], atol=1e-5)
        assert got.truncated[b] == (ended[b] and want.truncated[b])
    assert want.ended.all()


def test_rows_take_slots_in_the_order_given(model):
    """order: the work rows in the order they take slots (a pod's processes' rows in turn).
    With 2 slots and the rows queued last-first, a call stopped at one whole group has
    started rows at the front of that order only; every row's tokens are those its key draws
    (the full run's), wherever it stands in the queue."""
    ids, mask, vis = prompts("image", np.random.default_rng(15))
    args, kw = inputs(model, ids, mask, **vis)
    cfg = _cfg(model, slots=2, page_size=4)
    want = _run(model, cfg, args, kw)
    order = np.array([5, 3, 4, 1, 0, 2], np.int32)
    groups = np.array([0, 0, 0, 1, 1, 1], np.int32)
    got = _run(model, cfg, args, dict(kw, groups=groups, need=np.int32(1), order=order))
    started = got.mask[order].sum(1) > 0  # in queue order
    assert started[:2].all() and not started.all(), started
    assert (np.diff(started.astype(int)) <= 0).all(), started  # a prefix of the queue
    assert got.ended[groups == 1].all()  # the group queued first ended whole
    for b in range(len(order)):
        k = int(got.mask[b].sum())
        np.testing.assert_array_equal(got.tokens[b, :k], want.tokens[b, :k])
        np.testing.assert_allclose(got.logprobs[b, :k], want.logprobs[b, :k], atol=1e-5)


def test_work_rows_may_take_their_prompts_in_any_order_and_number(model):
    """prompt_of: 5 work rows over 2 prompts, unevenly and out of order; greedy, each row is
    its prompt's greedy completion (the static sampler's, one row per prompt)."""
    ids, mask, vis = prompts("image", np.random.default_rng(16))
    args, kw = inputs(model, ids, mask, **vis)
    one = Sampler(nnx.graphdef(model), _cfg(model, 0.0))
    want = jax.tree.map(np.asarray, one(nnx.state(model), *args, jax.random.key(0), **kw))
    prompt_of = np.array([1, 0, 1, 1, 0], np.int32)
    cfg = _cfg(model, 0.0, slots=2, page_size=4)
    got = Sampler(nnx.graphdef(model), cfg)(
        nnx.state(model), *args, jax.random.key(0), prompt_of=prompt_of, **kw
    )
    got = jax.tree.map(np.asarray, got)
    assert got.tokens.shape == (5, N) and (want.tokens[0] != want.tokens[1]).any()
    for w, p in enumerate(prompt_of):
        np.testing.assert_array_equal(got.tokens[w], want.tokens[p])
        np.testing.assert_array_equal(got.mask[w], want.mask[p])
        np.testing.assert_allclose(got.logprobs[w], want.logprobs[p], atol=1e-5)


def test_the_aot_tools_queue_model_counts_the_engines_steps(model):
    """`jaxvrl.aot.iteration.schedule` (which prices rollouts ahead of time) runs the queue
    as the engine does: the same decode steps, tokens per row and ended rows, with and
    without a group stop (rows end by their limits only)."""
    from jaxvrl.aot.iteration import schedule

    ids, mask, vis = prompts("text", np.random.default_rng(17))
    args, kw = inputs(model, ids, mask, **vis)
    cfg = dataclasses.replace(_cfg(model, slots=2, page_size=4), eos_token_ids=())
    limits = np.array([3, 9, 1, 5, 10, 2], np.int32)
    for groups, need in ((None, 0), (np.array([0, 0, 0, 1, 1, 1], np.int32), 1)):
        stop = {} if groups is None else dict(groups=groups, need=np.int32(need))
        out = _run(model, cfg, args, dict(kw, limits=limits, **stop))
        run = schedule(limits, 2, groups=groups, need=need, check_every=cfg.check_every)
        steps, made, ended = run["steps"], run["made"], run["ended"]
        assert int(out.steps) == steps and (groups is None or not ended.all())
        np.testing.assert_array_equal(out.mask.sum(1), made)
        np.testing.assert_array_equal(out.ended, ended)
