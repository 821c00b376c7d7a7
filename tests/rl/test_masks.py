"""Visual dependency, top-p perception mask, entropy mask
(docs/algorithms.md#token-masks-perception-and-entropy)."""

from __future__ import annotations

import fractions
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxvrl import rl


def test_visual_dependency_hand_values():
    logp = jnp.array([[-1.0, -2.0, -0.5, 0.0, -1.0]])
    aug = jnp.array([[-1.5, -1.0, -30.0, 0.0, 40.0]])
    mask = jnp.array([[1, 1, 1, 1, 0]])
    s = np.asarray(rl.visual_dependency(aug, logp, mask))
    # d = -0.5: e^-0.5 + 0.5 - 1 = 0.1065306597; d = 1: e - 2 = 0.7182818285;
    # d = -29.5 clipped to -20: e^-20 + 19 = 19.000000002 clipped to 10; d = 0: 0; padding: 0.
    np.testing.assert_allclose(s[0], [0.1065306597, 0.7182818285, 10.0, 0.0, 0.0], rtol=1e-6)


def test_visual_dependency_has_no_gradient():
    g = jax.grad(lambda a: rl.visual_dependency(a, jnp.zeros((1, 2)), jnp.ones((1, 2))).sum())(
        jnp.ones((1, 2))
    )
    np.testing.assert_array_equal(np.asarray(g), 0.0)


@pytest.mark.parametrize(
    "n,p,k",
    [
        (10, 0.3, 3),
        (5, 0.2, 1),
        (6, 0.2, 2),
        (1, 0.2, 1),
        (0, 0.2, 0),
        (7, 1.0, 7),
        (5000, 1e-5, 1),  # any share above 0 keeps a token
        (3629, 0.12345, 449),  # five digits: 447.99... rounds up
        (100_000, 0.99999, 99_999),
        (410, 1 / 3, 137),
    ],
)
def test_top_k_count_hand_values(n, p, k):
    assert int(rl.top_k_count(jnp.array([n]), p)[0]) == k


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.integers(0, 16_000_000), min_size=1, max_size=6),
    st.integers(1, 9).flatmap(lambda d: st.tuples(st.just(d), st.integers(1, 10**d))),
)
def test_top_k_count_exact_for_decimals(ns, digits):
    """k = ceil(n * p) exactly for p written with up to nine decimal digits."""
    d, units = digits
    p = units / 10**d
    got = np.asarray(rl.top_k_count(jnp.array(ns), p))
    want = [math.ceil(n * fractions.Fraction(str(p))) for n in ns]
    np.testing.assert_array_equal(got, want)


def test_top_p_mask_exact_k_ties_to_earlier():
    scores = jnp.array([[0.5, 0.9, 0.5, 0.5, 0.1, 7.0], [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]])
    mask = jnp.array([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]])
    out = np.asarray(rl.top_p_token_mask(scores, mask, 0.5))
    # row 0: n = 5, k = 3: 0.9, then the two earliest of the tied 0.5s; padding (7.0) never.
    np.testing.assert_array_equal(out[0], [1, 1, 1, 0, 0, 0])
    # row 1: n = 4, k = 2: the two earliest of four ties
    np.testing.assert_array_equal(out[1], [1, 1, 0, 0, 0, 0])
    ten = rl.top_p_token_mask(jnp.arange(10.0)[None], jnp.ones((1, 10)), 0.3)
    np.testing.assert_array_equal(np.asarray(ten)[0], [0] * 7 + [1] * 3)


def test_top_p_mask_signed_zero_nan_and_holes():
    # -0.0 == 0.0 is a tie (earlier wins); NaN counts as -inf (ties by position); a
    # padding hole in the middle is skipped and never counted.
    scores = jnp.array([[-0.0, 0.0, -1.0, 5.0], [jnp.nan, -jnp.inf, 2.0, 9.0]])
    mask = jnp.array([[1, 1, 1, 0], [1, 1, 1, 0]])
    np.testing.assert_array_equal(
        np.asarray(rl.top_p_token_mask(scores, mask, 0.3)), [[1, 0, 0, 0], [0, 0, 1, 0]]
    )
    np.testing.assert_array_equal(
        np.asarray(rl.top_p_token_mask(scores, mask, 1.0)), [[1, 1, 1, 0], [1, 1, 1, 0]]
    )
    holes = rl.top_p_token_mask(jnp.array([[9.0, 1.0, 9.0, 2.0]]), jnp.array([[1, 0, 0, 1]]), 0.5)
    np.testing.assert_array_equal(np.asarray(holes), [[1, 0, 0, 0]])


_top_p = jax.jit(rl.top_p_token_mask, static_argnums=2)


