"""Rollout Routing Replay (actor.routing_replay) on a tiny Qwen3-MoE (2 sparse layers of 8
experts, top 2). The sampler records every token's routes; here its routers pick the experts
ranked 2..k+1 (a stand-in for a sampler whose numerics route otherwise), so a training pass
that routes afresh disagrees with it. Replaying the recorded routes gives the sampler's
log-probs in the old-policy pass (padded and packed) and in the loss pass (a ratio of 1),
and train/router_mismatch counts the routes the routers would choose otherwise; with the
sampler's own routing it is 0. The slots engine records the static sampler's routes."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import base
from jaxvrl import models as M
from jaxvrl.config import ConfigError, set_values
from jaxvrl.models import moe
from jaxvrl.sampling import Sampler, generate
from jaxvrl.sampling.sampler import generation_config
from jaxvrl.trainer import packing, update
from jaxvrl.trainer.experience import Rows, no_grad_passes
from jaxvrl.trainer.passes import router_mismatch
from jaxvrl.trainer.rollout import assemble
from jaxvrl.trainer.setup import check_model_settings
from tests.helpers import step_config
from tests.models import hf_tiny_text as T
from tests.models.test_qwen3_moe import build, routed_otherwise

G = 2


# the sampling of both batches; "own" rows end at EOS (any of 20 ids) within N_OWN tokens
OWN = dict(max_new_tokens=8, temperature=1.0, eos_token_ids=tuple(range(4, 24)), routes=True)
N_OTHER = 5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model, prompts (ids, mask), {routing: rollout batch}, the "own" SampleOutput): G
    samples of 3 left-padded prompts, drawn with the routers' own choice ("own") and with the
    experts ranked 2..k+1 ("other"); each batch carries the sampler's log-probs and routes."""
    path = tmp_path_factory.mktemp("qwen3_moe_replay")
    build(path)
    model = M.load(path)
    ids, mask = T.prompts(seed=2, lengths=(6, 9, 3))
    batches, outs = {}, {}
    with pytest.MonkeyPatch.context() as mp:
        for name in ("own", "other"):
            kw = OWN
            if name == "other":  # traced anew: max_new_tokens is this call's own
                mp.setattr(moe, "route", routed_otherwise(moe.route))
                kw = dict(max_new_tokens=N_OTHER, temperature=1.0, routes=True)
            out = outs[name] = generate(
                model, ids, mask, rng=jax.random.key(4), num_samples=G, **kw
            )
            rows = np.repeat(mask, G, axis=0)
            positions = np.maximum(np.cumsum(rows, axis=1) - 1, 0).astype(np.int32)
            batches[name] = assemble(
                np.repeat(ids, G, axis=0), rows, positions, np.zeros(len(rows), np.int32),
                np.asarray(out.tokens), np.asarray(out.mask), np.zeros(len(rows), np.float32),
                np.zeros(len(rows), bool), old_logprobs=np.asarray(out.logprobs),
                routes=np.asarray(out.routes),
            )  # fmt: skip
            n = kw["max_new_tokens"]
            assert out.routes.shape == (len(rows), ids.shape[1] + n, 2, 2)
    return model, (ids, mask), batches, outs["own"]


def _cfg(replay: bool, padding_free: bool, n: int):
    return step_config({
        "actor.routing_replay": replay, "actor.padding_free": padding_free,
        "actor.old_logprobs": "recompute", "rollout.max_new_tokens": n,
        "rollout.num_generations": G,
    })  # fmt: skip


def _old_pass(model, batch, replay: bool, padding_free: bool):
    """(old-policy log-probs [B, N], train/router_mismatch) of the no-grad passes."""
    cfg = _cfg(replay, padding_free, batch.completion_length)
    fitted = jax.tree.map(jnp.asarray, packing.fit_batch(batch, jax.random.key(0), cfg))
    graphdef, params = nnx.split(model)
    passes = jax.jit(lambda p, b: no_grad_passes(graphdef, p, None, b, jax.random.key(1), cfg))(
        params, fitted
    )
    n = fitted.completion_length
    logp = np.zeros(batch.completion_mask.shape, np.float32)
    logp[:, :n] = passes.old_logp
    return logp, float(router_mismatch(passes.route_mismatch, fitted))


def _gap(batch, logp) -> float:
    """The largest |pass - sampler| log-prob over the completion tokens."""
    real = np.asarray(batch.completion_mask) > 0
    return float(np.abs(np.where(real, logp - np.asarray(batch.old_logprobs), 0.0)).max())


# float32 log-probs of a 128-token vocabulary: log-sum-exps of ~5
TOL = 5e-6 * 5


