"""The parallel tests' runner of code in a subprocess with simulated CPU devices (the batches
and step settings they train on: tests/helpers.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def device_flags(n: int) -> str:
    """XLA_FLAGS for a subprocess with n simulated CPU devices (keeping this process's flags).

    XLA's CPU scheduler for concurrency let the simulated devices of a scanned train step
    (collectives inside the layer loop) enter two independent collectives in different orders
    and wait on each other for ever (a rendezvous timeout on 2 cores); scheduled in order, they
    never do."""
    own = os.environ.get("XLA_FLAGS", "")
    return (
        f"{own} --xla_force_host_platform_device_count={n} "
        "--xla_cpu_enable_concurrency_optimized_scheduler=false"
    ).strip()


# XLA's CPU runtime ends the process when simulated devices wait on different collectives
STUCK = "Termination timeout for"


def run_with_devices(code: str, n: int = 8, timeout: int = 600) -> str:
    """Run `code` in a fresh python with n simulated CPU devices (the count is fixed when jax
    starts, so it cannot be changed inside the pytest process).

    Run up to twice more where XLA's CPU runtime gave up on a collective (`STUCK`): its executor
    may start two independent collectives of a program in different orders on different
    simulated devices (seen about once in four runs of a sharded TPRL step on 2 cores), which
    then wait on each other. A fault of ours (devices that disagree on their collectives)
    is stuck every time and still fails."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = device_flags(n)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    for _ in range(3):
        res = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
            timeout=timeout,
        )
        if res.returncode == 0 or STUCK not in res.stderr:
            break
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    return res.stdout


def tiny_model_report(script: str, tmp_path_factory, name: str) -> dict:
    """`script` (it reads the model's path as `sys.argv[1]`) run on 8 devices with a tiny
    Qwen2.5-VL saved for it; the JSON it prints after "REPORT"."""
    import json

    from tests.models import hf_tiny

    path = tmp_path_factory.mktemp(name)
    hf_tiny.build(path, seed=3)
    out = run_with_devices(script.replace("sys.argv[1]", repr(str(path))), n=8)
    return json.loads(out.split("REPORT")[-1])
