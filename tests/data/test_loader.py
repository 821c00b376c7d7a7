"""The grain pipeline: sources, bad rows, resume, sharding, the examples of a batch."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from PIL import Image

from jaxvrl.data import synthetic
from jaxvrl.data.loader import make_dataset
from jaxvrl.data.rows import DataError, EncodeOptions
from jaxvrl.data.sources import open_source, open_sources
from tests.data.conftest import png


def _good(i: int) -> dict:
    return {
        "problem": f"good {i}",
        "images": ["ok.png"],
        "label_idx": i % 4,
        "answer": "ABCD"[i % 4],
    }


BAD = {
    "missing_image": {"problem": "missing", "images": ["nope.png"], "label_idx": 1},
    "corrupt_image": {"problem": "corrupt", "images": ["corrupt.png"], "label_idx": 1},
    "oversized_image": {"problem": "big", "images": ["big.png"], "label_idx": 1},
    "prompt_too_long": {"problem": "long " * 400, "images": ["ok.png"], "label_idx": 1},
    "missing_label": {"problem": "no label", "images": ["ok.png"]},
    "missing_prompt": {"images": ["ok.png"], "label_idx": 2},
}


@pytest.fixture()
def image_dir(tmp_path):
    (tmp_path / "ok.png").write_bytes(png())
    (tmp_path / "corrupt.png").write_bytes(b"not an image")
    Image.new("RGB", (1100, 50)).save(tmp_path / "big.png")
    return tmp_path


def _epoch(ds) -> list[dict]:
    return [b for b in ds]


@pytest.mark.parametrize("reason", sorted(BAD))
def test_each_bad_row_is_counted_and_good_rows_intact(image_dir, tokenizer, reason):
    rows = [_good(0), _good(1), BAD[reason], _good(2), _good(3)]
    path = image_dir / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    opts = EncodeOptions(image_dir=str(image_dir), max_prompt_length=200, max_image_side=1024)
    ds, stats = make_dataset(
        open_sources(str(path)), tokenizer, opts, batch_size=1, shuffle=False, num_epochs=2
    )
    batches = _epoch(ds)
    assert stats.counts == {reason: 1}  # two epochs, still one distinct bad row
    assert stats.seen[reason] == {f"{path}:3"}  # file and line of the bad row
    assert [b[0]["problem"] for b in batches] == [f"good {i}" for i in range(4)] * 2
    assert [b[0]["label_idx"] for b in batches[:4]] == [0, 1, 2, 3]
    assert all(b[0]["image_grid_thw"].tolist() == [[1, 4, 4]] for b in batches)
    assert stats.report()[reason] == 1 and sum(stats.report().values()) == 1


def test_sources_jsonl_parquet_and_saved_dataset_agree(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {"problem": f"q{i}", "label_idx": i, "images": [{"bytes": png(), "path": None}]}
        for i in range(5)
    ]
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, tmp_path / "x.parquet", row_group_size=2)
    (tmp_path / "x.jsonl").write_text(
        "\n".join(
            json.dumps({**r, "images": [{"bytes": base64.b64encode(png()).decode()}]}) for r in rows
        )
    )
    saved = tmp_path / "saved"  # the layout `datasets.Dataset.save_to_disk` writes
    saved.mkdir()
    with (
        pa.OSFile(str(saved / "data-00000-of-00001.arrow"), "wb") as f,
        pa.ipc.new_stream(f, table.schema) as w,
    ):
        w.write_table(table)
    (saved / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]})
    )
    for src in (
        open_source(str(tmp_path / "x.parquet")),
        open_source(str(tmp_path / "x.jsonl")),
        open_source(str(saved)),
    ):
        assert len(src) == 5
        assert [src[i]["problem"] for i in (4, 0, 3, 2)] == ["q4", "q0", "q3", "q2"]
    assert open_source(str(saved))[3]["_where"].endswith("saved row 3")
    assert len(open_sources([str(tmp_path / "x.parquet"), str(tmp_path / "x.jsonl")])) == 10


def test_a_shuffled_parquet_epoch_decodes_each_row_group_once_while_they_fit(tmp_path):
    import pickle

    import pyarrow as pa
    import pyarrow.parquet as pq

    from jaxvrl.data.sources import ParquetSource

    n, group = 60, 7  # 9 groups, the last one short
    table = pa.table({"problem": [f"q{i}" for i in range(n)], "blob": [bytes(1000)] * n})
    pq.write_table(table, tmp_path / "x.parquet", row_group_size=group)
    order = [int(i) for i in np.random.default_rng(0).permutation(n)]

    def epoch(src):
        reads = []
        read = src._file.read_row_group
        src._file.read_row_group = lambda g, **kw: (reads.append(g), read(g, **kw))[1]
        assert [src[i]["problem"] for i in order] == [f"q{i}" for i in order]
        assert src[order[0]]["_where"].endswith(f"x.parquet row {order[0]}")
        return reads

    reads = epoch(ParquetSource(str(tmp_path / "x.parquet")))
    assert sorted(reads) == list(range(9))  # each group decoded once
    # a budget of about two groups: rows still right, groups re-read, the kept bytes bounded
    small = ParquetSource(str(tmp_path / "x.parquet"), cache_bytes=2 * group * 1000 + 100)
    reads = epoch(small)
    assert len(reads) > 9 and len(small._groups) <= 2
    assert small._cached == sum(t.nbytes for t in small._groups.values()) <= small.cache_bytes
    assert pickle.loads(pickle.dumps(small)).cache_bytes == small.cache_bytes


def test_invalid_files_fail_at_start_with_path_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "a"}\n\n{"problem": \n')
    with pytest.raises(DataError, match=r"bad.jsonl:3: invalid JSONL"):
        open_source(str(bad))
    bad.write_text('{"problem": "a"}\n[1, 2]\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: a row must be a JSON object"):
        open_source(str(bad))
    pq = tmp_path / "bad.parquet"
    pq.write_bytes(b"PAR1garbage")
    with pytest.raises(DataError, match="bad.parquet: not a readable parquet"):
        open_source(str(pq))
    with pytest.raises(DataError, match="none.jsonl: data file not found"):
        open_sources([str(tmp_path / "none.jsonl")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no .parquet, .jsonl or .json files.*no state.json"):
        open_source(str(tmp_path / "empty"))
    bad = tmp_path / "bad.json"  # neither a list nor one row per line
    bad.write_text('{"problem":\n "a"}\n')
    with pytest.raises(DataError, match=r"bad.json:1: invalid JSONL.*a list of rows or one per"):
        open_source(str(bad))


def test_json_files_hold_a_list_or_one_row_per_line(tmp_path):
    """A .json file of JSON Lines (`datasets`' to_json writes them) reads as its list does, and
    a folder of .json files (its metadata files left out) as the files do."""
    rows = [{"problem": f"q{i}", "answer": str(i)} for i in range(3)]
    (tmp_path / "list.json").write_text(json.dumps(rows, indent=1))
    folder = tmp_path / "lines"
    folder.mkdir()
    (folder / "train.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "dataset_infos.json").write_text('{"default": {}}')
    for src in (open_source(str(tmp_path / "list.json")), open_source(str(folder))):
        assert [src[i]["problem"] for i in range(len(src))] == ["q0", "q1", "q2"]


def _same(a: list[dict], b: list[dict]) -> bool:
    """The same examples: equal keys, arrays equal element for element."""
    return len(a) == len(b) and all(
        x.keys() == y.keys()
        and all(
            np.array_equal(x[k], y[k]) if isinstance(x[k], np.ndarray) else x[k] == y[k] for k in x
        )
        for x, y in zip(a, b)
    )


def test_resume_mid_epoch_gives_the_exact_next_batch(tokenizer):
    rows = synthetic.make_split("train", 20, kinds=("colour", "shape"))
    opts = EncodeOptions(system_prompt=synthetic.SYSTEM_PROMPT)
    kw = dict(batch_size=3, seed=7)
    ds, _ = make_dataset(rows, tokenizer, opts, **kw)
    it = iter(ds)
    for _ in range(8):  # 24 prompts: past the first epoch's end, mid second epoch
        next(it)
    state = json.loads(json.dumps(it.get_state()))  # survives serialisation (orbax JSON)
    expect = [next(it) for _ in range(3)]
    fresh, _ = make_dataset(rows, tokenizer, opts, **kw)
    it2 = iter(fresh)
    it2.set_state(state)
    got = [next(it2) for _ in range(3)]
    assert all(_same(a, b) for a, b in zip(expect, got))
    assert [len(b) for b in got] == [3, 3, 3]


def test_epochs_are_reshuffled_and_shards_are_disjoint(tokenizer):
    rows = synthetic.make_split("train", 12)
    opts = EncodeOptions()
    ids = lambda ds: [r["id"] for b in ds for r in b]
    ds, _ = make_dataset(rows, tokenizer, opts, batch_size=4, seed=3, num_epochs=2)
    order = ids(ds)
    assert sorted(order[:12]) == sorted(order[12:]) == sorted(r["id"] for r in rows)
    assert order[:12] != order[12:]
    ds_again, _ = make_dataset(rows, tokenizer, opts, batch_size=4, seed=3, num_epochs=2)
    assert ids(ds_again) == order
    # seed 4's epochs are not seed 3's shifted by one epoch (grain shuffles each epoch with
    # its seed plus the epoch's number)
    ds_next, _ = make_dataset(rows, tokenizer, opts, batch_size=4, seed=4, num_epochs=2)
    assert ids(ds_next)[:12] != order[12:]
    shards = [
        ids(
            make_dataset(
                rows, tokenizer, opts, batch_size=2, num_epochs=1, shard_index=k, shard_count=3
            )[0]
        )
        for k in range(3)
    ]
    assert sorted(sum(shards, [])) == sorted(r["id"] for r in rows)
    assert all(len(s) == 4 for s in shards)


def test_examples_with_mixed_image_counts(image_dir, tokenizer):
    rows = [
        {
            "problem": "two",
            "images": ["ok.png", {"bytes": png((0, 0, 255), (90, 60))}],
            "label_idx": 0,
        },
        {"problem": "none", "label_idx": 1},
        {"problem": "one", "images": ["ok.png"], "answer": "yes"},
    ]
    opts = EncodeOptions(image_dir=str(image_dir))
    ds, _ = make_dataset(rows, tokenizer, opts, batch_size=3, shuffle=False, num_epochs=1)
    (b,) = list(ds)
    assert [len(x["image_grid_thw"]) for x in b] == [2, 0, 1]
    assert [x.get("label_idx") for x in b] == [0, 1, None] and b[2]["answer"] == "yes"
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for x in b:  # an example's pad tokens match its own images, and its patches their grids
        n_patch = int(np.prod(x["image_grid_thw"], -1).sum())
        assert x["prompt_ids"].count(pad) == n_patch // 4 and len(x["pixel_values"]) == n_patch
