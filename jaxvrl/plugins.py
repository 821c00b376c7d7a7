"""User functions named in the config: `package.module:function` or `path/to/file.py:function`
(reward functions, the data format hook). A leaf: it imports nothing of jaxvrl."""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable


def load_function(spec: str, what: str) -> Callable:
    """The function `spec` names; `what` (e.g. "reward", "config.data.format") starts every
    error message. Raises ValueError (no ':'), FileNotFoundError or AttributeError."""
    if ":" not in spec:
        raise ValueError(f"{what} {spec!r}: expected 'module:function' or 'path.py:function'")
    target, name = spec.rsplit(":", 1)
    if target.endswith(".py"):
        if not os.path.exists(target):
            raise FileNotFoundError(f"{what} {spec!r}: file {target} not found")
        mod_spec = importlib.util.spec_from_file_location(
            f"jaxvrl_user_{abs(hash(os.path.abspath(target)))}", target
        )
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise AttributeError(f"{what} {spec!r}: {target} has no function {name!r}")
    return fn
