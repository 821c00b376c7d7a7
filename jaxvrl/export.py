"""A run's policy as a Hugging Face checkpoint directory, for transformers, vLLM or SGLang.

    python -m jaxvrl.export --workdir RUN [--step N] --out DIR [--dtype bfloat16|float32]
        [--push_to_hub org/name [--private]]

RUN and DIR are local paths or gs:// URLs. From the latest checkpoint in `RUN/checkpoints` (or
step N) only the policy's parameters are read, tensor by tensor onto the host: no optimizer
state, no critic, no train state on a device, so host memory stays near one copy of the
weights (a run with scanned layers: one stacked param at a time, written as its L per-layer
tensors). LoRA adapters are merged (W + A B alpha / r), QLoRA's quantized bases dequantized.
DIR gets the base model's config.json (its dtype set to the export's), the weights as
safetensors (`model.safetensors`, or `model-0000i-of-0000n.safetensors` shards of at most
`--max_shard_size` with `model.safetensors.index.json`), generation_config.json and the
tokenizer/processor files of the base model.

What the run started from (base model path, dtypes, LoRA settings) is read from `RUN/run.json`,
which `python -m jaxvrl.train` writes when a run starts; `--base_model` points elsewhere (a
moved base model, or a full fine-tuning run from before run.json existed).

`--push_to_hub org/name` then uploads DIR's exported files to that Hugging Face Hub model
repository in one commit (created if missing, `--private` then; HF_TOKEN and HF_ENDPOINT as
huggingface_hub reads them; weight files of an earlier push that this one does not replace are
removed). A push that fails leaves the export in DIR and exits with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import sys
import tempfile
import time

import numpy as np

from jaxvrl import hub, models
from jaxvrl.config import ConfigError
from jaxvrl.data.tasks import TASKS
from jaxvrl.logging import show_logs
from jaxvrl.remote import bound_remote_io, forget_listings, is_remote

log = logging.getLogger("jaxvrl")
RUN_INFO = "run.json"
EMBEDDED = models.EMBEDDED
DTYPES = ("float32", "bfloat16", "float16")
HEAD = "lm_head.kernel"  # the output head's param (absent where tied)
# Files copied from the base model beside the weights, by prefix (config.json is rewritten).
_LICENSE_FILES = ("LICENSE", "NOTICE")


class ExportError(ValueError):
    """A run, checkpoint step or output directory that the export cannot use."""


@dataclasses.dataclass
class Exported:
    step: int
    out: str
    files: list[str]
    weight_bytes: int
    dtype: str
    merged_adapters: int  # LoRA modules merged into their base weights


# --- the run's record -------------------------------------------------------------------------


def write_run_info(directory: str, info: dict) -> None:
    """Writes `info` as `directory/run.json` (a local directory: the workdir, or the local
    mirror of a gs:// one)."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, RUN_INFO)
    with open(path + ".part", "w") as f:
        json.dump(info, f, indent=2)
        f.write("\n")
    os.replace(path + ".part", path)


def _fs(url: str):
    import fsspec

    bound_remote_io(url)
    fs, root = fsspec.core.url_to_fs(url)
    return fs, root.rstrip("/") or "/"


def read_run_info(workdir: str, base_model: str | None = None) -> dict:
    """RUN/run.json; base_model replaces its model path. Without run.json, base_model is
    required (the run is then taken for a full fine-tuning run)."""
    fs, root = _fs(workdir)
    path = f"{root}/{RUN_INFO}"
    if fs.exists(path):
        with fs.open(path, "rb") as f:
            info = json.loads(f.read().decode())
    elif base_model is not None:
        info = {"model_path": base_model, "lora": {"rank": 0}}
    else:
        raise ExportError(
            f"{workdir}/{RUN_INFO} not found: python -m jaxvrl.train writes it when a run starts "
            "(base model, dtypes, LoRA settings). For a run from before it existed, pass "
            "--base_model with the model directory the run started from"
        )
    if base_model is not None:
        info["model_path"] = base_model
        info.pop("model_commit", None)  # the run's commit is of its own base model
    return info


def _base_model_path(info: dict) -> str:
    path = info.get("model_path")
    if path:
        return path
    return TASKS[info.get("builtin_task") or "shapes"].checkpoint  # the task's embedded one


# --- checkpoints ------------------------------------------------------------------------------


def checkpoint_steps(workdir: str) -> tuple[str, list[int]]:
    """-> (RUN/checkpoints, its saved steps in order); nothing is created."""
    from jaxvrl.checkpoint import Checkpointer

    ck = Checkpointer(f"{workdir.rstrip('/')}/checkpoints", read_only=True)
    try:
        return ck.directory, ck.all_steps()
    finally:
        ck.close()


METADATA_ATTEMPTS = 4  # reads of a remote checkpoint's array metadata before giving up


def _tree_metadata(read, path, attempts: int):
    """The array metadata (shapes, dtypes) saved with a checkpoint's `state` item at `path`,
    as `read()` gives it (Checkpointer.array_metadata, which raises what orbax raises). A
    remote read that fails is tried again (after 1, 2, 4 s; the filesystem's cached listings
    dropped, as a stale one can hide a file) up to `attempts` times; then an ExportError names
    the path and the last error."""
    for attempt in range(attempts):
        try:
            return read()
        except Exception as e:  # noqa: BLE001 - named in the error below
            error = e
        if attempt + 1 < attempts:
            log.warning(
                "reading %s/_METADATA failed (%s: %s); trying again",
                path,
                type(error).__name__,
                error,
            )
            time.sleep(2**attempt)
            forget_listings()
    raise ExportError(
        f"cannot read the checkpoint's array metadata at {path}/_METADATA "
        f"({attempts} attempt{'s' * (attempts > 1)}): {type(error).__name__}: {error}"
    ) from error


class StateReader:
    """The arrays of one checkpoint step's `state` item, read by key onto the host as numpy
    (through a read-only Checkpointer: nothing else is read)."""

    def __init__(self, directory: str, step: int):
        from jaxvrl.checkpoint import Checkpointer

        self.checkpointer, self.step = Checkpointer(directory, read_only=True), step
        self.path = self.checkpointer.item_path(step, "state")
        attempts = METADATA_ATTEMPTS if is_remote(directory) else 1
        read = lambda: self.checkpointer.array_metadata(step, "state")
        self.shapes = _tree_metadata(read, self.path, attempts)  # key -> (shape, dtype)

    def read(self, keys) -> dict[str, np.ndarray]:
        return self.checkpointer.read_arrays(self.step, keys, "state")


# --- checkpoint arrays -> the plain model's parameters ----------------------------------------


@dataclasses.dataclass(frozen=True)
class Stored:
    """A parameter saved as it is."""

    key: str


@dataclasses.dataclass(frozen=True)
class Dequantized:
    """A QLoRA kernel: qwix fields of a QuantLinear or QuantExpertKernel."""

    qvalue: str
    scale: str
    zero_point: str | None


@dataclasses.dataclass(frozen=True)
class Merged:
    """A LoRA-wrapped kernel: its base (stored or quantized) plus A B alpha / r."""

    base: Stored | Dequantized
    lora_a: str
    lora_b: str


Source = Stored | Dequantized | Merged
_PARAM_KEY = re.compile(r"(?:\d{5}:)?params/(.+?)(?:/value)?")


def policy_sources(keys) -> dict[str, Source]:
    """Checkpoint array keys (`params/model/layers/0/self_attn/q_proj/base/kernel/value`, ...)
    -> the plain model's dotted param paths (`model.layers.0.self_attn.q_proj.kernel`) and
    how each is made. Keys outside `params` (optimizer state, critic, counters) are left out."""
    params = {}
    for k in keys:
        m = _PARAM_KEY.fullmatch(k)
        if m:
            params[m.group(1).replace("/", ".")] = k
    out: dict[str, Source] = {}
    for path, key in params.items():
        mod, leaf = path.rsplit(".", 1)
        quantized = f"{mod}.qvalue" in params
        if leaf in ("lora_a", "lora_b") or (quantized and leaf in ("scale", "zero_point")):
            continue  # read with the kernel they belong to
        src: Source = Stored(key)
        if leaf == "qvalue":
            src = Dequantized(key, params[f"{mod}.scale"], params.get(f"{mod}.zero_point"))
            leaf = "kernel"
        parent = mod.removesuffix(".base")
        if parent != mod and f"{parent}.lora_a" in params:
            mod = parent
            if leaf == "kernel":
                src = Merged(src, params[f"{mod}.lora_a"], params[f"{mod}.lora_b"])
        out[f"{mod}.{leaf}"] = src
    return out


def _keys(src: Source) -> list[str]:
    if isinstance(src, Stored):
        return [src.key]
    if isinstance(src, Dequantized):
        return [k for k in (src.qvalue, src.scale, src.zero_point) if k is not None]
    return [*_keys(src.base), src.lora_a, src.lora_b]


def _make(src: Source, arrays: dict, info: dict) -> np.ndarray:
    """The parameter's float array from its checkpoint arrays (merging and dequantizing run
    on the CPU with the functions the training code uses, so the results are the same)."""
    if isinstance(src, Stored):
        return arrays[src.key]
    import jax
    import jax.numpy as jnp

    from jaxvrl.models import lora

    with jax.default_device(jax.devices("cpu")[0]):
        if isinstance(src, Dequantized):
            zp = None if src.zero_point is None else arrays[src.zero_point]
            quant = info.get("lora", {}).get("quantize", "none")
            dtype = jnp.dtype(info.get("param_dtype", "float32"))
            w = lora.dequantize(arrays[src.qvalue], arrays[src.scale], zp, quant, dtype)
            return np.asarray(w)
        alpha = info.get("lora", {}).get("alpha")
        if alpha is None:
            raise ExportError(
                f"the checkpoint holds LoRA adapters but {RUN_INFO} has no lora.alpha"
            )
        a, b = arrays[src.lora_a], arrays[src.lora_b]
        # merged in float32 and cast once, to the export's dtype: a bfloat16 base would round
        # away the adapters' smaller updates before a float32 export saw them
        w = np.asarray(_make(src.base, arrays, info), np.float32)
        return np.asarray(lora.merged_kernel(w, a, b, float(alpha) / a.shape[-1]))


def _model_shapes(cfg, scan_layers: bool) -> dict[str, tuple[int, ...]]:
    """Dotted param path -> shape of the plain model for `cfg` (abstract: nothing allocated);
    scan_layers: with stacked layers (`model.layers.mlp.up_proj.kernel` [L, D, F])."""
    from flax import nnx

    from jaxvrl.models import Model

    abstract = nnx.eval_shape(lambda: Model(cfg, rngs=nnx.Rngs(0), scan_layers=scan_layers))
    flat = nnx.to_flat_state(nnx.state(abstract, nnx.Param))
    return {".".join(str(p) for p in path): tuple(v.shape) for path, v in flat}


def _check_sources(sources: dict, shapes: dict, where: str, base: str) -> None:
    missing = [p for p in shapes if p not in sources]
    extra = [p for p in sources if p not in shapes]
    if not sources:
        raise ExportError(f"{where} holds no policy parameters (no `params/...` arrays)")
    if missing or extra:
        raise ExportError(
            f"{where} does not fit the model of {base}: missing {missing[:5]}, unexpected "
            f"{extra[:5]} (was the run started from another base model? see --base_model)"
        )


# --- the output directory ---------------------------------------------------------------------


def _entries(fs, root: str) -> list[str]:
    if not fs.exists(root):
        return []
    return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in fs.ls(root))


