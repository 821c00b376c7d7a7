"""The grain pipeline: source rows -> shuffled, sharded, repeated -> encoded (bad rows counted
and filtered) -> batches of B prompts, each repeated G times for group sampling.

    ds, stats = make_dataset(open_sources(paths), tokenizer, opts, batch_size=B, group_size=G)
    it = iter(ds)            # grain DatasetIterator
    batch = next(it)         # dict, see `collate_flat`
    state = it.get_state()   # small dict; goes into the orbax checkpoint beside the train state
    it.set_state(state)      # resumes at exactly the next batch

Order: rows are sharded by process first (`shard_index::shard_count`), then shuffled with
`seed`, reshuffled differently (and deterministically) each epoch. Batches may straddle an
epoch boundary. Encoding is deterministic, so restoring the state reproduces every batch.

Static shapes (`collate_flat`): prompt length P is rounded up to a multiple of `prompt_bucket`;
patch rows, image count, video patch rows and video count are each rounded up to a power of
two (at least `min_patch_bucket` / 1; 0 stays 0). Over a run the number of distinct batch
shapes is at most `shape_bound(...)`: (#P values) x (#patch buckets) x (#image-count buckets)
x (the same two factors for videos when the data has videos).
"""

from __future__ import annotations

import math

import numpy as np

from jaxvrl.data.buckets import length_bucket, pow2_bucket
from jaxvrl.data.rows import DataError, EncodeOptions, SkipStats, encode_row

PATCH_DIM = 3 * 2 * 14 * 14  # C x temporal_patch_size x patch x patch


def _pack(arrays: list, grids: list, rows_of: list, dim: int, min_patch_bucket: int):
    """Concatenate per-row patches/grids and pad: (values float32[Np, dim], mask int32[Np],
    grid int32[Ni, 3] (padding rows zero), owner int32[Ni] (-1 = padding), count)."""
    n_patch = sum(len(a) for a in arrays)
    n_img = sum(len(g) for g in grids)
    np_bucket, ni_bucket = pow2_bucket(n_patch, min_patch_bucket), pow2_bucket(n_img)
    values = np.zeros((np_bucket, dim), np.float32)
    mask = np.zeros((np_bucket,), np.int32)
    grid = np.zeros((ni_bucket, 3), np.int32)
    owner = np.full((ni_bucket,), -1, np.int32)
    if n_patch:
        values[:n_patch] = np.concatenate([a for a in arrays if len(a)])
        mask[:n_patch] = 1
    if n_img:
        grid[:n_img] = np.concatenate([g for g in grids if len(g)])
        owner[:n_img] = np.concatenate(
            [np.full(len(g), r, np.int32) for g, r in zip(grids, rows_of)]
        )
    return values, mask, grid, owner, n_img


def _seconds(example: dict) -> np.ndarray:
    """float32[n_vid]: the example's seconds per temporal patch (1 when it has none)."""
    n = len(np.asarray(example.get("video_grid_thw", np.zeros((0, 3)))).reshape(-1, 3))
    return np.asarray(example.get("second_per_grid_ts", np.ones(n)), np.float32).reshape(-1)


def collate_flat(
    examples: list[dict],
    group_size: int,
    pad_id: int,
    prompt_bucket: int = 32,
    min_patch_bucket: int = 64,
) -> dict:
    """B examples -> one batch of R = B * group_size rows (each example repeated G times in a
    row, so rows g*G .. g*G+G-1 form prompt g's group). Vision inputs are repeated with their
    rows, in row order, so they line up with the pad tokens exactly as in HF.

    Device arrays (numpy):
      input_ids        int32[R, P]   left-padded with `pad_id`
      attention_mask   int32[R, P]   1 on prompt tokens
      pixel_values     float32[Np, 1176]  all images' patches in row order, zero-padded
      pixel_mask       int32[Np]     1 on real patches; padding patches belong to no image
      image_grid_thw   int32[Ni, 3]  (t, h, w) per image; padding images are (0, 0, 0)
      image_row        int32[Ni]     batch row of each image, -1 for padding
      num_images       int32[]       real images (the first num_images grid rows)
      pixel_values_videos, video_pixel_mask, video_grid_thw, video_row, num_videos: the same
                                     for videos (zero-size when the batch has none)
      second_per_grid_ts float32[Nv] seconds per temporal patch of each video (0 for padding)
      label_idx        int32[R]      -1 where the row has none
      group_index      int32[R]      prompt index g of each row
    Host columns (lists of length R): rows (the examples without pixel arrays), prompts
    (problem text), answers (the row's `answer`, else `solution`, else None).
    """
    rows = [ex for ex in examples for _ in range(group_size)]
    r = len(rows)
    p = length_bucket(max(len(x["prompt_ids"]) for x in rows), prompt_bucket)
    ids = np.full((r, p), pad_id, np.int32)
    mask = np.zeros((r, p), np.int32)
    for i, x in enumerate(rows):
        n = len(x["prompt_ids"])
        ids[i, p - n :] = x["prompt_ids"]
        mask[i, p - n :] = 1
    out = dict(input_ids=ids, attention_mask=mask)
    for pv_key, grid_key, names in (
        ("pixel_values", "image_grid_thw", ("pixel_mask", "image_row", "num_images")),
        (
            "pixel_values_videos",
            "video_grid_thw",
            ("video_pixel_mask", "video_row", "num_videos"),
        ),
    ):
        arrays = [np.asarray(x.get(pv_key, np.zeros((0, PATCH_DIM), np.float32))) for x in rows]
        grids = [
            np.asarray(x.get(grid_key, np.zeros((0, 3))), np.int32).reshape(-1, 3) for x in rows
        ]
        values, pmask, grid, owner, n = _pack(arrays, grids, range(r), PATCH_DIM, min_patch_bucket)
        out[pv_key], out[grid_key] = values, grid
        out[names[0]], out[names[1]], out[names[2]] = pmask, owner, np.int32(n)
    seconds = np.zeros(len(out["video_grid_thw"]), np.float32)
    if int(out["num_videos"]):
        seconds[: int(out["num_videos"])] = np.concatenate([_seconds(x) for x in rows])
    out["second_per_grid_ts"] = seconds
    labels = [x.get("label_idx") for x in rows]
    out["label_idx"] = np.array([-1 if v is None else int(v) for v in labels], np.int32)
    out["group_index"] = np.repeat(np.arange(len(examples), dtype=np.int32), group_size)
    drop = (
        "pixel_values",
        "image_grid_thw",
        "pixel_values_videos",
        "video_grid_thw",
        "second_per_grid_ts",
    )
    out["rows"] = [{k: v for k, v in x.items() if k not in drop} for x in rows]
    out["prompts"] = [x["problem"] for x in rows]
    out["answers"] = [x.get("answer", x.get("solution")) for x in rows]
    return out


