"""Orbax checkpoints: one step directory holds the train state (any pytree of arrays: params,
optimizer state, counters), the RNG key, the data-iterator state, each process's running
totals (JSON) and replay buffer (bytes) and JSON run metadata, in a local directory or under
`gs://`.

Layout of `<directory>/<step>/`: `state` (arrays, keyed by their readable tree path),
`rng` (key data), `meta` (the caller's JSON), `data` (iterator state: JSON, or grain's bytes
as base64), `counters` (running totals, one per process), `replay` (one file per process,
`<index>-of-<count>`: the replay buffer's bytes, jaxvrl/trainer/replay_state.py), `info`
(tree paths and key implementations, to check a restore target against). Every item is
written before orbax commits the step, so a step that lacks one is never listed as complete.

A step whose files were damaged afterwards (missing, cut short, not decodable) is skipped by
`restore_latest`: named in a warning and moved aside to `<step>.damaged` (orbax lists integer
names only, so it is neither restored nor counted by max_to_keep, and the step can be saved
again), and the newest step that reads back is restored.

Resume order (train.py): build the abstract train state (`jax.eval_shape` + shardings, or the
freshly initialised state), `restore_latest(abstract)` fills it with the saved arrays in the
target's shardings and dtypes, then the data iterator, the RNG, the running totals and the
replay buffer continue from their saved state. Every process calls save and restore (orbax
coordinates multi-host writes).
"""

from __future__ import annotations

import base64
import dataclasses
import gc
import json
import logging
import os
import signal
import sys
import threading
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from jaxvrl.parallel import runtime
from jaxvrl.remote import bound_remote_io, forget_listings, is_remote, naming

log = logging.getLogger("jaxvrl")


class CheckpointError(ValueError):
    """A checkpoint that does not fit the restore target."""


class DamagedCheckpoint(CheckpointError):
    """A step whose files are missing, cut short or not decodable (`what`: the item and the
    failure, in one line)."""

    def __init__(self, step: int, directory: str, what: str):
        super().__init__(f"checkpoint step {step} in {directory} is damaged ({what})")
        self.step, self.what = step, what


# tensorstore's status codes for data that is absent, cut short or not decodable; the others
# (PERMISSION_DENIED, UNAVAILABLE, DEADLINE_EXCEEDED, ...) say nothing about the files
_DAMAGE_CODES = ("NOT_FOUND", "OUT_OF_RANGE", "DATA_LOSS", "FAILED_PRECONDITION")
_DAMAGE_TYPES = (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError, KeyError)


