"""The main job: sample -> reward -> filter -> fused train step -> log -> checkpoint.

    python -m jaxvrl.train --config configs/tprl.py [--config.key=value ...]

Read top to bottom: setup (model and tokenizer, data, train state, samplers, the rollout
phase, resume), then the loop in `run`: rollout phase, train step, logs, checkpoint. The
ConfigDict is read here and by the constructors of jaxvrl/trainer/build.py; the train step
reads its frozen copy (`StepConfig`).

Resume order: the fresh train state is the restore target; the checkpoint's arrays, RNG key,
data-iterator state, running totals and replay buffer replace it (dynamic sampling carries
nothing from one step to the next: its surplus groups are dropped); metrics and markdown logs
written after the checkpoint's step are dropped, so the resumed run writes each step once.

Devices (docs/scaling.md): one SPMD program on the mesh `config.mesh` (data, fsdp, tensor;
one device is a 1x1x1 mesh), several hosts joined by `config.distributed`. The train state is
created sharded, the state and the RNG restore into their shardings, every process samples
and scores its own rows (`runtime.place_batch` joins them into the global batch,
`runtime.host_local` hands each process its rows back).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxvrl import hub, models, rl
from jaxvrl.checkpoint import (
    Checkpointer,
    PreemptionFlag,
    saved_with_other_settings,
    stop_requested_everywhere,
)
from jaxvrl.config import (
    ConfigError,
    describe_config,
    flat_keys,
    get,
    load_config,
    parse_argv,
    validate,
)
from jaxvrl.data.from_config import (
    builtin_task,
    checkpoint_dir,
    encode_options,
    row_format,
    train_source,
)
from jaxvrl.data.loader import make_dataset
from jaxvrl.data.pipeline import collate, encode_rows, read_rows
from jaxvrl.data.sources import DataNotFound
from jaxvrl.export import write_run_info
from jaxvrl.logging import backend_names, show_logs
from jaxvrl.models import load
from jaxvrl.parallel import runtime
from jaxvrl.parallel.sharding import row_shards
from jaxvrl.remote import MirroredDir, is_remote, probe_writable
from jaxvrl.rl.reward_pool import RewardsInterrupted
from jaxvrl.rl.rewards import (
    RewardFailing,
    SafeReward,
    load_reward_fn,
    reward_kwargs,
    reward_names,
)
from jaxvrl.sampling import (
    Sampler,
    SamplingConfig,
    decode_bytes,
    generation_config,
    rollout_dtype,
    rollout_mesh,
)
from jaxvrl.trainer.build import init_train_state, sampling_params, step_config
from jaxvrl.trainer.counters import RunCounters
from jaxvrl.trainer.diagnostics import AttentionMaps
from jaxvrl.trainer.packing import StepShapes, fit_batch
from jaxvrl.trainer.replay_state import load_buffer, save_buffer
from jaxvrl.trainer.reporting import RunLogs, evaluate, step_scalars
from jaxvrl.trainer.reward_model import NAME as RM_NAME
from jaxvrl.trainer.reward_model import RewardModel
from jaxvrl.trainer.rollout import FilterOptions, RolloutPhase
from jaxvrl.trainer.scoring import RewardScorer
from jaxvrl.trainer.step import build_train_step

log = logging.getLogger("jaxvrl")
EMBEDDED = models.EMBEDDED


def train_data(c, tokenizer, model_config=None):
    """-> (iterator, rows, skip stats): a grain iterator of prompts_per_step encoded examples
    per next() (shuffled per epoch, sharded per process; its state goes into the checkpoint),
    the number of rows in this process's shard, and the live counts of skipped bad rows."""
    source = train_source(c)
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


def val_examples(c, tokenizer, model_config=None) -> list:
    """Encoded held-out examples (val_files, or the built-in task's test split)."""
    opts = encode_options(c, model_config)
    if c.data.val_files:
        examples, stats = [], None
        for path in c.data.val_files.split(","):
            try:
                rows = read_rows(path, fmt=row_format(c))
            except DataNotFound as e:
                raise ConfigError(f"config.data.val_files={e.path!r}: {e.reason}") from None
            ex, stats = encode_rows(rows, tokenizer, opts, source=path, stats=stats)
            examples += ex
    elif not c.data.train_files:
        make = builtin_task(c).make_split
        rows = make("test", c.val_size, c.seed, kinds=tuple(c.data.synthetic_kinds))
        examples, stats = encode_rows(rows, tokenizer, opts, source="builtin:val")
    else:
        return []
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


