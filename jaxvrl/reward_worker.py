"""The entry of a reward worker process (started by jaxvrl/rl/reward_pool.py). It imports no
jax: `jaxvrl.rl`'s own `__init__` (which imports the RL math, hence jax) is replaced by an
empty package of the same path before the reward modules load, so a worker starts in a
fraction of a second; a user module that reads a name of `jaxvrl.rl` itself gets the real
package then."""

from __future__ import annotations

import importlib
import os
import signal
import sys
import threading
import time
import types
from multiprocessing import connection


def _light_rl_package() -> None:
    """`jaxvrl.rl` as a package whose submodules import on their own; its `__init__` runs on
    the first read of a name it defines."""
    if "jaxvrl.rl" in sys.modules:
        return
    import jaxvrl

    path = os.path.join(os.path.dirname(jaxvrl.__file__), "rl")
    pkg = types.ModuleType("jaxvrl.rl")
    pkg.__path__ = [path]
    pkg.__package__ = "jaxvrl.rl"
    pkg.__file__ = os.path.join(path, "__init__.py")

    def __getattr__(name):  # noqa: N807 -- the module-level attribute hook
        if name.startswith("__"):
            raise AttributeError(name)
        with open(pkg.__file__, encoding="utf-8") as f:
            exec(compile(f.read(), pkg.__file__, "exec"), pkg.__dict__)
        del pkg.__dict__["__getattr__"]
        return getattr(pkg, name)

    pkg.__getattr__ = __getattr__
    sys.modules["jaxvrl.rl"] = pkg
    jaxvrl.rl = pkg


def _exit_with_parent(parent: int) -> None:
    """Ends this worker when the trainer is gone (a call that hangs would outlive it)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(1)


def main(fd: int) -> None:
    """Serve reward calls on the socket `fd` (jaxvrl/rl/reward_pool.py: serve): the first
    message holds the functions' specs, forms and keyword arguments."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    parent = os.getppid()
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    _light_rl_package()
    pool = importlib.import_module("jaxvrl.rl.reward_pool")
    conn = connection.Connection(fd)
    specs, forms, kwargs = conn.recv()
    pool.serve(conn, specs, forms, kwargs)