def _check_out(out: str, overwrite: bool) -> None:
    fs, root = _fs(out)
    if fs.exists(root) and not fs.isdir(root):
        raise ExportError(f"--out {out} is a file, not a directory")
    entries = _entries(fs, root)
    if entries and not overwrite:
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise ExportError(
            f"--out {out} is not empty ({len(entries)} entries: {shown}); choose a new "
            "directory or pass --overwrite to replace the export there"
        )


def _prepare_out(out: str):
    """-> (fs, root) of the output directory, created, without the weights of an earlier
    export (old shards would mix with the new ones)."""
    fs, root = _fs(out)
    for name in _entries(fs, root):
        if re.fullmatch(r"model(-\d+-of-\d+)?\.safetensors(\.index\.json)?", name):
            fs.rm(f"{root}/{name}")
    fs.makedirs(root, exist_ok=True)
    return fs, root


def _base_files(model_path: str, into: str, commit: str | None = None) -> str:
    """A local directory with the base model's config.json and tokenizer/processor files
    (never its weights: a gs:// or Hugging Face Hub model is not downloaded whole). A Hub
    name is fetched at `commit` (run.json's: the one the run trained from) when given."""
    from jaxvrl.models.weights import PROCESSOR_FILES

    name = hub.model_name(model_path)
    if name:
        try:
            at = f"{name[0]}@{commit}" if commit else model_path
            return hub.fetch_model(at, weights=False).path
        except hub.NotFound as e:
            raise ExportError(f"base model {model_path}: {e}") from None
    fs, root = _fs(model_path)
    if not fs.exists(f"{root}/config.json"):
        raise ExportError(f"base model {model_path} has no config.json")
    if not is_remote(model_path):
        return root
    for e in fs.ls(root, detail=True):
        name = e["name"].rstrip("/").rsplit("/", 1)[-1]
        if e["type"] == "file" and (
            name == "config.json" or name.startswith(PROCESSOR_FILES + _LICENSE_FILES)
        ):
            fs.get(e["name"], os.path.join(into, name))
    return into


