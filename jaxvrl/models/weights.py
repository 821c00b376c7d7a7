"""HF checkpoint <-> Flax params: one table of key patterns, loading and export.

Each row of `KEY_TABLE` maps an HF tensor name to a param path, both as templates whose
`{name}` fields match one dotted component, plus how the tensor is transformed:
- "linear": torch Linear weight [out, in] <-> Flax kernel [in, out] (transpose);
- "patch":  Conv3d weight [E, C, T, P, P] <-> kernel [C*T*P*P, E] (a linear map on patches);
- "copy":   unchanged;
- "experts": all experts at once, [E, out, in] (save_pretrained) <-> kernel [E, in, out];
  a tensor already [E, in, out] (published Qwen3-VL-MoE files) is read as it is (`_from_hf`).
A family's table is a `KeyTable` (`jaxvrl/models/<family>/weights.py`).

Per-layer params (`model.layers.{i}...`) of a scanned model are stacked on a leading layer
axis ([L, D, F]; `stacked_path`, `layer_path`). Experts are stacked on an axis of their own:
HF's `...mlp.experts.{e}.gate_proj.weight` is index e of `...mlp.experts.gate_proj.kernel`
[E, D, F] (`expert_path`; [L, E, D, F] when layers are stacked), or one tensor for all
(`KeyTable.per_expert` false: Qwen3-VL-MoE's fused `experts.gate_up_proj`).

Export writes safetensors shards tensor by tensor (`write_shards`): the header is planned from
shapes and dtypes, then each tensor is produced, written and dropped, so host memory holds one
tensor at a time, not the model.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import re
import shutil
import struct
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

from jaxvrl.config import ConfigError


@dataclasses.dataclass(frozen=True)
class KeyTable:
    """A family's HF tensor names <-> param paths: rows of (HF template, path template,
    transform), and `aliases` (regex, replacement) that rewrite other savers' prefixes to the
    table's before matching."""

    rows: tuple[tuple[str, str, str], ...]
    aliases: tuple[tuple[str, str], ...] = ()

    @functools.cached_property
    def _rules(self):
        return (
            [(_regex(hf), path, kind) for hf, path, kind in self.rows],
            [(_regex(path), hf, kind) for hf, path, kind in self.rows],
        )

    @functools.cached_property
    def per_expert(self) -> bool:
        """Whether the table names each expert's tensors (`experts.{e}.`) rather than all
        experts' at once (rows of kind "experts")."""
        return not any(kind == "experts" for *_, kind in self.rows)

    def hf_to_path(self, key: str) -> tuple[str, str] | None:
        """HF tensor name -> (dotted param path, transform), or None if unknown."""
        for pattern, repl in self.aliases:
            key = re.sub(pattern, repl, key)
        for rx, path, kind in self._rules[0]:
            m = rx.match(key)
            if m:
                return path.format(**m.groupdict()), kind
        return None

    def path_to_hf(self, path: str) -> tuple[str, str]:
        for rx, hf, kind in self._rules[1]:
            m = rx.match(path)
            if m:
                return hf.format(**m.groupdict()), kind
        raise KeyError(f"param {path} has no HF name in the key table")


# Buffers some exporters write; they carry no parameters.
IGNORED_KEYS = re.compile(r"(rotary_emb\.inv_freq|rotary_pos_emb\.inv_freq)$")
# Files of a checkpoint directory that belong to the tokenizer and the processor (by prefix).
PROCESSOR_FILES = (
    "tokenizer",
    "special_tokens",
    "vocab",
    "merges",
    "chat_template",
    "added_tokens",
    "preprocessor",
    "video_preprocessor",
    "processor",
    "generation_config",
)
SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size
INDEX_FILE = "model.safetensors.index.json"
_SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


# Modules whose params a scanned model stacks on a leading layer axis.
STACKED_MODULES = ("model.layers", "visual.blocks")
_LAYER = re.compile(r"^(?P<prefix>model\.layers|visual\.blocks)\.(?P<i>\d+)\.(?P<rest>.+)$")


