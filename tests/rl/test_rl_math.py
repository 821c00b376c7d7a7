"""RL math against hand-computed values and independent formulas (SPEC sections 2-5)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxvrl import rl


def test_visual_dependency_hand_values():
    logp = jnp.array([[-1.0, -2.0, -0.5, 0.0]])
    aug = jnp.array([[-1.5, -1.0, -30.0, 0.0]])
    mask = jnp.array([[1, 1, 1, 0]])
    s = np.asarray(rl.visual_dependency(aug, logp, mask))
    d = np.array([-0.5, 1.0, -20.0])  # third clipped to -20
    expect = np.clip(np.exp(d) - d - 1, 0, 10)
    np.testing.assert_allclose(s[0, :3], expect, rtol=1e-6)
    assert s[0, 2] == 10.0 and s[0, 3] == 0.0


def test_top_p_mask_exact_k_ties_to_earlier():
    scores = jnp.array([[0.5, 0.9, 0.5, 0.5, 0.1, 7.0], [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]])
    mask = jnp.array([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]])
    out = np.asarray(rl.top_p_token_mask(scores, mask, 0.5))
    # row 0: n=5, k=3 -> 0.9, then two of the tied 0.5s, earliest first; padding (7.0) never.
    np.testing.assert_array_equal(out[0], [1, 1, 1, 0, 0, 0])
    # row 1: n=4, k=2 -> the two earliest of four ties
    np.testing.assert_array_equal(out[1], [1, 1, 0, 0, 0, 0])
    # ceil(10 * 0.3) = 3, not 4 from 3.0000000000000004
    ten = rl.top_p_token_mask(jnp.arange(10.0)[None], jnp.ones((1, 10)), 0.3)
    assert int(ten.sum()) == 3


@settings(max_examples=25, deadline=None)
@given(
    st.integers(1, 4),
    st.integers(1, 12),
    st.floats(0.05, 1.0),
    st.integers(0, 5),
    st.integers(0, 2**31 - 1),
)
def test_top_p_mask_properties(b, t, top_p, extra_pad, seed):
    rng = np.random.default_rng(seed)
    scores = rng.integers(0, 4, (b, t)).astype(np.float32)  # many ties
    lengths = rng.integers(0, t + 1, b)
    mask = (np.arange(t)[None] < lengths[:, None]).astype(np.float32)
    out = np.asarray(rl.top_p_token_mask(jnp.asarray(scores), jnp.asarray(mask), top_p))
    k = np.ceil(lengths * top_p - 1e-6).astype(int)
    np.testing.assert_array_equal(out.sum(1), k)
    assert np.all(out <= mask)
    # the kept tokens are a top-k by score with ties to earlier positions
    for i in range(b):
        order = sorted(range(lengths[i]), key=lambda j: (-scores[i, j], j))[: k[i]]
        assert set(np.flatnonzero(out[i])) == set(order)
    # padding columns change nothing
    padded = rl.top_p_token_mask(
        jnp.pad(jnp.asarray(scores), ((0, 0), (0, extra_pad)), constant_values=9.0),
        jnp.pad(jnp.asarray(mask), ((0, 0), (0, extra_pad))),
        top_p,
    )
    np.testing.assert_array_equal(np.asarray(padded)[:, :t], out)


def test_entropy_mask_batch_scope():
    ent = jnp.array([[3.0, 0.0, 1.0], [2.0, 2.5, 0.0]])
    mask = jnp.array([[1, 1, 1], [1, 1, 0]])
    out = np.asarray(rl.entropy_token_mask(ent, mask, 0.4, scope="batch"))
    # 5 tokens, k = 2: 3.0 and 2.5
    np.testing.assert_array_equal(out, [[1, 0, 0], [0, 1, 0]])
    seq = np.asarray(rl.entropy_token_mask(ent, mask, 0.4, scope="sequence"))
    np.testing.assert_array_equal(seq, [[1, 0, 1], [0, 1, 0]])  # k = 2 and 1
    with pytest.raises(ValueError, match="scope"):
        rl.entropy_token_mask(ent, mask, 0.4, scope="tokens")


def test_trajectory_scaling_hand_values_and_mean_one():
    scores = jnp.array([[1.0, 3.0], [0.0, 0.0], [4.0, 0.0]])
    mask = jnp.array([[1, 1], [1, 1], [1, 0]])
    alpha = np.asarray(rl.trajectory_scaling(scores, mask, 0.8))
    s = np.array([2.0, 0.0, 4.0])
    n = (s - 0) / 4
    mu = n.mean()
    bmax = 0.8 + 0.2 / mu
    np.testing.assert_allclose(alpha, 0.8 + (bmax - 0.8) * n, rtol=1e-6)
    assert abs(alpha.mean() - 1) < 1e-6
    flat = rl.trajectory_scaling(jnp.ones((3, 2)), jnp.ones((3, 2)), 0.8)
    np.testing.assert_array_equal(np.asarray(flat), 1.0)


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 8), st.floats(0.0, 0.99), st.integers(0, 2**31 - 1))
def test_trajectory_scaling_mean_is_one(b, beta_min, seed):
    rng = np.random.default_rng(seed)
    scores = jnp.asarray(rng.exponential(size=(b, 5)).astype(np.float32))
    alpha = np.asarray(rl.trajectory_scaling(scores, jnp.ones((b, 5)), beta_min))
    assert abs(alpha.mean() - 1.0) < 1e-4
    assert alpha.min() >= beta_min - 1e-5


def test_group_advantages():
    r = jnp.array([1.0, 0.0, 0.0, 1.0, 2.0, 2.0])
    grpo = np.asarray(rl.group_advantages(r, 3))
    g = np.array([[1, 0, 0], [1, 2, 2]], float)
    expect = (g - g.mean(1, keepdims=True)) / (g.std(1, ddof=1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(grpo, expect.reshape(-1), rtol=1e-5)
    dr = np.asarray(rl.group_advantages(r, 3, norm_by_std=False))
    np.testing.assert_allclose(dr, (g - g.mean(1, keepdims=True)).reshape(-1), rtol=1e-6)
    rloo = np.asarray(rl.group_advantages(r, 3, estimator="rloo"))
    np.testing.assert_allclose(rloo, [1, -0.5, -0.5, -1, 0.5, 0.5], rtol=1e-6)
    remax = rl.group_advantages(r, 3, estimator="remax", baseline=jnp.full(6, 0.5))
    np.testing.assert_allclose(np.asarray(remax), np.asarray(r) - 0.5)
    with pytest.raises(ValueError):
        rl.group_advantages(r, 3, estimator="ppo")


def test_gae_hand_values():
    rewards = jnp.array([[0.0, 0.0, 1.0, 0.0]])
    values = jnp.array([[0.5, 0.2, 0.4, 9.0]])
    mask = jnp.array([[1, 1, 1, 0]])
    gamma, lam = 0.9, 0.8
    d2 = 1.0 + 0 - 0.4
    d1 = 0.0 + gamma * 0.4 - 0.2
    d0 = 0.0 + gamma * 0.2 - 0.5
    a2 = d2
    a1 = d1 + gamma * lam * a2
    a0 = d0 + gamma * lam * a1
    adv_raw = np.array([a0, a1, a2])
    adv, ret = rl.gae(rewards, values, mask, gamma, lam)
    np.testing.assert_allclose(np.asarray(ret)[0, :3], adv_raw + [0.5, 0.2, 0.4], rtol=1e-6)
    white = (adv_raw - adv_raw.mean()) / np.sqrt(adv_raw.var(ddof=1) + 1e-8)
    np.testing.assert_allclose(np.asarray(adv)[0, :3], white, rtol=1e-5)
    assert float(adv[0, 3]) == 0.0


def test_reinforce_plus_plus():
    r = jnp.array([1.0, -1.0])
    mask = jnp.array([[1, 1, 1], [1, 1, 0]])
    out = np.asarray(rl.reinforce_plus_plus(r, mask, gamma=0.5))
    raw = np.array([0.25, 0.5, 1.0, -0.5, -1.0])
    white = (raw - raw.mean()) / np.sqrt(raw.var(ddof=1) + 1e-8)
    np.testing.assert_allclose(out[mask > 0], white, rtol=1e-5)


def _loss_numpy(logp, old, adv, mask, low, high, dual, mode, tmask=None, w=None):
    ratio = np.exp(np.clip(logp - old, -20, 20))
    a = adv[:, None] if adv.ndim == 1 else adv
    lt = np.maximum(-a * ratio, -a * np.clip(ratio, 1 - low, 1 + high))
    lt = np.where(a < 0, np.minimum(lt, -dual * a), lt)
    if tmask is not None:
        lt = lt * tmask
    m = mask * (1 if w is None else w)
    rows = mask.sum(1) > 0
    if mode == "token-mean":
        return (lt * m).sum() / m.sum()
    if mode == "seq-mean-token-mean":
        return ((lt * m).sum(1)[rows] / m.sum(1)[rows]).mean()
    if mode == "seq-mean-token-sum":
        return (lt * m).sum(1)[rows].mean()
    return (lt * m).sum() / (rows.sum() * mask.shape[1])


@pytest.mark.parametrize("mode", rl.losses.AGG_MODES)
def test_policy_loss_modes(mode):
    rng = np.random.default_rng(0)
    logp = rng.normal(-1, 0.5, (4, 6)).astype(np.float32)
    old = (logp + rng.normal(0, 0.4, (4, 6))).astype(np.float32)
    adv = np.array([1.5, -2.0, 0.3, -0.1], np.float32)
    mask = np.ones((4, 6), np.float32)
    mask[1, 4:] = 0
    mask[3, :] = 0  # an empty row is not counted
    tmask = (rng.random((4, 6)) > 0.5).astype(np.float32)
    w = rng.uniform(0.2, 3, (4, 6)).astype(np.float32)
    for kw in ({}, {"token_mask": tmask}, {"token_weights": w}):
        loss, metrics = rl.policy_loss(
            jnp.asarray(logp),
            jnp.asarray(old),
            jnp.asarray(adv),
            jnp.asarray(mask),
            clip_ratio_low=0.2,
            clip_ratio_high=0.28,
            clip_ratio_dual=3.0,
            loss_agg_mode=mode,
            **{k: jnp.asarray(v) for k, v in kw.items()},
        )
        ref = _loss_numpy(
            logp,
            old,
            adv,
            mask,
            0.2,
            0.28,
            3.0,
            mode,
            kw.get("token_mask"),
            kw.get("token_weights"),
        )
        np.testing.assert_allclose(float(loss), ref, rtol=1e-5)
        assert 0 <= float(metrics["clip_frac"]) <= 1


@settings(max_examples=20, deadline=None)
@given(st.integers(2, 6), st.integers(0, 2**31 - 1))
def test_token_mean_split_invariance(split, seed):
    rng = np.random.default_rng(seed)
    b = 6
    logp = rng.normal(-1, 0.5, (b, 5)).astype(np.float32)
    old = (logp + rng.normal(0, 0.3, (b, 5))).astype(np.float32)
    adv = rng.normal(size=b).astype(np.float32)
    mask = (np.arange(5)[None] < rng.integers(0, 6, b)[:, None]).astype(np.float32)
    if mask.sum() == 0:
        return
    full, _ = rl.policy_loss(*map(jnp.asarray, (logp, old, adv, mask)))
    total = 0.0
    for idx in np.array_split(np.arange(b), split):
        part, _ = rl.policy_loss(*map(jnp.asarray, (logp[idx], old[idx], adv[idx], mask[idx])))
        total += float(part) * mask[idx].sum() / mask.sum()
    np.testing.assert_allclose(total, float(full), rtol=1e-5, atol=1e-7)


def test_trl_style_torch_reference():
    """GRPO/DAPO per-token loss written as TRL does it, in torch, on the same inputs."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    logp = rng.normal(-1, 0.3, (3, 4)).astype(np.float32)
    old = (logp + rng.normal(0, 0.2, (3, 4))).astype(np.float32)
    adv = rng.normal(size=3).astype(np.float32)
    mask = np.array([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]], np.float32)
    t = lambda x: torch.tensor(x)  # noqa: E731
    coef_1 = torch.exp(t(logp) - t(old))
    coef_2 = torch.clamp(coef_1, 1 - 0.2, 1 + 0.28)
    per_token = -torch.min(coef_1 * t(adv)[:, None], coef_2 * t(adv)[:, None])
    dapo = (per_token * t(mask)).sum() / t(mask).sum()
    grpo = ((per_token * t(mask)).sum(-1) / t(mask).sum(-1)).mean()
    for mode, ref in (("token-mean", dapo), ("seq-mean-token-mean", grpo)):
        loss, _ = rl.policy_loss(
            *map(jnp.asarray, (logp, old, adv, mask)),
            clip_ratio_low=0.2,
            clip_ratio_high=0.28,
            clip_ratio_dual=1e9,
            loss_agg_mode=mode,
        )
        np.testing.assert_allclose(float(loss), float(ref), rtol=1e-5)


