"""What TPRL and VGR cost on top of GRPO in jaxvrl's fused train step, and what the usual way
of getting attention maps (transformers, eager attention, `output_attentions=True`) costs on
top of a plain transformers forward, on the same model and batch.

    python bench/tprl_overhead.py                  # small config, 2 prompts x G=4, 256 tokens
    python bench/tprl_overhead.py --new-tokens 64 --rounds 3
    python bench/tprl_overhead.py --only jaxvrl    # or hf
    python bench/tprl_overhead.py --only jaxvrl --dtype bfloat16 --attention xla,flash,cudnn  # GPU
    python bench/tprl_overhead.py --only jaxvrl --attention xla,flash --algorithms GRPO,VGR \
        --prompts 1 --group 2 --new-tokens 2048 --rounds 2   # attention implementations

jaxvrl: one compiled train step per algorithm on the same RolloutBatch (the built-in task's
prompts with their images, random completions of N tokens, random rewards):
- GRPO: old-policy pass, advantages, loss and update (DAPO token-mean aggregation);
- TPRL: + the perturbed-image pass, perception and entropy masks (top 40 %) and TAS
  (configs/tprl.py);
- VGR: + attention statistics in the old-policy pass and VGR token weights on the loss mask
  (last 2 layers, configs/vgr.py).
`--attention` (comma-separated: auto, xla, flash, splash, cudnn) compiles each step once per
attention implementation of the model's forward passes (`Model.set_attention`), and
`--algorithms` picks the steps; ratios are against the table's first step. Peak memory is read
from the compiled step (`memory_analysis()`: arguments + outputs + temporaries - donated
aliases; deterministic), and its temporaries alone (activations, logits, gradients).

transformers: a no-grad forward over the same token ids and images with the default (sdpa)
attention, with eager attention, and with eager attention and `output_attentions=True` (what
TRL-based VGR/MDI implementations call to get the maps), same threads, logits kept for the
completion only (`logits_to_keep`, as TRL's log-prob pass). Time and the process's peak RSS
growth during the call (VmHWM after a reset through /proc/self/clear_refs; the script
re-executes itself with glibc's mmap threshold fixed, so freed tensors leave the RSS).

Times are the minimum over `--rounds` rounds, the variants interleaved within each round; the
process's CPU time (all threads) is printed beside the wall time, as it moves less when other
work shares the cores.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time

import numpy as np

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH))
sys.path.insert(0, BENCH)

import rl_step  # noqa: E402  (bench/rl_step.py: checkpoint, tokenizer, processor)

MMAP_ENV = "MALLOC_MMAP_THRESHOLD_"


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def peak_rss_growth(fn) -> tuple[object, float]:
    """(fn(), bytes the peak RSS rose above the RSS before the call)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
    except OSError:
        pass
    before = _status_kb("VmRSS")
    out = fn()
    return out, max(0, _status_kb("VmHWM") - before) * 1024.0


def fmt_mb(x: float) -> str:
    return f"{x / 2**20:.0f}"


# ----------------------------------------------------------------------------- batch
def make_batch(args, tok, rows, mcfg):
    """Host RolloutBatch: P prompts x G rows, random completions of N tokens, random rewards."""
    from jaxvrl.data import synthetic
    from jaxvrl.data.pipeline import EncodeOptions, collate, encode_rows
    from jaxvrl.trainer.rollout import assemble_prompts

    opts = EncodeOptions(system_prompt=synthetic.SYSTEM_PROMPT, **rl_step.pixel_limits(args))
    examples, _ = encode_rows(rows[: args.prompts], tok, opts, source="builtin:train")
    batch = collate(examples, args.group, mcfg, tok, with_pools=True)
    rng = np.random.default_rng(0)
    b, n = batch["input_ids"].shape[0], args.new_tokens
    special = set(tok.all_special_ids)
    ordinary = np.array([i for i in range(len(tok)) if i not in special])
    tokens = rng.choice(ordinary, size=(b, n)).astype(np.int32)
    mask = np.ones((b, n), np.float32)
    rewards = rng.standard_normal(b).astype(np.float32)
    return assemble_prompts(batch, tokens, mask, rewards, with_pools=True)


