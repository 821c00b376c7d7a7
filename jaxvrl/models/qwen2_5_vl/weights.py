"""HF checkpoint <-> Flax params: one table of key patterns, loading and export.

Each row of `KEY_TABLE` maps an HF tensor name to a param path, both as templates whose
`{name}` fields match one dotted component, plus how the tensor is transformed:
- "linear": torch Linear weight [out, in] <-> Flax kernel [in, out] (transpose);
- "patch":  Conv3d weight [E, C, T, P, P] <-> kernel [C*T*P*P, E] (a linear map on patches);
- "copy":   unchanged.
A new model (Qwen2-VL, Qwen3-VL) is a new table and a config.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxvrl.models.qwen2_5_vl.config import ConfigError, Qwen2_5_VLConfig
from jaxvrl.models.qwen2_5_vl.model import Qwen2_5_VL

KEY_TABLE: tuple[tuple[str, str, str], ...] = (
    ("visual.patch_embed.proj.weight", "visual.patch_embed.kernel", "patch"),
    ("visual.blocks.{i}.{norm}.weight", "visual.blocks.{i}.{norm}.weight", "copy"),
    ("visual.blocks.{i}.attn.{proj}.weight", "visual.blocks.{i}.attn.{proj}.kernel", "linear"),
    ("visual.blocks.{i}.attn.{proj}.bias", "visual.blocks.{i}.attn.{proj}.bias", "copy"),
    ("visual.blocks.{i}.mlp.{proj}.weight", "visual.blocks.{i}.mlp.{proj}.kernel", "linear"),
    ("visual.blocks.{i}.mlp.{proj}.bias", "visual.blocks.{i}.mlp.{proj}.bias", "copy"),
    ("visual.merger.ln_q.weight", "visual.merger.ln_q.weight", "copy"),
    ("visual.merger.mlp.0.weight", "visual.merger.fc1.kernel", "linear"),
    ("visual.merger.mlp.0.bias", "visual.merger.fc1.bias", "copy"),
    ("visual.merger.mlp.2.weight", "visual.merger.fc2.kernel", "linear"),
    ("visual.merger.mlp.2.bias", "visual.merger.fc2.bias", "copy"),
    ("model.embed_tokens.weight", "model.embed_tokens.embedding", "copy"),
    ("model.layers.{i}.{norm}.weight", "model.layers.{i}.{norm}.weight", "copy"),
    (
        "model.layers.{i}.self_attn.{proj}.weight",
        "model.layers.{i}.self_attn.{proj}.kernel",
        "linear",
    ),
    ("model.layers.{i}.self_attn.{proj}.bias", "model.layers.{i}.self_attn.{proj}.bias", "copy"),
    ("model.layers.{i}.mlp.{proj}.weight", "model.layers.{i}.mlp.{proj}.kernel", "linear"),
    ("model.norm.weight", "model.norm.weight", "copy"),
    ("lm_head.weight", "lm_head.kernel", "linear"),
)

# Prefixes of transformers 4.5x saves (`Qwen2_5_VLModel` nesting) -> the canonical layout.
KEY_ALIASES: tuple[tuple[str, str], ...] = (
    (r"^model\.language_model\.", "model."),
    (r"^model\.visual\.", "visual."),
)
# Buffers some exporters write; they carry no parameters.
IGNORED_KEYS = re.compile(r"(rotary_emb\.inv_freq|rotary_pos_emb\.inv_freq)$")


def _regex(template: str) -> re.Pattern:
    parts = re.split(r"(\{\w+\})", template)
    body = "".join(f"(?P<{p[1:-1]}>[^.]+)" if p.startswith("{") else re.escape(p) for p in parts)
    return re.compile(f"^{body}$")


_HF_RULES = [(_regex(hf), path, kind) for hf, path, kind in KEY_TABLE]
_PATH_RULES = [(_regex(path), hf, kind) for hf, path, kind in KEY_TABLE]


def hf_to_path(key: str) -> tuple[str, str] | None:
    """HF tensor name -> (dotted param path, transform), or None if unknown."""
    for pattern, repl in KEY_ALIASES:
        key = re.sub(pattern, repl, key)
    for rx, path, kind in _HF_RULES:
        m = rx.match(key)
        if m:
            return path.format(**m.groupdict()), kind
    return None


def path_to_hf(path: str) -> tuple[str, str]:
    for rx, hf, kind in _PATH_RULES:
        m = rx.match(path)
        if m:
            return hf.format(**m.groupdict()), kind
    raise KeyError(f"param {path} has no HF name in KEY_TABLE")


def _from_hf(x: np.ndarray, kind: str) -> np.ndarray:
    if kind == "linear":
        return x.T
    if kind == "patch":
        return x.reshape(x.shape[0], -1).T
    return x


def _to_hf(x: np.ndarray, kind: str, target_shape=None) -> np.ndarray:
    if kind == "linear":
        return x.T
    if kind == "patch":
        return x.T.reshape(target_shape)
    return x


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


def _dotted(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def load(path, dtype=jnp.float32, param_dtype=None) -> Qwen2_5_VL:
    """Load an HF Qwen2.5-VL checkpoint directory (config.json + *.safetensors) without torch.

    dtype: compute dtype; param_dtype: stored parameter dtype (default: dtype).
    """
    path = os.fspath(path)
    param_dtype = dtype if param_dtype is None else param_dtype
    cfg = Qwen2_5_VLConfig.from_pretrained(path)
    abstract = nnx.eval_shape(
        lambda: Qwen2_5_VL(cfg, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0))
    )
    graphdef, state = nnx.split(abstract)
    wanted = {_dotted(p): v for p, v in nnx.to_flat_state(state)}
    loaded: dict[str, np.ndarray] = {}
    unknown = []
    files = _shard_files(path)
    by_file: dict[str, list[str]] = {}
    for key, file in files.items():
        by_file.setdefault(file, []).append(key)
    for file, keys in by_file.items():
        with safe_open(file, "np") as f:
            for key in keys:
                mapped = hf_to_path(key)
                if mapped is None:
                    if not IGNORED_KEYS.search(key):
                        unknown.append(f"{key} ({os.path.basename(file)})")
                    continue
                p, kind = mapped
                if p == "lm_head.kernel" and cfg.tie_word_embeddings:
                    continue
                if p not in wanted:
                    unknown.append(f"{key} ({os.path.basename(file)})")
                    continue
                arr = _from_hf(f.get_tensor(key), kind)
                want = wanted[p]
                if tuple(arr.shape) != tuple(want.shape):
                    raise ConfigError(
                        f"{file}: tensor {key} has shape {tuple(f.get_slice(key).get_shape())}, "
                        f"config.json implies {tuple(_to_hf_shape(want.shape, kind))}"
                    )
                loaded[p] = arr
    if unknown:
        raise ConfigError(f"{path}: tensors not part of Qwen2.5-VL: {', '.join(unknown[:10])}")
    missing = sorted(set(wanted) - set(loaded))
    if missing:
        names = [path_to_hf(m)[0] for m in missing[:10]]
        raise ConfigError(f"{path}: checkpoint lacks tensors: {', '.join(names)}")
    for p, var in nnx.to_flat_state(state):
        var.set_value(jnp.asarray(loaded[_dotted(p)], dtype=var.dtype))
    return nnx.merge(graphdef, state)


def _to_hf_shape(shape, kind):
    return tuple(reversed(shape)) if kind == "linear" else tuple(shape)


def save(model: Qwen2_5_VL, path, *, tokenizer_dir=None, dtype=None) -> None:
    """Write an HF checkpoint directory (config.json, model.safetensors) that transformers loads.

    tokenizer_dir: copy tokenizer files from here too. dtype: cast tensors (default: as stored).
    """
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    cfg = model.config
    _, state = nnx.split(model, nnx.Param)
    tensors = {}
    v = cfg.vision
    patch_shape = (v.hidden_size, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
    for p, var in nnx.to_flat_state(state):
        key, kind = path_to_hf(_dotted(p))
        arr = np.asarray(jax.device_get(var.get_value()))
        if dtype is not None:
            arr = arr.astype(dtype)
        tensors[key] = np.ascontiguousarray(_to_hf(arr, kind, patch_shape))
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    hf = cfg.to_hf_dict()
    hf["dtype"] = str(next(iter(tensors.values())).dtype)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    if tokenizer_dir is not None:
        for name in os.listdir(tokenizer_dir):
            if name.startswith(
                (
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
            ):
                shutil.copy2(os.path.join(tokenizer_dir, name), os.path.join(path, name))
