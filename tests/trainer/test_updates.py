"""Several policy updates per rollout batch: epochs x mini-batches equal sequential optax updates
with the experience held fixed; clipping binds from the second update on; the sampler's old
log-probs equal the recomputed ones."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxvrl import rl
from jaxvrl.sampling import Sampler, SamplingConfig
from jaxvrl.trainer.rollout import assemble
from jaxvrl.trainer.step import make_train_step, update_order
from tests.helpers import (
    G,
    N,
    init_state,
    make_batch,
    make_prompts,
    metrics_adv,
    reference_logp,
    step_config,
)
from tests.models import hf_tiny as T
from tests.tolerance import assert_reduction_close, term_scale

TEMP = 0.7


def rows_of(batch, idx):
    """The rows idx of a RolloutBatch (position_ids [3, B, L] has them on axis 1)."""
    take = lambda x: jnp.asarray(x)[idx]  # noqa: E731
    return dataclasses.replace(
        jax.tree.map(take, batch),
        position_ids=jnp.asarray(batch.position_ids)[:, idx],
    )


def clipped_token_mean(params, graphdef, mb, old, adv, token_mask, weights, low, high, dual):
    """The PPO dual-clip loss written out: token-mean over the rows' weighted mask."""
    logp, _ = reference_logp(params, graphdef, mb, TEMP)
    r = jnp.exp(logp - old)
    a = adv[:, None]
    loss_t = jnp.maximum(-a * r, -a * jnp.clip(r, 1 - low, 1 + high))
    loss_t = jnp.where(a < 0, jnp.minimum(loss_t, -dual * a), loss_t)
    mw = mb.completion_mask * weights
    return jnp.sum(loss_t * token_mask * mw) / jnp.sum(mw)


def test_two_mini_batches_two_epochs_equal_four_sequential_updates(model):
    graphdef, _ = nnx.split(model, nnx.Param)
    tx = optax.sgd(0.3, momentum=0.9)  # the momentum carries over from update to update
    cfg = step_config(
        {
            "rollout.temperature": TEMP,
            "actor.clip_ratio_high": 0.28,
            "prompts_per_step": 2,
            "actor.global_batch_size": 1,  # 2 mini-batches
            "actor.ppo_epochs": 2,
            "optim.micro_batches": 2,  # each mini-batch of 2 rows in 2 micro-batches
            "tprl.enable_entropy_filtering": True,
            "tprl.top_p_entropy_tokens": 0.4,
            "vgr.enable_token_weights": True,
        }
    )
    state = init_state(model, tx)
    p0 = jax.tree.map(jnp.array, state.params)
    plain = make_batch(model, seed=5)
    logp0, ent0 = reference_logp(p0, graphdef, plain, TEMP)
    mask = plain.completion_mask
    # the sampler's log-probs, off the policy's by up to ~0.5 nats: ratios clip from the start
    noise = 0.25 * jax.random.normal(jax.random.key(1), logp0.shape)
    old = (logp0 + noise) * mask
    batch = dataclasses.replace(plain, old_logprobs=old)
    rng = jax.random.key(7)
    new_state, metrics, extras = make_train_step(graphdef, tx, cfg)(state, None, batch, rng)

    # the reference: the experience fixed once from the old policy, then 4 plain updates
    adv = jnp.asarray(metrics_adv(batch).reshape(-1), jnp.float32)
    token_mask = rl.entropy_token_mask(ent0, mask, 0.4, scope="sequence")
    weights = extras.token_weights  # VGR weights: the experience phase's, held fixed
    order = np.asarray(update_order(rng, 4, 2, 2))
    assert order.shape == (4, 2) and sorted(order[2:].ravel()) == [0, 1, 2, 3]
    assert order[:2].ravel().tolist() == [0, 1, 2, 3]  # the first epoch: rows in order
    assert order[2:].ravel().tolist() != [0, 1, 2, 3]  # the second: shuffled
    params, opt = p0, tx.init(p0)
    grad = jax.jit(jax.grad(clipped_token_mean), static_argnums=(1, 7, 8, 9))
    for idx in order:
        mb = rows_of(batch, idx)
        grads = grad(
            params, graphdef, mb, old[idx], adv[idx], token_mask[idx], weights[idx], 0.2, 0.28, 3.0
        )
        updates, opt = tx.update(grads, opt, params)
        params = optax.apply_updates(params, updates)

    np.testing.assert_allclose(np.asarray(extras.advantages), np.asarray(adv), atol=1e-5)
    assert int(metrics["updates"]) == 4 and int(new_state.step) == 1
    assert float(metrics["clip_frac"]) > 0  # the sampler's log-probs are the old ones
    for (path, a), (_, b) in zip(nnx.to_flat_state(new_state.params), nnx.to_flat_state(params)):
        np.testing.assert_allclose(a.get_value(), b.get_value(), atol=5e-6, err_msg=str(path))


