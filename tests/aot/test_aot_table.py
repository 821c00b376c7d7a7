"""docs/scaling.md shows the TPU compiler's figures (docs/aot_table.py rendering the stored
JSON of `python -m jaxvrl.aot`), and every row's command is one the tool accepts."""

from __future__ import annotations

import importlib.util
import os
import shlex

from jaxvrl.aot.__main__ import _split_args
from jaxvrl.config import load_config, parse_argv

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _table():
    spec = importlib.util.spec_from_file_location("aot_table", f"{ROOT}/docs/aot_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_scaling_doc_holds_the_rendered_tables():
    t = _table()
    results = t.load()
    assert results, "docs/aot_results.jsonl is empty: python docs/aot_table.py run"
    for key, r in results.items():
        assert r["cmd"] == next(row["cmd"] for row in t.ROWS if row["key"] == key), key
        assert r["report"]["programs"], key
    with open(f"{ROOT}/docs/scaling.md") as f:
        assert t.render() in f.read()


def test_table_commands_parse():
    for row in _table().ROWS:
        argv = shlex.split(row["cmd"])[3:]  # after `python -m jaxvrl.aot`
        ours, rest = _split_args(argv)
        path, overrides = parse_argv(rest)
        c = load_config(os.path.join(ROOT, path), overrides)
        assert c.model.preset and ours["topology"] in row["key"]