def stacked_path(path: str) -> tuple[str, int | None]:
    """A per-layer param path -> (the stacked param's path, layer index), other paths ->
    (path, None): `model.layers.3.mlp.up_proj.kernel` -> (`model.layers.mlp.up_proj.kernel`,
    3)."""
    m = _LAYER.match(path)
    if m is None:
        return path, None
    return f"{m['prefix']}.{m['rest']}", int(m["i"])


# a param of stacked experts (no expert index after `experts`), and one expert's
_EXPERTS = re.compile(r"\.experts\.(?!\d+\.)")
_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<e>\d+)\.(?P<rest>.+)$")


def expert_path(path: str) -> tuple[str, int | None]:
    """One expert's param path -> (the experts' stacked param, expert index), other paths ->
    (path, None): `model.layers.3.mlp.experts.5.up_proj.kernel` ->
    (`model.layers.3.mlp.experts.up_proj.kernel`, 5)."""
    m = _EXPERT.match(path)
    if m is None:
        return path, None
    return f"{m['prefix']}.{m['rest']}", int(m["e"])


def param_index(path: str, scan_layers: bool) -> tuple[str, tuple[int, ...]]:
    """An HF tensor's param path (per layer, per expert) -> (the model's param path, the
    index of the tensor in it): the layer where layers are stacked, then the expert."""
    target, i = stacked_path(path) if scan_layers else (path, None)
    target, e = expert_path(target)
    return target, tuple(j for j in (i, e) if j is not None)


def is_stacked(path: str) -> bool:
    """Whether `path` is a stacked param of a scanned model (a layer module without index)."""
    return any(
        path.startswith(p + ".") and not path[len(p) + 1 :].split(".", 1)[0].isdigit()
        for p in STACKED_MODULES
    )


def layer_path(path: str, i: int) -> str:
    """A stacked param path and a layer index -> the per-layer path (inverse of
    `stacked_path`)."""
    for p in STACKED_MODULES:
        if path.startswith(p + "."):
            return f"{p}.{i}{path[len(p) :]}"
    raise KeyError(f"{path} is not a param of {' or '.join(STACKED_MODULES)}")


def per_layer(
    shapes, per_expert: bool = True
) -> list[tuple[str, str, int | tuple | None, tuple[int, ...]]]:
    """(path, shape) pairs of a model's params, scanned or not -> (per-layer path, the path,
    index, per-layer shape) for every HF tensor; index: None, the layer or expert (an int),
    or (layer, expert), so that `param[index]` is the tensor. A stacked param gives its
    tensors one after the other (param-major), so a reader of stacked arrays reads each
    once. per_expert: experts' kernels give one tensor per expert (`KeyTable.per_expert`)."""
    out = []
    for path, shape in shapes:
        shape = tuple(shape)
        rows = [(path, ())]
        if is_stacked(path):
            rows = [(layer_path(path, i), (i,)) for i in range(shape[0])]
        if per_expert and _EXPERTS.search(path):
            n = shape[len(rows[0][1])]
            rows = [(_one_expert(p, e), ix + (e,)) for p, ix in rows for e in range(n)]
        lead = len(rows[0][1])
        out += [(p, path, _index(ix), shape[lead:]) for p, ix in rows]
    return out


def _one_expert(path: str, e: int) -> str:
    return _EXPERTS.sub(f".experts.{e}.", path, count=1)


def _index(ix: tuple[int, ...]) -> int | tuple | None:
    return None if not ix else ix[0] if len(ix) == 1 else ix


def _regex(template: str) -> re.Pattern:
    parts = re.split(r"(\{\w+\})", template)
    body = "".join(f"(?P<{p[1:-1]}>[^.]+)" if p.startswith("{") else re.escape(p) for p in parts)
    return re.compile(f"^{body}$")


