"""Compile the main job's programs for a TPU slice ahead of time, on any machine.

    python -m jaxvrl.aot --config configs/tprl.py --topology=v5p-16 \
        --config.model.preset=qwen2.5-vl-7b [--config.key=value ...] [--suggest]

Builds what `jaxvrl.train` builds, as shapes only (no weights are read: a `model.path` holding
just a `config.json`, or `model.preset`, is enough), on a mesh (`config.mesh`) over the slice's
abstract devices, and compiles with the XLA TPU compiler (`libtpu`, `pip install -e '.[tpu]'`):
- `train_step`: the jitted, donated train step with the run's batch shapes (every process's
  prompts_per_step x num_generations rows, prompts of data.max_prompt_length holding one image
  of data.max_pixels, completions of rollout.max_new_tokens), micro-batches, remat, dtypes,
  LoRA, critic, reference and perturbed-image passes as configured;
- `sampler`: the rollout sampler (prefill + the whole decode loop) on the same rows;
- `decode_step`: one decode step alone, to price it against the bytes it must read.

For each it prints the compile time, HBM per device, the XLA cost model's FLOPs and time
(loops counted), the MFU that implies, the collectives and the largest arrays; a last line
holds them as JSON. Exit status 1 when a program does not fit (with the knobs that help), 2
for a bad argument or no TPU compiler. Flags besides --config: --topology=NAME (v4-8, v5e-16,
v5p-16, v6e-8, ...), --programs=train_step,sampler,decode_step, --jobs=N (compiles at once),
--suggest (micro-batches, host offload, then mesh.sequence from fsdp, until the step fits),
--lengths=FILE of integers or lognormal:median=M,sigma=S (completion lengths for the step's
rows: packing, MFU on real tokens; with the decode step, the mix's decode loop against its
steps' bounds). --iteration=K|auto prices one RL iteration for the --lengths mix:
synchronous, partial, one-step-off with the rollout on K chips (auto: the fastest), both.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import os
import sys

import numpy as np

from jaxvrl.aot.report import format_report, knobs, with_decode_steps

PROGRAMS = ("train_step", "sampler", "decode_step")


def _split_args(argv: list[str]) -> tuple[dict, list[str]]:
    """Our flags (--topology, --suggest, --programs) apart from the config's."""
    ours, rest, i = {}, [], 0
    while i < len(argv):
        a = argv[i]
        name = a.split("=", 1)[0]
        if name in ("--topology", "--programs", "--jobs", "--lengths", "--iteration"):
            if "=" in a:
                ours[name[2:]] = a.split("=", 1)[1]
            elif i + 1 < len(argv):
                ours[name[2:]], i = argv[i + 1], i + 1
            else:
                raise SystemExit(f"{name} needs a value")
        elif a == "--suggest":
            ours["suggest"] = True
        else:
            rest.append(a)
        i += 1
    if "topology" not in ours:
        raise SystemExit("missing --topology, e.g. --topology=v5p-16")
    return ours, rest


