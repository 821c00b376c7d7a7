"""Device mesh and sharding rules.

Model code never names mesh axes. Parameters get logical axis names from `PARAM_AXES` (one
regex table over param paths), and `LOGICAL_RULES` maps logical names to mesh axes. A
dimension that a mesh axis does not divide is replicated instead (tiny test models on 8 devices).
"""

from __future__ import annotations

import math
import re

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# expert: a mixture of experts' experts split over it (expert parallelism), the rows too
# elsewhere, as over data (`models/moe.py`: tokens go to their experts' devices and back);
# sequence: every row's tokens split over it (sequence parallelism: `models/attention.py`
# gathers what attention needs), the weights too, as over fsdp
MESH_AXES = ("data", "fsdp", "expert", "sequence", "tensor")
# the axes that split a batch's rows
ROW_AXES = ("data", "fsdp", "expert")

# logical axis -> mesh axes (None = replicated)
LOGICAL_RULES: dict[str, tuple[str, ...] | None] = {
    "batch": ROW_AXES,
    # the expert and sequence axes shard the other weights like fsdp (an expert kernel's embed
    # dimension keeps fsdp and sequence: its experts' dimension took the expert axis)
    "embed": ("fsdp", "expert", "sequence"),
    "mlp": ("tensor",),
    "heads": ("tensor",),
    "vocab": ("tensor",),
    "norm": None,
    # the leading layer axis of scanned layers' params (`model.scan_layers`): never split, so
    # a scan step reads one layer's slice as the unscanned layer would read its own params
    "layers": None,
    # the experts of a mixture-of-experts layer (their kernels otherwise split like a dense
    # MLP's)
    "experts": ("expert",),
    # activations only: a row's tokens (and the vision tower's patches)
    "length": ("sequence",),
    "act_embed": None,
}

# param path regex -> logical axes of each dimension (first match wins)
# `(\.base)?`: a LoRA-wrapped Linear keeps its weights under `.base`; QLoRA stores them as
# `qvalue` [D_in, D_out] with a `scale` [D_in / tile, D_out]. Adapters: lora_a [D_in, r],
# lora_b [r, D_out], sharded on the dimension they share with the base weight.
_QKV, _OUT, _UP, _DOWN = (
    r"(q_proj|k_proj|v_proj|qkv)",
    r"(o_proj|attn\.proj)",
    r"(gate_proj|up_proj|fc1)",
    r"(down_proj|fc2)",
)
_W = r"(\.base)?\.(kernel|qvalue)$"
_S = r"(\.base)?\.scale$"
_B = r"(\.base)?\.bias$"
PARAM_AXES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"embed_tokens\.embedding$", ("vocab", "embed")),
    (r"lm_head\.kernel$", ("embed", "vocab")),
    (_QKV + _W, ("embed", "heads")),
    (_QKV + _S, (None, "heads")),
    (_QKV + _B, ("heads",)),
    (_QKV + r"\.lora_a$", ("embed", None)),
    (_QKV + r"\.lora_b$", (None, "heads")),
    (_OUT + _W, ("heads", "embed")),
    (_OUT + _S, (None, "embed")),
    (_OUT + r"\.lora_a$", ("heads", None)),
    (_OUT + r"\.lora_b$", (None, "embed")),
    (_UP + _W, ("embed", "mlp")),
    (_UP + _S, (None, "mlp")),
    (_UP + _B, ("mlp",)),
    (_UP + r"\.lora_a$", ("embed", None)),
    (_UP + r"\.lora_b$", (None, "mlp")),
    (_DOWN + _W, ("mlp", "embed")),
    (_DOWN + _S, (None, "embed")),
    (_DOWN + r"\.lora_a$", ("mlp", None)),
    (_DOWN + r"\.lora_b$", (None, "embed")),
    # a mixture-of-experts layer (`models/moe.py`): experts' kernels [E, D_in, D_out] (QLoRA:
    # qvalue, and scale [E, D_in / tile, D_out]), router and shared expert's gate (the shared
    # expert's projections are a dense MLP's, above)
    (_UP + r"\.(kernel|qvalue)$", ("experts", "embed", "mlp")),
    (_UP + r"\.scale$", ("experts", None, "mlp")),
    (_DOWN + r"\.(kernel|qvalue)$", ("experts", "mlp", "embed")),
    (_DOWN + r"\.scale$", ("experts", None, "embed")),
    (r"mlp\.(gate|shared_expert_gate)\.kernel$", ("embed", None)),
    (r"patch_embed\.kernel$", (None, "embed")),
    (r"\.(bias|weight)$", ("norm",)),
)


