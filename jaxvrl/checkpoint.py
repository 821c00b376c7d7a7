"""Orbax checkpoints: one step directory holds the train state (any pytree of arrays: params,
optimizer state, counters), the RNG key, the data-iterator state, each process's running
totals (JSON) and replay buffer (bytes) and JSON run metadata, in a local directory or under
`gs://`.

Layout of `<directory>/<step>/`: `state` (arrays, keyed by their readable tree path, e.g.
`params/model/layers/0/mlp/up_proj/kernel/value`), `rng` (key data), `meta` (the caller's
JSON), `data` (iterator state: JSON, or bytes from grain as base64), `counters` (the caller's
JSON running totals, one per process; absent in checkpoints written before it existed),
`replay` (one file per process, `<index>-of-<count>`: the caller's bytes, its replay buffer
encoded by jaxvrl/trainer/replay_state.py; absent when the run had no buffer or was written
before it was saved), `info` (tree paths and key implementations, to check a restore target
against). Every item, each process's replay file included, is written before orbax commits
the step (renames its temporary directory, or on gs:// writes its commit marker), so a step
that lacks one of them is never listed as complete.

Resume order (train.py): build the abstract train state (`jax.eval_shape` + shardings, or the
freshly initialised state), `restore_latest(abstract)` fills it with the saved arrays in the
target's shardings and dtypes, then the data iterator, the RNG, the running totals and the
replay buffer continue from their saved state. Every process calls save and restore (orbax
coordinates multi-host writes).
"""

from __future__ import annotations

import base64
import dataclasses
import os
import signal
import threading
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxvrl.parallel import runtime
from jaxvrl.remote import bound_remote_io, naming


class CheckpointError(ValueError):
    """A checkpoint that does not fit the restore target."""


@dataclasses.dataclass
class Restored:
    step: int
    state: Any  # the abstract target's structure, its shardings and dtypes
    rng: jax.Array | None
    meta: dict
    data_state: dict | bytes | None
    counters: dict | None = None  # this process's; None: the checkpoint has none
    replay: bytes | None = None  # this process's; None: the checkpoint has none


