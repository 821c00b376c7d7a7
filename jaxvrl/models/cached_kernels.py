"""A decode step's attention over a KV cache as one Pallas TPU kernel (`tpu_decode`): the
`attend_cache` implementation "tpu" (`jaxvrl.models.cached_attention`).

XLA compiles the dense form (two einsums around a masked softmax) into several fusions that
pass the float32 scores [rows, heads, S] through HBM between them, and reads every slot of
the cache whether written or not. Here each (block of rows, key/value head) streams its keys
[H, S] and values [S, H] through VMEM once, in blocks of positions, with an online softmax:
scores, probabilities and the pool masses never leave the chip, and key blocks past a block
of rows' last visible slot are neither read nor computed (none at all for rows that see no
key: the static sampler hides the cache of rows that have ended).

Arrays are the cache's layouts (`KVCache`): queries qg [B, 1, K, G, H], keys [B, K, H, S] or
[B, K, S, H] (`key_layout`: the latter is what accelerators' caches hold), values
[B, K, S, H], the mask bool[B, 1, S] of the slots each row's query sees; pools (the attention
masses' key pools) {"vision", "text", "prompt"} bool[B, S]. Under a mesh it runs
per device (shard_map: rows as the batch is split, key/value heads as the heads); the heads
average of the pool masses is taken after, across devices. `interpret=True` runs it on the
CPU (Pallas's interpreter: the tests' reference check). The slots engine's pages are read
where they lie by `tpu_paged_decode` on TPUs and `gpu_paged_decode` (Pallas Triton) on GPUs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton
from jax.sharding import PartitionSpec as P

from jaxvrl.models.attention import POOLS, pool_ratios
from jaxvrl.parallel.sharding import logical_to_spec, traced_mesh

_NEG = -1e30  # a finite "minus infinity": a block with no visible key adds exp(-huge) = 0
_LANES = 128


def _divisor(n: int, sizes: tuple[int, ...]) -> int:
    """The first of `sizes` that divides n, else n (a block of the whole axis)."""
    return next((s for s in sizes if n % s == 0), n)


def row_block(rows: int) -> int:
    """The rows a grid step of the kernel takes, of one device's `rows`."""
    return _divisor(rows, (8, 4, 2, 1))


def _dots(dtype):
    """(dot, dot_nt) in float32: a @ b, and a @ b.T (the keys lying by slot)."""
    # bfloat16 products are exact at the default precision (Mosaic refuses float32 contract
    # precision for them, which the training programs set as the default); float32: highest
    exact = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else jax.lax.Precision.DEFAULT
    dot = functools.partial(jnp.dot, preferred_element_type=jnp.float32, precision=exact)
    dot_nt = functools.partial(
        jax.lax.dot_general, dimension_numbers=(((1,), (1,)), ((), ())),
        preferred_element_type=jnp.float32, precision=exact,
    )  # fmt: skip
    return dot, dot_nt


def _unpack(refs, pools: bool):
    """The kernels' refs after the queries, keys, values and validity: (pool input, output,
    masses output, the online softmax's scratch (m, l, acc, pool masses), the rest)."""
    if pools:
        pool_ref, o_ref, mass_ref, m_sc, l_sc, acc_sc, p_sc, *rest = refs
        return pool_ref, o_ref, mass_ref, (m_sc, l_sc, acc_sc, p_sc), rest
    o_ref, m_sc, l_sc, acc_sc, *rest = refs
    return None, o_ref, None, (m_sc, l_sc, acc_sc, None), rest


def _start(m_sc, l_sc, acc_sc, p_sc):
    m_sc[...] = jnp.full(m_sc.shape, _NEG, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)
    if p_sc is not None:
        p_sc[...] = jnp.zeros(p_sc.shape, jnp.float32)


