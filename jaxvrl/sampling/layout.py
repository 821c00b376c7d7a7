"""The rollout's layout: the devices and dtype the sampler holds the policy's weights in.

Training splits every weight over `mesh.fsdp`, so each matmul gathers its weights first. A
train step amortises that over thousands of tokens per row; a decode step feeds one token per
row and would gather the whole model at every step. Rollouts therefore take a layout of their
own (`Layout`): a mesh over the same devices with a `data` axis (rows) and a `tensor` axis
(attention heads, MLP columns and the vocabulary split across a group of devices, as in
Megatron-LM, arXiv 1909.08053: each decode step reads each weight once per group and
all-reduces the hidden state twice per layer), and a compute dtype.

`Sampler.prepare` puts the policy's parameters into that layout once per rollout phase: LoRA
adapters merged into their base weights, every floating weight cast to the rollout dtype and
resharded, in one jitted program (plus, where the rollout mesh orders the devices otherwise
than training's, a device-to-device move of whole shards; onto devices of the sampler's own,
`across`). The copy lives until the phase drops it.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxvrl import models
from jaxvrl.models import lora
from jaxvrl.models.moe import sparse_layers
from jaxvrl.parallel import sharding

DTYPES = ("auto", *models.DTYPES)


@dataclasses.dataclass(frozen=True)
class Layout:
    """mesh: the rollout's mesh (None: wherever the arrays are, one device); dtype: the
    compute dtype of the sampling model ("float32", "bfloat16"; None: the model's own)."""

    mesh: Mesh | None = None
    dtype: str | None = None


@struct.dataclass
class RolloutParams:
    """The policy's parameters in a sampler's layout (`Sampler.prepare`): `params` for the
    model structure `graphdef` (LoRA merged, the rollout's compute dtype), placed for
    `layout`."""

    params: Any
    graphdef: Any = struct.field(pytree_node=False)
    layout: Layout = struct.field(pytree_node=False)


def rollout_mesh(
    mesh: Mesh,
    data: int = -1,
    tensor: int = 0,
    kv_heads: int = 0,
    weight_bytes: float = 0,
    cache_bytes: float = 0,
    expert: int = 1,
) -> Mesh:
    """A mesh (data, fsdp=1, expert, sequence=1, tensor) over the devices of `mesh` for the
    sampler.

    tensor: devices per tensor group (0: chosen among the divisors of a host's devices by
    `rollout_sizes`, so a decode step reads as few bytes per device as it can); expert:
    tensor groups whose devices each hold 1 / expert of a mixture-of-experts model's experts
    (the rows split over them as over data, every other weight whole in each); data: the
    number of groups of expert x tensor devices (-1: the devices left). Devices are taken
    host by host (in `mesh`'s order within a host), so a group that fits in a host lies
    within one, its all-reduces and all-to-alls never leave it, and each host's prompts stay
    on its own devices. Raises ValueError naming the sizes when they do not fit the
    devices."""
    devices = list(mesh.devices.reshape(-1))
    hosts = len({d.process_index for d in devices})
    sizes = rollout_sizes(
        len(devices), hosts, data, tensor, kv_heads, weight_bytes, cache_bytes, expert
    )
    order = sorted(range(len(devices)), key=lambda i: (devices[i].process_index, i))
    grid = np.asarray([devices[i] for i in order]).reshape(tuple(sizes.values()))
    return Mesh(grid, sharding.MESH_AXES)


def prefill_mesh(mesh: Mesh, sequence: int) -> Mesh:
    """The prefill's mesh for the rollout mesh `mesh` (data, 1, 1, 1, tensor): its data axis
    cut into (data / sequence, sequence), over the same devices in the same order. A prompt's
    tokens split over `sequence` neighbouring data groups (sequence parallelism:
    `models/attention.py`); rows over (data, sequence) there are the decode mesh's rows, so
    the prefill hands its carry to the decode steps in place (`for_decode`). Raises
    ValueError naming the sizes where `sequence` does not divide the data groups."""
    if sequence == 1:
        return mesh
    if any(mesh.shape[a] != 1 for a in ("fsdp", "sequence")):
        raise ValueError(f"a rollout mesh has no fsdp or sequence axis, got {dict(mesh.shape)}")
    if mesh.shape["expert"] != 1:
        raise ValueError(
            f"a prompt split over {sequence} devices and experts split over "
            f"{mesh.shape['expert']} are not supported together: set one of them to 1"
        )
    data, tensor = mesh.shape["data"], mesh.shape["tensor"]
    if sequence < 1 or data % sequence:
        raise ValueError(
            f"a prompt split over {sequence} devices needs a number of data groups it divides, "
            f"the rollout mesh has {data} (of {tensor} devices each)"
        )
    grid = mesh.devices.reshape(data // sequence, 1, 1, sequence, tensor)
    return Mesh(grid, sharding.MESH_AXES)


# the decode steps' layout seen from a prefill mesh: rows over its data and sequence axes (the
# decode mesh's data axis), a row's positions whole
_DECODE_RULES = {
    **sharding.LOGICAL_RULES,
    "batch": (*sharding.ROW_AXES, "sequence"),
    "length": None,
}


def for_decode(x: jax.Array, axes: tuple = ("batch",)) -> jax.Array:
    """A prefill's output `x` in the layout decode steps take it (logical `axes` of its
    leading dimensions, the rest whole) where the program is traced for a prefill mesh
    (`prefill_mesh`, a sequence axis); else `x` as it is."""
    mesh = sharding.traced_mesh()
    if mesh is None or mesh.shape["sequence"] == 1:
        return x
    axes = (*axes, *(None,) * (x.ndim - len(axes)))
    spec = sharding.logical_to_spec(axes, x.shape, mesh, _DECODE_RULES)
    return jax.lax.with_sharding_constraint(x, spec)


def onto(tree, mesh: Mesh | None):
    """The arrays of `tree` that lie on another mesh over the same devices put on `mesh`,
    split alike: rows over a prefill mesh's (data, sequence) become rows over the decode
    mesh's data (`prefill_mesh`: the same devices in the same order, so no copy), other
    splits keep their axes' names (a dimension the new mesh's axes do not divide whole)."""
    if mesh is None:
        return tree

    def one(x):
        s = getattr(x, "sharding", None)
        if not isinstance(s, NamedSharding) or s.mesh == mesh:
            return x
        spec = []
        for dim, names in zip(x.shape, (*s.spec, *(None,) * (x.ndim - len(s.spec)))):
            axes = (names,) if isinstance(names, str) else tuple(names or ())
            if "sequence" in axes and mesh.shape["sequence"] == 1:  # prefill rows -> decode
                rows = "data" in axes or s.mesh.shape["data"] == 1
                axes = tuple(a for a in axes if a not in ("data", "sequence"))
                axes = ("data", *axes) if rows else axes
            size = int(np.prod([mesh.shape[a] for a in axes]))
            spec.append((axes[0] if len(axes) == 1 else axes) if axes and dim % size == 0 else None)
        target = NamedSharding(mesh, P(*spec))
        if isinstance(x, jax.ShapeDtypeStruct):  # compiling ahead of time
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=target)
        return jax.device_put(x, target)

    return jax.tree.map(one, tree)


def rollout_sizes(
    devices: int,
    hosts: int,
    data: int = -1,
    tensor: int = 0,
    kv_heads: int = 0,
    weight_bytes: float = 0,
    cache_bytes: float = 0,
    expert: int = 1,
) -> dict:
    """The rollout mesh's axis sizes {data, fsdp: 1, expert, sequence: 1, tensor} for
    `devices` over `hosts` (`rollout_mesh`).

    tensor 0 picks t among the divisors of what a host's devices leave of `expert` groups
    (an expert group within a host where it fits one, else whole hosts of it). A decode step
    reads per device the weights over t and its group's share of the KV cache (the group's
    rows: 1 / (devices / t) of them), split over the group's devices by KV head where t
    divides the KV heads; otherwise every device of the group holds the group's whole cache
    (the model's sharding leaves an axis that does not divide a dimension unsplit). With the
    sizes given (`weight_bytes`: the weights a decode step reads, `cache_bytes`: the whole
    rollout's cache), t minimises that sum; without them, t is the largest that divides the
    KV heads.
    """
    if not tensor:
        per_host = max(devices // hosts, 1)
        room = per_host // math.gcd(per_host, expert)  # what a host's expert groups leave
        fits = [t for t in range(1, room + 1) if room % t == 0 and devices % (t * expert) == 0]
        fits = fits or [1]
        if kv_heads and weight_bytes:

            def read(t):
                by_head = t if kv_heads % t == 0 else 1
                return weight_bytes / t + cache_bytes * t / (devices * by_head)

            tensor = min(fits, key=lambda t: (read(t), t))
        else:
            tensor = max(t for t in fits if not kv_heads or kv_heads % t == 0)
    return sharding.mesh_sizes(devices, data, 1, tensor, expert)


def decode_bytes(text_cfg, rows: int, length: int, dtype) -> tuple[int, int]:
    """(weights, cache): the bytes of the text decoder's and LM head's weights one decode
    step of `rows` rows multiplies by (a mixture-of-experts layer: its router and the experts
    its rows' tokens can reach, min(experts, rows x top k)), and of the KV cache of `rows`
    rows of `length` positions, in `dtype`."""
    c = text_cfg
    d, hd = c.hidden_size, c.head_dim
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    attention = d * (q + 2 * kv) + q * d
    sparse = sum(sparse_layers(c))
    reached = min(c.num_experts, rows * c.num_experts_per_tok)
    experts = d * c.num_experts + reached * 3 * d * c.moe_intermediate_size
    dense = 3 * d * c.intermediate_size
    size = jnp.dtype(dtype).itemsize
    layers = c.num_hidden_layers * attention + sparse * experts
    weights = (layers + (c.num_hidden_layers - sparse) * dense + d * c.vocab_size) * size
    cache = 2 * c.num_hidden_layers * kv * rows * length * size
    return weights, cache


def rollout_dtype(name: str, mesh: Mesh | None, model_dtype) -> str | None:
    """`rollout.dtype` resolved: "auto" is bfloat16 where the rollout runs on accelerators
    and the model's compute dtype on the CPU; None where it is the model's compute dtype."""
    if name not in DTYPES:
        raise ValueError(f"rollout dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    model_dtype = jnp.dtype(model_dtype)
    if name == "auto":
        platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
        name = model_dtype.name if platform == "cpu" else "bfloat16"
    return None if jnp.dtype(name) == model_dtype else name


def sampling_state(graphdef, params, dtype: str | None):
    """(graphdef, state) of the sampling model: LoRA merged into the base weights, compute
    dtype `dtype` (None: the model's), every floating weight the model casts where it uses
    it cast to that dtype, no expert capacity (an expert axis drops no pair)."""
    model = nnx.merge(graphdef, params)
    if lora.wrapped(model):
        model = lora.merge_lora(model)
    if dtype is not None:
        model.set_dtype(jnp.dtype(dtype))
    model.set_expert_capacity(0.0)  # the sampler drops no (token, expert) pair
    graph, state = nnx.split(model)
    return graph, compute_params(graph, state)


# quantized weights (QLoRA): dequantized in their own dtype before the cast, left as stored
_STORED = ("qvalue", "scale", "zero_point")


def compute_params(graphdef, params):
    """`params` with every floating leaf the model casts to its compute dtype where it uses
    it (kernels, embeddings, biases, norms' weights, LoRA adapters) cast to that dtype once:
    the same numbers at every use, read at half the bytes when float32 master weights serve
    a bfloat16 model. The sampler calls it inside its jitted program (a no-op on prepared
    parameters, already in the compute dtype)."""
    dtype = jnp.dtype(nnx.merge(graphdef, params).dtype)

    def cast(path, x):
        name = sharding.leaf_name(path)
        if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == dtype:
            return x
        return x if name.rsplit(".", 1)[-1] in _STORED else x.astype(dtype)

    return jax.tree_util.tree_map_with_path(cast, params)


# the rollout's weights: an expert axis splits the experts only (each device of an expert group
# holds every other weight as a data group's devices do), the rows split over it
_ROLLOUT_RULES = {**sharding.LOGICAL_RULES, "embed": ("fsdp", "sequence")}


def param_shardings(state, mesh: Mesh):
    """The shardings of the sampling model's parameters `state` on the rollout mesh `mesh`."""
    return sharding.param_shardings(state, mesh, _ROLLOUT_RULES)


def _is_abstract(tree) -> bool:
    return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))


def _sampling_params(graphdef, dtype: str | None, params):
    """The state half of `sampling_state`: what `Preparer` converts parameters to."""
    return sampling_state(graphdef, params, dtype)[1]


class Preparer:
    """Puts parameters of one model structure into one layout (`prepare`). Its conversion is
    a jit of a module-level function with the structure and dtype static: jax's cache keeps
    one program per structure, layout and shapes, for every preparer."""

    def __init__(self, graphdef, layout: Layout):
        self.graphdef, self.layout = graphdef, layout
        self._targets: dict = {}  # tree structure -> (graphdef, abstract state, shardings)

    def target(self, params):
        """(graphdef, abstract state, shardings or None) of the prepared parameters."""
        key = jax.tree.structure(params)
        if key not in self._targets:
            seen = {}

            def state(p):
                seen["graph"], out = sampling_state(self.graphdef, p, self.layout.dtype)
                return out

            abstract = jax.eval_shape(state, params)
            mesh = self.layout.mesh
            shardings = None if mesh is None else param_shardings(abstract, mesh)
            self._targets[key] = (seen["graph"], abstract, shardings)
        return self._targets[key]

    def __call__(self, params) -> RolloutParams:
        if isinstance(params, RolloutParams):
            if params.layout != self.layout:
                raise ValueError(
                    f"these parameters were prepared for {params.layout}, this sampler samples "
                    f"with {self.layout}"
                )
            return params
        graph, abstract, shardings = self.target(params)
        if _is_abstract(params):  # for compiling ahead of time
            if shardings is not None:
                abstract = jax.tree.map(
                    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                    abstract,
                    shardings,
                )
            return RolloutParams(abstract, graph, self.layout)
        if self._unchanged(params, graph, abstract, shardings):
            return RolloutParams(params, graph, self.layout)
        return RolloutParams(self._convert(params, shardings), graph, self.layout)

    def _unchanged(self, params, graph, abstract, shardings) -> bool:
        """Whether the parameters already are what `prepare` would make (one device, no LoRA,
        the model's dtype): then they are used as they are, without a copy."""
        if graph != self.graphdef:
            return False
        leaves, targets = jax.tree.leaves(params), jax.tree.leaves(abstract)
        if any(x.dtype != t.dtype for x, t in zip(leaves, targets)):
            return False
        if shardings is None:
            return True
        return all(
            getattr(x, "sharding", None) == s for x, s in zip(leaves, jax.tree.leaves(shardings))
        )

    def _convert(self, params, shardings):
        how = (self.graphdef, self.layout.dtype)
        if shardings is None:
            return jax.jit(_sampling_params, static_argnums=(0, 1))(*how, params)
        # one program cuts the new weights onto a mesh of the rollout's shape over the
        # devices in the order the parameters' arrays have (a program's inputs and outputs
        # share one device order); where the rollout mesh orders them otherwise, whole
        # shards then move to their devices
        order = _device_order(params)
        mesh = self.layout.mesh
        if set(order) != set(mesh.devices.flat):  # the sampler's own devices: cast, then copy
            src = jax.tree.leaves(params)[0].sharding
            cast = None
            if isinstance(src, NamedSharding):  # cast into a layout of the source's mesh
                cast = sharding.param_shardings(self.target(params)[1], src.mesh)
            out = jax.jit(_sampling_params, static_argnums=(0, 1), out_shardings=cast)(*how, params)
            return across(out, shardings)
        staging = mesh
        if order != list(mesh.devices.flat):
            staging = Mesh(np.asarray(order).reshape(mesh.devices.shape), mesh.axis_names)
        staged = jax.tree.map(lambda s: NamedSharding(staging, s.spec), shardings)
        fn = jax.jit(_sampling_params, static_argnums=(0, 1), out_shardings=staged)
        out = fn(*how, params)
        return out if staging is mesh else jax.device_put(out, shardings)


def across(tree, shardings):
    """`tree` (arrays on one set of devices) put into `shardings` (on another set). In one
    process a `jax.device_put`. Multi-controller jax moves an array only within one device
    set, so with several processes each array's shards first go to a mirror mesh on the
    target devices (each source device paired with a target device of its own process) in
    one program over both sets, a collective-permute, and are resharded there; where the
    sets cannot be paired so, or the arrays are not on a mesh, through the hosts."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)
    leaves, treedef = jax.tree.flatten(tree)
    src = leaves[0].sharding
    targets = jax.tree.leaves(shardings)
    pairs = None
    if isinstance(src, NamedSharding):
        pairs = _pairs(list(src.mesh.devices.flat), list(targets[0].device_set))
    if pairs is None or any(x.sharding.mesh != src.mesh for x in leaves):
        warnings.warn(  # once: python's default filter
            "the rollout's devices do not pair with the train step's on every host: the "
            "weights go through the hosts at each copy",
            stacklevel=2,
        )
        host = [multihost_utils.process_allgather(x, tiled=True) for x in leaves]
        return jax.device_put(jax.tree.unflatten(treedef, host), shardings)
    mesh = src.mesh
    mirror = Mesh(np.vectorize(pairs.get, otypes=[object])(mesh.devices), mesh.axis_names)
    both = Mesh(np.stack([mesh.devices, mirror.devices]), ("side", *mesh.axis_names))
    outs = [NamedSharding(both, P("side", *x.sharding.spec)) for x in leaves]
    stacked = []
    for x, spec in zip(leaves, outs):  # [2, ...]: the shards, zeros on their mirrors
        bufs = []
        for shard in x.addressable_shards:
            bufs.append(shard.data[None])
            bufs.append(jnp.zeros((1, *shard.data.shape), x.dtype, device=pairs[shard.device]))
        stacked.append(jax.make_array_from_single_device_arrays((2, *x.shape), spec, bufs))
    swapped = jax.jit(lambda ys: [y[::-1] for y in ys], out_shardings=outs)(stacked)
    moved = []
    for x, y in zip(leaves, swapped):
        mine = [s.data[0] for s in y.addressable_shards if s.device in pairs.values()]
        spec = NamedSharding(mirror, x.sharding.spec)
        moved.append(jax.make_array_from_single_device_arrays(x.shape, spec, mine))
    return jax.device_put(jax.tree.unflatten(treedef, moved), shardings)


def _key(d):
    return (d.process_index, d.id)


def _pairs(src: list, dst: list) -> dict | None:
    """{source device: target device} pairing each process's devices in order; None when a
    process holds a different number of each."""
    pairs = {}
    for p in {d.process_index for d in src} | {d.process_index for d in dst}:
        a = sorted((d for d in src if d.process_index == p), key=_key)
        b = sorted((d for d in dst if d.process_index == p), key=_key)
        if len(a) != len(b):
            return None
        pairs.update(zip(a, b))
    return pairs


def _device_order(params) -> list:
    """The devices of the parameters' arrays in their sharding's order."""
    s = jax.tree.leaves(params)[0].sharding
    if isinstance(s, NamedSharding):
        return list(s.mesh.devices.flat)
    return sorted(s.device_set, key=lambda d: d.id)