def check_model_settings(c, model_config) -> None:
    """A text-only model (no vision tower) refuses, at start, a built-in task whose rows hold
    images and the settings that read the image: the perceptual pass's filtering and
    shaping, VGR's token weights, the MDI reward."""
    if getattr(model_config, "num_labels", None):
        raise ConfigError(
            f"config.model.path: a {model_config.hf_architecture} is a sequence classifier; "
            "the policy is a causal LM (a classifier goes in reward.model.path)"
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
    from transformers import AutoTokenizer

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
    tokenizer = AutoTokenizer.from_pretrained(path)
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


def sampling_config(c, mcfg, tokenizer=None, entropies: bool = False) -> SamplingConfig:
    """The rollout's SamplingConfig for model config `mcfg`: EOS from the model config (else
    the tokenizer's), pad from the tokenizer (0 without one), vision tokens suppressed;
    entropies: return each token's entropy (the trainer's token shaping reads them)."""
    if mcfg.eos_token_id is not None:
        eos = tuple(int(x) for x in np.atleast_1d(mcfg.eos_token_id))
    else:
        eos = (tokenizer.eos_token_id,) if tokenizer is not None else ()
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
    return dataclasses.replace(cfg, slots=r.slots, page_size=r.page_size, entropies=entropies)


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
    try:
        m = c.rollout.mesh
        rmesh = rollout_mesh(mesh, m.data, m.tensor, kv, weights, cache)
    except ValueError as e:
        raise ConfigError(f"config.rollout.mesh: {e}") from None
    groups = rmesh.shape["data"]
    if (rows * processes) % groups:
        raise ConfigError(
            f"config.prompts_per_step x rollout.num_generations = {rows} rows per process "
            f"({processes} processes) do not split evenly over the rollout's {groups} data "
            "groups (rollout.mesh.data): set rollout.mesh.data or rollout.mesh.tensor so "
            "that they do"
        )
    return rmesh, dtype  # the same devices' platform as `mesh`'s


def make_samplers(graph, mcfg, tokenizer, c, mesh=None):
    """-> (sampler, greedy): the rollout sampler and the greedy one for validation, for the
    model graph `graph` (after init: with LoRA adapters) with config `mcfg`, in the rollout
    layout over the devices of the training mesh `mesh` (`rollout_layout`; None: one
    device, the model's dtype)."""
    cfg = sampling_config(c, mcfg, tokenizer, entropies=step_config(c, mesh).sampler_shaping)
    greedy = dataclasses.replace(cfg, temperature=0.0, entropies=False)
    rmesh, dtype = None, None
    if mesh is not None:
        rmesh, dtype = rollout_layout(c, mesh, mcfg.text)
    return Sampler(graph, cfg, rmesh, dtype), Sampler(graph, greedy, rmesh, dtype)


def make_rollout_phase(
    c, sampler, greedy, tokenizer, model_config, step_cfg, mesh=None
) -> RolloutPhase:
    # rewards are keyed by the names they are logged under
    names = reward_names(c.reward.funcs, c.reward.names)
    kwargs = reward_kwargs(c.reward.kwargs, names, c.reward.funcs)
    try:  # each function's form is recognised by its signature
        fns = {
            n: SafeReward(n, load_reward_fn(f), f, kwargs[n]) for n, f in zip(names, c.reward.funcs)
        }
    except TypeError as e:
        raise ConfigError(f"config.reward.funcs: {e}") from None
    scorer = RewardScorer(
        fns,
        num_workers=c.reward.num_workers,
        timeout_s=c.reward.timeout_s,
        image_dir=c.data.image_dir or None,
        max_failure_fraction=c.reward.max_failure_fraction,
        failure_window=c.reward.failure_window,
        constants={"mdi_balance_ratio": c.reward.mdi_balance_ratio},
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
        ),
        rewards=fns,
        scorer=scorer,
        reward_weights=lambda step: rl.stage_reward_weights(
            step, regular, early, c.reward.early_steps
        ),
        opts=opts,
        attention=(c.vgr.layer_set, c.vgr.token_weight_last_k_layers) if stats else None,
        with_pools=step_cfg.needs_attention,
        mdi_balance_ratio=c.reward.mdi_balance_ratio,
        replay=replay,
        greedy=greedy if c.algorithm.adv_estimator == "remax" else None,
        mesh=mesh,
        accuracy=by_spec.get("mc_idx"),
        reward_model=reward_model(c, names, mesh),
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


def make_validate(
    c, examples, greedy, model_config, tokenizer, mesh=None, decode=None, scorer=None
):
    """-> validate(params): greedy val/accuracy and val/format on the held-out examples, in
    batches of the rollout's row count (`decode`: where the rollout keeps its decode
    weights, reused here), and with `scorer` (the rollout's) val/reward/<name>."""
    val_collate = functools.partial(
        collate,
        repeat=1,
        model_config=model_config,
        tokenizer=tokenizer,
        prompt_bucket=c.data.prompt_bucket,
        with_pools=False,
    )
    rows = c.prompts_per_step * c.rollout.num_generations
    return lambda params: evaluate(
        examples, greedy, params, val_collate, tokenizer, rows, mesh, decode, scorer
    )


def load_start_params(path: str, state, ref_params, ref_shardings):
    """config.load_checkpoint_path (`<dir>/<step>`): that checkpoint's parameters with a fresh
    optimizer at step 0; they are also the reference policy's."""
    directory, step = os.path.split(path.rstrip("/"))
    if not step.isdigit():
        raise ConfigError(f"config.load_checkpoint_path={path!r}: expected <dir>/<step>")
    ck = Checkpointer(directory)
    params = ck.restore_step(int(step), {"state": state})["state"].params
    ck.close()
    print(f"parameters from {path}", flush=True)
    ref = None
    if ref_params is not None:  # distinct buffers (the state is donated), sharded like params
        ref = runtime.place_state(jax.tree.map(jnp.array, params), ref_shardings)
    return state.replace(params=params), ref


def resume(c, ckpt: Checkpointer, state, data, mesh, counters: RunCounters, replay=None):
    """-> (start step, state, rng, meta: the checkpoint's JSON run state, e.g. the
    consecutive non-finite steps and the step shapes compiled) from the latest checkpoint in
    workdir, or the fresh ones; the data iterator, the running totals and the replay
    buffer (`replay`: rl.ReplayBuffer or None) continue from their saved state. The arrays
    restore into `state`'s shardings, the RNG replicated over the mesh (a global array every
    process can save)."""
    rng = runtime.replicate(jax.random.key(c.seed), mesh)
    if not c.resume or ckpt.latest_step() is None:
        return 0, state, rng, {}
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
    print(f"resumed from step {r.step}", flush=True)
    return r.step, r["state"], r["rng"], r["meta"]


def training_mesh(c):
    """The mesh of `config.mesh` over this run's devices; a ConfigError when they do not fit."""
    try:
        return runtime.mesh_from_config(c.mesh)
    except ValueError as e:
        raise ConfigError(f"config.mesh: {e}") from None


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
            f"({processes} processes) do not split evenly over mesh.data x mesh.fsdp "
            f"= {shards} devices: make the rows a multiple of {shards}, or move devices to "
            "mesh.tensor"
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
            f"split evenly over mesh.data x mesh.fsdp = {shards} devices"
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


def _short(metrics: dict) -> str:
    return ", ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items()))


MATMUL_PRECISIONS = ("default", "high", "highest")


def matmul_precision(name: str):
    """The context under which a run traces its programs: float32 matmuls at `name` (the
    config's `model.matmul_precision`), for those programs only, not the process."""
    if name not in MATMUL_PRECISIONS:
        raise ConfigError(f"model.matmul_precision={name!r}: expected one of {MATMUL_PRECISIONS}")
    return jax.default_matmul_precision(name)


def run(c) -> dict:
    """Train (or only validate) per config `c`; returns the last step's scalars plus the
    compile counts (`compiles/*`). Programs are traced at `model.matmul_precision`. Every
    setting's rules are checked first (`load_config` did so too; a caller may have changed
    the ConfigDict since)."""
    validate(c)
    with matmul_precision(c.model.matmul_precision):
        return _run(c)


def _run(c) -> dict:
    runtime.initialize_distributed(c.distributed)  # a no-op unless distributed.enable
    t_start = time.time()
    mesh = training_mesh(c)
    check_rows(c, mesh)
    primary = jax.process_index() == 0
    # checkpoints go to the workdir itself (orbax writes gs://); logs are written locally and
    # mirrored to a remote workdir by process 0
    if primary:  # before anything loads: a workdir that cannot be written ends the run here
        try:
            probe_writable(c.workdir)
        except Exception as e:  # an OSError locally, the filesystem's own error on gs://
            raise ConfigError(f"config.workdir={c.workdir!r}: cannot be written ({e})") from None
    mirror = MirroredDir(c.workdir) if primary and is_remote(c.workdir) else None
    if not is_remote(c.workdir):
        os.makedirs(c.workdir, exist_ok=True)
    logdir = mirror.local if mirror else c.workdir
    # checkpoints resume only into the model they were saved from (checked before any loading)
    other = c.resume and saved_with_other_settings(c.workdir, run_info(c))
    if other:
        raise ConfigError(f"{c.workdir}: saved with {other}; use another workdir or set it back")
    source = model_source(c)  # a Hub name or gs:// directory fetched: before any loading
    check_model_settings(c, models.load_config(source[0]))
    if primary:
        write_run_info(logdir, run_info(c, commit=source[1]))

    model, tokenizer = load_model(c, source)
    data, train_rows, skipped = train_data(c, tokenizer, model.config)
    # the state, optimizer state and reference copy are created sharded; init runs on a copy
    # of the model, whose graph after init (LoRA adapters) is the sampler's
    s = runtime.sharded_train_state(init_train_state, model, mesh, c)
    state, ref_params = s.state, s.ref_params
    step_cfg = step_config(c, mesh)
    # state donated, metrics replicated (build_train_step is looked up here, so that tests can
    # wrap the step function)
    step_fn = build_train_step(s.graphdef, s.tx, step_cfg)
    train_step = runtime.jit_train_step(step_fn, mesh, s.state_shardings, s.ref_shardings)
    sampler, greedy = make_samplers(s.model_graphdef, model.config, tokenizer, c, mesh)
    rmesh = sampler.mesh  # the rollout's layout: the prompts go there
    phase = make_rollout_phase(c, sampler, greedy, tokenizer, model.config, step_cfg, rmesh)
    examples = val_examples(c, tokenizer, model.config)
    validate = make_validate(
        c, examples, greedy, model.config, tokenizer, rmesh, phase.decode, phase.scorer
    )
    ckpt = Checkpointer(os.path.join(c.workdir, "checkpoints"), c.max_to_keep)
    state = runtime.place_state(state, s.state_shardings)  # the restore target's shardings
    counters = RunCounters(skipped, phase.rewards)
    start, state, rng, meta = resume(c, ckpt, state, data, mesh, counters, phase.replay)
    nonfinite = int(meta.get("nonfinite_streak", 0))
    # the step shapes compiled so far, for later batches to reuse (a resumed run takes the
    # shapes the uninterrupted run would)
    step_shapes = StepShapes.from_json(meta.get("step_shapes", []))
    if start == 0 and c.load_checkpoint_path:
        state, ref_params = load_start_params(
            c.load_checkpoint_path, state, ref_params, s.ref_shardings
        )
    # Rows of steps after `start` (a run cut off after its last checkpoint, or a fresh start
    # over an old run) are dropped; val_only appends nothing after step 0.
    logs = RunLogs(
        *(logdir, c.total_steps, start, primary, start if start else -1, c.log_samples),
        backends=backend_names(c.logging.backends),
        project=c.logging.project,
        run_name=c.logging.run_name or f"{c.name}-{os.path.basename(c.workdir.rstrip('/'))}",
        config={k: get(c, k) for k in flat_keys(c)},
    )

    metrics = {}
    if c.val_only or (start == 0 and c.val_before_train):
        metrics = validate(sampling_params(state))
        if start == 0:
            logs.scalars(0, metrics, progress=False)
        print(f"step {start}: {_short(metrics)}", flush=True)
    maps = None
    if c.logging.attention_samples:
        n = c.logging.attention_samples
        maps = AttentionMaps.build(sampler.graphdef, model.config, n, step_cfg)
    compiler = concurrent.futures.ThreadPoolExecutor(1, "jaxvrl-diagnostics")
    flag = PreemptionFlag()
    shapes = set()  # the train step's batch shapes (each compiles a program)

    def save(n: int, step_rng) -> None:
        meta = {"nonfinite_streak": nonfinite, "step_shapes": step_shapes.to_json()}
        items = {
            "state": state,
            "rng": step_rng,
            "meta": meta,
            "data_state": data.get_state(),
            "counters": counters.state(),
            "replay": None if phase.replay is None else save_buffer(phase.replay),
        }
        ckpt.save(n, items)

    try:
        for step in range(start, 0 if c.val_only else c.total_steps):
            t0 = time.time()
            done = step + 1
            step_rng = rng
            rng, k_sample, k_step = jax.random.split(rng, 3)
            params = sampling_params(state)
            try:
                rollout = phase.run(
                    params, step, k_sample, data, train_rows, stop=lambda: flag.requested
                )
            except RewardsInterrupted:  # SIGTERM while the rewards ran: the last step saved
                if ckpt.latest_step() != step:
                    save(step, step_rng)
                print(f"stopping at step {step} (SIGTERM during the rewards); saved", flush=True)
                break
            logged = bool(c.log_rollouts_every) and step % c.log_rollouts_every == 0
            pictures = logged and maps is not None
            if pictures:  # the diagnostic pass compiles beside the train step
                maps.prepare(params, rollout, compiler)
            # each process passes its own rows; they join into the global batch
            batch = fit_batch(rollout.batch, k_step, step_cfg, mesh, step_shapes)  # its real tokens
            shapes.add(runtime.shape_key(batch))
            batch = runtime.place_batch(batch, mesh)
            state, step_metrics, extras = train_step(state, ref_params, batch, k_step)
            step_metrics = jax.device_get(step_metrics)  # waits for the step to finish
            metrics = step_scalars(rollout, step_metrics, time.time() - t0)
            # the step's shape: completion columns kept, packed buffers per device group
            metrics["train/completion_columns"] = float(batch.completion_length)
            metrics["train/pack_buffers"] = float(batch.pack_buffers)
            metrics["train/micro_batches"] = float(batch.micro_batches or c.optim.micro_batches)
            metrics["compiles/train_step"] = float(runtime.compiles(train_step))
            metrics.update(counters.update(metrics))
            if (c.val_freq and done % c.val_freq == 0) or done == c.total_steps:
                metrics.update(validate(sampling_params(state)))
            failing = phase.scorer.end_step()  # a reward failing too often ends the run
            logs.scalars(done, metrics)
            if logged:
                host = runtime.host_local(extras)
                rows = logs.sample_rows(rollout, host, tokenizer)
                logs.markdown(done, runtime.gather_json(rows))  # every process's rows
                if pictures:  # a diagnostic pass over a few of the rows
                    try:
                        samples = maps(sampling_params(state), rollout, host.token_weights)
                        logs.attention_maps(done, samples, tokenizer)
                    except Exception:  # noqa: BLE001 -- the pictures must not stop training
                        logs.picture_failures += 1
                        log.exception("attention pictures of step %d failed", done)
            if mirror:
                mirror.push()  # at most every 30 s
            nonfinite = nonfinite + 1 if metrics["train/nonfinite"] else 0
            check_nonfinite(nonfinite, c.max_nonfinite_steps)

            over_budget = bool(c.time_budget_s) and process0_says(
                time.time() - t_start > c.time_budget_s
            )
            failed = runtime.any_process(failing is not None)
            stop = stop_requested_everywhere(flag) or over_budget or failed
            if stop or done == c.total_steps or (c.save_freq and done % c.save_freq == 0):
                save(done, rng)
            if failed:  # after the checkpoint: one `error:` line, exit 2
                raise RewardFailing(failing or "a reward function failed too often on a host")
            if stop:
                why = "SIGTERM" if flag.requested else "time budget"
                print(f"stopping at step {done} ({why}); checkpoint saved", flush=True)
                break
    finally:
        flag.restore()
        phase.close()
        compiler.shutdown(wait=True)
        ckpt.close()
        logs.close()
        if mirror:
            mirror.push(force=True)
    metrics["compiles/train_step"] = runtime.compiles(train_step)
    metrics["compiles/train_step_shapes"] = len(shapes)  # distinct batch shapes trained on
    metrics["compiles/sampler"] = sampler.compiles()
    metrics["compiles/greedy_sampler"] = greedy.compiles()
    return metrics


def main(argv=None) -> None:
    show_logs()
    argv = list(sys.argv[1:] if argv is None else argv)
    show = "--help_config" in argv
    try:
        path, overrides = parse_argv([a for a in argv if a != "--help_config"])
        config = load_config(path, overrides)
        if show:  # every key with its value (after the overrides) and its comment in base.py
            print(describe_config(config, path))
            return
        final = run(config)
    except ConfigError as e:  # the user's to fix: one line, no traceback
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    if "val/accuracy" in final:
        print(f"final val/accuracy {final['val/accuracy']:.3f}", flush=True)
    if math.isnan(final.get("loss", 0.0)):
        sys.exit(1)


if __name__ == "__main__":
    main()
