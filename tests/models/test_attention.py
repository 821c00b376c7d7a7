"""attend: the dense reference against numpy; the blocked ("flash") implementation against the
reference on outputs, gradients and attention statistics; its compiled memory."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxvrl.models import attention as A
from jaxvrl.models import attention_kernels as K
from jaxvrl.models import visibility as V
from jaxvrl.models.layers import masked_softmax, pool_masses

H = 8


def _inputs(seed, b, t, s, n, kh, h=H):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, t, n, h)).astype(np.float32)
    k = rng.normal(size=(b, s, kh, h)).astype(np.float32)
    v = rng.normal(size=(b, s, kh, h)).astype(np.float32)
    w = rng.normal(size=(b, t, n, h)).astype(np.float32)  # the linear functional for grads
    return q, k, v, w


def _pools(seed, key_valid):
    """vision and text: disjoint subsets of prompt, which skips each row's first valid key."""
    rng = np.random.default_rng(seed + 100)
    kv = np.asarray(key_valid)
    first = np.argmax(kv, axis=1)
    prompt = kv.copy()
    prompt[np.arange(kv.shape[0]), first] = False
    kind = rng.integers(0, 3, size=kv.shape)
    return {"vision": prompt & (kind == 0), "text": prompt & (kind == 1), "prompt": prompt}


def _left_padded(b, s, pads):
    kv = np.ones((b, s), bool)
    for row, pad in enumerate(pads):
        kv[row, :pad] = False
    return kv


