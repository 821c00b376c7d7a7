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
import logging
import math
import os
import sys
import time

import jax

from jaxvrl import models
from jaxvrl.checkpoint import (
    Checkpointer,
    PreemptionFlag,
    saved_steps,
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
from jaxvrl.data.from_config import checkpoint_dir, train_source, val_sources
from jaxvrl.data.prompts import pool_token_ids
from jaxvrl.data.rows import DataError
from jaxvrl.export import write_run_info
from jaxvrl.logging import backend_names, show_logs
from jaxvrl.parallel import runtime
from jaxvrl.remote import MirroredDir, is_remote, probe_writable
from jaxvrl.rl.reward_pool import RewardsInterrupted
from jaxvrl.rl.rewards import (
    RewardFailing,
)
from jaxvrl.trainer.ahead import decode_ahead, encode_ahead
from jaxvrl.trainer.build import (
    init_train_state,
    optimizer_settings,
    sampling_params,
    step_config,
)
from jaxvrl.trainer.counters import RunCounters
from jaxvrl.trainer.diagnostics import AttentionMaps
from jaxvrl.trainer.groups import GroupsExhausted
from jaxvrl.trainer.packing import StepShapes, fit_batch
from jaxvrl.trainer.replay_state import encode_items, save_buffer
from jaxvrl.trainer.reporting import RunLogs, step_scalars
from jaxvrl.trainer.setup import (
    check_attention,
    check_decode_attention,
    check_model_settings,
    check_nonfinite,
    check_offload,
    check_rows,
    inert_settings,
    load_model,
    load_start_params,
    make_rollout_phase,
    make_samplers,
    make_validate,
    matmul_precision,
    model_source,
    process0_says,
    resume,
    reward_functions,
    rollout_layout,
    run_info,
    sampling_devices,
    train_data,
    training_mesh,
    val_examples,
)
from jaxvrl.trainer.step import build_train_step

log = logging.getLogger("jaxvrl")
EMBEDDED = models.EMBEDDED


def _short(metrics: dict) -> str:
    return ", ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items()))


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
    saved = [] if c.resume or c.val_only else saved_steps(c.workdir)
    if saved:  # a fresh run would save nothing over them, and exports read the newest
        raise ConfigError(
            f"config.resume=False: {c.workdir}/checkpoints holds an earlier run's steps (up to "
            f"{saved[-1]}), which this run's would not replace; set resume=True to continue "
            "it, or use another workdir (or remove those checkpoints)"
        )
    source = model_source(c)  # a Hub name or gs:// directory fetched: before any loading
    # what would end the run later ends it here, before the model loads: settings the model
    # or the devices cannot take, the rollout's layout, the rewards, the reward model's
    # checkpoint, the training and held-out files (columns, data.format)
    model_config = models.load_config(source[0])
    check_model_settings(c, model_config)
    for why in inert_settings(c) if primary else ():
        log.warning(why)
    check_attention(c, mesh.devices.flat[0])
    check_decode_attention(c, mesh.devices.flat[0])  # the rollout's devices are of this platform
    layout = rollout_layout(c, sampling_devices(c, mesh), model_config.text)
    rewards = reward_functions(c)
    if c.reward.model.path:
        checkpoint_dir(c.reward.model.path, "reward.model.path")
    rows = train_source(c)
    held_out = val_sources(c)
    if primary:
        write_run_info(logdir, run_info(c, commit=source[1]))

    model, tokenizer = load_model(c, source)
    data, train_rows, skipped = train_data(c, tokenizer, model.config, rows)
    # the state, optimizer state and reference copy are created sharded; init runs on a copy
    # of the model, whose graph after init (LoRA adapters) is the sampler's
    offload = check_offload(c, mesh)
    s = runtime.sharded_train_state(init_train_state, model, mesh, c, offload=offload)
    state, ref_params = s.state, s.ref_params
    step_cfg = step_config(c, mesh)
    # state donated, metrics replicated (build_train_step is looked up here, so that tests can
    # wrap the step function); an earlier run of this process with the same step lends its
    # program, and this run counts the programs and batch shapes it adds
    optimizer = optimizer_settings(c.optim, c.total_steps, step_cfg.updates)
    program = runtime.kept_program(
        (build_train_step, s.graphdef, optimizer, step_cfg, mesh)
        + (runtime.tree_key(s.state_shardings), runtime.tree_key(s.ref_shardings)),
        lambda: runtime.jit_train_step(
            build_train_step(s.graphdef, s.tx, step_cfg),
            *(mesh, s.state_shardings, s.ref_shardings),
        ),
    )
    train_step, known_shapes = program.fn, set(program.shapes)
    programs_before = runtime.compiles(train_step)
    sampler, greedy = make_samplers(
        s.model_graphdef, model.config, tokenizer, c, mesh, source[0], layout
    )
    rmesh = sampler.mesh  # the rollout's layout: the prompts go there
    phase = make_rollout_phase(
        c, sampler, greedy, tokenizer, model.config, step_cfg, rmesh, fns=rewards
    )
    examples = val_examples(c, tokenizer, model.config, held_out)
    validate = make_validate(c, examples, greedy, model.config, tokenizer, rmesh, phase)
    ckpt = Checkpointer(os.path.join(c.workdir, "checkpoints"), c.max_to_keep)
    state = runtime.place_state(state, s.state_shardings)  # the restore target's shardings
    counters = RunCounters(skipped, phase.tallies)
    start, state, rng, meta, carried = resume(
        c, ckpt, state, data, mesh, counters, phase.replay, phase.partial
    )
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

    # SIGTERM sets the flag from here: a notice during the first validation stops the run
    # before its first step (on a pod jax.distributed's own handler took it, and the run went
    # on to be killed unsaved)
    flag = PreemptionFlag()
    metrics, maps = {}, None
    try:
        if c.val_only or (start == 0 and c.val_before_train):
            metrics = validate(sampling_params(state))
            if start == 0:
                logs.scalars(0, metrics, progress=False)
            print(f"step {start}: {_short(metrics)}", flush=True)
        if c.logging.attention_samples:
            n = c.logging.attention_samples
            tokens = pool_token_ids(tokenizer, models.processor(model.config))
            maps = AttentionMaps.build(sampler.graphdef, model.config, n, step_cfg, tokens)
        last = start if c.val_only else c.total_steps
        if last > start and stop_requested_everywhere(flag):
            print(f"stopping before step {start + 1} (SIGTERM)", flush=True)
            last = start
    except BaseException:
        flag.restore()
        raise
    compiler = concurrent.futures.ThreadPoolExecutor(1, "jaxvrl-diagnostics")
    shapes = set()  # the train step's batch shapes (each compiles a program)

    # one-step-off training: (the next step's rollout, its train key, its policy version),
    # sampled on the sampler's own devices while a step trains
    off = bool(c.rollout.devices)
    ahead = None
    if carried is not None and carried.get("ahead") is not None:
        rollout_, key_, version_ = decode_ahead(carried["ahead"], phase)
        ahead = (rollout_, runtime.replicate(key_, mesh), version_)

    def before_rollout():
        """The data iterator's place before a rollout, which a rollout cut short by SIGTERM
        saves so that its examples are drawn again; None with partial rollouts, whose drawn
        examples and sampled rows stay in flight until scored (`PartialRollouts.generate`)."""
        return None if phase.partial is not None else data.get_state()

    def save(n: int, step_rng, data_state=None) -> None:
        meta = {"nonfinite_streak": nonfinite, "step_shapes": step_shapes.to_json()}
        flights = None if phase.partial is None else phase.partial.flights
        kept = None if ahead is None else encode_ahead(*ahead)
        items = {
            "state": state,
            "rng": step_rng,
            "meta": meta,
            "data_state": data.get_state() if data_state is None else data_state,
            "counters": counters.state(),
            "replay": None if phase.replay is None else save_buffer(phase.replay),
            "carried": None
            if flights is None and not off
            else encode_items([{"flights": flights, "ahead": kept}]),
        }
        ckpt.save(n, items)

    # SIGTERM abandons a step's running reward calls on one host; on a pod the signal
    # reaches the hosts at different times, and a host that stopped alone would save alone
    # (a collective the others never join): there the rewards finish and the step's end
    # stops every host at once (`stop_requested_everywhere`)
    rewards_stop = (lambda: flag.requested) if jax.process_count() == 1 else None

    def sample(step: int, params, key, version: int | None = None):
        return phase.run(params, step, key, data, train_rows, stop=rewards_stop, version=version)

    try:
        for step in range(start, last):
            t0 = time.time()
            done = step + 1
            step_rng = rng
            params = sampling_params(state)
            if ahead is not None:  # sampled while the last step trained
                rollout, k_step, _ = ahead
                ahead = None
            else:
                rng, k_sample, k_step = jax.random.split(rng, 3)
                before = before_rollout()
                try:
                    rollout = sample(step, params, k_sample, step if off else None)
                except RewardsInterrupted:  # SIGTERM while the rewards ran: the last step saved
                    if ckpt.latest_step() != step:
                        save(step, step_rng, before)
                    print(
                        f"stopping at step {step} (SIGTERM during the rewards); saved", flush=True
                    )
                    break
                except GroupsExhausted:  # the last step saved, then one `error:` line
                    if ckpt.latest_step() != step:
                        save(step, step_rng, before)
                    raise
            logged = bool(c.log_rollouts_every) and step % c.log_rollouts_every == 0
            pictures = logged and maps is not None
            if pictures:  # the diagnostic pass compiles beside the train step
                maps.prepare(params, rollout, compiler)
            # each process passes its own rows; they join into the global batch
            batch = fit_batch(rollout.batch, k_step, step_cfg, mesh, step_shapes)  # its real tokens
            shapes.add(runtime.shape_key(batch))
            program.shapes.add(runtime.shape_key(batch))
            batch = runtime.place_batch(batch, mesh)
            sync_s, behind = 0.0, None
            if off and done < c.total_steps:  # this step's weights onto the sampler's devices
                t_sync = time.time()
                behind = jax.block_until_ready(sampler.prepare(params))
                sync_s = time.time() - t_sync
            state, step_metrics, extras = train_step(state, ref_params, batch, k_step)
            interrupted, rewind, exhausted = False, None, None
            if behind is not None:  # the next step's rollout while this one trains
                rng_before, before = rng, before_rollout()
                rng, k_sample, k_next = jax.random.split(rng, 3)
                try:
                    ahead = (sample(done, behind, k_sample, step), k_next, step)
                except (RewardsInterrupted, GroupsExhausted) as e:  # saved after this step as
                    interrupted, rewind, rng = True, before, rng_before  # if it had not started
                    exhausted = e if isinstance(e, GroupsExhausted) else None
                del behind
            step_metrics = jax.device_get(step_metrics)  # waits for the step to finish
            metrics = step_scalars(rollout, step_metrics, time.time() - t0)
            if off:
                metrics["rollout/weight_sync_s"] = sync_s
            # the step's shape: completion columns kept, packed buffers per device group
            metrics["train/completion_columns"] = float(batch.completion_length)
            metrics["train/pack_buffers"] = float(batch.pack_buffers)
            metrics["train/micro_batches"] = float(batch.micro_batches or c.optim.micro_batches)
            metrics["compiles/train_step"] = float(runtime.compiles(train_step) - programs_before)
            metrics.update(counters.update(metrics))
            if (c.val_freq and done % c.val_freq == 0) or done == c.total_steps:
                metrics.update(validate(sampling_params(state)))
            failing = phase.end_step()  # a reward failing too often ends the run
            logs.scalars(done, metrics)
            if logged:
                host = runtime.host_local(extras)
                rows = logs.sample_rows(rollout, host, tokenizer)
                logs.markdown(done, runtime.gather_json(rows))  # every process's rows
                if pictures:  # a diagnostic pass over a few of the rows
                    try:
                        key = jax.random.fold_in(jax.random.key(c.seed), done)
                        samples = maps(sampling_params(state), rollout, host.token_weights, key)
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
            signalled = stop_requested_everywhere(flag)  # on any host
            stop = signalled or over_budget or failed or interrupted
            if stop or done == c.total_steps or (c.save_freq and done % c.save_freq == 0):
                save(done, rng, rewind)
            if failed:  # after the checkpoint: one `error:` line, exit 2
                raise RewardFailing(failing or "a reward function failed too often on a host")
            if exhausted is not None:
                raise exhausted
            if stop:
                why = "SIGTERM" if signalled or interrupted else "time budget"
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
    # the step's programs this run compiled, and the batch shapes new to it: equal when no
    # step recompiles
    metrics["compiles/train_step"] = runtime.compiles(train_step) - programs_before
    metrics["compiles/train_step_shapes"] = len(shapes - known_shapes)
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
    except (ConfigError, DataError) as e:  # the user's to fix: one line, no traceback
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    if "val/accuracy" in final:
        print(f"final val/accuracy {final['val/accuracy']:.3f}", flush=True)
    if math.isnan(final.get("loss", 0.0)):
        sys.exit(1)


if __name__ == "__main__":
    main()
