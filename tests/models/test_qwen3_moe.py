"""The sparse mixture-of-experts block's functions (`jaxvrl.models.moe`): routing as
transformers computes it, the grouped-matmul experts against the dense reference (outputs and
gradients), and the load-balancing loss against a numpy formula and transformers'."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxvrl.models import moe
from tests.tolerance import assert_reduction_close, term_scale

EXPERTS, TOP_K = 8, 2


def test_ragged_experts_equal_the_dense_reference():
    """The grouped matmul over tokens sorted by expert against every expert on every token
    (an expert left without tokens among them), outputs and gradients."""
    rng = np.random.default_rng(0)
    n, d, f = 13, 32, 16
    x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
    kernels = tuple(
        jnp.asarray(rng.normal(size=s) / math.sqrt(s[1]), jnp.float32)
        for s in ((EXPERTS, d, f), (EXPERTS, d, f), (EXPERTS, f, d))
    )
    logits = jnp.asarray(rng.normal(size=(n, EXPERTS)), jnp.float32).at[:, 5].set(-1e3)
    weights, experts = moe.route(logits, TOP_K, True)
    assert not np.any(np.asarray(experts) == 5)
    a = moe.ragged_experts(x, weights, experts, kernels, jax.nn.silu)
    b = moe.dense_experts(x, weights, experts, kernels, jax.nn.silu)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(np.abs(b).max()))
    # and their gradients (the training pass) in x, the routing weights and the kernels

    def grads(run):
        def f(x, weights, kernels):
            return jnp.sum(jnp.sin(run(x, weights, experts, kernels, jax.nn.silu)))

        return jax.tree.leaves(jax.grad(f, argnums=(0, 1, 2))(x, weights, kernels))

    for ga, gb in zip(grads(moe.ragged_experts), grads(moe.dense_experts)):
        np.testing.assert_allclose(ga, gb, rtol=1e-4, atol=1e-5 * float(np.abs(gb).max()))


def test_route_as_transformers():
    """Softmax over the experts in float32, top k, renormalised where asked; a recorded
    selection takes the live router's weights."""
    logits = jnp.asarray([[1.0, 3.0, 2.0, 0.0]], jnp.bfloat16)
    p = np.exp([1.0, 3.0, 2.0, 0.0]) / np.exp([1.0, 3.0, 2.0, 0.0]).sum()
    w, e = moe.route(logits, 2, False)
    assert w.dtype == jnp.float32 and e.tolist() == [[1, 2]]
    np.testing.assert_allclose(w, [[p[1], p[2]]], rtol=1e-6)
    w, _ = moe.route(logits, 2, True)
    np.testing.assert_allclose(w, [[p[1] / (p[1] + p[2]), p[2] / (p[1] + p[2])]], rtol=1e-6)
    w, e = moe.route(logits, 2, False, selected=jnp.asarray([[0, 3]]))
    assert e.tolist() == [[0, 3]]
    np.testing.assert_allclose(w, [[p[0], p[3]]], rtol=1e-6)


def _numpy_balance_loss(logits, top_k, mask):
    """Switch Transformer's loss written out: E * sum_e f_e P_e over the valid tokens of
    every layer, f_e the top-k assignments to e per token, P_e e's mean probability."""
    logits = np.asarray(logits, np.float64)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    layers, n, e = p.shape
    f, prob, rows = np.zeros(e), np.zeros(e), 0.0
    for layer in range(layers):
        for t in range(n):
            if mask[t]:
                for j in np.argsort(-p[layer, t])[:top_k]:
                    f[j] += 1
                prob += p[layer, t]
                rows += 1
    return e * np.sum((f / rows) * (prob / rows))


def test_load_balancing_loss():
    """Against the formula in numpy and transformers' `load_balancing_loss_func`, with and
    without padding."""
    import torch
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 10, EXPERTS)).astype(np.float32)
    mask = (np.arange(10) >= 3).astype(np.int64)  # a left-padded row of 10
    for m in (None, mask):
        got = moe.load_balancing_loss(jnp.asarray(logits), TOP_K, m)
        want = _numpy_balance_loss(logits, TOP_K, np.ones(10) if m is None else m)
        hf = load_balancing_loss_func(
            tuple(torch.tensor(x) for x in logits),
            EXPERTS,
            TOP_K,
            None if m is None else torch.tensor(m)[None],
        )
        # a sum of E products of terms of order k / E and 1 / E
        scale = term_scale(np.full(EXPERTS, TOP_K / EXPERTS**2))
        assert_reduction_close(got, want, EXPERTS * scale)
        assert_reduction_close(got, float(hf), EXPERTS * scale)
    uniform = moe.load_balancing_loss(jnp.zeros((1, 4, EXPERTS)), TOP_K)
    np.testing.assert_allclose(uniform, TOP_K, rtol=1e-6)  # balanced: E * E * (k/E) * (1/E)