def _entry(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def tree_keys(tree) -> list[str]:
    """Readable '/'-joined tree path of each leaf, in jax.tree.leaves order."""
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    keys = ["/".join(_entry(k) for k in p) or "root" for p in paths]
    if len(set(keys)) != len(keys):  # e.g. a dict key "0" beside a list index 0
        keys = [f"{i:05d}:{k}" for i, k in enumerate(keys)]
    return keys


def _is_key(x) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _key_impl(x) -> str:
    return str(jax.random.key_impl(x))


def _to_saveable(x):
    return jax.random.key_data(x) if _is_key(x) else x


def _default_sharding():
    """Where a leaf without a sharding is restored: the first device in one process; fully
    replicated over every device with several processes (each must hold a copy)."""
    if jax.process_count() == 1:
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("all",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def _abstract_leaf(x, sharding=None):
    """-> ShapeDtypeStruct with a sharding (typed keys: their key data)."""
    sharding = sharding or getattr(x, "sharding", None) or _default_sharding()
    if _is_key(x):
        x = jax.eval_shape(jax.random.key_data, x)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def _process_file(index: int, count: int) -> str:
    return f"{index}-of-{count}"


class ProcessBytesHandler(ocp.AsyncCheckpointHandler):
    """An item of one file per process (orbax's JSON items are written by process 0 only):
    each process writes its own bytes and reads its own back. Written, like orbax's own
    items, after the step's temporary directory exists and before the step is committed."""

    def write(self, directory, data: bytes) -> None:
        name = _process_file(jax.process_index(), jax.process_count())
        (directory / name).write_bytes(bytes(data))

    async def async_save(self, directory, args: ProcessBytesSave):
        async def write():
            self.write(directory, args.data)

        return [ocp.future.CommitFutureAwaitingContractedSignals(write(), name="process_bytes")]

    def save(self, directory, args: ProcessBytesSave):
        self.write(directory, args.data)

    def restore(self, directory, args: ProcessBytesRestore | None = None) -> bytes:
        del args
        n, i = jax.process_count(), jax.process_index()
        path = directory / _process_file(i, n)
        if not path.exists():
            saved = sorted(p.name for p in directory.iterdir())
            counts = {int(s.rsplit("-of-", 1)[-1]) for s in saved if "-of-" in s}
            if len(counts) == 1 and counts != {n}:
                _check_process_count(counts.pop(), directory.parent.name, "replay buffers")
            raise CheckpointError(f"{path} is missing (saved: {saved})")
        return path.read_bytes()

    def metadata(self, directory):
        return None


@ocp.args.register_with_handler(ProcessBytesHandler, for_save=True)
@dataclasses.dataclass
class ProcessBytesSave(ocp.args.CheckpointArgs):
    data: bytes


@ocp.args.register_with_handler(ProcessBytesHandler, for_restore=True)
@dataclasses.dataclass
class ProcessBytesRestore(ocp.args.CheckpointArgs):
    pass


def _encode_one(data_state):
    if data_state is None:
        return {"kind": "none"}
    if isinstance(data_state, bytes | bytearray):
        return {"kind": "bytes", "value": base64.b64encode(bytes(data_state)).decode("ascii")}
    return {"kind": "json", "value": data_state}


def _decode_one(d):
    if d["kind"] == "bytes":
        return base64.b64decode(d["value"])
    return d.get("value")


def _encode_data_state(data_state):
    """Each process reads its own shard of the data, so every process's iterator state is kept
    (orbax writes JSON items from process 0 only): gathered here, a collective."""
    return {"kind": "per_process", "value": runtime.gather_json(_encode_one(data_state))}


def _this_process(states: list, step: int, what: str):
    _check_process_count(len(states), step, what)
    return states[jax.process_index()]


def _check_process_count(saved: int, step, what: str) -> None:
    n = jax.process_count()
    if saved != n:
        raise ValueError(
            f"checkpoint step {step} holds the {what} of {saved} processes, this run "
            f"has {n}: each process reads its own shard of the data, and the shards change "
            "with the process count. Resume with the same number of hosts, or start a new "
            "workdir from the weights (config.load_checkpoint_path)."
        )


def _decode_data_state(d, step: int):
    if d["kind"] != "per_process":  # written by a single process before per-process states
        return _decode_one(d)
    return _decode_one(_this_process(d["value"], step, "data-iterator states"))


class Checkpointer:
    """Keeps the last `max_to_keep` steps in `directory` (local path or gs://bucket/path)."""

    def __init__(
        self,
        directory: str,
        max_to_keep: int = 2,
        save_interval_steps: int = 1,
        async_save: bool = False,
    ):
        if "://" not in directory:
            directory = os.path.abspath(directory)
        bound_remote_io(directory)  # no request to gs:// waits forever
        self.directory = directory
        self.save_interval_steps = max(1, save_interval_steps)
        with naming(f"opening checkpoints in {directory}"):
            self.manager = ocp.CheckpointManager(
                directory,
                options=ocp.CheckpointManagerOptions(
                    max_to_keep=max_to_keep,
                    save_interval_steps=1,  # the interval is applied in save()
                    enable_async_checkpointing=async_save,
                    create=True,
                ),
            )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def should_save(self, step: int) -> bool:
        return step % self.save_interval_steps == 0 and step not in self.manager.all_steps()

    def save(
        self,
        step: int,
        state,
        rng: jax.Array | None = None,
        meta: dict | None = None,
        data_state: dict | bytes | None = None,
        force: bool = False,
        counters: dict | None = None,
        replay: bytes | None = None,
    ) -> bool:
        """Saves unless `step` is off the save interval (force: always); -> whether it saved.

        state: any pytree of arrays (typed PRNG keys allowed); rng: a typed key or raw uint32
        key data; meta: JSON-serialisable; data_state: the iterator's get_state() (a JSON
        dict, or bytes as grain returns); counters: this process's JSON running totals (every
        process passes its own, or none does: gathered, a collective); replay: this
        process's replay buffer as bytes (every process passes its own, or none does)."""
        if not force and step % self.save_interval_steps:
            return False  # (orbax would always save a first step, whatever the interval)
        leaves = jax.tree.leaves(state)
        arrays = dict(zip(tree_keys(state), (_to_saveable(x) for x in leaves)))
        info = {
            "keys": list(arrays),
            "key_impls": {k: _key_impl(x) for k, x in zip(arrays, leaves) if _is_key(x)},
            "rng_impl": _key_impl(rng) if rng is not None and _is_key(rng) else None,
            "rng_shape": None if rng is None else list(np.shape(_to_saveable(rng))),
        }
        items = {
            "state": ocp.args.StandardSave(arrays),
            "meta": ocp.args.JsonSave(dict(meta or {})),
            "data": ocp.args.JsonSave(_encode_data_state(data_state)),
            "info": ocp.args.JsonSave(info),
        }
        if counters is not None:
            from jaxvrl.parallel.runtime import gather_json

            items["counters"] = ocp.args.JsonSave({"per_process": gather_json(counters)})
        if replay is not None:
            items["replay"] = ProcessBytesSave(replay)
        if rng is not None:
            items["rng"] = ocp.args.StandardSave({"key_data": _to_saveable(rng)})
        with naming(f"saving checkpoint step {step} to {self.directory}"):
            saved = self.manager.save(step, args=ocp.args.Composite(**items), force=force)
        return bool(saved)

    def _check_keys(self, step: int, saved: list[str], wanted: list[str]) -> None:
        if saved == wanted:
            return
        missing = [k for k in wanted if k not in set(saved)]
        extra = [k for k in saved if k not in set(wanted)]
        raise CheckpointError(
            f"checkpoint {self.directory}/{step} does not match the restore target: "
            f"{len(saved)} saved arrays vs {len(wanted)} wanted; missing {missing[:5]}, "
            f"unexpected {extra[:5]}"
        )

    def restore_step(self, step: int, abstract_state, rng_sharding=None) -> Restored:
        """Restores `step` into abstract_state's structure, shardings and dtypes (its leaves:
        jax.ShapeDtypeStruct with sharding, or arrays). rng_sharding: where the RNG key goes
        (default: the first device, or replicated over all devices with several processes)."""
        if step not in self.manager.all_steps():
            raise CheckpointError(f"no checkpoint for step {step} in {self.directory}")
        json_items = ["info", "meta", "data"]
        saved_items = self.manager.item_metadata(step)
        if "counters" in saved_items:
            json_items.append("counters")
        where = f"restoring checkpoint step {step} from {self.directory}"
        with naming(where):
            head = self.manager.restore(
                step, args=ocp.args.Composite(**{k: ocp.args.JsonRestore() for k in json_items})
            )
        info = head["info"]
        leaves, treedef = jax.tree.flatten(abstract_state)
        keys = tree_keys(abstract_state)
        self._check_keys(step, info["keys"], keys)
        items = {"state": ocp.args.StandardRestore(dict(zip(keys, map(_abstract_leaf, leaves))))}
        if info["rng_shape"] is not None:
            target = jax.ShapeDtypeStruct(tuple(info["rng_shape"]), np.uint32)
            rng_target = _abstract_leaf(target, rng_sharding)
            items["rng"] = ocp.args.StandardRestore({"key_data": rng_target})
        if "replay" in saved_items:
            items["replay"] = ProcessBytesRestore()
        with naming(where):
            out = self.manager.restore(step, args=ocp.args.Composite(**items))
        arrays = out["state"]
        restored = []
        for k in keys:
            x = arrays[k]
            impl = info["key_impls"].get(k)
            restored.append(jax.random.wrap_key_data(x, impl=impl) if impl else x)
        rng = None
        if "rng" in items:
            rng = out["rng"]["key_data"]
            if info["rng_impl"]:
                rng = jax.random.wrap_key_data(rng, impl=info["rng_impl"])
        return Restored(
            step=step,
            state=jax.tree.unflatten(treedef, restored),
            rng=rng,
            meta=dict(head["meta"]),
            data_state=_decode_data_state(head["data"], step),
            counters=(
                _this_process(head["counters"]["per_process"], step, "running totals")
                if "counters" in head
                else None
            ),
            replay=out["replay"] if "replay" in items else None,
        )

    def restore_latest(self, abstract_state, rng_sharding=None) -> Restored | None:
        """The latest step restored into abstract_state, or None when there is none."""
        step = self.latest_step()
        if step is None:
            return None
        return self.restore_step(step, abstract_state, rng_sharding)

    def restore(self, step: int, abstract_state, rng_impl=None):
        """-> (state, rng, meta): restore_step's parts for callers that keep the iterator
        state inside meta. rng_impl: unused, the saved key implementation is used."""
        del rng_impl
        r = self.restore_step(step, abstract_state)
        return r.state, r.rng, r.meta

    def wait_until_finished(self) -> None:
        with naming(f"finishing the checkpoints in {self.directory}"):
            self.manager.wait_until_finished()

    def close(self) -> None:
        with naming(f"finishing the checkpoints in {self.directory}"):
            self.manager.wait_until_finished()
            self.manager.close()


class PreemptionFlag:
    """Set by SIGTERM (TPU VM / spot preemption): the loop checks `requested` after each step,
    saves a checkpoint and exits cleanly. `restore()` puts the previous handlers back."""

    def __init__(self, signals=(signal.SIGTERM,)):
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("install_preemption_handler() must be called from the main thread")
        self.requested = False
        self.signal_name: str | None = None
        self._previous = {s: signal.signal(s, self._handle) for s in signals}

    def _handle(self, signum, frame):
        del frame
        self.requested = True
        self.signal_name = signal.Signals(signum).name

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.restore()


def install_preemption_handler(signals=(signal.SIGTERM,)) -> PreemptionFlag:
    """Installs handlers for `signals` that only set a flag; returns the flag."""
    return PreemptionFlag(signals)


def stop_requested_everywhere(flag: PreemptionFlag) -> bool:
    """True on every process when any process got the signal (call at the same step on all
    processes: a preempted host must not save alone)."""
    return runtime.any_process(flag.requested)
