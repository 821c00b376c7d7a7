"""One full RL iteration, jaxvrl vs TRL's GRPOTrainer, on the same model, data and settings.

An iteration: sample G completions for each of P prompts (temperature 1), decode and score them
(mc_idx x 4 + think_format x 1, the built-in task's rewards), compute the old-policy and
reference log-probs, and take U AdamW steps (`--updates`, default 1) on the GRPO loss with a
low-variance KL term (beta 0.04), each on a mini-batch of P x G / U rows: jaxvrl's
actor.global_batch_size = P / U, TRL's steps_per_generation = U with per_device_train_batch_size
= P x G / U (one generation feeds U optimizer steps; TRL then recomputes the old log-probs with
a forward pass). jaxvrl's old log-probs are the sampler's unless `--old-logprobs recompute`. The model is the small random-init Qwen2.5-VL of bench/sampler.py (hidden 256,
4 layers, vision depth 4, Qwen's vocabulary) made in transformers, saved, and loaded by both;
the data is the built-in task (jaxvrl.data.synthetic) rendered with the shipped tokenizer and
its chat template; images go through each system's own Qwen2.5-VL image processor with the
same pixel limits. Both run on the CPU with the same number of threads: XLA's CPU runtime uses
one per core, and torch gets as many (--threads changes torch's only).

    python bench/rl_step.py                       # P=2 prompts x G=8, 64 new tokens, 3 iterations
    python bench/rl_step.py --prompts 4 --group 8 --new-tokens 128 --iters 4
    python bench/rl_step.py --only jaxvrl         # or trl

Timing: seconds per iteration, the median over iterations after the first (the first one
compiles in jaxvrl and warms up caches in torch); the first is printed separately. The
process's CPU time per iteration (all threads) is printed too: it moves less than the wall time
when other work shares the cores. With a
random-init model over a 152k vocabulary the end-of-sequence token is practically never drawn,
so both sides generate all N tokens (the mean completion length is printed to show it).

What each side computes: with one update both take the old log-probs from the loss pass
(detached current log-probs, no old-policy pass); with several, TRL runs an old-policy forward
pass over the generation batch and jaxvrl reads the sampler's log-probs (or recomputes them
with `--old-logprobs recompute`: the pass the sampler's log-probs save).

    python bench/rl_step.py --prompts 4 --updates 4 --iters 4   # 4 updates per rollout batch
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH))
sys.path.insert(0, BENCH)

import sampler as sampler_bench  # noqa: E402  (bench/sampler.py: sizes and HF config)

KL_COEF = 0.04
REWARD_WEIGHTS = {"mc_idx": 4.0, "think_format": 1.0}


def set_threads(n: int) -> None:
    """torch's intra-op threads; XLA's CPU runtime runs one thread per core (no flag sets it),
    so the default n = the core count makes the two equal."""
    import torch

    torch.set_num_threads(n)


def tokenizer_and_rows(args):
    from transformers import AutoTokenizer

    from jaxvrl.data import synthetic
    from jaxvrl.data.prompts import default_tokenizer_path

    tok = AutoTokenizer.from_pretrained(default_tokenizer_path())
    n = args.prompts * (args.iters + 1)
    rows = synthetic.make_split("train", n, seed=0, image_size=args.image_size)
    return tok, rows


def make_checkpoint(args, tok, path: str):
    """The small config with the shipped tokenizer's special ids, random init, saved to path."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from jaxvrl.data.prompts import special_token_ids

    size = sampler_bench.SIZES[args.size]
    if args.vocab:
        size = dataclasses.replace(size, vocab=args.vocab)
    cfg = sampler_bench.hf_config(size)
    sp = special_token_ids(tok)
    for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        setattr(cfg, k, sp[k])
    cfg.text_config.eos_token_id = sp["eos_token_id"]
    cfg.text_config.pad_token_id = sp["pad_token_id"]
    torch.manual_seed(0)
    hf = Qwen2_5_VLForConditionalGeneration(cfg).eval()
    hf.generation_config.eos_token_id = sp["eos_token_id"]
    hf.generation_config.pad_token_id = sp["pad_token_id"]
    hf.save_pretrained(path)
    tok.save_pretrained(path)
    return sum(p.numel() for p in hf.parameters())


