"""Advantage estimators (docs/algorithms.md#advantages)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxvrl import rl

R = jnp.array([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 3.0, 3.0, 3.0])


def test_grpo_hand_values():
    # group [1, 0, 0]: mean 1/3, Bessel std sqrt(1/3) = 0.5773503; (2/3) / (0.5773503 + 1e-6)
    a = np.asarray(rl.group_advantages(R, 3))
    np.testing.assert_allclose(
        a, [1.1546985, -0.5773493, -0.5773493, -1.1546985, 0.5773493, 0.5773493, 0, 0, 0], rtol=1e-6
    )


def test_dr_grpo_rloo_remax_hand_values():
    dr = np.asarray(rl.group_advantages(R, 3, norm_by_std=False))
    np.testing.assert_allclose(
        dr, [2 / 3, -1 / 3, -1 / 3, -2 / 3, 1 / 3, 1 / 3, 0, 0, 0], rtol=1e-6
    )
    rloo = np.asarray(rl.group_advantages(R, 3, estimator="rloo"))
    np.testing.assert_allclose(rloo, [1, -0.5, -0.5, -1, 0.5, 0.5, 0, 0, 0], rtol=1e-6)
    per_prompt = rl.group_advantages(R, 3, estimator="remax", baseline=jnp.array([0.5, 2.0, 3.0]))
    np.testing.assert_allclose(np.asarray(per_prompt), [0.5, -0.5, -0.5, -1, 0, 0, 0, 0, 0])
    per_row = rl.group_advantages(R, 3, estimator="remax", baseline=jnp.full(9, 1.0))
    np.testing.assert_allclose(np.asarray(per_row), np.asarray(R) - 1.0)


@pytest.mark.parametrize("group", [2, 6, 8, 16])
def test_a_group_of_equal_rewards_has_zero_advantage(group):
    """Equal rewards that float32 cannot hold exactly (a weight of 0.1, ...): their float32
    mean is off by a rounding step, which grpo's division by a std of ~1e-7 made ~0.3."""
    values = np.round(np.arange(-5.0, 5.05, 0.1), 1)
    r = jnp.asarray(np.repeat(values, group), jnp.float32)
    for kw in ({}, {"norm_by_std": False}, {"estimator": "rloo"}):
        np.testing.assert_array_equal(np.asarray(rl.group_advantages(r, group, **kw)), 0.0)
    # and groups that differ keep their values (a shift of every reward changes nothing)
    mixed = np.asarray(rl.group_advantages(R + 5.3, 3))
    np.testing.assert_allclose(mixed, np.asarray(rl.group_advantages(R, 3)), atol=3e-6)


def test_group_of_one_and_errors():
    r = jnp.array([1.0, 5.0])
    for kw in ({}, {"norm_by_std": False}, {"estimator": "rloo"}):
        np.testing.assert_array_equal(np.asarray(rl.group_advantages(r, 1, **kw)), 0.0)
    with pytest.raises(ValueError, match="baseline"):
        rl.group_advantages(R, 3, estimator="remax")
    with pytest.raises(ValueError, match="mask"):
        rl.group_advantages(R, 3, estimator="reinforce_plus_plus")
    with pytest.raises(ValueError, match="gae"):
        rl.group_advantages(R, 3, estimator="gae")
    with pytest.raises(ValueError, match="groups"):
        rl.group_advantages(R, 4)


def test_reinforce_plus_plus_hand_values():
    r = jnp.array([1.0, -1.0])
    mask = jnp.array([[1, 1, 1], [1, 1, 0]])
    out = np.asarray(rl.group_advantages(r, 2, "reinforce_plus_plus", mask=mask, gamma=0.5))
    # returns: 0.25, 0.5, 1 | -0.5, -1; mean 0.05; Bessel var 2.55 / 4 = 0.6375
    raw = np.array([0.25, 0.5, 1.0, -0.5, -1.0])
    want = (raw - 0.05) / np.sqrt(0.6375 + 1e-8)
    np.testing.assert_allclose(out[np.asarray(mask) > 0], want, rtol=1e-6)
    assert out[1, 2] == 0.0
    np.testing.assert_allclose(want[2], 1.1898259, rtol=1e-6)


