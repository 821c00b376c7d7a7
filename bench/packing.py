"""Padding-free train step against the padded one, on the same rows: completions of log-normal
lengths (median a quarter of max_new_tokens, the tail cut at the maximum, as truncated rows
are), so most of a padded [rows, prompt + max_new_tokens] batch is padding.

    python bench/packing.py                          # small model, 4 prompts x G=8, 256 tokens
    python bench/packing.py --algorithm GRPO --new-tokens 512 --rounds 3
    python bench/packing.py --dtype bfloat16         # on a GPU (JAX_PLATFORMS=cuda)

The model is the small random-init Qwen2.5-VL of bench/sampler.py (hidden 256, 4 layers,
Qwen's vocabulary), the prompts the built-in task's with their images (bench/rl_step.py), the
completions random tokens. Both steps are jaxvrl's fused train step with the same settings
(`--algorithm`: TPRL, configs/tprl.py's shaping with 2 updates; or GRPO, one update) and
micro-batches: "padded" runs the batch as the rollout assembles it (actor.padding_free off,
the completion axis at max_new_tokens), "packed" the batch `trainer.packing.fit_batch` fits
(the completion axis cut to its bucket, rows packed, the head on real completion tokens).
Times are the minimum over `--rounds` rounds, the two steps interleaved in each, after a
warm-up call; compile times apart.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
import time

import numpy as np

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH))
sys.path.insert(0, BENCH)

import rl_step  # noqa: E402  (bench/rl_step.py: tokenizer, rows, checkpoint)
import tprl_overhead  # noqa: E402  (bench/tprl_overhead.py: the batch of the built-in task)


def lognormal_lengths(rows: int, n: int, median: float, sigma: float, seed: int = 0):
    """int[rows] within 1 .. n."""
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(median), sigma, rows)), 1, n).astype(int)


def with_lengths(rb, lengths):
    """The batch with completion i cut to lengths[i] tokens (mask and attention mask)."""
    n = rb.completion_length
    comp = (np.arange(n)[None] < lengths[:, None]).astype(np.float32)
    mask = np.array(rb.attention_mask)
    mask[:, -n:] = comp
    return rb.replace(completion_mask=comp, attention_mask=mask)


def step_config(args):
    from configs import base as base_config
    from jaxvrl.config import set_values
    from jaxvrl.trainer.step import StepConfig

    values = {
        "rollout.num_generations": args.group,
        "rollout.max_new_tokens": args.new_tokens,
        "prompts_per_step": args.prompts,
        "actor.loss_agg_mode": "token-mean",
        "optim.micro_batches": args.micro_batches,
    }
    if args.algorithm == "TPRL":
        values.update(
            {
                "tprl.enable_perception_filtering": True,
                "tprl.enable_entropy_filtering": True,
                "tprl.enable_trajectory_reweighting": True,
                "actor.ppo_epochs": 2,
                "actor.shaping_source": "recompute",  # the same passes on both sides
            }
        )
    return StepConfig.of(set_values(base_config.get_config(), values))


def run(args, model, batches: dict) -> dict:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from jaxvrl.trainer.step import TrainState, build_train_step

    graphdef, params = nnx.split(model, nnx.Param)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-5))
    key = jax.random.key(0)
    res, compiled, states = {}, {}, {}
    for name, (cfg, rb) in batches.items():
        p = jax.tree.map(jnp.array, params)
        state = TrainState(p, tx.init(p), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))
        batch = jax.tree.map(jnp.asarray, rb)
        t = time.perf_counter()
        fn = jax.jit(build_train_step(graphdef, tx, cfg), donate_argnums=(0,))
        c = fn.lower(state, None, batch, key).compile()
        res[name] = {"compile_s": time.perf_counter() - t, "times": []}
        state, _, _ = jax.block_until_ready(c(state, None, batch, key))  # warm-up
        compiled[name], states[name] = (c, batch), state
        print(f"  {name}: compiled in {res[name]['compile_s']:.1f} s", flush=True)
    for _ in range(args.rounds):
        for name, (c, batch) in compiled.items():
            t = time.perf_counter()
            states[name], m, _ = jax.block_until_ready(c(states[name], None, batch, key))
            res[name]["times"].append(time.perf_counter() - t)
            res[name]["loss"] = float(m["loss"])
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--median", type=float, default=None, help="default new-tokens / 4")
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--algorithm", default="TPRL", choices=["TPRL", "GRPO"])
    ap.add_argument("--rounds", type=int, default=3)
    rl_step.model_args(ap)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args(argv)
    args.iters, args.threads = 0, os.cpu_count()
    import jax

    from jaxvrl.models.qwen2_5_vl import load
    from jaxvrl.trainer import packing

    print(
        f"# packing bench {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC | "
        f"{platform.machine()}, {os.cpu_count()} cores | jax {jax.__version__} | "
        f"{jax.devices()[0].device_kind} | load average {os.getloadavg()[0]:.1f}\n"
        f"# python {' '.join(sys.argv)}",
        flush=True,
    )
    tok, rows = rl_step.tokenizer_and_rows(args)
    with tempfile.TemporaryDirectory() as ckpt:
        n_params = rl_step.make_checkpoint(args, tok, ckpt)
        model = load(ckpt, dtype=jax.numpy.dtype(args.dtype), param_dtype=jax.numpy.float32)
        rb = tprl_overhead.make_batch(args, tok, rows, model.config)
    b, length = rb.input_ids.shape
    median = args.median or args.new_tokens / 4
    lengths = lognormal_lengths(b, args.new_tokens, median, args.sigma)
    rb = with_lengths(rb, lengths)
    rb = rb.replace(old_logprobs=np.full(rb.completion_mask.shape, -2.0, np.float32))
    cfg = step_config(args)
    padded_cfg = cfg.with_values({"actor.padding_free": False})
    packed = packing.fit_batch(rb, jax.random.key(0), cfg)
    real = int(rb.attention_mask.sum())
    print(
        f"# model {args.size} ({n_params / 1e6:.1f}M params, {args.dtype}), {args.algorithm}, "
        f"{b} rows x {length} tokens ({args.new_tokens} completion), {args.micro_batches} "
        f"micro-batches; completions median {int(np.median(lengths))}, mean "
        f"{lengths.mean():.0f}, max {lengths.max()} (sigma {args.sigma}); real tokens "
        f"{real:,} of {b * length:,} ({real / (b * length):.0%})\n# packed: "
        f"{packed.completion_length} completion columns, {packed.pack_buffers} buffer(s) of "
        f"{packed.pack_length} per micro-batch, head on {packed.pack_completions} slots",
        flush=True,
    )
    res = run(args, model, {"padded": (padded_cfg, rb), "packed": (cfg, packed)})
    base = min(res["padded"]["times"])
    print("\n| step | compile s | step s (min) | vs padded | loss |\n|---|---|---|---|---|")
    for name, r in res.items():
        t = min(r["times"])
        print(f"| {name} | {r['compile_s']:.1f} | {t:.3f} | {t / base:.2f}x | {r['loss']:.4f} |")


if __name__ == "__main__":
    main()