def _accumulate(r, q_ref, k, v, valid_ref, pool_ref, sc, *, scale, keys_minor):
    """Row r's G queries over this block of keys k [H, bs] (keys_minor) or [bs, H] and values
    v [bs, H], into the online softmax's scratch."""
    m_sc, l_sc, acc_sc, p_sc = sc
    dot, dot_nt = _dots(k.dtype)
    # [G, H] x [H, bs], or [G, H] x [bs, H] contracted over H
    s = (dot(q_ref[r], k) if keys_minor else dot_nt(q_ref[r], k)) * scale
    ok = valid_ref[r] > 0  # [1, bs]
    s = jnp.where(ok, s, _NEG)  # [G, bs]
    m_prev = m_sc[r]  # [G, 128], every lane alike
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    p = jnp.where(ok, jnp.exp(s - m_new[:, :1]), 0.0)
    alpha = jnp.exp(m_prev - m_new)
    l_sc[r] = alpha * l_sc[r] + jnp.sum(p, axis=1, keepdims=True)
    acc_sc[r] = alpha[:, :1] * acc_sc[r] + dot(p.astype(v.dtype), v)
    m_sc[r] = m_new
    if p_sc is not None:
        lane = jax.lax.broadcasted_iota(jnp.int32, p_sc.shape[1:], 1)
        add = jnp.zeros(p_sc.shape[1:], jnp.float32)
        for i in range(len(POOLS)):
            mass = jnp.sum(p * pool_ref[r, i : i + 1, :], axis=1, keepdims=True)
            add = jnp.where(lane == i, mass, add)
        p_sc[r] = alpha * p_sc[r] + add


def _inverse(total):
    """1 / the softmax's denominator, 0 where a row saw no key (its output and masses 0)."""
    return jnp.where(total > 0, 1.0 / jnp.where(total > 0, total, 1.0), 0.0)


def _finish(rows, o_ref, mass_ref, sc):
    m_sc, l_sc, acc_sc, p_sc = sc
    for r in range(rows):
        total = l_sc[r]
        inv = _inverse(total)
        o_ref[r] = (acc_sc[r] * inv[:, :1]).astype(o_ref.dtype)
        if p_sc is not None:
            mass_ref[r] = p_sc[r] * inv


def _kernel(filled, q_ref, k_ref, v_ref, valid_ref, *refs, scale, rows, pools, keys_minor):
    """One (block of rows, key/value head, block of positions) grid step: the online softmax
    of every row's G queries over this block of keys, and at the last block its output (and
    the probability mass on each pool, lanes 0..2 of a [G, 128] tile)."""
    pool_ref, o_ref, mass_ref, sc, _ = _unpack(refs, pools)
    j = pl.program_id(2)
    pl.when(j == 0)(lambda: _start(*sc))

    @pl.when(j < filled[pl.program_id(0)])  # past the block's last visible slot: nothing
    def _():
        for r in range(rows):
            _accumulate(
                r, q_ref, k_ref[r], v_ref[r], valid_ref, pool_ref, sc, scale=scale,
                keys_minor=keys_minor,
            )  # fmt: skip

    pl.when(j == pl.num_programs(2) - 1)(lambda: _finish(rows, o_ref, mass_ref, sc))


def _paged_kernel(
    block_filled, row_filled, table, runs, q_ref, k_hbm, v_hbm, valid_ref, *refs, scale, rows,
    pools, page_size, per_block,
):  # fmt: skip
    """As `_kernel`, the keys and values read from pages [P, K, ps, H] left in HBM: each row
    of the block copies its `per_block` pages of this block (its table's) into VMEM, only
    while the block holds a slot it sees; a row past its last one copies and computes
    nothing. Pages that lie in a run (runs[row, j]: consecutive pages, as a prompt's and a
    slot's own are allocated) come in one copy each of keys and values, others page by
    page."""
    pool_ref, o_ref, mass_ref, sc, (k_buf, v_buf, sem) = _unpack(refs, pools)
    i, hh, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    pl.when(j == 0)(lambda: _start(*sc))

    def copy(copies):
        for c in copies:
            c.start()
        for c in copies:
            c.wait()

    def row_step(r):
        row = i * rows + r
        first = table[row, j * per_block]

        @pl.when(runs[row, j] > 0)
        def _():
            at = pl.ds(first, per_block)
            copy([pltpu.make_async_copy(k_hbm.at[at, hh], k_buf.at[r], sem.at[0, r]),
                  pltpu.make_async_copy(v_hbm.at[at, hh], v_buf.at[r], sem.at[1, r])])  # fmt: skip

        @pl.when(runs[row, j] == 0)
        def _():
            copies = []
            for p in range(per_block):
                page = table[row, j * per_block + p]
                copies.append(pltpu.make_async_copy(k_hbm.at[page, hh], k_buf.at[r, p],
                                                    sem.at[0, r]))  # fmt: skip
                copies.append(pltpu.make_async_copy(v_hbm.at[page, hh], v_buf.at[r, p],
                                                    sem.at[1, r]))  # fmt: skip
            copy(copies)

        bs = per_block * page_size
        k, v = k_buf[r].reshape(bs, k_buf.shape[-1]), v_buf[r].reshape(bs, v_buf.shape[-1])
        _accumulate(r, q_ref, k, v, valid_ref, pool_ref, sc, scale=scale, keys_minor=False)

    for r in range(rows):
        pl.when(j < row_filled[i * rows + r])(functools.partial(row_step, r))

    pl.when(j == pl.num_programs(2) - 1)(lambda: _finish(rows, o_ref, mass_ref, sc))


