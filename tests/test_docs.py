"""The repository stands alone: the README and docs link only to files (and headings) that
exist in it, and no source, config or doc refers to documents outside it (a design contract,
numbered design documents, issue numbers). Plain text checks: no jax needed."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Markdown files whose links must resolve.
LINKED_DOCS = ["README.md", "docs/*.md", "bench/*.md"]
# Files that must not point outside the repository.
SCANNED = ["README.md", "jaxvrl", "configs", "docs", "bench", "launch", "tests"]
TEXT_SUFFIXES = {".py", ".md", ".sh", ".toml", ".txt", ".cfg", ".yaml", ".yml", ".jinja"}

# References to documents that live outside the repository. RNG seeds ("seed=0",
# "--seed 0", "for seed in range(3)", "c.seed = 0") must not match: a design-document seed is
# "seed"/"seeds" followed by a zero-padded three-digit number (000 ... 099), a list of them
# ("seeds 002/004"), or the design documents' possessive ("the seeds' names").
OUTSIDE_REFS = [
    ("the design contract", re.compile(r"\bSPEC\b")),
    ("a path outside the repository", re.compile(r"\.\./shared\b|\bshared/(?:SPEC|seeds)\b")),
    ("a design-document number", re.compile(r"(?i)\bseeds?[ _#-]*0\d\d\b")),
    (
        "a design-document reference",
        re.compile(r"(?i)(?<![\w'\"-])(?:seeds['\u2019](?=\s)|seed['\u2019]s\b|seeds/)"),
    ),
    ("an issue number", re.compile(r"(?i)\bissues? +#?\d+\b|(?<![\w/])#\d{1,4}\b(?!\w)")),
]

_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)
_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
_HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$", re.M)
_HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=[\"']([^\"']+)[\"']", re.I)


def _strip_code(text: str) -> str:
    """Markdown without fenced blocks and inline code (links there are not links)."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, markup and punctuation dropped, lower
    case, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(md_text: str) -> set[str]:
    """Every anchor a markdown file defines (headings, with GitHub's -1, -2 for repeats, and
    explicit <a name/id>)."""
    out, seen = set(), {}
    for heading in _HEADING.findall(_FENCE.sub("", md_text)):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    out.update(_HTML_ANCHOR.findall(md_text))
    return out


