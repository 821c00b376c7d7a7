"""The first rows of a run's training data as the model will see them.

    python -m jaxvrl.data --config configs/grpo.py [--config.key=value ...] [--rows N]

For each of the first N rows (file order, 3 by default): the prompt as the chat template
renders it, with each vision span's pads written once with their count
(`<|vision_start|><|image_pad|>x64<|vision_end|>`), the label, and each image's size, resized
size and grid (each video's frames and grid); a row the run would skip says why. Last, the
rows skipped so far per reason. The rows, columns, keys, format hook, `data.format_prompt`,
system prompt, tokenizer and image processor are the main job's (jaxvrl/data/from_config.py).
"""

from __future__ import annotations

import logging
import sys

import numpy as np

from jaxvrl import models
from jaxvrl.config import ConfigError, load_config, parse_argv
from jaxvrl.data.from_config import encode_options, model_dir, train_source
from jaxvrl.data.prompts import shown_prompt
from jaxvrl.data.rows import (
    DataError,
    EncodeOptions,
    SkipStats,
    encode_row,
    load_image,
    load_tokenizer,
    row_label,
    row_media,
)


class _Skips(SkipStats):
    """SkipStats that also keeps the last row's reason and detail (for the listing)."""

    last: tuple[str, str] | None = None

    def skip(self, reason: str, where: str, detail: str = "") -> None:
        self.last = (reason, detail)
        super().skip(reason, where, detail)


def media_lines(example: dict, opts: EncodeOptions, refs: list, videos: list) -> list[str]:
    """One line per image (its size, resized size, grid, tokens) and per video."""
    proc = opts.processor or models.ProcessorSettings()
    merge, patch = proc.merge_size, proc.patch_size
    lines = []
    for k, g in enumerate(np.asarray(example["image_grid_thw"]).reshape(-1, 3)):
        t, h, w = (int(x) for x in g)
        size = "x".join(map(str, load_image(refs[k], opts.image_dir).size))
        lines.append(
            f"image {k}: {size} px -> {w * patch}x{h * patch} (grid {t}x{h}x{w}, "
            f"{t * h * w // merge**2} tokens)"
        )
    for k, g in enumerate(np.asarray(example["video_grid_thw"]).reshape(-1, 3)):
        t, h, w = (int(x) for x in g)
        lines.append(
            f"video {k}: {len(videos[k])} frames -> {w * patch}x{h * patch} (grid {t}x{h}x{w}, "
            f"{t * h * w // merge**2} tokens)"
        )
    return lines


def show_rows(source, tokenizer, opts: EncodeOptions, n: int, out=None) -> SkipStats:
    """Writes the first `n` rows of `source` as the module docstring says (to `out`, default
    stdout); -> the skips."""
    out = out or sys.stdout
    stats = _Skips()
    for i in range(min(n, len(source))):
        row = source[i]
        where = row.get("_where", f"row {i}")
        stats.last = None
        ex = encode_row(row, tokenizer, opts, where, stats)
        if ex is None:
            reason, detail = stats.last or ("?", "")
            print(f"--- {where}: skipped ({reason}{': ' + detail if detail else ''})", file=out)
            continue
        print(f"--- {where}: {len(ex['prompt_ids'])} prompt tokens", file=out)
        print(shown_prompt(tokenizer, ex["prompt_ids"]), file=out)
        print(f"label: {row_label(ex)!r}", file=out)
        images, videos = row_media(row)
        for line in media_lines(ex, opts, images, videos):
            print(line, file=out)
    counts = {r: c for r, c in stats.report().items() if c}
    listed = ", ".join(f"{r} {c}" for r, c in counts.items()) or "none"
    print(f"skipped so far: {listed}", file=out)
    return stats


def main(argv=None) -> int:

    argv = list(sys.argv[1:] if argv is None else argv)
    rows, rest, i = 3, [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--rows" and i + 1 < len(argv):
            rows, i = argv[i + 1], i + 2
            continue
        if a.startswith("--rows="):
            rows = a.split("=", 1)[1]
        else:
            rest.append(a)
        i += 1
    logging.getLogger("jaxvrl.data.rows").setLevel(logging.ERROR)  # each row says why here
    try:
        if not str(rows).isdigit():
            raise ConfigError(f"--rows {rows!r}: expected a number of rows")
        path, overrides = parse_argv(rest)
        c = load_config(path, overrides)
        directory = model_dir(c)
        opts = encode_options(c, models.load_config(directory))
        source = train_source(c)
        tokenizer = load_tokenizer(directory)
        print(f"{path}: rows: {len(source)}; tokenizer and processor of {directory}", flush=True)
        show_rows(source, tokenizer, opts, int(rows))
    except (ConfigError, DataError) as e:  # the user's to fix: one line, no traceback
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
