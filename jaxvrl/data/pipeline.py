"""List-based encoding and collation for the trainer's per-row vision layout.

`encode_rows` (in `jaxvrl.data.rows`) encodes rows eagerly, `EpochIterator` walks them in
deterministic shuffled epochs, and `collate` builds a batch with per-row `VisionInputs`. The
trainer draws its training prompts from the grain pipeline (`jaxvrl.data.loader.make_dataset`
with `batch_fn=list`) and collates them here; validation examples are encoded eagerly.

Static shapes: prompts are left-padded to a multiple of `prompt_bucket` tokens and each row's
patches to a power of two (at least 16), so a run compiles at most
(max_prompt_length / prompt_bucket) x log2(max patches / 16) programs per batch size.
"""

from __future__ import annotations

import numpy as np

from jaxvrl.data.buckets import length_bucket, pow2_bucket
from jaxvrl.data.prompts import pool_token_ids
from jaxvrl.data.rows import (  # noqa: F401 -- re-exported for callers of this module
    DataError,
    EncodeOptions,
    SkipStats,
    encode_row,
    encode_rows,
    load_image,
)
from jaxvrl.data.sources import read_rows  # noqa: F401 -- re-exported
from jaxvrl.models.qwen2_5_vl import (
    attention_pools,
    get_rope_index,
    stack_vision_inputs,
    vision_inputs,
)


class EpochIterator:
    """Deterministic shuffled epochs over encoded examples, sharded per process; its state
    (epoch, position) is a small dict that goes into the checkpoint."""

    def __init__(
        self,
        examples: list,
        batch_size: int,
        seed: int = 0,
        shard_index: int = 0,
        shard_count: int = 1,
        shuffle: bool = True,
    ):
        self.examples = examples[shard_index::shard_count]
        if len(self.examples) < batch_size:
            raise DataError(
                f"{len(self.examples)} usable rows, fewer than one batch of {batch_size}"
            )
        self.batch_size, self.seed, self.shuffle = batch_size, seed, shuffle
        self.epoch, self.pos = 0, 0

    def _order(self) -> np.ndarray:
        n = len(self.examples)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, self.epoch]).permutation(n)

    def __next__(self) -> list:
        if self.pos + self.batch_size > len(self.examples):
            self.epoch, self.pos = self.epoch + 1, 0
        idx = self._order()[self.pos : self.pos + self.batch_size]
        self.pos += self.batch_size
        return [self.examples[i] for i in idx]

    def get_state(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos, "seed": self.seed}

    def set_state(self, state: dict) -> None:
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])


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
    int32[3, B, P], deltas int32[B], images (per-row VisionInputs, None if no row has one),
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
    pos, deltas = get_rope_index(ids, mask, model_config, all_grids)
    has_image = np.array([len(g) > 0 for g in grids])
    images = None
    if has_image.any():
        npatch = pow2_bucket(max(len(r["pixel_values"]) for r in rows), minimum=16)
        images = stack_vision_inputs(
            [
                vision_inputs(r["pixel_values"], r["image_grid_thw"], model_config.vision, npatch)
                for r in rows
            ]
        )
    pools = None
    if with_pools:
        pools = attention_pools(ids, mask, p, **pool_token_ids(tokenizer))
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
