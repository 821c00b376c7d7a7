"""Positions: the family's own (int[B, T] for RoPE, int[3, B, T] for M-RoPE), and what the
rest of the package does with them without knowing their rank: rows are always the
second-to-last axis and tokens the last (`row_axis`), and the tokens appended to a row
continue from one number on every leading axis (`continue_positions`). Also the host-side
M-RoPE position ids shared by the vision-language families and the attention-statistics
pools."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import jax.numpy as jnp
import numpy as np


def _xp(x):
    """numpy for numpy arrays, jax.numpy for the rest (traced or device arrays)."""
    return np if isinstance(x, np.ndarray) else jnp


def row_axis(positions) -> int:
    """The axis of the rows in a family's positions [..., B, T]."""
    return positions.ndim - 2


def continue_positions(like, start, n: int):
    """Positions int32[..., B, n] of n tokens appended to the rows of the family's positions
    `like` [..., B, T] (only its rank is read; or the rank itself, `Model.position_rank`):
    token i of row b sits at start[b] + i on every leading axis (M-RoPE's three alike).
    numpy in, numpy out; jax arrays give jax arrays."""
    xp = _xp(start)
    steps = (xp.asarray(start)[:, None] + xp.arange(n)).astype(np.int32)  # [B, n]
    # M-RoPE's three axes (temporal, height, width) hold the same text positions
    lead = ((3,) if like == 3 else ()) if isinstance(like, int) else like.shape[:-2]
    return xp.broadcast_to(steps, (*lead, *steps.shape))


def take_rows(positions, rows):
    """The rows `rows` int[b] of a family's positions (numpy or jax)."""
    xp = _xp(positions)
    return xp.take(positions, rows, axis=row_axis(positions))


def repeat_rows(positions, g: int):
    """Each row of a family's positions repeated g times in a row (numpy or jax)."""
    xp = _xp(positions)
    return xp.repeat(positions, g, axis=row_axis(positions))


def rows_first(positions):
    """A family's positions with the rows moved to axis 0 ([B, ..., T]), as every other
    array of a batch holds them; `rows_back` undoes it (numpy or jax)."""
    xp = _xp(positions)
    return xp.moveaxis(positions, row_axis(positions), 0)


def rows_back(positions, lead: int = 0):
    """`rows_first` undone for positions whose rows are at axis `lead` (after `lead` axes of
    micro-batches or devices): [m.., B, ..., T] -> [m.., ..., B, T]."""
    xp = _xp(positions)
    return xp.moveaxis(positions, lead, positions.ndim - 2)


def _runs(types: np.ndarray):
    """(type, start, end) of each maximal run of equal values."""
    if len(types) == 0:
        return []
    change = np.flatnonzero(np.diff(types)) + 1
    starts = np.concatenate([[0], change])
    ends = np.concatenate([change, [len(types)]])
    return [(int(types[s]), int(s), int(e)) for s, e in zip(starts, ends)]