def _damage(e: BaseException | None) -> str | None:
    """What a failure to read a step says about its files, in one line; None when it shows
    no damage (a permission, the network, a target that does not fit: raised as is, so that
    no good step is ever moved aside). The cause chain is searched: orbax wraps tensorstore's
    errors in a bare Exception."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        text = str(e).split("\n", 1)[0].split(" [tensorstore_spec=", 1)[0]
        if isinstance(e, _DAMAGE_TYPES):
            return f"{type(e).__name__}: {text}"[:400]
        if isinstance(e, ValueError) and text.startswith(_DAMAGE_CODES):
            return text[:400]
        e = e.__cause__ or e.__context__
    return None


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
            raise FileNotFoundError(f"{path} is missing (saved: {saved})")
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


def _drop_failed_reads() -> None:
    """Collects the array reads orbax left unfinished when one of them failed, without the
    "Exception ignored" report each would print when collected later (orbax turns the
    GeneratorExit that closes them into an Exception naming the whole TensorStore spec)."""
    hook = sys.unraisablehook

    def quiet(u):
        if "Encountered error while reading array index" not in str(u.exc_value):
            hook(u)

    sys.unraisablehook = quiet
    try:
        gc.collect()
    finally:
        sys.unraisablehook = hook


def _sync_processes(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


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

    def _item(self, step: int, name: str, args=None):
        """Item `name` of `step` restored with `args` (None: the names of the step's items,
        listed rather than read from orbax's metadata, which warns about each item it has no
        handler for). A failure that shows the files damaged raises DamagedCheckpoint naming
        the item; any other is raised as is."""
        try:
            if args is None:
                return {p.name for p in (epath.Path(self.directory) / str(step)).iterdir()}
            return self.manager.restore(step, args=ocp.args.Composite(**{name: args}))[name]
        except Exception as e:
            what = _damage(e)
            if what is None:
                with naming(f"restoring checkpoint step {step} from {self.directory}"):
                    raise
        _drop_failed_reads()
        raise DamagedCheckpoint(step, self.directory, f"{name}: {what}")

    def restore_step(self, step: int, abstract_state, rng_sharding=None) -> Restored:
        """Restores `step` into abstract_state's structure, shardings and dtypes (its leaves:
        jax.ShapeDtypeStruct with sharding, or arrays). rng_sharding: where the RNG key goes
        (default: the first device, or replicated over all devices with several processes).
        Raises DamagedCheckpoint when an item's files are missing, cut short or unreadable,
        CheckpointError when the step does not fit the target."""
        if step not in self.manager.all_steps():
            raise CheckpointError(f"no checkpoint for step {step} in {self.directory}")
        saved_items = self._item(step, "its items")
        json_items = ["info", "meta", "data"] + (["counters"] if "counters" in saved_items else [])
        head = {k: self._item(step, k, ocp.args.JsonRestore()) for k in json_items}
        info = head["info"]
        leaves, treedef = jax.tree.flatten(abstract_state)
        keys = tree_keys(abstract_state)
        self._check_keys(step, info["keys"], keys)
        target = dict(zip(keys, map(_abstract_leaf, leaves)))
        arrays = self._item(step, "state", ocp.args.StandardRestore(target))
        restored = []
        for k in keys:
            x = arrays[k]
            impl = info["key_impls"].get(k)
            restored.append(jax.random.wrap_key_data(x, impl=impl) if impl else x)
        rng = None
        if info["rng_shape"] is not None:
            shape = jax.ShapeDtypeStruct(tuple(info["rng_shape"]), np.uint32)
            rng_target = {"key_data": _abstract_leaf(shape, rng_sharding)}
            rng = self._item(step, "rng", ocp.args.StandardRestore(rng_target))["key_data"]
            if info["rng_impl"]:
                rng = jax.random.wrap_key_data(rng, impl=info["rng_impl"])
        replay = None
        if "replay" in saved_items:
            replay = self._item(step, "replay", ProcessBytesRestore())
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
            replay=replay,
        )

    def restore_latest(self, abstract_state, rng_sharding=None) -> Restored | None:
        """The newest step that reads back, restored into abstract_state; None when there is
        no step. Each newer step whose files are damaged (on any process) is named in one
        warning and moved aside (`_move_aside`); when no step reads back, nothing is moved and
        CheckpointError names each step's damage."""
        damaged: list[DamagedCheckpoint] = []
        for step in reversed(self.all_steps()):
            try:
                restored, failed = self.restore_step(step, abstract_state, rng_sharding), None
            except DamagedCheckpoint as e:
                failed = e
            # every process resumes from the same step (a collective with several)
            if not runtime.any_process(failed is not None):
                break
            damaged.append(failed or DamagedCheckpoint(step, self.directory, "on another host"))
        else:
            if damaged:
                raise CheckpointError(
                    f"no checkpoint in {self.directory} reads back (none was moved): "
                    + "; ".join(f"step {e.step}: {e.what}" for e in damaged)
                )
            return None
        for e in damaged:
            aside = self._move_aside(e.step)
            log.warning("%s: moved to %s; resuming from step %d", e, aside, restored.step)
        return restored

    def _move_aside(self, step: int) -> str:
        """Renames `<directory>/<step>` to `<step>.damaged` (`.damaged-2`, ... when taken) on
        process 0, then every process lists the steps again: orbax lists integer names only,
        so it neither restores nor garbage-collects the damaged copy, and `step` can be saved
        again. -> the new path. On gs:// a move is a copy, then a delete (one cut short leaves
        the step to be found damaged again)."""
        import fsspec

        fs, root = fsspec.core.url_to_fs(self.directory)
        n, name = 1, f"{step}.damaged"
        while fs.exists(f"{root}/{name}"):
            n += 1
            name = f"{step}.damaged-{n}"
        _sync_processes(f"jaxvrl_move_aside_{step}")  # every process chose `name` first
        if jax.process_index() == 0:
            src, dst = f"{root}/{step}", f"{root}/{name}"
            with naming(f"moving {self.directory}/{step} aside to {name}"):
                if is_remote(self.directory):  # (gcsfs's mv tries an API not every bucket has)
                    fs.copy(src, dst, recursive=True)
                    fs.rm(src, recursive=True)
                else:
                    os.rename(src, dst)
        _sync_processes(f"jaxvrl_moved_aside_{step}")
        forget_listings()  # gcsfs would answer from its cached listing of the directory
        self.manager.reload()
        return f"{self.directory}/{name}"

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


# The settings in `<workdir>/run.json` (train.run_info) that a workdir's checkpoints depend
# on: run.json key ('.' into the lora dict) -> the config key it records.
SAVED_WITH = {
    "model_path": "model.path",
    "builtin_task": "data.builtin_task",  # the embedded checkpoint when model.path is unset
    "param_dtype": "model.param_dtype",
    "scan_layers": "model.scan_layers",
    **{f"lora.{k}": f"lora.{k}" for k in ("rank", "alpha", "target_modules", "quantize")},
    "lora.train_vision": "lora.train_vision",
}


def _settings(info: dict) -> dict:
    """run.json contents -> {SAVED_WITH key: value as JSON holds it (paths without a trailing
    '/')}."""
    flat = {**info, **{f"lora.{k}": v for k, v in (info.get("lora") or {}).items()}}
    flat = json.loads(json.dumps({k: flat[k] for k in SAVED_WITH if k in flat}))
    return {k: v.rstrip("/") if isinstance(v, str) else v for k, v in flat.items()}


def saved_with_other_settings(workdir: str, info: dict) -> str | None:
    """How the run that saved `<workdir>/checkpoints` (local or gs://) was set up otherwise
    than this one (`info`: what this run writes to run.json): '<config key>=<saved>, this
    run has <this>' for the first SAVED_WITH setting that differs. None when none does, or
    there is no checkpoint or no `<workdir>/run.json`; a setting the saved run.json lacks
    (written before it was recorded) is not compared."""
    import fsspec

    bound_remote_io(workdir)
    fs, root = fsspec.core.url_to_fs(workdir)
    ckpts, path = f"{root.rstrip('/')}/checkpoints", f"{root.rstrip('/')}/run.json"
    with naming(f"reading {workdir}/run.json"):
        listed = fs.ls(ckpts, detail=False) if fs.isdir(ckpts) else []
        steps = [p for p in listed if p.rstrip("/").rsplit("/", 1)[-1].isdigit()]
        if not steps or not fs.exists(path):
            return None
        saved = _settings(json.loads(fs.cat_file(path)))
    now = _settings(info)
    for k, key in SAVED_WITH.items():
        if k in saved and saved[k] != now.get(k):
            return f"{key}={saved[k]}, this run has {now.get(k)}"
    return None


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