def test_kl_kinds():
    logp = jnp.array([-1.0, -2.0, 0.0])
    ref = jnp.array([-1.5, -1.0, -30.0])
    x = np.array([0.5, -1.0, 30.0])
    np.testing.assert_allclose(rl.kl_penalty(logp, ref, "kl"), x, rtol=1e-6)
    np.testing.assert_allclose(rl.kl_penalty(logp, ref, "abs"), np.abs(x), rtol=1e-6)
    np.testing.assert_allclose(rl.kl_penalty(logp, ref, "mse"), x**2 / 2, rtol=1e-6)
    e = np.clip(-x, -20, 20)
    np.testing.assert_allclose(
        rl.kl_penalty(logp, ref, "low_var_kl"), np.clip(np.exp(e) - e - 1, -10, 10), rtol=1e-5
    )


def test_kl_controllers_and_value_loss():
    ctl = rl.AdaptiveKLController(value=0.1, target=0.05, horizon=100)
    assert math.isclose(ctl.update(0.2, 10), 0.1 * (1 + 0.2 * 10 / 100))
    assert math.isclose(ctl.update(0.04, 10), 0.1 * 1.02 * (1 + (-0.2) * 10 / 100))
    assert rl.FixedKLController(0.3).update(5.0, 1) == 0.3
    v = jnp.array([[1.0, 0.0]])
    old = jnp.array([[0.5, 0.1]])
    ret = jnp.array([[0.0, 1.0]])
    loss, m = rl.value_loss(v, old, ret, jnp.ones((1, 2)), clip_range=0.2)
    l1 = np.array([1.0, 1.0])
    l2 = np.array([0.7**2, (0.0 - 1) ** 2])
    np.testing.assert_allclose(float(loss), 0.5 * np.maximum(l1, l2).mean(), rtol=1e-6)


