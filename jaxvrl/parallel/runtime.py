"""What the train loop calls to run on a device mesh, one host or many.

    initialize_distributed(c.distributed)          # before anything touches a device
    mesh = mesh_from_config(c.mesh)
    s = sharded_train_state(init_train_state, model, mesh, c)   # state born sharded
    step = build_train_step(s.graphdef, s.tx, step_cfg)   # trainer.step, not jitted
    train_step = jit_train_step(step, mesh, s.state_shardings, s.ref_shardings)
    batch = place_batch(host_batch, mesh)          # this process's rows -> global arrays
    state, metrics, extras = train_step(state, ref_params, batch, rng)
    rows = host_local(sampler_output)              # this process's rows back as numpy

Every sharding comes from the logical-axis rules in `sharding.py`; optimizer state is sharded
like the parameter it belongs to (its path ends in the parameter's path), scalars are
replicated, batch rows are split over (data, fsdp).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
from collections.abc import Callable, Hashable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxvrl.parallel.sharding import ROW_AXES, constrain, make_mesh, param_shardings

log = logging.getLogger("jaxvrl")


def initialize_distributed(cfg) -> bool:
    """jax.distributed.initialize for multi-host runs; returns whether it ran.

    cfg: the `distributed` ConfigDict group (enable, coordinator_address, num_processes,
    process_id). With enable=False nothing happens. With enable=True the fields left None
    come from the platform's environment (TPU VM metadata, SLURM, Open MPI), which is how a
    TPU pod slice or `launch/gpu.sh` runs it. Call it before any other JAX call.
    """
    if not cfg.enable:
        return False
    if jax.distributed.is_initialized():
        return True
    kw = {
        k: cfg[k]
        for k in ("coordinator_address", "num_processes", "process_id")
        if cfg[k] is not None
    }
    jax.distributed.initialize(**kw)
    log.info(
        "jax.distributed: process %d of %d, %d local / %d global devices",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )
    return True


def any_process(flag: bool) -> bool:
    """True on every process when `flag` is true on any (call it at the same point on all
    processes: it is a collective when there are several)."""
    if jax.process_count() == 1:
        return bool(flag)
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.asarray(flag, np.int32))))


def max_across_processes(sizes: dict) -> dict:
    """{name: int}: each the largest any process holds (a collective when there are several
    processes; the same keys on every process): the shapes every process's part of one
    global batch must share."""
    if jax.process_count() == 1:
        return dict(sizes)
    from jax.experimental import multihost_utils

    keys = sorted(sizes)
    local = np.asarray([int(sizes[k]) for k in keys], np.int64)
    every = np.asarray(multihost_utils.process_allgather(local)).reshape(-1, len(keys))
    return {k: int(v) for k, v in zip(keys, every.max(axis=0))}


def gather_json(obj) -> list:
    """Every process's JSON-serialisable `obj`, in process order (a collective when there are
    several processes)."""
    if jax.process_count() == 1:
        return [obj]
    from jax.experimental import multihost_utils

    raw = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.asarray([raw.size], np.int64)))
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: raw.size] = raw
    rows = np.asarray(multihost_utils.process_allgather(padded))
    return [json.loads(bytes(r[: int(n)]).decode()) for r, n in zip(rows, sizes.reshape(-1))]


def metrics_across_processes(m: dict, weight: float, sums=(), maxes=()) -> dict:
    """Every process's host-side metrics combined (a collective with several processes): the
    keys in `sums` add up, those in `maxes` take the largest, the others are means weighted
    by each process's `weight` (the number of items its values average), NaN values left
    out. A key some process lacks (a sub-score only some rows returned) counts as NaN there;
    a key that is NaN everywhere is dropped. Values travel as float32 between processes."""
    keys = sorted(m)
    if jax.process_count() > 1:  # the same keys in the same order on every process
        keys = sorted({k for names in gather_json(keys) for k in names})
    vals = np.asarray([float(m.get(k, np.nan)) for k in keys] + [float(weight)], np.float64)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        vals = np.asarray(multihost_utils.process_allgather(vals))
    vals = vals.reshape(-1, len(keys) + 1)
    w = vals[:, -1]
    out = {}
    for i, k in enumerate(keys):
        x = vals[:, i]
        ok = np.isfinite(x)
        if not ok.any():
            continue
        if k in sums:
            out[k] = float(np.sum(x[ok]))
        elif k in maxes:
            out[k] = float(np.max(x[ok]))
        else:
            out[k] = float(np.sum(x[ok] * w[ok]) / max(np.sum(w[ok]), 1e-12))
    return out


def mesh_from_config(cfg, devices=None) -> Mesh:
    """Mesh (data, fsdp, expert, sequence, tensor) from the `mesh` ConfigDict group; one size
    may be -1 (the rest of the devices). Raises ValueError naming the sizes and the device
    count when they do not fit."""
    # a group written before the expert and sequence axes existed has neither
    expert, sequence = cfg.get("expert", 1), cfg.get("sequence", 1)
    return make_mesh(
        cfg.data, cfg.fsdp, cfg.tensor, devices=devices, expert=expert, sequence=sequence
    )


def on_host():
    """Context in which new arrays go to host memory (the CPU backend), not accelerator 0:
    load the checkpoint under it, then `sharded_train_state` cuts it onto the mesh.

        with on_host():
            model = load(path, dtype=..., param_dtype=...)
    """
    return jax.default_device(jax.local_devices(backend="cpu")[0])


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def state_shardings(state, mesh: Mesh):
    """NamedSharding for every leaf of a TrainState (or its abstract `jax.eval_shape`).

    Parameters follow the PARAM_AXES table by their path; an optimizer-state leaf's path ends
    in its parameter's path (`opt_state.1.0.mu.model.layers.0.mlp.up_proj.kernel`), so the
    same table shards Adam's mu and nu like the parameter; scalars (step, counts) have no
    dimension to split and are replicated. New fields (a critic, LoRA factors) follow the
    same rule.
    """
    return param_shardings(state, mesh)


def put_on_mesh(tree, shardings):
    """Place a pytree with `shardings` (same structure).

    Host leaves (numpy, or arrays on the CPU backend) are cut on the host and each device
    receives only its slice (`make_array_from_callback`): a checkpoint loaded on the host
    never needs one device's memory, and on a pod every process passes the same full value.
    Leaves already on the mesh are resharded by device_put.
    """

    def one(x, sharding):
        if isinstance(x, jax.Array) and not _on_cpu_backend(x, sharding):
            if x.sharding.device_set == sharding.device_set or sharding.is_fully_addressable:
                return jax.device_put(x, sharding)
        host = np.asarray(x)  # on a pod: this process's full copy, cut per local device
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])

    return jax.tree.map(one, tree, shardings)


def replicate(tree, mesh: Mesh):
    """Host values and typed PRNG keys -> fully replicated arrays on the mesh. On a pod the
    train loop's rng must be one (orbax saves only global arrays from every host); every
    process passes the same value."""
    rep = replicated(mesh)

    def one(x):
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            data = put_on_mesh(np.asarray(jax.random.key_data(x)), rep)
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        return put_on_mesh(x, rep)

    return jax.tree.map(one, tree)


def sharded_init(fn, mesh: Mesh, *args, offload=()):
    """Run `fn(*args)` (arrays in, a pytree of arrays out) so that every output is created
    already sharded: shapes from `jax.eval_shape`, shardings from the rules table, then
    `jit(fn, out_shardings=...)`. Returns (outputs, their shardings).

    Typical use: fn builds the TrainState (and reference params) from loaded params that
    are already on the mesh; the optimizer state is then born sharded like them (the parts
    named in `offload` in host memory: `in_host_memory`).
    """
    abstract = jax.eval_shape(fn, *args)
    shardings = in_host_memory(state_shardings(abstract, mesh), offload)
    return jax.jit(fn, out_shardings=shardings)(*args), shardings


def in_host_memory(shardings, offload=()):
    """`shardings` (of a TrainState, or a tuple (TrainState, reference params)) with the
    parts named in `offload` in the devices' pinned host memory: "optimizer" (the policy's
    and critic's optimizer states; the train step brings them to the devices for each update,
    `trainer.update._apply`), "reference" (the reference weights, brought to the devices for
    the reference pass)."""

    def host(tree):
        return jax.tree.map(lambda s: s.with_memory_kind("pinned_host"), tree)

    if isinstance(shardings, tuple):
        state, *rest = shardings
        if "reference" in offload and rest and rest[0] is not None:
            rest[0] = host(rest[0])
        return (in_host_memory(state, offload), *rest)
    if "optimizer" not in offload or not dataclasses.is_dataclass(shardings):
        return shardings
    return dataclasses.replace(
        shardings,
        opt_state=host(shardings.opt_state),
        critic_opt_state=host(shardings.critic_opt_state),
    )


@dataclasses.dataclass
class ShardedInit:
    """What `sharded_train_state` returns: init's outputs created on the mesh, their
    shardings, and the graphs init left behind (LoRA changes the model's graph)."""

    graphdef: object  # the train step's graph (init's first output)
    tx: object  # the optimizer
    state: object
    ref_params: object | None
    state_shardings: object
    ref_shardings: object | None
    model_graphdef: object  # nnx.graphdef of the model after init (what the sampler takes)


def sharded_train_state(init, model, mesh: Mesh, *args, offload=()) -> ShardedInit:
    """Run `init(model, *args) -> (graphdef, tx, state, ref_params)` (trainer.build's
    init_train_state) so that the state and the reference params are created sharded.

    The model's arrays go onto the mesh first (each device gets its slice, see
    `put_on_mesh`), then init runs on a copy merged inside `jit(out_shardings=...)`; its
    in-place changes (LoRA adapters) happen on that copy, so the model graph after init is
    returned as `model_graphdef` for the sampler. Random inits inside (a critic head) draw
    the same values as on one device.
    """
    from flax import nnx

    graph0, values = nnx.split(model)
    values = put_on_mesh(values, param_shardings(values, mesh))
    fn, seen = _init_fn(init, graph0, args)
    (state, ref), (state_sh, ref_sh) = sharded_init(fn, mesh, values, offload=offload)
    return ShardedInit(
        seen["graphdef"], seen["tx"], state, ref, state_sh, ref_sh, seen["model_graphdef"]
    )


def abstract_train_state(init, model, mesh: Mesh, *args, offload=()) -> ShardedInit:
    """What `sharded_train_state` makes, as shapes only: the state and reference params are
    `jax.ShapeDtypeStruct`s carrying their shardings on `mesh`, nothing is computed or
    allocated. `model` may itself be abstract (`nnx.eval_shape`): the ahead-of-time compile
    (`jaxvrl.aot`) builds the train state of a 7B model this way on a CPU host."""
    from flax import nnx

    graph0, values = nnx.split(model)
    fn, seen = _init_fn(init, graph0, args)
    abstract = jax.eval_shape(fn, values)
    shardings = in_host_memory(state_shardings(abstract, mesh), offload)
    state, ref = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )
    return ShardedInit(seen["graphdef"], seen["tx"], state, ref, *shardings, seen["model_graphdef"])


