"""Every array function of jaxvrl.rl traces under jax.jit with static shapes (so none of them
reads a value on the host) and gives the same result as eager execution."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxvrl import rl

B, T, L = 4, 6, 3
_rng = np.random.default_rng(0)
X = jnp.asarray(_rng.normal(size=(B, T)).astype(np.float32))
Y = jnp.asarray(_rng.normal(size=(B, T)).astype(np.float32))
M = jnp.asarray((np.arange(T)[None] < np.array([6, 3, 1, 0])[:, None]).astype(np.float32))
A = jnp.asarray(_rng.uniform(0.0, 1.0, (L, B, T)).astype(np.float32))
N = jnp.array([4, 0, 2, 3])
R = jnp.array([1.0, 0.0, 0.5, 0.5])

CASES = {
    "visual_dependency": lambda: rl.visual_dependency(X, Y, M),
    "top_p_token_mask": lambda: rl.top_p_token_mask(X, M, 0.2),
    "entropy_token_mask": lambda: rl.entropy_token_mask(X, M, 0.3, "batch"),
    "token_entropy": lambda: rl.token_entropy(A.transpose(1, 2, 0)),
    "trajectory_scaling": lambda: rl.trajectory_scaling(jnp.abs(X), M, 0.8),
    "per_token_vgr": lambda: rl.per_token_vgr(A, A[::-1], N, N + 1, "late"),
    "attention_metrics": lambda: rl.attention_metrics(A, A[::-1], N, N + 1, M, last_k=2),
    "vgr_token_weights": lambda: rl.vgr_token_weights(
        jnp.abs(X), M, smooth_sigma=1.5, has_image=N > 0
    ),
    "mdi_balance_reward": lambda: rl.mdi_balance_reward(jnp.abs(X[:, 0])),
    "group_advantages": lambda: rl.group_advantages(R, 2),
    "rloo": lambda: rl.group_advantages(R, 2, "rloo"),
    "remax": lambda: rl.group_advantages(R, 2, "remax", baseline=R[::2]),
    "reinforce_plus_plus": lambda: rl.group_advantages(R, 2, "reinforce_plus_plus", mask=M),
    "gae": lambda: rl.gae(X, Y, M, 0.99, 0.95),
    "policy_loss": lambda: rl.policy_loss(
        X, Y, R, M, token_mask=M, token_weights=jnp.abs(X), loss_agg_mode="seq-mean-token-mean"
    ),
    "policy_loss_denominator": lambda: rl.policy_loss(
        X, Y, X, M, denominator=rl.agg_denominator(M, "token-mean")
    ),
    "kl_penalty": lambda: rl.kl_penalty(X, Y, "low_var_kl"),
    "kl_in_reward": lambda: rl.kl_in_reward(R, X, Y, M, 0.05, "mse"),
    "entropy_bonus": lambda: rl.entropy_bonus(jnp.abs(X), M, "token-mean", 0.01),
    "entropy_penalty": lambda: rl.entropy_penalty(X, M, "seq-mean-token-sum", 0.06),
    "value_loss": lambda: rl.value_loss(X, Y, X * 0.5, M, 0.2, "seq-mean-token-sum-norm"),
    "whiten": lambda: rl.whiten(X, M),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_jits_and_matches_eager(name):
    fn = CASES[name]
    jitted = jax.jit(fn)()
    eager = fn()
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(
            np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6, err_msg=name
        ),
        jitted,
        eager,
    )
    assert all(np.asarray(x).dtype in (np.float32, np.int32) for x in jax.tree.leaves(jitted))