def score(texts, labels):
    """Total reward per completion: the built-in task's reward functions and weights."""
    from jaxvrl.rl.rewards import mc_idx_reward, think_format_reward

    mc = np.asarray(mc_idx_reward(texts, labels), np.float64)
    fmt = np.asarray(think_format_reward(texts), np.float64)
    return REWARD_WEIGHTS["mc_idx"] * mc + REWARD_WEIGHTS["think_format"] * fmt


# ----------------------------------------------------------------------------- jaxvrl
def run_jaxvrl(args, ckpt: str, tok, rows) -> dict:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from configs import base as base_config
    from jaxvrl.config import set_values
    from jaxvrl.data import synthetic
    from jaxvrl.data.pipeline import EncodeOptions, collate, encode_rows
    from jaxvrl.data.prompts import special_token_ids
    from jaxvrl.models.qwen2_5_vl import load
    from jaxvrl.sampling import Sampler, SamplingConfig
    from jaxvrl.trainer.rollout import assemble_prompts
    from jaxvrl.trainer.step import StepConfig, TrainState, make_train_step

    model = load(ckpt)
    mcfg = model.config
    opts = EncodeOptions(system_prompt=synthetic.SYSTEM_PROMPT, **pixel_limits(args))
    examples, _ = encode_rows(rows, tok, opts, source="builtin:train")
    sp = special_token_ids(tok)
    scfg = SamplingConfig(
        args.new_tokens,
        temperature=1.0,
        eos_token_ids=(sp["eos_token_id"],),
        pad_token_id=sp["pad_token_id"],
        suppress_token_ids=(
            mcfg.image_token_id,
            mcfg.video_token_id,
            mcfg.vision_start_token_id,
            mcfg.vision_end_token_id,
        ),
    )
    sampler = Sampler(nnx.graphdef(model), scfg)
    kept = {}  # the decode weights, packed into the same buffer every iteration
    if args.prompts % args.updates:
        raise SystemExit(f"--updates {args.updates} must divide --prompts {args.prompts}")
    settings = {
        "rollout.num_generations": args.group,
        "prompts_per_step": args.prompts,
        "actor.global_batch_size": args.prompts // args.updates,  # --updates mini-batches
        "actor.old_logprobs": args.old_logprobs,
        "actor.loss_agg_mode": "seq-mean-token-mean",
        "actor.use_kl_loss": True,
        "actor.kl_loss_coef": KL_COEF,
        "actor.kl_loss_type": "low_var_kl",
    }
    step_cfg = StepConfig.of(set_values(base_config.get_config(), settings))
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(args.lr, weight_decay=0.0))
    graphdef, params = nnx.split(model, nnx.Param)
    ref_params = jax.tree.map(jnp.array, params)
    state = TrainState(params, tx.init(params), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))
    train_step = make_train_step(graphdef, tx, step_cfg)
    rng = jax.random.key(0)

    def iteration(i, state, rng):
        chunk = examples[i * args.prompts : (i + 1) * args.prompts]
        batch = collate(chunk, args.group, mcfg, tok, with_pools=False)
        rng, k_sample, k_step = jax.random.split(rng, 3)
        t0 = time.perf_counter()
        rows = batch["input_ids"].shape[0]
        kept["w"] = sampler.decode_weights(state.params, rows, reuse=kept.pop("w", None))
        out = sampler(
            state.params,
            jnp.asarray(batch["input_ids"]),
            jnp.asarray(batch["attention_mask"]),
            jnp.asarray(batch["position_ids"]),
            jnp.asarray(batch["deltas"]),
            k_sample,
            images=jax.tree.map(jnp.asarray, batch["images"]),
            decode_weights=kept["w"],
        )
        tokens, mask = np.asarray(out.tokens), np.asarray(out.mask)
        t1 = time.perf_counter()
        texts = [
            tok.decode(r[: int(m.sum())].tolist(), skip_special_tokens=True)
            for r, m in zip(tokens, mask)
        ]
        rewards = score(texts, [r["label_idx"] for r in batch["rows"]])
        rb = assemble_prompts(batch, tokens, mask, rewards, old_logprobs=out.logprobs)
        t2 = time.perf_counter()
        state, metrics, _ = train_step(state, ref_params, jax.tree.map(jnp.asarray, rb), k_step)
        jax.block_until_ready(state.params)
        parts = dict(sample=t1 - t0, score=t2 - t1, step=time.perf_counter() - t2)
        return state, rng, float(mask.sum(1).mean()), parts

    times, cpu, lengths = [], [], []
    for i in range(args.iters):
        t, c = time.perf_counter(), time.process_time()
        state, rng, length, parts = iteration(i, state, rng)
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
        lengths.append(length)
        split = ", ".join(f"{k} {v:.2f} s" for k, v in parts.items())
        print(f"  jaxvrl iteration {i}: {times[-1]:.2f} s ({split}), mean completion {length:.1f}")
    return dict(times=times, cpu=cpu, length=float(np.mean(lengths)))