@pytest.mark.parametrize("padding_free", [False, True])
def test_replay_gives_the_samplers_logprobs_where_the_routers_would_choose_otherwise(
    tiny, padding_free
):
    model, _, batches, _ = tiny
    batch = batches["other"]
    logp, mismatch = _old_pass(model, batch, True, padding_free)
    assert _gap(batch, logp) <= TOL
    assert mismatch > 0.5  # the routers' own top 2 is rarely the sampler's ranks 2..3
    if padding_free:
        return
    fresh, fresh_mismatch = _old_pass(model, batch, False, padding_free)
    assert _gap(batch, fresh) > 0.05 and fresh_mismatch > 0.5


def test_with_the_samplers_own_routing_nothing_differs(tiny):
    model, _, batches, _ = tiny
    batch = batches["own"]
    logp, mismatch = _old_pass(model, batch, False, False)
    assert _gap(batch, logp) <= TOL and mismatch == 0.0


def test_the_loss_pass_replays_the_routes(tiny):
    """One update whose old log-probs are the sampler's: with replay, the ratio is 1 on
    every token (packed rows); routed afresh, it is not."""
    model, _, batches, _ = tiny
    batch = batches["other"]
    graphdef, params = nnx.split(model)
    maxima = {}
    for replay in (True, False):
        cfg = _cfg(replay, True, batch.completion_length)
        mb = jax.tree.map(jnp.asarray, packing.fit_batch(batch, jax.random.key(0), cfg))
        n = mb.completion_length
        rows = Rows(jnp.ones(len(mb.rewards)), old_logp=jnp.asarray(batch.old_logprobs)[:, :n])
        aux = update.MicroInputs(rows, jnp.float32(1.0))
        loss = jax.jit(lambda p: update._loss(p, None, graphdef, mb, aux, cfg))  # noqa: B023
        maxima[replay] = float(loss(params)[1].maxima["ratio_max"])
    assert abs(maxima[True] - 1.0) <= TOL and maxima[False] > 1.05


def test_the_slots_engine_records_the_static_samplers_routes(tiny):
    """Two slots that refill (6 rows, ending at EOS): the same tokens, log-probs and routes,
    prompt and completion, as the static sampler's."""
    model, (ids, mask), _, static = tiny
    assert np.asarray(static.mask).sum(axis=1).min() < OWN["max_new_tokens"]  # EOS ends rows
    graphdef, params = nnx.split(model)
    args = [jnp.asarray(x) for x in (ids, mask, *M.rope_index(model.config, ids, mask))]
    cfg = dataclasses.replace(generation_config(model.config, **OWN), slots=2, page_size=4)
    out = Sampler(graphdef, cfg)(params, *args, jax.random.key(4), num_samples=G)
    np.testing.assert_array_equal(out.tokens, static.tokens)
    np.testing.assert_allclose(out.logprobs, static.logprobs, atol=1e-5)
    np.testing.assert_array_equal(out.routes, static.routes)


def test_replay_is_refused_without_experts_or_with_partial_rollouts(tmp_path):
    T.make_config("qwen3").save_pretrained(tmp_path / "dense")
    c = base.get_config()
    set_values(c, {"actor.routing_replay": True, "data.builtin_task": "arithmetic"})
    with pytest.raises(ConfigError, match=r"^config\.actor\.routing_replay=True: model type "):
        check_model_settings(c, M.load_config(tmp_path / "dense"))
    build(tmp_path / "moe")
    set_values(c, {"rollout.slots": 4, "rollout.partial": True})
    with pytest.raises(ConfigError, match=r"^config\.actor\.routing_replay=True: rows carried "):
        check_model_settings(c, M.load_config(tmp_path / "moe"))
    set_values(c, {"rollout.partial": False})  # the slots engine records routes too
    check_model_settings(c, M.load_config(tmp_path / "moe"))


def test_a_batch_of_padding_groups_alone_carries_the_routes_the_sampler_records(tiny):
    """Every process's part of a step's batch must have the same structure: where the filters
    kept no group on one process, its batch still carries routes (zeros) of the layout the
    sampler records (`setup.route_layout`), not None beside the others' arrays."""
    from jaxvrl.trainer.groups import Group, routes
    from jaxvrl.trainer.setup import route_layout

    model, _, _, static = tiny
    like = route_layout(model.config.text)
    recorded = np.asarray(static.routes)
    assert like == (recorded.shape[2:], recorded.dtype), (like, recorded.shape)
    example = {"prompt_ids": [1, 2, 3]}
    padding = [Group.padding(example, G, OWN["max_new_tokens"]) for _ in range(2)]
    got = routes(padding, 7, like)
    assert got.shape == (2 * G, 7 + OWN["max_new_tokens"], *like[0]) and got.dtype == like[1]
    assert not got.any() and routes(padding, 7) is None