def main(argv=None) -> int:
    import jax

    if "JAX_PLATFORMS" not in os.environ:
        jax.config.update("jax_platforms", "cpu")  # the host only traces; programs are TPU's
    from jaxvrl.aot.plan import Plan
    from jaxvrl.config import ConfigError, load_config, parse_argv

    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(__doc__)
        return 0
    ours, rest = _split_args(argv)
    try:
        path, overrides = parse_argv(rest)
        c = load_config(path, overrides)
        plan = Plan.build(c, ours["topology"], lengths=ours.get("lengths"))
    except (ConfigError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    programs = tuple(ours.get("programs", ",".join(PROGRAMS)).split(","))
    if set(programs) - set(PROGRAMS):
        print(f"error: --programs takes {', '.join(PROGRAMS)}", file=sys.stderr)
        return 2
    print(plan.describe(), flush=True)
    # The TPU compiler runs mostly on one thread and releases the GIL: programs compile side
    # by side, one per core
    jobs = max(1, min(len(programs), int(ours.get("jobs", os.cpu_count() or 1))))
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        reports = list(pool.map(plan.compile, programs))
    by_name = {r.name: r for r in reports}
    if "sampler" in by_name and "decode_step" in by_name and not by_name["sampler"].error:
        # the sampler's program prices its decode loop's body once: priced as its prefill
        # plus every decode step at the decode step's estimate
        steps = plan.c.rollout.max_new_tokens
        r = with_decode_steps(by_name["sampler"], by_name["decode_step"], steps, plan.slice)
        reports[reports.index(by_name["sampler"])] = r
    for r in reports:
        print(format_report(r), flush=True)
    loop = _decode_loop(plan, by_name) if plan.lengths is not None else None
    failed = [r.name for r in reports if not r.fits]
    suggestion = None
    if failed:
        help_ = "; ".join(knobs(plan.c, plan.mesh))
        print(f"does not fit: {', '.join(failed)}. Knobs that help: {help_}")
        if ours.get("suggest") and "train_step" in failed:
            step = next(r for r in reports if r.name == "train_step")
            suggestion = _suggest(plan, step, ours.get("lengths"))
    if "iteration" in ours and not failed:
        out_iteration = _iteration(plan, by_name, ours["iteration"], ours, jobs)
        if out_iteration is None:
            return 1
    out = {
        "topology": plan.slice.name,
        "mesh": dict(plan.mesh.shape),
        "rollout_mesh": dict(plan.rollout[0].shape),
        "rollout_dtype": plan.rollout[1] or plan.c.model.dtype,
        "fits": not failed,
        "programs": {r.name: r.as_json() for r in reports},
    }
    if suggestion:
        out["suggest"] = suggestion
    if loop:
        out["decode_loop"] = loop
    if "iteration" in ours and not failed:
        out["iteration"] = out_iteration
    print(json.dumps(out), flush=True)
    return 1 if failed else 0


def _decode_loop(plan, reports: dict) -> dict | None:
    """The --lengths mix's decode loop (`iteration.decode_loop`) on the static sampler, printed
    against the sum of its steps' bounds; None without a fitting decode step."""
    from jaxvrl.aot import iteration
    from jaxvrl.models.cached_kernels import row_block
    from jaxvrl.parallel import topology
    from jaxvrl.parallel.sharding import row_shards

    step = reports.get("decode_step")
    if step is None or not step.fits or step.bound_s is None:
        return None
    bandwidth = topology.bandwidth(plan.slice)
    cache = step.breakdown["kv_cache"]
    lengths, kernel = plan.completions, plan.decode_kernel
    priced = functools.partial(
        iteration.decode_loop, lengths, plan.prompt_len, plan.new_tokens, step_s=step.estimate_s,
        weights=step.bound_s * bandwidth - cache, cache=cache, bandwidth=bandwidth,
        written_only=kernel, step_bytes=step.bytes_accessed,
    )  # fmt: skip
    loop = priced(row_block=row_block(len(lengths) // row_shards(plan.rollout[0])))
    print(
        f"decode loop of the {len(lengths)} rows (completions median {int(np.median(lengths))}, "
        f"max {int(lengths.max())} of {plan.new_tokens}): {loop['steps']} steps of every row "
        f"(the static sampler{', the kernel reading running rows to the written slot' if kernel else ''}) "
        f"{loop['loop_s'] * 1e3:,.0f} ms; the steps' bounds (weights and "
        f"the running rows' filled cache) {loop['bound_s'] * 1e3:,.0f} ms: "
        f"{loop['loop_s'] / loop['bound_s']:.2f}x (at the full cache's bound "
        f"{loop['full_bound_s'] * 1e3:,.0f} ms)",
        flush=True,
    )
    if kernel:  # a slot per row: the paged kernel reads each running row's own pages
        loop["paged_loop_s"] = priced(row_block=1)["loop_s"]
        print(
            f"  the slots engine with a slot per row (rollout.slots={len(lengths)}), the paged "
            f"kernel reading each running row's pages to its written slot: "
            f"{loop['paged_loop_s'] * 1e3:,.0f} ms ({loop['paged_loop_s'] / loop['bound_s']:.2f}x;"
            " priced at the static decode step's other work)",
            flush=True,
        )
        per_slot = cache / (len(lengths) * (plan.prompt_len + plan.new_tokens))
        narrowed = _narrowed_loop(plan, step, per_slot)
        if narrowed:
            loop["narrowed"] = narrowed
            print(
                f"  the same, narrowing (rollout.narrow={plan.sampling_config().narrow}: "
                + ", ".join(f"{w} slots {n:,} steps" for w, n in narrowed["at"].items())
                + f"): {narrowed['loop_s'] * 1e3:,.0f} ms "
                f"({narrowed['loop_s'] / loop['bound_s']:.2f}x; each width's own step)",
                flush=True,
            )
    return loop


def _narrowed_loop(plan, step, per_slot: float) -> dict | None:
    """The slots engine with a slot per row of the --lengths mix, narrowing as the config's
    rollout.narrow says (`iteration.engine_loop`), each width's decode step compiled for its
    rows; None where it would not narrow."""
    from jaxvrl.aot import iteration

    rows = len(plan.completions)
    ladder = _ladder(plan, rows)
    if len(ladder) < 2:
        return None
    at = _steps_at(plan, step, rows)
    if any(not r.fits or r.estimate_s is None for r in at.values()):
        return None
    loop = iteration.engine_loop(
        plan.completions, rows, plan.prompt_len, plan.new_tokens, widths=ladder,
        step_at={w: (r.estimate_s, r.estimate_s / r.bytes_accessed) for w, r in at.items()},
        per_slot=per_slot, check_every=plan.sampling_config().check_every,
    )  # fmt: skip
    return dict(loop, step_s={w: r.estimate_s for w, r in at.items()})


def _ladder(plan, rows: int | None = None) -> list[int]:
    """The row counts a rollout of `rows` (default the plan's) with a slot per row narrows
    through (`steps.widths`, rollout.narrow)."""
    from jaxvrl.parallel.sharding import row_shards
    from jaxvrl.sampling.steps import widths

    return widths(rows or plan.rows, row_shards(plan.rollout[0]), plan.sampling_config())


def _steps_at(plan, step, rows: int | None = None) -> dict:
    """{width: the decode step compiled at that many rows} over `_ladder`, `step` the one
    at all `rows`."""
    ladder = _ladder(plan, rows)
    at = {ladder[0]: step}
    for w in ladder[1:]:
        if w not in plan.steps_at:
            print(f"  compiling the decode step at {w} rows (a narrowed loop's)", flush=True)
        at[w] = plan.decode_step_at(w)
    return at


def _suggest(plan, step, lengths) -> dict | None:
    """Settings with which the train step fits: first the optimizer state in host memory
    where that state alone is more than the step is over, then more micro-batches, the
    offload, rows split over more chips; None (said) when none fits."""
    from jaxvrl.aot.plan import as_flags

    over = step.peak_bytes - step.hbm_bytes
    state_first = step.breakdown.get("optimizer", 0) >= over
    if state_first and (found := plan.suggest_offload(lengths)):
        print(f"suggest: {as_flags(found)} fits")
        return found
    m = plan.suggest_micro_batches(step)
    if m:
        print(f"suggest: --config.optim.micro_batches={m} fits")
        return {"optim.micro_batches": m}
    if not state_first and (found := plan.suggest_offload(lengths)):
        print(f"suggest: {as_flags(found)} fits")
        return found
    print("suggest: no micro-batch count fits on this mesh; splitting rows over chips")
    found = plan.suggest_sequence(lengths)
    print(f"suggest: {as_flags(found)} fits" if found else "suggest: no mesh.sequence fits either")
    return found


def _iteration(plan, reports: dict, k: str, ours: dict, jobs: int) -> dict | None:
    """Compiles the programs again with the rollout on `k` chips of their own ("auto": each
    size `setup.split_sizes` offers, keeping the fastest) and prints one iteration's price in
    each mode (`iteration.price`); None when no split fits."""
    import concurrent.futures as futures

    from jaxvrl.aot import iteration
    from jaxvrl.aot.plan import Plan, completion_lengths
    from jaxvrl.config import set_values
    from jaxvrl.parallel import topology
    from jaxvrl.trainer import setup

    if not {"train_step", "sampler", "decode_step"} <= set(reports):
        raise SystemExit("--iteration needs --programs=train_step,sampler,decode_step")
    sizes = setup.split_sizes(topology.tpu_devices(plan.slice))
    ks = sizes if k == "auto" else [int(k)] if k.isdigit() else []
    if not ks or set(ks) - set(sizes):
        raise SystemExit(
            f"--iteration={k}: the {plan.slice.name} slice splits into boxes of its torus "
            f"on every host with the rollout on {sizes} chips (or --iteration=auto)"
        )
    g, n = plan.c.rollout.num_generations, plan.c.rollout.max_new_tokens
    prompts = plan.rows // g
    lengths = completion_lengths(
        ours.get("lengths") or f"lognormal:median={n},sigma=0", plan.rows * 24, n
    )

    def work_of(ladder):  # each mode's decode steps (by width, narrowing as `ladder` says)
        return {
            "synchronous": iteration.rollout_work(
                lengths, prompts, g, plan.prompt_len, n, partial=False, widths=ladder
            ),
            "partial": iteration.rollout_work(
                lengths, prompts, g, plan.prompt_len, n, partial=True, widths=ladder,
                oversample=plan.c.rollout.oversample,
                max_staleness=max(plan.c.rollout.max_staleness, 2),
            ),
        }  # fmt: skip

    def per_token(sampler, p):  # the prefill's seconds per prompt token
        return sampler.fixed_s / (p.sampler_prompts * p.prompt_len)

    row_slots = plan.prompt_len + n  # a row's cache positions in the compiled decode step

    def decoding(p, decode) -> dict:  # each width's decode step and cache position price
        at = _steps_at(p, decode)
        out = {"decode_s": {w: r.estimate_s for w, r in at.items()}, "position_s": {}}
        kernel = p.decode_kernel and p.sampling_config().slots
        for w, r in at.items():  # the price of a cache position no running row reads
            rate = r.estimate_s / r.bytes_accessed  # seconds a byte, as XLA priced them
            # gathered pages or the static sampler: the whole cache every step
            out["position_s"][w] = (
                r.breakdown["kv_cache"] / (w * row_slots) * rate if kernel else 0.0
            )
        return out

    ladder = _ladder(plan)
    work = work_of(ladder)
    whole = dict(**decoding(plan, reports["decode_step"]),
                 prefill_s_per_token=per_token(reports["sampler"], plan),
                 train_s=reports["train_step"].estimate_s, positions=row_slots)  # fmt: skip
    ici = iteration.ICI_GBPS.get(plan.slice.chip.name, 0.0) * 1e9 / 2
    splits = {}
    for chips in ks:  # the split the run makes (`setup.device_split`), compiled as it runs
        c = plan.c.copy_and_resolve_references()
        set_values(c, {"rollout.devices": chips})
        split = Plan.build(c, plan.slice.name, lengths=ours.get("lengths"))
        print(f"the split: the rollout on {chips} chips, the train step on the other "
              f"{plan.slice.chips - chips}\n{split.describe()}", flush=True)  # fmt: skip
        with futures.ThreadPoolExecutor(jobs) as pool:
            parts = {r.name: r for r in pool.map(split.compile, PROGRAMS)}
        for r in parts.values():
            print(format_report(r), flush=True)
        if not all(r.fits for r in parts.values()):
            print(f"the split with the rollout on {chips} chips does not fit")
            continue
        steps = decoding(split, parts["decode_step"])
        split_work = work if _ladder(split) == ladder else work_of(_ladder(split))
        off = dict(split_train_s=parts["train_step"].estimate_s,
                   split_decode_s=steps["decode_s"], split_position_s=steps["position_s"],
                   split_prefill_s_per_token=per_token(parts["sampler"], split),
                   copy_s=parts["sampler"].breakdown["params"] / ici if ici else 0.0)  # fmt: skip
        splits[chips] = {
            mode: iteration.price(**whole, **off, work=work[kind], split_work=split_work[kind])
            for mode, kind in (("one-step-off", "synchronous"), ("both", "partial"))
        }
        print(f"rollout on {chips} chips: one-step-off "
              f"{splits[chips]['one-step-off']['iteration_s'] * 1e3:,.0f} ms, both "
              f"{splits[chips]['both']['iteration_s'] * 1e3:,.0f} ms", flush=True)  # fmt: skip
    if not splits:
        print("no split fits: no one-step-off price")
        return None
    best = min(splits, key=lambda chips: splits[chips]["both"]["iteration_s"])
    rest = plan.slice.chips - best
    modes = {
        "synchronous": iteration.price(**whole, work=work["synchronous"]),
        "partial": iteration.price(**whole, work=work["partial"]),
        f"one-step-off ({best} + {rest} chips)": splits[best]["one-step-off"],
        "both": splits[best]["both"],
    }
    base = modes["synchronous"]["iteration_s"]
    print("| mode | decode steps | prefill tokens | rollout ms | train ms | weight copy ms | "
          "iteration ms | vs synchronous |\n|---|---|---|---|---|---|---|---|")  # fmt: skip
    for name, m in modes.items():
        w = work["partial" if name in ("partial", "both") else "synchronous"]
        print(f"| {name} | {w['decode_steps']:,.0f} | {w['prefill_tokens']:,.0f} | "
              f"{m['rollout_s'] * 1e3:,.0f} | {m['train_s'] * 1e3:,.0f} | {m['copy_s'] * 1e3:,.1f} | "
              f"{m['iteration_s'] * 1e3:,.0f} | {m['iteration_s'] / base:.2f}x |")  # fmt: skip
    if len(ladder) > 1:  # where the rollouts narrowed
        for kind, w in work.items():
            at = ", ".join(f"{a['steps']:,.0f} at {r} rows" for r, a in w["at"].items())
            print(f"{kind} decode steps by width (rollout.narrow): {at}")
    return {"modes": modes, "work": work, "rollout_chips": best,
            "splits": {str(c): v for c, v in splits.items()}}  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
