"""Checkpoints: exact round trips of state, RNG, iterator state and metadata; latest step,
max_to_keep, save interval; abstract targets with shardings; SIGTERM; a GCS emulator."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxvrl.checkpoint import (
    Checkpointer,
    CheckpointError,
    PreemptionFlag,
    ProcessBytesHandler,
    stop_requested_everywhere,
    tree_keys,
)
from tests.trainer_infra.workers import HERE, needs_gcs, run_worker


class Tiny(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(3, 4, rngs=rngs)
        self.norm = nnx.LayerNorm(4, rngs=rngs)


def train_state(seed=0):
    """(params nnx.State, adam state, step, a bf16 leaf, a typed key leaf) like the trainer's."""
    model = Tiny(nnx.Rngs(seed))
    params = nnx.state(model, nnx.Param)
    tx = optax.adamw(1e-3)
    opt = tx.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    updates, opt = tx.update(grads, opt, params)
    params = optax.apply_updates(params, updates)
    return {
        "params": params,
        "opt_state": opt,
        "step": jnp.int32(5 + seed),
        "half": jnp.full((2, 2), 1.5 + seed, jnp.bfloat16),
        "key": jax.random.key(seed),
    }


def assert_trees_equal(a, b):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip_is_exact(tmp_path):
    state, rng = train_state(0), jax.random.split(jax.random.key(7))[1]
    meta = {"kl_coef": 0.0123, "counters": {"nonfinite": 2, "replayed": 7}}
    ck = Checkpointer(str(tmp_path / "ck"))
    assert ck.latest_step() is None and ck.restore_latest({"state": state}) is None
    counters = {"skipped": {"corrupt_image": ["a.jsonl:3"]}, "reward_failures": {"f": 2}}
    data_state = {"epoch": 1, "position": 17, "seed": 0}
    items = {"state": state, "rng": rng, "meta": meta, "data_state": data_state}
    assert ck.save(3, {**items, "counters": counters})
    ck.close()
    # a fresh manager (a new process would do the same), abstract target from eval_shape
    ck = Checkpointer(str(tmp_path / "ck"))
    abstract = jax.eval_shape(lambda: train_state(1))
    r = ck.restore_latest({"state": abstract})
    assert r.step == 3 and r.meta == meta and r["meta"] == meta
    assert r.data_state == {"epoch": 1, "position": 17, "seed": 0}
    assert r.counters == counters  # this process's running totals
    assert_trees_equal(r.state, state)
    assert isinstance(r.state["params"], nnx.State)
    assert r.state["half"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(jax.random.key_data(r.rng), jax.random.key_data(rng))
    assert jax.random.key_impl(r.rng) == jax.random.key_impl(rng)
    # concrete arrays as the target
    r2 = ck.restore_step(3, {"state": train_state(1)})
    assert_trees_equal(r2["state"], state)
    assert r2["meta"] == meta and r2.items.keys() == r.items.keys()
    ck.close()


def test_bytes_iterator_state_raw_rng_and_readable_keys(tmp_path):
    ck = Checkpointer(str(tmp_path))
    raw_rng = np.array([1, 2], np.uint32)  # jax.random.PRNGKey-style raw key data
    state = {"a": [jnp.arange(3), jnp.ones(2)], "b": {"c": jnp.zeros(())}}
    ck.save(1, {"state": state, "rng": raw_rng, "data_state": b'{"grain": "state"}'})
    r = ck.restore_step(1, {"state": state})
    assert r.data_state == b'{"grain": "state"}'
    assert r.rng.dtype == np.uint32 and list(np.asarray(r.rng)) == [1, 2]
    assert tree_keys(state) == ["a/0", "a/1", "b/c"]
    assert sorted(ck.manager.restore(1)["state"]) == ["a/0", "a/1", "b/c"]
    ck.save(2, {"state": state})  # no rng, metadata or counters (as checkpoints before them)
    r = ck.restore_latest({"state": state})
    assert r.rng is None and r.meta == {} and r.data_state is None and r.counters is None
    ck.close()


def test_replay_bytes_are_this_processs_and_committed_with_the_step(tmp_path, monkeypatch):
    state, blob = {"w": jnp.arange(3.0)}, bytes(range(256)) * 3
    ck = Checkpointer(str(tmp_path))
    ck.save(1, {"state": state, "replay": blob})
    ck.save(2, {"state": state})  # a run without a buffer, or a checkpoint from before it was
    assert ck.restore_step(1, {"state": state}).replay == blob
    assert ck.restore_step(2, {"state": state}).replay is None
    assert "0-of-1" in os.listdir(tmp_path / "1" / "replay")

    def disk_full(self, directory, data):
        raise OSError("disk full")

    monkeypatch.setattr(ProcessBytesHandler, "write", disk_full)
    with pytest.raises(OSError, match="disk full"):
        ck.save(3, {"state": state, "replay": blob})
    monkeypatch.undo()
    ck.close()
    ck = Checkpointer(str(tmp_path))  # a step whose buffer was not written is no step
    assert ck.all_steps() == [1, 2] and ck.restore_latest({"state": state}).step == 2
    replay = tmp_path / "1" / "replay"  # as if written by 2 processes
    os.rename(replay / "0-of-1", replay / "1-of-2")
    (replay / "0-of-2").write_bytes(blob)
    with pytest.raises(ValueError, match="replay buffers of 2 processes, this run has 1"):
        ck.restore_step(1, {"state": state})
    ck.close()


def test_latest_max_to_keep_and_interval(tmp_path):
    ck = Checkpointer(str(tmp_path), max_to_keep=2)
    for step in (1, 2, 3, 4):
        ck.save(step, {"state": {"x": jnp.full((2,), float(step))}})
    assert ck.all_steps() == [3, 4] and ck.latest_step() == 4
    target = {"state": {"x": jnp.zeros(2)}}
    assert float(ck.restore_latest(target).state["x"][0]) == 4.0
    assert float(ck.restore_step(3, target).state["x"][0]) == 3.0
    with pytest.raises(CheckpointError, match="no checkpoint for step 1"):
        ck.restore_step(1, target)
    ck.close()
    ck = Checkpointer(str(tmp_path / "every3"), save_interval_steps=3)
    saved = [s for s in range(1, 8) if ck.save(s, {"state": {"x": jnp.zeros(1)}})]
    assert saved == [3, 6] and ck.should_save(9) and not ck.should_save(8)
    assert ck.save(7, {"state": {"x": jnp.zeros(1)}}, force=True)  # e.g. on SIGTERM
    assert ck.all_steps() == [6, 7]
    ck.close()


def test_structure_mismatch_is_a_clear_error(tmp_path):
    ck = Checkpointer(str(tmp_path))
    ck.save(1, {"state": {"w": jnp.zeros(2), "b": jnp.zeros(1)}})
    with pytest.raises(CheckpointError, match=r"missing \['v'\], unexpected \['w'\]"):
        ck.restore_latest({"state": {"v": jnp.zeros(2), "b": jnp.zeros(1)}})
    # a name that is no checkpoint item (e.g. the state itself passed as the items)
    with pytest.raises(TypeError, match=r"unknown checkpoint items \['b', 'w'\]"):
        ck.save(2, {"w": jnp.zeros(2), "b": jnp.zeros(1)})
    with pytest.raises(TypeError, match=r"restore_step: unknown checkpoint items \['v'\]"):
        ck.restore_step(1, {"v": jnp.zeros(2)})
    with pytest.raises(ValueError, match="'state' is required"):
        ck.save(2, {"meta": {}})
    ck.close()


def test_restore_uses_the_target_sharding(tmp_path):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("fsdp",))
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
    ck = Checkpointer(str(tmp_path))
    ck.save(1, {"state": {"w": jnp.arange(4.0)}})
    target = {"w": jax.ShapeDtypeStruct((4,), jnp.float32, sharding=spec)}
    r = ck.restore_latest({"state": target})
    assert r.state["w"].sharding == spec
    np.testing.assert_array_equal(np.asarray(r.state["w"]), np.arange(4.0))
    ck.close()