def test_vgr_weights_and_mdi_reward():
    vgr = jnp.array([[1.0, 4.0, 0.25, 9.0], [2.0, 2.0, 2.0, 2.0]])
    mask = jnp.array([[1, 1, 1, 0], [1, 1, 0, 0]])
    w = np.asarray(
        rl.vgr_token_weights(
            vgr, mask, clip=(0.2, 3.0), eps=0.0, has_image=jnp.array([True, False])
        )
    )
    raw = np.array([1.0, 0.25, 4.0])
    np.testing.assert_allclose(w[0, :3], np.clip(raw / raw.mean(), 0.2, 3.0), rtol=1e-5)
    assert w[0, 3] == 0
    np.testing.assert_array_equal(w[1], [1, 1, 0, 0])
    sm = np.asarray(rl.vgr_token_weights(vgr, mask, smooth_sigma=1.0, eps=0.0))
    assert sm[0, 0] > w[0, 0] and sm[0, 2] < w[0, 2]  # smoothing pulls towards neighbours
    r = np.asarray(rl.mdi_balance_reward(jnp.array([1.0, 2.0, 0.5, 1.5, np.nan, 0.0, 8.0])))
    bal = 1 - abs(math.log(1.5)) / math.log(2)
    np.testing.assert_allclose(r, [1, -1, -1, 2 * bal - 1, 0, 0, -1], rtol=1e-6)