@settings(max_examples=25, deadline=None)
@given(st.sampled_from([0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0]), st.integers(0, 2**31 - 1))
def test_top_p_mask_properties(top_p, seed):
    b, t, extra_pad = 4, 12, 3  # fixed shapes: one compile per top_p
    rng = np.random.default_rng(seed)
    scores = rng.integers(0, 4, (b, t)).astype(np.float32)  # many ties
    lengths = rng.integers(0, t + 1, b)
    mask = (np.arange(t)[None] < lengths[:, None]).astype(np.float32)
    out = np.asarray(_top_p(jnp.asarray(scores), jnp.asarray(mask), top_p))
    k = [math.ceil(n * fractions.Fraction(str(top_p))) for n in lengths]
    np.testing.assert_array_equal(out.sum(1), k)  # exactly k per row
    assert np.all(out <= mask)
    for i in range(b):  # a top-k by score, ties to earlier positions
        want = sorted(range(lengths[i]), key=lambda j: (-scores[i, j], j))[: k[i]]
        assert set(np.flatnonzero(out[i])) == set(want)
    # appended padding columns (with large scores) change nothing
    padded = _top_p(
        jnp.pad(jnp.asarray(scores), ((0, 0), (0, extra_pad)), constant_values=9.0),
        jnp.pad(jnp.asarray(mask), ((0, 0), (0, extra_pad))),
        top_p,
    )
    np.testing.assert_array_equal(np.asarray(padded)[:, :t], out)
    assert np.asarray(padded)[:, t:].sum() == 0


def test_top_p_mask_on_any_float_matches_a_sort():
    # mixed signs, infinities, subnormals, signed zeros, NaN and ties, rows of 1..997 tokens:
    # the selection equals numpy's stable sort by (score descending, position); no sort op
    rng = np.random.default_rng(7)
    b, t = 5, 997
    specials = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 1e-45, -1e-45, 3e38, -3e38])
    scores = rng.standard_normal((b, t)).astype(np.float32) * 10.0 ** rng.integers(-30, 30, (b, t))
    scores = np.where(rng.random((b, t)) < 0.1, rng.choice(specials, (b, t)), scores)
    scores[1] = np.round(scores[1])  # many ties
    lengths = np.array([t, 1, 500, 0, 996])
    mask = (np.arange(t)[None] < lengths[:, None]) & (rng.random((b, t)) < 0.9)
    mask[1, 0] = True
    fn = jax.jit(rl.top_p_token_mask, static_argnums=2)
    assert "sort" not in str(jax.make_jaxpr(fn, static_argnums=2)(scores, mask, 0.4))
    for top_p in (0.001, 0.4, 0.77, 1.0):
        out = np.asarray(fn(jnp.asarray(scores), jnp.asarray(mask.astype(np.float32)), top_p))
        for i in range(b):
            idx = np.flatnonzero(mask[i])
            x = np.where(np.isnan(scores[i, idx]), -np.inf, scores[i, idx]) + 0.0  # -0.0 -> 0.0
            k = math.ceil(len(idx) * fractions.Fraction(str(top_p)))
            want = idx[np.lexsort((idx, -x))[:k]]  # last key first: score desc, then position
            np.testing.assert_array_equal(np.flatnonzero(out[i]), np.sort(want), err_msg=f"{i}")


def test_entropy_mask_scopes():
    ent = jnp.array([[3.0, 0.0, 1.0], [2.0, 2.5, 0.0]])
    mask = jnp.array([[1, 1, 1], [1, 1, 0]])
    out = np.asarray(rl.entropy_token_mask(ent, mask, 0.4, scope="batch"))
    np.testing.assert_array_equal(out, [[1, 0, 0], [0, 1, 0]])  # N = 5, k = 2: 3.0 and 2.5
    seq = np.asarray(rl.entropy_token_mask(ent, mask, 0.4, scope="sequence"))
    np.testing.assert_array_equal(seq, [[1, 0, 1], [0, 1, 0]])  # k = 2 and 1
    # batch-scope ties go to the earlier position in row-major order
    tie = rl.entropy_token_mask(jnp.ones((2, 2)), jnp.ones((2, 2)), 0.5, scope="batch")
    np.testing.assert_array_equal(np.asarray(tie), [[1, 1], [0, 0]])
    with pytest.raises(ValueError, match="scope"):
        rl.entropy_token_mask(ent, mask, 0.4, scope="tokens")


def test_token_entropy_and_union():
    logits = jnp.array([[0.0, 0.0, 0.0, 0.0], [0.0, -jnp.inf, -jnp.inf, -jnp.inf]])
    h = np.asarray(rl.token_entropy(jnp.where(jnp.isinf(logits), -1e9, logits)))
    np.testing.assert_allclose(h, [math.log(4), 0.0], atol=1e-6)
    hot = np.asarray(rl.token_entropy(jnp.array([[math.log(3.0), 0.0]]), temperature=1.0))
    np.testing.assert_allclose(hot, [-(0.75 * math.log(0.75) + 0.25 * math.log(0.25))], rtol=1e-6)
    a, b = jnp.array([[1.0, 0.0, 0.0]]), jnp.array([[0.0, 0.0, 1.0]])
    np.testing.assert_array_equal(np.asarray(rl.union_token_mask(a, None, b)), [[1, 0, 1]])
    assert rl.union_token_mask(None, None) is None