def _init_fn(init, graph0, args):
    """values -> init(model, *args)'s (state, ref), recording the graphs and optimizer that
    init leaves behind in the returned dict."""
    from flax import nnx

    seen = {}

    def fn(values):
        m = nnx.merge(graph0, values)
        graphdef, tx, state, ref = init(m, *args)
        seen.update(graphdef=graphdef, tx=tx, model_graphdef=nnx.graphdef(m))
        return state, ref

    return fn, seen


def batch_shardings(batch, mesh: Mesh, rows: int | None = None):
    """Rows over (data, fsdp, expert) for every leaf whose leading axis (for position_ids, the
    family's positions [..., B, L], the second-to-last) is the row axis; other leaves
    (packed vision patches) are replicated.

    batch: a RolloutBatch (or any dataclass/pytree of arrays); rows: B (default: the leading
    size of input_ids or of the first leaf).
    """
    axes = tuple(a for a in ROW_AXES if mesh.shape[a] > 1) or None
    rows = _rows(batch) if rows is None else rows

    def one(path, x):
        nd = np.ndim(x)
        axis = nd - 2 if _name(path) == "position_ids" else 0
        spec = [None] * nd
        if nd > axis and np.shape(x)[axis] == rows:
            spec[axis] = axes
        return NamedSharding(mesh, PartitionSpec(*spec))

    return jax.tree_util.tree_map_with_path(one, batch)


