"""Attention metrics, VGR token weights, MDI balance reward
(docs/algorithms.md#attention-metrics-vgr-mdi-aei)."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from jaxvrl import rl


def test_layer_sets():
    assert list(rl.layer_indices(7, "early")) == [0, 1, 2]
    assert list(rl.layer_indices(7, "middle")) == [3, 4]
    assert list(rl.layer_indices(7, "late")) == [5, 6]
    assert list(rl.layer_indices(6, "middle")) == [2, 3]
    assert list(rl.layer_indices(7, "all")) == list(range(7))
    assert list(rl.layer_indices(7, "early", last_k=2)) == [5, 6]
    assert list(rl.layer_indices(2, "late")) == [1]  # empty third -> last layer
    assert list(rl.layer_indices(3, "all", last_k=9)) == [0, 1, 2]
    with pytest.raises(ValueError, match="layer set"):
        rl.layer_indices(4, "first")


def _masses():
    # [L=3, B=2, T=2]; row 1 has no image (n_vision = 0)
    a_v = np.zeros((3, 2, 2), np.float32)
    a_x = np.zeros((3, 2, 2), np.float32)
    a_v[:, 0] = [[0.2, 0.4], [0.4, 0.4], [0.6, 0.1]]
    a_x[:, 0] = [[0.4, 0.2], [0.2, 0.2], [0.3, 0.5]]
    a_v[:, 1], a_x[:, 1] = 0.0, 0.5
    return jnp.asarray(a_v), jnp.asarray(a_x), jnp.array([10, 0]), jnp.array([5, 7])


def test_attention_metrics_hand_values():
    a_v, a_x, nv, nx = _masses()
    out = rl.attention_metrics(a_v, a_x, nv, nx, jnp.ones((2, 2)), eps=0.0)
    # all layers: A_V = 0.4, 0.3; A_X = 0.3, 0.3; VGR = (A_X / 5) / (A_V / 10)
    np.testing.assert_allclose(np.asarray(out["vgr"][0]), [1.5, 2.0], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(out["vgr"][1]), [1.0, 1.0])  # no image: neutral
    np.testing.assert_allclose(float(out["mdi"][0]), 2 * 0.3 / 0.35, rtol=1e-6)
    np.testing.assert_allclose(float(out["mdi_early"][0]), 2.0, rtol=1e-6)
    np.testing.assert_allclose(float(out["mdi_middle"][0]), 1.0, rtol=1e-6)
    np.testing.assert_allclose(float(out["mdi_late"][0]), 2 * 0.4 / 0.35, rtol=1e-6)
    # AEI: attention share 0.35 / 0.65 over token share 10 / 15 (text: 0.3 / 0.65 over 5 / 15)
    np.testing.assert_allclose(float(out["aei_vision"][0]), 0.8076923, rtol=1e-6)
    np.testing.assert_allclose(float(out["aei_text"][0]), 1.3846154, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(out["attn_vision"]), [0.35, 0.0], rtol=1e-6)
    for key in ("mdi", "mdi_early", "aei_vision", "aei_text"):
        assert np.isnan(float(out[key][1])), key  # no statistic without an image
    last = rl.attention_metrics(a_v, a_x, nv, nx, jnp.array([[1, 0], [1, 1]]), last_k=1, eps=0.0)
    np.testing.assert_allclose(np.asarray(last["vgr"][0]), [1.0, 10.0], rtol=1e-6)
    np.testing.assert_allclose(float(last["mdi"][0]), 1.0, rtol=1e-6)  # only t = 0 counts
    mid = rl.attention_metrics(a_v, a_x, nv, nx, jnp.ones((2, 2)), layer_set="middle", eps=0.0)
    np.testing.assert_allclose(np.asarray(mid["vgr"][0]), [1.0, 1.0], rtol=1e-6)
    # the default eps = 1e-6 only moves the denominator
    dflt = rl.attention_metrics(a_v, a_x, nv, nx, jnp.ones((2, 2)))
    np.testing.assert_allclose(float(dflt["mdi"][0]), 0.06 / (0.035 + 1e-6), rtol=1e-6)


def test_vgr_token_weights_hand_values():
    vgr = jnp.array([[1.0, 4.0, 0.25, 9.0], [2.0, 2.0, 2.0, 2.0]])
    mask = jnp.array([[1, 1, 1, 0], [1, 1, 0, 0]])
    has_image = jnp.array([True, False])
    w = np.asarray(rl.vgr_token_weights(vgr, mask, eps=0.0, has_image=has_image))
    # 1 / VGR = 1, 0.25, 4; mean 1.75; / mean = 0.5714286, 0.1428571, 2.2857143; clip at 0.2
    np.testing.assert_allclose(w[0], [4 / 7, 0.2, 16 / 7, 0.0], rtol=1e-6)
    np.testing.assert_array_equal(w[1], [1, 1, 0, 0])  # no image: 1 (0 on padding)
    sm = np.asarray(rl.vgr_token_weights(vgr, mask, smooth_sigma=1.0, eps=0.0))
    k1, k2 = math.exp(-0.5), math.exp(-2.0)  # kernel at distance 1, 2 (padding excluded)
    c = np.array([4 / 7, 0.2, 16 / 7])
    want = [
        (c[0] + k1 * c[1] + k2 * c[2]) / (1 + k1 + k2),
        (k1 * c[0] + c[1] + k1 * c[2]) / (1 + 2 * k1),
        (k2 * c[0] + k1 * c[1] + c[2]) / (1 + k1 + k2),
    ]
    np.testing.assert_allclose(sm[0, :3], want, rtol=1e-6)
    assert sm[0, 3] == 0
    np.testing.assert_allclose(sm[1], [1, 1, 0, 0], rtol=1e-6)  # constant rows stay constant
    narrow = np.asarray(rl.vgr_token_weights(vgr, mask, clip=(0.5, 2.0), eps=0.0))
    np.testing.assert_allclose(narrow[0, :3], [4 / 7, 0.5, 2.0], rtol=1e-6)
    nan = rl.vgr_token_weights(jnp.array([[jnp.nan, 1.0]]), jnp.ones((1, 2)), eps=0.0)
    np.testing.assert_allclose(np.asarray(nan), [[1.0, 1.0]])


def test_vgr_weights_padding_invariant():
    vgr = jnp.array([[0.5, 2.0, 1.0, 3.0, 0.7]])
    mask = jnp.array([[1, 1, 1, 1, 0]])
    w = rl.vgr_token_weights(vgr, mask, smooth_sigma=0.8)
    wp = rl.vgr_token_weights(
        jnp.pad(vgr, ((0, 0), (0, 4)), constant_values=0.01),
        jnp.pad(mask, ((0, 0), (0, 4))),
        smooth_sigma=0.8,
    )
    np.testing.assert_allclose(np.asarray(wp)[:, :5], np.asarray(w), rtol=1e-6)


def test_mdi_balance_reward():
    mdi = jnp.array([1.0, 2.0, 0.5, 1.5, jnp.nan, 0.0, 8.0, jnp.inf, -1.0])
    r = np.asarray(rl.mdi_balance_reward(mdi))
    # balance(1.5) = 1 - ln 1.5 / ln 2 = 0.4150375 -> reward -0.169925; MDI 0 (no attention
    # on the text) is as far from balance as can be: -1; NaN, inf and negative: no statistic
    np.testing.assert_allclose(r, [1, -1, -1, -0.169925, 0, -1, -1, 0, 0], rtol=1e-5, atol=1e-7)
    r3 = float(rl.mdi_balance_reward(jnp.array([1.5]), ratio=3.0)[0])
    np.testing.assert_allclose(r3, 0.2618595, rtol=1e-5)  # 2 (1 - ln 1.5 / ln 3) - 1
    with pytest.raises(ValueError, match="ratio"):
        rl.mdi_balance_reward(mdi, ratio=1.0)
