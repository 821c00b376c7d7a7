"""prepare_aokvqa on a small A-OKVQA-shaped parquet."""

from __future__ import annotations

import io
import json

import numpy as np
from PIL import Image

from jaxvrl.data import prepare_aokvqa
from jaxvrl.data.rows import EncodeOptions, encode_rows
from jaxvrl.data.sources import read_rows


def _jpeg(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


def _write(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {
            "image": {"bytes": _jpeg(i), "path": None},
            "question_id": f"q{i}",
            "question": f"What is object {i}?",
            "choices": ["cat", "dog", "car", "tree"],
            "correct_choice_idx": i % 4,
            "direct_answers": ["cat"] * 10,
            "difficult_direct_answer": False,
            "rationales": [f"because {i}"],
        }
        for i in range(6)
    ]
    rows[4]["image"] = {"bytes": b"broken", "path": None}  # corrupt: skipped, counted
    rows[5]["correct_choice_idx"] = None  # no label: skipped, counted
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    return tmp_path / "train.parquet"


def test_prepare_aokvqa_rows_and_images(tmp_path):
    src = _write(tmp_path)
    out = tmp_path / "out"
    prepare_aokvqa.main(["--input", str(src), "--out_dir", str(out)])
    rows = [json.loads(x) for x in (out / "train.jsonl").read_text().splitlines()]
    assert [r["question_id"] for r in rows] == ["q0", "q1", "q2", "q3"]
    r = rows[1]
    assert r["problem"] == "What is object 1?\nA. cat\nB. dog\nC. car\nD. tree"
    assert r["label_idx"] == 1 and r["answer"] == "B" and r["rationales"] == ["because 1"]
    assert (out / r["images"][0]).read_bytes() == _jpeg(1)
    # the output trains as-is: rows encode with image_dir = out_dir
    from transformers import AutoTokenizer

    from jaxvrl.data import default_tokenizer_path

    tok = AutoTokenizer.from_pretrained(default_tokenizer_path())
    ex, stats = encode_rows(
        read_rows(str(out / "train.jsonl")), tok, EncodeOptions(image_dir=str(out))
    )
    assert stats.total == 0 and len(ex) == 4


def test_prepare_aokvqa_counts_bad_rows_and_filters(tmp_path):
    src = _write(tmp_path)
    path, stats, n = prepare_aokvqa.prepare(str(src), str(tmp_path / "a"))
    assert n == 4 and dict(stats.counts) == {"corrupt_image": 1, "missing_label": 1}
    ids = tmp_path / "ids.txt"
    ids.write_text("q3\nq0\nq2\n")
    _, _, n = prepare_aokvqa.prepare(str(src), str(tmp_path / "b"), question_id_file=str(ids))
    assert n == 3
    subsets = []
    for seed in (0, 0, 1):
        path, _, n = prepare_aokvqa.prepare(
            str(tmp_path), str(tmp_path / f"s{seed}"), subset_size=3, seed=seed
        )
        subsets.append([json.loads(x)["question_id"] for x in open(path)])
    assert subsets[0] == subsets[1]  # seeded: the same subset again (parquet dir input)
    assert len(subsets[0]) <= 3