def sampled_batch(model, seed):
    """2 prompts x G completions drawn by the sampler (temperature TEMP), with its log-probs."""
    rng = np.random.default_rng(seed)
    p = make_prompts(model, seed=rng, pools=True)
    graphdef, params = nnx.split(model, nnx.Param)
    suppress = (T.IMAGE, T.VIDEO, T.VSTART, T.VEND)
    sampler = Sampler(graphdef, SamplingConfig(N, TEMP, suppress_token_ids=suppress))
    args = [jnp.asarray(p[k]) for k in ("input_ids", "attention_mask", "position_ids", "deltas")]
    images = jax.tree.map(jnp.asarray, p["images"])
    out = sampler(params, *args, jax.random.key(seed), images=images)
    b = len(p["input_ids"])
    batch = assemble(
        p["input_ids"],
        p["attention_mask"],
        p["position_ids"],
        p["deltas"],
        np.asarray(out.tokens),
        np.asarray(out.mask),
        np.array([1.0, 0.0, 0.0, 1.0]),
        np.ones(b, bool),
        images=p["images"],
        old_logprobs=np.asarray(out.logprobs),
    )
    return jax.tree.map(jnp.asarray, batch)


def test_clipping_binds_after_the_first_update_and_sampler_equals_recompute(model):
    """2 epochs over the whole batch at a large learning rate: the first update is on-policy
    (no token clipped), the second sees ratios far from 1. Sampler and recomputed old
    log-probs agree within 2e-4, so both settings see the same losses and clipping."""
    graphdef, _ = nnx.split(model, nnx.Param)
    tx = optax.adam(0.05)
    batch = sampled_batch(model, seed=3)
    want, _ = reference_logp(nnx.split(model, nnx.Param)[1], graphdef, batch, TEMP)
    mask = np.asarray(batch.completion_mask)
    diff = np.abs(np.asarray(batch.old_logprobs) - np.asarray(want)) * mask
    assert mask.sum() > 4 and diff.max() < 2e-4
    results = {}
    for how in ("sampler", "recompute"):
        cfg = step_config(
            {"rollout.temperature": TEMP, "actor.ppo_epochs": 2, "actor.old_logprobs": how}
        )
        state = init_state(model, tx)
        state, metrics, _ = make_train_step(graphdef, tx, cfg)(
            state, None, batch, jax.random.key(0)
        )
        results[how] = (jax.tree.map(np.asarray, state.params), metrics)
        assert int(metrics["updates"]) == 2
        last = float(metrics["clip_frac_last"])
        assert last > 0.1 and float(metrics["ratio_max"]) > 1.2
        # clip_frac is the mean over the 2 updates: the first one clipped nothing
        np.testing.assert_allclose(float(metrics["clip_frac"]), last / 2, atol=1e-6)
    m = results["recompute"][1]
    assert float(m["rollout/logprob_abs_diff_max"]) < 2e-4
    assert 0 < float(m["rollout/logprob_abs_diff_mean"]) <= float(m["rollout/logprob_abs_diff_max"])
    # Adam amplifies the 1e-6 differences in the parameters: compare what the updates saw
    s, r = results["sampler"][1], results["recompute"][1]
    adv = np.asarray(rl.group_advantages(batch.rewards, G))[:, None] * mask
    assert_reduction_close(float(s["loss"]), float(r["loss"]), term_scale(adv, mask), rtol=1e-3)
    assert abs(float(s["clip_frac_last"]) - float(r["clip_frac_last"])) <= 1.01 / mask.sum()


def test_recompute_with_token_rollout_correction_weighs_the_loss(model):
    """old_logprobs=recompute, rollout_is=token: the loss's per-token terms carry
    min(exp(recomputed - sampler), 2), and the two's difference is logged."""
    graphdef, _ = nnx.split(model, nnx.Param)
    tx = optax.sgd(0.5)
    cfg = step_config(
        {
            "rollout.temperature": TEMP,
            "actor.old_logprobs": "recompute",
            "algorithm.rollout_is": "token",
            "algorithm.rollout_is_threshold": 2.0,
        }
    )
    plain = make_batch(model, seed=6)
    state = init_state(model, tx)
    p0 = jax.tree.map(jnp.array, state.params)
    logp0, _ = reference_logp(p0, graphdef, plain, TEMP)
    mask = plain.completion_mask
    noise = 0.5 * jax.random.normal(jax.random.key(2), logp0.shape) * mask
    batch = dataclasses.replace(plain, old_logprobs=logp0 - noise)
    w = jnp.minimum(jnp.exp(noise), 2.0)
    adv = jnp.asarray(metrics_adv(batch).reshape(-1, 1), jnp.float32)

    def loss(params):  # on-policy (old = recomputed = current): ratio 1, its gradient grad logp
        logp, _ = reference_logp(params, graphdef, batch, TEMP)
        r = jnp.exp(logp - jax.lax.stop_gradient(logp))
        return jnp.sum(-adv * r * w * mask) / jnp.sum(mask)

    grads = jax.grad(loss)(p0)
    new_state, metrics, _ = make_train_step(graphdef, tx, cfg)(
        state, None, batch, jax.random.key(0)
    )
    m = np.asarray(mask) > 0
    np.testing.assert_allclose(
        float(metrics["rollout/logprob_abs_diff_max"]),
        np.abs(np.asarray(noise))[m].max(),
        rtol=1e-3,
    )
    np.testing.assert_allclose(
        float(metrics["rollout/is_weight_mean"]), np.asarray(w)[m].mean(), rtol=1e-4
    )
    expect = jax.tree.map(lambda p, g: p - 0.5 * g, p0, grads)
    for (path, a), (_, b) in zip(nnx.to_flat_state(new_state.params), nnx.to_flat_state(expect)):
        np.testing.assert_allclose(a.get_value(), b.get_value(), atol=2e-6, err_msg=str(path))
