"""Markdown logs a user reads (README "What a run writes"): `rollout_results.md` (prompt,
completion, each reward, total, advantage per sample), `token_weights.md` (each completion as
`word(weight)`, and as HTML with each token coloured by its values) and
`attention_diagnostics.md` (MDI, AEI, early / middle / late MDI, links to the attention
heatmaps' PNGs).

Section builders are pure functions returning text; MarkdownLog appends them to a file.
Model text goes inside code fences so that tags like `<think>` stay visible.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Sequence

import numpy as np

ATTENTION_ORDER = (
    "mdi",
    "mdi_early",
    "mdi_middle",
    "mdi_late",
    "aei_vision",
    "aei_text",
    "attn_vision",
    "attn_text",
)


class MarkdownLog:
    """Appends sections to `<workdir>/<name>.md` (title written once, kept on resume); only
    the primary process writes."""

    def __init__(self, workdir: str, name: str, title: str, enabled: bool = True):
        self.enabled = enabled
        self.path = os.path.join(workdir, f"{name}.md")
        if enabled and not os.path.exists(self.path):
            os.makedirs(workdir, exist_ok=True)
            with open(self.path, "w", encoding="utf-8") as f:
                f.write(f"# {title}\n\n")

    def append(self, text: str) -> None:
        if self.enabled:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(text.rstrip() + "\n\n")


def fenced(text: str, lang: str = "text") -> str:
    """A code fence longer than any backtick run inside `text`."""
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{lang}\n{text}\n{fence}"


def _num(v, digits: int) -> str:
    v = float(v)
    return f"{v:.{digits}f}" if math.isfinite(v) else "n/a"


def _row_values(x, n: int) -> np.ndarray:
    """A per-row value: float[B], or one value for all n rows."""
    a = np.asarray(x, np.float64)
    return np.full(n, float(a)) if a.ndim == 0 else a


def rollout_section(
    step: int,
    prompts: Sequence[str],
    completions: Sequence[str],
    rewards: dict,
    totals,
    advantages,
    limit: int = 8,
    kept: Sequence[bool] | None = None,
) -> str:
    """prompts / completions: one per row; rewards: {name: float[B]} (unweighted); totals:
    float[B] (weighted sum); advantages: float[B] (one per row); kept: per row whether it
    is in the step's batch (False: "(filtered)"; None: all are)."""
    n = len(completions)
    totals = _row_values(totals, n)
    adv = _row_values(advantages, n)
    parts = {k: _row_values(v, n) for k, v in rewards.items()}
    lines = [f"## Step {step}", ""]
    for i in range(min(limit, n)):
        head = f"### Sample {i}{_mark(kept, i)}"
        lines += [head, "", "**Prompt:**", "", fenced(str(prompts[i])), ""]
        lines += ["**Completion:**", "", fenced(str(completions[i])), ""]
        lines += ["| reward | value |", "|---|---|"]
        lines += [f"| {k} | {_num(v[i], 2)} |" for k, v in parts.items()]
        lines += [f"| **total** | {_num(totals[i], 3)} |", f"| advantage | {_num(adv[i], 3)} |"]
        lines.append("")
    return "\n".join(lines)


def _mark(kept: Sequence[bool] | None, i: int) -> str:
    """Row i's mark: " (filtered)" where it is not in the step's batch."""
    return "" if kept is None or kept[i] else " (filtered)"


def rollout_table(
    prompts, completions, rewards: dict, totals, advantages, limit: int = 8, kept=None
):
    """rollout_section's samples as a table for the trackers: -> (columns, rows), the columns
    prompt, completion, each reward, total, advantage, and where a row of `kept`
    (rollout_section's) is not in the step's batch, kept: whether each row is."""
    n = min(limit, len(completions))
    cols = {k: _row_values(v, len(completions)) for k, v in rewards.items()}
    cols["total"] = _row_values(totals, len(completions))
    cols["advantage"] = _row_values(advantages, len(completions))
    rows = [
        [str(prompts[i]), str(completions[i]), *(float(v[i]) for v in cols.values())]
        for i in range(n)
    ]
    if kept is None or all(kept[:n]):
        return ["prompt", "completion", *cols], rows
    return ["prompt", "completion", *cols, "kept"], [
        r + [bool(kept[i])] for i, r in enumerate(rows)
    ]