def broken_links(md: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    """Relative links of `md` that do not resolve to a file or heading inside `root`."""
    text = md.read_text(encoding="utf-8")
    body = _strip_code(text)
    targets = _LINK.findall(body) + _REF_DEF.findall(body)
    bad = []
    for target in targets:
        if re.match(r"(?i)^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        path, _, frag = target.partition("#")
        dest = md if not path else (md.parent / path).resolve()
        if path.startswith("/") or not dest.is_relative_to(root.resolve()):
            bad.append(f"{target}: outside the repository")
            continue
        if not dest.exists():
            bad.append(f"{target}: no such file")
            continue
        if frag and dest.suffix == ".md" and frag not in anchors(dest.read_text("utf-8")):
            bad.append(f"{target}: no heading #{frag} in {dest.name}")
    return bad


def outside_refs(path: pathlib.Path) -> list[str]:
    """Lines of `path` that refer to documents outside the repository."""
    bad = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        for what, pattern in OUTSIDE_REFS:
            if pattern.search(line):
                bad.append(f"{path.name}:{i}: {what}: {line.strip()}")
    return bad


def _scanned_files():
    for entry in SCANNED:
        p = ROOT / entry
        files = [p] if p.is_file() else sorted(p.rglob("*"))
        for f in files:
            hidden = any(part.startswith(".") for part in f.relative_to(ROOT).parts)
            # hidden folders hold what tools made (bench/.venvs: the peers' environments)
            if (
                f.is_file()
                and f.suffix in TEXT_SUFFIXES
                and f != pathlib.Path(__file__)
                and not hidden
            ):
                yield f


def test_markdown_links_resolve():
    docs = sorted({p for pattern in LINKED_DOCS for p in ROOT.glob(pattern)})
    assert ROOT / "README.md" in docs and ROOT / "docs/algorithms.md" in docs
    bad = {str(d.relative_to(ROOT)): broken_links(d) for d in docs}
    assert {k: v for k, v in bad.items() if v} == {}


def test_readme_points_at_the_algorithms_doc():
    assert "(docs/algorithms.md" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_documented_defaults_match_base_config():
    """Every `key` | `default` row of docs/algorithms.md's tables equals configs/base.py."""
    from configs import base

    cfg = base.get_config()
    text = (ROOT / "docs/algorithms.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| ((?:`[\w.]+`(?:, )?)+) \| ((?:`[^`]+`(?:, )?)+) \|", text, re.M)
    checked, wrong = 0, []
    for key_cell, value_cell in rows:
        keys, values = re.findall(r"`([\w.]+)`", key_cell), re.findall(r"`([^`]+)`", value_cell)
        assert len(keys) == len(values), (keys, values)
        parent = keys[0].rsplit(".", 1)[0]
        for key, value in zip(keys, values):
            key = key if "." in key else f"{parent}.{key}"
            want = float(value) if value in ("inf", "-inf") else ast.literal_eval(value)
            got = cfg
            for part in key.split("."):
                got = got[part]
            checked += 1
            if got != want:
                wrong.append(f"{key}: docs {value}, configs/base.py {got!r}")
    assert checked > 50 and wrong == []


def test_documented_functions_exist():
    """Every `jaxvrl/...py: name` of docs/algorithms.md names a function or class there."""
    text = (ROOT / "docs/algorithms.md").read_text(encoding="utf-8")
    refs = re.findall(r"`(jaxvrl/[\w/]+\.py): (\w+)`((?:, `\w+`)*)", text)
    missing = []
    for path, first, more in refs:
        source = (ROOT / path).read_text(encoding="utf-8")
        for name in [first, *re.findall(r"`(\w+)`", more)]:
            if not re.search(rf"^\s*(?:def|class) {name}\b|^{name}\s*=", source, re.M):
                missing.append(f"{path}: {name}")
    assert len(refs) > 30 and missing == []


def test_nothing_refers_outside_the_repository():
    files = list(_scanned_files())
    assert len(files) > 50  # the scan found the package
    bad = [hit for f in files for hit in outside_refs(f)]
    assert bad == []


def test_link_check_fails_on_a_broken_link(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs/a.md").write_text("# Title\n\n## Some `code` section\n\ntext\n")
    md = tmp_path / "README.md"
    md.write_text(
        "[ok](docs/a.md) [ok](docs/a.md#some-code-section) [ok](#top-one) "
        "[web](https://arxiv.org/abs/2503.14476)\n\n# Top one\n\n"
        "```\n[not a link](missing.md)\n```\n`[not a link](missing.md)`\n"
    )
    assert broken_links(md, tmp_path) == []
    md.write_text(
        "[gone](docs/missing.md) [anchor](docs/a.md#nope) [up](../shared/SPEC.md)\n"
        "[ref]: docs/also_missing.md\n"
    )
    bad = broken_links(md, tmp_path)
    assert len(bad) == 4, bad
    assert any("outside" in b for b in bad) and any("#nope" in b for b in bad)


@pytest.mark.parametrize(
    "line",
    [
        "see ../shared/SPEC.md",
        "(SPEC section 3)",
        "Per-token visual dependency S_t (seeds 002/004).",
        "# seed 000: R in clip(1 - |ln MDI| / ln R, 0, 1)",
        "DAPO loss (Seed 001's replay buffer)",
        "options under the seeds' names",
        "what the seed's config says",
        "the files in seeds/",
        "Done-when test of issue 8",
        "fixed in issue #12",
        "see #42",
    ],
)
def test_outside_refs_flags_planted_examples(tmp_path, line):
    f = tmp_path / "planted.py"
    f.write_text(f'"""Docstring."""\n\n# {line}\nx = 1\n')
    assert len(outside_refs(f)) >= 1


@pytest.mark.parametrize(
    "line",
    [
        "c.seed = 0",
        "seed=0",
        "rng = np.random.default_rng(seed + 1000)",
        "p.add_argument('--seed', type=int, default=0)",
        "for seed in range(3):",
        "if 'seeds' in row or \"seed's\" == key:",
        "the rng seed 0 and random seed 1",
        'f"{split}-{seed}-{i}"',
        "SPECIAL_TOKENS = ['<|im_start|>']",
        "transformers>=5.23 (PR 48669)",
        "prompts 000-099 of the built-in task",
        "shared by all workers; the shared gs:// workdir",
        "colour #ff0000 or channel 3",
    ],
)
def test_outside_refs_passes_rng_seeds_and_lookalikes(tmp_path, line):
    f = tmp_path / "fine.py"
    f.write_text(f"# {line}\n")
    assert outside_refs(f) == []