def test_attention_metrics_layer_sets():
    assert list(rl.layer_indices(7, "early")) == [0, 1, 2]
    assert list(rl.layer_indices(7, "middle")) == [3, 4]
    assert list(rl.layer_indices(7, "late")) == [5, 6]
    assert list(rl.layer_indices(7, "all", last_k=2)) == [5, 6]
    L, B, T = 3, 2, 2
    a_v = jnp.full((L, B, T), 0.2)
    a_x = jnp.full((L, B, T), 0.4)
    out = rl.attention_metrics(a_v, a_x, jnp.array([10, 0]), jnp.array([5, 5]), jnp.ones((B, T)))
    np.testing.assert_allclose(float(out["mdi"][0]), (0.4 / 5) / (0.2 / 10 + 1e-6), rtol=1e-5)
    assert np.isnan(float(out["mdi"][1]))  # no image: no statistic, reward neutral
    np.testing.assert_allclose(float(out["aei_vision"][0]), (0.2 / 0.6) / (10 / 15), rtol=1e-5)


def test_everything_jits_with_static_shapes():
    b, t = 4, 6
    x = jnp.ones((b, t))
    fns = [
        lambda: rl.visual_dependency(x, x, x),
        lambda: rl.top_p_token_mask(x, x, 0.2),
        lambda: rl.entropy_token_mask(x, x, 0.2, "batch"),
        lambda: rl.trajectory_scaling(x, x, 0.8),
        lambda: rl.group_advantages(x[:, 0], 2),
        lambda: rl.gae(x, x, x, 0.9, 0.9),
        lambda: rl.policy_loss(x, x, x[:, 0], x)[0],
        lambda: rl.vgr_token_weights(x, x, smooth_sigma=1.0),
        lambda: rl.attention_metrics(x[None], x[None], x[:, 0], x[:, 0], x)["mdi"],
    ]
    for f in fns:
        jax.jit(f)()
