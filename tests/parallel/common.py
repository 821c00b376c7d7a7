"""Shared pieces of the parallel tests: a hand-made rollout batch on the tiny HF checkpoint
(tests/models/hf_tiny.py) and the 8-device subprocess runner."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np

from tests.models import hf_tiny as T

G = 2  # completions per prompt
N = 5  # completion length
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_prompts(model, prompts: int = 4, seed: int = 0) -> dict:
    """`prompts` x G left-padded rows, each with its own image (per-row vision layout): the
    sampler's inputs (numpy leaves, rows first; position_ids int[3, B, P])."""
    from jaxvrl.models import qwen2_5_vl as q

    rng = np.random.default_rng(seed)
    grid_choices = ([[1, 4, 4]], [[1, 2, 6]], [[1, 2, 4]], [[1, 4, 2]])
    rows, vis, grids = [], [], []
    for i in range(prompts):
        g = grid_choices[i % len(grid_choices)]
        p = T.prompt(rng, images=g, text_len=(3, 6))
        pv = T.patches(rng, g)
        for _ in range(G):
            rows.append(p)
            grids.append(g)
            vis.append(q.vision_inputs(pv, g, model.config.vision, num_patches=16))
    ids, mask = T.left_pad(rows, length=26)
    pos, deltas = q.get_rope_index(ids, mask, model.config, np.concatenate(grids))
    return dict(
        input_ids=ids.astype(np.int32),
        attention_mask=mask.astype(np.int32),
        position_ids=np.asarray(pos, np.int32),
        deltas=np.asarray(deltas, np.int32),
        images=q.stack_vision_inputs(vis),
    )


def make_batch(model, prompts: int = 4, seed: int = 0):
    """A RolloutBatch on `make_prompts` rows: random completions of unequal length and random
    rewards (numpy leaves)."""
    from jaxvrl.trainer.rollout import assemble

    p = make_prompts(model, prompts, seed)
    rng = np.random.default_rng(seed + 1000)
    b = p["input_ids"].shape[0]
    tokens = rng.integers(20, 280, (b, N))
    comp = np.ones((b, N), np.float32)
    comp[1, 3:] = 0  # an EOS at position 2
    comp[-1, 1:] = 0
    return assemble(
        p["input_ids"],
        p["attention_mask"],
        p["position_ids"],
        p["deltas"],
        tokens,
        comp,
        rng.normal(size=b),
        np.ones(b, bool),
        images=p["images"],
    )


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


def run_with_devices(code: str, n: int = 8, timeout: int = 600) -> str:
    """Run `code` in a fresh python with n simulated CPU devices (the count is fixed when jax
    starts, so it cannot be changed inside the pytest process)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = device_flags(n)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=timeout,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    return res.stdout
