"""Policy, KL, entropy and value losses (docs/algorithms.md, from #policy-loss on), against
hand values, a torch reference written the way TRL and verl write them, and batch-split /
padding properties."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxvrl import rl
from tests.tolerance import assert_reduction_close, term_scale

E2 = math.exp(2.0)


def _hand_batch():
    """Ratios r and advantages chosen so that every branch of the loss shows up.

    row 0 (A = +1): r = 1.5 -> clipped to 1.2: l = -1.2; r = 0.5 -> l = -0.5; padding
    row 1 (A = -1): r = 0.5 -> clipped to 0.8: l = 0.8; r = e^2 -> dual clip: l = 3; r = 1: 1
    row 2: empty
    """
    old = jnp.array([[-1.0, -1.0, 0.0], [-1.0, -3.0, -2.0], [0.0, 0.0, 0.0]])
    logp = old + jnp.log(jnp.array([[1.5, 0.5, 9.0], [0.5, E2, 1.0], [2.0, 2.0, 2.0]]))
    adv = jnp.array([1.0, -1.0, 5.0])
    mask = jnp.array([[1, 1, 0], [1, 1, 1], [0, 0, 0]], jnp.float32)
    return logp, old, adv, mask


# sum of losses = -1.7 + 4.8 = 3.1 over 5 tokens, 2 non-empty rows, T = 3
@pytest.mark.parametrize(
    "mode,want",
    [
        ("token-mean", 3.1 / 5),
        ("seq-mean-token-mean", (-1.7 / 2 + 4.8 / 3) / 2),
        ("seq-mean-token-sum", 3.1 / 2),
        ("seq-mean-token-sum-norm", 3.1 / (2 * 3)),
    ],
)
def test_policy_loss_hand_values(mode, want):
    logp, old, adv, mask = _hand_batch()
    kw = dict(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_dual=3.0, loss_agg_mode=mode)
    loss, metrics = rl.policy_loss(logp, old, adv, mask, **kw)
    np.testing.assert_allclose(float(loss), want, rtol=1e-6)
    adv_bt = jnp.broadcast_to(adv[:, None], (3, 3))  # [B, T] advantages: same loss
    np.testing.assert_allclose(float(rl.policy_loss(logp, old, adv_bt, mask, **kw)[0]), want, 1e-6)
    want_metrics = {
        "clip_frac": 2 / 5,
        "clip_frac_high": 1 / 5,
        "clip_frac_low": 1 / 5,
        "dual_clip_frac": 1 / 5,
        "approx_kl": -(math.log(1.5) + 2 * math.log(0.5) + 2.0) / 5,
        "approx_kl_k3": (0.5 - math.log(1.5) + 2 * (-0.5 - math.log(0.5)) + E2 - 3) / 5,
        "ratio_mean": (1.5 + 0.5 + 0.5 + E2 + 1) / 5,
    }
    for key, value in want_metrics.items():
        np.testing.assert_allclose(float(metrics[key]), value, rtol=1e-5, err_msg=key)


def test_policy_loss_token_mask_and_weights_hand_values():
    logp, old, adv, mask = _hand_batch()
    tmask = jnp.array([[1, 0, 1], [0, 1, 1], [1, 1, 1]], jnp.float32)
    # the token mask drops -0.5 and 0.8 but the denominator still counts 5 tokens
    loss, _ = rl.policy_loss(logp, old, adv, mask, token_mask=tmask)
    np.testing.assert_allclose(float(loss), (-1.2 + 3.0 + 1.0) / 5, rtol=1e-6)
    w = jnp.array([[2.0, 1.0, 7.0], [1.0, 1.0, 0.5], [3.0, 3.0, 3.0]])
    # weights enter numerator and denominator: (-2.4 - 0.5 + 0.8 + 3 + 0.5) / 5.5
    loss, _ = rl.policy_loss(logp, old, adv, mask, token_weights=w)
    np.testing.assert_allclose(float(loss), 1.4 / 5.5, rtol=1e-6)
    loss, _ = rl.policy_loss(
        logp, old, adv, mask, token_weights=w, loss_agg_mode="seq-mean-token-mean"
    )
    np.testing.assert_allclose(float(loss), ((-2.9 / 3) + (4.3 / 2.5)) / 2, rtol=1e-6)
    # a higher clip_ratio_high (DAPO 0.28) lets r = 1.5 through as 1.28
    loss, m = rl.policy_loss(logp, old, adv, mask, clip_ratio_high=0.28)
    np.testing.assert_allclose(float(loss), (-1.28 - 0.5 + 4.8) / 5, rtol=1e-6)


def test_agg_loss_empty_batch_is_zero():
    for mode in rl.losses.AGG_MODES:
        assert float(rl.agg_loss(jnp.ones((2, 3)), jnp.zeros((2, 3)), mode)) == 0.0
    with pytest.raises(ValueError, match="loss_agg_mode"):
        rl.agg_loss(jnp.ones((2, 3)), jnp.ones((2, 3)), "token-sum")


_loss = jax.jit(rl.policy_loss, static_argnames=("loss_agg_mode",))


def _random_batch(rng, b=6, t=5):
    logp = rng.normal(-1, 0.5, (b, t)).astype(np.float32)
    old = (logp + rng.normal(0, 0.4, (b, t))).astype(np.float32)
    adv = rng.normal(size=b).astype(np.float32)
    mask = (np.arange(t)[None] < rng.integers(0, t + 1, b)[:, None]).astype(np.float32)
    w = rng.uniform(0.2, 3.0, (b, t)).astype(np.float32)
    return logp, old, adv, mask, w


@settings(max_examples=25, deadline=None)
@given(
    st.sampled_from(rl.losses.AGG_MODES),
    st.sets(st.sampled_from([2, 3, 4])),
    st.booleans(),
    st.integers(0, 2**31 - 1),
)
def test_micro_batch_losses_add_up_with_global_denominator(mode, cuts, weighted, seed):
    rng = np.random.default_rng(seed)
    logp, old, adv, mask, w = _random_batch(rng)
    weights = w if weighted else None
    full, _ = _loss(logp, old, adv, mask, loss_agg_mode=mode, token_weights=weights)
    agg_mask = mask * w if weighted else mask
    den = rl.agg_denominator(jnp.asarray(agg_mask), mode)
    total = 0.0
    for idx in np.split(np.arange(6), sorted(cuts)):
        part, _ = _loss(
            logp[idx],
            old[idx],
            adv[idx],
            mask[idx],
            loss_agg_mode=mode,
            token_weights=None if weights is None else weights[idx],
            denominator=den,
        )
        total += float(part)
    # the loss terms +-A r (w) cancel: the tolerance scales with their size, not the total's
    terms = adv[:, None] * np.exp(np.abs(logp - old)) * (w if weighted else 1.0)
    assert_reduction_close(total, float(full), term_scale(terms, mask))


@settings(max_examples=15, deadline=None)
@given(st.sampled_from(rl.losses.AGG_MODES), st.integers(0, 2**31 - 1))
def test_policy_loss_padding_invariant(mode, seed):
    rng = np.random.default_rng(seed)
    logp, old, adv, mask, _ = _random_batch(rng)
    loss, metrics = _loss(logp, old, adv, mask, loss_agg_mode=mode)
    pad = lambda x, v: np.pad(x, ((0, 0), (0, 3)), constant_values=v)  # noqa: E731
    loss_p, metrics_p = _loss(
        pad(logp, 5.0), pad(old, -9.0), adv, pad(mask, 0.0), loss_agg_mode=mode
    )
    # seq-mean-token-sum-norm divides by the padded length T by definition
    scale = 8 / 5 if mode == "seq-mean-token-sum-norm" else 1.0
    terms = adv[:, None] * np.exp(np.abs(logp - old))
    assert_reduction_close(float(loss_p) * scale, float(loss), term_scale(terms, mask))
    # the metrics average log-ratios, ratios and clip indicators: terms of order one
    ratio_scale = term_scale(np.exp(np.abs(logp - old)), mask)
    for key in metrics:
        assert_reduction_close(float(metrics_p[key]), float(metrics[key]), ratio_scale, err_msg=key)


def _torch_reference(logp, old, adv, mask, ref_logp, beta, low, high, dual, loss_type):
    """GRPO/DAPO loss as TRL's GRPOTrainer writes it (dual clip as verl writes it)."""
    torch = pytest.importorskip("torch")
    t = lambda x: torch.tensor(np.asarray(x), dtype=torch.float64)  # noqa: E731
    per_token_logps = t(logp).requires_grad_(True)
    advantages, completion_mask = t(adv), t(mask)
    coef_1 = torch.exp(per_token_logps - t(old))
    coef_2 = torch.clamp(coef_1, 1 - low, 1 + high)
    per_token_loss1 = coef_1 * advantages.unsqueeze(1)
    per_token_loss2 = coef_2 * advantages.unsqueeze(1)
    per_token_loss = -torch.min(per_token_loss1, per_token_loss2)
    dual_loss = torch.min(per_token_loss, -advantages.unsqueeze(1) * dual)
    per_token_loss = torch.where(advantages.unsqueeze(1) < 0, dual_loss, per_token_loss)
    if beta:
        ref = t(ref_logp)
        per_token_kl = torch.exp(ref - per_token_logps) - (ref - per_token_logps) - 1
        per_token_loss = per_token_loss + beta * per_token_kl
    if loss_type == "grpo":
        loss = (per_token_loss * completion_mask).sum(-1) / completion_mask.sum(-1).clamp(min=1.0)
        loss = loss.mean()
    elif loss_type == "dapo":  # bnpo / dapo: global token normaliser
        loss = (per_token_loss * completion_mask).sum() / completion_mask.sum().clamp(min=1.0)
    else:  # dr_grpo
        loss = (per_token_loss * completion_mask).sum() / (
            per_token_loss.size(0) * per_token_loss.size(1)
        )
    loss.backward()
    return float(loss.detach()), per_token_logps.grad.numpy()


