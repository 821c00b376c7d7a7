"""Who may see whom in attention, as O(T + S) arrays (`Visibility`), and what every
implementation of `jaxvrl.models.attention.attend` shares: the mask of a block
(`visibility_mask`, with causality, segments and a sliding window), the blocked
implementations' settings (`Blocks`), padding to whole blocks, and the rows that see no key.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


class Visibility(NamedTuple):
    """Who may see whom, O(T + S) arrays (see the module docstring). Leading axes are B or 1."""

    key_valid: jax.Array  # bool[B, S]
    q_positions: jax.Array  # int32[B|1, T]
    k_positions: jax.Array  # int32[B|1, S]
    q_segments: jax.Array | None  # int32[B|1, T]
    k_segments: jax.Array | None  # int32[B|1, S]


def visibility_mask(
    vis: Visibility, causal: bool, t0=0, bq=None, s0=0, bk=None, sliding: int = 0
) -> jax.Array:
    """bool[B, bq, bk]: which keys s0..s0+bk each query t0..t0+bq may see (all by default);
    sliding > 0 (causal): only keys fewer than `sliding` positions back."""

    def cut(x, start, size):
        if x is None or size is None:
            return x
        return lax.dynamic_slice_in_dim(x, start, size, axis=1)

    mask = cut(vis.key_valid, s0, bk)[:, None, :]
    if causal:
        qp, kp = cut(vis.q_positions, t0, bq), cut(vis.k_positions, s0, bk)
        mask = mask & (kp[:, None, :] <= qp[:, :, None])
        if sliding:
            mask = mask & (kp[:, None, :] > qp[:, :, None] - sliding)
    if vis.q_segments is not None:
        qs, ks = cut(vis.q_segments, t0, bq), cut(vis.k_segments, s0, bk)
        mask = mask & (qs[:, :, None] == ks[:, None, :])
    return mask


def as_rows(x, length: int, name: str) -> jax.Array | None:
    """[L] or [B, L] -> int32[1 or B, L]."""
    if x is None:
        return None
    x = jnp.asarray(x)
    if x.ndim == 1:
        x = x[None]
    if x.ndim != 2 or x.shape[1] != length:
        raise ValueError(f"{name} must be [{length}] or [B, {length}], got {x.shape}")
    return x.astype(jnp.int32)


def make_visibility(q, k, key_valid, q_positions, k_positions, q_segments, k_segments, causal):
    b, t, s = q.shape[0], q.shape[1], k.shape[1]
    if key_valid is None:
        key_valid = jnp.ones((b, s), bool)
    key_valid = jnp.broadcast_to(jnp.asarray(key_valid, bool), (b, s))
    if causal and (q_positions is None) != (k_positions is None):
        raise ValueError("give both q_positions and k_positions, or neither")
    if causal and q_positions is None:
        if t != s:
            raise ValueError(f"causal attention of {t} queries over {s} keys needs positions")
        q_positions = k_positions = jnp.arange(t)
    if (q_segments is None) != (k_segments is None):
        raise ValueError("give both q_segments and k_segments, or neither")
    qp, kp = as_rows(q_positions, t, "q_positions"), as_rows(k_positions, s, "k_positions")
    if not causal:  # positions do not matter; keep the pytree's shape fixed
        qp, kp = jnp.zeros((1, t), jnp.int32), jnp.zeros((1, s), jnp.int32)
    qs, ks = as_rows(q_segments, t, "q_segments"), as_rows(k_segments, s, "k_segments")
    return Visibility(key_valid, qp, kp, qs, ks)


@dataclasses.dataclass(frozen=True)
class Blocks:
    scale: float
    causal: bool
    block_q: int
    block_k: int
    # every query sees at least its own key (self-attention, no key masked, the same segment
    # ids on both sides): the kernels' rows are never blind
    sees_self: bool = False
    sliding: int = 0  # causal: keys fewer than this many positions back only (0: all)


def pad_axis(x, axis: int, size: int, value):
    if x is None or x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def every_query_sees_itself(t, s, key_valid, q_positions, q_segments, k_segments, causal) -> bool:
    """Whether `attend`'s arguments alone promise that every query sees at least its own key:
    self-attention (T == S) with no key masked, default positions when causal, and the very
    same segment ids (one array) for queries and keys."""
    return (
        key_valid is None
        and t == s
        and q_segments is k_segments
        and (not causal or q_positions is None)
    )


def sees_any(vis: Visibility, causal: bool, sliding: int = 0) -> jax.Array:
    """bool[B, T]: queries that may see at least one key. The kernels below give the other
    rows an average of masked values rather than zeros. Without segments or a window in
    O(T + S): a query sees a key iff the row's first valid key position is at or before its
    own (causal), or the row has a valid key at all; else in O((T + S) log S), never a [T, S]
    mask (4 GiB for one 64k-token row): with segments, the same test against the first valid
    key of the query's segment (`_first_of_segment`); with a sliding window, whether the last
    valid key of the query's segment at or before its position is fewer than `sliding`
    positions back (`_last_at_or_before`)."""
    b, t = vis.key_valid.shape[0], vis.q_positions.shape[1]
    if vis.q_segments is None and not sliding:
        if not causal:
            return jnp.broadcast_to(jnp.any(vis.key_valid, axis=-1)[:, None], (b, t))
        never = jnp.iinfo(jnp.int32).max
        first = jnp.min(jnp.where(vis.key_valid, vis.k_positions, never), axis=-1)  # [B]
        return jnp.broadcast_to(first[:, None] <= vis.q_positions, (b, t))
    if not (sliding and causal):
        found, first = _first_of_segment(vis, b, t)
        return found & (first <= vis.q_positions) if causal else found
    found, last = _last_at_or_before(vis, b, t)
    return found & (last > vis.q_positions - sliding)


def _keys_sorted(vis: Visibility, b: int, t: int):
    """Per row, the keys' (segment, invalid, position) sorted (valid keys first within a
    segment, by position), and the queries' segments and positions, all [B, ...] int32; no
    segments: one segment."""
    s = vis.key_valid.shape[1]
    zeros = lambda n: jnp.zeros((b, n), jnp.int32)  # noqa: E731
    k_seg = zeros(s) if vis.k_segments is None else jnp.broadcast_to(vis.k_segments, (b, s))
    q_seg = zeros(t) if vis.q_segments is None else jnp.broadcast_to(vis.q_segments, (b, t))
    k_pos = jnp.broadcast_to(vis.k_positions, (b, s))
    q_pos = jnp.broadcast_to(vis.q_positions, (b, t))
    invalid = (~vis.key_valid).astype(jnp.int32)

    def row(k_seg, invalid, k_pos):
        order = jnp.lexsort((k_pos, invalid, k_seg))
        return k_seg[order], invalid[order], k_pos[order]

    return (*jax.vmap(row)(k_seg, invalid, k_pos), q_seg, q_pos)


def _first_of_segment(vis: Visibility, b: int, t: int) -> tuple[jax.Array, jax.Array]:
    """(found bool[B, T]: a valid key shares the query's segment; first int32[B, T]: the
    smallest position of those keys): the valid keys sorted by (segment, position), each
    query's segment looked up by binary search."""
    s = vis.key_valid.shape[1]
    seg, invalid, pos, q_seg, _ = _keys_sorted(vis, b, t)

    def row(seg, invalid, pos, q_seg):
        at = jnp.minimum(jnp.searchsorted(seg, q_seg, side="left"), s - 1)
        return (seg[at] == q_seg) & (invalid[at] == 0), pos[at]

    return jax.vmap(row)(seg, invalid, pos, q_seg)


