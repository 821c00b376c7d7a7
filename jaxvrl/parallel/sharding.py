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
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis -> mesh axes (None = replicated)
LOGICAL_RULES: dict[str, tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),
    "embed": ("fsdp",),
    "mlp": ("tensor",),
    "heads": ("tensor",),
    "vocab": ("tensor",),
    "norm": None,
}

# param path regex -> logical axes of each dimension (first match wins)
PARAM_AXES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"embed_tokens\.embedding$", ("vocab", "embed")),
    (r"lm_head\.kernel$", ("embed", "vocab")),
    (r"(q_proj|k_proj|v_proj|qkv)\.kernel$", ("embed", "heads")),
    (r"(q_proj|k_proj|v_proj|qkv)\.bias$", ("heads",)),
    (r"(o_proj|attn\.proj)\.kernel$", ("heads", "embed")),
    (r"(gate_proj|up_proj|fc1)\.kernel$", ("embed", "mlp")),
    (r"(gate_proj|up_proj|fc1)\.bias$", ("mlp",)),
    (r"(down_proj|fc2)\.kernel$", ("mlp", "embed")),
    (r"patch_embed\.kernel$", (None, "embed")),
    (r"\.(bias|weight)$", ("norm",)),
)


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1, devices=None) -> Mesh:
    """Mesh with axes (data, fsdp, tensor); one size may be -1 (= the remaining devices)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = [data, fsdp, tensor]
    if sizes.count(-1) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got {dict(zip(MESH_AXES, sizes))}")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if len(devices) % known:
            raise ValueError(f"{len(devices)} devices not divisible by mesh sizes {sizes}")
        sizes[sizes.index(-1)] = len(devices) // known
    if math.prod(sizes) != len(devices):
        raise ValueError(
            f"mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices, "
            f"have {len(devices)}"
        )
    return Mesh(np.asarray(devices).reshape(sizes), MESH_AXES)


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


def param_axes(path: str, ndim: int) -> tuple[str | None, ...]:
    for pattern, axes in PARAM_AXES:
        if re.search(pattern, path) and len(axes) == ndim:
            return axes
    return (None,) * ndim


def param_shardings(state, mesh: Mesh, rules=LOGICAL_RULES):
    """NamedSharding for every leaf of an nnx state / pytree keyed by its dotted path."""

    def one(path, leaf):
        parts = [getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path]
        name = ".".join(str(p) for p in parts if p != "value")  # nnx Variables end in .value
        shape = getattr(leaf, "shape", ())
        spec = logical_to_spec(param_axes(name, len(shape)), shape, mesh, rules)
        return NamedSharding(mesh, spec)

    return jax.tree_util.tree_map_with_path(one, state)


def batch_sharding(mesh: Mesh, ndim: int, batch_axis: int = 0) -> NamedSharding:
    """Rows split over (data, fsdp); every other dimension replicated."""
    spec = [None] * ndim
    spec[batch_axis] = tuple(a for a in ("data", "fsdp") if mesh.shape[a] > 1) or None
    return NamedSharding(mesh, PartitionSpec(*spec))