def test_sigterm_sets_the_flag_and_restores_the_handler():
    before = signal.getsignal(signal.SIGTERM)
    with PreemptionFlag() as flag:
        assert not flag.requested and not stop_requested_everywhere(flag)
        os.kill(os.getpid(), signal.SIGTERM)
        assert flag.requested and flag.signal_name == "SIGTERM"
        assert stop_requested_everywhere(flag)
    assert signal.getsignal(signal.SIGTERM) == before


def test_sigterm_in_a_loop_saves_and_exits_cleanly(tmp_path):
    worker = os.path.join(HERE, "ckpt_worker.py")
    proc = subprocess.Popen(
        [sys.executable, worker, "sigterm", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "on SIGTERM" in out
    ck = Checkpointer(str(tmp_path))
    r = ck.restore_latest({"state": {"w": jnp.zeros(3)}})
    assert r.meta == {"stopped_by": "SIGTERM"}
    assert float(r.state["w"][0]) == r.step >= 1
    ck.close()


@needs_gcs
def test_gcs_round_trip_against_a_loopback_emulator():
    res = run_worker("ckpt_worker.py", "gcs", tail=3000)
    assert res["ok"] and res["step"] == 3
    assert res["meta"] == {"kl_coef": pytest.approx(0.3)} and res["data"] == {"pos": 3}
    assert res["listed"] == ["2", "3"]  # max_to_keep=2 deleted step 1 in the bucket
