"""Every package the library imports is declared in pyproject.toml: unconditional imports by
the package's own `dependencies` (never only by an extra, which the test extra's torch would
hide), lazy imports of optional features by an extra or an `except ImportError` fallback.
.ci/run proves the same end to end: the README's main command in a bare virtualenv."""

from __future__ import annotations

import ast
import importlib.metadata as md
import pathlib
import re
import sys

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Needed at run time by a library we call, which does not install it itself:
# transformers renders chat templates with jinja2 (`apply_chat_template`).
UNDECLARED_BY_THEIR_USER = {"jinja2"}


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def declared() -> tuple[set[str], set[str]]:
    """(the distributions of `dependencies`, those of the optional extras)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = {_name(r) for reqs in project["optional-dependencies"].values() for r in reqs}
    return {_name(r) for r in project["dependencies"]}, extras


def _guarded(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Inside a `try` whose handlers catch ImportError (or ModuleNotFoundError)."""
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.Try):
            for h in node.handlers:
                types = h.type.elts if isinstance(h.type, ast.Tuple) else [h.type]
                caught = {t.id for t in types if isinstance(t, ast.Name)}
                if caught & {"ImportError", "ModuleNotFoundError", "Exception"}:
                    return True
    return False


def _in_function(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return True
    return False


def third_party_imports():
    """(file, line, top-level module, lazy, guarded) for each import of a module outside the
    standard library and jaxvrl."""
    for path in sorted((ROOT / "jaxvrl").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                mods = [node.module]
            else:
                continue
            for mod in mods:
                top = mod.split(".")[0]
                if top in sys.stdlib_module_names or top in ("jaxvrl", "__future__"):
                    continue
                yield (path.relative_to(ROOT), node.lineno, top,
                       _in_function(node, parents), _guarded(node, parents))


def test_every_import_is_declared():
    deps, extras = declared()
    dists = md.packages_distributions()
    bad = []
    for path, line, top, lazy, guarded in third_party_imports():
        names = {d.lower().replace("_", "-") for d in dists.get(top, [top])}
        if names & deps or guarded:
            continue
        if lazy and names & extras:
            continue
        where = "only in an extra" if names & extras else "nowhere"
        bad.append(f"{path}:{line}: {top} ({', '.join(sorted(names))}) is declared {where}")
    assert not bad, "imports not in pyproject.toml's dependencies:\n" + "\n".join(bad)


def test_runtime_needs_of_our_libraries_are_declared():
    deps, _ = declared()
    assert UNDECLARED_BY_THEIR_USER <= deps


def test_the_check_sees_an_undeclared_import(tmp_path, monkeypatch):
    """The walk finds top-level, lazy and guarded imports as such (else the test above could
    pass on a file it misread)."""
    pkg = tmp_path / "jaxvrl"
    pkg.mkdir()
    (pkg / "m.py").write_text(
        "import numpy\n"
        "def f():\n    import qwix\n"
        "try:\n    import math_verify\nexcept ImportError:\n    math_verify = None\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    found = {top: (lazy, guarded) for _, _, top, lazy, guarded in third_party_imports()}
    assert found == {"numpy": (False, False), "qwix": (True, False), "math_verify": (False, True)}
