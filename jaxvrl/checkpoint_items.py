"""What a checkpoint step holds: ITEMS, one entry per piece of run state, the one table that
Checkpointer.save and restore_step (jaxvrl/checkpoint.py), the export and the trainer's resume
read. A new piece of run state is one entry here, plus the code that makes its value (an entry
of the `items` the trainer saves) and the code that uses it (`Restored[name]` on resume).

Each item is a directory of the step, written and read back by its kind:

  Arrays  a pytree of arrays (typed PRNG keys allowed) keyed by readable tree path, restored
          into a target's structure, shardings and dtypes (the target: the abstract tree)
  Key     an RNG key, typed or raw uint32 key data (the target: its sharding; default: the
          first device, or replicated over every device with several processes)
  Json    a JSON value; per process: each process's value (or bytes, tagged layout) gathered
          into one JSON item (orbax writes JSON from process 0 only; a collective)
  Bytes   each process's bytes, one file per process (`<index>-of-<count>`)

Besides the items, a step's `info` (JSON) records what a restore must know before reading:
the tree paths and key implementations of the arrays, the shape and implementation of the key.
Every item is written before orbax commits the step, so a step that lacks one is never listed.
"""

from __future__ import annotations

import base64
import dataclasses

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxvrl.parallel import runtime

INFO = "info"  # the step's record of how to read its items back


class CheckpointError(ValueError):
    """A checkpoint that does not fit the restore target."""


@dataclasses.dataclass(frozen=True)
class At:
    """The step an item is read from (named in errors)."""

    directory: str
    step: int

    def __str__(self) -> str:
        return f"{self.directory}/{self.step}"


# --- arrays and keys ---------------------------------------------------------------------------


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


def _wrapped(x, impl: str | None):
    return jax.random.wrap_key_data(x, impl=impl) if impl else x


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


def _check_keys(at: At, saved: list[str], wanted: list[str]) -> None:
    if saved == wanted:
        return
    missing = [k for k in wanted if k not in set(saved)]
    extra = [k for k in saved if k not in set(wanted)]
    raise CheckpointError(
        f"checkpoint {at} does not match the restore target: {len(saved)} saved arrays vs "
        f"{len(wanted)} wanted; missing {missing[:5]}, unexpected {extra[:5]}"
    )


# --- per-process values ------------------------------------------------------------------------


def _process_file(index: int, count: int) -> str:
    return f"{index}-of-{count}"


def check_process_count(saved: int, step, what: str) -> None:
    n = jax.process_count()
    if saved != n:
        raise ValueError(
            f"checkpoint step {step} holds the {what} of {saved} processes, this run "
            f"has {n}: each process reads its own shard of the data, and the shards change "
            "with the process count. Resume with the same number of hosts, or start a new "
            "workdir from the weights (config.load_checkpoint_path)."
        )


def _this_process(values: list, step: int, what: str):
    check_process_count(len(values), step, what)
    return values[jax.process_index()]


def _encode_one(value):
    if value is None:
        return {"kind": "none"}
    if isinstance(value, bytes | bytearray):
        return {"kind": "bytes", "value": base64.b64encode(bytes(value)).decode("ascii")}
    return {"kind": "json", "value": value}


def _decode_one(d):
    if d["kind"] == "bytes":
        return base64.b64decode(d["value"])
    return d.get("value")


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
        what = args.what if args is not None else "values"
        n, i = jax.process_count(), jax.process_index()
        path = directory / _process_file(i, n)
        if not path.exists():
            saved = sorted(p.name for p in directory.iterdir())
            counts = {int(s.rsplit("-of-", 1)[-1]) for s in saved if "-of-" in s}
            if len(counts) == 1 and counts != {n}:
                check_process_count(counts.pop(), directory.parent.name, what)
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
    what: str = "values"  # what the process-count error calls them


# --- the kinds ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Kind:
    """How an item is written and read back. `info`: what it records in the step's info;
    `saved`: whether a step holds an optional item; `save_args` / `restore_args`: orbax's
    arguments; `value`: the value restored, from what orbax read."""

    def info(self, item: Item, value) -> dict:
        return {}

    def saved(self, item: Item, info: dict, listed: set[str]) -> bool:
        return item.directory in listed

    def save_args(self, item: Item, value) -> ocp.args.CheckpointArgs:
        raise NotImplementedError

    def restore_args(self, item: Item, info: dict, target, at: At) -> ocp.args.CheckpointArgs:
        raise NotImplementedError

    def value(self, item: Item, read, info: dict, target, at: At):
        return read


