"""Partial rollouts (`rollout.partial`, jaxvrl/trainer/partial.py): rows carried across steps
keep each token's sampler log-prob, equal to a teacher-forced pass of the policy version
that sampled it; the staleness bound drops whole groups and counts their rows; the ratio's
old log-probs are the sampler's. (A run resumed with rows in flight equals an uninterrupted
one: tests/trainer/test_train.py; two processes carrying their own rows through calls over
both: tests/parallel/test_multihost.py.)

The policy of version v is the tiny model's weights scaled by (1 + 0.1 v), so that tokens
of different versions have clearly different log-probs. Rows end when a token id is a
multiple of 9 (or after N tokens): their lengths spread, so some rows outlive their step.

Tolerance: a carried row's continuation is a prefill of its prompt and tokens so far, the
teacher-forced pass one forward over the whole row: float32 sums in another order, log-probs
agree to 1e-4 (observed ~1e-6).
"""

from __future__ import annotations

import dataclasses
import functools
import types
from unittest import mock

import jax
import numpy as np
import pytest
from flax import nnx

from jaxvrl.data.pipeline import collate
from jaxvrl.models import qwen2_5_vl
from jaxvrl.sampling import Sampler
from jaxvrl.sampling.sampler import generation_config
from jaxvrl.trainer.partial import PartialRollouts
from tests.models import hf_tiny
from tests.trainer.test_train import tiny_config

N = 10
G = 2
EOS = tuple(range(9, 290, 9))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = tmp_path_factory.mktemp("partial_model")
    hf_tiny.build(path, seed=5)
    model = qwen2_5_vl.load(path)
    graphdef, params = nnx.split(model)
    versions = [
        jax.tree.map(lambda x, v=v: x * (1 + 0.1 * v), params) for v in range(6)
    ]  # the policy after each step
    return model, graphdef, versions, phase_of(model, graphdef)


def phase_of(model, graphdef, mesh=None, agree=None):
    """What `PartialRollouts.generate` reads of a RolloutPhase: the collate, a slots sampler
    (2 slots of 4-token pages; rows end at every 9th token id), on `mesh` (None: one
    device); agree: the processes' shape agreement (`runtime.max_across_processes`)."""
    cfg = generation_config(model.config, max_new_tokens=N, temperature=1.0)
    cfg = dataclasses.replace(cfg, eos_token_ids=EOS, check_every=2, slots=2, page_size=4)
    tokenizer = types.SimpleNamespace(pad_token_id=0)
    more = {} if agree is None else {"agree": agree}
    return types.SimpleNamespace(
        collate=functools.partial(
            collate,
            model_config=model.config,
            tokenizer=tokenizer,
            prompt_bucket=8,
            with_pools=False,
            **more,
        ),
        sampler=Sampler(graphdef, cfg, mesh),
        mesh=mesh,
        decode=None,
        make_groups=sampled_groups,
    )


def sampled_groups(params, examples, rows, out, step, att=None):
    """`RolloutPhase.make_groups` as the filters get the groups, without rewards: each
    example's G rows as sampled."""
    return [
        types.SimpleNamespace(example=ex, tokens=out.tokens[i * G : (i + 1) * G],
                              mask=out.mask[i * G : (i + 1) * G],
                              logprobs=out.logprobs[i * G : (i + 1) * G])
        for i, ex in enumerate(examples)
    ]  # fmt: skip


def example_stream(seed: int):
    """An endless stream of one-example lists: text prompts and prompts with an image."""
    rng = np.random.default_rng(seed)
    while True:
        if rng.random() < 0.5:
            grids = np.array([[1, 4, 4]])
            yield [dict(prompt_ids=hf_tiny.prompt(rng, images=grids), image_grid_thw=grids,
                        pixel_values=hf_tiny.patches(rng, grids))]  # fmt: skip
        else:
            yield [dict(prompt_ids=hf_tiny.prompt(rng), image_grid_thw=np.zeros((0, 3), int),
                        pixel_values=np.zeros((0, 1176), np.float32))]  # fmt: skip


def _steps(setup, steps: int, max_staleness: int, seed: int = 0):
    """`steps` rollouts of one group each (2 prompts started per step): per step the groups
    handed to the filters and the step's metrics."""
    _, _, versions, phase = setup
    partial = PartialRollouts(1, G, N, oversample=2.0, max_staleness=max_staleness)
    examples, out = example_stream(seed), []
    for step in range(steps):
        key = jax.random.fold_in(jax.random.key(seed), step)
        groups, _ = partial.generate(phase, versions[step], examples, key, step)
        out.append((groups, partial.take_metrics(groups, step)))
    return out


