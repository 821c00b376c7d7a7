"""Dataset columns by name: keys (nested too), every image encoding, parquet with renamed
columns, the format hook, missing columns at start, remote files, video_fps."""

from __future__ import annotations

import base64
import json
import pickle

import numpy as np
import pytest
from PIL import Image

from jaxvrl.config import ConfigError
from jaxvrl.data.columns import RowFormat, RowMapper
from jaxvrl.data.rows import DataError, EncodeOptions, SkipStats, encode_rows, load_image
from jaxvrl.data.sources import open_source, open_sources, read_rows
from tests.data.conftest import png


@pytest.fixture()
def image_dir(tmp_path):
    (tmp_path / "red.png").write_bytes(png())
    (tmp_path / "wide.png").write_bytes(png((0, 0, 255), (90, 60)))
    return tmp_path


def _jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _encode(rows, tokenizer, image_dir, **kw):
    opts = EncodeOptions(image_dir=str(image_dir), **kw)
    examples, stats = encode_rows(rows, tokenizer, opts, stats=SkipStats())
    return examples, stats


B64 = base64.b64encode(png()).decode()
ENCODINGS = {
    "path": ("red.png", [[1, 4, 4]]),
    "list of paths": (["red.png", "wide.png"], [[1, 4, 4], [1, 4, 6]]),
    "bytes": (png(), [[1, 4, 4]]),
    "base64": (B64, [[1, 4, 4]]),
    "data uri": ("data:image/png;base64," + B64, [[1, 4, 4]]),
    "bytes dict": ({"bytes": png(), "path": "ignored.png"}, [[1, 4, 4]]),
    "base64 dict": ({"bytes": B64, "path": None}, [[1, 4, 4]]),
    "path dict": ({"bytes": None, "path": "wide.png"}, [[1, 4, 6]]),
    "null": (None, np.zeros((0, 3))),
}


@pytest.mark.parametrize("kind", sorted(ENCODINGS))
def test_image_key_reads_every_image_encoding(kind, image_dir, tokenizer):
    value, grids = ENCODINGS[kind]
    fmt = RowFormat(prompt_key="question", image_key="picture")
    row = RowMapper(fmt)({"question": "What colour?", "picture": value, "answer": "A"})
    assert "picture" not in row  # the payload leaves the row once read
    (ex,), stats = _encode([row], tokenizer, image_dir)
    assert stats.total == 0 and ex["problem"] == "What colour?" and ex["answer"] == "A"
    np.testing.assert_array_equal(ex["image_grid_thw"], grids)


def test_bare_strings_are_paths_first_then_base64(image_dir):
    assert load_image(B64, str(image_dir)).size == (40, 40)
    with pytest.raises(FileNotFoundError, match="abcd"):  # decodes as base64, is no image
        load_image("abcd", str(image_dir))
    with pytest.raises(FileNotFoundError, match="nope.png"):
        load_image("nope.png", str(image_dir))


def test_keys_unset_read_the_rows_untouched(tmp_path):
    rows = [{"problem": "p", "images": ["a.png"], "label_idx": 1, "x": {"y": 2}}]
    path = _jsonl(tmp_path / "d.jsonl", rows)
    assert open_source(path, fmt=RowFormat()).columns == [
        ("problem",), ("images",), ("label_idx",), ("x",), ("x", "y"),
    ]  # fmt: skip
    assert read_rows(path, fmt=RowFormat()) == [{**rows[0], "_where": f"{path}:1"}]
    assert RowMapper(RowFormat())(rows[0]) == rows[0]


def test_nested_keys_and_a_literal_dotted_column(tmp_path, image_dir, tokenizer):
    rows = [
        {"q": {"text": "nested?", "img": ["red.png"]}, "meta": {"gt": "B"}, "q.text": "literal"},
        {"q": {"text": "second", "img": "wide.png"}, "meta": {"gt": 2}, "q.text": None},
    ]
    fmt = RowFormat(prompt_key="q.text", image_key="q.img", answer_key="meta.gt")
    got = read_rows(_jsonl(tmp_path / "n.jsonl", rows), fmt=fmt)
    assert [r["problem"] for r in got] == ["literal", None]  # the literal column wins
    fmt = RowFormat(prompt_key="q.textx", image_key="q.img")
    with pytest.raises(DataError, match=r"no column 'q.textx'.*nested: q.text, q.img, meta.gt"):
        read_rows(_jsonl(tmp_path / "n.jsonl", rows), fmt=fmt)
    rows = [{k: v for k, v in r.items() if k != "q.text"} for r in rows]
    fmt = RowFormat(prompt_key="q.text", image_key="q.img", answer_key="meta.gt")
    examples, stats = _encode(
        read_rows(_jsonl(tmp_path / "n.jsonl", rows), fmt=fmt), tokenizer, image_dir
    )
    assert stats.total == 0
    assert [e["problem"] for e in examples] == ["nested?", "second"]
    assert [e["answer"] for e in examples] == ["B", 2]
    assert [e["image_grid_thw"].tolist() for e in examples] == [[[1, 4, 4]], [[1, 4, 6]]]
    assert examples[0]["q"] == {"text": "nested?"}  # the images leave, their siblings stay