def model_args(ap) -> None:
    """The random model's and the built-in task's flags, shared by the benches that build them
    (`make_checkpoint`, `tokenizer_and_rows`)."""
    ap.add_argument("--size", default="small", choices=sorted(sampler_bench.SIZES))
    ap.add_argument("--vocab", type=int, default=None, help="override the vocabulary size")
    ap.add_argument("--image-size", type=int, default=56, help="built-in task image side (px)")
    ap.add_argument("--min-pixels", type=int, default=56 * 56)
    ap.add_argument("--max-pixels", type=int, default=28 * 28 * 256)


def pixel_limits(args) -> dict:
    return dict(min_pixels=args.min_pixels, max_pixels=args.max_pixels)


# ----------------------------------------------------------------------------- TRL
def hf_processor(tok, args):
    """transformers' Qwen2.5-VL processor for images and text (no video processor: it needs
    torchvision, which is not installed beside the pinned CPU torch)."""
    from transformers import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    class ImageTextProcessor(Qwen2_5_VLProcessor):
        def __init__(self, tokenizer):  # ProcessorMixin.__init__ insists on a video processor
            self.image_processor = Qwen2VLImageProcessorPil(**pixel_limits(args))
            self.video_processor = None
            self.tokenizer = tokenizer
            self.chat_template = tokenizer.chat_template
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)

    return ImageTextProcessor(tok)


def run_trl(args, ckpt: str, tok, rows) -> dict:
    import torch
    from datasets import Dataset
    from transformers import Qwen2_5_VLForConditionalGeneration, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from jaxvrl.data import synthetic
    from jaxvrl.rl.rewards import mc_idx_reward, think_format_reward

    def text_of(completions):
        return [c[0]["content"] if isinstance(c, list) else c for c in completions]

    def mc_idx(completions, label_idx, **_):
        return mc_idx_reward(text_of(completions), label_idx)

    def think_format(completions, **_):
        return think_format_reward(text_of(completions))

    n = args.prompts * args.iters
    data = Dataset.from_list(
        [
            {
                "prompt": [
                    {"role": "system", "content": synthetic.SYSTEM_PROMPT},
                    {"role": "user", "content": r["problem"]},
                ],
                "image": r["images"][0],
                "label_idx": r["label_idx"],
            }
            for r in rows[:n]
        ]
    )
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32)
    out_dir = tempfile.mkdtemp(prefix="trl_bench_")
    u = args.updates
    config = GRPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=args.prompts * args.group // u,  # rows per optimizer step
        gradient_accumulation_steps=1,
        steps_per_generation=u,  # one generation of P x G rows feeds u optimizer steps
        num_generations=args.group,
        max_completion_length=args.new_tokens,
        temperature=1.0,
        top_p=1.0,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=KL_COEF,
        loss_type="grpo",
        reward_weights=[REWARD_WEIGHTS["mc_idx"], REWARD_WEIGHTS["think_format"]],
        max_steps=args.iters * u,
        num_train_epochs=1,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        fp16=False,
        dataloader_num_workers=0,
        seed=0,
        shuffle_dataset=False,
        disable_tqdm=True,
    )
    times, cpu, lengths = [], [], []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t, self.c = time.perf_counter(), time.process_time()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t)
            cpu.append(time.process_time() - self.c)
            print(f"  TRL optimizer step {len(times) - 1}: {times[-1]:.2f} s", flush=True)

        def on_log(self, _args, _state, _control, logs=None, **k):
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[mc_idx, think_format],
        args=config,
        train_dataset=data,
        processing_class=hf_processor(tok, args),
        callbacks=[Timer()],
    )
    torch.set_num_threads(args.threads)
    trainer.train()
    length = float(np.mean(lengths)) if lengths else float("nan")
    per_rollout = lambda xs: [sum(xs[i : i + u]) for i in range(0, len(xs), u)]  # noqa: E731
    return dict(times=per_rollout(times), cpu=per_rollout(cpu), length=length)


