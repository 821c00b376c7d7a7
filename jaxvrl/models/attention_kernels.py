"""The attention kernels `jaxvrl.models.attention.attend` hands whole problems to: the Pallas
TPU splash kernel (`splash`, per device under shard_map) and cuDNN's (`cudnn`, through
`jax.nn.dot_product_attention`); each builds its mask from the `Visibility` arrays."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxvrl.models.visibility import (
    Blocks,
    Visibility,
    pad_axis,
    round_up,
    visibility_mask,
    zero_blind,
)
from jaxvrl.parallel.sharding import logical_to_spec, traced_mesh


def splash(q, k, v, vis: Visibility, cfg: Blocks, *, interpret: bool):
    """The Pallas TPU splash kernel, one row at a time (vmap). Causality is its static
    CausalMask (key index <= query index); key validity and segments become its SegmentIds:
    queries get 2 * segment, valid keys 2 * segment and invalid keys 1, which no query has."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa  # TPU-only module

    b, t, n, h = q.shape
    s = k.shape[1]
    bq = round_up(min(cfg.block_q, t), 128)
    bk = round_up(min(cfg.block_k, s), 128)
    if cfg.causal:  # T == S here: one padded length keeps the causal diagonal
        tp = sp = round_up(t, math.lcm(bq, bk))
    else:
        tp, sp = round_up(t, bq), round_up(s, bk)
    q_seg = jnp.zeros((b, t), jnp.int32) if vis.q_segments is None else 2 * vis.q_segments
    k_seg = jnp.zeros((b, s), jnp.int32) if vis.k_segments is None else 2 * vis.k_segments
    k_seg = jnp.where(vis.key_valid, k_seg, 1)
    segments = (
        pad_axis(jnp.broadcast_to(q_seg, (b, t)), 1, tp, 0),
        pad_axis(jnp.broadcast_to(k_seg, (b, s)), 1, sp, 1),
    )
    qt = pad_axis((q * cfg.scale).astype(q.dtype).transpose(0, 2, 1, 3), 2, tp, 0)  # [B, N, T, H]
    kt = pad_axis(k.transpose(0, 2, 1, 3), 2, sp, 0)  # [B, K, S, H]
    vt = pad_axis(v.transpose(0, 2, 1, 3), 2, sp, 0)
    mask = sa.CausalMask((tp, sp)) if cfg.causal else sa.FullMask((tp, sp))
    sizes = dict(block_q=bq, block_kv=bk, block_kv_compute=bk)
    sizes.update(block_q_dkv=bq, block_kv_dkv=bk, block_kv_dkv_compute=bk)
    sizes.update(block_q_dq=bq, block_kv_dq=bk)

    def rows(qt, kt, vt, q_seg, k_seg):  # the rows and heads one device holds
        kernel = sa.make_splash_mha(
            sa.MultiHeadMask([mask] * qt.shape[1]),
            block_sizes=sa.BlockSizes(**sizes),
            head_shards=1,
            q_seq_shards=1,
            interpret=interpret,
        )
        return jax.vmap(kernel)(qt, kt, vt, sa.SegmentIds(q_seg, k_seg))

    def kernel(qt, kt, vt, q_seg, k_seg):
        return per_device(rows, (qt, kt, vt, q_seg, k_seg), ("qkv", "qkv", "qkv", "seg", "seg"))

    if q.dtype != jnp.float32:
        # Mosaic rejects bfloat16 products at float32 contract precision (train.py sets
        # "highest"); products of bfloat16 inputs are exact at the default precision
        kernel = at_precision(kernel, "default")
    out = kernel(qt, kt, vt, *segments)
    return zero_blind(out[:, :, :t].transpose(0, 2, 1, 3), vis, cfg).astype(q.dtype)


def at_precision(fn, precision: str):
    """fn(q, k, v, *ints) with its forward and backward both traced at a matmul precision (a
    `with` around the call alone leaves the backward to the precision at transpose time)."""

    @jax.custom_vjp
    def call(*args):
        with jax.default_matmul_precision(precision):
            return fn(*args)

    def fwd(*args):
        with jax.default_matmul_precision(precision):
            return jax.vjp(fn, *args)

    def bwd(vjp, d_out):
        with jax.default_matmul_precision(precision):
            dq, dk, dv, *_ = vjp(d_out)
        return dq, dk, dv, None, None

    call.defvjp(fwd, bwd)
    return call


def per_device(fn, args, kinds):
    """fn(*args) under shard_map over the mesh being traced for (Mosaic kernels are not
    partitioned automatically): rows split like the batch, heads like the attention heads,
    by the logical rules; query and key/value heads stay aligned (both split or neither).
    kinds: "qkv" for [B, heads, L, H], "seg" for [B, L]; the output is shaped like args[0]."""
    mesh = traced_mesh()
    if mesh is None or mesh.size == 1:
        return fn(*args)
    axes = ("batch", "heads", None, None)
    specs = [logical_to_spec(axes, x.shape, mesh) for x, kind in zip(args, kinds) if kind == "qkv"]
    batch = specs[0][0]
    heads = specs[0][1] if all(spec[1] == specs[0][1] for spec in specs) else None
    in_specs = [P(batch, heads, None, None) if kind == "qkv" else P(batch, None) for kind in kinds]
    run = jax.shard_map(
        fn, mesh=mesh, in_specs=tuple(in_specs), out_specs=in_specs[0], check_vma=False
    )
    return run(*args)


def cudnn(q, k, v, vis: Visibility, cfg: Blocks, *, masked: bool, backend: str = "cudnn"):
    """`jax.nn.dot_product_attention` (cuDNN flash attention: bfloat16/float16 on a GPU).
    Causality is its index-causal flag; key validity and segments, when given, a bool
    [B, 1, T, S] mask, which the kernel turns into a bias of that size. The mask is
    broadcast to whole T and S: the rule gives [B, 1, S] for key validity alone, and cuDNN
    takes no bias broadcast over T. With a bias cuDNN's training kernels take even T and S
    only: odd lengths get one padded query (seeing every real key, its output dropped) and one
    padded key (seen by no query); T == S when causal, so the causal diagonal is kept."""
    b, t, s = q.shape[0], q.shape[1], k.shape[1]
    mask = None
    if masked:
        mask = jnp.broadcast_to(visibility_mask(vis, False), (b, t, s))
        tp, sp = round_up(t, 2), round_up(s, 2)
        mask = pad_axis(pad_axis(mask, 2, sp, False), 1, tp, True)[:, None]
        q, k, v = pad_axis(q, 1, tp, 0), pad_axis(k, 1, sp, 0), pad_axis(v, 1, sp, 0)
    out = jax.nn.dot_product_attention(
        q, k, v, mask=mask, scale=cfg.scale, is_causal=cfg.causal, implementation=backend
    )
    return zero_blind(out[:, :t], vis, cfg).astype(q.dtype)
