"""Padding-free forward passes: the real tokens of B padded rows [B, L] packed into K
buffers [K, T] with segment ids, so the decoder computes real tokens only.

The rows fall into `groups` equal parts of consecutive rows (one per device that holds rows
under a mesh, else one); group g's rows go into its own `buffers` buffers (K = groups x
buffers), so rows never leave the device that holds them. Each row occupies one run of
slots starting at `start[b]` of its group's buffers (flattened, buffers x T; the caller
places rows so that none crosses a buffer's end), its real tokens (attention_mask 1) in their
order. A packed token keeps its own position ids (M-RoPE), its image/video feature, its pools
and its DeepStack slot; attention never crosses a segment (segment id = 1 + the row's index
in its group; 0 on empty slots, which no query sees). Causality by index holds inside a
segment, since a row's tokens keep their order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxvrl.parallel.sharding import logical_to_spec, sequence_split, traced_mesh


@struct.dataclass
class Packing:
    """Where every token of B rows [B, L] sits in K = groups x buffers buffers of T slots.

    dest:     int32[B, L] slot of each token in its group's buffers (flattened: 0 ..
              buffers x T - 1); buffers x T (out of range) for padding.
    src:      int32[groups, buffers x T] the group's flattened token (row-in-group x L + col)
              each slot holds (rows-in-group x L, out of range, on empty slots).
    segments: int32[K, T] 1 + the row's index in its group, 0 on empty slots.
    """

    dest: jax.Array
    src: jax.Array
    segments: jax.Array
    groups: int = struct.field(pytree_node=False, default=1)
    buffers: int = struct.field(pytree_node=False, default=1)
    length: int = struct.field(pytree_node=False, default=0)

    @classmethod
    def build(cls, attention_mask, start, *, groups: int, buffers: int, length: int) -> Packing:
        """From the rows' attention masks [B, L] (1 on real tokens) and the first slot of each
        row in its group's buffers, start int32[B] (traceable; shapes static)."""
        b, seq = attention_mask.shape
        if b % groups:
            raise ValueError(f"{b} rows do not split into {groups} groups")
        per = b // groups
        size = buffers * length
        real = attention_mask > 0
        rank = jnp.cumsum(real, axis=1, dtype=jnp.int32) - 1
        dest = jnp.where(real, start[:, None].astype(jnp.int32) + rank, size)
        local = jnp.arange(per * seq, dtype=jnp.int32).reshape(per, seq)
        row = jnp.broadcast_to(jnp.arange(1, per + 1, dtype=jnp.int32)[:, None], (per, seq))

        def one(dest_g):  # [per, L] -> what each of the group's slots holds
            at = dest_g.reshape(-1)
            src = jnp.full(size, per * seq, jnp.int32).at[at].set(local.reshape(-1), mode="drop")
            seg = jnp.zeros(size, jnp.int32).at[at].set(row.reshape(-1), mode="drop")
            return src, seg

        src, seg = jax.vmap(one)(dest.reshape(groups, per, seq))
        return cls(dest, src, seg.reshape(groups * buffers, length), groups, buffers, length)

    def pack(self, x: jax.Array, axis: int = 0) -> jax.Array:
        """x [..., B, L, ...] (rows at `axis`, tokens next) -> [..., K, T, ...]."""
        x = jnp.moveaxis(x, (axis, axis + 1), (0, 1))
        b, seq = x.shape[:2]
        g = x.reshape((self.groups, (b // self.groups) * seq) + x.shape[2:])
        inverse = self.dest.reshape(self.groups, -1)  # each token's slot (empty: buffers x T)
        out = gather_rows(g, self.src, inverse)  # [groups, buffers x T, ...], 0 on empty slots
        out = out.reshape((self.groups * self.buffers, self.length) + x.shape[2:])
        return jnp.moveaxis(out, (0, 1), (axis, axis + 1))

    def slots(self, start: int, stop: int) -> jax.Array:
        """int32[B, stop - start]: the slot of columns start:stop of every row (a static
        slice, not a gather by an index array); padding tokens get the last slot (masked by
        the caller)."""
        return jnp.minimum(self.dest[:, start:stop], self.buffers * self.length - 1)

    def take(self, y: jax.Array, start: int, stop: int, axis: int = 0) -> jax.Array:
        """Per-row values of packed outputs: y [..., K, T, ...] (buffers at `axis`) ->
        [..., B, stop - start, ...] at columns start:stop of every row (e.g. the
        completion's predictors)."""
        y = jnp.moveaxis(y, (axis, axis + 1), (0, 1))
        size = self.buffers * self.length
        g = y.reshape((self.groups, size) + y.shape[2:])
        b = self.dest.shape[0]
        idx = self.slots(start, stop)  # [B, n]
        n = idx.shape[1]
        idx = idx.reshape((self.groups, (b // self.groups) * n) + (1,) * (g.ndim - 2))
        out = jnp.take_along_axis(g, idx, axis=1).reshape((b, n) + y.shape[2:])
        return jnp.moveaxis(out, (0, 1), (axis, axis + 1))


def _take_rows(x: jax.Array, index: jax.Array) -> jax.Array:
    """x [G, S, ...] at index int32[G, J] along axis 1; index S reads zeros."""
    full = jnp.concatenate([x, jnp.zeros((x.shape[0], 1) + x.shape[2:], x.dtype)], axis=1)
    return jnp.take_along_axis(full, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1)


@jax.custom_vjp
def gather_rows(x: jax.Array, index: jax.Array, inverse: jax.Array) -> jax.Array:
    """out[g, j] = x[g, index[g, j]] for x [G, S, ...] and index int32[G, J] (index S: none,
    reads zeros), where the map is injective and `inverse` int32[G, S] is its inverse: the j
    that reads each x[g, s] (J: none). The gradient is then a gather by `inverse` instead of
    the scatter-add a gather's transpose otherwise is (which a TPU compiler may offload to
    SparseCores, where its cost model cannot price the program, and GPUs run with atomics)."""
    return _take_rows(x, index)


def _gather_rows_fwd(x, index, inverse):
    return _take_rows(x, index), (index, inverse)


def _gather_rows_bwd(res, g):
    index, inverse = res
    return _take_rows(g, inverse), None, None


gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


def gather_slots(hidden: jax.Array, at: jax.Array, reader: jax.Array) -> jax.Array:
    """`gather_rows` of packed outputs hidden [K = groups x buffers, T, D] at slots at
    int32[groups, J] of each group's buffers (flattened, buffers x T; buffers x T: none),
    whose inverse is reader int32[groups, buffers x T] -> [groups, J, D].

    Where a mesh axis splits the buffers' tokens (sequence parallelism), each device gathers
    the slots it holds and the devices along that axis sum their parts (every slot is held by
    one, so the sum is exact): the buffers are never gathered whole. Else a plain gather."""
    k, t, d = hidden.shape
    g = at.shape[0]
    split = sequence_split(t)
    mesh = traced_mesh()
    if split is not None:
        rows = logical_to_spec(("batch",), (k,), mesh)[0]
        if logical_to_spec(("batch",), (g,), mesh)[0] != rows:
            split = None
    if split is None:
        return gather_rows(hidden.reshape(g, k // g * t, d), at, reader)
    return _split_gather(hidden, at, reader, split[0], split[1], rows)


def _split_gather(hidden, at, reader, axis, size, rows):
    @jax.custom_vjp
    def run(hidden, at, reader):
        return _split_take(hidden, at, axis, size, rows)

    def fwd(hidden, at, reader):
        return run(hidden, at, reader), reader

    def bwd(reader, cot):  # each packed slot's head slot: the inverse gather, per device
        k, t = hidden.shape[0], hidden.shape[1]
        buffers = k // reader.shape[0]

        def local(cot, reader):
            g = cot.shape[0]
            full = jnp.concatenate([cot, jnp.zeros((g, 1, cot.shape[2]), cot.dtype)], axis=1)
            r = reader.reshape(g, -1)  # [g, buffers x T / size]
            out = jnp.take_along_axis(full, r[..., None], axis=1)
            return out.reshape(g * buffers, -1, cot.shape[2])

        spec = jax.sharding.PartitionSpec
        grad = jax.shard_map(
            local,
            in_specs=(spec(rows, None, None), spec(rows, None, axis)),
            out_specs=spec(rows, axis, None),
            check_vma=False,
        )(cot, reader.reshape(reader.shape[0], buffers, t))
        return grad, None, None

    run.defvjp(fwd, bwd)
    return run(hidden, at, reader)


def _split_take(hidden, at, axis, size, rows):
    """The forward of `gather_slots` with the tokens split over `axis` (of `size` devices)."""
    spec = jax.sharding.PartitionSpec

    def local(hidden, at):
        k, tl = hidden.shape[:2]
        g = at.shape[0]
        buffers, t = k // g, tl * size
        buf, col = at // t, at % t - jax.lax.axis_index(axis) * tl
        mine = (at < buffers * t) & (col >= 0) & (col < tl)
        flat = hidden.reshape(g, buffers * tl, hidden.shape[2])
        index = jnp.where(mine, buf * tl + col, 0)
        out = jnp.take_along_axis(flat, index[..., None], axis=1)
        return jax.lax.psum(jnp.where(mine[..., None], out, 0), axis)

    return jax.shard_map(
        local,
        in_specs=(spec(rows, axis, None), spec(rows, None)),
        out_specs=spec(rows, None, None),
        check_vma=False,
    )(hidden, at)
