"""Rollout engines on a long-tailed length mix: the static sampler (every row decoded until the
longest ends) against slots that refill (`rollout.slots`, `jaxvrl/sampling/engine.py`).

Each of R prompts is sampled G times; row w is forced to stop after L_w tokens (the samplers'
per-row `limits`, no EOS), L_w drawn from a log-normal (median --median, log-sd --sigma)
and capped at max_new_tokens: a few rows are many times longer than most, as completion
lengths in reasoning RL are. Both engines sample the same completions (checked); the figures:

- slot-steps: decode rows x decode steps the engine ran (the static engine runs every row
  until the longest ends; the slot engine runs its slots until the queue is empty);
- slot utilization: generated tokens / slot-steps (`rollout/slot_utilization`);
- wall time of the call (after a warm-up compile), and tokens per second.

    python bench/rollout.py                        # the embedded tiny model, 32 prompts x 8
    python bench/rollout.py --slots 16,32,64 --new-tokens 512
    python bench/rollout.py --model /path/to/hf/checkpoint --dtype bfloat16   # e.g. on a GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF checkpoint (default: the embedded tiny)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--median", type=float, default=24.0)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--slots", default="16,32")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxvrl import train
    from jaxvrl.models import qwen2_5_vl as q
    from jaxvrl.sampling import Sampler
    from jaxvrl.sampling.sampler import generation_config

    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    model = q.load(args.model or train.EMBEDDED, dtype=dtype)
    cfg_m = model.config
    rng = np.random.default_rng(args.seed)
    r, g, p, n = args.prompts, args.samples, args.prompt_len, args.new_tokens

    # left-padded text prompts of random ordinary tokens (ids below the special ones)
    hi = min(cfg_m.image_token_id, cfg_m.vision_start_token_id, cfg_m.text.vocab_size)
    lens = rng.integers(p // 2, p + 1, size=r)
    ids = np.zeros((r, p), np.int32)
    mask = np.zeros((r, p), np.int32)
    for i, k in enumerate(lens):
        ids[i, p - k :] = rng.integers(1, hi, size=k)
        mask[i, p - k :] = 1
    pos, deltas = q.get_rope_index(ids, mask, cfg_m)
    limits = np.exp(np.log(args.median) + args.sigma * rng.standard_normal(r * g))
    limits = np.clip(np.round(limits), 1, n).astype(np.int32)
    batch = [jnp.asarray(x) for x in (ids, mask, np.asarray(pos, np.int32), deltas)]

    graphdef, params = nnx.split(model)
    base = generation_config(cfg_m, max_new_tokens=n, temperature=1.0, eos_token_ids=())

    def run(slots: int):
        cfg = dataclasses.replace(base, slots=slots, page_size=args.page_size)
        sampler = Sampler(graphdef, cfg)
        call = lambda: sampler(  # noqa: E731
            params, *batch, jax.random.key(1), num_samples=g, limits=jnp.asarray(limits)
        )
        jax.block_until_ready(call())  # compile
        t0 = time.perf_counter()
        out = jax.tree.map(np.asarray, call())
        return out, time.perf_counter() - t0

    tokens = int(limits.sum())
    print(
        f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {platform.processor() or platform.machine()}, "
        f"jax {jax.__version__} on {jax.devices()[0].platform}; {args.model or 'embedded tiny model'} "
        f"{args.dtype}; {r} prompts x {g} samples = {r * g} rows, prompts of {p} tokens, "
        f"max_new_tokens {n}; lengths log-normal (median {args.median:g}, sigma {args.sigma:g}): "
        f"mean {limits.mean():.1f}, max {limits.max()}, {tokens} tokens; page size {args.page_size}"
    )
    print(
        "| engine | decode rows | decode steps | slot-steps | vs static | slot utilization | wall s | tokens/s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    static, secs = run(0)
    assert (static.mask.sum(1) == limits).all()
    ref = int(static.steps) * r * g

    def row(name, rows, out, secs):
        steps = int(out.steps)
        work = steps * rows
        print(
            f"| {name} | {rows} | {steps} | {work} | {work / ref:.2f}x | {tokens / work:.3f} | "
            f"{secs:.2f} | {tokens / secs:,.0f} |"
        )

    row("static", r * g, static, secs)
    for slots in (int(x) for x in args.slots.split(",")):
        out, secs = run(slots)
        np.testing.assert_array_equal(out.tokens, static.tokens)  # the same completions
        np.testing.assert_allclose(out.logprobs, static.logprobs, atol=1e-4)
        row(f"slots={slots}", min(slots, r * g), out, secs)


if __name__ == "__main__":
    main()