def get_rope_index(
    input_ids,
    attention_mask,
    cfg,
    image_grid_thw=None,
    video_grid_thw=None,
    second_per_grid_ts=None,
    *,
    timed_video: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """3-D M-RoPE position ids like HF `get_rope_index`.

    input_ids, attention_mask: int[B, T] (left or right padding). Images and videos are consumed
    in order across the batch. Text tokens advance all three axes by one; a vision block of grid
    (t, h, w) gets (start + t_idx * interval, start + row, start + col) over its merged grid, and
    the next text token starts at start + max(h, w) / merge. Padding positions are 0. The
    interval is 1 for images; for videos, tokens_per_second * second_per_grid_ts with
    timed_video (Qwen2.5-VL), else 1: the frame index (Qwen2-VL, second_per_grid_ts unread).

    Returns (position_ids int32[3, B, T], deltas int32[B]) where deltas = max position + 1 -
    number of valid tokens: the i-th token appended after the prompt has position
    n_valid + deltas + i on all three axes.
    """
    ids = np.asarray(input_ids)
    b, t = ids.shape
    mask = np.ones_like(ids, bool) if attention_mask is None else np.asarray(attention_mask) > 0
    merge = cfg.vision.spatial_merge_size
    grids = {
        1: iter(np.asarray(image_grid_thw).reshape(-1, 3)) if image_grid_thw is not None else None,
        2: iter(np.asarray(video_grid_thw).reshape(-1, 3)) if video_grid_thw is not None else None,
    }
    seconds = (
        iter(np.asarray(second_per_grid_ts, np.float32).reshape(-1))
        if (second_per_grid_ts is not None)
        else None
    )
    pos = np.zeros((3, b, t), np.int64)
    deltas = np.zeros((b,), np.int64)
    for row in range(b):
        row_ids = ids[row][mask[row]]
        types = np.where(row_ids == cfg.image_token_id, 1, 0)
        types = np.where(row_ids == cfg.video_token_id, 2, types)
        parts, cur = [], 0
        for kind, start, end in _runs(types):
            n = end - start
            if kind == 0:
                parts.append(np.broadcast_to(np.arange(n) + cur, (3, n)))
                cur += n
                continue
            parts_kind, cur = _vision_positions(
                kind, n, cur, grids, seconds, cfg, merge, row, timed_video
            )
            parts.extend(parts_kind)
        row_pos = np.concatenate(parts, axis=1) if parts else np.zeros((3, 0), np.int64)
        pos[:, row, mask[row]] = row_pos
        deltas[row] = (row_pos.max() + 1 if row_pos.size else 0) - len(row_ids)
    return pos.astype(np.int32), deltas.astype(np.int32)


def _vision_positions(kind, n, cur, grids, seconds, cfg, merge, row, timed):
    """Positions of a run of n vision pad tokens, which may hold several consecutive grids."""
    name = "image" if kind == 1 else "video"
    parts = []
    while n > 0:
        if grids[kind] is None:
            raise ValueError(f"row {row}: {name} pad tokens but no {name}_grid_thw given")
        try:
            gt, gh, gw = (int(x) for x in next(grids[kind]))
        except StopIteration:
            raise ValueError(
                f"row {row}: more {name} pad tokens than {name}_grid_thw entries"
            ) from None
        lh, lw = gh // merge, gw // merge
        count = gt * lh * lw
        if count > n:
            raise ValueError(
                f"row {row}: {name} grid {(gt, gh, gw)} needs {count} pad tokens, found {n}"
            )
        interval = np.float32(1.0)
        if kind == 2 and timed:  # in float32, as transformers (its processor's float32 seconds)
            sec = np.float32(1.0 if seconds is None else next(seconds, 1.0))
            interval = np.float32(cfg.vision.tokens_per_second) * sec
        tt = (np.arange(gt, dtype=np.float32) * interval).astype(np.int64)
        t_idx, h_idx, w_idx = np.meshgrid(tt, np.arange(lh), np.arange(lw), indexing="ij")
        parts.append(np.stack([t_idx.ravel(), h_idx.ravel(), w_idx.ravel()]) + cur)
        cur += max(gh, gw) // merge
        n -= count
    return parts, cur


def attention_pools(
    input_ids,
    attention_mask,
    prompt_length: int,
    *,
    im_start_id: int,
    im_end_id: int,
    user_header_ids: Sequence[int],
    special_ids: Iterable[int],
    vision_ids: Iterable[int],
    header_breaks: Iterable[int] = (),
) -> dict[str, np.ndarray]:
    """Key pools for attention statistics (docs/algorithms.md#attention-statistics), bool[B, T]
    each.

    vision: image/video pad tokens. text: tokens inside user turns (after `<|im_start|>` +
    `user_header_ids`, up to `<|im_end|>`) that are neither special nor vision tokens. The
    header's last token (its line break) may also be one of `header_breaks`: the tokens that
    line break merges into when the user's text starts with more of them ("\n\n", ...).
    prompt: every valid prompt token (index < prompt_length) except the row's first valid token,
    the attention sink; masses are renormalised over it.
    """
    ids = np.asarray(input_ids)
    valid = np.asarray(attention_mask) > 0
    b, t = ids.shape
    vision = np.isin(ids, list(vision_ids)) & valid
    special = np.isin(ids, list(special_ids))
    header = list(user_header_ids)
    breaks = set(header[-1:]) | set(header_breaks)
    in_user = np.zeros((b, t), bool)
    for row in range(b):
        inside, skip = False, 0
        for j in range(min(prompt_length, t)):
            if not valid[row, j]:
                continue
            tok = ids[row, j]
            if tok == im_start_id:
                after = list(ids[row, j + 1 : j + 1 + len(header)])
                inside = len(after) == len(header) > 0 and after[:-1] == header[:-1]
                inside = inside and after[-1] in breaks
                skip = len(header) if inside else 0
                continue
            if tok == im_end_id:
                inside = False
                continue
            if skip:
                skip -= 1
                continue
            in_user[row, j] = inside
    in_prompt = valid & (np.arange(t)[None, :] < prompt_length)
    first = np.argmax(valid, axis=1)
    prompt = in_prompt.copy()
    prompt[np.arange(b), first] = False
    vision &= prompt
    text = in_user & ~special & ~vision & prompt
    return {"vision": vision, "text": text, "prompt": prompt}