def _from_hf(x: np.ndarray, kind: str, shape=None) -> np.ndarray:
    """An HF tensor -> the param's layout (shape: the param's, which "experts" reads)."""
    if kind == "linear":
        return x.T
    if kind == "experts" and x.shape == _to_hf_shape(shape, kind):
        return x.swapaxes(-1, -2)
    if kind == "patch":
        return x.reshape(x.shape[0], -1).T
    return x


def _to_hf(x: np.ndarray, kind: str, target_shape=None) -> np.ndarray:
    if kind == "linear":
        return x.T
    if kind == "experts":
        return x.swapaxes(-1, -2)
    if kind == "patch":
        return x.T.reshape(target_shape)
    return x


def patch_shape(cfg) -> tuple[int, ...]:
    """HF's Conv3d weight shape [E, C, T, P, P] of the patch embedding."""
    v = cfg.vision
    return (v.hidden_size, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)


def hf_tensor(path: str, x, cfg, keys: KeyTable, dtype=None) -> tuple[str, np.ndarray]:
    """Dotted param path and its Flax array -> (HF tensor name, contiguous HF array) by `keys`."""
    key, kind = keys.path_to_hf(path)
    arr = np.asarray(x)
    if dtype is not None:
        arr = arr.astype(dtype)
    shape = patch_shape(cfg) if kind == "patch" else None
    return key, np.ascontiguousarray(_to_hf(arr, kind, shape))


def hf_shape(path: str, shape, cfg, keys: KeyTable) -> tuple[str, tuple[int, ...]]:
    """Dotted param path and its Flax shape -> (HF tensor name, HF shape)."""
    key, kind = keys.path_to_hf(path)
    return key, patch_shape(cfg) if kind == "patch" else _to_hf_shape(shape, kind)


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One tensor of a safetensors file, before its values exist."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


def shard_plan(specs: list[TensorSpec], max_shard_bytes: int = SHARD_BYTES) -> dict[str, list]:
    """File name -> its tensors, in order: a new shard starts where the next tensor would take
    the current one past `max_shard_bytes` (a larger tensor gets a shard of its own). One shard
    is `model.safetensors`; several are `model-0000i-of-0000n.safetensors`, as transformers
    names them."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for s in specs:
        if shards[-1] and size + s.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += s.nbytes
    if len(shards) == 1:
        return {"model.safetensors": shards[0]}
    n = len(shards)
    return {f"model-{i + 1:05d}-of-{n:05d}.safetensors": sh for i, sh in enumerate(shards)}


def _write_safetensors(f, specs: list[TensorSpec], produce: Callable[[str], np.ndarray]) -> None:
    """The safetensors layout: u64 header size, JSON header (padded to 8 bytes), raw data."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for s in specs:
        dt = _SAFETENSORS_DTYPES.get(np.dtype(s.dtype).name)
        if dt is None:
            raise ValueError(
                f"{s.name}: dtype {s.dtype} is not exported (float32, bfloat16, float16)"
            )
        header[s.name] = {
            "dtype": dt,
            "shape": list(s.shape),
            "data_offsets": [offset, offset + s.nbytes],
        }
        offset += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    for s in specs:
        arr = produce(s.name)
        if tuple(arr.shape) != tuple(s.shape) or arr.dtype != np.dtype(s.dtype):
            raise ValueError(
                f"{s.name}: produced {arr.dtype}{list(arr.shape)}, planned {s.dtype}{list(s.shape)}"
            )
        f.write(np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data)


def _open_local(name: str, path: str):
    return open(os.path.join(path, name), "wb")


