"""Config files and `--config.key=value` overrides (big_vision style, ml_collections).

python -m jaxvrl.train --config configs/tprl.py --config.rollout.temperature=0.7
python -m jaxvrl.train --config=configs/grpo.py:arg --config.model.path=/ckpt/qwen
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import os
import sys
import time

import ml_collections


class ConfigError(ValueError):
    """A config file or override that cannot be applied."""


def parse_argv(argv: list[str]) -> tuple[str, list[str]]:
    """-> (config path, ['key=value', ...]) from `--config PATH|--config=PATH` and
    `--config.key=value` / `--config.key value` arguments."""
    path, overrides, i = None, [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--config":
            if i + 1 >= len(argv):
                raise ConfigError("--config needs a path, e.g. --config configs/tprl.py")
            path, i = argv[i + 1], i + 2
            continue
        if a.startswith("--config="):
            path = a.split("=", 1)[1]
        elif a.startswith("--config."):
            body = a[len("--config.") :]
            if "=" not in body:
                if i + 1 >= len(argv):
                    raise ConfigError(f"{a} needs a value")
                body, i = f"{body}={argv[i + 1]}", i + 1
            overrides.append(body)
        else:
            raise ConfigError(f"unknown argument {a!r} (use --config PATH and --config.key=value)")
        i += 1
    if path is None:
        raise ConfigError("missing --config, e.g. --config configs/tprl.py")
    return path, overrides


def _load_file(spec: str) -> ml_collections.ConfigDict:
    path, _, arg = spec.partition(":")
    if not os.path.exists(path):
        raise ConfigError(f"config file {path} not found")
    root = os.path.dirname(os.path.dirname(os.path.abspath(path)))
    if root not in sys.path:  # lets configs/*.py import their siblings as `configs.x`
        sys.path.insert(0, root)
    mod_spec = importlib.util.spec_from_file_location(f"jaxvrl_config_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ConfigError(f"{path} has no get_config()")
    return module.get_config(arg or None)


def flat_keys(cfg, prefix="") -> list[str]:
    out = []
    for k, v in cfg.items():
        if isinstance(v, ml_collections.ConfigDict):
            out += flat_keys(v, f"{prefix}{k}.")
        else:
            out.append(prefix + k)
    return out


def _parse_value(raw: str, current, key: str):
    if isinstance(current, bool):
        low = raw.lower()
        if low in ("true", "1", "yes"):
            return True
        if low in ("false", "0", "no"):
            return False
        raise ConfigError(f"--config.{key}: expected a bool, got {raw!r}")
    if isinstance(current, int):
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"--config.{key}: expected an int, got {raw!r}") from None
    if isinstance(current, float):
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(f"--config.{key}: expected a float, got {raw!r}") from None
    if isinstance(current, tuple | list):
        try:
            val = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            val = tuple(x.strip() for x in raw.split(",") if x.strip())
        return tuple(val) if isinstance(val, list | tuple) else (val,)
    if current is None:
        try:
            return ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            return raw
    return raw


def apply_override(cfg, item: str, source: str = "") -> None:
    key, _, raw = item.partition("=")
    keys = flat_keys(cfg)
    if key not in keys:
        close = difflib.get_close_matches(key, keys, n=5, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ConfigError(f"unknown config key {key!r} in {source or 'the config'}{hint}")
    *parents, leaf = key.split(".")
    node = cfg
    for p in parents:
        node = node[p]
    node[leaf] = _parse_value(raw, node[leaf], key)


def load_config(spec: str, overrides: list[str] = ()) -> ml_collections.ConfigDict:
    cfg = _load_file(spec)
    for item in overrides:
        apply_override(cfg, item, spec.partition(":")[0])
    if not cfg.get("workdir"):
        name = os.path.splitext(os.path.basename(spec.partition(":")[0]))[0]
        cfg.workdir = os.path.join("runs", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    cfg.lock()
    return cfg
