"""The host-side layout of a batch's image and video patches (`VisionInputs`): everything that
depends on the grids (window permutation, rotary positions, attention segments, the
interpolation of learned position embeddings) computed in numpy, so the device program only
sees arrays of static shape."""

from __future__ import annotations

import jax
import numpy as np
from flax import struct

from jaxvrl.models.config import VisionConfig


@struct.dataclass
class VisionInputs:
    """Packed patches of several images/videos plus their host-computed layout.

    pixel_values:    float[N, C*T*P*P], patches in window order (`vision_inputs` reorders the
                     processor's; N may include padding, last).
    rot_pos:         int32[N, 2] (row, col) rotary position of each patch, window order.
    window_index:    int32[U] original merge unit at each window-order slot (U = N / merge unit).
    reverse_index:   int32[U] inverse permutation of window_index.
    full_segments:   int32[N] attention segment (one per image frame) in window order.
    window_segments: int32[N] attention segment (one per window) in window order.
    pos_index:       int32[N, 4] or None: the rows of the learned position table (towers with
                     one, `VisionConfig.num_position_embeddings`) whose sum weighted by
                     pos_weight float32[N, 4] is each patch's position embedding, window order.
    """

    pixel_values: jax.Array
    rot_pos: jax.Array
    window_index: jax.Array
    reverse_index: jax.Array
    full_segments: jax.Array
    window_segments: jax.Array
    pos_index: jax.Array | None = None
    pos_weight: jax.Array | None = None


def stack_vision_inputs(rows: list[VisionInputs]) -> VisionInputs:
    """Per-row layout: stack rows of equal `num_patches` along a new leading batch axis."""
    return jax.tree.map(lambda *xs: np.stack(xs), *rows)