def _call(kernel, prefetch, in_specs, args, *, q, pool, bs, blocks, extra_scratch, cache_bytes,
          interpret):  # fmt: skip
    """The pallas_call of a decode kernel over grid (row blocks, key/value heads, `blocks`
    blocks of bs slots): queries (and the outputs) per (row block, head), validity and pools
    per (row block, slot block), a block past the row block's filled ones (the first of
    `prefetch`, per row block) fetched as its last filled one (no copy)."""
    b, kh, g, h = q.shape
    rows = row_block(b)
    sq = pl.Squeezed()

    def heads(i, hh, j, *_):
        return (i, hh, 0, 0)

    def per_row(i, hh, j, blocks_filled, *_):
        return (i, 0, jnp.minimum(j, jnp.maximum(blocks_filled[i] - 1, 0)))

    in_specs = [pl.BlockSpec((rows, sq, g, h), heads), *in_specs]
    in_specs.append(pl.BlockSpec((rows, 1, bs), per_row))
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    out_specs = [pl.BlockSpec((rows, sq, g, h), heads)]
    scratch = [pltpu.VMEM((rows, g, _LANES), jnp.float32)] * 2
    scratch.append(pltpu.VMEM((rows, g, h), jnp.float32))
    if pool is not None:
        in_specs.append(pl.BlockSpec((rows, len(POOLS), bs), per_row))
        out_shape.append(jax.ShapeDtypeStruct((b, kh, g, _LANES), jnp.float32))
        out_specs.append(pl.BlockSpec((rows, sq, g, _LANES), heads))
        scratch.append(pltpu.VMEM((rows, g, _LANES), jnp.float32))
        args = [*args, pool]
    valid = args[3]
    cost = pl.CostEstimate(
        flops=4 * b * kh * g * h * bs * blocks,
        transcendentals=b * kh * g * bs * blocks,
        bytes_accessed=cache_bytes + 2 * q.size * q.dtype.itemsize + valid.size * 4,
    )
    call = pl.pallas_call(
        functools.partial(kernel, rows=rows, pools=pool is not None),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),
            grid=(b // rows, kh, blocks),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=scratch + extra_scratch,
        ),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        cost_estimate=cost,
        interpret=interpret,
        name="jaxvrl_decode_attention",
    )
    out = call(*prefetch, *args)
    return out[0], (out[1] if pool is not None else None)