def write_shards(
    specs: list[TensorSpec],
    produce: Callable[[str], np.ndarray],
    open_file: Callable[[str], object],
    max_shard_bytes: int = SHARD_BYTES,
    on_shard: Callable[[str, int], None] | None = None,
) -> list[str]:
    """Writes `specs` as safetensors shards (plus `model.safetensors.index.json` when there
    are several), each tensor made by `produce(name)` just before it is written: host memory
    holds one tensor. open_file(name): a binary file to write (local or remote). on_shard(name,
    bytes) is called after each shard. -> the files written."""
    plan = shard_plan(specs, max_shard_bytes)
    for name, shard in plan.items():
        with open_file(name) as f:
            _write_safetensors(f, shard, produce)
        if on_shard is not None:
            on_shard(name, sum(s.nbytes for s in shard))
    files = list(plan)
    if len(plan) > 1:
        index = {
            "metadata": {"total_size": sum(s.nbytes for s in specs)},
            "weight_map": {s.name: name for name, shard in plan.items() for s in shard},
        }
        with open_file(INDEX_FILE) as f:
            f.write(json.dumps(index, indent=2).encode())
        files.append(INDEX_FILE)
    return files


def _shard_files(path: str) -> dict[str, str]:
    """tensor name -> file holding it, for single-file or index-sharded checkpoints."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        for file in sorted(set(weight_map.values())):
            if not os.path.exists(os.path.join(path, file)):
                raise FileNotFoundError(f"{index}: shard {file} is missing from {path}")
        return {k: os.path.join(path, v) for k, v in weight_map.items()}
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files (an HF checkpoint is needed)")
    out = {}
    for file in files:
        full = os.path.join(path, file)
        with safe_open(full, "np") as f:
            out.update({k: full for k in f.keys()})
    return out


def _stored_head_differs(files: dict, table) -> bool:
    """Whether the checkpoint's files ({key: file}) store an output head that is not its
    token embedding."""
    head = next((k for k in files if (table.hf_to_path(k) or ("",))[0] == "lm_head.kernel"), None)
    embed = next((k for k in files if k.endswith("embed_tokens.weight")), None)
    if head is None or embed is None:
        return False
    tensors = []
    for key in (head, embed):
        with safe_open(files[key], "np") as f:
            tensors.append(f.get_tensor(key))
    return tensors[0].shape != tensors[1].shape or not np.array_equal(*tensors)


def _dotted(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def load(
    path,
    family,
    build,
    cfg,
    dtype=jnp.float32,
    param_dtype=None,
    attention: str = "auto",
    scan_layers: bool = True,
):
    """The model `build(cfg, ...)` (`jaxvrl.models.model.Model`) of `family` (a
    `jaxvrl.models.families.Family`) for `cfg`, filled from the HF checkpoint directory `path`
    (*.safetensors) without torch.

    dtype: compute dtype; param_dtype: stored parameter dtype (default: dtype); attention:
    the attention implementation; scan_layers: stacked, scanned layers: tensor
    `model.layers.{i}...` fills index i of the stacked param, in place, one tensor at a time.
    """
    path = os.fspath(path)
    param_dtype = dtype if param_dtype is None else param_dtype
    table: KeyTable = family.keys
    files = _shard_files(path)
    if cfg.tie_word_embeddings and _stored_head_differs(files, table):
        # transformers then keeps the stored head (it warns and does not tie): so do we
        logging.getLogger("jaxvrl").warning(
            "%s: config.json ties the output head to the embeddings, but the checkpoint stores "
            "an lm_head.weight that differs from them; using the stored head, as transformers "
            "does",
            path,
        )
        cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
    abstract = nnx.eval_shape(
        lambda: build(
            cfg,
            dtype=dtype,
            param_dtype=param_dtype,
            rngs=nnx.Rngs(0),
            attention=attention,
            scan_layers=scan_layers,
        )
    )
    graphdef, state = nnx.split(abstract)
    wanted = {_dotted(p): v for p, v in nnx.to_flat_state(state)}
    loaded: dict[str, np.ndarray] = {}
    filled: dict[str, set] = {}  # stacked path -> layers filled
    unknown = []
    by_file: dict[str, list[str]] = {}
    for key, file in files.items():
        by_file.setdefault(file, []).append(key)
    for file, keys in by_file.items():
        with safe_open(file, "np") as f:
            for key in keys:
                mapped = table.hf_to_path(key)
                if mapped is None:
                    if not IGNORED_KEYS.search(key):
                        unknown.append(f"{key} ({os.path.basename(file)})")
                    continue
                p, kind = mapped
                if p == "lm_head.kernel" and cfg.tie_word_embeddings:
                    continue
                target, ix = param_index(p, scan_layers)
                want = wanted.get(target)
                if want is None or any(j >= n for j, n in zip(ix, want.shape)):
                    unknown.append(f"{key} ({os.path.basename(file)})")
                    continue
                shape = want.shape[len(ix) :]
                arr = _from_hf(f.get_tensor(key), kind, tuple(shape))
                if tuple(arr.shape) != tuple(shape):
                    raise ConfigError(
                        f"{file}: tensor {key} has shape {tuple(f.get_slice(key).get_shape())}, "
                        f"config.json implies {tuple(_to_hf_shape(shape, kind))}"
                    )
                if not ix:
                    loaded[target] = arr
                    continue
                if target not in loaded:
                    loaded[target] = np.empty(want.shape, want.dtype)
                loaded[target][ix] = arr
                filled.setdefault(target, set()).add(_index(ix))
    if unknown:
        raise ConfigError(
            f"{path}: tensors not part of {family.architecture}: {', '.join(unknown[:10])}"
        )
    missing = [
        layer
        for layer, p, i, _ in per_layer(((p, v.shape) for p, v in wanted.items()), table.per_expert)
        if p not in loaded or (i is not None and i not in filled[p])
    ]
    if missing:
        names = [table.path_to_hf(m)[0] for m in missing[:10]]
        raise ConfigError(f"{path}: checkpoint lacks tensors: {', '.join(names)}")
    for p, var in nnx.to_flat_state(state):
        var.set_value(jnp.asarray(loaded.pop(_dotted(p)), dtype=var.dtype))
    return nnx.merge(graphdef, state)


def _to_hf_shape(shape, kind):
    if kind == "experts":
        return (*shape[:-2], shape[-1], shape[-2])
    return tuple(reversed(shape)) if kind == "linear" else tuple(shape)


def save(
    model, path, keys: KeyTable, *, tokenizer_dir=None, dtype=None, max_shard_bytes=SHARD_BYTES
) -> None:
    """Write an HF checkpoint directory (config.json, model.safetensors, or shards with an
    index past `max_shard_bytes`) that transformers loads.

    tokenizer_dir: copy tokenizer files from here too. dtype: cast tensors (default: as stored).
    """
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    cfg = model.config
    _, state = nnx.split(model, nnx.Param)
    flat = {_dotted(p): var for p, var in nnx.to_flat_state(state)}
    variables = {}
    specs = []
    shapes = ((p, v.get_value().shape) for p, v in flat.items())
    for layer, dotted, i, shape in per_layer(shapes, keys.per_expert):
        key, hf = hf_shape(layer, shape, cfg, keys)
        out_dtype = np.dtype(dtype if dtype is not None else flat[dotted].get_value().dtype)
        variables[key] = (layer, dotted, i)
        specs.append(TensorSpec(key, hf, out_dtype))

    def produce(key):
        layer, dotted, i = variables[key]
        x = flat[dotted].get_value()
        return hf_tensor(layer, jax.device_get(x if i is None else x[i]), cfg, keys, dtype)[1]

    write_shards(specs, produce, lambda name: _open_local(name, path), max_shard_bytes)
    hf = cfg.to_hf_dict()
    hf["dtype"] = str(specs[0].dtype)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    if tokenizer_dir is not None:
        for name in os.listdir(tokenizer_dir):
            if name.startswith(PROCESSOR_FILES):
                shutil.copy2(os.path.join(tokenizer_dir, name), os.path.join(path, name))
