"""PPO in the fused step: the critic's value loss falls on a fixed batch while the policy waits
out the warm-up; KL-in-reward changes the advantages exactly as R - beta sum_t KL_t and the
adaptive controller's coefficient moves by its formula."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import grpo, ppo
from jaxvrl import rl
from jaxvrl.models import qwen2_5_vl as q
from jaxvrl.trainer.build import init_train_state, step_config
from jaxvrl.trainer.step import make_train_step
from tests.helpers import G, make_batch, reference_logp
from tests.tolerance import assert_reduction_close, term_scale


def _flat(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_critic_value_loss_decreases_during_policy_warmup(ckpt):
    model = q.load(ckpt)
    c = ppo.get_config()
    c.rollout.num_generations = G
    c.algorithm.lam = 1.0  # returns = reward-to-go, independent of V: a fixed target
    c.algorithm.use_kl_in_reward = False
    c.critic.lr = 5e-4
    c.critic.warmup_steps = 100
    graphdef, tx, state, ref = init_train_state(model, c)
    step = make_train_step(graphdef, tx, step_config(c))
    batch = make_batch(model, seed=2, rewards=np.array([1.0, 0.0, 0.5, 2.0]))
    policy0 = _flat(state.params)
    critic0 = _flat(state.critic_params)
    losses = []
    for _ in range(5):
        state, metrics, extras = step(state, ref, batch, jax.random.key(0))
        losses.append(float(metrics["vf_loss"]))
        assert int(metrics["policy_updated"]) == 0
    print("\nvalue loss per step:", [round(x, 4) for x in losses])
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < 0.5 * losses[0]
    for a, b in zip(_flat(state.params), policy0):
        np.testing.assert_array_equal(a, b)  # the policy waits for the warm-up
    assert any(np.abs(a - b).max() > 0 for a, b in zip(_flat(state.critic_params), critic0))
    adv, mask = np.asarray(extras.advantages), np.asarray(batch.completion_mask)
    assert adv.shape == mask.shape  # token-level GAE advantages, whitened
    assert abs((adv * mask).sum() / mask.sum()) < 1e-5


def test_kl_in_reward_advantages_and_adaptive_coefficient(ckpt):
    model = q.load(ckpt)
    c = grpo.get_config()
    c.rollout.num_generations = G
    c.algorithm.use_kl_in_reward = True
    c.algorithm.kl_ctrl.type = "adaptive"
    c.algorithm.kl_ctrl.kl_coef = 0.5
    c.algorithm.kl_ctrl.target_kl = 0.01
    c.algorithm.kl_ctrl.horizon = 20
    cfg = step_config(c)
    assert cfg.needs_ref
    graphdef, tx, state, ref = init_train_state(model, c)
    noise = lambda i, x: x + 0.02 * jax.random.normal(jax.random.key(i), x.shape, x.dtype)  # noqa: E731
    leaves, treedef = jax.tree.flatten(ref)
    ref = jax.tree.unflatten(treedef, [noise(i, x) for i, x in enumerate(leaves)])
    batch = make_batch(model, seed=4, rewards=np.array([1.0, 0.0, 0.0, 0.0]))

    def logp(params):
        return reference_logp(params, graphdef, batch, 1.0)[0]

    m = np.asarray(batch.completion_mask)
    old, ref_lp = np.asarray(logp(state.params)), np.asarray(logp(ref))
    kl_t = (old - ref_lp) * m  # verl's default kl_penalty "kl"
    beta = 0.5
    seq = np.asarray(batch.rewards) - beta * kl_t.sum(-1)
    want = np.asarray(rl.group_advantages(jnp.asarray(seq), G))
    plain = np.asarray(rl.group_advantages(batch.rewards, G))
    kl = float(np.mean(kl_t.sum(-1) / m.sum(-1)))
    want_coef = rl.adaptive_kl_coef(beta, kl, 0.01, 20, n_steps=m.shape[0])

    step = make_train_step(graphdef, tx, cfg)
    spare = jax.tree.map(jnp.copy, state)  # the step donates its state
    state, metrics, extras = step(state, ref, batch, jax.random.key(0))
    np.testing.assert_allclose(np.asarray(extras.advantages), want, atol=1e-4)
    assert np.abs(want - plain).max() > 1e-3  # the KL term did change them
    # per-token KL = logp - ref can take either sign: tolerance on the terms' size
    assert_reduction_close(float(metrics["kl_reward"]), kl, term_scale(kl_t, m), rtol=1e-4)
    assert float(metrics["kl_coef"]) == pytest.approx(beta)
    np.testing.assert_allclose(float(state.kl_coef), want_coef, rtol=1e-5)
    assert float(state.kl_coef) != beta
    # a padding row (an unfilled group's: no completion tokens) is not one of verl's n_steps
    padded = batch.replace(completion_mask=batch.completion_mask.at[-1].set(0))
    state, metrics, _ = step(spare, ref, padded, jax.random.key(0))
    want_coef = rl.adaptive_kl_coef(beta, float(metrics["kl_reward"]), 0.01, 20, n_steps=3)
    np.testing.assert_allclose(float(state.kl_coef), want_coef, rtol=1e-5)


def test_remax_with_kl_in_reward_takes_each_tokens_return(ckpt):
    """REMAX with the KL in the reward (verl's compute_remax_outcome_advantage): each token's
    advantage is its return, the token rewards from it to the row's end, less the greedy
    baseline; a row's tokens then differ by the KL behind them."""
    model = q.load(ckpt)
    c = grpo.get_config()
    c.rollout.num_generations = G
    c.algorithm.adv_estimator = "remax"
    c.algorithm.use_kl_in_reward = True
    c.algorithm.kl_ctrl.kl_coef = 0.5
    cfg = step_config(c)
    graphdef, tx, state, ref = init_train_state(model, c)
    noise = lambda i, x: x + 0.02 * jax.random.normal(jax.random.key(i), x.shape, x.dtype)  # noqa: E731
    leaves, treedef = jax.tree.flatten(ref)
    ref = jax.tree.unflatten(treedef, [noise(i, x) for i, x in enumerate(leaves)])
    batch = make_batch(model, seed=4, rewards=np.array([1.0, 0.0, 0.0, 1.0]))
    baseline = jnp.array([0.25, 0.25, 0.75, 0.75], jnp.float32)
    batch = batch.replace(baseline=baseline)
    m = np.asarray(batch.completion_mask)
    old = np.asarray(reference_logp(state.params, graphdef, batch, 1.0)[0])
    ref_lp = np.asarray(reference_logp(ref, graphdef, batch, 1.0)[0])
    token_r = -0.5 * (old - ref_lp) * m
    last = m.sum(1).astype(int) - 1
    token_r[np.arange(len(last)), last] += np.asarray(batch.rewards)
    returns = np.cumsum(token_r[:, ::-1], axis=1)[:, ::-1]  # the rewards from each token on
    want = (returns - np.asarray(baseline)[:, None]) * m
    _, _, extras = make_train_step(graphdef, tx, cfg)(state, ref, batch, jax.random.key(0))
    got = np.asarray(extras.advantages)
    assert got.shape == m.shape
    np.testing.assert_allclose(got * m, want, atol=1e-4)
    assert np.ptp(want[0, : last[0] + 1]) > 1e-3  # the tokens' advantages differ


def test_shared_backbone_critic_trains_head_and_policy_together(ckpt):
    model = q.load(ckpt)
    c = ppo.get_config()
    c.rollout.num_generations = G
    c.algorithm.lam = 1.0
    c.algorithm.use_kl_in_reward = False
    c.critic.lr = 5e-3
    c.critic.share_backbone = True  # not in configs/base.py yet: read with a default
    graphdef, tx, state, ref = init_train_state(model, c)
    assert set(state.critic_params) == {"head"}  # no second backbone
    step = make_train_step(graphdef, tx, step_config(c))
    batch = make_batch(model, seed=2, rewards=np.array([1.0, 0.0, 0.5, 2.0]))
    policy0 = _flat(state.params)
    losses = []
    for _ in range(3):
        state, metrics, _ = step(state, ref, batch, jax.random.key(0))
        losses.append(float(metrics["vf_loss"]))
        assert int(metrics["policy_updated"]) == 1
    print("\nshared-backbone value loss per step:", [round(x, 4) for x in losses])
    assert losses[-1] < losses[0]
    assert any(np.abs(a - b).max() > 0 for a, b in zip(_flat(state.params), policy0))