def shape_bound(
    max_prompt_length: int,
    prompt_bucket: int,
    max_patches: int,
    max_images: int,
    min_patch_bucket: int = 64,
    max_video_patches: int = 0,
    max_videos: int = 0,
) -> int:
    """Upper bound on distinct batch shapes: max_patches / max_images are per batch
    (R rows x the most any row has); 0 patches/images is one more possible value."""

    def n_pow2(hi: int, lo: int) -> int:
        if hi <= 0:
            return 1
        return int(math.log2(pow2_bucket(hi, lo))) - int(math.log2(lo)) + 1 + 1  # + the 0 case

    n_prompt = -(-max_prompt_length // prompt_bucket)
    n_img = n_pow2(max_patches, min_patch_bucket) * n_pow2(max_images, 1)
    n_vid = n_pow2(max_video_patches, min_patch_bucket) * n_pow2(max_videos, 1)
    return n_prompt * n_img * n_vid


def _usable_rows(n_rows: int, stats: SkipStats):
    """The filter that drops bad rows (None). Any 2 * n_rows consecutive rows hold a whole
    epoch, so that many bad rows in a row means there is no good row at all: an error naming
    the skip reasons, rather than an endless search for a batch."""
    misses = 0

    def usable(x) -> bool:
        nonlocal misses
        if x is not None:
            misses = 0
            return True
        misses += 1
        if misses >= 2 * n_rows:
            raise DataError(
                f"no usable row among the {n_rows} rows of this shard (skipped: "
                f"{dict(stats.counts)}; the first of each reason is logged above)"
            )
        return False

    return usable


def make_dataset(
    source,
    tokenizer,
    opts: EncodeOptions,
    *,
    batch_size: int,
    group_size: int = 1,
    seed: int = 0,
    shuffle: bool = True,
    num_epochs: int | None = None,
    shard_index: int = 0,
    shard_count: int = 1,
    prompt_bucket: int = 32,
    min_patch_bucket: int = 64,
    stats: SkipStats | None = None,
    batch_fn=None,
    read_threads: int = 0,
):
    """A grain IterDataset of batches (see the module docstring) and the live SkipStats.

    source: random access rows (`__len__`, `__getitem__`), e.g. `sources.open_sources(paths)`
    or a list of row dicts (the built-in task). batch_size counts prompts (B); each batch
    holds B * group_size rows. num_epochs=None repeats forever. batch_fn(examples) -> batch
    replaces `collate_flat` (e.g. the trainer's per-row layout); it receives the B examples.
    read_threads=0 encodes in the consuming thread (exact, ordered skip logging).
    """
    import grain

    if not 0 <= shard_index < shard_count:
        raise ValueError(f"shard_index {shard_index} not in [0, {shard_count})")
    stats = stats if stats is not None else SkipStats()
    ds = grain.MapDataset.source(source)
    ds = ds[shard_index::shard_count]
    if len(ds) == 0:
        raise ValueError(f"shard {shard_index}/{shard_count} of the data has no rows")
    n_rows = len(ds)
    if shuffle:
        ds = ds.shuffle(seed=seed)
    ds = ds.repeat(num_epochs)

    def encode(row):
        where = row.get("_where", f"row id {row.get('id', '?')}")
        return encode_row(row, tokenizer, opts, where, stats)

    ds = ds.map(encode)
    read = grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=max(read_threads, 1))
    it = ds.to_iter_dataset(read, allow_nones=True).filter(_usable_rows(n_rows, stats))
    if batch_fn is None:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

        def batch_fn(examples):
            return collate_flat(examples, group_size, pad, prompt_bucket, min_patch_bucket)

    return it.batch(batch_size, drop_remainder=True, batch_fn=batch_fn), stats
