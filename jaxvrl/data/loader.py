"""The grain pipeline: source rows -> shuffled, sharded, repeated -> encoded (bad rows counted
and filtered) -> batches of B encoded examples (`jaxvrl.data.rows.encode_row`).

    ds, stats = make_dataset(open_sources(paths), tokenizer, opts, batch_size=B)
    it = iter(ds)            # grain DatasetIterator
    examples = next(it)      # list of B example dicts (`pipeline.collate` lays them out)
    state = it.get_state()   # small dict; goes into the orbax checkpoint beside the train state
    it.set_state(state)      # resumes at exactly the next batch

Order: rows are sharded by process first (`shard_index::shard_count`), then shuffled with
`seed`, reshuffled differently (and deterministically) each epoch. Batches may straddle an
epoch boundary. Encoding is deterministic, so restoring the state reproduces every batch.
"""

from __future__ import annotations

from jaxvrl.data.rows import DataError, EncodeOptions, SkipStats, encode_row


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


def epoch_seed(seed: int) -> int:
    """grain's shuffle seed for a run's `seed`. grain shuffles epoch e with seed + e, so the
    seeds s and s + 1 would share every epoch but one; an odd multiplier (invertible modulo
    2^32) spreads the runs' seeds apart: two seeds within 2.6 million of each other share no
    epoch's order in their first 1,000 epochs. Seed 0 keeps grain's own order."""
    return (int(seed) * 0x9E3779B1) % 2**32


def make_dataset(
    source,
    tokenizer,
    opts: EncodeOptions,
    *,
    batch_size: int,
    seed: int = 0,
    shuffle: bool = True,
    num_epochs: int | None = None,
    shard_index: int = 0,
    shard_count: int = 1,
    stats: SkipStats | None = None,
    batch_fn=list,
    read_threads: int = 0,
):
    """A grain IterDataset of batches (see the module docstring) and the live SkipStats.

    source: random access rows (`__len__`, `__getitem__`), e.g. `sources.open_sources(paths)`
    or a list of row dicts (the built-in task). batch_size counts prompts (B). num_epochs=None
    repeats forever. batch_fn(examples) -> batch receives the B examples (default: the list).
    read_threads=0 encodes in the consuming thread (exact, ordered skip logging).
    """
    import grain

    if not 0 <= shard_index < shard_count:
        raise ValueError(f"shard_index {shard_index} not in [0, {shard_count})")
    stats = stats if stats is not None else SkipStats()
    ds = grain.MapDataset.source(source)
    ds = ds[shard_index::shard_count]
    if len(ds) == 0:
        raise DataError(
            f"no rows for process {shard_index} of {shard_count}: the data has {len(source)} "
            "rows, fewer than the processes that split it"
        )
    n_rows = len(ds)
    if shuffle:
        ds = ds.shuffle(seed=epoch_seed(seed))
    ds = ds.repeat(num_epochs)

    def encode(row):
        where = row.get("_where", f"row id {row.get('id', '?')}")
        return encode_row(row, tokenizer, opts, where, stats)

    ds = ds.map(encode)
    read = grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=max(read_threads, 1))
    it = ds.to_iter_dataset(read, allow_nones=True).filter(_usable_rows(n_rows, stats))
    return it.batch(batch_size, drop_remainder=True, batch_fn=batch_fn), stats