def _rot_pos(grid_thw: np.ndarray, merge: int) -> np.ndarray:
    """(row, col) of every patch, block-major over merge x merge blocks (HF order)."""
    out = []
    for t, h, w in grid_thw:
        hpos, wpos = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        shape = (h // merge, merge, w // merge, merge)
        hpos = hpos.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
        wpos = wpos.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
        out.append(np.tile(np.stack([hpos, wpos], -1), (t, 1)))
    return np.concatenate(out, 0) if out else np.zeros((0, 2), np.int64)


def _taps(index: np.ndarray, size: np.ndarray, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear taps (floor, floor + 1, clamped to the table) int64[n, 2] and their weights
    float32[n, 2] for positions `index` on axes of `size` patches resampled from `side` rows,
    corners aligned: HF's `_interpolation_axis_taps_weights`, in its float32 order."""
    span = np.maximum(size - 1, 1).astype(np.float32)
    src = index.astype(np.float32) * np.float32(side - 1) / span
    floor = np.floor(src)
    offsets = np.arange(2)
    taps = np.clip(floor.astype(np.int64)[:, None] + offsets, 0, side - 1)
    distance = np.abs(src[:, None] - floor[:, None] - offsets.astype(np.float32))
    return taps, np.maximum(np.float32(1) - distance, np.float32(0))


def _position_taps(grid_thw: np.ndarray, merge: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices int64[N, 4] into a side x side table and weights float32[N, 4] of every patch
    (processor order) for the bilinear interpolation of the table to its grid."""
    rows = _rot_pos(grid_thw, merge)
    size = np.repeat(grid_thw[:, 1:], np.prod(grid_thw, axis=-1), axis=0)  # (h, w) per patch
    h_taps, h_w = _taps(rows[:, 0], size[:, 0], side)
    w_taps, w_w = _taps(rows[:, 1], size[:, 1], side)
    index = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    return index, (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4)


def _window_layout(grid_thw: np.ndarray, cfg: VisionConfig) -> tuple[np.ndarray, np.ndarray]:
    """Window permutation of merge units and the window id of each unit, in window order.

    Windows are `window_size` pixels square; grids that do not divide the window get partial
    windows at the bottom/right edges (HF pads the index grid with -100 and drops those slots).
    """
    merge = cfg.spatial_merge_size
    ws = cfg.window_units
    if not ws:  # no windows: processor order, one "window" per frame
        per_frame = [(h // merge) * (w // merge) for t, h, w in grid_thw for _ in range(t)]
        ids = np.repeat(np.arange(len(per_frame)), per_frame).astype(np.int64)
        return np.arange(len(ids)), ids
    index, window_ids, offset, next_window = [], [], 0, 0
    for t, h, w in grid_thw:
        gh, gw = h // merge, w // merge
        idx = np.arange(t * gh * gw).reshape(t, gh, gw)
        ph, pw = (-gh) % ws, (-gw) % ws
        # HF pads by ws - g % ws, which adds an all-padding window when g divides ws; empty
        # windows have no tokens, so padding by (-g) % ws gives the same layout.
        padded = np.pad(idx, ((0, 0), (0, ph), (0, pw)), constant_values=-1)
        nh, nw = (gh + ph) // ws, (gw + pw) // ws
        padded = padded.reshape(t, nh, ws, nw, ws).transpose(0, 1, 3, 2, 4).reshape(t, nh * nw, -1)
        wid = np.broadcast_to(np.arange(t * nh * nw).reshape(t, nh * nw, 1), padded.shape)
        keep = padded >= 0
        index.append(padded[keep] + offset)
        window_ids.append(wid[keep] + next_window)
        offset += t * gh * gw
        next_window += t * nh * nw
    if not index:
        return np.zeros((0,), np.int64), np.zeros((0,), np.int64)
    return np.concatenate(index), np.concatenate(window_ids)


def vision_inputs(
    pixel_values, grid_thw, cfg: VisionConfig, num_patches: int | None = None
) -> VisionInputs:
    """Host-side layout of packed patches (pixel_values in the processor's order). Pads to
    `num_patches` rows (a multiple of the merge unit) so that batches with different grids
    share one compiled program, and puts the patches in window order: the embedding is
    patch-wise, so reordering the pixels here is reordering its output, without a gather (and
    its backward scatter) in the program."""
    grid = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
    pv = np.asarray(pixel_values)
    unit, merge = cfg.merge_unit, cfg.spatial_merge_size
    n_valid = int(np.sum(np.prod(grid, axis=-1))) if len(grid) else 0
    if pv.ndim != 2 or pv.shape[1] != cfg.patch_dim:
        raise ValueError(f"pixel_values must be [num_patches, {cfg.patch_dim}], got {pv.shape}")
    if np.any(grid[:, 1:] % merge):
        raise ValueError(f"grid_thw h and w must be multiples of {merge}, got {grid.tolist()}")
    if pv.shape[0] < n_valid:
        raise ValueError(f"pixel_values has {pv.shape[0]} rows but grid_thw needs {n_valid}")
    n = pv.shape[0] if num_patches is None else num_patches
    if n < n_valid or n % unit:
        raise ValueError(
            f"num_patches={n} must be >= {n_valid} and a multiple of the merge unit {unit}"
        )
    pv = np.concatenate([pv[:n_valid], np.zeros((n - n_valid, pv.shape[1]), pv.dtype)])

    win_index, win_ids = _window_layout(grid, cfg)
    n_units, n_valid_units = n // unit, n_valid // unit
    window_index = np.concatenate([win_index, np.arange(n_valid_units, n_units)])
    reverse_index = np.argsort(window_index)
    # One full-attention segment per (image, frame); padding gets its own segment.
    frame = np.repeat(
        np.arange(int(np.sum(grid[:, 0])) if len(grid) else 0),
        np.repeat(grid[:, 1] * grid[:, 2], grid[:, 0]) if len(grid) else [],
    )
    frame_units = np.concatenate([frame[::unit], np.full(n_units - n_valid_units, -1)])
    # win_ids is already in window order; frame ids are in processor order. Padding units get
    # windows of their own, as wide as whole ones, so every window is a run of at most
    # `window_patches` consecutive patches (what the banded attention relies on).
    first_pad = int(win_ids.max()) + 1 if len(win_ids) else 0
    pad_windows = first_pad + np.arange(n_units - n_valid_units) // max(cfg.window_units**2, 1)
    window_units = np.concatenate([win_ids, pad_windows])
    rot = np.concatenate([_rot_pos(grid, merge), np.zeros((n - n_valid, 2), np.int64)])
    rot = rot.reshape(n_units, unit, 2)[window_index].reshape(n, 2)
    pos_index = pos_weight = None
    if cfg.num_position_embeddings:  # padding: row 0 with weight 0
        index, weight = _position_taps(grid, merge, cfg.position_side)
        index = np.concatenate([index, np.zeros((n - n_valid, 4), np.int64)])
        weight = np.concatenate([weight, np.zeros((n - n_valid, 4), np.float32)])
        pos_index = index.reshape(n_units, unit, 4)[window_index].reshape(n, 4).astype(np.int32)
        pos_weight = weight.reshape(n_units, unit, 4)[window_index].reshape(n, 4)
    return VisionInputs(
        pixel_values=pv.reshape(n_units, unit, -1)[window_index].reshape(n, -1),
        rot_pos=rot.astype(np.int32),
        window_index=window_index.astype(np.int32),
        reverse_index=reverse_index.astype(np.int32),
        full_segments=np.repeat(frame_units[window_index], unit).astype(np.int32),
        window_segments=np.repeat(window_units, unit).astype(np.int32),
        pos_index=pos_index,
        pos_weight=pos_weight,
    )