def summary(times: list[float]) -> tuple[float, float]:
    """(first iteration s, median of the others s)."""
    rest = times[1:] or times
    return times[0], statistics.median(rest)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=2, help="prompts per iteration (P)")
    ap.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--iters", type=int, default=3, help="iterations (the first is warm-up)")
    model_args(ap)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--updates", type=int, default=1, help="policy updates per rollout batch")
    ap.add_argument("--old-logprobs", default="sampler", choices=["sampler", "recompute"])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--only", choices=["jaxvrl", "trl"], default=None)
    args = ap.parse_args(argv)
    set_threads(args.threads)

    import jax
    import torch

    try:
        import trl

        trl_version = trl.__version__
    except ImportError:
        trl_version = "not installed"
    print(
        f"# rl_step bench {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC | "
        f"{platform.machine()}, {os.cpu_count()} cores, {args.threads} threads | "
        f"jax {jax.__version__} | torch {torch.__version__} | trl {trl_version} | "
        f"load average {os.getloadavg()[0]:.1f}\n# python {' '.join(sys.argv)}",
        flush=True,
    )
    tok, rows = tokenizer_and_rows(args)
    results = {}
    with tempfile.TemporaryDirectory() as ckpt:
        n_params = make_checkpoint(args, tok, ckpt)
        print(
            f"# model: {args.size} ({n_params / 1e6:.1f}M params), P={args.prompts} prompts x "
            f"G={args.group} = {args.prompts * args.group} rows, {args.new_tokens} new tokens, "
            f"{args.image_size}px images, float32, {args.updates} update(s) per rollout batch "
            f"(jaxvrl old log-probs: {args.old_logprobs})",
            flush=True,
        )
        if args.only in (None, "jaxvrl"):
            results["jaxvrl"] = run_jaxvrl(args, ckpt, tok, rows)
        if args.only in (None, "trl"):
            results["TRL"] = run_trl(args, ckpt, tok, rows)
    print("| system | first iteration s | s / iteration (median of the rest) | CPU s / iteration "
          "| mean completion |")  # fmt: skip
    print("|---|---|---|---|---|")
    for name, r in results.items():
        first, med = summary(r["times"])
        print(
            f"| {name} | {first:.2f} | {med:.2f} | {summary(r['cpu'])[1]:.2f} | {r['length']:.1f} |"
        )
    if len(results) == 2:
        jx, trl = results["jaxvrl"], results["TRL"]
        ratio = summary(jx["times"])[1] / summary(trl["times"])[1]
        cpu_ratio = summary(jx["cpu"])[1] / summary(trl["cpu"])[1]
        print(
            f"\njaxvrl / TRL time per iteration: {ratio:.2f}x (CPU time {cpu_ratio:.2f}x; "
            "target <= 0.5x)",
            flush=True,
        )


if __name__ == "__main__":
    main()