def test_answer_key_alone_decides_the_label(tokenizer, image_dir):
    raw = {"problem": "p", "label_idx": 0, "solution": "s", "gt": "C", "opts": ["x", "y", "z"]}
    row = RowMapper(RowFormat(answer_key="gt", choices_key="opts"))(raw)
    assert row["answer"] == "C" and "label_idx" not in row and "solution" not in row
    assert row["choices"] == ["x", "y", "z"]
    missing = RowMapper(RowFormat(answer_key="gt"))({"problem": "p", "label_idx": 0})
    (ex,), stats = _encode([row, missing], tokenizer, image_dir)
    assert ex["answer"] == "C" and stats.counts == {"missing_label": 1}


def test_parquet_with_renamed_columns_on_disk_and_remote(tmp_path, tokenizer, monkeypatch):
    import fsspec
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(
        [
            {"instruction": f"q{i}", "gt": "ABCD"[i], "photo": [{"bytes": png(), "path": None}]}
            for i in range(4)
        ]
    )
    pq.write_table(table, tmp_path / "x.parquet", row_group_size=3)
    fmt = RowFormat(prompt_key="instruction", answer_key="gt", image_key="photo")
    monkeypatch.setenv("JAXVRL_CACHE", str(tmp_path / "cache"))
    fsspec.filesystem("memory").pipe("/bucket/x.parquet", (tmp_path / "x.parquet").read_bytes())
    for path in (str(tmp_path / "x.parquet"), "memory://bucket/x.parquet"):
        src = open_sources([path], fmt=fmt)
        examples, stats = _encode([src[i] for i in range(4)], tokenizer, tmp_path)
        assert stats.total == 0 and [e["problem"] for e in examples] == ["q0", "q1", "q2", "q3"]
        assert [e["answer"] for e in examples] == list("ABCD")
        assert src[3]["_where"] == f"{path} row 3"
    bad = RowFormat(prompt_key="question", image_key="photo")
    with pytest.raises(DataError) as e:
        open_source("memory://bucket/x.parquet", fmt=bad)
    assert str(e.value) == (
        "memory://bucket/x.parquet: no column 'question' for config.data.prompt_key; "
        "its columns: instruction, gt, photo"
    )


def test_a_missing_column_fails_at_open_naming_file_key_and_columns(tmp_path):
    rows = [{"question": "q", "answer": "A", "image_path": "a.png"}, {"question": "r", "x": 1}]
    path = _jsonl(tmp_path / "train.jsonl", rows)
    with pytest.raises(DataError) as e:
        open_sources([path], fmt=RowFormat(prompt_key="question", image_key="image"))
    assert str(e.value) == (
        f"{path}: no column 'image' for config.data.image_key; "
        "its columns: question, answer, image_path, x"
    )
    as_json = tmp_path / "train.json"
    as_json.write_text(json.dumps(rows))
    with pytest.raises(
        DataError, match=r"train.json: no column 'prompt' for config.data.prompt_key"
    ):
        read_rows(str(as_json), fmt=RowFormat(prompt_key="prompt"))
    # a column that some rows lack is no error: those rows have no value there
    got = read_rows(path, fmt=RowFormat(prompt_key="question", answer_key="x"))
    assert [r["answer"] for r in got] == [None, 1]


FORMAT = '''
def to_row(raw):
    """A chat-style row -> the row format."""
    user = raw["messages"][0]["content"]
    return {"problem": user["text"], "images": [user["image"]], "answer": raw["target"]}


def broken(raw):
    raise KeyError("messages")


def not_a_row(raw):
    return [raw]
'''


