"""The fused train step: exact GRPO update vs an independent formula, micro-batch invariance,
non-finite skipping, one compilation per shape, TPRL/VGR paths."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxvrl.models import qwen2_5_vl as q
from jaxvrl.trainer.rollout import assemble
from jaxvrl.trainer.step import StepConfig, TrainState, make_train_step
from tests.models import hf_tiny as T
from tests.tolerance import assert_reduction_close, term_scale

G = 2
N = 5


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("step_model")
    T.build(path, seed=11)
    return q.load(path)


def make_prompts(model, rng):
    """2 prompts x G rows, each row with its own image (per-row vision layout): a dict of
    input_ids, attention_mask, position_ids, deltas, images, pools (numpy)."""
    grids = [[[1, 4, 4]], [[1, 2, 6]]]
    rows, vis = [], []
    for g in grids:
        p = T.prompt(rng, images=g, text_len=(3, 6))
        pv = T.patches(rng, g)
        for _ in range(G):
            rows.append(p)
            vis.append(q.vision_inputs(pv, g, model.config.vision, num_patches=16))
    ids, mask = T.left_pad(rows, length=26)  # one prompt bucket for every seed
    grid_all = np.concatenate([g for g in grids for _ in range(G)])
    pos, deltas = q.get_rope_index(ids, mask, model.config, grid_all)
    pools = q.attention_pools(ids, mask, ids.shape[1], **T.POOL_IDS)
    images = q.stack_vision_inputs(vis)
    return dict(
        input_ids=ids, attention_mask=mask, position_ids=pos, deltas=deltas, images=images,
        pools=pools,
    )  # fmt: skip


def make_batch(model, seed=0, rewards=None, old_logprobs=None):
    """2 prompts x G random completions of N tokens (rows 1 and 3 end early)."""
    rng = np.random.default_rng(seed)
    p = make_prompts(model, rng)
    b = len(p["input_ids"])
    tokens = rng.integers(20, 280, (b, N))
    comp = np.ones((b, N), np.float32)
    comp[1, 3:] = 0  # an EOS at position 2 in row 1
    comp[3, 1:] = 0
    rewards = rng.normal(size=b) if rewards is None else rewards
    batch = assemble(
        p["input_ids"],
        p["attention_mask"],
        p["position_ids"],
        p["deltas"],
        tokens,
        comp,
        rewards,
        np.ones(b, bool),
        images=p["images"],
        pools=p["pools"],
        old_logprobs=old_logprobs,
    )
    return jax.tree.map(jnp.asarray, batch)


def init_state(model, tx):
    _, params = nnx.split(model, nnx.Param)
    params = jax.tree.map(jnp.array, params)  # a private copy: the step donates it
    return TrainState(params, tx.init(params), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))


@functools.partial(jax.jit, static_argnums=(1, 3))  # compiled once per shape (gradients too)
def reference_logp(params, graphdef, batch, temperature):
    """(log-probs of the completion tokens [B, N], entropies [B, N]) from full logits."""
    model = nnx.merge(graphdef, params)
    out = model.forward(
        batch.input_ids, batch.attention_mask, batch.position_ids, images=batch.images
    )
    logits = out.logits[:, -N - 1 : -1] / temperature
    logp = jax.nn.log_softmax(logits, -1)
    ent = -jnp.sum(jnp.exp(logp) * logp, -1)
    return jnp.take_along_axis(logp, batch.input_ids[:, -N:, None], -1)[..., 0], ent


def reference_grpo_loss(params, graphdef, batch, temperature, ref_params=None, beta=0.0):
    """Independent GRPO/DAPO (token-mean) loss on-policy: ratio = 1 at the current params, so
    the loss value is -sum(m A)/sum(m) and its gradient is -sum(m A grad logp)/sum(m). With
    ref_params, plus beta * token-mean of k3 = exp(ref - logp) - (ref - logp) - 1."""
    tok, _ = reference_logp(params, graphdef, batch, temperature)
    r = np.asarray(batch.rewards).reshape(-1, G)
    adv = (r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-6)
    adv = jnp.asarray(adv.reshape(-1))[:, None]
    ratio = jnp.exp(tok - jax.lax.stop_gradient(tok))
    m = batch.completion_mask
    loss = jnp.sum(-adv * ratio * m) / jnp.sum(m)
    if ref_params is not None:
        d = reference_logp(ref_params, graphdef, batch, temperature)[0] - tok
        loss = loss + beta * jnp.sum((jnp.exp(d) - d - 1.0) * m) / jnp.sum(m)
    return loss


def metrics_adv(batch):
    """GRPO advantages of the batch's rows: the magnitude of the policy loss's terms."""
    r = np.asarray(batch.rewards, np.float64).reshape(-1, G)
    return (r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-6)


def test_grpo_update_matches_independent_formula(model):
    graphdef, _ = nnx.split(model, nnx.Param)
    tx = optax.sgd(0.5)
    cfg = StepConfig(group_size=G, temperature=0.7, loss_agg_mode="token-mean")
    step = make_train_step(graphdef, tx, cfg)
    # with one update per batch the old policy is the current one: the sampler's log-probs
    # (here far off) do not enter, and no token is clipped
    batch = make_batch(model, old_logprobs=np.full((2 * G, N), -3.0, np.float32))
    state = init_state(model, tx)
    p0 = jax.tree.map(np.array, state.params)
    grads = jax.grad(reference_grpo_loss)(jax.tree.map(jnp.asarray, p0), graphdef, batch, 0.7)
    new_state, metrics, _ = step(state, None, batch, jax.random.key(0))
    assert int(new_state.step) == 1 and int(new_state.skipped) == 0
    assert int(metrics["updates"]) == 1 and float(metrics["clip_frac"]) == 0.0
    assert float(metrics["ratio_max"]) == 1.0
    expect = jax.tree.map(lambda p, g: p - 0.5 * g, p0, grads)
    for (path, a), (_, b) in zip(
        nnx.to_flat_state(new_state.params), nnx.to_flat_state(jax.tree.map(jnp.asarray, expect))
    ):
        np.testing.assert_allclose(a.get_value(), b.get_value(), atol=2e-6, err_msg=str(path))
    ref_loss = reference_grpo_loss(jax.tree.map(jnp.asarray, p0), graphdef, batch, 0.7)
    # the loss is a token mean of +-A terms that largely cancel: tolerance on their scale
    adv_scale = term_scale(metrics_adv(batch))
    assert_reduction_close(float(metrics["loss"]), float(ref_loss), adv_scale)
    assert abs(float(ref_loss)) > 1e-3  # rows of unequal length: token-mean is not zero


def test_grpo_kl_step_without_old_pass_matches_reference(model):
    """GRPO + KL loss needs no old-policy pass (old = current): the update, the entropy and
    the KL metrics still equal the independent full-logits formulas, over 2 micro-batches."""
    graphdef, _ = nnx.split(model, nnx.Param)
    tx = optax.sgd(0.5)
    cfg = StepConfig(
        group_size=G, temperature=0.7, use_kl_loss=True, kl_loss_coef=0.3, micro_batches=2
    )
    assert not cfg.old_pass
    batch = make_batch(model, seed=2)
    state = init_state(model, tx)
    p0 = jax.tree.map(jnp.asarray, jax.tree.map(np.array, state.params))
    noise = lambda i, x: x + 0.05 * jax.random.normal(jax.random.key(i), x.shape)  # noqa: E731
    leaves, treedef = jax.tree.flatten(p0)
    ref = jax.tree.unflatten(treedef, [noise(i, x) for i, x in enumerate(leaves)])
    loss_fn = lambda p: reference_grpo_loss(p, graphdef, batch, 0.7, ref, beta=0.3)  # noqa: E731
    want_loss, grads = jax.value_and_grad(loss_fn)(p0)
    logp, ent = reference_logp(p0, graphdef, batch, 0.7)
    d = reference_logp(ref, graphdef, batch, 0.7)[0] - logp
    m = batch.completion_mask
    want_kl = float(jnp.sum((jnp.exp(d) - d - 1.0) * m) / jnp.sum(m))
    want_ent = float(jnp.sum(ent * m) / jnp.sum(m))
    new_state, metrics, _ = make_train_step(graphdef, tx, cfg)(state, ref, batch, jax.random.key(0))
    assert want_kl > 1e-3
    np.testing.assert_allclose(float(metrics["kl"]), want_kl, rtol=1e-4)
    np.testing.assert_allclose(float(metrics["entropy"]), want_ent, rtol=1e-5)
    assert_reduction_close(float(metrics["loss"]), float(want_loss), term_scale(metrics_adv(batch)))
    expect = jax.tree.map(lambda p, g: p - 0.5 * g, p0, grads)
    for (path, a), (_, b) in zip(nnx.to_flat_state(new_state.params), nnx.to_flat_state(expect)):
        np.testing.assert_allclose(a.get_value(), b.get_value(), atol=2e-6, err_msg=str(path))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batches_give_the_same_update(model, mode):
    graphdef, _ = nnx.split(model, nnx.Param)
    tx = optax.sgd(1.0)  # params then show the gradient itself (Adam would amplify float noise)
    base = StepConfig(
        group_size=G,
        loss_agg_mode=mode,
        perception_filtering=True,
        token_weights=True,
        trajectory_reweighting=True,
        entropy_filtering=True,
        entropy_filter_scope="batch",
    )
    # one micro-batch shapes tokens inside the loss pass; two run the old-policy pass first
    assert dataclasses.replace(base, micro_batches=1).shaping_in_loss
    assert dataclasses.replace(base, micro_batches=2).old_pass
    batch = make_batch(model, seed=1)
    results = []
    for m in (1, 2):
        step = make_train_step(graphdef, tx, dataclasses.replace(base, micro_batches=m))
        state, metrics, extras = step(init_state(model, tx), None, batch, jax.random.key(3))
        results.append((state, metrics, extras))
    (s1, m1, e1), (s2, m2, e2) = results
    # loss and advantage_mean are means of terms that cancel: tolerances scale with the terms
    adv = np.asarray(e1["advantages"], np.float64)
    mask = np.asarray(batch.completion_mask)
    adv_t = np.broadcast_to(adv[:, None] if adv.ndim == 1 else adv, mask.shape)
    scales = {
        "loss": term_scale(adv_t * np.asarray(e1["token_weights"]), mask),
        "advantage_mean": term_scale(adv),
    }
    for k in (
        "loss",
        "sensitivity_score_mean",
        "scaling_factor_mean",
        "perception_token_fraction",
        "token_weight_mean",
        "entropy",
        "advantage_mean",
    ):
        # the others average positive terms: their own size is the terms' scale
        scale = scales.get(k, abs(float(m1[k])))
        assert_reduction_close(float(m1[k]), float(m2[k]), scale, err_msg=k)
    for k in ("advantages", "token_weights"):
        np.testing.assert_allclose(np.asarray(e1[k]), np.asarray(e2[k]), atol=1e-5, err_msg=k)
    for (path, a), (_, b) in zip(nnx.to_flat_state(s1.params), nnx.to_flat_state(s2.params)):
        np.testing.assert_allclose(a.get_value(), b.get_value(), atol=2e-6, err_msg=str(path))


def test_nonfinite_loss_skips_update_and_counts(model):
    graphdef, _ = nnx.split(model, nnx.Param)
    tx = optax.sgd(0.1)
    step = make_train_step(graphdef, tx, StepConfig(group_size=G))
    rewards = np.array([1.0, np.nan, 0.0, 1.0])
    batch = make_batch(model, rewards=rewards)
    state = init_state(model, tx)
    before = jax.tree.map(np.array, state.params)
    state, metrics, _ = step(state, None, batch, jax.random.key(0))
    assert int(state.skipped) == 1 and int(metrics["nonfinite"]) == 1
    for (path, a), (_, b) in zip(nnx.to_flat_state(state.params), nnx.to_flat_state(before)):
        np.testing.assert_array_equal(a.get_value(), b.get_value(), err_msg=str(path))


def test_tprl_step_compiles_once_per_shape(model):
    graphdef, _ = nnx.split(model, nnx.Param)
    tx = optax.adam(1e-3)
    cfg = StepConfig(
        group_size=G,
        perception_filtering=True,
        entropy_filtering=True,
        trajectory_reweighting=True,
        use_kl_loss=True,
        kl_loss_coef=0.1,
        top_p_perception_tokens=0.4,
    )
    step = make_train_step(graphdef, tx, cfg)
    _, ref = nnx.split(model, nnx.Param)
    state = init_state(model, tx)
    for seed in range(3):
        state, metrics, _ = step(state, ref, make_batch(model, seed=seed), jax.random.key(seed))
        assert np.isfinite(float(metrics["loss"]))
        assert 0.0 < float(metrics["perception_token_fraction"]) <= 1.0
        assert float(metrics["kl"]) >= 0.0
    assert step._cache_size() == 1