def _filled(valid, rows: int, bs: int):
    """Per row and per block of rows, the slot blocks up to the last visible slot (0: its
    rows see nothing, e.g. rows that have ended): the others are neither fetched nor
    computed."""
    b, _, s = valid.shape
    pos = jnp.arange(s, dtype=jnp.int32)
    last = jnp.max(jnp.where(valid[:, 0] > 0, pos[None], -1), axis=1)
    per_row = jnp.where(last < 0, 0, last // bs + 1).astype(jnp.int32)
    return per_row, jnp.max(per_row.reshape(b // rows, rows), axis=1)


def _local(q, k, v, valid, pool, *, scale, interpret, key_layout="BKHS"):
    """The kernel on one device's rows and heads: q [b, K, G, H], k [b, K, H, S] (or
    [b, K, S, H]), v [b, K, S, H], valid int32[b, 1, S], pool float32[b, 3, S] or None ->
    (out [b, K, G, H], pool masses float32[b, K, G, 128] (lanes 0..2) or None)."""
    b, _, _, h = q.shape
    s = v.shape[-2]
    keys_minor = key_layout == "BKHS"
    rows = row_block(b)
    bs = _divisor(s, (512, 256, 128))
    _, filled = _filled(valid, rows, bs)

    def upto(i, j, n):
        return jnp.minimum(j, jnp.maximum(n[i] - 1, 0))

    def keys(i, hh, j, n):
        return (i, hh, 0, upto(i, j, n))

    def values(i, hh, j, n):
        return (i, hh, upto(i, j, n), 0)

    sq = pl.Squeezed()
    by_slot = pl.BlockSpec((rows, sq, bs, h), values)  # the values, and keys [b, K, S, H]
    in_specs = [pl.BlockSpec((rows, sq, h, bs), keys) if keys_minor else by_slot, by_slot]
    kernel = functools.partial(_kernel, scale=scale, keys_minor=keys_minor)
    return _call(
        kernel, [filled], in_specs, [q, k, v, valid], q=q, pool=pool, bs=bs, blocks=s // bs,
        extra_scratch=[], cache_bytes=k.size * k.dtype.itemsize + v.size * v.dtype.itemsize,
        interpret=interpret,
    )  # fmt: skip


def _paged_local(q, k_pages, v_pages, table, valid, pool, *, scale, interpret, block=512):
    """The paged kernel on one device's rows and heads: pages k, v [P, K, ps, H], table
    int32[b, n], valid int32[b, 1, n * ps], pool float32[b, 3, n * ps] or None; a grid step
    reads `per_block` pages of each row (about `block` slots), the table padded with page 0
    to whole blocks (masked)."""
    b, kh, _, h = q.shape
    ps, n = v_pages.shape[-2], table.shape[1]
    rows = row_block(b)
    per_block = max(1, min(n, block // ps))
    blocks = -(-n // per_block)
    bs, pad = per_block * ps, blocks * per_block - n
    table = jnp.pad(table, ((0, 0), (0, pad)))
    valid = jnp.pad(valid, ((0, 0), (0, 0), (0, pad * ps)))
    if pool is not None:
        pool = jnp.pad(pool, ((0, 0), (0, 0), (0, pad * ps)))
    row_filled, block_filled = _filled(valid, rows, bs)
    by_block = table.reshape(b, blocks, per_block)  # blocks whose pages are consecutive
    runs = jnp.all(by_block == by_block[..., :1] + jnp.arange(per_block), axis=2)
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    buf = (rows, per_block, ps, h)
    extra = [pltpu.VMEM(buf, k_pages.dtype), pltpu.VMEM(buf, v_pages.dtype),
             pltpu.SemaphoreType.DMA((2, rows))]  # fmt: skip
    kernel = functools.partial(_paged_kernel, scale=scale, page_size=ps, per_block=per_block)
    item = k_pages.dtype.itemsize + v_pages.dtype.itemsize
    prefetch = [block_filled, row_filled, table, runs.astype(jnp.int32)]
    return _call(
        kernel, prefetch, [hbm, hbm], [q, k_pages, v_pages, valid],
        q=q, pool=pool, bs=bs, blocks=blocks, extra_scratch=extra,
        cache_bytes=b * n * ps * kh * h * item, interpret=interpret,
    )  # fmt: skip


def _inputs(qg, mask, pools, dtype):
    """The kernels' queries [B, K, G, H] in `dtype`, validity int32[B, 1, S] and pools
    float32[B, 3, S] (or None)."""
    if qg.shape[1] != 1:
        raise ValueError(f"the decode kernel takes one query per row, got {qg.shape[1]}")
    pool = None
    if pools is not None:
        pool = jnp.stack([pools[name].astype(jnp.float32) for name in POOLS], axis=1)
    return qg[:, 0].astype(dtype), mask.astype(jnp.int32), pool


def _per_device(local, args, kv_axes, pooled: bool):
    """`local` under shard_map where the program is traced for a mesh: queries args[0],
    outputs and every per-row argument split as the rows are; the keys and values (args 1,
    2) as `kv_axes` names them, by KV head only where the queries' heads split alike."""
    mesh = traced_mesh()
    if mesh is None or mesh.size <= 1:
        return local(*args)
    spec = logical_to_spec(("batch", "heads", None, None), args[0].shape, mesh)
    kv_spec = logical_to_spec(kv_axes, args[1].shape, mesh)
    heads = spec[1] if spec[1] == kv_spec[1] else None
    qkv = P(spec[0], heads, None, None)
    pages = P(spec[0] if kv_axes[0] else None, heads, None, None)
    rest = [P(spec[0], *([None] * (x.ndim - 1))) for x in args[3:]]
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(qkv, pages, pages, *rest),
        out_specs=(qkv, qkv if pooled else None),
        check_vma=False,
    )(*args)


def _stats(masses):
    """(A_V, A_X) float32[B, 1] from the per-head pool masses, or None."""
    if masses is None:
        return None
    # heads-averaged [B, T = 1, P], then renormalised over the prompt
    return pool_ratios(jnp.mean(masses[..., : len(POOLS)], axis=(1, 2))[:, None])


def tpu_decode(qg, k, v, mask, *, scale, pools, dtype, key_layout="BKHS", interpret=False):
    """`attend_cache` for one query per row (T == 1): (out [B, 1, K, G, H] in `dtype`,
    (A_V, A_X) float32[B, 1] with pools, else None)."""
    q, valid, pool = _inputs(qg, mask, pools, dtype)
    args = [q, k.astype(dtype), v.astype(dtype), valid] + ([] if pool is None else [pool])

    def local(q, k, v, valid, *pool):
        return _local(q, k, v, valid, pool[0] if pool else None, scale=float(scale),
                      interpret=interpret, key_layout=key_layout)  # fmt: skip

    out, masses = _per_device(local, args, ("batch", "heads", None, None), pool is not None)
    return out[:, None], _stats(masses)


def tpu_paged_decode(
    qg, k_pages, v_pages, table, mask, *, scale, pools, dtype, interpret=False, block=512
):
    """`attend_cache` over pages (keys and values [P, K, ps, H], row b's in the order of
    table int32[B, n]) for one query per row, read where they lie, about `block` slots of
    each row per grid step: (out [B, 1, K, G, H] in `dtype`, (A_V, A_X) float32[B, 1] with
    pools, else None)."""
    q, valid, pool = _inputs(qg, mask, pools, dtype)
    args = [q, k_pages.astype(dtype), v_pages.astype(dtype), table, valid]
    args += [] if pool is None else [pool]

    def local(q, k, v, table, valid, *pool):
        # Pallas's TPU interpreter: the generic one has no DMAs or semaphores
        mode = pltpu.InterpretParams() if interpret else False
        return _paged_local(q, k, v, table, valid, pool[0] if pool else None,
                            scale=float(scale), interpret=mode, block=block)  # fmt: skip

    out, masses = _per_device(local, args, (None, "heads", None, None), pool is not None)
    return out[:, None], _stats(masses)


# --- GPUs: the same paged decode as a Pallas Triton kernel ----------------------------------


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _gpu_paged_kernel(
    filled_ref, table_ref, q_ref, k_ref, v_ref, valid_ref, *refs, scale, page_size, pools
):
    """One (row, key/value head) program: the row's G queries (padded to a power of two)
    over its pages up to its last visible slot, one page [ps, H] at a time, with an online
    softmax; the output and, with pools, the probability mass on each pool (columns 0..2 of
    4). Pages past `filled` are neither read nor computed."""
    pool_ref, o_ref, mass_ref = (refs[0], refs[1], refs[2]) if pools else (None, refs[0], None)
    row, hh = pl.program_id(0), pl.program_id(1)
    q = q_ref[...].astype(jnp.float32)  # [G, H]
    g, h = q.shape

    def page_step(j, carry):
        m, total, acc, mass = carry
        page = table_ref[row, j]
        at = pl.ds(j * page_size, page_size)
        k = k_ref[page, hh, :, :].astype(jnp.float32)  # [ps, H]
        v = v_ref[page, hh, :, :].astype(jnp.float32)
        ok = valid_ref[row, 0, at] > 0  # [ps]
        s = jnp.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G, ps]
        s = jnp.where(ok[None, :], s, _NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(ok[None, :], jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        total = alpha * total + jnp.sum(p, axis=1)
        acc = alpha[:, None] * acc + jnp.sum(p[:, :, None] * v[None, :, :], axis=1)
        if pools:
            pool = pool_ref[row, :, at]  # [4, ps]
            mass = alpha[:, None] * mass + jnp.sum(p[:, None, :] * pool[None, :, :], axis=2)
        return m_new, total, acc, mass

    start = (jnp.full((g,), _NEG, jnp.float32), jnp.zeros((g,), jnp.float32),
             jnp.zeros((g, h), jnp.float32), jnp.zeros((g, 4), jnp.float32))  # fmt: skip
    _, total, acc, mass = jax.lax.fori_loop(0, filled_ref[row], page_step, start)
    inv = _inverse(total)
    o_ref[...] = (acc * inv[:, None]).astype(o_ref.dtype)
    if pools:
        mass_ref[...] = mass * inv[:, None]


def _gpu_paged_local(q, k_pages, v_pages, table, valid, pool, *, scale, interpret):
    """The GPU paged kernel on one device's rows and heads (`_paged_local`'s arrays): ->
    (out [b, K, G, H], pool masses float32[b, K, G, 4] (columns 0..2) or None). The query
    heads are padded to a power of two (Triton's blocks); the padding is dropped after."""
    b, kh, g, h = q.shape
    ps = v_pages.shape[-2]
    if _pow2(ps) != ps or _pow2(h) != h:
        raise ValueError(f"the GPU paged kernel takes powers of two: page_size {ps}, head {h}")
    gp = _pow2(g)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, gp - g), (0, 0)))
    filled, _ = _filled(valid, 1, ps)  # each row's pages up to its last visible slot
    whole = pl.BlockSpec(memory_space=pl.ANY)
    heads = pl.BlockSpec((None, None, gp, h), lambda i, hh: (i, hh, 0, 0))
    args = [filled, table, q, k_pages, v_pages, valid]
    out_shape = [jax.ShapeDtypeStruct((b, kh, gp, h), q.dtype)]
    out_specs = [heads]
    if pool is not None:
        args.append(jnp.pad(pool, ((0, 0), (0, 4 - pool.shape[1]), (0, 0))))
        out_shape.append(jax.ShapeDtypeStruct((b, kh, gp, 4), jnp.float32))
        out_specs.append(pl.BlockSpec((None, None, gp, 4), lambda i, hh: (i, hh, 0, 0)))
    kernel = functools.partial(_gpu_paged_kernel, scale=scale, page_size=ps,
                               pools=pool is not None)  # fmt: skip
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(b, kh),
        in_specs=[whole, whole, heads, whole, whole, whole] + [whole] * (pool is not None),
        out_specs=out_specs,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="jaxvrl_paged_decode_gpu",
    )(*args)
    out = outs[0][:, :, :g]
    return out, (outs[1][:, :, :g] if pool is not None else None)


def gpu_paged_decode(qg, k_pages, v_pages, table, mask, *, scale, pools, dtype, interpret=False):
    """`tpu_paged_decode` on GPUs (a Pallas Triton kernel, one program per row and KV head,
    each row's pages read where they lie up to its last visible slot): (out [B, 1, K, G, H]
    in `dtype`, (A_V, A_X) float32[B, 1] with pools, else None). Page size and head
    dimension: powers of two."""
    q, valid, pool = _inputs(qg, mask, pools, dtype)
    args = [q, k_pages.astype(dtype), v_pages.astype(dtype), table, valid]
    args += [] if pool is None else [pool]

    def local(q, k, v, table, valid, *pool):
        return _gpu_paged_local(q, k, v, table, valid, pool[0] if pool else None,
                                scale=float(scale), interpret=interpret)  # fmt: skip

    out, masses = _per_device(local, args, (None, "heads", None, None), pool is not None)
    return out[:, None], _stats(masses)
