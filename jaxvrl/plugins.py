"""User functions named in the config: `package.module:function` or `path/to/file.py:function`
(reward functions, the data format hook). A leaf: it imports nothing of jaxvrl."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable


def _import(target: str):
    """The module of a file path (`path.py`) or of an importable name. A file's module is in
    `sys.modules` while it runs and after, under a name fixed by its path (as verl and EasyR1
    load theirs): its dataclasses resolve their annotations, and its functions pickle by
    reference (a process pool of its own, forked, finds them)."""
    if not target.endswith(".py"):
        return importlib.import_module(target)
    path = os.path.abspath(target)
    name = f"jaxvrl_user_{hashlib.sha1(path.encode()).hexdigest()[:16]}"
    spec = importlib.util.spec_from_file_location(name, target)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


# what `load_function` raises: a config naming a function it cannot give (one-line messages)
LOAD_ERRORS = (ValueError, OSError, AttributeError, ImportError)


def load_function(spec: str, what: str, defaults: tuple[str, ...] = ()) -> Callable:
    """The function `spec` names; `what` (e.g. "reward", "config.data.format") starts every
    error message. A `path.py` without `:function` takes the first of `defaults` the file
    defines. Raises ValueError (no function named), FileNotFoundError, AttributeError or
    ImportError (the file or module raised while it was imported, or did not parse)."""
    bare = ":" not in spec and spec.endswith(".py") and defaults
    if ":" not in spec and not bare:
        raise ValueError(f"{what} {spec!r}: expected 'module:function' or 'path.py:function'")
    target, name = (spec, None) if bare else spec.rsplit(":", 1)
    if target.endswith(".py") and not os.path.exists(target):
        raise FileNotFoundError(f"{what} {spec!r}: file {target} not found")
    try:
        module = _import(target)
    except Exception as e:  # noqa: BLE001 -- the user's code raised: one line naming it
        raise ImportError(f"{what} {spec!r} failed to load: {type(e).__name__}: {e}") from e
    if name is None:
        name = next((n for n in defaults if callable(getattr(module, n, None))), None)
        if name is None:
            found = sorted(
                k
                for k, v in vars(module).items()
                if callable(v) and getattr(v, "__module__", None) == module.__name__
            )
            raise AttributeError(
                f"{what} {spec!r}: {target} defines none of {', '.join(defaults)}; name the "
                f"function as '{target}:function' (functions in the file: "
                f"{', '.join(found) or 'none'})"
            )
    fn = getattr(module, name, None)
    if not callable(fn):
        raise AttributeError(f"{what} {spec!r}: {target} has no function {name!r}")
    return fn
