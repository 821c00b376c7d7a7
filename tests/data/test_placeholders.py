"""`<image>` / `<video>` placeholders place each medium where it stands, as transformers'
processors do for interleaved chat content (Qwen2.5-VL, Qwen3-VL); a row whose placeholders
and media disagree is skipped and counted; verl's chat-message prompts, its nested label and
EasyR1's format_prompt template; a missing prompt or label column fails at open with one line."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from PIL import Image

from jaxvrl.data.rows import EncodeOptions, SkipStats, encode_row
from tests.data.conftest import png

TEXT = "First image: <image> Second image: <image> Which is red?"


def _images():
    rng = np.random.default_rng(0)
    sizes = [(60, 90, 3), (200, 120, 3)]
    return [Image.fromarray(rng.integers(0, 256, s, dtype=np.uint8)) for s in sizes]


def _interleaved(text: str, media: dict) -> list[dict]:
    """The user turn as transformers reads interleaved content: text parts and each medium
    ({"type": "image", "image": ...}) at its placeholder."""
    content, counts = [], {"image": 0, "video": 0}
    for piece in __import__("re").split(r"(<image>|<video>)", text):
        kind = piece[1:-1] if piece in ("<image>", "<video>") else None
        if kind:
            content.append({"type": kind, kind: media[kind][counts[kind]]})
            counts[kind] += 1
        elif piece:
            content.append({"type": "text", "text": piece})
    return [{"role": "user", "content": content}]


def _encode(row, tokenizer, opts, where="data row 0"):
    stats = SkipStats()
    return encode_row(row, tokenizer, opts, where, stats), stats


def test_two_placeholders_equal_hf_qwen2_5_vl(tokenizer):
    from tests.data.test_prompts import _hf_processor

    images = _images()
    proc = _hf_processor(tokenizer)
    ref = proc.apply_chat_template(
        _interleaved(TEXT, {"image": images}),
        tokenize=True,
        add_generation_prompt=True,
        return_dict=True,
        return_tensors="np",
    )
    opts = EncodeOptions(max_pixels=28 * 28 * 1280)  # the HF image processor's default
    ex, stats = _encode({"problem": TEXT, "images": images, "answer": "A"}, tokenizer, opts)
    assert stats.total == 0
    assert ex["prompt_ids"] == ref["input_ids"][0].tolist()
    np.testing.assert_array_equal(ex["image_grid_thw"], ref["image_grid_thw"])
    np.testing.assert_allclose(ex["pixel_values"], ref["pixel_values"], atol=1e-5, rtol=0)
    span = "<|vision_start|><|image_pad|><|vision_end|>"
    assert f"First image: {span} Second image: {span} Which is red?" in ex["prompt_text"]
    assert ex["image_refs"] == images and ex["problem"] == TEXT


def test_two_placeholders_equal_hf_qwen3_vl(tokenizer, monkeypatch):
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    from tests.data.test_processor_qwen3_vl import SETTINGS, _hf_images, _hf_video

    monkeypatch.setattr(Qwen3VLProcessor, "check_argument_for_proper_class", lambda *a: None)
    proc = Qwen3VLProcessor(
        image_processor=_hf_images(),
        tokenizer=tokenizer,
        video_processor=_hf_video(),
        chat_template=tokenizer.chat_template,  # the repository's tokenizer's, as ours reads
    )
    images = _images()
    ref = proc.apply_chat_template(
        _interleaved(TEXT, {"image": images}),
        tokenize=True,
        add_generation_prompt=True,
        return_dict=True,
        return_tensors="np",
    )
    opts = EncodeOptions(
        processor=SETTINGS, min_pixels=SETTINGS.min_pixels, max_pixels=SETTINGS.max_pixels
    )
    ex, _ = _encode({"problem": TEXT, "images": images, "answer": "A"}, tokenizer, opts)
    assert ex["prompt_ids"] == ref["input_ids"][0].tolist()
    np.testing.assert_array_equal(ex["image_grid_thw"], ref["image_grid_thw"])


def test_a_video_placeholder_places_the_video_before_the_image(tokenizer):
    """`<video>` then `<image>`: the video's span first (the Qwen2.5-VL processor's ids, its
    video grids from our own processor, whose layout test_processor checks)."""
    from tests.data.test_prompts import _hf_processor, _video

    text = "Watch <video> then look at <image>. What moved?"
    images, frames = _images()[:1], _video()
    proc = _hf_processor(tokenizer)
    msgs = _interleaved(text, {"image": [None], "video": [None]})
    for part in msgs[0]["content"]:
        part.pop("image", None), part.pop("video", None)
    rendered = proc.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    ref = proc(text=[rendered], images=images, videos=[frames], return_tensors="np")
    opts = EncodeOptions(max_pixels=28 * 28 * 1280, video_min_pixels=28 * 28 * 4)
    row = {"problem": text, "images": images, "videos": [frames], "answer": "B"}
    ex, stats = _encode(row, tokenizer, opts)
    assert stats.total == 0 and ex["prompt_text"] == rendered
    assert ex["prompt_ids"] == ref["input_ids"][0].tolist()
    assert rendered.index("<|video_pad|>") < rendered.index("<|image_pad|>")


def test_placeholders_that_disagree_with_the_media_skip_the_row(tokenizer):
    opts = EncodeOptions()
    stats = SkipStats()
    rows = [
        {"problem": TEXT, "images": [png()], "answer": "A"},  # two placeholders, one image
        {"problem": "Which? <video>", "images": [png()], "answer": "A"},
        {"problem": "<image> alone", "answer": "A"},  # a placeholder and no image
    ]
    for i, row in enumerate(rows):
        assert encode_row(row, tokenizer, opts, f"f row {i}", stats) is None
    assert stats.report()["placeholder_mismatch"] == 3
    # a text-only model reads no placeholders: the text stays as it is
    text_only = EncodeOptions(processor=None)
    ex, stats = _encode({"problem": "<image> alone", "answer": "A"}, tokenizer, text_only)
    assert stats.total == 0 and "<image> alone" in ex["prompt_text"]
    # without placeholders the media come first, as before
    ex, _ = _encode({"problem": "Which?", "images": [png()], "answer": "A"}, tokenizer, opts)
    assert "user\n<|vision_start|><|image_pad|><|vision_end|>Which?" in ex["prompt_text"]


def test_verl_messages_nested_label_and_a_format_prompt(tokenizer):
    """verl's row: `prompt` as chat messages (a system turn of its own), the label in
    `reward_model.ground_truth`, `data_source` and `extra_info` kept; an EasyR1 format_prompt
    rewrites the last user turn before its placeholders are read."""
    ref = {"bytes": png((0, 0, 255)), "path": None}
    row = {
        "data_source": "hiyouga/geometry3k",
        "prompt": [
            {"role": "system", "content": "Be exact."},
            {"role": "user", "content": "<image>Find x."},
        ],
        "images": [ref],
        "reward_model": {"style": "rule", "ground_truth": "12"},
        "extra_info": {"split": "train", "index": 7},
    }
    fmt = "{{ content | trim }} Put the answer in \\boxed{}.\n"
    opts = EncodeOptions(system_prompt="ignored: the row has its own", format_prompt=fmt)
    ex, stats = _encode(row, tokenizer, opts)
    assert stats.total == 0
    assert ex["prompt_text"] == (
        "<|im_start|>system\nBe exact.<|im_end|>\n<|im_start|>user\n"
        "<|vision_start|><|image_pad|><|vision_end|>Find x. Put the answer in \\boxed{}."
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    assert ex["answer"] == "12" and ex["problem"] == "<image>Find x."
    assert ex["data_source"] == row["data_source"] and ex["extra_info"] == row["extra_info"]
    assert ex["image_refs"] == [ref]
    plain = {k: v for k, v in ex.items() if not isinstance(v, np.ndarray)}
    assert pickle.loads(pickle.dumps(plain)) == plain


def test_a_verl_row_that_kept_its_source_columns_is_read_as_verl_reads_it(tokenizer, tmp_path):
    """A verl file made by `datasets.map` without removing the source's columns: its chat
    `prompt` is the prompt and `reward_model.ground_truth` the label, as verl reads them, not
    the kept `problem` and `answer` (a worked solution); set keys still decide. Read from a
    parquet file as a run opens it (no keys set)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from jaxvrl.data.columns import RowFormat, RowMapper
    from jaxvrl.data.sources import open_source

    row = {
        "problem": "Find x.",
        "answer": "Since 3x = 36, x is 12. #### 12",
        "solution": "x = 12",
        "prompt": [{"role": "user", "content": "Find x. Think first, then give \\boxed{x}."}],
        "reward_model": {"style": "rule", "ground_truth": "12"},
        "extra_info": {"index": 3},
    }
    pq.write_table(pa.Table.from_pylist([row]), tmp_path / "verl.parquet")
    read = open_source(str(tmp_path / "verl.parquet"), fmt=RowFormat())[0]
    ex, stats = _encode(read, tokenizer, EncodeOptions())
    assert stats.total == 0 and ex["answer"] == "12" and ex["solution"] == "x = 12"
    assert "Think first, then give \\boxed{x}." in ex["prompt_text"]
    assert ex["extra_info"] == row["extra_info"]
    # the row format's own names alone, or a label_idx: as before
    plain = {k: row[k] for k in ("problem", "answer")}
    assert RowMapper(RowFormat())(plain) == plain
    choice = dict(row, label_idx=2)
    assert RowMapper(RowFormat())(choice)["label_idx"] == 2
    # keys set in the config decide
    fmt = RowFormat(prompt_key="problem", answer_key="solution")
    ex, _ = _encode(RowMapper(fmt)(row), tokenizer, EncodeOptions())
    assert ex["answer"] == "x = 12" and "Think first" not in ex["prompt_text"]


def test_a_missing_prompt_or_label_column_fails_at_open(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from jaxvrl.config import ConfigError
    from jaxvrl.data.columns import RowFormat
    from jaxvrl.data.sources import open_source

    path = tmp_path / "q.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "q?", "answer": "A"}]), path)
    with pytest.raises(ConfigError) as e:
        open_source(str(path), fmt=RowFormat())
    assert str(e.value) == (
        f"{path}: no prompt column (looked for problem, prompt); its columns: question, answer; "
        "set config.data.prompt_key to the prompt's column"
    )
    assert len(open_source(str(path), fmt=RowFormat(prompt_key="question"))) == 1
    pq.write_table(pa.Table.from_pylist([{"problem": "q?", "target": "A"}]), path)
    with pytest.raises(ConfigError, match=r"no label column \(looked for label_idx, answer, "):
        open_source(str(path), fmt=RowFormat())
    assert len(open_source(str(path))) == 1  # raw rows (no format): not checked
