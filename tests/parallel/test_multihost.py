"""Multi-host on one machine: 2 processes x 4 simulated CPU devices joined by
jax.distributed.initialize (from config). Each process passes only its own rows to
`place_batch`; the 2-step losses and parameters equal one device's; an orbax checkpoint is
written by both processes and restored by both into the sharded state, each getting back its
own data-iterator state and replay buffer bytes; the markdown samples hold both processes'
rows; one-step-off's weight copy moves every weight exactly from the train step's devices to
the sampler's on both hosts; both samplers narrowed over both processes sample their rows as
they do whole, and each process reads back its own rows; the processes agree on the shapes of
the prompt batches they collate, and each process's share of a packing plan is its rows'
wherever the mesh puts them; partial rollouts carry each process's rows through sampler
calls over both, each token's log-prob that of its own prompt under the policy that sampled
it, with the pod's counts logged.

What a real pod adds and this cannot test: TPU/GPU interconnect collectives, the platform's
auto-detected coordinator (TPU metadata, SLURM), a gs:// workdir shared by hosts, preemption.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxvrl.models import qwen2_5_vl as q
from jaxvrl.trainer.step import TrainState, make_train_step
from tests.helpers import make_batch, step_config
from tests.models import hf_tiny as T
from tests.parallel.common import ROOT, device_flags


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_one_device(tmp_path):
    ckpt = tmp_path / "model"
    T.build(ckpt, seed=3)
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    env["XLA_FLAGS"] = device_flags(4)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.parallel.multihost_worker", str(i), str(port)]
            + [str(ckpt), str(tmp_path)],
            cwd=ROOT,
            env=env,
            stdout=open(tmp_path / f"worker{i}.log", "w"),  # a file: a pipe could fill and block
            stderr=subprocess.STDOUT,
        )
        for i in range(2)
    ]
    deadline = time.time() + 600
    try:  # a failed process leaves its peer waiting in a collective: stop at the first failure
        while any(p.poll() is None for p in procs) and time.time() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    results = []
    for i, p in enumerate(procs):
        out = (tmp_path / f"worker{i}.log").read_text()
        assert p.wait() == 0, out[-4000:]
        results.append(json.loads(out.split("RESULT")[-1].splitlines()[0]))

    # one device, same batches and keys
    model = q.load(ckpt)
    graphdef, params = nnx.split(model, nnx.Param)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.05, momentum=0.9))
    cfg = step_config({"actor.use_kl_loss": True, "actor.kl_loss_coef": 0.1})
    ref = jax.tree.map(jnp.copy, params)
    state = TrainState(params, tx.init(params), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))
    step = make_train_step(graphdef, tx, cfg)
    losses = []
    for seed in range(2):
        batch = jax.tree.map(
            jnp.asarray, make_batch(model, 4, seed, pools=False, completion_seed=seed + 1000)
        )
        state, m, _ = step(state, ref, batch, jax.random.key(seed))
        losses.append(float(m["loss"]))

    # float32, only the reduction order differs (see test_mesh_step.py)
    for r in results:
        # token means of +-A (order one) plus KL: tolerance on the terms' scale
        np.testing.assert_allclose(r["losses"], losses, rtol=1e-5, atol=1e-5)
        assert r["restored_equal"] and r["restored_sharding"] and r["restored_step"] == 2
        assert r["rng_equal"] and r["data_state_equal"] and r["replay_equal"]
        assert r["any_process"] == [True, False]
        assert r["sizes"] == {"width": 64, "images": 16, "videos": 0}
        assert r["copied"] == [True, True]  # one-step-off's weight copy across hosts
        # both samplers narrowed over the two processes (8 rows of 1 to 6 tokens, 6 steps:
        # 48 rows x steps whole) sample each process's rows as they do whole, and each
        # process reads back its own 4 rows (the slots engine's were every row, process 0's
        # first, on both)
        for same, diff, work, mine in r["narrowed"]:
            assert same and diff < 1e-5 and 21 <= work < 48 and mine == 4, r["narrowed"]
        assert r["plans"] == [True, True]  # packing plans in the mesh's row order
        # rollout.slots=auto: the least memory any process's devices report, on both
        assert r["slots"] == results[0]["slots"] and r["slots"][0] == r["slots"][1], r["slots"]
        want = {"a": 5.0 / 3.0, "n_failures": 2.0, "attn/x": 2.0}  # float32 on the wire
        assert r["metrics"] == pytest.approx(want, rel=1e-6)
        assert r["uneven"] == {"a": 1.5, "only0": 5.0, "only1": 6.0, "b": 7.0}
    # partial rollouts over both processes: each trains its group every step, every token's
    # log-prob is its own prompt's under the version that sampled it (1e-4: a carried row's
    # prefill against one teacher-forced pass, test_partial.py), the metrics are the pod's
    pods = [r["partial"] for r in results]
    for p in pods:
        assert p["trained"] == [1, 1, 1, 1] and p["err"] < 1e-4, p
    here = np.asarray([[m.pop("carried_here") for m in p["metrics"]] for p in pods])
    assert pods[0]["metrics"] == pods[1]["metrics"]
    carried = [m["rollout/carried_rows"] for m in pods[0]["metrics"]]
    assert carried == here.sum(0).tolist() and sum(carried) > 0, (carried, here)
    assert sum(p["mixed"] for p in pods) > 0  # rows spanned two versions
    # the processes' shares of the decode work add up to the pod's 2 slots x its steps
    work = np.asarray([p["work"] for p in pods])  # [process, step, (work, steps)]
    np.testing.assert_array_equal(work[:, :, 0].sum(0), 2 * work[0, :, 1])
    # the markdown samples hold both processes' rows, in turn (process 0 wrote them)
    md = (tmp_path / "logs" / "rollout_results.md").read_text()
    order = [md.index(f"answer of process {p}, sample {j}") for j in range(2) for p in range(2)]
    assert order == sorted(order), md
    att = (tmp_path / "logs" / "attention_diagnostics.md").read_text()
    assert "1.5" in att and "0.5" in att, att
    got = np.load(tmp_path / "params.npz")
    for path, v in nnx.to_flat_state(state.params):
        np.testing.assert_allclose(got[".".join(map(str, path))], v.get_value(), atol=1e-6)