def test_the_format_hook_maps_raw_rows(tmp_path, image_dir, tokenizer):
    hook = tmp_path / "my_format.py"
    hook.write_text(FORMAT)
    raw = [
        {"messages": [{"content": {"text": f"q{i}", "image": "red.png"}}], "target": "B"}
        for i in range(2)
    ]
    path = _jsonl(tmp_path / "chat.jsonl", raw)
    src = open_source(path, fmt=RowFormat(format=f"{hook}:to_row"))
    rows = [src[i] for i in range(len(src))]
    assert rows[1] == {"problem": "q1", "images": ["red.png"], "answer": "B", "_where": f"{path}:2"}
    examples, stats = _encode(rows, tokenizer, image_dir)
    assert stats.total == 0 and len(examples) == 2
    assert pickle.loads(pickle.dumps(src))[1] == rows[1]  # e.g. for grain worker processes
    # the keys read the hook's output, checked against it at open
    src = open_source(path, fmt=RowFormat(format=f"{hook}:to_row", answer_key="problem"))
    assert src[0]["answer"] == "q0"
    with pytest.raises(DataError, match=r"no column 'target'.*format returns.*problem, images"):
        open_source(path, fmt=RowFormat(format=f"{hook}:to_row", answer_key="target"))
    with pytest.raises(DataError, match=r"chat.jsonl:1: config.data.format .*broken.* KeyError"):
        open_source(path, fmt=RowFormat(format=f"{hook}:broken"))
    with pytest.raises(DataError, match=r"returned list, expected a dict"):
        open_source(path, fmt=RowFormat(format=f"{hook}:not_a_row"))
    with pytest.raises(ConfigError, match="has no function 'nope'"):
        open_source(path, fmt=RowFormat(format=f"{hook}:nope"))
    # a function of an importable module works the same way
    src = open_source(
        path, fmt=RowFormat(format="copy:copy", prompt_key="target", answer_key="target")
    )
    assert src[0]["problem"] == "B"


def test_remote_jsonl_and_images(tmp_path, tokenizer, monkeypatch):
    import fsspec

    monkeypatch.setenv("JAXVRL_CACHE", str(tmp_path / "cache"))
    rows = [
        {"question": "remote?", "answer": 1, "image_path": "img/red.png"},
        {"question": "gone?", "answer": 2, "image_path": "img/none.png"},
    ]
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    fsspec.filesystem("memory").pipe({"/b2/train.jsonl": data, "/b2/img/red.png": png()})
    fmt = RowFormat(prompt_key="question", image_key="image_path")
    got = read_rows("memory://b2/train.jsonl", fmt=fmt)
    assert [r["_where"] for r in got] == ["memory://b2/train.jsonl:1", "memory://b2/train.jsonl:2"]
    examples, stats = _encode(got, tokenizer, "memory://b2")
    assert [e["problem"] for e in examples] == ["remote?"]
    assert examples[0]["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert stats.seen == {"missing_image": {"memory://b2/train.jsonl:2"}}
    with pytest.raises(DataError, match="memory://b2/none.jsonl: data file not found"):
        read_rows("memory://b2/none.jsonl", fmt=fmt)


def test_video_key_and_video_fps(tokenizer, tmp_path):
    frames = [Image.new("RGB", (56, 56), (10 * i, 0, 0)) for i in range(4)]
    one = {"problem": "what happens?", "clip": frames, "answer": "A"}
    two = {"problem": "and here?", "clip": [frames, frames[:2]], "answer": "B"}
    fmt = RowFormat(video_key="clip")
    rows = [RowMapper(fmt)(one), RowMapper(fmt)(two)]
    assert len(rows[0]["videos"]) == 1 and len(rows[1]["videos"]) == 2
    kw = dict(video_min_pixels=56 * 56, video_max_pixels=56 * 56)
    examples, stats = _encode(rows, tokenizer, tmp_path, video_fps=1.0, **kw)
    assert stats.total == 0
    assert examples[0]["second_per_grid_ts"].tolist() == [2.0]  # 2 frames per patch at 1 fps
    assert examples[1]["video_grid_thw"].tolist() == [[2, 4, 4], [1, 4, 4]]
    assert examples[1]["second_per_grid_ts"].tolist() == [2.0, 2.0]
    examples, _ = _encode(rows[:1], tokenizer, tmp_path, video_fps=4.0, **kw)
    assert examples[0]["second_per_grid_ts"].tolist() == [0.5]
    with pytest.raises(ValueError, match="video_fps"):
        EncodeOptions(video_fps=0.0)