@pytest.mark.parametrize(
    "loss_type,mode",
    [
        ("grpo", "seq-mean-token-mean"),
        ("dapo", "token-mean"),
        ("dr_grpo", "seq-mean-token-sum-norm"),
    ],
)
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_matches_trl_style_torch_loss_and_gradient(loss_type, mode, beta):
    rng = np.random.default_rng(3)
    logp = rng.normal(-1, 0.3, (4, 5)).astype(np.float32)
    old = (logp + rng.normal(0, 0.3, (4, 5))).astype(np.float32)
    ref = (logp + rng.normal(0, 0.3, (4, 5))).astype(np.float32)
    adv = np.asarray(rl.group_advantages(jnp.array([1.0, 0.0, 0.0, 1.0]), 4))
    old[2] -= 1.5  # row 2 has A < 0 and r ~ e^1.5 > 3: the dual clip acts there
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 0, 0, 0, 0]])
    mask = mask.astype(np.float32)

    def loss_fn(lp):
        loss, _ = rl.policy_loss(
            lp,
            old,
            adv,
            mask,
            clip_ratio_low=0.2,
            clip_ratio_high=0.28,
            clip_ratio_dual=3.0,
            loss_agg_mode=mode,
        )
        kl = rl.agg_loss(rl.kl_penalty(lp, ref, "low_var_kl"), mask, mode)
        return loss + beta * kl

    loss, grad = jax.jit(jax.value_and_grad(loss_fn))(jnp.asarray(logp))
    _, metrics = rl.policy_loss(logp, old, adv, mask, clip_ratio_high=0.28)
    assert float(metrics["dual_clip_frac"]) > 0 and float(metrics["clip_frac"]) > 0
    want, want_grad = _torch_reference(logp, old, adv, mask, ref, beta, 0.2, 0.28, 3.0, loss_type)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-4, atol=1e-7)
    assert np.abs(want_grad).sum() > 0


