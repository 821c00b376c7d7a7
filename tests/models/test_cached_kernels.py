"""The decode steps' Pallas TPU attention kernel (`jaxvrl.models.cached_kernels`): in Pallas's
interpreter on the CPU it equals the dense form (`cached_attention._dense`: outputs and the
pool masses) for grouped heads, several row and key blocks, partly written caches, a row
and a block of rows that see no key, and bfloat16; compiled for a TPU by the TPU compiler, XLA prices it by the
bytes it reads (the cache, the queries and outputs), where the dense form passes several
times the cache; and the samplers' tokens, log-probs and masses with it are the CPU form's.

Tolerances: float32 sums over at most S = 1,152 keys in another order (blocks of 512 with an
online softmax): 2e-6 on outputs of magnitude ~1 and on masses in [0, 1], times H / 64 for
scores summed over more than 64 head dimensions (in another order where the keys lie by
slot). bfloat16: the
products' inputs round alike in both; the sums differ by a bf16 rounding of the output (2^-8).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxvrl.models import cached_kernels as ck
from jaxvrl.models.cached_attention import IMPLEMENTATIONS, _dense


def _problem(seed, b, kh, g, h, s, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    qg = jnp.asarray(rng.normal(size=(b, 1, kh, g, h)), dtype)
    k = jnp.asarray(rng.normal(size=(b, kh, h, s)), dtype)
    v = jnp.asarray(rng.normal(size=(b, kh, s, h)), dtype)
    # each row: left padding, then its keys up to a written slot; row 1 sees nothing
    mask = np.zeros((b, 1, s), bool)
    written = int(rng.integers(s // 3, s - 1))
    for r in range(b):
        mask[r, 0, int(rng.integers(0, 9)) : written - int(rng.integers(0, 5))] = True
    mask[1 % b] = False
    pools = {name: jnp.asarray(rng.random((b, s)) < 0.3) for name in ck.POOLS}
    return qg, k, v, jnp.asarray(mask), pools


@pytest.mark.parametrize(
    "b,kh,g,h,s,layout",
    [(3, 2, 3, 16, 200, "BKHS"), (16, 2, 4, 32, 1152, "BKHS"), (2, 1, 7, 128, 1024, "BKHS"),
     (16, 2, 4, 32, 1152, "BKSH"), (3, 1, 7, 128, 640, "BKSH")],
    ids=["one-block", "row-and-key-blocks", "7b-heads", "keys-by-slot", "keys-by-slot-7b-heads"],
)  # fmt: skip
def test_the_kernel_equals_the_dense_form(b, kh, g, h, s, layout):
    """Keys positions-minor [B, K, H, S] (the reference's layout) or second-minor [B, K, S, H]
    (the accelerators' cache), the latter given to the kernel transposed."""
    qg, k, v, mask, pools = _problem(b * s, b, kh, g, h, s)
    if b >= 16:  # a whole block of 8 rows that see nothing (ended rows): skipped
        mask = mask.at[8:].set(False)
    keys = k if layout == "BKHS" else jnp.swapaxes(k, 2, 3)
    tol = 2e-6 * max(1.0, h / 64)
    for with_pools in (None, pools):
        want, want_stats = _dense(qg, k, v, mask, scale=0.3, pools=with_pools, dtype=jnp.float32)
        got, stats = ck.tpu_decode(
            qg, keys, v, mask, scale=0.3, pools=with_pools, dtype=jnp.float32, interpret=True,
            key_layout=layout,
        )  # fmt: skip
        np.testing.assert_allclose(got, want, atol=tol)
        assert not np.asarray(got[1]).any()  # a row that sees no key: zeros, not NaN
        assert not np.asarray(got[8:]).any()
        if with_pools is None:
            assert stats is None
            continue
        for a, w in zip(stats, want_stats):
            np.testing.assert_allclose(a, w, atol=tol)
        assert np.asarray(stats[0]).max() > 0.1


def _paged_case(kernel, seed, sizes, spans, atol=2e-6, table=None, **kw):
    """`kernel` (a paged decode: pages [P, K, ps, H] read through each row's table) against
    the dense form over the pages the tables gather, rows seeing the slots `spans` (lo, hi)
    of theirs, without and with pools: outputs and pool masses; a row that sees nothing
    gives zeros. sizes: (b, kh, g, h, ps, n, pages); table: int32[b, n] (default pages
    drawn at random). -> the problem's arrays."""
    from jaxvrl.models.cached_attention import gather_pages

    rng = np.random.default_rng(seed)
    b, kh, g, h, ps, n, pages = sizes
    kp = jnp.asarray(rng.normal(size=(pages, kh, ps, h)), jnp.float32)
    vp = jnp.asarray(rng.normal(size=(pages, kh, ps, h)), jnp.float32)
    if table is None:
        table = rng.permutation(pages)[: b * n].reshape(b, n)
    table = jnp.asarray(table, jnp.int32)
    qg = jnp.asarray(rng.normal(size=(b, 1, kh, g, h)), jnp.float32)
    mask = np.zeros((b, 1, n * ps), bool)
    for r, (lo, hi) in enumerate(spans):
        mask[r, 0, lo:hi] = True
    mask = jnp.asarray(mask)
    pools = {name: jnp.asarray(rng.random((b, n * ps)) < 0.3) for name in ck.POOLS}
    k, v = gather_pages(kp, vp, table, "BKSH")
    for with_pools in (None, pools):
        want, want_stats = _dense(qg, k, v, mask, scale=0.3, pools=with_pools,
                                  dtype=jnp.float32, key_layout="BKSH")  # fmt: skip
        got, stats = kernel(qg, kp, vp, table, mask, scale=0.3, pools=with_pools,
                            dtype=jnp.float32, **kw)  # fmt: skip
        np.testing.assert_allclose(got, want, atol=atol)
        assert not np.asarray(got)[[i for i, (lo, hi) in enumerate(spans) if lo == hi]].any()
        if with_pools is not None:
            for a, w in zip(stats, want_stats):
                np.testing.assert_allclose(a, w, atol=atol)
    return qg, kp, vp, table, mask, pools


def test_the_paged_kernel_equals_the_dense_form_over_gathered_pages():
    """The kernel reading each row's pages [P, K, ps, H] where they lie (Pallas's TPU
    interpreter: its copies and semaphores): rows whose tables spread over the pages, a row
    that sees nothing, tables padded to whole blocks of pages, several blocks per row (rows
    that stop seeing keys early read fewer), pool masses; equal to the dense form over the
    pages gathered by the tables."""
    spans = [(3, 80), (0, 0), (10, 30), (0, 88)]
    _paged_case(ck.tpu_paged_decode, 5, (4, 2, 2, 16, 8, 11, 50), spans, interpret=True,
                block=32)  # fmt: skip
    # the engine's tables: a prompt's 3 pages, then the slot's own 8, each a run of
    # consecutive pages (a block of 4 pages inside a run comes in one copy; the block that
    # straddles the two runs, and the padded last one, page by page)
    engine = [[*range(3 * (r // 2), 3 * (r // 2) + 3), *range(20 + 8 * r, 28 + 8 * r)]
              for r in range(4)]  # fmt: skip
    _paged_case(ck.tpu_paged_decode, 6, (4, 2, 2, 16, 8, 11, 60), spans, interpret=True,
                block=32, table=engine)  # fmt: skip


def _gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def _gpu_paged_case(g: int, interpret: bool, atol: float = 2e-6):
    """The GPU paged kernel against the dense form (`_paged_case`): each row reads its own
    pages up to its last visible slot."""
    spans = [(3, 40), (0, 0), (0, 48)]
    return _paged_case(ck.gpu_paged_decode, 7, (3, 2, g, 16, 8, 6, 30), spans, atol=atol,
                       interpret=interpret)  # fmt: skip


@pytest.mark.parametrize("g", [3, 4])  # 3: the query heads padded to Triton's power of two
def test_the_gpu_paged_kernel_equals_the_dense_form_and_lowers_for_cuda(g):
    """The Pallas Triton kernel (GPUs) in Pallas's interpreter equals the dense form
    (`_gpu_paged_case`); lowered for CUDA on this host (jax.export), it is one Triton call."""
    from jax import export

    qg, kp, vp, table, mask, pools = _gpu_paged_case(g, interpret=True)

    def step(qg, kp, vp, table, mask):
        return ck.gpu_paged_decode(qg, kp, vp, table, mask, scale=0.3, pools=pools,
                                   dtype=jnp.bfloat16)  # fmt: skip

    triton = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    lowered = export.export(jax.jit(step), platforms=["cuda"], disabled_checks=[triton])(
        qg, kp, vp, table, mask
    )
    text = lowered.mlir_module()
    assert text.count("__gpu$xla.gpu.triton") == 1 and "jaxvrl_paged_decode_gpu" in text


@pytest.mark.skipif(not _gpu(), reason="needs a GPU")
def test_the_gpu_paged_kernel_on_a_gpu():
    """Compiled by Triton on the GPU, 7 query heads a KV head (Qwen2.5-VL-7B's): the dense
    reference at full float32 matmul precision (a GPU's default rounds to TF32); the GPU's
    exp and the summation order: 1e-5 on values of magnitude ~1."""
    with jax.default_matmul_precision("highest"):
        _gpu_paged_case(7, interpret=False, atol=1e-5)


def test_the_kernel_in_bfloat16():
    qg, k, v, mask, pools = _problem(1, 8, 2, 4, 64, 640, jnp.bfloat16)
    want, (wv, wx) = _dense(qg, k, v, mask, scale=0.125, pools=pools, dtype=jnp.bfloat16)
    got, (gv, gx) = ck.tpu_decode(
        qg, k, v, mask, scale=0.125, pools=pools, dtype=jnp.bfloat16, interpret=True
    )
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.float32(got), np.float32(want), atol=2**-7, rtol=2**-7)
    np.testing.assert_allclose(gv, wv, atol=2e-3)
    np.testing.assert_allclose(gx, wx, atol=2e-3)


def test_more_than_one_query_falls_back_to_the_dense_form():
    qg, k, v, mask, _ = _problem(2, 2, 1, 2, 8, 40)
    qg2 = jnp.concatenate([qg, qg * 0.5], axis=1)
    mask2 = jnp.concatenate([mask, mask], axis=1)
    want = _dense(qg2, k, v, mask2, scale=1.0, pools=None, dtype=jnp.float32)[0]
    got = IMPLEMENTATIONS["tpu_interpret"](qg2, k, v, mask2, scale=1.0, pools=None,
                                           dtype=jnp.float32)[0]  # fmt: skip
    np.testing.assert_array_equal(got, want)


def test_the_tpu_compiler_prices_the_kernel_by_the_bytes_it_reads():
    """The 7B's decode attention per chip (32 rows, 1 KV head of 7 queries, 2,048 slots,
    bfloat16) compiled for a v5p chip: XLA's cost analysis of the kernel (keys either way,
    and the paged kernel) is the cache, the queries, the outputs and the mask; of the dense
    form several times the cache."""
    pytest.importorskip("libtpu", reason="the TPU compiler: pip install -e '.[tpu]'")
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jaxvrl.parallel import topology as T

    mesh = Mesh(np.array(T.tpu_devices(T.parse("v5p-8"))[:1]), ("d",))
    at = NamedSharding(mesh, PartitionSpec())
    b, kh, g, h, s = 32, 1, 7, 128, 2048
    bf = jnp.bfloat16
    dtypes = [bf, bf, bf, bool]
    cache = 2 * b * kh * h * s * 2

    def priced(impl, layout="BKHS"):
        keys = (b, kh, h, s) if layout == "BKHS" else (b, kh, s, h)
        shapes = [(b, 1, kh, g, h), keys, (b, kh, s, h), (b, 1, s)]
        args = [jax.ShapeDtypeStruct(x, d, sharding=at) for x, d in zip(shapes, dtypes)]
        kw = dict(scale=0.09, pools=None, dtype=bf, key_layout=layout)
        fn = jax.jit(lambda q, k, v, m: impl(q, k, v, m, **kw))
        with jax.set_mesh(mesh):
            compiled = fn.lower(*args).compile()
        assert "jaxvrl_decode_attention" in compiled.as_text() or impl is _dense
        return compiled.cost_analysis()["bytes accessed"]

    # besides the cache (512 bytes a slot here): queries and outputs (0.3%), the mask as
    # int32 (4 bytes a slot, written once and read twice: 2.3%)
    for layout in ("BKHS", "BKSH"):
        kernel = priced(IMPLEMENTATIONS["tpu"], layout)
        assert cache <= kernel <= 1.05 * cache, (layout, kernel / cache)
    dense = priced(_dense)
    assert dense > 2.5 * cache, dense / cache
    # the paged kernel (pages of 16 slots, the rows' tables over them) as the cache it reads,
    # and its tables read once more for the runs of consecutive pages (in (8, 128) tiles:
    # 0.8% here, where a row's table is 128 pages of 16 slots)
    n = s // 16
    shapes = [(b, 1, kh, g, h), (b * n, kh, 16, h), (b * n, kh, 16, h), (b, n), (b, 1, s)]
    types = [bf, bf, bf, jnp.int32, bool]
    args = [jax.ShapeDtypeStruct(x, d, sharding=at) for x, d in zip(shapes, types)]
    fn = jax.jit(lambda *a: ck.tpu_paged_decode(*a, scale=0.09, pools=None, dtype=bf))
    with jax.set_mesh(mesh):
        compiled = fn.lower(*args).compile()
    assert "jaxvrl_decode_attention" in compiled.as_text()
    paged = compiled.cost_analysis()["bytes accessed"]
    assert cache <= paged <= 1.06 * cache, paged / cache


def test_the_kernel_per_device_on_a_rollout_mesh():
    """On 8 CPU devices, rows over data 2 and key/value heads over tensor 4 (the rollout
    mesh's split of the cache): each device runs the kernel on its rows and heads, the pool
    masses are averaged over every device's heads; equal to the dense form on one device.
    Likewise the paged kernel, its pages split by head only (every row group reads any
    page), over the same keys and values cut into shuffled pages of 20 slots."""
    from tests.parallel.common import run_with_devices

    out = run_with_devices(
        """
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import NamedSharding, PartitionSpec as P
        from jaxvrl.parallel.sharding import make_mesh
        from jaxvrl.models.cached_attention import IMPLEMENTATIONS, _dense
        from tests.models.test_cached_kernels import _problem

        qg, k, v, mask, pools = _problem(3, 4, 4, 2, 16, 300)
        want, stats = _dense(qg, k, v, mask, scale=0.3, pools=pools, dtype=jnp.float32)
        mesh = make_mesh(data=2, fsdp=1, tensor=4)
        put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
        args = (put(qg, P("data", None, "tensor")), put(k, P("data", "tensor")),
                put(v, P("data", "tensor")), put(mask, P("data")),
                {n: put(x, P("data")) for n, x in pools.items()})
        fn = jax.jit(lambda q, k, v, m, p: IMPLEMENTATIONS["tpu_interpret"](
            q, k, v, m, scale=0.3, pools=p, dtype=jnp.float32))
        with jax.set_mesh(mesh):
            got, got_stats = fn(*args)
            text = fn.lower(*args).as_text()
        assert "shard_map" in text or "sdy.manual_computation" in text
        np.testing.assert_allclose(got, want, atol=2e-6)
        for a, b in zip(got_stats, stats):
            np.testing.assert_allclose(a, b, atol=2e-6)

        from jaxvrl.models.cached_attention import PAGED
        rows, kh, s, h, ps = 4, 4, 300, 16, 20
        n = s // ps
        by_slot = lambda x: np.asarray(x).reshape(rows, kh, n, ps, h).transpose(0, 2, 1, 3, 4)
        order = np.random.default_rng(0).permutation(rows * n)  # page i lies at order[i]
        kp, vp = np.zeros((2, rows * n, kh, ps, h), np.float32)
        kp[order] = by_slot(np.swapaxes(k, 2, 3)).reshape(-1, kh, ps, h)
        vp[order] = by_slot(v).reshape(-1, kh, ps, h)
        table = order.reshape(rows, n).astype(np.int32)
        paged = jax.jit(lambda q, kp, vp, t, m, p: PAGED["tpu_interpret"](
            q, kp, vp, t, m, scale=0.3, pools=p, dtype=jnp.float32))
        with jax.set_mesh(mesh):
            got, got_stats = paged(args[0], put(kp, P(None, "tensor")), put(vp, P(None, "tensor")),
                                   put(table, P("data")), args[3], args[4])
        np.testing.assert_allclose(got, want, atol=2e-6)
        for a, b in zip(got_stats, stats):
            np.testing.assert_allclose(a, b, atol=2e-6)
        print("OK")
        """
    )
    assert out.strip().endswith("OK")


def test_the_kernel_asked_for_elsewhere_than_on_tpus_is_a_config_error(tmp_path, monkeypatch):
    import types

    import jaxvrl.train as T
    from jaxvrl.config import ConfigError, load_config
    from jaxvrl.trainer.setup import check_decode_attention

    # the run ends there before the model loads
    monkeypatch.setattr(T, "load_model", lambda *a: pytest.fail("the model was loaded"))
    run = load_config("configs/tprl.py", ["rollout.decode_attention=tpu", f"workdir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"rollout.decode_attention='tpu'.* runs on cpu"):
        T.run(run)

    asked = load_config("configs/tprl.py", ["rollout.decode_attention=tpu"])
    with pytest.raises(ConfigError, match=r"rollout.decode_attention='tpu'.* runs on cpu"):
        check_decode_attention(asked, types.SimpleNamespace(platform="cpu"))
    check_decode_attention(asked, types.SimpleNamespace(platform="tpu"))
    gpu = load_config("configs/tprl.py", ["rollout.decode_attention=gpu"])
    with pytest.raises(ConfigError, match=r"rollout.decode_attention='gpu'.* runs on tpu"):
        check_decode_attention(gpu, types.SimpleNamespace(platform="tpu"))
    check_decode_attention(gpu, types.SimpleNamespace(platform="gpu"))
    odd = load_config("configs/tprl.py", ["rollout.decode_attention=gpu", "rollout.page_size=10"])
    with pytest.raises(ConfigError, match=r"rollout.page_size=10: the GPU paged kernel"):
        check_decode_attention(odd, types.SimpleNamespace(platform="gpu"))
    check_decode_attention(load_config("configs/tprl.py"), types.SimpleNamespace(platform="cpu"))


def test_keys_by_slot_hold_what_positions_minor_keys_hold():
    """The caches' two key layouts (`KVCache.key_layout`): a prefill's keys written by
    `KVCache.filled`, a decode step's new keys stored into pages at each row's write slot
    (`PagedLayer.store`) and gathered by the rows' tables are the same numbers, transposed;
    the dense cached attention over either gives the same outputs and masses."""
    from jaxvrl.models.cache import KVCache, PagedLayer
    from jaxvrl.models.cached_attention import attend_cache, gather_pages
    from jaxvrl.models.config import TextConfig

    rng = np.random.default_rng(3)
    b, kh, g, h, ps, n = 3, 2, 2, 8, 4, 3
    cfg = TextConfig(num_key_value_heads=kh, head_dim=h, num_hidden_layers=2)
    k_new = jnp.asarray(rng.normal(size=(2, b, 5, kh, h)), jnp.float32)
    valid = jnp.asarray(rng.random((b, 5)) < 0.8)
    caches = {lay: KVCache.init(cfg, b, 9, key_layout=lay).filled(k_new, k_new, valid)
              for lay in ("BKHS", "BKSH")}  # fmt: skip
    for a, c in zip(caches["BKHS"].k, caches["BKSH"].k):
        np.testing.assert_array_equal(jnp.swapaxes(a, -1, -2), c)
    assert caches["BKSH"].index == 5 and not caches["BKSH"].empty

    pages = jnp.asarray(rng.normal(size=(10, kh, h, ps)), jnp.float32)
    values = jnp.asarray(rng.normal(size=(10, kh, ps, h)), jnp.float32)
    table = jnp.asarray(rng.permutation(10)[: b * n].reshape(b, n), jnp.int32)
    write = jnp.asarray([0, 5, 11], jnp.int32)
    new = jnp.asarray(rng.normal(size=(b, 1, kh, h)), jnp.float32)
    hs = PagedLayer(pages, values, table, write).store(new, new)
    sh = PagedLayer(jnp.swapaxes(pages, -1, -2), values, table, write, "BKSH").store(new, new)
    k_hs, v_hs = gather_pages(hs.k, hs.v, table)
    k_sh, v_sh = gather_pages(sh.k, sh.v, table, "BKSH")
    np.testing.assert_array_equal(jnp.swapaxes(k_hs, -1, -2), k_sh)
    np.testing.assert_array_equal(v_hs, v_sh)
    rows = jnp.arange(b)
    np.testing.assert_array_equal(k_sh[rows, :, write], new[:, 0])  # each row's write slot

    qg = jnp.asarray(rng.normal(size=(b, 1, kh, g, h)), jnp.float32)
    mask = jnp.asarray(rng.random((b, 1, n * ps)) < 0.7)
    pools = {name: jnp.asarray(rng.random((b, n * ps)) < 0.4) for name in ck.POOLS}
    kw = dict(scale=0.3, dtype=jnp.float32, pools=pools, table=table)
    out_hs, stats_hs = attend_cache(qg, hs.k, hs.v, mask, **kw)
    out_sh, stats_sh = attend_cache(qg, sh.k, sh.v, mask, **kw, key_layout="BKSH")
    np.testing.assert_allclose(out_sh, out_hs, atol=1e-6)
    for a, c in zip(stats_sh, stats_hs):
        np.testing.assert_allclose(a, c, atol=1e-6)
