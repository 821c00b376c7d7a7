"""Sampling rules: exact argmax/top-k/top-p against sort-based float64 references, and the
inverse-CDF sampler's distribution."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxvrl.sampling import filter_logits, rules

CUT = -1e29


def nucleus_ref(logits: np.ndarray, top_p: float) -> np.ndarray:
    """bool[B, V]: smallest most-probable set with mass >= top_p (float64, by sorting)."""
    x = logits.astype(np.float64)
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    order = np.argsort(-p, axis=-1, kind="stable")
    cum = np.cumsum(np.take_along_axis(p, order, -1), -1)
    n_keep = (cum < top_p).sum(-1) + 1
    thr = np.take_along_axis(np.take_along_axis(p, order, -1), n_keep[:, None] - 1, -1)
    return p >= thr


def test_filter_logits_top_k_top_p_by_hand():
    logits = jnp.log(jnp.array([[0.5, 0.25, 0.15, 0.1]]))
    k2 = np.asarray(filter_logits(logits, 2, 1.0))
    assert np.all(k2[0, 2:] < CUT) and np.all(k2[0, :2] > -10)
    p = np.asarray(filter_logits(logits, 0, 0.7))  # 0.5 + 0.25 reaches 0.7
    assert np.all(p[0, :2] > -10) and np.all(p[0, 2:] < CUT)
    p1 = np.asarray(filter_logits(logits, 0, 0.4))
    assert (p1[0] > -10).sum() == 1


@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.97])
@pytest.mark.parametrize("peaked", [False, True])
def test_top_p_matches_sorted_reference(top_p, peaked):
    """Both threshold paths: the top-64 candidates (peaked rows) and the bisection (flat)."""
    rng = np.random.default_rng(int(top_p * 100) + peaked)
    x = rng.standard_normal((4, 5000)).astype(np.float32) * 2
    if peaked:
        x[:, :3] += 12.0
    kept = np.asarray(rules.top_p_filter(jnp.asarray(x), top_p)) > CUT
    ref = nucleus_ref(x, top_p)
    # float32 vs float64 masses may disagree about the one token at the boundary
    assert np.all((kept ^ ref).sum(-1) <= 1)
    assert np.all(kept.sum(-1) >= 1)


def test_a_rows_top_p_set_does_not_depend_on_the_other_rows():
    """top_p at a cumulative mass (and one float32 step either side) of peaked rows: each row
    keeps the same tokens alone as beside a flat row, which takes the bisection path."""
    rng = np.random.default_rng(0)
    flat = np.zeros((1, 1000), np.float32)  # its top 64 hold 6.4%: bisection
    nucleus = jax.jit(rules.nucleus_filter)  # top_p_filter's program, p traced
    differ = 0
    for _ in range(30):
        x = (rng.standard_normal((1, 1000)) * 4).astype(np.float32)
        desc = np.sort(np.asarray(jax.nn.softmax(jnp.asarray(x), -1))[0])[::-1]
        p = np.cumsum(desc.astype(np.float32))[int(rng.integers(0, 5))]
        for q in (p, np.nextafter(p, np.float32(1)), np.nextafter(p, np.float32(0))):
            alone = np.asarray(nucleus(jnp.asarray(x), q))[0] > CUT
            both = np.asarray(nucleus(jnp.asarray(np.concatenate([x, flat])), q))
            differ += int((alone != (both[0] > CUT)).any())
    assert differ == 0


def test_first_argmax_and_top_k_ties():
    x = jnp.array([[1.0, 3.0, 3.0, 0.0], [2.0, -1.0, 2.0, 2.0]])
    np.testing.assert_array_equal(rules.first_argmax(x), [1, 0])
    rng = np.random.default_rng(0)
    y = jnp.asarray(rng.standard_normal((3, 1000)).astype(np.float32))
    np.testing.assert_array_equal(rules.first_argmax(y), jnp.argmax(y, -1))
    k = np.asarray(rules.top_k_filter(y, 5)) > CUT
    np.testing.assert_array_equal(k.sum(-1), [5, 5, 5])
    top5 = np.sort(np.argsort(-np.asarray(y))[:, :5])
    np.testing.assert_array_equal(top5, np.nonzero(k)[1].reshape(3, 5))


def test_categorical_distribution_and_never_filtered():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 700)).astype(np.float32)
    x[0, 100:300] = rules.NEG_INF  # filtered tokens, spanning whole sampler blocks
    keys = jax.random.split(jax.random.key(2), 40000)  # one row's draws with 40,000 keys
    u = rules.row_uniforms(keys, 0)
    pick = jax.vmap(lambda ui: rules.categorical_from_uniform(ui[None], jnp.asarray(x)))
    toks = np.asarray(jax.jit(pick)(u))
    toks = toks.ravel()
    assert not np.any((toks >= 100) & (toks < 300))
    p = np.asarray(jax.nn.softmax(jnp.asarray(x[0])))
    emp = np.bincount(toks, minlength=700) / toks.size
    # each frequency within 5 standard errors of its probability
    assert np.all(np.abs(emp - p) <= 5 * np.sqrt(p * (1 - p) / toks.size) + 1e-4)


def test_token_logprob_is_full_distribution():
    x = jnp.log(jnp.array([[0.5, 0.25, 0.15, 0.1]]))
    lp = rules.token_logprob(x, jnp.array([1]), 1.0)
    np.testing.assert_allclose(lp, np.log(0.25), rtol=1e-6)
    lp2 = rules.token_logprob(x, jnp.array([0]), 2.0)
    ref = np.log(np.sqrt(0.5) / np.sum(np.sqrt([0.5, 0.25, 0.15, 0.1])))
    np.testing.assert_allclose(lp2, ref, rtol=1e-6)


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
def test_the_samplers_pick_never_takes_a_suppressed_id_and_counts_it_in_the_logprob(
    monkeypatch, temperature
):
    """The XLA form of a decode step's pick (the CPU kernels switched off, as in a program for
    an accelerator): a suppressed id holding a row's maximum, or far above the rest, is never
    chosen; each log-prob is that of the full distribution (suppressed ids in the
    normaliser, a float64 reference); an id outside the vocabulary is ignored."""
    from jaxvrl.sampling import steps
    from jaxvrl.sampling.cpu import kernels

    monkeypatch.setattr(kernels, "usable", lambda: False)
    rng = np.random.default_rng(3)
    b, v = 64, 300
    x = rng.standard_normal((b, v)).astype(np.float32) * 2
    suppress = (0, 7, v - 1, v + 5)
    x[:8, 7] = 40.0  # far above the rest: every draw would take it
    x[8:16, v - 1] = x[8:16].max(axis=1) + 1e-3
    cfg = steps.SamplingConfig(4, temperature=temperature, suppress_token_ids=suppress)
    keys = jax.random.split(jax.random.key(0), b)
    tok, lp = jax.jit(lambda y, k: steps.pick(y, k, 2, cfg)[:2])(jnp.asarray(x), keys)
    tok, lp = np.asarray(tok), np.asarray(lp)
    assert not np.isin(tok, suppress).any(), tok
    t = temperature if temperature > 0 else 1.0
    x64 = x.astype(np.float64) / t
    logsm = x64 - x64.max(1, keepdims=True)
    logsm -= np.log(np.exp(logsm).sum(1, keepdims=True))
    np.testing.assert_allclose(lp, logsm[np.arange(b), tok], rtol=0, atol=2e-5)
    if temperature == 0.0:
        allowed = x64.copy()
        allowed[:, [0, 7, v - 1]] = -np.inf
        np.testing.assert_array_equal(tok, allowed.argmax(1))
    else:  # the rows' draws are not all the same token
        assert len(set(tok[16:].tolist())) > 10
