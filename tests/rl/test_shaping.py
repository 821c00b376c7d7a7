"""Trajectory advantage shaping (TAS, docs/algorithms.md#trajectory-advantage-shaping-tas)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxvrl import rl


def test_tas_hand_values():
    # row means S = 2, 0, 4 (the padded 4.0 in row 1 is ignored); the last row is empty
    scores = jnp.array([[1.0, 3.0], [0.0, 4.0], [4.0, 0.0], [7.0, 7.0]])
    mask = jnp.array([[1, 1], [1, 0], [1, 0], [0, 0]])
    # n = 0.5, 0, 1; mu = 0.5; beta_max = 0.8 + 0.2 / 0.5 = 1.2; alpha = 0.8 + 0.4 n
    alpha = np.asarray(rl.trajectory_scaling(scores, mask, 0.8))
    np.testing.assert_allclose(alpha, [1.0, 0.8, 1.2, 1.0], rtol=1e-6)
    # row_mask leaves row 2 out: S = 2, 0 -> n = 1, 0; mu = 0.5; alpha = 1.2, 0.8
    alpha = rl.trajectory_scaling(scores, mask, 0.8, row_mask=jnp.array([1, 1, 0, 1]) > 0)
    np.testing.assert_allclose(np.asarray(alpha), [1.2, 0.8, 1.0, 1.0], rtol=1e-6)


def test_tas_no_spread_is_one():
    flat = rl.trajectory_scaling(jnp.full((3, 2), 0.7), jnp.ones((3, 2)), 0.8)
    np.testing.assert_array_equal(np.asarray(flat), 1.0)
    tiny = rl.trajectory_scaling(jnp.array([[0.0], [5e-7]]), jnp.ones((2, 1)), 0.5)
    np.testing.assert_array_equal(np.asarray(tiny), 1.0)
    empty = rl.trajectory_scaling(jnp.ones((2, 2)), jnp.zeros((2, 2)), 0.8)
    np.testing.assert_array_equal(np.asarray(empty), 1.0)


_tas = jax.jit(rl.trajectory_scaling)


@settings(max_examples=25, deadline=None)
@given(st.floats(0.0, 0.99), st.integers(0, 2**31 - 1))
def test_tas_mean_is_one_and_padding_invariant(beta_min, seed):
    rng = np.random.default_rng(seed)
    b, t = 6, 5
    scores = rng.exponential(size=(b, t)).astype(np.float32)
    mask = (np.arange(t)[None] < rng.integers(1, t + 1, b)[:, None]).astype(np.float32)
    alpha = np.asarray(_tas(jnp.asarray(scores), jnp.asarray(mask), beta_min))
    assert abs(alpha.mean() - 1.0) < 1e-5
    assert alpha.min() >= beta_min - 1e-5
    pad = _tas(
        jnp.asarray(np.pad(scores, ((0, 0), (0, 3)), constant_values=50.0)),
        jnp.asarray(np.pad(mask, ((0, 0), (0, 3)))),
        beta_min,
    )
    np.testing.assert_allclose(np.asarray(pad), alpha, rtol=1e-6)


def test_tas_axis_name_sees_the_global_batch():
    rng = np.random.default_rng(1)
    scores = jnp.asarray(rng.exponential(size=(6, 4)).astype(np.float32))
    mask = jnp.asarray((rng.random((6, 4)) > 0.3).astype(np.float32))
    whole = rl.trajectory_scaling(scores, mask, 0.7)
    per_shard = jax.vmap(
        lambda s, m: rl.trajectory_scaling(s, m, 0.7, axis_name="d"), axis_name="d"
    )
    split = per_shard(scores.reshape(2, 3, 4), mask.reshape(2, 3, 4)).reshape(6)
    np.testing.assert_allclose(np.asarray(split), np.asarray(whole), rtol=1e-6)
    g = jax.grad(lambda s: rl.trajectory_scaling(s, mask, 0.7).sum())(scores)
    np.testing.assert_array_equal(np.asarray(g), 0.0)  # alpha carries no gradient