def _numpy_attention(q, k, v, mask, scale, pools=None):
    """float64 reference: mask bool[B, T, S]; GQA by repeating each k/v head G times."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    logits = np.einsum("btnh,bsnh->bnts", q, k) * scale
    m = np.broadcast_to(mask[:, None], logits.shape)
    logits = np.where(m, logits, -np.inf)
    top = np.max(logits, axis=-1, keepdims=True)
    e = np.where(m, np.exp(logits - np.where(np.isfinite(top), top, 0.0)), 0.0)
    tot = e.sum(-1, keepdims=True)
    probs = np.where(tot > 0, e / np.where(tot > 0, tot, 1.0), 0.0)
    out = np.einsum("bnts,bsnh->btnh", probs, v)
    if pools is None:
        return out, None
    p = probs.mean(axis=1)
    mass = {name: (p * pools[name][:, None, :]).sum(-1) for name in A.POOLS}
    ok = mass["prompt"] > 0
    den = np.where(ok, mass["prompt"], 1.0)
    return out, (np.where(ok, mass["vision"] / den, 0), np.where(ok, mass["text"] / den, 0))


def _close(actual, desired, rtol=1e-5, err_msg=""):
    """Elementwise, with the absolute tolerance scaled to the largest reference magnitude."""
    desired = np.asarray(desired, np.float64)
    atol = rtol * max(float(np.abs(desired).max(initial=0.0)), 1e-30)
    np.testing.assert_allclose(np.asarray(actual, np.float64), desired, rtol, atol, err_msg=err_msg)


def test_xla_matches_numpy_and_the_model_softmax():
    b, t, n, kh = 2, 9, 4, 2
    q, k, v, _ = _inputs(0, b, t, t, n, kh)
    kv = _left_padded(b, t, [3, 0])
    pools = _pools(0, kv)
    scale = H**-0.5
    out, stats = A.attend(q, k, v, scale=scale, key_valid=kv, pools=pools)
    causal = np.arange(t)[None, :] <= np.arange(t)[:, None]
    mask = causal[None] & kv[:, None, :]
    ref_out, ref_stats = _numpy_attention(q, k, v, mask, scale, pools)
    _close(out, ref_out)
    _close(stats[0], ref_stats[0])
    _close(stats[1], ref_stats[1])
    assert np.all(np.asarray(out)[0, :3] == 0)  # queries before the first valid key see nothing
    # today's model formula (masked_softmax, then pool_masses) gives the same statistics
    qg = q.reshape(b, t, kh, n // kh, H)
    logits = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k) * scale
    probs = masked_softmax(logits, jnp.asarray(mask)[:, None, None])
    model_stats = pool_masses(probs, pools)
    _close(stats[0], model_stats[0])
    _close(stats[1], model_stats[1])


def _case(name):
    """(q, k, v, w, keyword arguments of attend, bool[B, T, S] mask) for one calling pattern."""
    if name == "causal_left_padding":  # training forward / prefill, T, S not whole blocks
        b, t, s, n, kh = 2, 13, 13, 4, 2
        kw = dict(key_valid=_left_padded(b, s, [4, 0]), block_q=4, block_k=5)
    elif name == "decode":  # one query at position 8 over a cache of 11 slots
        b, t, s, n, kh = 2, 1, 11, 4, 2
        kv = _left_padded(b, s, [2, 0])
        kv[:, 9:] = False  # unwritten slots
        kw = dict(key_valid=kv, q_positions=[8], k_positions=np.arange(s), block_k=4)
    elif name == "extend":  # three new tokens per row at slots 9..11 and 8..10, block > T
        b, t, s, n, kh = 2, 3, 16, 4, 2
        kv = _left_padded(b, s, [5, 1])
        kv[0, 12:] = kv[1, 11:] = False
        qp = np.stack([9 + np.arange(t), 8 + np.arange(t)])  # positions per row
        kw = dict(key_valid=kv, q_positions=qp, k_positions=np.arange(s), block_q=4, block_k=6)
    elif name == "segments":  # vision windows: non-causal, block-diagonal, -1 = padding
        b, t, s, n, kh = 1, 22, 22, 2, 2
        seg = np.repeat([0, 1, 2, 3, -1], [5, 7, 4, 4, 2])
        kw = dict(causal=False, q_segments=seg, k_segments=seg, block_q=8, block_k=8)
    else:
        raise ValueError(name)
    q, k, v, w = _inputs(len(name), b, t, s, n, kh)
    kv = np.asarray(kw.get("key_valid", np.ones((b, s), bool)))
    mask = np.broadcast_to(kv[:, None, :], (b, t, s))
    if kw.get("causal", True):
        qp = np.broadcast_to(kw.get("q_positions", np.arange(t)), (b, t))
        kp = np.broadcast_to(kw.get("k_positions", np.arange(s)), (b, s))
        mask = mask & (kp[:, None, :] <= qp[:, :, None])
    if "q_segments" in kw:
        mask = mask & (kw["q_segments"][None, :, None] == kw["k_segments"][None, None, :])
    return q, k, v, w, kw, mask


CASES = ["causal_left_padding", "decode", "extend", "segments"]


def _grads(q, k, v, w, kw, implementation):
    """out, stats and d<w, out>/d(q, k, v) under one jit."""

    def loss(q, k, v):
        out, stats = A.attend(q, k, v, scale=H**-0.5, implementation=implementation, **kw)
        return jnp.sum(out * w), (out, stats)

    fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
    grads, (out, stats) = fn(q, k, v)
    return out, stats, grads


@pytest.mark.parametrize("name", CASES)
def test_flash_matches_xla(name):
    q, k, v, w, kw, mask = _case(name)
    kw = dict(kw, pools=_pools(1, kw.get("key_valid", np.ones(mask[:, 0].shape, bool))))
    blocks = {key: kw.pop(key) for key in ("block_q", "block_k") if key in kw}
    ref_out, ref_stats, ref_grads = _grads(q, k, v, w, kw, "xla")
    out, stats, grads = _grads(q, k, v, w, dict(kw, **blocks), "flash")
    np_out, _ = _numpy_attention(q, k, v, mask, H**-0.5)
    _close(ref_out, np_out, err_msg="xla vs numpy")
    _close(out, ref_out, err_msg="out")
    for name_, g, ref in zip("qkv", grads, ref_grads):
        _close(g, ref, err_msg=f"d{name_}")
    _close(stats[0], ref_stats[0], err_msg="A_V")
    _close(stats[1], ref_stats[1], err_msg="A_X")
    blind = ~mask.any(-1)  # [B, T] queries that see no key: zeros, finite gradients
    assert np.all(np.asarray(out)[blind] == 0)
    assert np.all(np.asarray(stats[0])[blind] == 0) and np.all(np.asarray(stats[1])[blind] == 0)
    assert all(np.all(np.isfinite(g)) for g in grads)


def _runs(rng, t, window):
    """int32[t] segment ids: consecutive runs of 1..window positions."""
    lengths = []
    while sum(lengths) < t:
        lengths.append(int(rng.integers(1, window + 1)))
    return np.repeat(np.arange(len(lengths)), lengths)[:t].astype(np.int32)


@pytest.mark.parametrize(
    "b, t, n, kh, window, causal, per_row",
    [
        (1, 70, 4, 4, 8, False, False),  # vision windows: 70 not whole windows
        (2, 33, 4, 2, 5, True, True),  # GQA, causal, per-row runs, left padding
        (2, 16, 2, 1, 16, False, True),  # one window covering every query
        (1, 9, 2, 2, 1, False, False),  # each query alone
        (2, 300, 2, 1, 8, False, True),  # on TPUs 128-wide blocks: three of them, the last cut
    ],
)
def test_banded_matches_xla(b, t, n, kh, window, causal, per_row, monkeypatch):
    """The banded form (window given, any implementation but xla) against the dense reference
    on outputs, gradients and statistics, where segments are runs of at most `window`; with
    blocks as wide as the window (CPU) and, for a TPU program, rounded up to 128."""
    rng = np.random.default_rng(t + window)
    q, k, v, w = _inputs(t, b, t, t, n, kh)
    seg = np.stack([_runs(rng, t, window) for _ in range(b)]) if per_row else _runs(rng, t, window)
    kv = _left_padded(b, t, [3] + [0] * (b - 1)) if causal else np.ones((b, t), bool)
    kv[-1, -1] = False  # an invalid key inside a window
    kw = dict(key_valid=kv, causal=causal, q_segments=seg, k_segments=seg, pools=_pools(3, kv))
    ref_out, ref_stats, ref_grads = _grads(q, k, v, w, kw, "xla")
    runs = [("flash", "cpu"), ("splash", "cpu"), ("splash", "tpu")]
    for impl, platform in runs:
        monkeypatch.setattr(A, "target_platform", lambda p=platform: p)
        out, stats, grads = _grads(q, k, v, w, dict(kw, window=window), impl)
        _close(out, ref_out, err_msg=f"{impl} out")
        for name_, g, ref in zip("qkv", grads, ref_grads):
            _close(g, ref, err_msg=f"{impl} d{name_}")
        _close(stats[0], ref_stats[0], err_msg="A_V")
        _close(stats[1], ref_stats[1], err_msg="A_X")
    monkeypatch.undo()  # the real platform again (this CPU)
    # a window narrower than the runs breaks the promise: the banded form then differs
    if window > 2 and not causal:
        out, _, _ = _grads(q, k, v, w, dict(kw, window=max(1, window // 4)), "flash")
        assert not np.allclose(np.asarray(out), np.asarray(ref_out), atol=1e-3)


def test_fully_masked_rows_and_blocks_give_zeros():
    # row 0 has no valid key at all; row 1 only the last ones (whole key blocks skipped)
    b, t, n, kh = 2, 10, 4, 2
    q, k, v, w = _inputs(5, b, t, t, n, kh)
    kv = np.zeros((b, t), bool)
    kv[1, 7:] = True
    kw = dict(key_valid=kv, causal=False)
    ref_out, _, ref_grads = _grads(q, k, v, w, kw, "xla")
    out, _, grads = _grads(q, k, v, w, dict(kw, block_q=3, block_k=3), "flash")
    assert np.all(np.asarray(out)[0] == 0) and np.all(np.asarray(grads[0])[0] == 0)
    _close(out, ref_out)
    for g, ref in zip(grads, ref_grads):
        _close(g, ref)


def test_statistics_do_not_change_the_gradients():
    q, k, v, w, kw, _ = _case("decode")
    pools = _pools(2, kw["key_valid"])

    def loss(q, k, v, pools):
        out, _ = A.attend(q, k, v, scale=0.3, implementation="flash", pools=pools, **kw)
        return jnp.sum(out * w)

    def both(q, k, v):
        return jax.grad(loss, (0, 1, 2))(q, k, v, None), jax.grad(loss, (0, 1, 2))(q, k, v, pools)

    plain, with_stats = jax.jit(both)(q, k, v)
    for g, ref in zip(with_stats, plain):
        np.testing.assert_array_equal(g, ref)

    def stats_sum(q, implementation):  # statistics are gradient-free
        _, (a_v, a_x) = A.attend(
            q, k, v, scale=0.3, pools=pools, implementation=implementation, **kw
        )
        return jnp.sum(a_v) + jnp.sum(a_x)

    assert np.all(np.asarray(jax.grad(stats_sum)(q, "xla")) == 0)


def test_bfloat16_inputs():
    q, k, v, w, kw, _ = _case("causal_left_padding")
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    ref, _ = A.attend(q, k, v, scale=H**-0.5, key_valid=kw["key_valid"])
    out, _ = A.attend(q, k, v, scale=H**-0.5, implementation="flash", **kw)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.float32(out), np.float32(ref), atol=3e-2)


def test_resolve_and_argument_errors():
    assert A.resolve("auto", "cpu") == "xla"
    assert A.resolve("auto", "tpu") == "splash" and A.resolve("auto", "gpu") == "flash"
    assert A.resolve("flash", "cpu") == "flash"
    with pytest.raises(ValueError, match="unknown attention implementation"):
        A.resolve("dense", "cpu")
    q, k, v, _ = _inputs(0, 1, 2, 3, 2, 1)
    with pytest.raises(ValueError, match="resolve"):
        A.attend(q, k, v, scale=1.0, causal=False, implementation="auto")
    with pytest.raises(ValueError, match="needs positions"):
        A.attend(q, k, v, scale=1.0)
    with pytest.raises(ValueError, match="q_segments and k_segments"):
        A.attend(q, k, v, scale=1.0, causal=False, q_segments=np.zeros(2))


def test_splash_interpreted_matches_xla():
    # the Pallas kernel in the interpreter: causal, left padding, GQA, T = 200 padded to 256
    b, t, n, kh = 2, 200, 4, 2
    q, k, v, w = _inputs(6, b, t, t, n, kh)
    kv = _left_padded(b, t, [37, 0])
    kw = dict(key_valid=kv, pools=_pools(6, kv))
    ref_out, ref_stats, ref_grads = _grads(q, k, v, w, kw, "xla")
    splash = dict(kw, interpret=True, block_q=128, block_k=128)
    out, stats, grads = _grads(q, k, v, w, splash, "splash")
    _close(out, ref_out, err_msg="out")
    assert np.all(np.asarray(out)[0, :37] == 0)  # rows that see no key
    for name, g, ref in zip("qkv", grads, ref_grads):
        _close(g, ref, err_msg=f"d{name}")
    _close(stats[0], ref_stats[0], err_msg="A_V")  # from the blocked statistics pass
    _close(stats[1], ref_stats[1], err_msg="A_X")


def test_splash_interpreted_segments():
    # vision windows: non-causal, block-diagonal, a padding segment of its own
    q, k, v, _ = _inputs(7, 1, 150, 150, 2, 2)
    seg = np.repeat([0, 1, 2, -1], [64, 64, 12, 10])
    kw = dict(scale=H**-0.5, causal=False, q_segments=seg, k_segments=seg)
    ref, _ = A.attend(q, k, v, **kw)
    out, _ = jax.jit(
        lambda q, k, v: A.attend(q, k, v, implementation="splash", interpret=True, **kw)
    )(q, k, v)
    _close(out, ref)


def test_kernels_run_flash_or_xla_for_cache_positions():
    # index-causal kernels cannot take a cache's positions: a decode step runs "xla" and a cache
    # extend "flash" (no Pallas interpreter or GPU here, so a kernel call would fail)
    for name, implementations in (("decode", ("splash", "cudnn")), ("extend", ("cudnn",))):
        q, k, v, _, kw, _ = _case(name)
        ref, _ = A.attend(q, k, v, scale=0.3, **kw)
        for implementation in implementations:
            out, _ = A.attend(q, k, v, scale=0.3, implementation=implementation, **kw)
            _close(out, ref, err_msg=f"{name} {implementation}")


@pytest.mark.parametrize("name", ["causal_left_padding", "segments"])
def test_cudnn_arguments_through_the_xla_backend(name, monkeypatch):
    # the cuDNN path's mapping (mask, causal flag, scale, GQA, zeroed blind rows) checked with
    # jax.nn.dot_product_attention's XLA backend: no GPU here. The mask must be a whole
    # [B, 1, T, S] with T and S even: the cuDNN backend rejects one broadcast over T, and odd
    # lengths with a bias in training (the XLA backend accepts both); T = 13 here, padded
    masks = []
    dpa = jax.nn.dot_product_attention

    def recording(*args, mask=None, **kwargs):
        masks.append(None if mask is None else mask.shape)
        return dpa(*args, mask=mask, **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", recording)
    q, k, v, _, kw, _ = _case(name)
    kw = {key: val for key, val in kw.items() if key not in ("block_q", "block_k")}
    ref, _ = jax.jit(lambda q, k, v: A.attend(q, k, v, scale=H**-0.5, **kw))(q, k, v)
    causal = kw.get("causal", True)
    vis = V.make_visibility(
        q, k, kw.get("key_valid"), None, None, kw.get("q_segments"), kw.get("k_segments"), causal
    )
    blocks = V.Blocks(H**-0.5, causal, 512, 512)
    out = jax.jit(lambda q, k, v: K.cudnn(q, k, v, vis, blocks, masked=True, backend="xla"))
    _close(out(q, k, v), ref)
    even = lambda n: n + n % 2
    assert masks == [(q.shape[0], 1, even(q.shape[1]), even(k.shape[1]))]


def _gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


needs_gpu = pytest.mark.skipif(not _gpu(), reason="cuDNN attention needs a GPU")


@needs_gpu
@pytest.mark.parametrize("name", ["causal_left_padding", "segments"])
def test_cudnn_on_a_gpu_matches_xla(name):
    # the cuDNN kernel itself (bfloat16 inputs) against the dense reference in float32 on the
    # same bfloat16 values: outputs, gradients, statistics (its second, blocked pass); GQA
    q, k, v, w, kw, mask = _case(name)
    kw = {key: val for key, val in kw.items() if key not in ("block_q", "block_k")}
    kw["pools"] = _pools(3, kw.get("key_valid", np.ones(mask[:, 0].shape, bool)))
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    with jax.default_matmul_precision("highest"):
        ref_out, ref_stats, ref_grads = _grads(
            *(x.astype(jnp.float32) for x in (q, k, v)), w, kw, "xla"
        )
    out, stats, grads = _grads(q, k, v, w, kw, "cudnn")
    assert out.dtype == jnp.bfloat16
    # bfloat16 rounding of the kernel's output and of its gradients (8 bits of mantissa), on
    # values of the size of the largest reference
    for got, want, what in [(out, ref_out, "out"), *zip(grads, ref_grads, ("dq", "dk", "dv"))]:
        _close(np.float32(got), want, rtol=2e-2, err_msg=what)
    _close(stats[0], ref_stats[0], rtol=1e-2, err_msg="A_V")
    _close(stats[1], ref_stats[1], rtol=1e-2, err_msg="A_X")
    blind = ~mask.any(-1)
    assert np.all(np.float32(out)[blind] == 0)


@pytest.mark.parametrize("name", CASES + ["no_valid_key"])
def test_which_queries_see_a_key(name):
    # the kernels' blind-row rule (O(T + S) without segments) against the dense mask
    if name == "no_valid_key":
        q, k, v, _, kw, _ = _case("causal_left_padding")
        kw = dict(kw, key_valid=np.zeros_like(kw["key_valid"]))
    else:
        q, k, v, _, kw, _ = _case(name)
    causal = kw.get("causal", True)
    positions = kw.get("q_positions"), kw.get("k_positions")
    vis = V.make_visibility(
        q, k, kw.get("key_valid"), *positions, kw.get("q_segments"), kw.get("k_segments"), causal
    )
    for c in {causal, False}:
        want = np.asarray(A.visibility_mask(vis, c)).any(-1)
        want = np.broadcast_to(want, (q.shape[0], q.shape[1]))
        np.testing.assert_array_equal(V.sees_any(vis, c), want, err_msg=f"causal={c}")
        # where the arguments promise that every query sees itself, the kernels skip the rule
        args = kw.get("key_valid"), positions[0], kw.get("q_segments"), kw.get("k_segments"), c
        if V.every_query_sees_itself(q.shape[1], k.shape[1], *args):
            assert want.all(), f"causal={c}"
    # the promise holds for the vision tower's calls only: one segment array, no key masked
    seg = np.repeat([0, 1, -1], [3, 2, 1])
    assert V.every_query_sees_itself(6, 6, None, None, seg, seg, False)
    assert not V.every_query_sees_itself(6, 6, None, None, seg, seg.copy(), False)
    assert not V.every_query_sees_itself(6, 6, np.ones(6, bool), None, seg, seg, False)
    assert not V.every_query_sees_itself(6, 6, None, np.arange(6), None, None, True)


def test_precision_wrapper_keeps_values_and_gradients():
    # the wrapper that traces splash's forward and backward at one matmul precision
    def fn(q, k, v, i, j):
        return jnp.tanh(q @ k.T) @ v * (i.sum() + j.sum())

    q, k, v, _ = _inputs(8, 1, 3, 4, 1, 1)
    q, k, v = q[0, :, 0], k[0, :, 0], v[0, :, 0]
    i, j = jnp.arange(3), jnp.ones(4, jnp.int32)
    wrapped = K.at_precision(fn, "default")
    _close(wrapped(q, k, v, i, j), fn(q, k, v, i, j))
    for argnum in range(3):
        got = jax.grad(lambda *a: jnp.sum(wrapped(*a) ** 2), argnums=argnum)(q, k, v, i, j)
        want = jax.grad(lambda *a: jnp.sum(fn(*a) ** 2), argnums=argnum)(q, k, v, i, j)
        _close(got, want)


def test_splash_compiles_for_a_tpu_mesh():
    # forward and backward with statistics, compiled for v5e-4 (fsdp 2 x tensor 2) on this host
    from jaxvrl.parallel import topology
    from jaxvrl.parallel.sharding import make_mesh
    from tests.helpers import batch_sharding

    mesh = make_mesh(fsdp=2, tensor=2, devices=topology.tpu_devices(topology.parse("v5e-4")))
    b, t, n, kh, h = 4, 1000, 8, 2, 128

    def loss(q, k, v, kv):
        pools = {name: kv for name in A.POOLS}
        out, stats = A.attend(
            q, k, v, scale=h**-0.5, key_valid=kv, pools=pools, implementation="splash"
        )
        return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(stats[0])

    def arg(shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=batch_sharding(mesh, len(shape)))

    args = (arg((b, t, n, h)), arg((b, t, kh, h)), arg((b, t, kh, h)), arg((b, t), bool))
    with jax.set_mesh(mesh):
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile().as_text()
    assert text.count("tpu_custom_call") >= 2  # the kernel's forward and backward
    assert "all-gather" not in text  # each device runs its own rows and heads


def _temp_bytes(implementation, t, n, kh, h):
    q = jax.ShapeDtypeStruct((1, t, n, h), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, t, kh, h), jnp.float32)

    def loss(q, k, v):
        out, _ = A.attend(q, k, v, scale=h**-0.5, implementation=implementation)
        return jnp.sum(out * out)

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    return fn.lower(q, kv, kv).compile().memory_analysis().temp_size_in_bytes


def test_flash_memory_does_not_grow_with_t_times_s():
    # forward + backward at T = S = 2048, 4 heads of 32, blocks of 512
    n, kh, h = 4, 2, 32
    probs = n * 2048 * 2048 * 4  # one float32 [N, T, S] tensor: 64 MiB
    dense, flash = (_temp_bytes(impl, 2048, n, kh, h) for impl in ("xla", "flash"))
    assert dense >= 2 * probs  # the reference holds [T, S] logits and probabilities (258 MiB)
    assert flash < probs // 2, (flash, dense)  # a few [N, 512, 512] blocks (25 MiB)


@pytest.mark.parametrize("segments", [True, False])
@pytest.mark.parametrize("causal, sliding", [(True, 0), (True, 7), (True, 1), (False, 0)])
def test_which_queries_see_any_key_equals_the_whole_mask(causal, sliding, segments):
    """With segments or a sliding window the kernels' guard against queries that see no key
    never builds the [T, S] mask: a sort of the keys and a binary search per query; the same
    answer as the whole mask for unordered segments and positions (repeated ones too), keys
    and queries of other lengths."""
    rng = np.random.default_rng(0)
    b, t, s = 2, 50, 37
    valid = jnp.asarray(rng.random((b, s)) < 0.6)
    q_seg = jnp.asarray(rng.integers(0, 9, (b, t)), jnp.int32)
    k_seg = jnp.asarray(rng.integers(0, 7, (b, s)), jnp.int32)
    q_pos = jnp.asarray(rng.integers(0, 40, (b, t)), jnp.int32)
    k_pos = jnp.asarray(rng.integers(0, 40, (b, s)), jnp.int32)
    if not segments:
        q_seg = k_seg = None
    vis = V.Visibility(valid, q_pos, k_pos, q_seg, k_seg)
    want = np.asarray(jnp.any(V.visibility_mask(vis, causal, sliding=sliding), -1))
    want = np.broadcast_to(want, (b, t))
    assert want.any() and (not want.all() or not segments)
    np.testing.assert_array_equal(np.asarray(V.sees_any(vis, causal, sliding)), want)
