"""The CPU decode kernels (jaxvrl/sampling/cpu/decode_kernels.cc): x @ w.T against a float64
reference on odd shapes, packing, the greedy pick against the XLA rules, the gate, the
fallback when they cannot be built, and the sampler's tokens and log-probs with and without
them, and the decode weights that reuse their buffer."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxvrl.sampling import Sampler, generate, rules
from jaxvrl.sampling.cpu import kernels as cpu_kernels
from tests.models import hf_tiny

needs_kernel = pytest.mark.skipif(
    not cpu_kernels.available(), reason="no C++ compiler here: the kernel cannot be built"
)


@needs_kernel
@pytest.mark.parametrize(
    "m,k,n",
    [(1, 1, 1), (3, 7, 5), (8, 256, 1000), (9, 130, 77), (5, 37, 20001), (32, 896, 300)],
)
def test_rows_by_weight_matches_float64(m, k, n):
    """Every row count (full and partial blocks of 8), N with and without a partial last
    panel, over many chunks (several threads) and one."""
    rng = np.random.default_rng(m * 1000 + k)
    w = rng.standard_normal((n, k), np.float32)
    x = rng.standard_normal((m, k), np.float32)
    packed = cpu_kernels.pack(jnp.asarray(w))
    assert packed.shape == (-(-n // 8) * k * 8,)
    f = jax.jit(cpu_kernels.rows_by_weight, static_argnums=2)
    got = np.asarray(f(packed, jnp.asarray(x), n))
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    assert got.shape == (m, n) and got.dtype == np.float32
    # a float32 sum of k products: error within a few ulp of sum |x w| times k
    bound = 4 * np.finfo(np.float32).eps * k * (np.abs(x) @ np.abs(w).T)
    assert np.all(np.abs(got - ref) <= bound + 1e-30)
    # deterministic: the thread split does not change the summation order
    np.testing.assert_array_equal(got, np.asarray(f(packed, jnp.asarray(x), n)))


@needs_kernel
@pytest.mark.parametrize("n,k", [(1, 3), (13, 5), (64, 7)])
def test_pack_from_rows_and_from_columns(n, k):
    w = np.random.default_rng(n).standard_normal((n, k), np.float32)
    want = np.zeros((-(-n // 8) * 8, k), np.float32)
    want[:n] = w
    want = want.reshape(-1, 8, k).transpose(0, 2, 1).reshape(-1)
    np.testing.assert_array_equal(np.asarray(jax.jit(cpu_kernels.pack)(jnp.asarray(w))), want)
    empty = cpu_kernels.empty(cpu_kernels.packed_size(n, k))
    cols = jax.jit(cpu_kernels.pack_into, static_argnames=("offset", "columns"))(
        empty, jnp.asarray(w.T.copy()), 0, columns=True
    )
    np.testing.assert_array_equal(np.asarray(cols), want)


@needs_kernel
def test_weights_packed_at_offsets_of_one_donated_buffer():
    """Two weights (one from rows, one from columns) at their offsets of one buffer, in place
    (the donated buffer's memory is the result's), each product read from its own offset;
    what the buffer held before does not matter."""
    rng = np.random.default_rng(3)
    w1 = rng.standard_normal((13, 5), np.float32)  # rows [N, K]
    w2 = rng.standard_normal((7, 20), np.float32)  # columns [K, N]
    x1, x2 = rng.standard_normal((3, 5), np.float32), rng.standard_normal((3, 7), np.float32)
    at = cpu_kernels.packed_size(13, 5)
    size = at + cpu_kernels.packed_size(20, 7)

    def f(buf):
        buf = cpu_kernels.pack_into(buf, w1, 0)
        buf = cpu_kernels.pack_into(buf, w2, at, columns=True)
        return (
            buf,
            cpu_kernels.rows_by_weight(buf, x1, 13),
            cpu_kernels.rows_by_weight(buf, x2, 20, at),
        )

    buf = jnp.full((size,), np.nan, jnp.float32)
    where = buf.unsafe_buffer_pointer()
    out, y1, y2 = jax.jit(f, donate_argnums=0)(buf)
    assert out.unsafe_buffer_pointer() == where and buf.is_deleted()
    np.testing.assert_allclose(np.asarray(y1), x1.astype(np.float64) @ w1.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(y2), x2.astype(np.float64) @ w2, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_kernels.pack_into(jnp.zeros((size,)), w2, at + 1, columns=True)


def _xla_greedy(x, suppress):
    ids = jnp.asarray(suppress, jnp.int32)
    y = x.at[:, ids].set(rules.NEG_INF) if suppress else x
    tok = rules.first_argmax(y)
    return tok, rules.token_logprob(x, tok, 1.0)


@needs_kernel
@pytest.mark.parametrize("v", [1, 9, 8 * 1000, 151936 + 3])
def test_greedy_pick_matches_the_rules(v):
    """First maximum (ties inside and across vector lanes), a suppressed id holding the row's
    maximum (it still counts in the normaliser), logits far below the maximum (exp
    underflow), a vocabulary that is not a multiple of 8."""
    rng = np.random.default_rng(v)
    b = 6
    x = rng.standard_normal((b, v)).astype(np.float32) * 4
    top = x.max() + 1
    suppress = (0, v - 1) if v > 1 else ()
    if v >= 20:
        x[1, [3, 11, 19]] = top  # ties: the first wins
        x[2, v - 1] = top + 5  # a suppressed id is the maximum
        x[2, [5, 6]] = top  # the pick among the rest: 5
        x[3, :] = -200.0
        x[3, 7] = 50.0  # every other entry underflows exp(x - max)
        x[4, v // 2 :] = top  # ties across the second half
    if v == 9:
        suppress = (2, 2)  # repeated ids: each entry still counts once in the normaliser
    tok, lp = jax.jit(cpu_kernels.greedy_pick, static_argnums=1)(jnp.asarray(x), suppress)
    want_tok, _ = _xla_greedy(jnp.asarray(x), tuple(sorted(set(suppress))))
    np.testing.assert_array_equal(np.asarray(tok), np.asarray(want_tok))
    x64 = x.astype(np.float64)
    t = np.asarray(tok)
    ref_lp = (
        x64[np.arange(b), t] - np.log(np.exp(x64 - x64.max(1, keepdims=True)).sum(1)) - x64.max(1)
    )
    np.testing.assert_allclose(np.asarray(lp), ref_lp, rtol=0, atol=2e-6 * max(1, np.log(v)))
    if v >= 20:
        assert t[1] == 3 and t[2] == 5 and t[3] == 7 and t[4] == v // 2
        assert abs(float(lp[3])) < 1e-6


def _inverse_cdf(x, u, suppress, temp):
    """float64 reference: (first id whose running mass passes u * total, the running masses,
    log-softmax over every id)."""
    z = (x / np.float32(temp)).astype(np.float64)
    keep = np.ones(z.shape, bool)
    keep[:, list(suppress)] = False
    top = np.max(np.where(keep, z, -np.inf), axis=1, keepdims=True)
    p = np.where(keep, np.exp(z - top), 0.0)
    cum = np.cumsum(p, axis=1)
    target = u.astype(np.float64) * cum[:, -1]
    ids = np.array([np.searchsorted(c, t, side="right") for c, t in zip(cum, target)])
    full = np.max(z, axis=1, keepdims=True)
    logsm = z - full - np.log(np.sum(np.exp(z - full), axis=1, keepdims=True))
    return ids, cum, target, logsm


@needs_kernel
@pytest.mark.parametrize("v,temp", [(1, 1.0), (9, 0.5), (8 * 1000, 1.0), (151936 + 3, 0.7)])
def test_categorical_pick_inverts_the_cdf(v, temp):
    """Against a float64 inverse CDF: each row's draw for its uniform number (an adjacent id
    only where the target sits within float rounding of a boundary), never a suppressed id
    (one holding a far larger logit than the rest included: the log-prob's normaliser still
    has it), entries that underflow, u at both ends, V not a multiple of the blocks."""
    rng = np.random.default_rng(v)
    b = 12
    x = (rng.standard_normal((b, v)) * 4).astype(np.float32)
    suppress = (0, v - 1) if v > 2 else ()
    if v >= 20:
        x[1, v - 1] = 300.0  # a suppressed id far above the rest
        x[2, :] = -200.0
        x[2, [4, 9]] = 0.0  # two ids share the mass, the rest underflows
    u = rng.uniform(0, 1, b).astype(np.float32)
    u[3], u[4] = 0.0, np.nextafter(np.float32(1), np.float32(0))
    f = jax.jit(cpu_kernels.categorical_pick, static_argnums=(2, 3))
    tok, lp = (np.asarray(a) for a in f(jnp.asarray(x), jnp.asarray(u), suppress, temp))
    want, cum, target, logsm = _inverse_cdf(x, u, suppress, temp)
    for r in range(b):
        assert tok[r] not in suppress
        if tok[r] != want[r]:  # only at a boundary: the target within rounding of cum
            near = np.min(np.abs(cum[r, max(want[r] - 1, 0) : want[r] + 1] - target[r]))
            assert near <= 1e-5 * cum[r, -1], (r, tok[r], want[r])
        np.testing.assert_allclose(lp[r], logsm[r, tok[r]], rtol=0, atol=2e-5)
    if v >= 20:
        assert tok[2] in (4, 9)


@needs_kernel
def test_categorical_pick_frequencies_are_the_softmax():
    """Evenly spaced uniform numbers over many rows of the same logits: each id is drawn in
    proportion to its probability (suppressed ids taken out and the rest renormalised), to
    within one draw."""
    n = 4000
    logits = np.array([0.5, -1.0, 2.0, 3.0, -30.0, 1.0, 0.0], np.float32)
    x = np.tile(logits, (n, 1))
    u = ((np.arange(n) + 0.5) / n).astype(np.float32)
    tok, _ = cpu_kernels.categorical_pick(jnp.asarray(x), jnp.asarray(u), (3,), 1.5)
    counts = np.bincount(np.asarray(tok), minlength=7)
    p = np.exp(logits.astype(np.float64) / 1.5)
    p[3] = 0.0
    np.testing.assert_allclose(counts, n * p / p.sum(), atol=1.01)
    with pytest.raises(ValueError, match="temperature"):
        cpu_kernels.categorical_pick(jnp.asarray(x), jnp.asarray(u), (), 0.0)
    # a suppressed id far above the rest (exp of its gap overflows even a double): the
    # log-prob is still log softmax(x / T) over every id
    far = np.zeros((2, 64), np.float32)
    far[:, 5] = 80.0
    tok, lp = cpu_kernels.categorical_pick(jnp.asarray(far), jnp.asarray([0.1, 0.9]), (5,), 0.1)
    assert 5 not in np.asarray(tok).tolist()
    np.testing.assert_allclose(np.asarray(lp), [-800.0, -800.0], rtol=1e-6)


@needs_kernel
@pytest.mark.parametrize("b,kv,g,h,s", [(3, 2, 7, 64, 37), (1, 1, 1, 5, 1), (8, 2, 2, 16, 300)])
def test_decode_attention_matches_masked_softmax(b, kv, g, h, s):
    """Against a float64 masked softmax; a fully masked row gives zeros, like the model's."""
    rng = np.random.default_rng(s)
    q = rng.standard_normal((b, kv, g, h)).astype(np.float32)
    keys = rng.standard_normal((b, kv, h, s)).astype(np.float32)
    values = rng.standard_normal((b, kv, s, h)).astype(np.float32)
    mask = rng.random((b, s)) < 0.7
    mask[0, -1] = True
    if b > 1:
        mask[1] = False
    scale = h**-0.5
    got = np.asarray(jax.jit(cpu_kernels.decode_attention, static_argnums=4)(
        jnp.asarray(q), jnp.asarray(keys), jnp.asarray(values), jnp.asarray(mask), scale
    ))  # fmt: skip
    sc = np.einsum("bkgh,bkhs->bkgs", q.astype(np.float64), keys) * scale
    sc = np.where(mask[:, None, None], sc, -np.inf)
    top = np.max(sc, axis=-1, keepdims=True)
    e = np.where(mask[:, None, None], np.exp(sc - np.where(np.isfinite(top), top, 0)), 0.0)
    tot = e.sum(-1, keepdims=True)
    p = np.where(tot > 0, e / np.where(tot > 0, tot, 1), 0.0)
    want = np.einsum("bkgs,bksh->bkgh", p, values)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.sqrt(s))
    if b > 1:
        assert not got[1].any()