def teacher_forced(graphdef, params, rows):
    """float32[R, 64]: each row's log-probs of its `tokens` after its example's prompt under
    `params`, at completion positions (rows: [(example, tokens)], one batch, right-padded to
    64 columns; the images packed in row order)."""
    m = nnx.merge(graphdef, params)
    ids, mask = np.zeros((len(rows), 64), np.int64), np.zeros((len(rows), 64), np.int64)
    for r, (ex, toks) in enumerate(rows):
        row = list(ex["prompt_ids"]) + list(toks)
        ids[r, : len(row)], mask[r, : len(row)] = row, 1
    images = [ex for ex, _ in rows if len(ex["image_grid_thw"])]
    vision = {}
    if images:
        vision["pixel_values"] = np.concatenate([ex["pixel_values"] for ex in images])
        vision["image_grid_thw"] = np.concatenate([ex["image_grid_thw"] for ex in images])
    logp = np.asarray(jax.nn.log_softmax(m(ids, mask, **vision).logits.astype("float32"), -1))
    out = np.zeros((len(rows), 64), np.float32)
    for r, (ex, toks) in enumerate(rows):
        p = len(ex["prompt_ids"])
        out[r, : len(toks)] = logp[r, np.arange(p - 1, p - 1 + len(toks)), toks]
    return out


def test_carried_rows_keep_each_tokens_log_prob_under_the_version_that_sampled_it(setup):
    _, graphdef, versions, _ = setup
    runs = _steps(setup, 5, max_staleness=5)
    rows, mixed = [], 0  # (example, tokens, their versions, the sampler's log-probs)
    for step, (groups, m) in enumerate(runs):
        assert len(groups) == 1, step  # one whole group a step
        for x in groups:
            assert m["rollout/staleness_max"] == (step - x.versions[x.versions >= 0].min())
            for j in range(G):
                n = int(x.mask[j].sum())
                v = x.versions[j, :n]
                assert n > 0 and (v >= 0).all() and (x.versions[j, n:] == -1).all()
                assert (np.diff(v) >= 0).all() and v.max() <= step
                mixed += len(set(v.tolist())) > 1
                rows.append((x.example, x.tokens[j, :n], v, x.logprobs[j, :n]))
    assert mixed > 0  # some row spanned two versions
    assert sum(m["rollout/carried_rows"] for _, m in runs) > 0
    # every token under its own version's policy: one teacher-forced batch per version
    for ver in sorted({int(u) for *_, v, _ in rows for u in v}):
        ref = teacher_forced(graphdef, versions[ver], [(ex, t) for ex, t, _, _ in rows])
        for r, (_, toks, v, lp) in enumerate(rows):
            at = v == ver
            np.testing.assert_allclose(lp[at], ref[r, : len(toks)][at], atol=1e-4)


def test_groups_past_the_staleness_bound_are_dropped_whole_and_counted(setup):
    runs = _steps(setup, 5, max_staleness=0)
    dropped = sum(m["rollout/dropped_stale_rows"] for _, m in runs)
    assert dropped > 0 and dropped % G == 0  # whole groups
    for step, (groups, m) in enumerate(runs):
        for x in groups:  # nothing trained spans two versions
            assert (x.versions[x.versions >= 0] == step).all()
        assert m["rollout/staleness_max"] == 0


def test_a_stop_while_the_rewards_run_leaves_the_complete_groups_carried(setup):
    """SIGTERM while a step's groups are scored (make_groups raises RewardsInterrupted): they
    stay in flight, where the checkpoint keeps them, and the next call scores them first
    without sampling again."""
    from jaxvrl.rl.reward_pool import RewardsInterrupted

    _, _, versions, phase = setup

    def stopped(*args, **kwargs):
        raise RewardsInterrupted("stop requested while the rewards ran")

    partial = PartialRollouts(1, G, N, oversample=2.0, max_staleness=5)
    examples = example_stream(1)
    with pytest.raises(RewardsInterrupted):
        partial.generate(types.SimpleNamespace(**dict(vars(phase), make_groups=stopped)),
                         versions[0], examples, jax.random.key(1), 0)  # fmt: skip
    (first, *_) = [f for f in partial.flights if f.complete]
    (group,), info = partial.generate(phase, versions[1], examples, jax.random.key(2), 1)
    assert group.example is first.example and (group.tokens == first.tokens).all()
    assert info["decode_steps"] == 0  # no sampler call


def test_carried_rows_take_the_samplers_log_probs_as_the_ratios_old_ones():
    from jaxvrl.trainer.state import StepConfig

    keys = ["rollout.slots=2", "rollout.partial=true", "actor.global_batch_size=2"]
    partial = StepConfig.of(tiny_config("configs/tprl.py", "/tmp/unused", *keys))
    plain = StepConfig.of(tiny_config("configs/tprl.py", "/tmp/unused", keys[0], keys[2]))
    assert plain.updates == 1 and not plain.sampler_old
    assert partial.sampler_old and not partial.sampler_shaping
    off = StepConfig.of(tiny_config("configs/tprl.py", "/tmp/unused", "rollout.devices=1", keys[2]))
    assert off.sampler_old and not off.sampler_shaping  # one-step-off: one update behind


