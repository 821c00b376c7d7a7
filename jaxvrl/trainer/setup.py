"""What the main job builds before its loop, from the run's config: the model and tokenizer,
the data, the samplers and the rollout phase, the reward model, validation, the mesh and the
checks of rows and settings, the resume from a checkpoint (jaxvrl/train.py runs them, then the
loop; the AOT tool builds the same programs from them)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxvrl import hub, models, rl
from jaxvrl.checkpoint import (
    Checkpointer,
    CheckpointError,
)
from jaxvrl.config import (
    ConfigError,
)
from jaxvrl.data.from_config import (
    builtin_task,
    checkpoint_dir,
    encode_options,
    train_source,
    val_sources,
)
from jaxvrl.data.loader import make_dataset
from jaxvrl.data.pipeline import collate, encode_rows
from jaxvrl.data.rows import checkpoint_json_key, load_tokenizer
from jaxvrl.models import load
from jaxvrl.models.moe import route_dtype, sparse_layers
from jaxvrl.parallel import runtime
from jaxvrl.parallel.sharding import process_row_shards, row_shards
from jaxvrl.plugins import LOAD_ERRORS
from jaxvrl.remote import is_remote
from jaxvrl.rl.rewards import (
    SafeReward,
    load_reward_fn,
    reward_kwargs,
    reward_names,
    unused_reward_kwargs,
)
from jaxvrl.sampling import (
    Sampler,
    SamplingConfig,
    decode_bytes,
    generation_config,
    prefill_mesh,
    rollout_dtype,
    rollout_mesh,
    steps,
)
from jaxvrl.trainer.build import step_config
from jaxvrl.trainer.counters import RunCounters
from jaxvrl.trainer.partial import PartialRollouts, call_width
from jaxvrl.trainer.replay_state import decode_items, load_buffer
from jaxvrl.trainer.reporting import evaluate
from jaxvrl.trainer.reward_model import NAME as RM_NAME
from jaxvrl.trainer.reward_model import RewardModel
from jaxvrl.trainer.rollout import FilterOptions, RolloutPhase, reward_constants
from jaxvrl.trainer.scoring import RewardScorer

log = logging.getLogger("jaxvrl")


def train_data(c, tokenizer, model_config=None, source=None):
    """-> (iterator, rows, skip stats): a grain iterator of prompts_per_step encoded examples
    per next() (shuffled per epoch, sharded per process; its state goes into the checkpoint),
    the number of rows in this process's shard, and the live counts of skipped bad rows.
    source: the rows, `train_source(c)` when None."""
    source = train_source(c) if source is None else source
    ds, stats = make_dataset(
        source,
        tokenizer,
        encode_options(c, model_config),
        batch_size=c.prompts_per_step,
        seed=c.seed,
        shard_index=jax.process_index(),
        shard_count=jax.process_count(),
        batch_fn=list,  # the rollout phase collates (once for the sampler, G times to train)
    )
    return iter(ds), -(-len(source) // jax.process_count()), stats


def val_examples(c, tokenizer, model_config=None, sources=None) -> list:
    """Encoded held-out examples (val_files, or the built-in task's test split). sources: the
    val files as `val_sources(c)` opened them (opened here when None)."""
    opts = encode_options(c, model_config)
    if c.data.val_files:
        examples, stats = [], None
        for path, src in val_sources(c) if sources is None else sources:
            rows = [src[i] for i in range(len(src))]
            ex, stats = encode_rows(rows, tokenizer, opts, source=path, stats=stats)
            examples += ex
    elif not c.data.train_files:
        make = builtin_task(c).make_split
        rows = make("test", c.val_size, c.seed, kinds=tuple(c.data.synthetic_kinds))
        examples, stats = encode_rows(rows, tokenizer, opts, source="builtin:val")
    else:
        return []
    if c.data.val_files and not examples:  # validation would report nothing, every time
        raise ConfigError(
            f"config.data.val_files={c.data.val_files!r}: no usable row (skipped: "
            f"{dict(stats.counts)}; the first of each reason is logged above)"
        )
    if stats.total:
        log.warning("val: skipped %d rows: %s", stats.total, dict(stats.counts))
    return examples


def model_source(c) -> tuple[str, str | None]:
    """-> (local directory, Hub commit or None) of model.path: a local directory, a gs:// one
    (copied into a local cache once) or a Hugging Face Hub name `org/name[@revision]` (fetched
    into the hub's cache; a local directory of the same name wins); None: the embedded tiny
    checkpoint of the built-in task. One that cannot be found is a ConfigError."""
    if c.model.preset and not c.model.path:
        raise ConfigError(
            f"config.model.preset={c.model.preset!r} has shapes but no weights (it is for "
            "python -m jaxvrl.aot); set config.model.path to a checkpoint to train"
        )
    return checkpoint_dir(c.model.path or builtin_task(c).checkpoint, "model.path")


# settings that read the image: (config key, whether the run turns it on)
IMAGE_SETTINGS = (
    ("tprl.enable_perception_filtering", lambda c: c.tprl.enable_perception_filtering),
    ("tprl.enable_trajectory_reweighting", lambda c: c.tprl.enable_trajectory_reweighting),
    ("vgr.enable_token_weights", lambda c: c.vgr.enable_token_weights),
    ("reward.funcs", lambda c: "mdi" in c.reward.funcs),
)


def inert_settings(c) -> list[str]:
    """What the run warns of at start (one line each, naming the keys): settings that do
    nothing here, and greedy sampling (rollout.temperature 0 or top_k 1) with an advantage
    that compares a prompt's completions (grpo, rloo) or a greedy baseline (remax): alike
    completions, alike rewards, every advantage 0. Warned of, not refused: a deterministic
    rollout is how runs are checked against references, and a sweep may switch a feature
    off and leave its settings."""
    out = []
    if c.algorithm.adv_estimator in ("grpo", "rloo", "remax") and (
        c.rollout.temperature == 0 or c.rollout.top_k == 1
    ):
        how = "rollout.temperature=0" if c.rollout.temperature == 0 else "rollout.top_k=1"
        out.append(
            f"{how} samples greedily: with algorithm.adv_estimator={c.algorithm.adv_estimator}"
            " a prompt's completions are alike, and so are their rewards: every advantage is "
            "0 and the policy does not learn (sample with rollout.temperature > 0)"
        )
    unused = (
        (c.actor.kl_loss_coef > 0 and not c.actor.use_kl_loss,
         f"actor.kl_loss_coef={c.actor.kl_loss_coef} does nothing without actor.use_kl_loss=true"),
        (c.algorithm.use_kl_in_reward and c.algorithm.kl_ctrl.kl_coef == 0,
         "algorithm.use_kl_in_reward=true with algorithm.kl_ctrl.kl_coef=0 subtracts nothing "
         "(the adaptive controller only scales it)"),
        (c.algorithm.kl_ctrl.type != "fixed" and not c.algorithm.use_kl_in_reward,
         f"algorithm.kl_ctrl.type={c.algorithm.kl_ctrl.type} does nothing without "
         "algorithm.use_kl_in_reward=true"),
        (c.optim.min_lr_ratio > 0 and c.optim.schedule != "cosine",
         f"optim.min_lr_ratio={c.optim.min_lr_ratio} does nothing with "
         f"optim.schedule={c.optim.schedule} (cosine decays to it)"),
        (c.lora.train_vision and not c.lora.rank,
         "lora.train_vision=true does nothing without lora.rank > 0"),
        (c.actor.max_token_len_per_device is not None and not c.actor.dynamic_batching,
         f"actor.max_token_len_per_device={c.actor.max_token_len_per_device} does nothing "
         "without actor.dynamic_batching=true"),
    )  # fmt: skip
    return out + [why for inert, why in unused if inert]


def check_model_settings(c, model_config) -> None:
    """A text-only model (no vision tower) refuses, at start, a built-in task whose rows hold
    images and the settings that read the image: the perceptual pass's filtering and
    shaping, VGR's token weights, the MDI reward. A model without sparse layers refuses the
    load-balancing loss, routing replay and an expert mesh axis (which must divide the
    experts); an expert capacity without that axis is refused too."""
    if getattr(model_config, "num_labels", None):
        raise ConfigError(
            f"config.model.path: a {model_config.hf_architecture} is a sequence classifier; "
            "the policy is a causal LM (a classifier goes in reward.model.path)"
        )
    if c.actor.router_aux_loss_coef > 0 and not any(sparse_layers(model_config.text)):
        raise ConfigError(
            f"config.actor.router_aux_loss_coef={c.actor.router_aux_loss_coef}: model type "
            f"{model_config.model_type!r} has no mixture-of-experts layers; set it to 0"
        )
    if c.actor.routing_replay:
        check_routing_replay(c, model_config)
    check_expert_axis("mesh.expert", c.mesh.expert, model_config)
    check_expert_axis("rollout.mesh.expert", c.rollout.mesh.expert, model_config)
    if c.mesh.expert == 1 and c.model.expert_capacity:
        raise ConfigError(
            f"config.model.expert_capacity={c.model.expert_capacity}: it bounds what each "
            "device sends each other device on an expert mesh axis, and mesh.expert is 1; "
            "set mesh.expert > 1 or the capacity to 0"
        )
    if getattr(model_config, "vision", None) is not None:
        return
    if not c.data.train_files and builtin_task(c).has_images:
        raise ConfigError(
            f"config.data.builtin_task={c.data.builtin_task!r}: its rows hold images while "
            f"model type {model_config.model_type!r} is text-only; set data.builtin_task="
            "'arithmetic' or name a text dataset in data.train_files"
        )
    for key, on in IMAGE_SETTINGS:
        if on(c):
            what = "the 'mdi' reward" if key == "reward.funcs" else "True"
            raise ConfigError(
                f"config.{key}: {what} needs images, and model type "
                f"{model_config.model_type!r} is text-only; turn it off for this model"
            )


def load_model(c, source: tuple[str, str | None] | None = None):
    """-> (model, tokenizer): the HF checkpoint at model.path, or the embedded tiny one
    (source: model_source(c), when the caller has it already)."""

    path, commit = source or model_source(c)
    with runtime.on_host():  # host memory; sharded_train_state cuts it onto the mesh
        model = load(
            path,
            dtype=models.DTYPES[c.model.dtype],
            param_dtype=models.DTYPES[c.model.param_dtype],
            scan_layers=c.model.scan_layers,
        )
    model.set_remat_policy(c.model.remat_policy)  # part of the graphdef: before any split
    model.set_attention(c.model.attention)
    model.set_expert_capacity(c.model.expert_capacity)
    tokenizer = load_tokenizer(path)
    if not getattr(tokenizer, "chat_template", None):
        log.warning("%s: the tokenizer has no chat template: prompts are the plain text", path)
    n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    where = f"{c.model.path} at commit {commit} ({path})" if commit else path
    print(f"{c.name}: model {where} ({n / 1e6:.2f}M params), workdir {c.workdir}", flush=True)
    return model, tokenizer


def run_info(c, commit: str | None = None) -> dict:
    """What `python -m jaxvrl.export` reads from `<workdir>/run.json`: the base model (None:
    the embedded one of `builtin_task`; a Hub name as written, with the commit it resolved
    to), the dtypes and the LoRA settings."""
    path = c.model.path
    lc = c.lora
    named = not path or is_remote(path) or hub.model_name(path)
    return {
        "config": c.name,
        "model_path": path if named else os.path.abspath(path),
        "model_commit": commit,
        "builtin_task": None if path else c.data.builtin_task,  # whose embedded checkpoint
        "dtype": c.model.dtype,
        "param_dtype": c.model.param_dtype,
        "scan_layers": c.model.scan_layers,
        "lora": {
            "rank": lc.rank,
            "alpha": lc.alpha,
            "target_modules": list(lc.target_modules),
            "quantize": lc.quantize,
            "train_vision": lc.train_vision,
        },
    }


def check_routing_replay(c, model_config) -> None:
    """actor.routing_replay needs a model with sparse layers, and each row sampled within
    its step: a row carried across steps (rollout.partial) is prefilled again under a newer
    policy, so no one routing reproduces both its earlier and its later tokens."""
    key = "config.actor.routing_replay=True"
    if not any(sparse_layers(model_config.text)):
        raise ConfigError(
            f"{key}: model type {model_config.model_type!r} has no mixture-of-experts layers; "
            "set it to False"
        )
    if c.rollout.partial:
        raise ConfigError(
            f"{key}: rows carried across steps (rollout.partial) are prefilled again under a "
            "newer policy, so no one routing reproduces their tokens; set rollout.partial=False"
        )


def records_routes(c, mcfg) -> bool:
    """Whether the rollout records its routes: a model with sparse layers whose rows are
    sampled within their step (`check_routing_replay`'s conditions)."""
    return any(sparse_layers(mcfg.text)) and not c.rollout.partial


def route_layout(text_cfg) -> tuple:
    """((L', k), dtype): the shape per token and the dtype of a rollout's recorded routes
    (`steps.step_routes`), L' sparse layers of top-k experts."""
    shape = (sum(sparse_layers(text_cfg)), text_cfg.num_experts_per_tok)
    return shape, np.dtype(route_dtype(text_cfg.num_experts))


def stop_token_ids(mcfg, tokenizer=None, model_dir: str | None = None) -> tuple[int, ...]:
    """The ids a completion ends at, as transformers' generate and vLLM stop: config.json's
    eos_token_id and those of the checkpoint's generation_config.json (Qwen2.5's Instruct
    models end at <|im_end|> or <|endoftext|>), else the tokenizer's EOS."""
    eos = [] if mcfg.eos_token_id is None else list(np.atleast_1d(mcfg.eos_token_id))
    name = "generation_config.json"
    more = checkpoint_json_key(model_dir, name, "eos_token_id") if model_dir else None
    eos += [] if more is None else list(np.atleast_1d(more))
    if not eos and tokenizer is not None and tokenizer.eos_token_id is not None:
        eos = [tokenizer.eos_token_id]
    return tuple(dict.fromkeys(int(x) for x in eos))


def sampling_config(
    c, mcfg, tokenizer=None, entropies: bool = False, mesh=None, model_dir=None, **where
) -> SamplingConfig:
    """The rollout's SamplingConfig for model config `mcfg`: its stop ids (`stop_token_ids`,
    model_dir: the checkpoint's directory), pad from the tokenizer (0 without one), vision
    tokens suppressed; entropies: return each token's entropy (the trainer's token shaping
    reads them); the routes where `records_routes`; the slots `rollout_slots` gives on the
    rollout mesh `mesh` (`where`: its processes and hbm)."""
    eos = stop_token_ids(mcfg, tokenizer, model_dir)
    r = c.rollout
    pad = (tokenizer.pad_token_id if tokenizer is not None else 0) or 0
    cfg = generation_config(
        mcfg,
        max_new_tokens=r.max_new_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        eos_token_ids=eos,
        pad_token_id=pad,
    )
    return dataclasses.replace(
        cfg,
        slots=rollout_slots(c, mcfg.text, mesh, **where),
        page_size=r.page_size,
        narrow=r.narrow,
        decode_attention=r.decode_attention,
        entropies=entropies,
        routes=records_routes(c, mcfg),
    )


def rollout_slots(c, text_cfg, mesh=None, processes: int | None = None, hbm=None) -> int:
    """rollout.slots resolved on the rollout mesh `mesh` (None: this process's first device):
    a count as set; "auto" slots where the engine's decode steps read pages in place on those
    devices (`steps.reads_pages`) or rows are carried across steps (rollout.partial), else 0
    (the static sampler, which reads its cache in place everywhere). Their count: a slot per
    row of the step (every process's prompts_per_step x num_generations), or as many as keep
    the decode weights and every page within rollout.memory_fraction of a device's memory
    (hbm: its bytes; default `pod_memory`, none on the CPU), a multiple of the
    rollout's row groups where that leaves any."""
    r = c.rollout
    if r.slots != "auto":
        return r.slots
    probe = SamplingConfig(max_new_tokens=1, decode_attention=r.decode_attention)
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        paged = steps.reads_pages(probe)
    if not (paged or r.partial):
        return 0
    processes = jax.process_count() if processes is None else processes
    g = r.num_generations
    rows = c.prompts_per_step * g * processes
    hbm = pod_memory(mesh) if hbm is None else hbm
    if not hbm:
        return rows
    # a device holds the decode weights over its tensor group and every page (pages split by
    # KV head only); with rollout.partial each carried row is a prompt of its own
    tensor = 1 if mesh is None else mesh.shape.get("tensor", 1)
    heads = tensor if text_cfg.num_key_value_heads % tensor == 0 else 1
    dtype = rollout_dtype(r.dtype, mesh, c.model.dtype) or c.model.dtype
    weights, position = decode_bytes(text_cfg, 1, 1, dtype)
    position /= heads
    ps = r.page_size
    own = -(-r.max_new_tokens // ps) * ps * position  # a slot's pages
    if r.partial:
        width = call_width(c.prompts_per_step, r.oversample, process_row_shards(mesh, processes))
        length, prompts = c.data.max_prompt_length + r.max_new_tokens, width * g * processes
    else:
        length, prompts = c.data.max_prompt_length, c.prompts_per_step * processes
    shared = prompts * -(-length // ps) * ps * position
    room = r.memory_fraction * hbm - weights / tensor - shared
    fit = int(room // own)
    if fit < 1:
        gb = 1e9
        raise ConfigError(
            f"config.rollout.slots=auto: one slot's KV-cache pages ({own / gb:.2f} GB a device)"
            f" do not fit beside the prompts' ({shared / gb:.2f} GB) and the decode weights "
            f"({weights / tensor / gb:.2f} GB) in rollout.memory_fraction={r.memory_fraction} "
            f"of the rollout devices' {hbm / gb:.1f} GB: raise rollout.memory_fraction or "
            "rollout.mesh.tensor, or lower data.max_prompt_length or rollout.max_new_tokens"
        )
    slots = min(rows, fit)
    groups = row_shards(mesh)
    return slots // groups * groups if slots >= groups else slots


def pod_memory(mesh=None) -> int | None:
    """A rollout device's memory in bytes: one of this process's on `mesh` (None: this
    process's first device; another process's device reports nothing), on a pod the least
    any process's reports, so that every process compiles the same slots; None where a
    device reports none (the CPU)."""
    own = [] if mesh is None else mesh.devices.flat
    own = [d for d in own if d.process_index == jax.process_index()] or jax.local_devices()
    hbm = device_memory(own[0])
    if jax.process_count() == 1:
        return hbm
    every = runtime.gather_json(hbm)
    return None if None in every else min(every)


def device_memory(device) -> int | None:
    """A device's memory in bytes as it reports it; None where it does not (the CPU, a
    compile-only device)."""
    try:
        stats = device.memory_stats()
    except (AttributeError, RuntimeError):  # jax's errors for devices not of this process
        return None
    return (stats or {}).get("bytes_limit")


def check_expert_axis(key: str, size: int, model_config) -> None:
    """A ConfigError where the expert mesh axis `key` of `size` devices (> 1) has no experts
    to split, or does not divide them."""
    experts = model_config.text.num_experts if any(sparse_layers(model_config.text)) else 0
    if size > 1 and (not experts or experts % size):
        has = f"{experts} experts" if experts else "no mixture-of-experts layers"
        raise ConfigError(
            f"config.{key}={size}: model type {model_config.model_type!r} has {has}; set "
            f"{key} to 1 or a divisor of the experts"
        )


def auto_experts(mesh, sizes: tuple, text_cfg, rows: int, sequence: int) -> int:
    """rollout.mesh.expert=0 resolved over the devices of `mesh` (the rollout mesh's other
    `sizes` as `rollout_mesh` takes them): 1 for a model without experts or with each
    prompt's prefill split over devices, else the most devices that split the experts evenly
    and leave a mesh the step's `rows` split over (a decode step then reads 1 / expert of
    the experts per device)."""
    experts = text_cfg.num_experts if any(sparse_layers(text_cfg)) else 0
    if not experts or sequence > 1:
        return 1
    for e in sorted((e for e in range(2, mesh.size + 1) if mesh.size % e == 0), reverse=True):
        try:
            if experts % e == 0 and rows % row_shards(rollout_mesh(mesh, *sizes, e)) == 0:
                return e
        except ValueError:
            continue
    return 1


def rollout_layout(c, mesh, text_cfg, processes: int | None = None) -> tuple:
    """(mesh, dtype) the samplers run with: `rollout.mesh` over the devices of the training
    mesh `mesh` (tensor 0: the tensor group that reads the fewest bytes per device in a
    decode step of the model with text config `text_cfg`: `layout.rollout_sizes`) and
    `rollout.dtype` resolved for them (None: model.dtype). The step's rows (every process's
    prompts_per_step x num_generations; processes: default this run's) must split over its
    data groups."""
    processes = jax.process_count() if processes is None else processes
    rows = c.prompts_per_step * c.rollout.num_generations
    dtype = rollout_dtype(c.rollout.dtype, mesh, c.model.dtype)
    length = c.data.max_prompt_length + c.rollout.max_new_tokens
    weights, cache = decode_bytes(text_cfg, rows * processes, length, dtype or c.model.dtype)
    kv = text_cfg.num_key_value_heads
    m = c.rollout.mesh
    sizes = (m.data, m.tensor, kv, weights, cache)
    expert = m.expert or auto_experts(mesh, sizes, text_cfg, rows * processes, m.sequence)
    try:
        rmesh = rollout_mesh(mesh, *sizes, expert)
    except ValueError as e:
        raise ConfigError(f"config.rollout.mesh: {e}") from None
    try:
        prefill_mesh(rmesh, m.sequence)
    except ValueError as e:
        raise ConfigError(f"config.rollout.mesh.sequence={m.sequence}: {e}") from None
    if c.data.prompt_bucket % m.sequence:
        raise ConfigError(
            f"config.rollout.mesh.sequence={m.sequence} splits every prompt's tokens: "
            f"data.prompt_bucket={c.data.prompt_bucket} must be a multiple of it"
        )
    groups = row_shards(rmesh)
    if (rows * processes) % groups:
        raise ConfigError(
            f"config.prompts_per_step x rollout.num_generations = {rows} rows per process "
            f"({processes} processes) do not split evenly over the rollout's {groups} row "
            "groups (rollout.mesh.data x rollout.mesh.expert): set rollout.mesh.data or "
            "rollout.mesh.tensor so that they do"
        )
    return rmesh, dtype  # the same devices' platform as `mesh`'s


def make_samplers(graph, mcfg, tokenizer, c, mesh=None, model_dir=None, layout=None):
    """-> (sampler, greedy): the rollout sampler and the greedy one for validation, for the
    model graph `graph` (after init: with LoRA adapters) with config `mcfg` (model_dir: its
    checkpoint's directory, for generation_config.json's stop ids), in the rollout layout
    over the devices of the training mesh `mesh`, or the sampler's own with rollout.devices
    (`rollout_layout`, `sampling_devices`; None: one device, the model's dtype). layout: that
    (mesh, dtype) where the caller has it already."""
    rmesh, dtype = None, None
    if mesh is not None:
        rmesh, dtype = layout or rollout_layout(c, sampling_devices(c, mesh), mcfg.text)
    check_decode_attention(c, jax.devices()[0] if rmesh is None else rmesh.devices.flat[0])
    shaping = step_config(c, mesh).sampler_shaping
    cfg = sampling_config(c, mcfg, tokenizer, entropies=shaping, mesh=rmesh, model_dir=model_dir)
    greedy = dataclasses.replace(cfg, temperature=0.0, entropies=False, routes=False)
    split = c.rollout.mesh.sequence if rmesh is not None else 1
    return Sampler(graph, cfg, rmesh, dtype, split), Sampler(graph, greedy, rmesh, dtype, split)


# the training kernels (model.attention) that only one platform runs
ATTENTION_PLATFORMS = {"splash": "tpu", "cudnn": "gpu"}


def check_attention(c, device) -> None:
    """A ConfigError where model.attention names a kernel that the run's devices (of
    `device`'s platform) cannot run."""
    name = c.model.attention
    need = ATTENTION_PLATFORMS.get(name)
    if need and device.platform != need:
        raise ConfigError(
            f"config.model.attention={name!r}: that kernel runs on {need.upper()}s, the run's "
            f"devices are {device.platform}; set it to 'auto' (the platform's own), 'xla' "
            "or 'flash'"
        )


def check_decode_attention(c, device) -> None:
    """A ConfigError where rollout.decode_attention names a kernel the rollout's devices (those
    of `device`'s platform) cannot run."""
    name = c.rollout.decode_attention
    if name in ("tpu", "gpu") and device.platform != name:
        raise ConfigError(
            f"config.rollout.decode_attention={name!r}: the Pallas {name.upper()} kernel runs "
            f"on {name.upper()}s, the rollout runs on {device.platform}; set it to 'auto' or "
            "'dense'"
        )
    ps = c.rollout.page_size
    if name == "gpu" and ps & (ps - 1):
        raise ConfigError(
            f"config.rollout.page_size={ps}: the GPU paged kernel (rollout.decode_attention="
            "'gpu') reads pages of a power of two positions; set it to 16, 32 or 64"
        )


def reward_functions(c) -> dict[str, SafeReward]:
    """The config's reward functions by the names they are logged under, each loaded and its
    form recognised by its signature. A file or module that is missing, fails to import or
    lacks the function, and a signature no form fits, raise ConfigError (one line)."""
    names = reward_names(c.reward.funcs, c.reward.names)
    kwargs = reward_kwargs(c.reward.kwargs, names, c.reward.funcs)
    fns = {}
    for n, f in zip(names, c.reward.funcs):
        try:
            fns[n] = SafeReward(n, load_reward_fn(f), f, kwargs[n])
        except (TypeError, *LOAD_ERRORS) as e:  # TypeError: a signature no form fits
            raise ConfigError(f"config.reward.funcs: {e}") from None
    unused = unused_reward_kwargs(c.reward.kwargs, fns)
    if unused:  # a misspelt keyword would silently leave the function at its default
        raise ConfigError(f"config.reward.kwargs: {unused}")
    return fns


def make_rollout_phase(
    c, sampler, greedy, tokenizer, model_config, step_cfg, mesh=None, fns=None
) -> RolloutPhase:
    """`fns`: the rewards as `reward_functions` gives them (loaded here when None)."""
    names = reward_names(c.reward.funcs, c.reward.names)
    fns = reward_functions(c) if fns is None else fns
    scorer = RewardScorer(
        fns,
        num_workers=c.reward.num_workers,
        timeout_s=c.reward.timeout_s,
        image_dir=c.data.image_dir or None,
        max_failure_fraction=c.reward.max_failure_fraction,
        failure_window=c.reward.failure_window,
        constants=reward_constants(c.reward.mdi_balance_ratio, c.total_steps),
    )
    regular = dict(zip(names, c.reward.weights))
    early = dict(zip(names, c.reward.early_weights)) if c.reward.early_weights else None
    by_spec = dict(zip(c.reward.funcs, names))

    def named(key):  # the filters may name a reward by its func spec too
        return key if key in names else by_spec.get(key, key)

    f, rb = c.filter, c.filter.replay_buffer
    opts = FilterOptions(
        group_size=c.rollout.num_generations,
        prompts_per_step=c.prompts_per_step,
        max_new_tokens=c.rollout.max_new_tokens,
        mask_truncated_completions=f.mask_truncated_completions,
        overlong_buffer_len=f.overlong_buffer_len,
        overlong_penalty_factor=f.overlong_penalty_factor,
        dynamic_sampling=f.dynamic_sampling,
        dynamic_sampling_metric=named(f.dynamic_sampling_metric),
        max_num_gen_batches=f.max_num_gen_batches,
        online_filtering=f.online_filtering,
        filter_key=named(f.filter_key),
        filter_low=f.filter_low,
        filter_high=f.filter_high,
    )
    stats = "mdi" in c.reward.funcs or step_cfg.needs_attention
    layers = model_config.text.num_hidden_layers
    replay = None
    if rb.enable:
        replay = rl.ReplayBuffer(rb.capacity, rb.min_std, rb.min_mean, rb.max_mean)
    return RolloutPhase(
        sampler=sampler,
        tokenizer=tokenizer,
        collate=functools.partial(
            collate,
            model_config=model_config,
            tokenizer=tokenizer,
            prompt_bucket=c.data.prompt_bucket,
            with_pools=True,
            # on a pod each process collates its own rows of one global batch: one shape
            agree=runtime.max_across_processes,
        ),
        rewards=fns,
        scorer=scorer,
        reward_weights=lambda step: rl.stage_reward_weights(
            step, regular, early, c.reward.early_steps
        ),
        opts=opts,
        attention=(c.vgr.layer_set, c.vgr.token_weight_last_k_layers) if stats else None,
        with_pools=step_cfg.needs_attention,
        sampled_masses=layers if step_cfg.needs_attention and step_cfg.sampler_shaping else 0,
        mdi_balance_ratio=c.reward.mdi_balance_ratio,
        replay=replay,
        greedy=greedy if c.algorithm.adv_estimator == "remax" else None,
        mesh=mesh,
        accuracy=by_spec.get("mc_idx", by_spec.get("accuracy")),
        reward_model=reward_model(c, names, mesh),
        routes=route_layout(model_config.text) if sampler.cfg.routes else None,
        partial=partial_rollouts(c, layers if stats else 0, sampler.cfg.entropies, sampler.mesh),
    )


def partial_rollouts(c, layers: int, entropies: bool, mesh=None) -> PartialRollouts | None:
    """The rows carried between steps with rollout.partial (None: off), keeping each token's
    attention masses over `layers` text layers (0: none), sampled on the rollout mesh `mesh`
    (None: one device); refused in one line where a part of the run cannot follow a row
    across steps."""
    if not c.rollout.partial:
        return None
    if c.algorithm.adv_estimator == "remax":
        raise ConfigError(
            "config.rollout.partial: partial rollouts do not carry remax's greedy baseline yet"
        )
    if c.rollout.devices and c.rollout.max_staleness < 2:
        log.warning(
            "rollout.partial with rollout.devices: a batch trains one update after its policy, "
            "so a carried row is at least 2 versions behind; with rollout.max_staleness=%d "
            "every carried group is dropped (set it to 2 or more)",
            c.rollout.max_staleness,
        )
    return PartialRollouts(
        prompts_per_step=c.prompts_per_step,
        group_size=c.rollout.num_generations,
        max_new_tokens=c.rollout.max_new_tokens,
        oversample=c.rollout.oversample,
        max_staleness=c.rollout.max_staleness,
        entropies=entropies,
        layers=layers,
        row_groups=process_row_shards(mesh),
    )


def reward_model(c, names, mesh=None) -> RewardModel | None:
    """The reward model of reward.model.path on `mesh` (None: none), in model.dtype; its
    reward is named `model`, which no function of `names` may be."""
    if not c.reward.model.path:
        return None
    if RM_NAME in names:
        raise ConfigError(
            f"config.reward.names: {RM_NAME!r} is the reward model's name "
            "(reward.model.path); give the function another one"
        )
    local, _ = checkpoint_dir(c.reward.model.path, "reward.model.path")
    dtype = models.DTYPES[c.model.dtype]
    return RewardModel.load(local, mesh=mesh, dtype=dtype, weight=c.reward.model.weight)


def make_validate(c, examples, greedy, model_config, tokenizer, mesh=None, phase=None):
    """-> validate(params): greedy val/accuracy and val/format on the held-out examples, in
    batches of the rollout's row count, and with the rollout `phase` (RolloutPhase: its
    decode weights reused here) val/reward/<name> by its rewards, the mdi reward from the
    greedy completions' attention where the rollout measures it."""
    attention = None if phase is None or phase.attention is None else phase.attention_metrics
    val_collate = functools.partial(
        collate,
        repeat=1,
        model_config=model_config,
        tokenizer=tokenizer,
        prompt_bucket=c.data.prompt_bucket,
        with_pools=attention is not None,
    )
    rows = c.prompts_per_step * c.rollout.num_generations
    decode, scorer = (None, None) if phase is None else (phase.decode, phase.scorer)
    return lambda params: evaluate(
        examples, greedy, params, val_collate, tokenizer, rows, mesh, decode, scorer, attention
    )


def load_start_params(path: str, state, ref_params, ref_shardings):
    """config.load_checkpoint_path (`<dir>/<step>`): that checkpoint's parameters with a fresh
    optimizer at step 0; they are also the reference policy's in a full fine-tune. With LoRA
    (no reference copy) the reference stays the policy with its adapters off, the base
    model, as in every LoRA run (verl's too), and the loaded adapters are the policy's."""
    directory, step = os.path.split(path.rstrip("/"))
    if not step.isdigit():
        raise ConfigError(f"config.load_checkpoint_path={path!r}: expected <dir>/<step>")
    ck = Checkpointer(directory, read_only=True)
    try:  # the parameters only: a PPO run's critic or another optimizer's state is not read
        params = ck.restore_params(int(step), state.params)
    except CheckpointError as e:
        raise ConfigError(f"config.load_checkpoint_path={path!r}: {e}") from None
    finally:
        ck.close()
    print(f"parameters from {path}", flush=True)
    ref = None
    if ref_params is not None:  # distinct buffers (the state is donated), sharded like params
        ref = runtime.place_state(jax.tree.map(jnp.array, params), ref_shardings)
    return state.replace(params=params), ref


def resume(
    c, ckpt: Checkpointer, state, data, mesh, counters: RunCounters, replay=None, partial=None
):
    """-> (start step, state, rng, meta: the checkpoint's JSON run state, e.g. the
    consecutive non-finite steps and the step shapes compiled, carried: the rollout state
    carried between steps, {"flights": partial rollouts' rows or None, "ahead": one-step-off
    training's batch in flight (`ahead.encode_ahead`) or None}, or None) from the latest checkpoint in
    workdir, or the fresh ones; the data iterator, the running totals and the replay
    buffer (`replay`: rl.ReplayBuffer or None) and the rows partial rollouts carry (`partial`:
    PartialRollouts or None) continue from their saved state. The arrays
    restore into `state`'s shardings, the RNG replicated over the mesh (a global array every
    process can save)."""
    rng = runtime.replicate(jax.random.key(c.seed), mesh)
    if not c.resume or ckpt.latest_step() is None:
        return 0, state, rng, {}, None
    r = ckpt.restore_latest({"state": state, "rng": rng.sharding})
    data.set_state(r["data_state"] if r["data_state"] is not None else r["meta"]["iterator"])
    counters.load(r["counters"])
    if replay is not None and r["replay"] is None:
        log.warning(
            "checkpoint step %d holds no replay buffer (written before it was saved, or by a "
            "run without filter.replay_buffer): the buffer starts empty",
            r.step,
        )
    elif replay is not None:
        load_buffer(replay, r["replay"])
    carried = None if r["carried"] is None else decode_items(r["carried"])[0]
    flights = None if carried is None else carried["flights"]
    if partial is not None and flights is None:
        log.warning(
            "checkpoint step %d holds no carried rollout rows (written by a run without "
            "rollout.partial): the next rollout starts afresh",
            r.step,
        )
    elif partial is not None:
        partial.flights = flights
    print(f"resumed from step {r.step}", flush=True)
    return r.step, r["state"], r["rng"], r["meta"], carried


def check_offload(c, mesh) -> tuple[str, ...]:
    """The parts of the train state kept in host memory ("optimizer": actor.offload_optimizer,
    "reference": actor.offload_reference; `runtime.in_host_memory`); a ConfigError when one is set,
    or model.remat_policy is "offload", and the mesh's devices have no pinned host memory space."""
    parts = tuple(
        name
        for name, on in (
            ("optimizer", c.actor.offload_optimizer),
            ("reference", c.actor.offload_reference),
        )
        if on
    )
    device = mesh.devices.flat[0]
    kinds = {m.kind for m in device.addressable_memories()}
    remat = c.model.remat_policy == "offload"  # the layers' inputs, kept for the backward pass
    if (parts or remat) and "pinned_host" not in kinds:
        key = f"actor.offload_{parts[0]}=True" if parts else "model.remat_policy='offload'"
        raise ConfigError(
            f"config.{key}: {device.platform} devices have no pinned host memory "
            f"(their memories: {', '.join(sorted(kinds))})"
        )
    return parts


def device_split(c, devices=None) -> tuple[list, list]:
    """(the train step's devices, the sampler's devices) of this run (`devices`: default
    jax.devices()): every device for both, or with rollout.devices = K, K / hosts of each
    host's devices for the sampler and the rest for the train step (`host_split`)."""
    devices = list(jax.devices() if devices is None else devices)
    k = c.rollout.devices
    if not k:
        return devices, devices
    hosts = sorted({d.process_index for d in devices})
    if k % len(hosts) or k >= len(devices):
        raise ConfigError(
            f"config.rollout.devices={k}: the sampler's devices must be a multiple of the "
            f"{len(hosts)} host(s) and leave the train step at least one of the "
            f"{len(devices)} devices"
        )
    train, roll = [], []
    for h in hosts:
        t, r = host_split([d for d in devices if d.process_index == h], k // len(hosts))
        train, roll = train + t, roll + r
    return train, roll


def host_split(chips: list, k: int) -> tuple[list, list]:
    """One host's devices `chips` split into (the train step's, the sampler's `k`). Chips on
    a torus (TPU devices have `coords`) split along a physical axis (`_slab`), so that each
    side is a box of the torus and the train step's holds the host's first chip (the TPU
    compiler stops on some programs over other subsets of a slice); without such a slab,
    or without coordinates, the sampler takes the last `k` in order."""
    high = _slab(chips, k)
    if high is None:
        return chips[: len(chips) - k], chips[len(chips) - k :]
    return [d for d, h in zip(chips, high) if not h], [d for d, h in zip(chips, high) if h]


def _slab(chips: list, k: int):
    """bool[len(chips)]: the `k` chips of highest coordinates along the first physical axis
    whose layers make a slab of `k`; None without coordinates or such a slab."""
    coords = [getattr(d, "coords", None) for d in chips]
    if any(x is None for x in coords):
        return None
    xyz = np.asarray(coords)
    lo, span = xyz.min(0), (xyz.max(0) - xyz.min(0) + 1).tolist()
    if math.prod(span) != len(chips):  # the host's chips do not fill a box
        return None
    for axis, n in enumerate(span):
        layer = len(chips) // n  # chips in one layer across this axis
        if k % layer == 0 and 0 < k // layer < n:
            return xyz[:, axis] - lo[axis] >= n - k // layer
    return None


def split_sizes(devices) -> list[int]:
    """The rollout.devices values that split `devices` into boxes of the torus on every host
    (`host_split`); every multiple of the hosts below the device count for devices without
    coordinates."""
    hosts = sorted({d.process_index for d in devices})
    mine = [d for d in devices if d.process_index == hosts[0]]
    torus = getattr(mine[0], "coords", None) is not None
    return [k * len(hosts) for k in range(1, len(mine)) if not torus or _slab(mine, k) is not None]


def training_mesh(c, devices=None):
    """The mesh of `config.mesh` over the train step's devices (`device_split`); a
    ConfigError when they do not fit."""
    train_devices = device_split(c, devices)[0]  # its own ConfigError names rollout.devices
    try:
        return runtime.mesh_from_config(c.mesh, train_devices)
    except ValueError as e:
        what = (
            f"the {len(train_devices)} devices rollout.devices leaves" if c.rollout.devices else ""
        )
        raise ConfigError(f"config.mesh: {e}{' (' + what + ')' if what else ''}") from None


def sampling_devices(c, mesh, devices=None):
    """The devices the samplers lay their mesh over: the training mesh `mesh`, or with
    rollout.devices a mesh of the sampler's own devices (`device_split`)."""
    if not c.rollout.devices:
        return mesh
    return runtime.make_mesh(1, -1, 1, devices=device_split(c, devices)[1])


def check_rows(c, mesh, processes: int | None = None) -> None:
    """The batch rows (every process's prompts_per_step x num_generations) are split evenly
    over the mesh's data x fsdp devices, into mini-batches of actor.global_batch_size
    prompts (each split evenly over the devices too) and each into optim.micro_batches.
    processes: the number of hosts (default: this run's)."""
    processes = jax.process_count() if processes is None else processes
    shards = row_shards(mesh)
    rows = c.prompts_per_step * c.rollout.num_generations
    if (rows * processes) % shards:
        raise ConfigError(
            f"config.prompts_per_step x rollout.num_generations = {rows} rows per process "
            f"({processes} processes) do not split evenly over mesh.data x mesh.fsdp x "
            f"mesh.expert = {shards} devices: make the rows a multiple of {shards}, or move "
            "devices to mesh.tensor or mesh.sequence"
        )
    gbs = c.actor.global_batch_size  # a divisor of prompts_per_step (its setting's rule)
    updates = c.prompts_per_step // (gbs or c.prompts_per_step)
    m, total = c.optim.micro_batches, rows * processes // updates
    if total % m:
        raise ConfigError(
            f"config.optim.micro_batches = {m} does not divide the {total} rows of a "
            f"{'mini-batch' if updates > 1 else 'step'} (actor.global_batch_size or "
            f"prompts_per_step x rollout.num_generations x {processes} processes)"
        )
    if updates > 1 and total % shards:
        raise ConfigError(
            f"config.actor.global_batch_size = {gbs}: a mini-batch's {total} rows do not "
            f"split evenly over mesh.data x mesh.fsdp x mesh.expert = {shards} devices"
        )


def process0_says(flag: bool) -> bool:
    """Process 0's flag on every process (a decision from each host's own clock must be the
    same everywhere: a host that stops alone leaves the others waiting in a collective)."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.asarray(flag, np.int32)))


def check_nonfinite(streak: int, limit: int) -> None:
    if streak >= limit:
        raise FloatingPointError(
            f"{streak} consecutive steps with a non-finite loss or gradient (limit "
            f"config.max_nonfinite_steps={limit}); each was skipped, the parameters are those "
            "of the last finite step. Lower optim.lr, check the rewards and the data, or resume "
            "from the last checkpoint"
        )


MATMUL_PRECISIONS = ("default", "high", "highest")


def matmul_precision(name: str):
    """The context under which a run traces its programs: float32 matmuls at `name` (the
    config's `model.matmul_precision`), for those programs only, not the process."""
    if name not in MATMUL_PRECISIONS:
        raise ConfigError(f"model.matmul_precision={name!r}: expected one of {MATMUL_PRECISIONS}")
    return jax.default_matmul_precision(name)