def test_rows_by_weight_rejects_a_weight_past_its_buffer():
    with pytest.raises(ValueError, match="no packed"):
        cpu_kernels.rows_by_weight(jnp.zeros((16 * 8,)), jnp.zeros((2, 8)), 16, offset=8)
    with pytest.raises(ValueError, match="no packed"):
        cpu_kernels.rows_by_weight(jnp.zeros((16, 8)), jnp.zeros((2, 8)), 16)


def test_gate():
    many = cpu_kernels.MAX_ROWS + 1
    assert not cpu_kernels.applies(2, jnp.bfloat16)
    assert not cpu_kernels.applies(many, jnp.float32)
    assert cpu_kernels.applies(2, jnp.float32) == cpu_kernels.available()


def test_build_failure_warns_and_falls_back(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXVRL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    # as in a process that has not loaded it (undone: the loaded library comes back)
    fresh = functools.cache(cpu_kernels._library.__wrapped__)
    monkeypatch.setattr(cpu_kernels, "_library", fresh)
    with pytest.warns(UserWarning, match="could not be built or loaded"):
        assert not cpu_kernels.available()
    assert not cpu_kernels.applies(2, jnp.float32) and not cpu_kernels.usable()
    assert not list(tmp_path.rglob("*.so"))  # no half-written library left behind


@needs_kernel
def test_sampler_with_and_without_the_kernel(tmp_path, monkeypatch, retrace):
    """Greedy and sampled decoding through the kernel give the tokens of XLA's dot and the
    same log-probs (tied head: the kernel also does the 151936-row-style table product)."""
    from jaxvrl.models import qwen2_5_vl

    hf_tiny.build(tmp_path, seed=8, tie=True)
    model = qwen2_5_vl.load(tmp_path)
    rng = np.random.default_rng(12)
    ids, mask = hf_tiny.left_pad(
        [
            hf_tiny.prompt(rng, images=[[1, 4, 4]], text_len=(3, 6)),
            hf_tiny.prompt(rng, text_len=(9, 12)),
        ]
    )
    grid = np.array([[1, 4, 4]])
    kw = dict(max_new_tokens=10, pixel_values=hf_tiny.patches(rng, grid), image_grid_thw=grid)
    runs, traced = {}, []
    real = cpu_kernels.rows_by_weight
    monkeypatch.setattr(cpu_kernels, "rows_by_weight", lambda *a: traced.append(a[2]) or real(*a))
    retrace()
    for name in ("kernel", "xla"):
        if name == "xla":
            assert traced  # the kernel was in the first runs' programs
            monkeypatch.setattr(cpu_kernels, "applies", lambda rows, dtype: False)
            monkeypatch.setattr(cpu_kernels, "usable", lambda: False)
            retrace()
        runs[name] = [
            generate(model, ids, mask, temperature=t, rng=jax.random.key(2), **kw)
            for t in (0.0, 1.0)
        ]
    for a, b in zip(runs["kernel"], runs["xla"]):
        np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
        np.testing.assert_allclose(np.asarray(a.logprobs), np.asarray(b.logprobs), atol=1e-5)


@needs_kernel
def test_decode_weights_are_packed_into_the_buffer_they_reuse(tmp_path):
    """The decode weights are an explicit pytree the caller keeps: prepared again with
    `reuse`, new weights go into the same memory and give their own tokens; a call without
    them prepares its own (same tokens); weights packed for fewer rows than a call's are refused;
    inside the caller's own jit the sampler gives the same tokens."""
    from flax import nnx

    from jaxvrl.models import qwen2_5_vl
    from jaxvrl.models.qwen2_5_vl import get_rope_index
    from jaxvrl.sampling.sampler import generation_config

    hf_tiny.build(tmp_path, seed=9, tie=False)
    model = qwen2_5_vl.load(tmp_path)
    rng = np.random.default_rng(5)
    ids, mask = hf_tiny.left_pad([hf_tiny.prompt(rng, text_len=(4, 7)) for _ in range(3)])
    graphdef, params = nnx.split(model)
    sampler = Sampler(graphdef, generation_config(model.config, max_new_tokens=6, temperature=0))
    kw = dict(max_new_tokens=6, temperature=0.0, sampler=sampler)
    weights = sampler.decode_weights(params, 3)
    assert weights.packed and weights.buf.ndim == 1 and not weights.rows
    first = generate(model, ids, mask, decode_weights=weights, **kw)
    own = generate(model, ids, mask, **kw)
    np.testing.assert_array_equal(np.asarray(own.tokens), np.asarray(first.tokens))
    where = weights.buf.unsafe_buffer_pointer()
    model.lm_head.kernel[...] = -model.lm_head.kernel[...]
    params = nnx.state(model)
    again = sampler.decode_weights(params, 3, reuse=weights)
    assert weights.buf.is_deleted() and again.buf.unsafe_buffer_pointer() == where
    flipped = generate(model, ids, mask, decode_weights=again, **kw)
    want = generate(model, ids, mask, max_new_tokens=6, temperature=0.0, decode_layout="model")
    np.testing.assert_array_equal(np.asarray(flipped.tokens), np.asarray(want.tokens))
    assert not np.array_equal(np.asarray(flipped.tokens), np.asarray(first.tokens))
    many = sampler.decode_weights(params, cpu_kernels.MAX_ROWS + 1)
    assert not many.packed and many.buf is None and many.rows
    # unpacked weights serve fewer rows (a narrowed slots loop's); packed ones not more
    fewer = generate(model, ids, mask, decode_weights=many, **kw)
    np.testing.assert_array_equal(np.asarray(fewer.tokens), np.asarray(flipped.tokens))
    with pytest.raises(ValueError, match="packed for at most 32 rows, this call has 33"):
        generate(model, ids, mask, decode_weights=again, num_samples=11, **kw)
    pos, deltas = get_rope_index(ids, mask, model.config, None, None, None)
    args = (jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(pos), jnp.asarray(deltas))
    direct = sampler(params, *args, jax.random.key(0), decode_weights=again).tokens
    traced = jax.jit(lambda p, *a: sampler(p, *a, jax.random.key(0)).tokens)(params, *args)
    np.testing.assert_array_equal(np.asarray(traced), np.asarray(direct))
    np.testing.assert_array_equal(np.asarray(direct), np.asarray(flipped.tokens))