def place_batch(batch, mesh: Mesh):
    """A host batch -> global arrays on the mesh.

    Single host: `batch` holds all B rows. Multi-host: each process passes its own B / P rows
    (its data shard, `EpochIterator(shard_index=process_index, shard_count=process_count)`);
    they become one run of the global batch's rows, where the mesh puts that process's
    devices (process i's at [i * B/P, (i+1) * B/P) on meshes in process order; `row_starts`
    tells). Leaves without a row axis (packed patches) must be equal on every
    process.
    """
    local_rows = _rows(batch)
    shardings = batch_shardings(batch, mesh, rows=local_rows)
    n_proc = jax.process_count()

    def one(x, sharding):
        x = np.asarray(x)
        split = [i for i, s in enumerate(sharding.spec) if s is not None]
        shape = list(x.shape)
        if split:
            shape[split[0]] *= n_proc
        return jax.make_array_from_process_local_data(sharding, x, tuple(shape))

    return jax.tree.map(one, batch, shardings)


def row_starts(mesh: Mesh, rows: int) -> list[int]:
    """Each process's first row (by process index) in a global batch that `place_batch`
    makes of `rows` rows from every process on `mesh`: each process's rows are one run of
    the global rows, wherever the mesh puts its devices."""
    total = rows * jax.process_count()
    sharding = batch_shardings({"x": np.zeros(total)}, mesh, rows=total)["x"]
    first = {}
    for device, index in sharding.devices_indices_map((total,)).items():
        start = index[0].start or 0
        first[device.process_index] = min(first.get(device.process_index, start), start)
    return [first[p] for p in range(jax.process_count())]


