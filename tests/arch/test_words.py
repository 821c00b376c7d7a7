"""Words in the code say what and why, briefly: module docstrings of at most 25 lines, and no
measured figure (milliseconds, GiB, "2x faster") in a comment, where it would go stale; those
live in bench/RESULTS.md and docs/."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_DOCSTRING_LINES = 25
# A number with a unit of time, memory or bandwidth, or a speed ratio.
FIGURE = re.compile(
    r"\d[\d,.]*\s*(?:ns|us|µs|ms|s/step|[KMGT]i?B|[KMGT]B/s|TFLOP/s|tokens/s)\b"
    r"|\d[\d.]*\s*x\s*(?:faster|slower|less|more|smaller|larger)\b"
)


def _sources():
    return sorted(p for p in (ROOT / "jaxvrl").rglob("*.py"))


def long_docstrings(paths) -> list[str]:
    out = []
    for path in paths:
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
        lines = doc.count("\n") + 1 if doc else 0
        if lines > MAX_DOCSTRING_LINES:
            out.append(f"{path}: {lines} lines")
    return out


def figures_in_comments(paths) -> list[str]:
    out = []
    for path in paths:
        tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
        for tok in tokens:
            if tok.type == tokenize.COMMENT and FIGURE.search(tok.string):
                out.append(f"{path}:{tok.start[0]}: {tok.string.strip()}")
    return out


def test_module_docstrings_are_short():
    assert not long_docstrings(_sources())


def test_no_measured_figure_in_a_comment():
    assert not figures_in_comments(_sources())


def test_the_checks_find_what_they_look_for(tmp_path):
    bad = tmp_path / "jaxvrl_bad.py"
    bad.write_text('"""' + "line\n" * 26 + '"""\nx = 1  # 3.2 ms on the CPU, 1.7x faster\n')
    good = tmp_path / "jaxvrl_good.py"
    good.write_text(
        '"""Short."""\nx = 2  # two prompts x 8 samples, 3 steps (a setting, not a figure)\n'
    )
    assert len(long_docstrings([bad])) == 1 and len(figures_in_comments([bad])) == 1
    assert not long_docstrings([good]) and not figures_in_comments([good])
    assert (
        FIGURE.search("7.1 vs 9.5 ms") and FIGURE.search("96 MiB") and FIGURE.search("2.3x slower")
    )