def mesh_sizes(
    n_devices: int,
    data: int = 1,
    fsdp: int = -1,
    tensor: int = 1,
    expert: int = 1,
    sequence: int = 1,
) -> dict[str, int]:
    """Axis sizes (MESH_AXES' order) with the one -1 resolved; a clear error when they do
    not fit n_devices."""
    sizes = {"data": data, "fsdp": fsdp, "expert": expert, "sequence": sequence, "tensor": tensor}
    free = [a for a, s in sizes.items() if s == -1]
    if len(free) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got {sizes}")
    if any(s == 0 or s < -1 for s in sizes.values()):
        raise ValueError(f"mesh axis sizes must be positive or -1, got {sizes}")
    known = math.prod(s for s in sizes.values() if s != -1)
    if free:
        if n_devices % known:
            raise ValueError(
                f"mesh {sizes}: the fixed axes multiply to {known}, which does not divide "
                f"the {n_devices} devices"
            )
        sizes[free[0]] = n_devices // known
    if math.prod(sizes.values()) != n_devices:
        raise ValueError(
            f"mesh {sizes} needs {math.prod(sizes.values())} devices, have {n_devices}"
        )
    return sizes


def make_mesh(
    data: int = 1,
    fsdp: int = -1,
    tensor: int = 1,
    devices=None,
    expert: int = 1,
    sequence: int = 1,
) -> Mesh:
    """Mesh with axes (data, fsdp, expert, sequence, tensor); one size may be -1 (= the
    remaining devices).

    Devices are laid out by `mesh_utils.create_device_mesh`, so on TPU the inner axes
    (tensor, then sequence, expert, fsdp) follow the physical interconnect.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = list(mesh_sizes(len(devices), data, fsdp, tensor, expert, sequence).values())
    try:
        grid = mesh_utils.create_device_mesh(sizes, devices, allow_split_physical_axes=True)
    except (AssertionError, NotImplementedError, ValueError):
        grid = np.asarray(devices).reshape(sizes)  # device kinds without a topology model
    return Mesh(grid, MESH_AXES)


def logical_to_spec(axes, shape, mesh: Mesh, rules=LOGICAL_RULES) -> PartitionSpec:
    spec, used = [], set()
    for name, dim in zip(axes, shape):
        mesh_axes = rules.get(name) if name is not None else None
        if not mesh_axes:
            spec.append(None)
            continue
        mesh_axes = tuple(a for a in mesh_axes if a not in used and mesh.shape[a] > 1)
        size = math.prod(mesh.shape[a] for a in mesh_axes)
        if not mesh_axes or dim % size:
            spec.append(None)
            continue
        used.update(mesh_axes)
        spec.append(mesh_axes if len(mesh_axes) > 1 else mesh_axes[0])
    return PartitionSpec(*spec)


def target_platform() -> str:
    """The platform ("cpu", "gpu", "tpu") of the devices the program being traced is compiled
    for: the mesh set with `jax.set_mesh` / `use_abstract_mesh`, else the default devices.

    Implementation choices (CPU-only kernels and forms) follow this, never the process's
    default backend: a TPU program compiled ahead of time on a CPU host (`jaxvrl.aot`) must
    be the program a TPU host runs."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:
        device = getattr(mesh, "abstract_device", None)
        if device is not None:
            return device.platform
    return jax.default_backend()


def target_device_count() -> int:
    """Devices of the program being traced: the mesh's size, else every device."""
    mesh = jax.sharding.get_abstract_mesh()
    return jax.device_count() if mesh.empty else mesh.size


