"""Collation for the trainer's per-row vision layout.

`collate` builds a batch with per-row `VisionInputs` from encoded examples. The trainer draws
its training prompts from the grain pipeline (`jaxvrl.data.loader.make_dataset`) and collates
them here; validation examples are encoded eagerly (`encode_rows`, in `jaxvrl.data.rows`).

Static shapes: prompts are left-padded to a multiple of `prompt_bucket` tokens and each row's
patches to a power of two (at least 16), so a run compiles at most
(max_prompt_length / prompt_bucket) x log2(max patches / 16) programs per batch size.
"""

from __future__ import annotations

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
) -> dict:
    """Batch of len(examples) * repeat rows (each example repeated `repeat` times in a row).

    Returns numpy arrays: input_ids/attention_mask int32[B, P] (left-padded), position_ids
    (the family's positions [..., B, P]), deltas int32[B], images (per-row VisionInputs, None if no row has one),
    has_image bool[B], pools (bool[B, P] each) and the examples per row (`rows`).
    """
    rows = [ex for ex in examples for _ in range(repeat)]
    p = length_bucket(max(len(r["prompt_ids"]) for r in rows), prompt_bucket)
    pad_id = tokenizer.pad_token_id or 0
    ids = np.full((len(rows), p), pad_id, np.int32)
    mask = np.zeros((len(rows), p), np.int32)
    for i, r in enumerate(rows):
        n = len(r["prompt_ids"])
        ids[i, p - n :] = r["prompt_ids"]
        mask[i, p - n :] = 1
    grids = [r["image_grid_thw"] for r in rows]
    all_grids = np.concatenate([g for g in grids if len(g)]) if any(len(g) for g in grids) else None
    pos, deltas = rope_index(model_config, ids, mask, all_grids)
    has_image = np.array([len(g) > 0 for g in grids])
    images = None
    if has_image.any():
        npatch = pow2_bucket(max(len(r["pixel_values"]) for r in rows), minimum=16)
        images = stack_vision_inputs(
            [
                vision_inputs(model_config, r["pixel_values"], r["image_grid_thw"], npatch)
                for r in rows
            ]
        )
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
        has_image=has_image,
        pools=pools,
        rows=rows,
    )
