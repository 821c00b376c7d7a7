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
CPU (Pallas's interpreter: the tests' reference check).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
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


def _kernel(filled, q_ref, k_ref, v_ref, valid_ref, *refs, scale, rows, pools, keys_minor):
    """One (block of rows, key/value head, block of positions) grid step: the online softmax
    of every row's G queries over this block of keys, and at the last block its output (and
    the probability mass on each pool, lanes 0..2 of a [G, 128] tile)."""
    if pools:
        pool_ref, o_ref, mass_ref, m_sc, l_sc, acc_sc, p_sc = refs
    else:
        o_ref, m_sc, l_sc, acc_sc = refs
    j = pl.program_id(2)
    # bfloat16 products are exact at the default precision (Mosaic refuses float32 contract
    # precision for them, which the training programs set as the default); float32: highest
    exact = jax.lax.Precision.HIGHEST if k_ref.dtype == jnp.float32 else jax.lax.Precision.DEFAULT
    dot = functools.partial(jnp.dot, preferred_element_type=jnp.float32, precision=exact)
    dot_nt = functools.partial(
        jax.lax.dot_general, dimension_numbers=(((1,), (1,)), ((), ())),
        preferred_element_type=jnp.float32, precision=exact,
    )  # fmt: skip

    @pl.when(j == 0)
    def _():
        m_sc[...] = jnp.full(m_sc.shape, _NEG, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)
        if pools:
            p_sc[...] = jnp.zeros(p_sc.shape, jnp.float32)

    @pl.when(j < filled[pl.program_id(0)])  # past the block's last visible slot: nothing
    def _():
        for r in range(rows):
            # [G, H] x [H, bs], or [G, H] x [bs, H] contracted over H
            s = (dot(q_ref[r], k_ref[r]) if keys_minor else dot_nt(q_ref[r], k_ref[r])) * scale
            ok = valid_ref[r] > 0  # [1, bs]
            s = jnp.where(ok, s, _NEG)  # [G, bs]
            m_prev = m_sc[r]  # [G, 128], every lane alike
            m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            p = jnp.where(ok, jnp.exp(s - m_new[:, :1]), 0.0)
            alpha = jnp.exp(m_prev - m_new)
            l_sc[r] = alpha * l_sc[r] + jnp.sum(p, axis=1, keepdims=True)
            acc_sc[r] = alpha[:, :1] * acc_sc[r] + dot(p.astype(v_ref.dtype), v_ref[r])
            m_sc[r] = m_new
            if pools:
                lane = jax.lax.broadcasted_iota(jnp.int32, p_sc.shape[1:], 1)
                add = jnp.zeros(p_sc.shape[1:], jnp.float32)
                for i in range(len(POOLS)):
                    mass = jnp.sum(p * pool_ref[r, i : i + 1, :], axis=1, keepdims=True)
                    add = jnp.where(lane == i, mass, add)
                p_sc[r] = alpha * p_sc[r] + add

    @pl.when(j == pl.num_programs(2) - 1)
    def _():
        for r in range(rows):
            total = l_sc[r]
            inv = jnp.where(total > 0, 1.0 / jnp.where(total > 0, total, 1.0), 0.0)
            o_ref[r] = (acc_sc[r] * inv[:, :1]).astype(o_ref.dtype)
            if pools:
                mass_ref[r] = p_sc[r] * inv


