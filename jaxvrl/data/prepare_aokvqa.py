"""A-OKVQA -> jaxvrl rows (multiple choice with `label_idx`, for the `mc_idx` reward).

    python -m jaxvrl.data.prepare_aokvqa --input aokvqa/train.parquet --out_dir data/aokvqa \
        [--question_id_file A-OKVQA_question_id.txt] [--subset_size 200] [--seed 0]

Input: a parquet file, a directory of parquet files, a JSONL file or an HF dataset saved to
disk, with A-OKVQA's columns: question, choices (4), correct_choice_idx, rationales, image
(embedded {"bytes": ...} dict or a path, relative to --image_dir) and question_id.
Output: `<out_dir>/<split>.jsonl` whose rows have `problem` ("question" then one "A. ..." line
per option), `choices`, `label_idx`, `answer` (the letter), `rationales`, `question_id` and
`images` (paths relative to out_dir, the image written to `<out_dir>/images/`). Train with
`image_dir=<out_dir>`. Rows that cannot be converted are skipped, counted by reason, and the
counts printed; they never stop the conversion.
"""

from __future__ import annotations

import argparse
import glob
import io
import json
import os

import numpy as np
from PIL import Image

from jaxvrl.data.rows import DataError, SkipStats
from jaxvrl.data.sources import ConcatSource, open_source

LETTERS = "ABCDEFGHIJ"


def format_problem(question: str, choices: list[str]) -> str:
    """'question' then one 'A. choice' line per option."""
    opts = "\n".join(f"{LETTERS[i]}. {c}" for i, c in enumerate(choices))
    return f"{question.strip()}\n{opts}"


def open_input(path: str) -> ConcatSource:
    """A file, a save_to_disk directory, or a directory of parquet files (sorted by name)."""
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, "state.json")):
        if not os.path.exists(os.path.join(path, "dataset_dict.json")):
            files = sorted(glob.glob(os.path.join(path, "**", "*.parquet"), recursive=True))
            if not files:
                raise DataError(f"{path}: no parquet files and not a saved HF dataset")
            return ConcatSource([open_source(f) for f in files])
    return ConcatSource([open_source(path)])


def _image_bytes(ref, image_dir: str | None) -> bytes:
    if isinstance(ref, dict):
        if ref.get("bytes"):
            return ref["bytes"]
        ref = ref.get("path")
    if isinstance(ref, bytes | bytearray):
        return bytes(ref)
    if not ref:
        raise FileNotFoundError("row has no image")
    path = ref if image_dir is None or os.path.isabs(ref) else os.path.join(image_dir, ref)
    with open(path, "rb") as f:
        return f.read()


def convert_row(row: dict, out_dir: str, image_dir: str | None, stats: SkipStats):
    """One A-OKVQA row -> a jaxvrl row (image written), or None (reason in `stats`)."""
    where = row.get("_where", "row")
    choices, idx = row.get("choices"), row.get("correct_choice_idx")
    question, qid = row.get("question"), row.get("question_id")
    if not question or qid is None:
        stats.skip("missing_prompt", where, "no question or question_id")
        return None
    if not choices or idx is None or not 0 <= int(idx) < len(choices) or len(choices) > 10:
        stats.skip("missing_label", where, f"choices={choices!r} correct_choice_idx={idx!r}")
        return None
    try:
        data = _image_bytes(row.get("image"), image_dir)
    except FileNotFoundError as e:
        stats.skip("missing_image", where, str(e))
        return None
    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except Exception as e:  # noqa: BLE001 -- any decoder error means a corrupt image
        stats.skip("corrupt_image", where, f"{type(e).__name__}: {e}")
        return None
    ext = (img.format or "png").lower().replace("jpeg", "jpg")
    rel = os.path.join("images", f"{qid}.{ext}")
    with open(os.path.join(out_dir, rel), "wb") as f:
        f.write(data)
    choices = [str(c) for c in choices]
    return {
        "id": str(qid),
        "question_id": str(qid),
        "problem": format_problem(question, choices),
        "choices": choices,
        "label_idx": int(idx),
        "answer": LETTERS[int(idx)],
        "rationales": list(row.get("rationales") or []),
        "images": [rel],
    }


def select(source, question_ids: set[str] | None, subset_size: int | None, seed: int) -> list[int]:
    """Row indices to convert: those whose question_id is listed (all if no list), then a
    seeded random subset of `subset_size`, kept in input order."""
    idx = list(range(len(source)))
    if question_ids is not None:
        idx = [i for i in idx if str(source[i].get("question_id")) in question_ids]
    if subset_size is not None and subset_size < len(idx):
        pick = np.random.default_rng(seed).choice(len(idx), subset_size, replace=False)
        idx = [idx[i] for i in sorted(pick)]
    return idx


def prepare(
    input_path: str,
    out_dir: str,
    question_id_file: str | None = None,
    subset_size: int | None = None,
    seed: int = 0,
    split: str = "train",
    image_dir: str | None = None,
) -> tuple[str, SkipStats, int]:
    """Convert; returns (jsonl path, skip stats, rows written)."""
    source = open_input(input_path)
    qids = None
    if question_id_file:
        with open(question_id_file, encoding="utf-8") as f:
            qids = {line.strip() for line in f if line.strip()}
    os.makedirs(os.path.join(out_dir, "images"), exist_ok=True)
    stats, written = SkipStats(), 0
    out_path = os.path.join(out_dir, f"{split}.jsonl")
    with open(out_path, "w", encoding="utf-8") as out:
        for i in select(source, qids, subset_size, seed):
            row = convert_row(source[i], out_dir, image_dir, stats)
            if row is not None:
                out.write(json.dumps(row, ensure_ascii=False) + "\n")
                written += 1
    return out_path, stats, written


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--input", required=True, help="parquet / JSONL / saved dataset / parquet dir")
    p.add_argument("--out_dir", required=True)
    p.add_argument("--question_id_file", default=None, help="keep only these ids (one a line)")
    p.add_argument("--subset_size", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--split", default="train", help="output file name: <split>.jsonl")
    p.add_argument("--image_dir", default=None, help="base for relative image paths")
    args = p.parse_args(argv)
    path, stats, n = prepare(
        args.input,
        args.out_dir,
        args.question_id_file,
        args.subset_size,
        args.seed,
        args.split,
        args.image_dir,
    )
    print(f"wrote {n} rows to {path}; skipped {stats.total}: {dict(stats.counts)}")


if __name__ == "__main__":
    main()