def test_discounted_returns_and_last_token():
    mask = jnp.array([[1, 1, 0, 0], [0, 0, 0, 0]])
    tok = rl.last_token_rewards(jnp.array([2.0, 3.0]), mask)
    np.testing.assert_array_equal(np.asarray(tok), [[0, 2, 0, 0], [0, 0, 0, 0]])
    ret = rl.discounted_returns(jnp.array([[1.0, 2.0, 5.0, 5.0]]), jnp.array([[1, 1, 0, 0]]), 0.9)
    np.testing.assert_allclose(np.asarray(ret), [[1 + 0.9 * 2, 2, 0, 0]], rtol=1e-6)


def test_gae_hand_values():
    rewards = jnp.array([[0.0, 0.0, 1.0, 7.0]])
    values = jnp.array([[0.5, 0.2, 0.4, 9.0]])  # the padded 9.0 and 7.0 are never read
    mask = jnp.array([[1, 1, 1, 0]])
    gamma, lam = 0.9, 0.8
    # V after the last completion token is 0
    d = [0.0 + gamma * 0.2 - 0.5, 0.0 + gamma * 0.4 - 0.2, 1.0 - 0.4]  # -0.32, 0.16, 0.6
    a2 = d[2]
    a1 = d[1] + gamma * lam * a2  # 0.592
    a0 = d[0] + gamma * lam * a1  # 0.10624
    raw = np.array([a0, a1, a2])
    np.testing.assert_allclose(raw, [0.10624, 0.592, 0.6], rtol=1e-12)
    adv, ret = rl.gae(rewards, values, mask, gamma, lam)
    np.testing.assert_allclose(np.asarray(ret)[0], [0.60624, 0.792, 1.0, 0.0], rtol=1e-6)
    white = (raw - raw.mean()) / np.sqrt(raw.var(ddof=1) + 1e-8)
    np.testing.assert_allclose(np.asarray(adv)[0, :3], white, rtol=1e-5)
    assert float(adv[0, 3]) == 0.0
    # gamma = lam = 1, constant V: A = [0.5] * 3, returns 1, whitened to 0
    adv, ret = rl.gae(jnp.array([[0.0, 0.0, 1.0]]), jnp.full((1, 3), 0.5), jnp.ones((1, 3)), 1, 1)
    np.testing.assert_allclose(np.asarray(ret), [[1.0, 1.0, 1.0]], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(adv), 0.0, atol=1e-6)


def test_gae_padding_invariant():
    rng = np.random.default_rng(0)
    r, v = rng.normal(size=(3, 4)), rng.normal(size=(3, 4))
    mask = np.array([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], np.float32)
    adv, ret = rl.gae(*map(jnp.asarray, (r, v, mask)), 0.95, 0.9)
    pad = lambda x: jnp.asarray(np.pad(x, ((0, 0), (0, 2)), constant_values=3.0))  # noqa: E731
    adv_p, ret_p = rl.gae(pad(r), pad(v), jnp.asarray(np.pad(mask, ((0, 0), (0, 2)))), 0.95, 0.9)
    np.testing.assert_allclose(np.asarray(adv_p)[:, :4], np.asarray(adv), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(ret_p)[:, :4], np.asarray(ret), rtol=1e-5, atol=1e-6)


def test_whiten():
    x = jnp.array([[1.0, 2.0, 3.0, 100.0]])
    m = jnp.array([[1, 1, 1, 0]])
    np.testing.assert_allclose(np.asarray(rl.whiten(x, m)), [[-1, 0, 1, 0]], rtol=1e-6)
    kept = rl.whiten(x, m, shift_mean=False)
    np.testing.assert_allclose(np.asarray(kept), [[1, 2, 3, 0]], rtol=1e-6)
