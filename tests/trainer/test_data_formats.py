"""EasyR1's and verl's parquet layouts train by path, unchanged, on the embedded default:
`<image>` placeholders interleave the images, verl's chat-message prompt and nested label are
read; `python -m jaxvrl.data` shows the interleaved prompts; a file without a prompt column is
one `error:` line (exit 2) before training."""

from __future__ import annotations

import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from jaxvrl.data.__main__ import main as show_data
from jaxvrl.train import main as train_main
from jaxvrl.train import run
from tests.trainer.test_train import tiny_config

SPAN = "<|vision_start|><|image_pad|>x1<|vision_end|>"
# the shapes of tests/trainer/test_train.py's grpo run (prompts of 65 to 96 tokens, at most 16
# patches a row), so that a test session compiles their programs once
SHAPES = ["data.min_pixels=784"]  # 28 x 28 images: one token, 4 patches each
TAIL = " Think briefly in <think></think>, then reply with 'Answer: X' where X is the letter."


def _png(color) -> dict:
    buf = io.BytesIO()
    Image.new("RGB", (28, 28), color).save(buf, "PNG")
    return {"bytes": buf.getvalue(), "path": None}  # HF datasets' Image feature


def _easyr1(path):
    """EasyR1's layout: `problem` with `<image>` placeholders, `answer`, `images`."""
    rows = [
        {
            "problem": f"First image: <image> Second image: <image> Which is {c}? A. left B. "
            f"right.{TAIL}",
            "answer": "AB"[i],
            "images": [_png((255, 0, 0)), _png((0, 0, 255))][:: 1 - 2 * i],
        }
        for i, c in enumerate(("red", "blue"))
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)


def _verl(path):
    """verl's geo3k layout: `prompt` as chat messages, `reward_model.ground_truth`,
    `data_source`, `extra_info`."""
    rows = [
        {
            "data_source": "hiyouga/geometry3k",
            "prompt": [
                {
                    "role": "user",
                    "content": f"<image>Which colour is it, please? A. red B. blue ({i}).{TAIL}",
                }
            ],
            "images": [_png((255, 0, 0) if i == 0 else (0, 0, 255))],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "AB"[i]},
            "extra_info": {"split": "train", "index": i},
        }
        for i in range(2)
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("formats")
    _easyr1(d / "easyr1.parquet")
    _verl(d / "verl.parquet")
    return d


def test_show_the_interleaved_prompts(files, capsys):
    for name in ("easyr1", "verl"):
        argv = ["--config", "configs/grpo.py", f"--config.data.train_files={files}/{name}.parquet"]
        assert show_data([*argv, *(f"--config.{s}" for s in SHAPES), "--rows", "2"]) == 0
    out = capsys.readouterr().out
    assert f"First image: {SPAN} Second image: {SPAN} Which is red?" in out
    assert f"user\n{SPAN}Which colour is it, please? A. red B. blue (0).{TAIL}<|im_end|>" in out
    assert "label: 'B'" in out and "image 1: 28x28 px -> 28x28 (grid 1x2x2, 1 tokens)" in out
    lengths = [int(n) for n in __import__("re").findall(r": (\d+) prompt tokens", out)]
    assert len(lengths) == 4 and all(64 < n <= 96 for n in lengths), lengths
    assert out.count("skipped so far: none") == 2


def test_both_layouts_train_two_steps_by_path(files, tmp_path):
    """One run over both files (2 rows each; 2 prompts a step: every row is trained on)."""
    data = f"{files}/easyr1.parquet,{files}/verl.parquet"
    cfg = tiny_config(
        "configs/grpo.py",
        tmp_path,
        "total_steps=2",
        "val_freq=0",
        f"data.train_files={data}",
        *SHAPES,
    )
    metrics = run(cfg)
    assert np.isfinite(metrics["loss"])
    assert not [k for k in metrics if k.startswith("data/skipped")]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert rows[-1]["step"] == 2 and rows[-1]["compiles/train_step"] <= 1
    text = (tmp_path / "rollout_results.md").read_text()  # the prompts as the model saw them
    assert f"First image: {SPAN} Second image: {SPAN} Which is" in text
    assert f"{SPAN}Which colour is it, please? A. red B. blue" in text


def test_a_file_without_a_prompt_column_is_one_error_line(tmp_path, capsys):
    path = tmp_path / "q.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "q?", "answer": "A"}]), path)
    argv = ["--config", "configs/grpo.py", f"--config.data.train_files={path}"]
    with pytest.raises(SystemExit) as e:
        train_main([*argv, f"--config.workdir={tmp_path / 'run'}"])
    assert e.value.code == 2
    assert show_data(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    want = (
        f"error: {path}: no prompt column (looked for problem, prompt); its columns: question, "
        "answer; set config.data.prompt_key to the prompt's column"
    )
    assert err == [want, want]
