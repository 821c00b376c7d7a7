"""Rows as users' datasets hold them, odd or broken: every bad row is skipped and counted under
its reason (never raising, so one row cannot end a run), the forms a single image, a single
video or a chat message's content take are read as the list forms are, and a data file that
cannot be read at all stops the run with one line."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from PIL import Image

from jaxvrl.config import ConfigError, load_config
from jaxvrl.data.columns import RowFormat, RowMapper
from jaxvrl.data.pipeline import EncodeOptions, encode_rows, read_rows
from jaxvrl.data.rows import SkipStats, encode_row
from tests.data.conftest import png


def _encode(rows, tokenizer, tmp_path, **kw):
    opts = EncodeOptions(image_dir=str(tmp_path), max_prompt_length=400, **kw)
    return encode_rows(rows, tokenizer, opts, source="d")


def test_each_bad_row_is_counted_under_its_reason_and_the_rest_encode(tmp_path, tokenizer):
    (tmp_path / "ok.png").write_bytes(png())
    Image.new("RGB", (2, 500)).save(tmp_path / "thin.png")  # aspect ratio 250 (at most 200)
    good = {"problem": "good <image>", "answer": "a", "images": ["ok.png"]}
    rows = [
        good,
        {"problem": "thin <image>", "answer": "a", "images": ["thin.png"]},
        {"problem": "the token <|image_pad|> in text", "answer": "a"},
        {"problem": "v <video>", "answer": "a", "videos": [[]]},
        {"problem": "v <video>", "answer": "a", "videos": ["clip.mp4"]},
        {"problem": "five", "answer": "a", "images": 5},
        {"prompt": [{"role": "user", "content": None}], "answer": "a"},
        {"prompt": [{"role": "user", "content": [{"type": "text"}]}], "answer": "a"},
    ]
    ex, stats = _encode(rows, tokenizer, tmp_path)
    assert [e["problem"] for e in ex] == ["good <image>"]
    assert dict(stats.counts) == {
        "oversized_image": 1,  # the aspect ratio, as transformers' processors refuse it
        "placeholder_mismatch": 1,  # the model's own pad token in the text
        "missing_image": 1,  # a video without frames
        "video_file": 1,  # frames are read, not video files
        "corrupt_image": 1,  # 5 is no image
        "missing_prompt": 2,  # messages without any content
    }
    assert stats.report()["bad_row"] == 0 and stats.report()["format_error"] == 0


def test_an_unexpected_error_in_a_row_is_counted_as_a_bad_row(tokenizer, monkeypatch):
    from jaxvrl.data import rows as R

    def broken(*a, **k):
        raise RuntimeError("a bug in encoding")

    monkeypatch.setattr(R, "render_prompt", broken)
    stats = SkipStats()
    assert (
        encode_row({"problem": "q", "answer": "a"}, tokenizer, EncodeOptions(), "r", stats) is None
    )
    assert stats.counts == {"bad_row": 1}


def test_single_media_and_message_parts_read_as_lists(tmp_path, tokenizer):
    (tmp_path / "ok.png").write_bytes(png())
    for name in ("f0.png", "f1.png"):
        Image.new("RGB", (56, 56), (0, 90, 0)).save(tmp_path / name)
    wrapped = base64.encodebytes(png((0, 0, 255))).decode()  # line breaks every 76 columns
    assert "\n" in wrapped
    rows = [
        {"problem": "one path <image>", "answer": "a", "images": "ok.png"},
        {"problem": "one dict", "answer": "a", "images": {"bytes": png(), "path": None}},
        {"problem": "wrapped base64", "answer": "a", "images": [wrapped]},
        {"problem": "frames <video>", "answer": "a", "videos": ["f0.png", "f1.png"]},
        {"problem": None, "prompt": "the prompt column", "answer": "a"},
        {  # TRL's layout: a conversational prompt, one image under `image`
            "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text"}]}],
            "image": {"bytes": png(), "path": None},
            "solution": "a",
        },
        {
            "prompt": [
                {"role": "user", "content": ["bare text, ", {"text": "a part without type "}, 7]}
            ],
            "answer": "a",
        },
    ]
    ex, stats = _encode(rows, tokenizer, tmp_path)
    assert stats.total == 0, stats.counts
    assert [e["image_grid_thw"].tolist() for e in ex[:3]] == [[[1, 4, 4]]] * 3
    assert ex[3]["video_grid_thw"][:, 0].tolist() == [1]  # one video of 2 frames: 1 patch deep
    assert ex[4]["problem"] == "the prompt column"
    assert ex[5]["image_grid_thw"].tolist() == [[1, 4, 4]] and "image" not in ex[5]
    assert ex[6]["problem"] == "bare text, a part without type 7"


def test_format_prompt_reads_a_list_of_parts_with_its_media_in_place(tmp_path, tokenizer):
    (tmp_path / "ok.png").write_bytes(png())
    parts = [
        {"type": "text", "text": " Look: "},
        {"type": "image_url"},
        {"type": "text", "text": "?"},
    ]
    rows = [{"prompt": [{"role": "user", "content": parts}], "answer": "a", "images": ["ok.png"]}]
    template = "{{ content | trim }} Put the final answer in \\boxed{}."
    [ex], _ = _encode(rows, tokenizer, tmp_path, format_prompt=template)
    text = ex["prompt_text"]
    want = "Look: <|vision_start|><|image_pad|><|vision_end|>? Put the final answer in \\boxed{}."
    assert want in text, text


def test_verl_media_dicts_file_uris_and_nan_labels(tmp_path, tokenizer):
    """verl's media forms ({"image": a path, a file:// URI or a PIL image}, {"video": frames
    or a file}) read as the plain forms do; a NaN label (a missing number in a pandas column)
    is no label: the next label column counts, else the row is skipped as missing_label."""
    from jaxvrl.trainer.scoring import ground_truth

    (tmp_path / "a.png").write_bytes(png())
    (tmp_path / "b.png").write_bytes(png((0, 0, 255)))
    uri, frames = f"file://{tmp_path / 'a.png'}", ["a.png", "b.png"]
    rows = [
        {"problem": "<image>", "answer": "x", "images": ["a.png"]},
        {"problem": "<image>", "answer": "x", "images": [{"image": uri}]},
        {
            "problem": "<image>",
            "answer": "x",
            "images": [{"image": Image.open(tmp_path / "a.png")}],
        },
        {"problem": "<image>", "answer": "x", "images": [uri]},
        {"problem": "<video>", "answer": "x", "videos": [frames]},
        {"problem": "<video>", "answer": "x", "videos": [{"video": frames, "fps": 2.0}]},
        {"problem": "<video>", "answer": "x", "videos": [{"video": "clip.mp4"}]},
        {"problem": "q", "label_idx": float("nan"), "answer": "4"},
        {"problem": "q", "label_idx": float("nan")},
    ]
    ex, stats = _encode(rows, tokenizer, tmp_path)
    assert {k: v for k, v in stats.report().items() if v} == {"video_file": 1, "missing_label": 1}
    assert len(ex) == 7
    for a, b in ((ex[0], ex[1]), (ex[0], ex[2]), (ex[0], ex[3]), (ex[4], ex[5])):
        for key in ("prompt_ids", "pixel_values", "pixel_values_videos", "video_grid_thw"):
            assert np.array_equal(a[key], b[key]), key
    assert ground_truth(ex[6]) == "4"
    assert ground_truth({"label_idx": np.float64("nan"), "ground_truth": float("nan")}) is None


def test_a_dotted_media_key_removes_only_its_leaf():
    row = {"q": "x", "a": "y", "extra_info": {"index": 7, "split": "train", "image": "i.png"}}
    out = RowMapper(RowFormat(image_key="extra_info.image"))(row)
    assert out["images"] == ["i.png"]
    assert out["extra_info"] == {"index": 7, "split": "train"}
    assert row["extra_info"]["image"] == "i.png"  # the source row is left as it was


def test_a_format_hook_failing_on_a_row_skips_it(tmp_path, tokenizer):
    hook = tmp_path / "hook.py"
    hook.write_text(
        "def to_row(r):\n"
        "    if r['q'] == 'boom':\n        raise KeyError('zz')\n"
        "    return {'problem': r['q'], 'answer': r['a']}\n"
    )
    mapper = RowMapper(RowFormat(format=f"{hook}:to_row"))
    rows = [mapper(dict(r, _where=f"d:{i}")) for i, r in enumerate([
        {"q": "fine", "a": "1"}, {"q": "boom", "a": "2"}, {"q": "also fine", "a": "3"},
    ])]  # fmt: skip
    ex, stats = _encode(rows, tokenizer, tmp_path)
    assert [e["problem"] for e in ex] == ["fine", "also fine"]
    assert stats.counts == {"format_error": 1}
    with pytest.raises(ConfigError, match=r"config.data.format .*has no function 'nope'"):
        RowMapper(RowFormat(format=f"{hook}:nope"))


def test_data_files_that_cannot_be_read_stop_with_one_line(tmp_path, capsys):
    from jaxvrl.data.__main__ import main
    from jaxvrl.data.from_config import data_paths, train_source

    rows = [{"problem": f"q{i}", "answer": "a"} for i in range(2)]
    bom = tmp_path / "bom.json"
    bom.write_bytes(b"\xef\xbb\xbf" + json.dumps(rows).encode())
    assert [r["problem"] for r in read_rows(str(bom))] == ["q0", "q1"]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "x.csv").write_text("problem,answer\nq,a\n")
    (tmp_path / "latin1.json").write_bytes(b'[{"problem": "caf\xe9", "answer": "a"}]')
    for files in (f"{tmp_path}/a.jsonl , {bom}", f"['{tmp_path}/a.jsonl', '{bom}']"):
        c = load_config("configs/grpo.py", [f"data.train_files={files}"])
        assert len(train_source(c)) == 4  # spaces around the names are not part of them
    assert data_paths("[a.parquet, b.parquet]") == ["a.parquet", "b.parquet"]  # verl's lists
    with pytest.raises(ConfigError, match=r"empty.jsonl': no rows"):
        train_source(load_config("configs/grpo.py", [f"data.train_files={tmp_path}/empty.jsonl"]))
    for name, message in (("latin1.json", "not UTF-8 text"), ("x.csv", "unknown data format")):
        code = main(["--config", "configs/grpo.py", f"--config.data.train_files={tmp_path / name}"])
        err = capsys.readouterr().err.strip()
        assert code == 2 and err.startswith("error: ") and message in err and "\n" not in err


def test_held_out_files_without_one_usable_row_stop_the_run_at_start(tmp_path, tokenizer):
    """Validation on files whose every row is skipped would report nothing at every
    validation: the run stops at start naming the files and the reasons."""
    from jaxvrl.trainer.setup import val_examples

    data = tmp_path / "val.jsonl"
    data.write_text(json.dumps({"problem": "<image>", "answer": "a", "images": ["x.png"]}) + "\n")
    c = load_config("configs/grpo.py", [f"data.val_files={data}"])
    with pytest.raises(ConfigError, match=r"val_files=.*no usable row .*'missing_image': 1"):
        val_examples(c, tokenizer)