@dataclasses.dataclass(frozen=True)
class Arrays(Kind):
    """A pytree of arrays, keyed by tree path; restored into its target (required)."""

    keys: str = "keys"  # the info fields: the tree paths, the typed keys' implementations
    key_impls: str = "key_impls"

    def info(self, item, value) -> dict:
        if value is None:
            raise ValueError(f"checkpoint item {item.name!r} is required (a pytree of arrays)")
        keys = tree_keys(value)
        leaves = jax.tree.leaves(value)
        impls = {k: _key_impl(x) for k, x in zip(keys, leaves) if _is_key(x)}
        return {self.keys: keys, self.key_impls: impls}

    def save_args(self, item, value):
        arrays = zip(tree_keys(value), map(_to_saveable, jax.tree.leaves(value)))
        return ocp.args.StandardSave(dict(arrays))

    def restore_args(self, item, info, target, at):
        if target is None:
            raise TypeError(f"restoring checkpoint item {item.name!r} needs its abstract tree")
        keys = tree_keys(target)
        _check_keys(at, info[self.keys], keys)
        return ocp.args.StandardRestore(
            dict(zip(keys, map(_abstract_leaf, jax.tree.leaves(target))))
        )

    def value(self, item, read, info, target, at):
        treedef = jax.tree.structure(target)
        impls = info[self.key_impls]
        return jax.tree.unflatten(
            treedef, [_wrapped(read[k], impls.get(k)) for k in tree_keys(target)]
        )


@dataclasses.dataclass(frozen=True)
class Key(Kind):
    """An RNG key; restored where its target (a sharding) says, by default as _abstract_leaf."""

    impl: str = "rng_impl"  # the info fields: the key's implementation (typed keys), its shape
    shape: str = "rng_shape"

    def info(self, item, value) -> dict:
        return {
            self.impl: _key_impl(value) if value is not None and _is_key(value) else None,
            self.shape: None if value is None else list(np.shape(_to_saveable(value))),
        }

    def saved(self, item, info, listed) -> bool:
        return info.get(self.shape) is not None

    def save_args(self, item, value):
        return ocp.args.StandardSave({"key_data": _to_saveable(value)})

    def restore_args(self, item, info, target, at):
        shape = jax.ShapeDtypeStruct(tuple(info[self.shape]), np.uint32)
        return ocp.args.StandardRestore({"key_data": _abstract_leaf(shape, target)})

    def value(self, item, read, info, target, at):
        return _wrapped(read["key_data"], info[self.impl])


@dataclasses.dataclass(frozen=True)
class Json(Kind):
    """One JSON object (None: {}); per process, each process's value gathered into a list,
    `tagged` as {"kind": json | bytes | none, "value": ...} to hold bytes and None as well."""

    tagged: bool = False

    def save_args(self, item, value):
        if not item.per_process:
            return ocp.args.JsonSave(dict(value or {}))
        if self.tagged:
            values = runtime.gather_json(_encode_one(value))
            return ocp.args.JsonSave({"kind": "per_process", "value": values})
        return ocp.args.JsonSave({"per_process": runtime.gather_json(value)})

    def restore_args(self, item, info, target, at):
        return ocp.args.JsonRestore()

    def value(self, item, read, info, target, at):
        if not item.per_process:
            return dict(read)
        if not self.tagged:
            return _this_process(read["per_process"], at.step, item.what)
        if read["kind"] != "per_process":  # written by a single process before per-process states
            return _decode_one(read)
        return _decode_one(_this_process(read["value"], at.step, item.what))


@dataclasses.dataclass(frozen=True)
class Bytes(Kind):
    """Each process's own bytes (per process only)."""

    def save_args(self, item, value):
        return ProcessBytesSave(value)

    def restore_args(self, item, info, target, at):
        return ProcessBytesRestore(item.what)


@dataclasses.dataclass(frozen=True)
class Item:
    name: str  # its key in Checkpointer.save's items, restore_step's targets and Restored
    kind: Kind
    directory: str = ""  # its directory in a step (default: the name)
    optional: bool = False  # None is not written, and a step without it restores None
    per_process: bool = False  # each process saves and restores its own value
    what: str = ""  # per process: what the process-count error calls the values

    def __post_init__(self):
        object.__setattr__(self, "directory", self.directory or self.name)
        if isinstance(self.kind, Bytes) and not self.per_process:
            raise ValueError(f"checkpoint item {self.name!r}: bytes are kept per process")


# The run state a step holds, in the order restore reads it (the small JSON items first: a
# damaged one is found before the arrays are read).
ITEMS = (
    Item("meta", Json()),  # the trainer's JSON run state (non-finite streak, step shapes)
    Item("data_state", Json(tagged=True), "data", per_process=True, what="data-iterator states"),
    Item("counters", Json(), optional=True, per_process=True, what="running totals"),
    Item("state", Arrays()),  # the train state: params, optimizer state, counters
    Item("rng", Key(), optional=True),
    Item("replay", Bytes(), optional=True, per_process=True, what="replay buffers"),
    # partial rollouts' rows in flight (trainer/partial.py), in the replay buffer's format
    Item("carried", Bytes(), optional=True, per_process=True, what="carried rollout rows"),
)
NAMES = tuple(item.name for item in ITEMS)


def item_named(name: str) -> Item:
    for it in ITEMS:
        if it.name == name:
            return it
    raise KeyError(f"no checkpoint item {name!r}; the items are {', '.join(NAMES)}")


def check_names(values, what: str) -> None:
    unknown = sorted(set(values) - set(NAMES))
    if unknown:
        raise TypeError(f"{what}: unknown checkpoint items {unknown}; the items are {NAMES}")
