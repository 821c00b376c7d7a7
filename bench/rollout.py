"""Rollout engines on a long-tailed length mix: the static sampler (every row decoded until the
longest ends) against slots that refill (`rollout.slots`, `jaxvrl/sampling/engine.py`).

Each of R prompts is sampled G times; row w is forced to stop after L_w tokens (the samplers'
per-row `limits`, no EOS), L_w drawn from a log-normal (median --median, log-sd --sigma)
and capped at max_new_tokens: a few rows are many times longer than most, as completion
lengths in reasoning RL are. Both engines sample the same completions (checked); the figures:

- slot-steps: decode rows x decode steps the engine ran (the static engine runs every row
  until the longest ends; the slot engine runs its slots until the queue is empty, with
  --narrow halving them each time no row waits and half or fewer run: `rollout.narrow`);
- slot utilization: generated tokens / slot-steps (`rollout/slot_utilization`);
- wall time of the call (after a warm-up compile), and tokens per second.

    python bench/rollout.py                        # the embedded tiny model, 32 prompts x 8
    python bench/rollout.py --slots 16,32,64 --new-tokens 512
    python bench/rollout.py --model /path/to/hf/checkpoint --dtype bfloat16   # e.g. on a GPU

On a GPU, the paged kernel (`--decode-attention gpu`: the slots engine reads its pages in
place; the static sampler is XLA's dense form) on a random Qwen2.5-0.5B-sized model, 64 and
256 rows, each with a slot per row:

    JAX_PLATFORMS=cuda python bench/rollout.py --size medium --dtype bfloat16 \
        --decode-attention gpu --prompts 8 --samples 8 --slots 64 --new-tokens 512
    JAX_PLATFORMS=cuda python bench/rollout.py --size medium --dtype bfloat16 \
        --decode-attention gpu --prompts 32 --samples 8 --slots 256 --new-tokens 512

With --partial STEPS: STEPS rollouts of --prompts groups each, with slots alone (every row of
a step to its end) against partial rollouts (`rollout.partial`: --oversample x the prompts
started, the step stops once its groups are whole, the rest carried; one row per
--max-staleness value), rows forced to the same log-normal lengths; the figure is the decode
work (slot-steps) per trained group, the rows still in flight at the end counted as spent.

    python bench/rollout.py --partial 12 --slots 16 --max-staleness 1,4
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
    ap.add_argument("--size", default=None, choices=("small", "medium"),
                    help="a random model of bench/sampler.py's sizes (needs torch)")  # fmt: skip
    ap.add_argument("--decode-attention", default="auto", choices=("auto", "dense", "tpu", "gpu"))
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--median", type=float, default=24.0)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--slots", default="16,32")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--narrow", default="0,3", help="rollout.narrow values (slot halvings)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--partial", type=int, default=0, help="steps of the partial-rollout mix")
    ap.add_argument("--oversample", type=float, default=2.0)
    ap.add_argument("--max-staleness", default="1,4")
    args = ap.parse_args()
    if args.partial:
        return partial_mix(args)

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxvrl.models import qwen2_5_vl as q
    from jaxvrl.sampling import Sampler
    from jaxvrl.sampling.sampler import generation_config
    from jaxvrl.sampling.steps import widths

    model = load_model(args)
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
    base = dataclasses.replace(base, decode_attention=args.decode_attention)

    def run(slots: int, narrow: int = 0):
        cfg = dataclasses.replace(base, slots=slots, page_size=args.page_size, narrow=narrow)
        sampler = Sampler(graphdef, cfg)
        call = lambda: sampler.timed(  # noqa: E731
            params, *batch, jax.random.key(1), num_samples=g, limits=jnp.asarray(limits)
        )
        jax.block_until_ready(call())  # compile
        t0 = time.perf_counter()
        out, times = call()
        out = jax.tree.map(np.asarray, out)
        return out, time.perf_counter() - t0, times.get("decode_work")

    tokens = int(limits.sum())
    print(
        f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {platform.processor() or platform.machine()}, "
        f"jax {jax.__version__} on {jax.devices()[0].platform}; {model_name(args)} "
        f"{args.dtype}, decode attention {args.decode_attention}; {r} prompts x {g} samples = {r * g} rows, prompts of {p} tokens, "
        f"max_new_tokens {n}; lengths log-normal (median {args.median:g}, sigma {args.sigma:g}): "
        f"mean {limits.mean():.1f}, max {limits.max()}, {tokens} tokens; page size {args.page_size}"
    )
    print(
        "| engine | decode rows | decode steps | slot-steps | vs static | slot utilization | wall s | tokens/s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    static, secs, _ = run(0)
    assert (static.mask.sum(1) == limits).all()
    ref = int(static.steps) * r * g

    def row(name, rows, out, secs, work=None):  # rows: the decode rows (or their widths)
        steps = int(out.steps)
        work = int(work or steps * int(rows))
        print(
            f"| {name} | {rows} | {steps} | {work} | {work / ref:.2f}x | {tokens / work:.3f} | "
            f"{secs:.2f} | {tokens / secs:,.0f} |"
        )

    def ladder(rows: int, narrow: int) -> str:  # the row counts the loop ran at
        return "/".join(map(str, widths(rows, 1, dataclasses.replace(base, narrow=narrow))))

    row("static", r * g, static, secs)
    for narrow in (int(x) for x in args.narrow.split(",") if int(x)):  # static, narrowing
        out, secs, work = run(0, narrow)
        same_completions(out, static, args.dtype)
        row(f"static, narrow={narrow}", ladder(r * g, narrow), out, secs, work)
    for slots in (int(x) for x in args.slots.split(",")):
        for narrow in (int(x) for x in args.narrow.split(",")):
            out, secs, work = run(slots, narrow)
            same_completions(out, static, args.dtype)
            name = f"slots={slots}" + (f", narrow={narrow}" if narrow else "")
            row(name, ladder(min(slots, r * g), narrow), out, secs, work)


def same_completions(out, ref, dtype: str = "float32", tie_rows: float = 0.01) -> None:
    """`out` sampled what `ref` sampled: the same tokens, log-probs within float32 rounding
    (bfloat16: within 4 of its epsilons of each log-prob, as the engines may round the
    bfloat16 logits differently).

    The engines run the same arithmetic in differently shaped programs (slots vs rows), so
    XLA may round a sum differently in the last bit; where a row's uniform number falls that
    close to a boundary of the inverse CDF, the two draw adjacent ids from there on. Such rows
    (at most one, or `tie_rows` of them) must agree up to where they part, and are counted."""
    parted = np.flatnonzero((out.tokens != ref.tokens).any(axis=1))
    first = np.argmax(out.tokens != ref.tokens, axis=1)
    upto = np.where(np.isin(np.arange(len(first)), parted), first, out.tokens.shape[1])
    before = np.arange(out.tokens.shape[1])[None, :] < upto[:, None]
    rtol = 0.0 if dtype == "float32" else 4 * 2.0**-7  # bfloat16 epsilon: 2^-7
    np.testing.assert_allclose(out.logprobs * before, ref.logprobs * before, rtol=rtol, atol=1e-4)
    if parted.size:
        print(f"# rows that parted at an inverse-CDF near-tie: {parted.size} ({parted.tolist()})")
    if dtype != "float32":  # a random model's near-flat bfloat16 logits part most rows
        return
    assert parted.size <= max(1, tie_rows * len(first)), (
        f"{parted.size} rows differ: {parted.tolist()}"
    )


def model_name(args) -> str:
    return args.model or (f"random {args.size} model" if args.size else "embedded tiny model")


def load_model(args):
    """The benchmarked model: --model, a random one of bench/sampler.py's --size (built by
    transformers and loaded through jaxvrl's loader), else the embedded tiny model."""
    import jax.numpy as jnp

    from jaxvrl import train
    from jaxvrl.models import qwen2_5_vl as q

    if args.size:
        from bench.sampler import SIZES, random_model

        return random_model(SIZES[args.size], args.dtype, seed=args.seed)[1]
    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    return q.load(args.model or train.EMBEDDED, dtype=dtype)


