"""What the gs:// tests share: the mark that skips them without the emulator's packages, and
running one of this directory's worker scripts in a fresh python (the emulator and gcsfs's
event loop live and die with it) and reading the JSON it prints last."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

needs_gcs = pytest.mark.skipif(
    not (importlib.util.find_spec("gcsfs") and importlib.util.find_spec("gcp_storage_emulator")),
    reason="needs gcsfs and gcp-storage-emulator (pip install '.[test]')",
)


def run_worker(script: str, *args: str, timeout: int = 300, env=None, tail: int = 4000) -> dict:
    """Runs tests/trainer_infra/<script> with args; fails the test with the end of its stderr
    when it exits non-zero or runs past `timeout` seconds; -> its last stdout line as JSON."""
    try:
        proc = subprocess.run(
            [sys.executable, os.path.join(HERE, script), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
            env=env,
        )
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else e.stderr or ""
        pytest.fail(f"{script} did not finish in {e.timeout} s:\n{err[-tail:]}")
    assert proc.returncode == 0, proc.stderr[-tail:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
