"""Rows -> encoded examples -> padded batches of G repeated rows, with a resumable iterator.

Row format (SPEC section 8): `problem` (or `prompt`), `images` (paths relative to `image_dir`,
raw bytes, {"bytes": ...} dicts (base64 text in JSON) or PIL images), optional `choices` + `label_idx`, `answer` /
`solution`. Bad rows are skipped, counted by reason and logged once each, never a crash.

Static shapes: prompts are left-padded to a multiple of `prompt_bucket` tokens and each row's
patches to a power of two (at least 16), so a run compiles at most
(max_prompt_length / prompt_bucket) x log2(max patches / 16) programs per batch size.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import io
import json
import logging
import os

import numpy as np
from PIL import Image

from jaxvrl.data.processor import process_images
from jaxvrl.data.prompts import encode_prompt, pool_token_ids
from jaxvrl.models.qwen2_5_vl import (
    attention_pools,
    get_rope_index,
    stack_vision_inputs,
    vision_inputs,
)

log = logging.getLogger(__name__)


class DataError(ValueError):
    """A data file that cannot be read at all (fails at start, naming the file and line)."""


def read_rows(path: str) -> list[dict]:
    """JSONL, JSON list or parquet rows."""
    if not os.path.exists(path):
        raise DataError(f"{path}: data file not found")
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except Exception as e:  # noqa: BLE001 -- report any parquet failure with the path
            raise DataError(f"{path}: not a readable parquet file ({e})") from e
    rows = []
    with open(path, encoding="utf-8") as f:
        if path.endswith(".json"):
            try:
                return list(json.load(f))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from e
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: invalid JSONL ({e.msg})") from e
    return rows


@dataclasses.dataclass
class SkipStats:
    """Rows skipped per reason; the first row of each reason is logged with its source."""

    counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def skip(self, reason: str, where: str, detail: str = "") -> None:
        if not self.counts[reason]:
            log.warning(
                "skipping %s (%s)%s; further rows like it are only counted",
                where,
                reason,
                f": {detail}" if detail else "",
            )
        self.counts[reason] += 1

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def load_image(ref, image_dir: str | None) -> Image.Image:
    if isinstance(ref, Image.Image):
        return ref
    if isinstance(ref, dict):
        ref = ref.get("bytes") or ref.get("path")
        if isinstance(ref, str) and not os.path.exists(ref):  # base64 in JSON
            ref = base64.b64decode(ref, validate=True)
    if isinstance(ref, bytes | bytearray):
        img = Image.open(io.BytesIO(ref))
    else:
        path = ref if image_dir is None or os.path.isabs(ref) else os.path.join(image_dir, ref)
        img = Image.open(path)
    img.load()
    return img


@dataclasses.dataclass(frozen=True)
class EncodeOptions:
    image_dir: str | None = None
    max_prompt_length: int = 512
    max_image_side: int = 1024
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 256
    system_prompt: str | None = None
    require_label: bool = True


def encode_rows(
    rows, tokenizer, opts: EncodeOptions, source: str = "data", stats: SkipStats | None = None
) -> tuple[list[dict], SkipStats]:
    """Encode rows (prompt ids, patches); bad rows go to `stats`, never raise."""
    stats = stats or SkipStats()
    out = []
    for i, row in enumerate(rows):
        where = f"{source} row {i}"
        text = row.get("problem", row.get("prompt"))
        if not isinstance(text, str) or not text:
            stats.skip("missing_prompt", where)
            continue
        label = row.get("label_idx", row.get("answer", row.get("solution")))
        if opts.require_label and label is None:
            stats.skip("missing_label", where)
            continue
        images = []
        try:
            images = [load_image(r, opts.image_dir) for r in (row.get("images") or [])]
        except FileNotFoundError as e:
            stats.skip("missing_image", where, str(e))
            continue
        except Exception as e:  # noqa: BLE001 -- any decoder error means a corrupt image
            stats.skip("corrupt_image", where, str(e))
            continue
        if any(max(im.size) > opts.max_image_side for im in images):
            stats.skip("oversized_image", where, f"side > {opts.max_image_side}")
            continue
        pv, grid = process_images(images, opts.min_pixels, opts.max_pixels)
        ids = encode_prompt(tokenizer, text, grid if images else None, system=opts.system_prompt)
        if len(ids) > opts.max_prompt_length:
            stats.skip("prompt_too_long", where, f"{len(ids)} > {opts.max_prompt_length} tokens")
            continue
        out.append(
            {
                **{k: v for k, v in row.items() if k != "images"},
                "prompt_ids": ids,
                "pixel_values": pv,
                "image_grid_thw": grid,
                "problem": text,
            }
        )
    return out, stats


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


def _bucket(n: int, step: int) -> int:
    return max(step, -(-n // step) * step)


def patch_bucket(n: int, minimum: int = 16) -> int:
    return max(minimum, 1 << int(np.ceil(np.log2(max(n, 1)))))


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
    p = _bucket(max(len(r["prompt_ids"]) for r in rows), prompt_bucket)
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
        npatch = patch_bucket(max(len(r["pixel_values"]) for r in rows))
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