# ----------------------------------------------------------------------------- jaxvrl
def step_configs(group: int, names=("GRPO", "TPRL", "VGR")) -> dict:
    from configs import base as base_config
    from jaxvrl.config import set_values
    from jaxvrl.trainer.step import StepConfig

    grpo = {
        "rollout.num_generations": group,
        "actor.loss_agg_mode": "token-mean",
        "actor.clip_ratio_high": 0.28,
    }
    base = StepConfig.of(set_values(base_config.get_config(), grpo))
    configs = {
        "GRPO": base,
        "TPRL": base.with_values(
            {
                "tprl.enable_perception_filtering": True,
                "tprl.top_p_perception_tokens": 0.4,
                "tprl.enable_entropy_filtering": True,
                "tprl.top_p_entropy_tokens": 0.4,
                "tprl.enable_trajectory_reweighting": True,
            }
        ),
        "VGR": base.with_values(
            {"vgr.enable_token_weights": True, "vgr.token_weight_last_k_layers": 2}
        ),
    }
    unknown = set(names) - set(configs)
    if unknown:
        raise SystemExit(f"unknown algorithms {sorted(unknown)}; known: {', '.join(configs)}")
    return {name: configs[name] for name in names}


def run_jaxvrl(args, model, rb) -> dict:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from jaxvrl.trainer.step import TrainState, build_train_step

    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-5))
    batch = jax.tree.map(jnp.asarray, rb)
    key = jax.random.key(0)
    attentions = args.attention.split(",")
    algorithms = args.algorithms.split(",")

    def fresh_state(params):
        p = jax.tree.map(jnp.array, params)
        return TrainState(p, tx.init(p), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))

    res, steps, states = {}, {}, {}
    variants = [
        (attn, alg, cfg)
        for attn in attentions
        for alg, cfg in step_configs(args.group, algorithms).items()
    ]
    for attention, alg, cfg in variants:
        model.set_attention(attention)  # part of the graphdef
        graphdef, params = nnx.split(model, nnx.Param)
        name = alg if len(attentions) == 1 else f"{alg}, {attention}"
        state = fresh_state(params)
        t = time.perf_counter()
        fn = jax.jit(build_train_step(graphdef, tx, cfg), donate_argnums=(0,))
        compiled = fn.lower(state, None, batch, key).compile()
        m = compiled.memory_analysis()
        peak = (
            m.argument_size_in_bytes
            + m.output_size_in_bytes
            + m.temp_size_in_bytes
            - m.alias_size_in_bytes
        )
        res[name] = dict(
            compile_s=time.perf_counter() - t,
            temp=float(m.temp_size_in_bytes),
            peak=float(peak),
            times=[],
            cpu=[],
        )
        state, _, _ = compiled(state, None, batch, key)  # warm-up
        jax.block_until_ready(state)
        steps[name], states[name] = compiled, state
        print(
            f"  jaxvrl {name}: compiled in {res[name]['compile_s']:.1f} s, temporaries "
            f"{fmt_mb(res[name]['temp'])} MiB, peak {fmt_mb(peak)} MiB",
            flush=True,
        )
    for _ in range(args.rounds):
        for name, compiled in steps.items():
            t, c = time.perf_counter(), time.process_time()
            state, _, _ = jax.block_until_ready(compiled(states[name], None, batch, key))
            res[name]["times"].append(time.perf_counter() - t)
            res[name]["cpu"].append(time.process_time() - c)
            states[name] = state
    return res


# ----------------------------------------------------------------------------- transformers
def hf_inputs(args, tok, rb, rows):
    """transformers inputs for the same rows: token ids, mask, images through HF's processor."""
    import torch

    proc = rl_step.hf_processor(tok, args)
    images = [r["images"][0] for r in rows[: args.prompts] for _ in range(args.group)]
    pix = proc.image_processor(images, return_tensors="pt")
    ids = torch.tensor(np.asarray(rb.input_ids), dtype=torch.long)
    return dict(
        input_ids=ids,
        attention_mask=torch.tensor(np.asarray(rb.attention_mask), dtype=torch.long),
        mm_token_type_ids=(ids == proc.image_token_id).long(),
        pixel_values=pix["pixel_values"],
        image_grid_thw=pix["image_grid_thw"],
    )


