"""Orbax checkpoints of the run state, in a local directory or under `gs://`: each step holds
the items of jaxvrl/checkpoint_items.py (the train state's arrays, the RNG key, each process's
data-iterator state, running totals and replay buffer, the trainer's JSON metadata), one
directory each (`<directory>/<step>/<item>`), and `info` (tree paths and key implementations,
to check a restore target against). `save(step, items)` takes them by item name;
`restore_step(step, targets)` and `restore_latest(targets)` give them back by name
(`Restored`), each filled into its target where it has one: the abstract train state for
`state`, a sharding for `rng`. Every item is written before orbax commits the step, so a step
that lacks one is never listed as complete.

A step whose files were damaged afterwards (missing, cut short, not decodable) is skipped by
`restore_latest`: named in one warning and moved aside to `<step>.damaged` (orbax lists
integer names only, so it is neither restored nor counted by max_to_keep, and the step can be
saved again), and the newest step that reads back is restored.

Resume order (train.py): build the abstract train state (`jax.eval_shape` + shardings, or the
freshly initialised state), `restore_latest({"state": abstract, ...})` fills it with the saved
arrays in the target's shardings and dtypes, then the data iterator, the RNG, the running
totals and the replay buffer continue from their saved state. Every process calls save and
restore (orbax coordinates multi-host writes).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from jaxvrl.checkpoint_items import (
    INFO,
    ITEMS,
    At,
    CheckpointError,
    ProcessBytesHandler,
    check_names,
    item_named,
    tree_keys,
)
from jaxvrl.parallel import runtime
from jaxvrl.remote import bound_remote_io, forget_listings, is_remote, naming

log = logging.getLogger("jaxvrl")

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "DamagedCheckpoint",
    "ProcessBytesHandler",
    "Restored",
    "tree_keys",
]


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


@dataclasses.dataclass(frozen=True)
class Restored:
    """A restored step: `items` maps each item name (checkpoint_items.ITEMS) to its value,
    None for an optional item the step does not hold; `r[name]` and `r.name` read it."""

    step: int
    items: Mapping[str, Any]

    def __getitem__(self, name: str):
        return self.items[name]

    def __getattr__(self, name: str):
        try:
            return self.__dict__["items"][name]
        except KeyError:
            raise AttributeError(name) from None


async def _with_its_reads(coro):
    """`coro`, then every task it started (awaited to the end, their errors collected)."""
    before = asyncio.all_tasks()
    try:
        return await coro
    finally:
        started = asyncio.all_tasks() - before - {asyncio.current_task()}
        if started:
            await asyncio.gather(*started, return_exceptions=True)


@contextlib.contextmanager
def _reads_finished():
    """orbax runs a restore's reads in an event loop of its own and closes the loop as soon as
    one read fails: the reads still in flight then finish on tensorstore's threads against the
    closed loop, each printing a traceback ('Event loop is closed'; one per array when the
    arrays' index file is cut short), some while later steps are read. Inside this block the
    coroutine orbax runs returns only after every read it started has finished, so a damaged
    step shows as its one warning. Nothing is muted: a good read leaves nothing running."""
    try:
        from orbax.checkpoint._src import asyncio_utils
    except ImportError:  # another orbax: its reads as they are
        asyncio_utils = None
    run_sync = getattr(asyncio_utils, "run_sync", None)
    if run_sync is None:
        yield
        return
    asyncio_utils.run_sync = lambda coro: run_sync(_with_its_reads(coro))
    try:
        yield
    finally:
        asyncio_utils.run_sync = run_sync


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


@contextlib.contextmanager
def _quiet_absl():
    """orbax warns (through absl) about read-only managers and item directories without
    step metadata: both expected when a run's checkpoints are only read."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _sync_processes(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


class Checkpointer:
    """Keeps the last `max_to_keep` steps in `directory` (local path or gs://bucket/path).
    read_only: lists and reads what is there (nothing is created, saved or deleted)."""

    def __init__(
        self,
        directory: str,
        max_to_keep: int = 2,
        save_interval_steps: int = 1,
        async_save: bool = False,
        read_only: bool = False,
    ):
        if "://" not in directory:
            directory = os.path.abspath(directory)
        bound_remote_io(directory)  # no request to gs:// waits forever
        self.directory = directory
        self.save_interval_steps = max(1, save_interval_steps)
        self.read_only = read_only
        quiet = _quiet_absl() if read_only else contextlib.nullcontext()
        with naming(f"opening checkpoints in {directory}"), quiet:
            self.manager = ocp.CheckpointManager(
                directory,
                options=ocp.CheckpointManagerOptions(
                    max_to_keep=max_to_keep,
                    save_interval_steps=1,  # the interval is applied in save()
                    enable_async_checkpointing=async_save,
                    create=not read_only,
                    read_only=read_only,
                ),
            )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def should_save(self, step: int) -> bool:
        return step % self.save_interval_steps == 0 and step not in self.manager.all_steps()

    def save(self, step: int, items: Mapping[str, Any], force: bool = False) -> bool:
        """Saves `items` (item name -> value, checkpoint_items.ITEMS) as `step` unless it is
        off the save interval (force: always); -> whether it saved.

        state: any pytree of arrays (typed PRNG keys allowed), required; rng: a typed key or
        raw uint32 key data; meta: JSON-serialisable dict; data_state: this process's
        iterator get_state() (a JSON dict, or bytes as grain returns; gathered, a
        collective); counters: this process's JSON running totals (every process passes its
        own, or none does: gathered, a collective); replay: this process's replay buffer as
        bytes (every process passes its own, or none does). An optional item left out or
        None is not written."""
        check_names(items, "Checkpointer.save")
        if not force and step % self.save_interval_steps:
            return False  # (orbax would always save a first step, whatever the interval)
        info, args = {}, {}
        for it in ITEMS:
            value = items.get(it.name)
            info.update(it.kind.info(it, value))
            if value is not None or not it.optional:
                args[it.directory] = it.kind.save_args(it, value)
        args[INFO] = ocp.args.JsonSave(info)
        with naming(f"saving checkpoint step {step} to {self.directory}"):
            saved = self.manager.save(step, args=ocp.args.Composite(**args), force=force)
        return bool(saved)

    def _read(self, step: int, name: str, args=None):
        """Item directory `name` of `step` restored with `args` (None: the names of the step's
        items, listed rather than read from orbax's metadata, which warns about each item it
        has no handler for). A failure that shows the files damaged raises DamagedCheckpoint
        naming the item; any other is raised as is."""
        try:
            if args is None:
                return {p.name for p in (epath.Path(self.directory) / str(step)).iterdir()}
            with _reads_finished():
                return self.manager.restore(step, args=ocp.args.Composite(**{name: args}))[name]
        except Exception as e:
            what = _damage(e)
            if what is None:
                with naming(f"restoring checkpoint step {step} from {self.directory}"):
                    raise
        _drop_failed_reads()
        raise DamagedCheckpoint(step, self.directory, f"{name}: {what}")

    def restore_step(self, step: int, targets: Mapping[str, Any] | None = None) -> Restored:
        """Restores `step`'s items, each into its target in `targets` (item name -> target):
        `state` needs its abstract tree (leaves: jax.ShapeDtypeStruct with sharding, or
        arrays), filled in its structure, shardings and dtypes; `rng` takes a sharding
        (default: the first device, or replicated over all devices with several processes).
        Raises DamagedCheckpoint when an item's files are missing, cut short or unreadable,
        CheckpointError when the step does not fit the target."""
        targets = dict(targets or {})
        check_names(targets, "Checkpointer.restore_step")
        if step not in self.manager.all_steps():
            raise CheckpointError(f"no checkpoint for step {step} in {self.directory}")
        at = At(self.directory, step)
        listed = self._read(step, "its items")
        info = self._read(step, INFO, ocp.args.JsonRestore())
        values = {}
        for it in ITEMS:
            target = targets.get(it.name)
            if it.optional and not it.kind.saved(it, info, listed):
                values[it.name] = None
                continue
            read = self._read(step, it.directory, it.kind.restore_args(it, info, target, at))
            values[it.name] = it.kind.value(it, read, info, target, at)
        return Restored(step, values)

    def restore_latest(self, targets: Mapping[str, Any] | None = None) -> Restored | None:
        """The newest step that reads back, restored into `targets` (as restore_step); None
        when there is no step. Each newer step whose files are damaged (on any process) is
        named in one warning and moved aside (`_move_aside`); when no step reads back, nothing
        is moved and CheckpointError names each step's damage."""
        damaged: list[DamagedCheckpoint] = []
        for step in reversed(self.all_steps()):
            try:
                restored, failed = self.restore_step(step, targets), None
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

    def item_path(self, step: int, name: str) -> epath.Path:
        """The directory of item `name` (checkpoint_items.ITEMS) in `step`."""
        return epath.Path(self.directory) / str(step) / item_named(name).directory

    def array_metadata(self, step: int, name: str = "state") -> dict[str, tuple]:
        """The arrays of item `name` in `step`: {tree path: (shape, numpy dtype)}, from the
        item's metadata (no array is read). Read through orbax's handler, which raises what
        failed (orbax's Checkpointer.metadata answers None for any failure)."""
        with _quiet_absl():
            meta = ocp.PyTreeCheckpointHandler().metadata(self.item_path(step, name))
        return {k: (tuple(m.shape), np.dtype(m.dtype)) for k, m in meta.items()}

    def read_arrays(self, step: int, keys, name: str = "state") -> dict[str, np.ndarray]:
        """Arrays `keys` (tree paths) of item `name` in `step`, read onto the host as numpy
        (orbax's partial restore: nothing else is read)."""
        args = ocp.args.PyTreeRestore(
            item={k: 0 for k in keys},
            restore_args={k: ocp.RestoreArgs(restore_type=np.ndarray) for k in keys},
            partial_restore=True,
        )
        with _quiet_absl(), _reads_finished():
            return dict(ocp.PyTreeCheckpointer().restore(self.item_path(step, name), args=args))

    def restore_params(self, step: int, params, prefix: str = "params"):
        """Only the arrays of `step`'s state under `prefix` (a run started from another run's
        parameters: its optimizer state, critic or counters are not read, and may differ), in
        the structure, shardings and dtypes of `params`. CheckpointError names the arrays the
        step lacks."""
        if step not in self.manager.all_steps():
            raise CheckpointError(f"no checkpoint for step {step} in {self.directory}")
        saved = self.array_metadata(step, "state")
        keys = [f"{prefix}/{k}" for k in tree_keys(params)]
        missing = [k for k in keys if k not in saved]
        if missing:
            theirs = sorted(k for k in saved if k.startswith(prefix + "/"))
            raise CheckpointError(
                f"checkpoint {At(self.directory, step)} holds other parameters than this run's "
                f"({len(theirs)} saved, {len(keys)} wanted): missing {missing[:3]}, e.g. saved "
                f"{theirs[:3]} (a LoRA run's parameters and a full model's differ)"
            )
        leaves = jax.tree.leaves(params)
        args = ocp.args.PyTreeRestore(
            item={k: 0 for k in keys},
            restore_args={
                k: ocp.ArrayRestoreArgs(sharding=x.sharding, dtype=x.dtype, global_shape=x.shape)
                for k, x in zip(keys, leaves)
            },
            partial_restore=True,
        )
        with _quiet_absl(), _reads_finished():
            read = ocp.PyTreeCheckpointer().restore(self.item_path(step, "state"), args=args)
        return jax.tree.unflatten(jax.tree.structure(params), [read[k] for k in keys])

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


def _saved_steps(fs, root: str) -> list[int]:
    ckpts = f"{root.rstrip('/')}/checkpoints"
    listed = fs.ls(ckpts, detail=False) if fs.isdir(ckpts) else []
    names = [p.rstrip("/").rsplit("/", 1)[-1] for p in listed]
    return sorted(int(n) for n in names if n.isdigit())


def saved_steps(workdir: str) -> list[int]:
    """The steps `<workdir>/checkpoints` (local or gs://) holds, in order."""
    import fsspec

    bound_remote_io(workdir)
    fs, root = fsspec.core.url_to_fs(workdir)
    with naming(f"listing {workdir}/checkpoints"):
        return _saved_steps(fs, root)


def saved_with_other_settings(workdir: str, info: dict) -> str | None:
    """How the run that saved `<workdir>/checkpoints` (local or gs://) was set up otherwise
    than this one (`info`: what this run writes to run.json): '<config key>=<saved>, this
    run has <this>' for the first SAVED_WITH setting that differs. None when none does, or
    there is no checkpoint or no `<workdir>/run.json`; a setting the saved run.json lacks
    (written before it was recorded) is not compared."""
    import fsspec

    bound_remote_io(workdir)
    fs, root = fsspec.core.url_to_fs(workdir)
    path = f"{root.rstrip('/')}/run.json"
    with naming(f"reading {workdir}/run.json"):
        if not _saved_steps(fs, root) or not fs.exists(path):
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
            raise RuntimeError("a PreemptionFlag must be made on the main thread")
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


def stop_requested_everywhere(flag: PreemptionFlag) -> bool:
    """True on every process when any process got the signal (call at the same step on all
    processes: a preempted host must not save alone)."""
    return runtime.any_process(flag.requested)