def host_local(tree):
    """Global arrays -> numpy holding this process's rows (the inverse of `place_batch`): on
    one host the whole array; on a pod the rows whose shards this process holds, in order
    (sampler outputs go back to the host this way to be decoded and rewarded). The row axis
    is the one axis the shards split (position_ids: their second-to-last); unsplit arrays come back whole."""

    def one(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return np.asarray(x)
        shards = x.addressable_shards
        split = [a for a in range(x.ndim) if shards[0].data.shape[a] != x.shape[a]]
        if not split:
            return np.asarray(shards[0].data)
        if len(split) > 1:
            raise ValueError(f"host_local: {x.shape} is split on axes {split}, not on rows")
        a = split[0]
        blocks = {s.index[a].start: np.asarray(s.data) for s in shards}  # replicas collapse
        return np.concatenate([blocks[k] for k in sorted(blocks)], axis=a)

    return jax.tree.map(one, tree)


def place_state(state, shardings):
    """Move a TrainState / params tree onto the mesh with its shardings (e.g. after a restore
    that gave single-device arrays). Prefer `sharded_init` for fresh states."""
    return put_on_mesh(state, shardings)


def jit_train_step(step, mesh: Mesh, state_shardings, ref_shardings=None):
    """`step` (state, ref_params, batch, rng) -> (state, metrics, extras), not jitted (e.g.
    `trainer.step.build_train_step(...)`), jitted for `mesh`: the state donated, the state's
    shardings in and out, the batch's taken from its arrays (see `place_batch`), metrics
    replicated (they are logged), extras (per-row values) split by row as the batch is. The
    step is traced under the mesh (`use_abstract_mesh`), which turns on the model's
    activation constraints (`sharding.constrain`).
    """

    def on_mesh(state, ref_params, batch, rng):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            state, metrics, extras = step(state, ref_params, batch, rng)
            # per-row extras split by row as the batch came: each process reads back its own
            extras = jax.tree.map(lambda x: constrain(x, ("batch",)), extras)
        return state, metrics, extras

    rep = replicated(mesh)
    return jax.jit(
        on_mesh,
        in_shardings=(state_shardings, ref_shardings, None, rep),
        out_shardings=(state_shardings, rep, None),
        donate_argnums=(0,),
    )


@dataclasses.dataclass(eq=False)
class KeptProgram:
    """A jitted program kept for later runs of this process, and the batch shapes it has run
    (`shape_key`s): a run counts the programs and shapes it added itself."""

    fn: Callable
    shapes: set = dataclasses.field(default_factory=set)


_KEPT: collections.OrderedDict[Hashable, KeptProgram] = collections.OrderedDict()
KEEP_PROGRAMS = 4  # the programs kept, least recently used first out


def kept_program(key: Hashable, build: Callable[[], Callable]) -> KeptProgram:
    """The program that `build()` made for an equal `key` earlier in this process, else a new
    one, kept. `key` must hold everything the program is traced from (the function that
    builds the step, the model's graph, the optimizer, the step's settings, the mesh and
    the shardings): a second run with the same settings in one process (a notebook, a sweep,
    a test session) then reuses the traced and compiled step instead of tracing it again.
    jax's own cache still tells apart what the key leaves out (argument shapes, shardings of
    the batch, the matmul precision in effect)."""
    try:
        kept = _KEPT.pop(key)
    except KeyError:
        kept = KeptProgram(build())
    except TypeError:  # an unhashable part: nothing to share
        return KeptProgram(build())
    _KEPT[key] = kept
    while len(_KEPT) > KEEP_PROGRAMS:
        _KEPT.popitem(last=False)
    return kept


def tree_key(tree) -> tuple:
    """A pytree of hashable leaves (shardings, None) as one hashable value."""
    leaves, treedef = jax.tree.flatten(tree, is_leaf=lambda x: x is None)
    return treedef, tuple(leaves)


def shape_key(tree) -> tuple:
    """What a jitted function's compiled program is keyed on in `tree` (its structure, static
    fields included, and each leaf's shape and dtype): distinct keys, distinct programs."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((np.shape(x), np.asarray(x).dtype.name) for x in leaves)


def compiles(fn) -> int:
    """Programs a jitted function has compiled so far in this process (one per distinct
    argument shape, dtype and sharding): a run logs it to show that steps do not recompile."""
    return fn._cache_size()


def _on_cpu_backend(x: jax.Array, sharding) -> bool:
    """x sits in host memory (the CPU backend) while the mesh is on accelerators."""
    src = next(iter(x.sharding.device_set)).platform
    return src == "cpu" and next(iter(sharding.device_set)).platform != "cpu"


def _name(path) -> str:
    k = path[0] if path else None
    return str(getattr(k, "name", getattr(k, "key", k)))


def _rows(batch) -> int:
    if dataclasses.is_dataclass(batch) and hasattr(batch, "input_ids"):
        return int(np.shape(batch.input_ids)[0])
    return int(np.shape(jax.tree.leaves(batch)[0])[0])