def _hf_config(base_dir: str, dtype: str, tied: bool = True) -> dict:
    """The base model's config.json with its dtype set to the export's (the layout it came in:
    transformers 4.x and 5.x read their own); tied=False: the head written untied."""
    with open(os.path.join(base_dir, "config.json")) as f:
        hf = json.load(f)
    if not tied:
        for d in (hf, hf.get("text_config")):
            if isinstance(d, dict) and d.get("tie_word_embeddings"):
                d["tie_word_embeddings"] = False
    for d in (hf, hf.get("text_config"), hf.get("vision_config")):
        for key in ("dtype", "torch_dtype"):
            if isinstance(d, dict) and key in d:
                d[key] = dtype
    if "dtype" not in hf and "torch_dtype" not in hf:
        hf["dtype"] = dtype
    return hf


def _generation_config(cfg) -> dict:
    eos = list(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple) else cfg.eos_token_id
    gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": eos}
    return {k: v for k, v in gen.items() if v is not None}


def _write_small_files(fs, root: str, base_dir: str, cfg, dtype: str) -> list[str]:
    from jaxvrl.models.weights import PROCESSOR_FILES

    hf = _hf_config(base_dir, dtype, tied=cfg.tie_word_embeddings)
    written = {"config.json": json.dumps(hf, indent=2)}
    if not os.path.exists(os.path.join(base_dir, "generation_config.json")):
        written["generation_config.json"] = json.dumps(_generation_config(cfg), indent=2)
    for name, text in written.items():
        with fs.open(f"{root}/{name}", "wb") as f:
            f.write((text + "\n").encode())
    copied = []
    for name in sorted(os.listdir(base_dir)):
        full = os.path.join(base_dir, name)
        if os.path.isfile(full) and name.startswith(PROCESSOR_FILES + _LICENSE_FILES):
            fs.put(full, f"{root}/{name}")
            copied.append(name)
    return sorted([*written, *copied])