def run_hf(args, ckpt, inputs) -> dict:
    import torch

    keep = args.new_tokens + 1  # the completion's logits, as TRL's log-prob pass keeps
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.set_num_threads(args.threads)
    models = {
        impl: Qwen2_5_VLForConditionalGeneration.from_pretrained(
            ckpt, dtype=torch.float32, attn_implementation=impl
        ).eval()
        for impl in ("sdpa", "eager")
    }
    variants = {
        "HF forward (sdpa)": (models["sdpa"], False),
        "HF forward (eager)": (models["eager"], False),
        "HF eager + output_attentions": (models["eager"], True),
    }
    res = {k: dict(times=[], cpu=[], rss=[]) for k in variants}
    with torch.inference_mode():
        for model, att in variants.values():
            model(**inputs, output_attentions=att, logits_to_keep=keep)  # warm-up
        for _ in range(args.rounds):
            for name, (model, att) in variants.items():
                t, c = time.perf_counter(), time.process_time()
                out, rss = peak_rss_growth(
                    lambda m=model, a=att: m(**inputs, output_attentions=a, logits_to_keep=keep)
                )
                res[name]["times"].append(time.perf_counter() - t)
                res[name]["cpu"].append(time.process_time() - c)
                res[name]["rss"].append(rss)
                if att:
                    n = len(out.attentions)
                    res[name]["maps"] = f"{n} x {tuple(out.attentions[0].shape)}"
                del out
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    rl_step.model_args(ap)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--only", choices=["jaxvrl", "hf"], default=None)
    ap.add_argument("--attention", default="auto", help="comma-separated: auto,xla,flash,...")
    ap.add_argument("--algorithms", default="GRPO,TPRL,VGR", help="comma-separated subset")
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="jaxvrl's compute dtype (parameters stay float32); cudnn needs bfloat16",
    )
    args = ap.parse_args(argv)
    if MMAP_ENV not in os.environ:  # freed large buffers go back to the OS: RSS peaks are real
        os.environ[MMAP_ENV] = str(128 * 1024)
        os.execv(sys.executable, [sys.executable, *sys.argv])
    args.iters = 0
    import jax
    import torch

    print(
        f"# tprl_overhead bench {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC | "
        f"{platform.machine()}, {os.cpu_count()} cores, {args.threads} threads | "
        f"jax {jax.__version__} | torch {torch.__version__} | load average "
        f"{os.getloadavg()[0]:.1f}\n# python {' '.join(sys.argv)}",
        flush=True,
    )
    import tempfile

    from jaxvrl.models.qwen2_5_vl import load

    tok, rows = rl_step.tokenizer_and_rows(args)
    with tempfile.TemporaryDirectory() as ckpt:
        n_params = rl_step.make_checkpoint(args, tok, ckpt)
        model = load(ckpt, dtype=jax.numpy.dtype(args.dtype), param_dtype=jax.numpy.float32)
        rb = make_batch(args, tok, rows, model.config)
        b, length = rb.input_ids.shape
        print(
            f"# model: {args.size} ({n_params / 1e6:.1f}M params), batch {b} rows x {length} "
            f"tokens ({args.new_tokens} completion), {args.image_size}px images, jaxvrl "
            f"{args.dtype} on {jax.devices()[0].platform}",
            flush=True,
        )
        jx = run_jaxvrl(args, model, rb) if args.only in (None, "jaxvrl") else {}
        del model
        hf = run_hf(args, ckpt, hf_inputs(args, tok, rb, rows)) if args.only != "jaxvrl" else {}
    report(jx, hf)


def report(jx: dict, hf: dict) -> None:
    if jx:
        first = next(iter(jx))
        g = jx[first]
        t0, c0, p0 = min(g["times"]), min(g["cpu"]), g["peak"]
        vs = f"vs {first}"
        print(f"\n| jaxvrl step | s | time {vs} | CPU s | CPU {vs} | compiled peak MiB | "
              f"{vs} | temporaries MiB | {vs} |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|")
        for name, r in jx.items():
            t, c = min(r["times"]), min(r["cpu"])
            print(
                f"| {name} | {t:.2f} | {t / t0:.2f}x | {c:.2f} | {c / c0:.2f}x | "
                f"{fmt_mb(r['peak'])} | {r['peak'] / p0:.2f}x | {fmt_mb(r['temp'])} | "
                f"{r['temp'] / g['temp']:.2f}x |"
            )
    if hf:
        base = hf["HF forward (sdpa)"]
        t0, c0, m0 = min(base["times"]), min(base["cpu"]), max(base["rss"])
        print("\n| transformers forward | s | time vs sdpa | CPU s | CPU vs sdpa | "
              "peak RSS growth MiB | vs sdpa |")  # fmt: skip
        print("|---|---|---|---|---|---|---|")
        for name, r in hf.items():
            t, c, rss = min(r["times"]), min(r["cpu"]), max(r["rss"])
            print(
                f"| {name} | {t:.2f} | {t / t0:.2f}x | {c:.2f} | {c / c0:.2f}x | {fmt_mb(rss)} | "
                f"{rss / max(m0, 1):.2f}x |"
            )
        maps = hf["HF eager + output_attentions"].get("maps")
        if maps:
            print(f"\noutput_attentions returns {maps} float32 maps per forward")


if __name__ == "__main__":
    main()