def traced_mesh():
    """The abstract mesh (MESH_AXES) the program being traced is split over, or None: none set
    with `jax.set_mesh` / `use_abstract_mesh`, another kind of mesh, or inside a shard_map
    over every axis (where each device's code sees its own shards)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(MESH_AXES) <= set(mesh.axis_names) or mesh.are_all_axes_manual:
        return None
    return mesh


def sequence_split(length: int) -> tuple[str, int] | None:
    """(mesh axis, its size) that splits a row's `length` tokens under the mesh being traced
    (the "length" rule's axis), or None: no mesh, the axis of size 1, or not dividing."""
    mesh = traced_mesh()
    axes = LOGICAL_RULES["length"] or ()
    if mesh is None or len(axes) != 1 or mesh.shape[axes[0]] == 1 or length % mesh.shape[axes[0]]:
        return None
    return axes[0], mesh.shape[axes[0]]


def constrain(x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
    """Sharding constraint by logical axis names under the mesh set with `jax.set_mesh`.

    A no-op without a mesh (one device, HF parity tests) and for dimensions that the mesh
    axes do not divide, so model code can call it unconditionally.
    """
    mesh = traced_mesh()
    if mesh is None:
        return x
    spec = logical_to_spec(axes, x.shape, mesh)
    if all(s is None for s in spec):
        return x
    return jax.lax.with_sharding_constraint(x, spec)


# a scanned model's stacked layers (no layer index after the module): a leading "layers" axis
_STACKED = re.compile(r"(^|\.)(model\.layers|visual\.blocks)\.(?!\d+(\.|$))")


def param_axes(path: str, ndim: int) -> tuple[str | None, ...]:
    """Logical axes of the param at dotted `path` with `ndim` dimensions (PARAM_AXES; a
    stacked param of scanned layers gets "layers" and then its per-layer axes)."""
    if ndim and _STACKED.search(path):
        return ("layers", *param_axes(_STACKED.sub(r"\1\2.0.", path, count=1), ndim - 1))
    for pattern, axes in PARAM_AXES:
        if re.search(pattern, path) and len(axes) == ndim:
            return axes
    return (None,) * ndim


def leaf_name(path) -> str:
    """A tree path -> the dotted name PARAM_AXES matches (`model.layers.0.mlp.up_proj.kernel`)."""
    parts = [getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path]
    return ".".join(str(p) for p in parts if p != "value")  # nnx Variables end in .value


def param_shardings(state, mesh: Mesh, rules=LOGICAL_RULES):
    """NamedSharding for every leaf of an nnx state / pytree keyed by its dotted path."""

    def one(path, leaf):
        name = leaf_name(path)
        shape = getattr(leaf, "shape", ())
        spec = logical_to_spec(param_axes(name, len(shape)), shape, mesh, rules)
        return NamedSharding(mesh, spec)

    return jax.tree_util.tree_map_with_path(one, state)


def row_shards(mesh: Mesh | None) -> int:
    """How many ways a batch's rows are split: mesh.data x mesh.fsdp x mesh.expert (1 without
    a mesh)."""
    return 1 if mesh is None else math.prod(mesh.shape.get(a, 1) for a in ROW_AXES)


def process_row_shards(mesh: Mesh | None, processes: int | None = None) -> int:
    """The row shards one process's rows split over: `row_shards` over the `processes`
    (default: this run's), at least 1."""
    processes = jax.process_count() if processes is None else processes
    return max(1, row_shards(mesh) // processes)


def sequence_shards(mesh: Mesh | None) -> int:
    """How many ways a row's tokens are split: the "length" rule's mesh axis (1 without a
    mesh)."""
    axes = LOGICAL_RULES["length"] or ()
    return 1 if mesh is None else math.prod(mesh.shape.get(a, 1) for a in axes)


def row_axes(rows: int) -> tuple[str, ...]:
    """The mesh axes that split `rows` under the mesh the program is traced for (`jax.set_mesh`
    / `use_abstract_mesh`): those of ROW_AXES larger than 1; () without a mesh, or where
    they do not divide the rows."""
    mesh = traced_mesh()
    if mesh is None:
        return ()
    axes = tuple(a for a in ROW_AXES if mesh.shape[a] > 1)
    return axes if axes and rows % math.prod(mesh.shape[a] for a in axes) == 0 else ()