def partial_mix(args) -> None:
    """Slot-steps per trained group over `args.partial` steps: slots alone vs partial rollouts."""
    import functools
    import types

    import jax
    from flax import nnx

    from jaxvrl.data.pipeline import collate
    from jaxvrl.sampling import Sampler
    from jaxvrl.sampling.sampler import generation_config
    from jaxvrl.trainer.partial import PartialRollouts
    from jaxvrl.trainer.rollout import sample_completions

    model = load_model(args)
    cfg_m = model.config
    r, g, p, n, slots = (
        args.prompts,
        args.samples,
        args.prompt_len,
        args.new_tokens,
        int(args.slots.split(",")[0]),
    )
    hi = min(cfg_m.image_token_id, cfg_m.vision_start_token_id, cfg_m.text.vocab_size)

    def stream(seed):  # one-example lists: a text prompt and its rows' forced lengths
        rng = np.random.default_rng(seed)
        while True:
            lengths = np.exp(np.log(args.median) + args.sigma * rng.standard_normal(g))
            yield [dict(prompt_ids=rng.integers(1, hi, size=rng.integers(p // 2, p + 1)).tolist(),
                        image_grid_thw=np.zeros((0, 3), int), pixel_values=np.zeros((0, 1)),
                        lengths=np.clip(np.round(lengths), 1, n).astype(np.int32))]  # fmt: skip

    graphdef, params = nnx.split(model)
    cfg = generation_config(cfg_m, max_new_tokens=n, temperature=1.0, eos_token_ids=())
    cfg = dataclasses.replace(cfg, slots=slots, page_size=args.page_size)
    tokenizer = types.SimpleNamespace(pad_token_id=0)
    phase = types.SimpleNamespace(
        collate=functools.partial(
            collate, model_config=cfg_m, tokenizer=tokenizer, with_pools=False
        ),  # fmt: skip
        sampler=Sampler(graphdef, cfg),
        mesh=None,
        decode=None,
        make_groups=lambda params, examples, *_: [types.SimpleNamespace() for _ in examples],
    )
    print(
        f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, "
        f"{platform.processor() or platform.machine()}, jax {jax.__version__} on "
        f"{jax.devices()[0].platform}; {model_name(args)} {args.dtype}; "
        f"{args.partial} steps of {r} groups x {g} rows, prompts of {p // 2}-{p} tokens, "
        f"max_new_tokens {n}, lengths log-normal (median {args.median:g}, sigma {args.sigma:g}); "
        f"{slots} slots, page size {args.page_size}"
    )
    print("| mode | groups trained | slot-steps | per group | vs slots alone | tokens/slot-step "
          "| rows carried at the end | rows dropped stale | wall s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")

    def sync():  # slots alone: every step's rows to their end
        examples, work, tokens, t0 = stream(args.seed), 0, 0.0, time.perf_counter()
        for step in range(args.partial):
            exs = [next(examples)[0] for _ in range(r)]
            limits = np.concatenate([ex["lengths"] for ex in exs])
            out = sample_completions(
                phase.sampler, params, phase.collate(exs, 1), jax.random.key(step),
                num_samples=g, limits=limits,
            )  # fmt: skip
            work += int(out.steps) * min(slots, r * g)
            tokens += float(out.mask.sum())
        return r * args.partial, work, tokens, 0, 0, time.perf_counter() - t0

    def partial(staleness):
        pr = PartialRollouts(r, g, n, oversample=args.oversample, max_staleness=staleness,
                             row_limit=lambda ex, j: ex["lengths"][j])  # fmt: skip
        examples = stream(args.seed)

        def lists():  # the data loader's lists of `r` examples
            while True:
                yield [next(examples)[0] for _ in range(r)]

        it, trained, work, tokens, dropped = lists(), 0, 0.0, 0.0, 0
        t0 = time.perf_counter()
        for step in range(args.partial):
            groups, info = pr.generate(phase, params, it, jax.random.key(step), step)
            trained, work, tokens = (
                trained + len(groups),
                work + info["decode_work"],
                tokens + info["tokens"],
            )
            dropped += pr.take_metrics(groups, step)["rollout/dropped_stale_rows"]
        carried = sum(int((f.length > 0).sum()) for f in pr.flights)
        return trained, work, tokens, carried, dropped, time.perf_counter() - t0

    sync()  # compile
    base = None
    for name, fn in [("slots alone", sync)] + [
        (
            f"partial, oversample {args.oversample:g}, max_staleness {s}",
            functools.partial(partial, int(s)),
        )
        for s in args.max_staleness.split(",")
    ]:
        trained, work, tokens, carried, dropped, secs = fn()
        per = work / trained
        base = base or per
        print(f"| {name} | {trained} | {work:,.0f} | {per:.1f} | {per / base:.2f}x | "
              f"{tokens / work:.3f} | {carried} | {dropped:.0f} | {secs:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