def show_token(text: str) -> str:
    """Token text as shown in `word(weight)`: surrounding whitespace dropped, a whitespace-only
    token escaped (`\\n`, `␣`)."""
    s = text.strip()
    if s:
        return s
    return text.replace(" ", "␣").encode("unicode_escape").decode("ascii").replace("\\u2423", "␣")


def decode_pieces(
    decode: Callable[[list[int]], str], ids: Sequence[int], weights: Sequence[float]
) -> list[tuple[str, float]]:
    """Decodes token ids one by one into (text, weight); tokens that only decode together
    (a character split over byte-level tokens) are merged, with the mean of their weights."""
    out, buf, wbuf = [], [], []
    for t, w in zip(ids, weights):
        buf.append(int(t))
        wbuf.append(float(w))
        text = decode(buf)
        if text.endswith("\ufffd") and len(buf) < 4:
            continue
        out.append((text, float(np.mean(wbuf))))
        buf, wbuf = [], []
    if buf:
        out.append((decode(buf), float(np.mean(wbuf))))
    return out


def token_weight_section(step: int, token_texts, weights, limit: int = 4) -> str:
    """token_texts: per row a list of token strings, or of (text, weight) pairs (then
    `weights` may be None); weights: float[B, T] aligned with the tokens. Each completion is
    written as `word(0.93) word(1.20) ...`, one `piece(weight)` per token: the pieces of one
    word (a token not starting or following whitespace) written together,
    `yellow(1.10)ish(0.90) cube(1.00)`."""
    lines = [f"## Step {step}", ""]
    for i in range(min(limit, len(token_texts))):
        row = token_texts[i]
        if row and isinstance(row[0], tuple):
            pairs = row
        else:
            pairs = list(zip(row, np.asarray(weights[i], np.float64)))
        out, before = [], " "
        for t, w in pairs:
            # a new word where this token or the one before it holds whitespace
            gap = not t.strip() or t[:1].isspace() or before[-1:].isspace()
            out.append((" " if gap and out else "") + f"{show_token(t)}({_num(w, 2)})")
            before = t
        lines += [f"### Sample {i}", "", fenced("".join(out)), ""]
    return "\n".join(lines)


def attention_section(step: int, metrics: dict, limit: int = 8, kept=None) -> str:
    """metrics: {name: float[B] per row, or a scalar}, e.g. rl.attention_metrics' mdi,
    mdi_early / middle / late, aei_vision, aei_text. Per-row values give one table row per
    sample (kept: rollout_section's; a row not in the step's batch marked "(filtered)") plus
    their mean (NaN = no statistic: a row without image); scalars give a name | value
    table."""
    names = [k for k in ATTENTION_ORDER if k in metrics]
    names += sorted(k for k in metrics if k not in ATTENTION_ORDER)
    arrays = {k: np.atleast_1d(np.asarray(metrics[k], np.float64)) for k in names}
    arrays = {k: v for k, v in arrays.items() if v.ndim == 1}
    names = list(arrays)
    lines = [f"## Step {step}", ""]
    if all(len(v) == 1 for v in arrays.values()):
        lines += ["| metric | value |", "|---|---|"]
        lines += [f"| {k} | {_num(arrays[k][0], 4)} |" for k in names]
        return "\n".join(lines)
    lines += ["| sample | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    n = max(len(v) for v in arrays.values())
    for i in range(min(limit, n)):
        cells = [_num(arrays[k][i], 3) if i < len(arrays[k]) else "" for k in names]
        lines.append(f"| {i}{_mark(kept, i)} | " + " | ".join(cells) + " |")
    means = []
    for k in names:
        finite = arrays[k][np.isfinite(arrays[k])]
        means.append(_num(finite.mean(), 3) if finite.size else "n/a")
    lines.append("| **mean** | " + " | ".join(means) + " |")
    return "\n".join(lines)


def heatmap_section(step: int, pictures: Sequence[tuple[str, str]]) -> str:
    """pictures: (caption, path relative to the markdown file) of the step's attention
    heatmaps and token panels, as image links."""
    lines = [f"## Step {step}", ""]
    for caption, path in pictures:
        lines += [f"**{caption}**", "", f"![{caption}]({path})", ""]
    return "\n".join(lines)


def token_colour_section(step: int, samples: Sequence[Sequence[str]]) -> str:
    """samples: per sample, HTML blocks of its tokens coloured by each per-token value
    (`heatmaps.token_html`)."""
    lines = [f"## Step {step}", ""]
    for i, blocks in enumerate(samples):
        lines += [f"### Sample {i}, coloured", "", *blocks, ""]
    return "\n".join(lines)
