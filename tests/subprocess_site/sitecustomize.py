"""Imported by every Python process the tests start (this folder is on their PYTHONPATH,
tests/conftest.py): the 8-device programs, the checkpoint and multi-host workers, the main
job under SIGTERM. Their cyclic garbage collector runs as seldom as the pytest workers' does:
tracing allocates many short-lived objects, and each full collection walks the whole heap."""

import gc

gc.set_threshold(50_000, 20, 20)