# --- export -----------------------------------------------------------------------------------


def export(
    workdir: str,
    out: str,
    *,
    step: int | None = None,
    dtype: str | None = None,
    overwrite: bool = False,
    base_model: str | None = None,
    max_shard_bytes: int | None = None,
) -> Exported:
    """Writes the policy of `workdir`'s checkpoint `step` (default: the latest) to `out` as an
    HF checkpoint directory. dtype: float32 | bfloat16 | float16 (default: the run's
    model.param_dtype); max_shard_bytes: largest safetensors file (default 5 GB)."""
    from jaxvrl.models import family_of, load_config, weights

    directory, steps = checkpoint_steps(workdir)
    if not steps:
        raise ExportError(f"no checkpoint in {workdir} (looked in {directory})")
    step = steps[-1] if step is None else step
    if step not in steps:
        raise ExportError(
            f"no checkpoint for step {step} in {directory}; saved steps: "
            + ", ".join(map(str, steps))
        )
    info = read_run_info(workdir, base_model)
    model_path = _base_model_path(info)
    reader = StateReader(directory, step)
    sources = policy_sources(reader.shapes)
    stored = [reader.shapes[s.key][1].name for s in sources.values() if isinstance(s, Stored)]
    dtype = dtype or info.get("param_dtype") or (stored[0] if stored else "float32")
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype}: expected one of {', '.join(DTYPES)}")
    np_dtype = np.dtype(dtype) if dtype != "bfloat16" else np.dtype(_bfloat16())
    _check_out(out, overwrite)
    with tempfile.TemporaryDirectory() as tmp:
        base_dir = _base_files(model_path, tmp, info.get("model_commit"))
        cfg = load_config(base_dir)
        if cfg.tie_word_embeddings and HEAD in sources:
            # a base whose config ties the head but whose files store their own (the run
            # trained that head, as transformers keeps it): exported untied
            cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
        table = family_of(cfg).keys
        scanned = any(weights.is_stacked(p) for p in sources)  # a run with model.scan_layers
        shapes = _model_shapes(cfg, scanned)
        _check_sources(sources, shapes, f"checkpoint {directory}/{step}", model_path)
        fs, root = _prepare_out(out)
        names = {}
        specs = []
        for layer, path, i, shape in weights.per_layer(shapes.items(), table.per_expert):
            name, hf_shape = weights.hf_shape(layer, shape, cfg, table)
            names[name] = (layer, path, i, shape)
            specs.append(weights.TensorSpec(name, hf_shape, np_dtype))
        # a stacked param's arrays, read once for its L tensors (they come one after the other)
        last: dict = {}

        def produce(name: str) -> np.ndarray:
            layer, path, i, shape = names[name]
            src = sources[path]
            keys = _keys(src)
            if last.get("keys") != keys:
                last.clear()
                last.update(keys=keys, arrays=reader.read(keys))
                n = {v.shape[0] for v in last["arrays"].values()} if i is not None else set()
                if n and n != {shapes[path][0]}:
                    raise ExportError(
                        f"checkpoint {directory}/{step}: {path} holds {sorted(n)} layers, the "
                        f"config.json of {model_path} implies {shapes[path][0]}"
                    )
            arrays = last["arrays"] if i is None else {k: v[i] for k, v in last["arrays"].items()}
            if i is None:
                last.clear()  # nothing else reads it
            x = _make(src, arrays, info)
            if tuple(x.shape) != shape:
                raise ExportError(
                    f"checkpoint {directory}/{step}: {layer} has shape {tuple(x.shape)}, "
                    f"the config.json of {model_path} implies {shape}"
                )
            return weights.hf_tensor(layer, x, cfg, table, np_dtype)[1]

        def opened(name: str):
            return fs.open(f"{root}/{name}", "wb")

        def logged(name: str, nbytes: int) -> None:
            log.info("wrote %s (%.1f MB)", name, nbytes / 1e6)

        files = weights.write_shards(
            specs, produce, opened, max_shard_bytes or weights.SHARD_BYTES, logged
        )
        files += _write_small_files(fs, root, base_dir, cfg, dtype)
    return Exported(
        step=step,
        out=out,
        files=sorted(files),
        weight_bytes=sum(s.nbytes for s in specs),
        dtype=dtype,
        merged_adapters=sum(isinstance(sources[path], Merged) for _, path, *_ in names.values()),
    )


