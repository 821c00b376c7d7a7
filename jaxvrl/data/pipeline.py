"""Collation for the trainer's per-row vision layout.

`collate` builds a batch with per-row `VisionInputs` from encoded examples. The trainer draws
its training prompts from the grain pipeline (`jaxvrl.data.loader.make_dataset`) and collates
them here; validation examples are encoded eagerly (`encode_rows`, in `jaxvrl.data.rows`).

Static shapes: prompts are left-padded to a multiple of `prompt_bucket` tokens and each row's
patches to a power of two (at least 16), so a run compiles at most
(max_prompt_length / prompt_bucket) x log2(max patches / 16) programs per batch size.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from jaxvrl.data.buckets import length_bucket, pow2_bucket
from jaxvrl.data.prompts import pool_token_ids
from jaxvrl.data.rows import EncodeOptions, encode_rows  # noqa: F401 -- re-exported
from jaxvrl.data.sources import read_rows  # noqa: F401 -- re-exported
from jaxvrl.models import (
    attention_pools,
    processor,
    rope_index,
    stack_vision_inputs,
    vision_inputs,
)


def collate(
    examples: list,
    repeat: int,
    model_config,
    tokenizer,
    prompt_bucket: int = 32,
    with_pools: bool = True,
    agree: Callable[[dict], dict] | None = None,
) -> dict:
    """Batch of len(examples) * repeat rows (each example repeated `repeat` times in a row).

    Returns numpy arrays: input_ids/attention_mask int32[B, P] (left-padded), position_ids
    (the family's positions [..., B, P]), deltas int32[B], images and videos (per-row
    VisionInputs, None where no row has one), has_image bool[B] (the row holds an image or a
    video), pools (bool[B, P] each) and the examples per row (`rows`).

    agree(sizes) -> sizes: where each process collates its own rows of one global batch (a
    pod), the sizes every process must share, {"width": P, "images": patches per row,
    "videos": ...} (0: none), made equal on every process (their maxima); None: these rows'.
    """
    rows = [ex for ex in examples for _ in range(repeat)]
    grids = {k: [_grid(r, k) for r in rows] for k in ("image_grid_thw", "video_grid_thw")}
    sizes = {
        "width": length_bucket(max(len(r["prompt_ids"]) for r in rows), prompt_bucket),
        "images": _patches(rows, "pixel_values", grids["image_grid_thw"]),
        "videos": _patches(rows, "pixel_values_videos", grids["video_grid_thw"]),
    }
    if agree is not None:
        sizes = agree(sizes)
    p = sizes["width"]
    pad_id = tokenizer.pad_token_id or 0
    ids = np.full((len(rows), p), pad_id, np.int32)
    mask = np.zeros((len(rows), p), np.int32)
    for i, r in enumerate(rows):
        n = len(r["prompt_ids"])
        ids[i, p - n :] = r["prompt_ids"]
        mask[i, p - n :] = 1
    seconds = [np.asarray(r.get("second_per_grid_ts", ()), np.float32).reshape(-1) for r in rows]
    pos, deltas = rope_index(
        model_config,
        ids,
        mask,
        _joined(grids["image_grid_thw"]),
        _joined(grids["video_grid_thw"]),
        _joined(seconds) if any(len(g) for g in grids["video_grid_thw"]) else None,
    )
    images = _row_inputs(
        model_config, rows, "pixel_values", grids["image_grid_thw"], sizes["images"]
    )
    videos = _row_inputs(
        model_config, rows, "pixel_values_videos", grids["video_grid_thw"], sizes["videos"]
    )
    has_image = np.array([len(a) + len(b) > 0 for a, b in zip(*grids.values())])
    pools = None
    if with_pools:
        tokens = pool_token_ids(tokenizer, processor(model_config))
        pools = attention_pools(ids, mask, p, **tokens)
    return dict(
        input_ids=ids,
        attention_mask=mask,
        position_ids=pos,
        deltas=deltas,
        images=images,
        videos=videos,
        has_image=has_image,
        pools=pools,
        rows=rows,
    )


def _grid(example: dict, key: str) -> np.ndarray:
    """int64[k, 3]: an example's image or video grids (none: [0, 3])."""
    return np.asarray(example.get(key, ()), np.int64).reshape(-1, 3)


def _joined(arrays: list):
    """The rows' arrays in one (rope_index's packed grids), or None where all are empty."""
    return np.concatenate(arrays) if any(len(a) for a in arrays) else None


def _patches(rows: list, key: str, grids: list) -> int:
    """The patches each row's `key` inputs are padded to: the most any row has, up to a power
    of two (at least 16); 0 where no row has any."""
    have = [len(r[key]) for r, g in zip(rows, grids) if len(g)]
    return pow2_bucket(max(have), minimum=16) if have else 0


def _row_inputs(model_config, rows: list, key: str, grids: list, npatch: int):
    """Per-row VisionInputs of the rows' `key` patches, each row's padded to `npatch` (0:
    None)."""
    if not npatch:
        return None
    empty = np.zeros((0, model_config.vision.patch_dim), np.float32)
    return stack_vision_inputs(
        [
            vision_inputs(model_config, r[key] if len(g) else empty, g, npatch)
            for r, g in zip(rows, grids)
        ]
    )
