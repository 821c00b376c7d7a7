"""The fused train step: exact GRPO update vs an independent formula, micro-batch invariance,
non-finite skipping, one compilation per shape, TPRL/VGR paths."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxvrl.trainer.step import make_train_step
from tests.helpers import G, N, init_state, make_batch, metrics_adv, reference_logp, step_config
from tests.tolerance import assert_reduction_close, term_scale


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


def test_grpo_update_matches_independent_formula(model):
    graphdef, _ = nnx.split(model, nnx.Param)
    tx = optax.sgd(0.5)
    cfg = step_config({"rollout.temperature": 0.7})
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
    cfg = step_config(
        {
            "rollout.temperature": 0.7,
            "actor.use_kl_loss": True,
            "actor.kl_loss_coef": 0.3,
            "optim.micro_batches": 2,
        }
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
    base = step_config(
        {
            "actor.loss_agg_mode": mode,
            "tprl.enable_perception_filtering": True,
            "vgr.enable_token_weights": True,
            "tprl.enable_trajectory_reweighting": True,
            "tprl.enable_entropy_filtering": True,
            "tprl.entropy_filter_scope": "batch",
            # loss terms over the weighted mask, as the policy loss
            "actor.entropy_coef": 0.3,
            "actor.use_entropy_penalty": True,
            "actor.entropy_penalty_coef": 0.2,
        }
    )
    # one micro-batch shapes tokens inside the loss pass; two run the old-policy pass first
    assert base.with_values({"optim.micro_batches": 1}).shaping_in_loss
    assert base.with_values({"optim.micro_batches": 2}).old_pass
    batch = make_batch(model, seed=1)
    results = []
    for m in (1, 2):
        step = make_train_step(graphdef, tx, base.with_values({"optim.micro_batches": m}))
        state, metrics, extras = step(init_state(model, tx), None, batch, jax.random.key(3))
        results.append((state, metrics, extras))
    (s1, m1, e1), (s2, m2, e2) = results
    # loss and advantage_mean are means of terms that cancel: tolerances scale with the terms
    adv = np.asarray(e1.advantages, np.float64)
    mask = np.asarray(batch.completion_mask)
    adv_t = np.broadcast_to(adv[:, None] if adv.ndim == 1 else adv, mask.shape)
    scales = {
        "loss": term_scale(adv_t * np.asarray(e1.token_weights), mask),
        "advantage_mean": term_scale(adv),
    }
    for k in (
        "loss",
        "sensitivity_score_mean",
        "scaling_factor_mean",
        "perception_token_fraction",
        "low_var_kl_mean_selected",
        "low_var_kl_mean_rejected",
        "token_weight_mean",
        "entropy",
        "advantage_mean",
        "entropy_loss",
        "entropy_penalty",
    ):
        # the others average positive terms: their own size is the terms' scale
        scale = scales.get(k, abs(float(m1[k])))
        assert_reduction_close(float(m1[k]), float(m2[k]), scale, err_msg=k)
    for k in ("advantages", "token_weights"):
        np.testing.assert_allclose(
            np.asarray(getattr(e1, k)), np.asarray(getattr(e2, k)), atol=1e-5, err_msg=k
        )
    for (path, a), (_, b) in zip(nnx.to_flat_state(s1.params), nnx.to_flat_state(s2.params)):
        np.testing.assert_allclose(a.get_value(), b.get_value(), atol=2e-6, err_msg=str(path))


def test_loss_terms_add_up_over_micro_batches_when_token_weights_differ(model):
    """token-mean with VGR weights: the policy loss and the loss terms (KL loss, entropy bonus
    and penalty) aggregate over m * w, as the VGR designs scale the response mask that
    EasyR1's KL loss also reads. Rows whose clipped weights sum far from their token counts
    (one token drawing 1,000x the vision mass of the rest) sit in one micro-batch: 2 and 4
    micro-batches still give the whole batch's terms and the same update."""
    graphdef, params = nnx.split(model, nnx.Param)
    tx = optax.sgd(1.0)
    cfg = step_config(
        {
            "actor.loss_agg_mode": "token-mean",
            "vgr.enable_token_weights": True,
            "actor.shaping_source": "sampler",  # the weights come from the masses below
            "actor.entropy_coef": 0.3,
            "actor.use_entropy_penalty": True,
            "actor.entropy_penalty_coef": 0.2,
            "actor.use_kl_loss": True,
            "actor.kl_loss_coef": 0.3,
            "rollout.temperature": 1.0,
        }
    )
    batch = make_batch(model, seed=1)
    logp, ent = reference_logp(params, graphdef, batch, 1.0)
    ref = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(1), x.shape), params)
    d = np.asarray(reference_logp(ref, graphdef, batch, 1.0)[0] - logp, np.float64)
    b, layers = batch.completion_mask.shape[0], model.config.text.num_hidden_layers
    skewed = (jnp.arange(b)[:, None] < b // 2) & (jnp.arange(N)[None] > 0)
    vision = jnp.repeat(jnp.where(skewed, 1e-4, 0.3)[:, None], layers, axis=1)
    batch = batch.replace(
        old_logprobs=logp,
        old_entropy=ent,
        old_vision_mass=vision,
        old_text_mass=jnp.full(vision.shape, 0.3),
    )
    m = np.asarray(batch.completion_mask, np.float64)
    terms = {
        "entropy_loss": np.asarray(ent, np.float64),
        "entropy_penalty": -np.asarray(logp, np.float64),
        "kl_loss": np.exp(d) - d - 1.0,  # k3 (low_var_kl, clamped far beyond these values)
    }
    states = []
    for micro in (2, 4):
        step = make_train_step(graphdef, tx, cfg.with_values({"optim.micro_batches": micro}))
        state, metrics, extras = step(init_state(model, tx), ref, batch, jax.random.key(3))
        w = np.asarray(extras.token_weights, np.float64)
        assert w.max() == 3.0 and w[b // 2 :].max() < 1.01  # clipped in the first half only
        for k, x in terms.items():  # token means over the whole batch's m * w
            want, plain = np.sum(x * m * w) / np.sum(m * w), np.sum(x * m) / m.sum()
            assert abs(want - plain) > 1e-4 * abs(want), k  # 10x the tolerance: w matters
            np.testing.assert_allclose(float(metrics[k]), want, rtol=1e-5, err_msg=k)
        states.append(state)
    for (path, a), (_, c) in zip(*(nnx.to_flat_state(s.params) for s in states)):
        np.testing.assert_allclose(a.get_value(), c.get_value(), atol=2e-6, err_msg=str(path))


def test_nonfinite_loss_skips_update_and_counts(model):
    graphdef, _ = nnx.split(model, nnx.Param)
    tx = optax.sgd(0.1)
    step = make_train_step(graphdef, tx, step_config())
    rewards = np.array([1.0, np.nan, 0.0, 1.0])
    batch = make_batch(model, rewards=rewards)
    state = init_state(model, tx)
    before = jax.tree.map(np.array, state.params)
    state, metrics, _ = step(state, None, batch, jax.random.key(0))
    assert int(state.skipped) == 1 and int(metrics["nonfinite"]) == 1
    for (path, a), (_, b) in zip(nnx.to_flat_state(state.params), nnx.to_flat_state(before)):
        np.testing.assert_array_equal(a.get_value(), b.get_value(), err_msg=str(path))


def test_a_skipped_update_moves_the_schedule_not_adams_state(model):
    """After a non-finite update the learning-rate schedule moves on (verl steps its scheduler
    every step; the step's other updates and later steps keep their rates) while Adam's
    moments and bias-correction count stay, as torch's skipped optimizer.step() leaves them;
    in host memory (actor.offload_optimizer) too."""
    from configs import grpo
    from jaxvrl.trainer import build
    from jaxvrl.trainer.update import _advance_schedule

    graphdef, _ = nnx.split(model, nnx.Param)
    o = grpo.get_config().optim
    o.warmup_steps, o.lr = 4, 1.0
    tx = build.make_optimizer(o, total_steps=10)
    step = make_train_step(graphdef, tx, step_config())
    batch = make_batch(model, rewards=np.array([1.0, np.nan, 0.0, 1.0]))
    state, _, _ = step(init_state(model, tx), None, batch, jax.random.key(0))
    counts = lambda s, kind: [  # noqa: E731
        int(x.count)
        for x in jax.tree.leaves(s, is_leaf=lambda x: isinstance(x, kind))
        if isinstance(x, kind)
    ]
    assert int(state.skipped) == 1
    assert counts(state.opt_state, optax.ScaleByScheduleState) == [1]
    assert counts(state.opt_state, optax.ScaleByAdamState) == [0]
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    opt = jax.device_put(state.opt_state, host)
    moved = jax.jit(lambda o: _advance_schedule(o, jnp.bool_(True)))(opt)
    assert counts(moved, optax.ScaleByScheduleState) == [2]


def test_tprl_step_compiles_once_per_shape(model):
    graphdef, _ = nnx.split(model, nnx.Param)
    tx = optax.adam(1e-3)
    cfg = step_config(
        {
            "tprl.enable_perception_filtering": True,
            "tprl.enable_entropy_filtering": True,
            "tprl.enable_trajectory_reweighting": True,
            "actor.use_kl_loss": True,
            "actor.kl_loss_coef": 0.1,
            "tprl.top_p_perception_tokens": 0.4,
        }
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


def test_shaping_in_the_loss_pass_reads_this_policy_not_an_older_samplers(model):
    """Rows sampled by an earlier policy (partial rollouts: the ratio's old log-probs are the
    sampler's) with one update and one micro-batch: the perception scores and TAS factors
    are shaped from the loss pass's own log-probs, whatever the sampler's were."""
    graphdef, ref = nnx.split(model, nnx.Param)
    tx = optax.sgd(0.1)
    cfg = step_config(
        {
            "rollout.partial": True,
            "tprl.enable_perception_filtering": True,
            "tprl.enable_trajectory_reweighting": True,
            "tprl.top_p_perception_tokens": 0.4,
        }
    )
    assert cfg.shaping_in_loss and cfg.sampler_old
    # LoRA dropout reaches the loss pass, not the perturbed one: the shaping then reads a
    # dropout-free old-policy pass (without dropout, the loss pass still serves)
    lora = {"lora.rank": 4, "tprl.enable_perception_filtering": True}
    assert step_config({**lora, "lora.dropout": 0.05}).old_pass
    assert step_config({**lora, "lora.dropout": 0.0}).shaping_in_loss
    step = make_train_step(graphdef, tx, cfg)
    state = init_state(model, tx)
    got = []
    for old in (-3.0, -6.0):
        batch = make_batch(model, old_logprobs=np.full((2 * G, N), old, np.float32))
        _, m, _ = step(jax.tree.map(jnp.copy, state), ref, batch, jax.random.key(0))
        got.append([float(m[k]) for k in ("sensitivity_score_mean", "scaling_factor_mean")])
    assert got[0] == got[1] and got[0][0] > 0


def test_a_mini_batch_of_padding_groups_alone_is_no_update(model):
    """Dynamic sampling short of groups pads the batch's last groups: with 2 mini-batches
    the second is padding alone. It moves no weight (the momentum would), is not counted
    in `updates`, and the step's metrics are the real update's: those of a step on the
    real rows alone (one mini-batch). SGD with momentum, not Adam: Adam's division by
    sqrt(v) turns the two programs' rounding in near-zero gradients into lr-sized steps."""
    graphdef, _ = nnx.split(model, nnx.Param)
    tx = optax.sgd(0.1, momentum=0.9)
    rewards = np.arange(4 * G, dtype=np.float32) % 3
    half = make_batch(model, 2, 3, rewards[: 2 * G], completion_seed=5)
    whole = make_batch(model, 4, 3, rewards, completion_seed=5)  # the same first 2 prompts
    assert np.array_equal(whole.input_ids[: 2 * G], half.input_ids)
    pad = jnp.zeros_like(half.completion_mask)
    whole = whole.replace(completion_mask=jnp.concatenate([half.completion_mask, pad]))
    got, want = {}, {}
    for out, batch, values in (
        (got, whole, {"prompts_per_step": 4, "actor.global_batch_size": 2}),
        (want, half, {"prompts_per_step": 2}),
    ):
        values["actor.old_logprobs"] = "recompute"
        step = make_train_step(graphdef, tx, step_config(values))
        state, m, _ = step(init_state(model, tx), None, batch, jax.random.key(0))
        out.update(metrics=jax.device_get(m), params=jax.device_get(state.params))
    assert int(got["metrics"]["updates"]) == 1
    # two programs of other shapes: their sums round apart in the last bits (the gradient
    # norm sums ~1e5 squares, the loss +-A terms of order one)
    for k in ("ratio_mean", "clip_frac", "entropy", "grad_norm", "loss", "advantage_mean"):
        np.testing.assert_allclose(
            got["metrics"][k], want["metrics"][k], rtol=1e-4, atol=1e-5, err_msg=k
        )
    for (path, a), (_, b) in zip(
        nnx.to_flat_state(got["params"]), nnx.to_flat_state(want["params"])
    ):
        np.testing.assert_allclose(a.get_value(), b.get_value(), atol=1e-6, err_msg=str(path))


def test_micro_batches_log_the_token_means_of_the_whole_mini_batch(model):
    """Off-policy rows (the sampler's log-probs far from the policy's) in 2 micro-batches of
    8 and 6 completion tokens, with the loss a mean over rows: the logged token means (clip
    fractions, ratio, approximate KLs) are the mini-batch's, as one micro-batch logs them,
    not weighted by the micro-batches' shares of the loss."""
    graphdef, _ = nnx.split(model, nnx.Param)
    tx = optax.sgd(0.0)
    batch = make_batch(model, seed=1, old_logprobs=np.full((2 * G, N), -3.0, np.float32))
    got = []
    for m in (1, 2):
        values = {"rollout.partial": True, "actor.loss_agg_mode": "seq-mean-token-mean"}
        step = make_train_step(graphdef, tx, step_config({**values, "optim.micro_batches": m}))
        _, metrics, _ = step(init_state(model, tx), None, batch, jax.random.key(0))
        got.append(jax.device_get(metrics))
    keys = ("clip_frac", "clip_frac_high", "clip_frac_low", "ratio_mean", "approx_kl")
    for k in keys + ("approx_kl_k3",):
        np.testing.assert_allclose(got[1][k], got[0][k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert 0 < got[0]["clip_frac"] < 1
