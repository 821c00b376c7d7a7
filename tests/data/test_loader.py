"""The grain pipeline: sources, bad rows, resume, sharding, groups, bounded shapes."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from PIL import Image

from jaxvrl.data import synthetic
from jaxvrl.data.loader import make_dataset, shape_bound
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
    assert [b["prompts"][0] for b in batches] == [f"good {i}" for i in range(4)] * 2
    assert [int(b["label_idx"][0]) for b in batches[:4]] == [0, 1, 2, 3]
    assert all(b["image_grid_thw"][0].tolist() == [1, 4, 4] for b in batches)
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
    with pytest.raises(DataError, match="no state.json"):
        open_source(str(tmp_path))


def _same(a: dict, b: dict) -> bool:
    return all(
        np.array_equal(a[k], b[k]) if isinstance(a[k], np.ndarray | np.number) else a[k] == b[k]
        for k in a
    )


def test_resume_mid_epoch_gives_the_exact_next_batch(tokenizer):
    rows = synthetic.make_split("train", 20, kinds=("colour", "shape"))
    opts = EncodeOptions(system_prompt=synthetic.SYSTEM_PROMPT)
    kw = dict(batch_size=3, group_size=2, seed=7)
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
    # groups: G consecutive rows are the same prompt; epochs are reshuffled
    b = expect[0]
    assert b["input_ids"].shape[0] == 6 and b["group_index"].tolist() == [0, 0, 1, 1, 2, 2]
    assert b["prompts"][0] == b["prompts"][1] and np.array_equal(
        b["input_ids"][0], b["input_ids"][1]
    )


def test_epochs_are_reshuffled_and_shards_are_disjoint(tokenizer):
    rows = synthetic.make_split("train", 12)
    opts = EncodeOptions()
    ids = lambda ds: [r["id"] for b in ds for r in b["rows"]]
    ds, _ = make_dataset(rows, tokenizer, opts, batch_size=4, seed=3, num_epochs=2)
    order = ids(ds)
    assert sorted(order[:12]) == sorted(order[12:]) == sorted(r["id"] for r in rows)
    assert order[:12] != order[12:]
    ds_again, _ = make_dataset(rows, tokenizer, opts, batch_size=4, seed=3, num_epochs=2)
    assert ids(ds_again) == order
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


def test_batch_layout_with_mixed_image_counts(image_dir, tokenizer):
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
    ds, _ = make_dataset(
        rows, tokenizer, opts, batch_size=3, group_size=2, shuffle=False, num_epochs=1
    )
    (b,) = list(ds)
    assert int(b["num_images"]) == 6 and b["image_grid_thw"].shape == (8, 3)
    assert b["image_row"].tolist() == [0, 0, 1, 1, 4, 5, -1, -1]
    grids = b["image_grid_thw"][: int(b["num_images"])]
    n_patch = int(np.prod(grids, -1).sum())
    assert int(b["pixel_mask"].sum()) == n_patch and not b["pixel_values"][n_patch:].any()
    assert b["pixel_values"].shape[0] == 1 << (n_patch - 1).bit_length()
    assert (b["image_grid_thw"][6:] == 0).all() and (b["image_row"][6:] == -1).all()
    assert b["label_idx"].tolist() == [0, 0, 1, 1, -1, -1] and b["answers"][4] == "yes"
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    per_row = (b["input_ids"] == pad).sum(1)  # pad tokens per row match that row's images
    for r in range(6):
        own = b["image_grid_thw"][b["image_row"] == r]
        assert per_row[r] == int(np.prod(own, -1).sum()) // 4
    assert (b["attention_mask"].sum(1) == (b["input_ids"] != tokenizer.pad_token_id).sum(1)).all()


def test_distinct_shapes_over_an_epoch_of_the_builtin_task(tokenizer):
    rows = synthetic.make_split("train", 96, kinds=("colour", "shape"))
    opts = EncodeOptions(system_prompt=synthetic.SYSTEM_PROMPT, max_prompt_length=256)
    b_prompts, g = 4, 4
    ds, stats = make_dataset(
        rows, tokenizer, opts, batch_size=b_prompts, group_size=g, num_epochs=1
    )
    shapes = {tuple((k, v.shape) for k, v in b.items() if isinstance(v, np.ndarray)) for b in ds}
    r = b_prompts * g
    bound = shape_bound(256, 32, max_patches=r * 16, max_images=r)
    print(
        f"distinct batch shapes over one epoch of the built-in task: {len(shapes)} (bound {bound})"
    )
    assert stats.total == 0 and 1 <= len(shapes) <= bound
    assert len(shapes) == 1  # one image size, one prompt bucket