def test_kl_kinds_hand_values():
    logp = jnp.array([-1.0, -2.0, 0.0, -40.0])
    ref = jnp.array([-1.5, -1.0, -30.0, 0.0])
    # x = 0.5, -1, 30, -40
    np.testing.assert_allclose(rl.kl_penalty(logp, ref, "kl"), [0.5, -1, 30, -40], rtol=1e-6)
    np.testing.assert_allclose(rl.kl_penalty(logp, ref, "abs"), [0.5, 1, 30, 40], rtol=1e-6)
    np.testing.assert_allclose(rl.kl_penalty(logp, ref, "mse"), [0.125, 0.5, 450, 800], rtol=1e-6)
    # e^-0.5 + 0.5 - 1 = 0.1065307; e^1 - 2 = 0.7182818; x = 30: exponent -20: 19 -> clip 10;
    # x = -40: exponent clamped to 20: e^20 - 21 -> clip 10
    low = rl.kl_penalty(logp, ref, "low_var_kl")
    np.testing.assert_allclose(low, [0.1065307, 0.7182818, 10.0, 10.0], rtol=1e-6)
    with pytest.raises(ValueError, match="KL kind"):
        rl.kl_penalty(logp, ref, "js")


def test_kl_in_reward_hand_values():
    logp = jnp.array([[-1.0, -1.0, 0.0], [-2.0, 0.0, 0.0]])
    ref = jnp.array([[-1.5, -0.5, 0.0], [-1.0, 0.0, 0.0]])
    mask = jnp.array([[1, 1, 0], [1, 0, 0]])
    tok, m = rl.kl_in_reward(jnp.array([1.0, 2.0]), logp, ref, mask, beta=0.1, kind="kl")
    # KL_t = 0.5, -0.5 | -1; reward on the last completion token
    np.testing.assert_allclose(np.asarray(tok), [[-0.05, 1.05, 0.0], [2.1, 0.0, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(m["seq_rewards"]), [1.0, 2.1], rtol=1e-6)
    np.testing.assert_allclose(float(m["kl"]), (0.0 + -1.0) / 2, rtol=1e-6)
    # a row left out of the loss (truncated, mask_truncated_completions) keeps its reward in
    # the group's sums: no token pays KL, none carries the reward
    tok, m = rl.kl_in_reward(
        jnp.array([1.0, -1.0]), logp, ref, jnp.array([[1, 1, 0], [0, 0, 0]]), 0.1
    )
    np.testing.assert_allclose(np.asarray(tok)[1], [0.0, 0.0, 0.0])
    np.testing.assert_allclose(np.asarray(m["seq_rewards"]), [1.0, -1.0], rtol=1e-6)


def test_rollout_correction_hand_values():
    old = jnp.array([[-1.0, -2.0, 0.0], [-1.0, -1.0, -1.0]])
    # recomputed - sampler: 0.5, -0.25, (padding) | 1.0, 0.5, 0.0
    sampler = old - jnp.array([[0.5, -0.25, 7.0], [1.0, 0.5, 0.0]])
    mask = jnp.array([[1, 1, 0], [1, 1, 1]])
    w, m = rl.rollout_correction(old, sampler, mask)
    assert w is None
    np.testing.assert_allclose(float(m["logprob_abs_diff_mean"]), 2.25 / 5, rtol=1e-6)
    np.testing.assert_allclose(float(m["logprob_abs_diff_max"]), 1.0, rtol=1e-6)
    w, m = rl.rollout_correction(old, sampler, mask, "token", 2.0)
    e = math.exp
    want = [[e(0.5), e(-0.25), 0.0], [2.0, e(0.5), 1.0]]  # e^1 truncated to 2
    np.testing.assert_allclose(np.asarray(w), want, rtol=1e-6)
    np.testing.assert_allclose(float(m["is_weight_mean"]), np.sum(want) / 5, rtol=1e-6)
    w, _ = rl.rollout_correction(old, sampler, mask, "sequence", 2.0)
    # row sums 0.25 and 1.5: e^0.25 and e^1.5 -> 2 on every token of the row
    np.testing.assert_allclose(np.asarray(w), [[e(0.25)] * 2 + [0.0], [2.0] * 3], rtol=1e-6)


def test_entropy_terms_hand_values():
    h = jnp.array([[1.0, 3.0, 9.0], [2.0, 9.0, 9.0]])
    mask = jnp.array([[1, 1, 0], [1, 0, 0]])
    np.testing.assert_allclose(float(rl.entropy_bonus(h, mask, "token-mean", 0.01)), -0.02)
    logp = -h
    pen = rl.entropy_penalty(logp, mask, "seq-mean-token-mean", coef=0.06)
    np.testing.assert_allclose(float(pen), 0.06 * (2.0 + 2.0) / 2, rtol=1e-6)


def test_value_loss_hand_values():
    v = jnp.array([[1.0, 0.0, 5.0]])
    old = jnp.array([[0.5, 0.1, 0.0]])
    ret = jnp.array([[0.0, 1.0, 0.0]])
    loss, m = rl.value_loss(v, old, ret, jnp.array([[1, 1, 0]]), clip_range=0.2)
    # t0: (1 - 0)^2 = 1 vs clip(1, 0.3, 0.7) = 0.7: 0.49 -> 1
    # t1: (0 - 1)^2 = 1 vs clip(0, -0.1, 0.3) = 0: 1 -> 1 (not larger)
    np.testing.assert_allclose(float(loss), 0.5 * 1.0, rtol=1e-6)
    assert float(m["vf_clip_frac"]) == 0.0
    loss, m = rl.value_loss(
        jnp.array([[0.0]]), jnp.array([[1.0]]), jnp.array([[0.0]]), jnp.ones((1, 1))
    )
    # clip(0, 0.8, 1.2) = 0.8: 0.64 > 0
    np.testing.assert_allclose(float(loss), 0.32, rtol=1e-6)
    assert float(m["vf_clip_frac"]) == 1.0


def test_kl_controllers():
    ctl = rl.AdaptiveKLController(value=0.1, target=0.05, horizon=100)
    assert math.isclose(ctl.update(0.2, 10), 0.1 * 1.02)  # e clipped to +0.2
    assert math.isclose(ctl.update(0.04, 10), 0.1 * 1.02 * 0.98)  # e = -0.2
    assert math.isclose(ctl.update(0.055, 10), 0.1 * 1.02 * 0.98 * 1.01)  # e = 0.1
    assert math.isclose(rl.adaptive_kl_coef(0.5, 0.05, 0.05, 10, 3), 0.5)
    assert rl.FixedKLController(0.3).update(5.0, 1) == 0.3