# the weight files an export writes: a push removes the repository's others (older shards)
_WEIGHT_FILES = ["model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json"]


def push(r: Exported, repo_id: str, *, private: bool = False) -> str:
    """Uploads export `r`'s files to Hub model repository `repo_id` (see hub.push_folder);
    a gs:// export is copied to a local temporary directory first. -> the commit's URL.
    Raises hub.PushFailed."""
    message = f"jaxvrl export of checkpoint step {r.step} ({r.dtype})"
    if not is_remote(r.out):
        return hub.push_folder(
            r.out, repo_id, private=private, message=message, allow=r.files, delete=_WEIGHT_FILES
        )
    with tempfile.TemporaryDirectory() as tmp:
        try:
            fs, root = _fs(r.out)
            for name in r.files:
                fs.get(f"{root}/{name}", os.path.join(tmp, name))
        except Exception as e:  # noqa: BLE001 - named in the one line
            raise hub.PushFailed(
                f"copying {r.out} to a local directory failed: {hub.one_line(e)}"
            ) from e
        return hub.push_folder(
            tmp, repo_id, private=private, message=message, allow=r.files, delete=_WEIGHT_FILES
        )


def _bfloat16():
    import ml_dtypes

    return ml_dtypes.bfloat16


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB', '1000' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a size like 5GB or 500MB")
    unit = m.group(2).upper().rstrip("B")
    base = 1024 if unit.endswith("I") else 1000
    power = "KMGT".index(unit[0]) + 1 if unit else 0
    return int(float(m.group(1)) * base**power)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m jaxvrl.export",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--workdir", required=True, help="the run's workdir (local or gs://)")
    p.add_argument("--out", required=True, help="the HF directory to write (local or gs://)")
    p.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    p.add_argument("--dtype", choices=DTYPES, help="default: the run's model.param_dtype")
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty --out")
    p.add_argument(
        "--base_model",
        help="base model: a directory, or a Hugging Face Hub name org/name[@revision] "
        "(default: from RUN/run.json)",
    )
    p.add_argument("--max_shard_size", type=parse_size, default="5GB", help="default 5GB")
    p.add_argument(
        "--push_to_hub",
        metavar="ORG/NAME",
        help="then upload DIR to this Hugging Face Hub model repository (created if missing)",
    )
    p.add_argument(
        "--private", action="store_true", help="with --push_to_hub: create the repository private"
    )
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.push_to_hub is not None and not hub.is_repo_id(args.push_to_hub):
        p.error(f"--push_to_hub {args.push_to_hub!r}: expected a repository id org/name")
    if args.private and args.push_to_hub is None:
        p.error("--private needs --push_to_hub")
    show_logs()
    try:
        r = export(
            args.workdir,
            args.out,
            step=args.step,
            dtype=args.dtype,
            overwrite=args.overwrite,
            base_model=args.base_model,
            max_shard_bytes=args.max_shard_size,
        )
    except (ExportError, ConfigError) as e:  # the user's to fix: one line, no traceback
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    merged = f", {r.merged_adapters} LoRA adapters merged" if r.merged_adapters else ""
    print(
        f"exported step {r.step} of {args.workdir} to {r.out}: {r.weight_bytes / 1e6:.1f} MB "
        f"of {r.dtype} weights{merged}; files: {', '.join(r.files)}",
        flush=True,
    )
    if args.push_to_hub:
        try:
            url = push(r, args.push_to_hub, private=args.private)
        except hub.PushFailed as e:  # the export stays: one line, no traceback
            print(
                f"error: --push_to_hub {args.push_to_hub}: {e}; the export is at {r.out}",
                file=sys.stderr,
                flush=True,
            )
            sys.exit(2)
        print(f"pushed to {args.push_to_hub}: {url}", flush=True)


if __name__ == "__main__":
    main()
