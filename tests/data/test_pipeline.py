"""The path the trainer uses today: rows encoded (encode_rows, or the grain loader) and
collated with bounded shapes; older processor parity checks kept as a second guard."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from PIL import Image

from jaxvrl.data import synthetic
from jaxvrl.data.loader import make_dataset
from jaxvrl.data.pipeline import EncodeOptions, collate, encode_rows, read_rows
from jaxvrl.data.processor import process_images, process_video
from jaxvrl.models import EMBEDDED, load_config
from tests.data.conftest import png


@pytest.fixture(scope="module")
def model_config():
    return load_config(EMBEDDED)


@pytest.mark.parametrize(
    "size,mode",
    [
        ((31, 29), "RGB"),
        ((57, 1003), "L"),
        ((1400, 900), "RGBA"),
        ((90, 64), "P"),
        ((200, 300), "LA"),
        ((28, 5000), "RGB"),
    ],
)
def test_process_images_equals_hf(size, mode):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    rng = np.random.default_rng(sum(size))
    w, h = size
    img = Image.fromarray(rng.integers(0, 256, (h, w, 4), dtype=np.uint8), "RGBA").convert(mode)
    ref = Qwen2VLImageProcessorPil()([img], return_tensors="np")
    pv, grid = process_images([img])
    np.testing.assert_array_equal(grid, ref["image_grid_thw"])
    np.testing.assert_allclose(pv, ref["pixel_values"], atol=1e-5)


def test_process_video_layout():
    frames = [np.full((56, 84, 3), 10 * i, np.uint8) for i in range(3)]
    pv, grid = process_video(frames, min_pixels=56 * 56)
    assert grid.tolist() == [[2, 4, 6]]  # 3 frames padded to 4 -> 2 temporal patches
    assert pv.shape == (2 * 4 * 6, 1176)
    # each patch holds 2 frames; the last temporal patch repeats frame 2
    p = pv.reshape(-1, 3, 2, 14, 14)
    np.testing.assert_allclose(p[-1, :, 0], p[-1, :, 1])


def test_bad_rows_are_counted_and_good_rows_intact(tmp_path, tokenizer):
    (tmp_path / "ok.png").write_bytes(png())
    (tmp_path / "corrupt.png").write_bytes(b"not an image")
    Image.new("RGB", (1100, 50)).save(tmp_path / "big.png")
    rows = [
        {"problem": "good one", "images": ["ok.png"], "label_idx": 0},
        {"problem": "missing", "images": ["nope.png"], "label_idx": 1},
        {"problem": "corrupt", "images": ["corrupt.png"], "label_idx": 1},
        {"problem": "big", "images": ["big.png"], "label_idx": 1},
        {"problem": "long " * 400, "images": ["ok.png"], "label_idx": 1},
        {"problem": "no label", "images": ["ok.png"]},
        {"images": ["ok.png"], "label_idx": 2},
        {
            "problem": "good two",
            "images": [{"bytes": base64.b64encode(png((0, 0, 255))).decode()}],
            "label_idx": 3,
        },
    ]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    opts = EncodeOptions(image_dir=str(tmp_path), max_prompt_length=200, max_image_side=1024)
    ex, stats = encode_rows(read_rows(str(path)), tokenizer, opts, source=str(path))
    assert dict(stats.counts) == {
        "missing_image": 1,
        "corrupt_image": 1,
        "oversized_image": 1,
        "prompt_too_long": 1,
        "missing_label": 1,
        "missing_prompt": 1,
    }
    assert [e["problem"] for e in ex] == ["good one", "good two"]
    assert [e["label_idx"] for e in ex] == [0, 3]
    assert ex[1]["image_grid_thw"].tolist() == [[1, 4, 4]]


def test_parquet_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "problem": ["q1", "q2"],
            "label_idx": [0, 1],
            "images": [[{"bytes": png()}], [{"bytes": png()}]],
        }
    )
    pq.write_table(table, tmp_path / "x.parquet")
    rows = read_rows(str(tmp_path / "x.parquet"))
    assert [r["problem"] for r in rows] == ["q1", "q2"]


def test_builtin_task_is_deterministic_balanced_and_needs_the_image():
    a = synthetic.make_split("train", 40, seed=1)
    b = synthetic.make_split("train", 40, seed=1)
    assert [r["problem"] for r in a] == [r["problem"] for r in b]
    assert np.array_equal(np.asarray(a[5]["images"][0]), np.asarray(b[5]["images"][0]))
    labels = [r["label_idx"] for r in a]
    assert np.bincount(labels).tolist() == [10, 10, 10, 10]
    test = synthetic.make_split("test", 40, seed=1)
    assert not np.array_equal(np.asarray(test[0]["images"][0]), np.asarray(a[0]["images"][0]))
    # the question text carries no answer: each question appears with every label
    by_q = {}
    for r in synthetic.make_split("train", 400):
        by_q.setdefault(r["problem"].split("?")[0], set()).add(r["label_idx"])
    assert all(v == {0, 1, 2, 3} for v in by_q.values())


def test_distinct_shapes_over_an_epoch_within_bound(tokenizer, model_config):
    rows = synthetic.make_split("train", 128)
    opts = EncodeOptions(system_prompt=synthetic.SYSTEM_PROMPT)
    ds, stats = make_dataset(rows, tokenizer, opts, batch_size=8, num_epochs=1)
    shapes = set()
    for examples in ds:
        b = collate(examples, 4, model_config, tokenizer, prompt_bucket=32)
        shapes.add((b["input_ids"].shape, b["images"].pixel_values.shape))
    assert stats.total == 0
    bound = (256 // 32) * 1  # prompt buckets x patch buckets for one image size
    print(f"distinct batch shapes over one epoch: {len(shapes)} (bound {bound}): {shapes}")
    assert 1 <= len(shapes) <= bound


def test_rows_encode_with_the_family_processor(tokenizer):
    """A row with an image and a video, encoded for Qwen3-VL's processor settings: patches of
    16 normalised by mean/std 0.5, and the video's frame groups each with its timestamp and
    its own vision span in the prompt (transformers' Qwen3VLProcessor expansion)."""
    from jaxvrl import models

    settings = models.family("qwen3_vl").processor(
        models.config_from_hf({"model_type": "qwen3_vl"})
    )
    img = Image.new("RGB", (70, 50), (200, 30, 30))
    frames = [Image.new("RGB", (64, 64), (10 * i, 0, 0)) for i in range(4)]
    row = {"problem": "what happens?", "images": [img], "videos": [frames], "label_idx": 0}
    opts = EncodeOptions(processor=settings, video_fps=2.0)
    (ex,), stats = encode_rows([row], tokenizer, opts)
    assert stats.total == 0
    pv, grid = process_images([img], opts.min_pixels, opts.max_pixels, settings=settings)
    np.testing.assert_array_equal(ex["pixel_values"], pv)
    assert pv.shape[1] == 3 * 2 * 16 * 16 and grid.tolist() == ex["image_grid_thw"].tolist()
    red = (200 / 255 - 0.5) / 0.5  # the red channel of the first patch's first pixel
    assert ex["pixel_values"][0, 0] == pytest.approx(red, abs=1e-6)
    t, h, w = ex["video_grid_thw"][0]
    assert t == 2  # 4 frames, 2 per temporal patch
    text = tokenizer.decode(ex["prompt_ids"])
    span = "<|vision_start|>" + "<|video_pad|>" * (h * w // 4) + "<|vision_end|>"
    # frame groups at 0 and 0.5 s, 1 and 1.5 s: their mean times as transformers prints them
    assert "<0.2 seconds>" + span + "<1.2 seconds>" + span in text
    image_pads = int(np.prod(ex["image_grid_thw"][0])) // 4
    assert text.count("<|image_pad|>") == image_pads