def _local(q, k, v, valid, pool, *, scale, interpret, key_layout="BKHS"):
    """The kernel on one device's rows and heads: q [b, K, G, H], k [b, K, H, S] (or
    [b, K, S, H]), v [b, K, S, H], valid int32[b, 1, S], pool float32[b, 3, S] or None ->
    (out [b, K, G, H], pool masses float32[b, K, G, 128] (lanes 0..2) or None)."""
    b, kh, g, h = q.shape
    s = v.shape[-2]
    keys_minor = key_layout == "BKHS"
    rows = row_block(b)
    bs = _divisor(s, (512, 256, 128))
    blocks = s // bs
    # per block of rows, the key blocks up to its last visible slot (0: its rows see nothing,
    # e.g. rows that have ended): the others are neither fetched nor computed
    pos = jnp.arange(s, dtype=jnp.int32)
    last = jnp.max(jnp.where(valid[:, 0] > 0, pos[None], -1).reshape(b // rows, -1), axis=1)
    filled = jnp.where(last < 0, 0, last // bs + 1).astype(jnp.int32)

    def upto(i, j, n):  # a block past the filled ones: the last filled one again (no copy)
        return jnp.minimum(j, jnp.maximum(n[i] - 1, 0))

    def keys(i, hh, j, n):
        return (i, hh, 0, upto(i, j, n))

    def values(i, hh, j, n):
        return (i, hh, upto(i, j, n), 0)

    def per_row(i, hh, j, n):
        return (i, 0, upto(i, j, n))

    def heads(i, hh, j, n):
        return (i, hh, 0, 0)

    sq = pl.Squeezed()
    by_slot = pl.BlockSpec((rows, sq, bs, h), values)  # the values, and keys [b, K, S, H]
    in_specs = [
        pl.BlockSpec((rows, sq, g, h), heads),
        pl.BlockSpec((rows, sq, h, bs), keys) if keys_minor else by_slot,
        by_slot,
        pl.BlockSpec((rows, 1, bs), per_row),
    ]
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    out_specs = [pl.BlockSpec((rows, sq, g, h), heads)]
    scratch = [pltpu.VMEM((rows, g, _LANES), jnp.float32)] * 2
    scratch.append(pltpu.VMEM((rows, g, h), jnp.float32))
    args = [q, k, v, valid]
    if pool is not None:
        in_specs.append(pl.BlockSpec((rows, len(POOLS), bs), per_row))
        out_shape.append(jax.ShapeDtypeStruct((b, kh, g, _LANES), jnp.float32))
        out_specs.append(pl.BlockSpec((rows, sq, g, _LANES), heads))
        scratch.append(pltpu.VMEM((rows, g, _LANES), jnp.float32))
        args.append(pool)
    cache_bytes = k.size * k.dtype.itemsize + v.size * v.dtype.itemsize
    cost = pl.CostEstimate(
        flops=4 * b * kh * g * h * s,
        transcendentals=b * kh * g * s,
        bytes_accessed=cache_bytes + 2 * q.size * q.dtype.itemsize + valid.size * 4,
    )
    call = pl.pallas_call(
        functools.partial(
            _kernel, scale=scale, rows=rows, pools=pool is not None, keys_minor=keys_minor
        ),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(b // rows, kh, blocks),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=scratch,
        ),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        cost_estimate=cost,
        interpret=interpret,
        name="jaxvrl_decode_attention",
    )
    out = call(filled, *args)
    return out[0], (out[1] if pool is not None else None)


def tpu_decode(qg, k, v, mask, *, scale, pools, dtype, key_layout="BKHS", interpret=False):
    """`attend_cache` for one query per row (T == 1): (out [B, 1, K, G, H] in `dtype`,
    (A_V, A_X) float32[B, 1] with pools, else None)."""
    b, t, kh, g, h = qg.shape
    if t != 1:
        raise ValueError(f"the decode kernel takes one query per row, got {t}")
    q = qg[:, 0].astype(dtype)
    valid = mask.astype(jnp.int32)  # [B, 1, S]
    pool = None
    if pools is not None:
        pool = jnp.stack([pools[name].astype(jnp.float32) for name in POOLS], axis=1)
    args = [q, k.astype(dtype), v.astype(dtype), valid] + ([] if pool is None else [pool])

    def local(*args):
        q, k, v, valid, *pool = args
        return _local(q, k, v, valid, pool[0] if pool else None, scale=float(scale),
                      interpret=interpret, key_layout=key_layout)  # fmt: skip

    mesh = traced_mesh()
    if mesh is not None and mesh.size > 1:
        spec = logical_to_spec(("batch", "heads", None, None), q.shape, mesh)
        kv_spec = logical_to_spec(("batch", "heads", None, None), k.shape, mesh)
        qkv = P(spec[0], spec[1] if spec[1] == kv_spec[1] else None, None, None)
        per_row = P(spec[0], None, None)
        local = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(qkv, qkv, qkv, *[per_row] * (len(args) - 3)),
            out_specs=(qkv, None if pool is None else qkv),
            check_vma=False,
        )
    out, masses = local(*args)
    stats = None
    if masses is not None:  # heads-averaged [B, T = 1, P], then renormalised over the prompt
        stats = pool_ratios(jnp.mean(masses[..., : len(POOLS)], axis=(1, 2))[:, None])
    return out[:, None], stats
