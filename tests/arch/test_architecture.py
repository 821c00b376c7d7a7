"""The package's shape: layers import only downward (import-linter's contracts in
pyproject.toml, which the test command runs; here shown to catch a cycle), and no module
holds mutable state (no globals rebound or mutated, no caches on functions but the one that
loads the CPU kernels' library, no module-level containers changed but the caches of compiled
work listed in KEPT)."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "jaxvrl"
# functions allowed a process-wide cache, and why
CACHED = {
    ("jaxvrl/sampling/cpu/kernels.py", "_library"): "XLA registers a custom call once per process",
}
# module-level containers allowed to change, and why: caches of compiled work, like jax's own
# per-process caches of programs, keyed on everything they were made from
KEPT = {
    ("jaxvrl/parallel/runtime.py", "_KEPT"): "a later run's train step reuses a traced program",
    ("jaxvrl/sampling/sampler.py", "_GENERATE_WEIGHTS"): "generate's packed decode weights, "
    "weakly keyed on the parameter arrays they were packed from",
}
MUTATORS = {"append", "extend", "insert", "remove", "pop", "popitem", "clear", "update",
            "setdefault", "add", "discard", "appendleft", "extendleft"}  # fmt: skip


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text())


def _module_names(tree) -> dict:
    """Names bound at module level to a list, dict or set (a display or a constructor call)."""
    names = {}
    for node in tree.body:
        targets, value = [], None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        mutable = isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp))
        if isinstance(value, ast.Call):
            f = value.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            mutable |= name in {"list", "dict", "set", "defaultdict", "deque", "OrderedDict"}
        for t in targets:
            if mutable and isinstance(t, ast.Name):
                names[t.id] = node.lineno
    return names


def _findings(path: str, tree) -> list[str]:
    out = []
    names = {k: v for k, v in _module_names(tree).items() if (path, k) not in KEPT}
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            out.append(f"{path}:{node.lineno}: global {', '.join(node.names)}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            obj = node.func.value
            if isinstance(obj, ast.Name) and obj.id in names and node.func.attr in MUTATORS:
                out.append(
                    f"{path}:{node.lineno}: {obj.id}.{node.func.attr}() mutates module state"
                )
        targets = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        if isinstance(node, ast.Delete):
            targets = node.targets
        for t in targets:
            if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name):
                if t.value.id in names:
                    out.append(f"{path}:{node.lineno}: {t.value.id}[...] mutates module state")
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for d in node.decorator_list:
                f = d.func if isinstance(d, ast.Call) else d
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                if name in {"cache", "lru_cache"} and (path, node.name) not in CACHED:
                    out.append(f"{path}:{node.lineno}: @{name} on {node.name}")
    return out


def test_no_module_level_mutable_state():
    findings = [f for path, tree in _modules() for f in _findings(path, tree)]
    assert not findings, "\n".join(findings)


def test_the_state_check_finds_what_it_looks_for():
    bad = ast.parse(
        "import collections, functools\n_SPARE: list = []\nCOUNTS = {}\n"
        "LAST = collections.OrderedDict()\n"
        "def f(x):\n    _SPARE[:] = [x]\n    COUNTS.setdefault(x, 0)\n    global N\n"
        "    LAST.popitem()\n"
        "@functools.lru_cache(maxsize=8)\ndef g(x):\n    return x\n"
    )
    found = _findings("bad.py", bad)
    assert len(found) == 5, found


def _lint(root: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(root))
    exe = shutil.which("lint-imports") or pytest.skip("lint-imports is not installed")
    return subprocess.run(
        [exe, "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=root, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.mark.parametrize(
    "module, line",
    [
        ("jaxvrl/models/decoder.py", "from jaxvrl.sampling import sampler"),
        ("jaxvrl/parallel/runtime.py", "from jaxvrl.trainer import step"),
    ],
)
def test_the_layering_contracts_catch_an_upward_import(tmp_path, module, line):
    shutil.copytree(PACKAGE, tmp_path / "jaxvrl", ignore=shutil.ignore_patterns("assets"))
    target = tmp_path / module
    target.write_text(target.read_text() + f"\n{line}  # noqa\n")
    broken = _lint(tmp_path)
    assert broken.returncode != 0, broken.stdout
    assert "BROKEN" in broken.stdout
    (tmp_path / module).write_text((PACKAGE.parent / module).read_text())
    kept = _lint(tmp_path)
    assert kept.returncode == 0, kept.stdout


def test_the_main_job_touches_no_private_attribute_of_another_module():
    tree = ast.parse((PACKAGE / "train.py").read_text())
    private = [
        f"train.py:{n.lineno}: .{n.attr}"
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute)
        and n.attr.startswith("_")
        and not n.attr.startswith("__")
        and not (isinstance(n.value, ast.Name) and n.value.id == "self")
    ]
    assert not private, private


# Positions are the family's own: int[B, T] (RoPE) or int[3, B, T] (M-RoPE). Outside
# jaxvrl/models/ code carries them by rank-free rules (rows on the second-to-last axis,
# `jaxvrl.models.positions`); these are the shapes of code that assumes a leading axis.
# a shape that starts with M-RoPE's 3 axes: (3, b, p), [3, B, T], (3,) + shape
LEADING_THREE = re.compile(r"[(\[]\s*3\s*,\s*(?:\)|[A-Za-z]\b|rows\b|batch\b)")
POSITION_NAME = re.compile(r"position_ids|positions")
FIXED_RANK = (
    re.compile(r"\baxis\s*=\s*[12]\b"),  # rows or tokens at a fixed axis
    re.compile(r"(?:position_ids|positions)[\]\)\"']*\[\s*(?::\s*,|[0-2]\s*\])"),  # [:, r], [0]
    re.compile(r"moveaxis\([^)]*,\s*[0-2]\s*,\s*[0-2]\s*\)"),  # axes moved by number
)


def _fixed_rank_positions(path: str, source: str) -> list[str]:
    return [
        f"{path}:{i}: {line.strip()}"
        for i, line in enumerate(source.splitlines(), 1)
        if LEADING_THREE.search(line)
        or (POSITION_NAME.search(line) and any(p.search(line) for p in FIXED_RANK))
    ]


def test_no_code_outside_the_models_assumes_the_rank_of_positions():
    findings = [
        f
        for path in sorted(PACKAGE.rglob("*.py"))
        if "models" not in path.relative_to(PACKAGE).parts[:1]
        for f in _fixed_rank_positions(path.relative_to(ROOT).as_posix(), path.read_text())
    ]
    assert not findings, "\n".join(findings)


@pytest.mark.parametrize(
    "line",
    [
        "    return np.broadcast_to(pos[None], (3,) + pos.shape).astype(np.int32)",
        "    out = batch.replace(position_ids=np.asarray(batch.position_ids)[:, rows])",
        "    position_ids=np.zeros((3, b, p), np.int32),",
        '    out["position_ids"] = np.repeat(batch["position_ids"], g, axis=1)',
        "    return batch.replace(position_ids=jnp.moveaxis(batch.position_ids, 1, 0))",
        "    pos = jnp.broadcast_to((start + i)[None, :, None], (3, b, 1))",
    ],
)
def test_the_position_check_finds_what_it_looks_for(line):
    assert _fixed_rank_positions("bad.py", f"def f():\n{line}\n")