def test_carried_rows_keep_each_tokens_attention_masses(setup):
    """With attention masses (the MDI reward's, VGR's): a carried row's prefilled tokens so far
    are in no key pool, so each token's masses equal a teacher-forced pass's under the policy
    that sampled it, over the prompt's own pools."""
    from jaxvrl.models import attention_pools

    model, graphdef, versions, phase = setup
    layers = model.config.text.num_hidden_layers

    def collate_with_pools(examples, repeat):
        batch = phase.collate(examples, repeat)
        ids, mask = batch["input_ids"], batch["attention_mask"]
        return dict(batch, pools=attention_pools(ids, mask, ids.shape[1], **hf_tiny.POOL_IDS))

    rows = []

    def make_groups(params, examples, _, out, step, att):
        for i, ex in enumerate(examples):
            for j in range(i * G, (i + 1) * G):
                n = int(out.mask[j].sum())
                rows.append(
                    (ex, out.tokens[j, :n], out.vision_mass[:, j, :n], out.text_mass[:, j, :n])
                )
        return [types.SimpleNamespace() for _ in examples]

    looked = types.SimpleNamespace(**vars(phase))
    looked.collate, looked.make_groups = collate_with_pools, make_groups
    looked.attention_metrics = lambda out, batch: {}
    partial = PartialRollouts(1, G, N, oversample=2.0, max_staleness=5, layers=layers)
    versions_of = []
    examples = example_stream(0)
    for step in range(4):
        key = jax.random.fold_in(jax.random.key(0), step)
        groups, _ = partial.generate(looked, versions[step], examples, key, step)
        versions_of += [
            x.versions[j, : int((x.versions[j] >= 0).sum())] for x in groups for j in range(G)
        ]
    assert any(len(set(v.tolist())) > 1 for v in versions_of)  # some row spanned two versions
    # every row teacher-forced in one batch per version, right-padded to 64 columns, each row
    # with its prompt's pools
    ids, mask = np.zeros((len(rows), 64), np.int64), np.zeros((len(rows), 64), np.int64)
    pools = {k: np.zeros((len(rows), 64), bool) for k in ("vision", "text", "prompt")}
    for r, (ex, toks, _, _) in enumerate(rows):
        row = list(ex["prompt_ids"]) + list(toks)
        ids[r, : len(row)], mask[r, : len(row)] = row, 1
        own = attention_pools(
            ids[r : r + 1], mask[r : r + 1], len(ex["prompt_ids"]), **hf_tiny.POOL_IDS
        )
        for k in pools:
            pools[k][r] = own[k][0]
    images = [ex for ex, *_ in rows if len(ex["image_grid_thw"])]
    vision = dict(
        pixel_values=np.concatenate([ex["pixel_values"] for ex in images]),
        image_grid_thw=np.concatenate([ex["image_grid_thw"] for ex in images]),
    )
    for ver in sorted({int(u) for v in versions_of for u in v}):
        out = nnx.merge(graphdef, versions[ver])(ids, mask, **vision, pools=pools)
        vm, tm = np.asarray(out.vision_mass), np.asarray(out.text_mass)
        for r, ((ex, toks, vmass, tmass), v) in enumerate(zip(rows, versions_of)):
            at = v == ver
            # token i's masses: its predictor's query, p - 1 + i
            q = len(ex["prompt_ids"]) - 1 + np.arange(len(toks))[at]
            np.testing.assert_allclose(vmass[:, at], vm[:, r, q], atol=1e-5)
            np.testing.assert_allclose(tmass[:, at], tm[:, r, q], atol=1e-5)


def test_the_staleness_metrics_are_the_trained_rows():
    """A group handed to the filters and dropped there (or a carried one still in flight)
    does not count: the staleness is over the rows of the groups the step trains."""
    import types

    partial = PartialRollouts(1, G, N, oversample=2.0, max_staleness=5)
    versions = np.full((G, N), -1, np.int32)
    old, fresh = versions.copy(), versions.copy()
    old[:, :3], fresh[:, :2] = 6, 10  # first tokens sampled at versions 6 and 10
    m = partial.take_metrics([types.SimpleNamespace(versions=fresh)], 10)
    assert m["rollout/staleness_mean"] == m["rollout/staleness_max"] == 0
    both = [types.SimpleNamespace(versions=v) for v in (old, fresh, None)]
    m = partial.take_metrics(both, 10)
    assert m["rollout/staleness_max"] == 4 and m["rollout/staleness_mean"] == pytest.approx(4 / 3)


def test_a_calls_groups_split_over_the_rollout_meshs_row_groups():
    """A call's groups (oversample x P) are rounded up to a multiple of the rollout mesh's
    row groups on each process, so that its prompts and rows split over them: 8 prompts x
    1.5 on 8 data groups start 16 (12 ended the run at its first step with a traceback), on 4
    row groups per process of 2 processes 12."""
    from jaxvrl.trainer.setup import partial_rollouts

    keys = (
        "rollout.partial=true",
        "rollout.slots=2",
        "prompts_per_step=8",
        "rollout.oversample=1.5",
    )
    c = tiny_config("configs/base.py", "/tmp/unused", *keys)
    assert partial_rollouts(c, 0, False).width == 12
    mesh = types.SimpleNamespace(shape={"data": 8, "fsdp": 1, "expert": 1})
    assert partial_rollouts(c, 0, False, mesh).width == 16
    with mock.patch.object(jax, "process_count", return_value=2):
        assert partial_rollouts(c, 0, False, mesh).width == 12