def _last_at_or_before(vis: Visibility, b: int, t: int) -> tuple[jax.Array, jax.Array]:
    """(found bool[B, T]: a valid key of the query's segment is at or before its position;
    last int32[B, T]: the largest such position): the keys sorted by (segment, invalid,
    position), the count of those at or before (query's segment, valid, its position) found
    by a binary search over the three, the key before it read."""
    s = vis.key_valid.shape[1]
    seg, invalid, pos, q_seg, q_pos = _keys_sorted(vis, b, t)

    def row(seg, invalid, pos, q_seg, q_pos):
        def at_or_before(i):  # key i's (segment, invalid, position) <= (q_seg, 0, q_pos)
            a, c = seg[i], pos[i]
            return (a < q_seg) | ((a == q_seg) & (invalid[i] == 0) & (c <= q_pos))

        def step(_, bounds):
            lo, hi = bounds
            mid = (lo + hi) // 2
            below = at_or_before(jnp.minimum(mid, s - 1)) & (lo < hi)
            return jnp.where(below, mid + 1, lo), jnp.where(below | (lo >= hi), hi, mid)

        zero = jnp.zeros_like(q_pos)
        count, _ = lax.fori_loop(0, s.bit_length() + 1, step, (zero, zero + s))
        prev = jnp.maximum(count - 1, 0)
        found = (count > 0) & (seg[prev] == q_seg) & (invalid[prev] == 0)
        return found, pos[prev]

    return jax.vmap(row)(seg, invalid, pos, q_seg, q_pos)


def zero_blind(out, vis: Visibility, cfg: Blocks):
    """The kernels' out [B, T, N, H] with rows that see no key set to zero."""
    if cfg.sees_self:
        return out
    return jnp.where(sees_any(vis, cfg.causal, cfg.sliding)[..., None, None], out, 0)


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple
