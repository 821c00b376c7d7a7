"""Rollout sampler benchmark: jaxvrl.sampling.generate vs transformers `generate`.

Builds one random-init Qwen2.5-VL in transformers, saves it, loads the same weights into
jaxvrl, and samples greedily on the same batch of image prompts with both, timing the whole
call (prefill with the vision tower + decode), after a warm-up (compilation) run. Both run the
full length: HF with min_new_tokens = max_new_tokens, jaxvrl with no EOS ids.

    python bench/sampler.py                      # small + medium, 64 and 256 new tokens
    python bench/sampler.py --quick              # small only, short (a couple of minutes on 2 cores)
    python bench/sampler.py --configs small --new-tokens 64,256
    python bench/sampler.py --device cuda --dtype bfloat16   # GPU (JAX default backend + torch cuda)
    python bench/sampler.py --configs small --repeats 3      # best of 3 timed calls each (noisy VMs)
    python bench/sampler.py --configs small --temperature 1  # plain sampling (RL rollouts)
    python bench/sampler.py --quick --no-hf --unrolled        # unscanned layers, for comparison
    python bench/sampler.py --quick --no-hf --generate --repeats 3  # generate() vs a kept Sampler

Decode step time is taken from the difference of the two lengths' runs, so prefill cancels:
step = (t(N2) - t(N1)) / (N2 - N1). The bandwidth bound of a decode step is the bytes of the
weights read per step (decoder layers, final norm and LM head; the embedding table only as the
LM head when tied) divided by the measured copy bandwidth (bytes read + written per second, a
large numpy copy on the CPU, a jitted device copy on a GPU). The read floor beside it is the
time a jitted sum takes to read the same weights once (no write, no arithmetic to speak of).

With --generate, jaxvrl also samples through plain `generate` calls (a new Sampler each, no
decode weights kept): first, so that its first call compiles, and then the kept Sampler's
first call finds the prefill program in jax's cache. Both decode steps come from the same
difference of the two lengths.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VOCAB = 151936


def special_ids(vocab: int) -> dict:
    """Qwen's special token ids (151644...) at the same distance from the vocabulary's end."""
    off = dict(im_start=151644, im_end=151645, vstart=151652, vend=151653, image=151655)
    ids = {k: v - VOCAB + vocab for k, v in off.items()}
    return dict(ids, video=ids["image"] + 1)


@dataclasses.dataclass(frozen=True)
class Size:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tie: bool
    v_depth: int
    v_hidden: int
    v_heads: int


SIZES = {
    # hidden 256, 4 layers, vision depth 4, Qwen's vocabulary
    "small": Size(256, 4, 4, 2, 1024, VOCAB, True, 4, 128, 2),
    # Qwen2.5-0.5B's text decoder (tied embeddings) with a small vision tower
    "medium": Size(896, 24, 14, 2, 4864, VOCAB, True, 4, 256, 4),
}


def hf_config(s: Size):
    from transformers import Qwen2_5_VLConfig

    sp = special_ids(s.vocab)
    return Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=s.vocab,
            hidden_size=s.hidden,
            intermediate_size=s.intermediate,
            num_hidden_layers=s.layers,
            num_attention_heads=s.heads,
            num_key_value_heads=s.kv_heads,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1000000.0,
                "mrope_section": [x * (s.hidden // s.heads) // 128 for x in (16, 24, 24)],
            },
            max_position_embeddings=4096,
            eos_token_id=sp["im_end"],
            tie_word_embeddings=s.tie,
        ),
        vision_config=dict(
            depth=s.v_depth,
            hidden_size=s.v_hidden,
            intermediate_size=4 * s.v_hidden,
            num_heads=s.v_heads,
            out_hidden_size=s.hidden,
            fullatt_block_indexes=[s.v_depth - 1],
            window_size=112,
        ),
        image_token_id=sp["image"],
        video_token_id=sp["video"],
        vision_start_token_id=sp["vstart"],
        vision_end_token_id=sp["vend"],
        tie_word_embeddings=s.tie,
    )


def image_prompts(batch: int, vocab: int, grid=(1, 16, 16), seed=0):
    """Left-padded chat-like prompts, one image each, text of varying length."""
    rng = np.random.default_rng(seed)
    sp = special_ids(vocab)
    n_img = int(np.prod(grid)) // 4
    rows = []
    for _ in range(batch):
        text = list(rng.integers(1000, min(100000, vocab - 300), rng.integers(8, 24)))
        rows.append(
            [sp["im_start"], 872, 198, sp["vstart"]] + [sp["image"]] * n_img + [sp["vend"]]
            + text + [sp["im_end"], 198, sp["im_start"], 77091 % (vocab - 300), 198]
        )  # fmt: skip
    p = max(map(len, rows))
    ids = np.zeros((batch, p), np.int64)
    mask = np.zeros((batch, p), np.int64)
    for i, r in enumerate(rows):
        ids[i, p - len(r) :] = r
        mask[i, p - len(r) :] = 1
    pv = rng.standard_normal((batch * int(np.prod(grid)), 1176)).astype(np.float32)
    return ids, mask, pv, np.array([grid] * batch)


def copy_bandwidth(device: str) -> float:
    """Bytes read + written per second by a large copy (best of 5)."""
    if device == "cpu":
        src = np.ones(256 * 2**20 // 4, np.float32) * 1.5
        dst = np.empty_like(src)
        best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(5))
        return 2 * src.nbytes / best
    import jax
    import jax.numpy as jnp

    x = jnp.ones((1024 * 2**20 // 4,), jnp.float32)
    f = jax.jit(lambda a: a * 1.0001)
    f(x).block_until_ready()
    best = min(_timed(lambda: f(x).block_until_ready()) for _ in range(5))
    return 2 * x.nbytes / best


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def decode_weight_bytes(model) -> int:
    """Bytes of parameters read per decode step: decoder layers, final norm, LM head."""
    import jax
    from flax import nnx

    n = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model.model.layers)))
    n += model.model.norm.weight[...].nbytes
    if model.config.tie_word_embeddings:
        n += model.model.embed_tokens.embedding[...].nbytes
    else:
        n += sum(x.nbytes for x in jax.tree.leaves(nnx.state(model.lm_head)))
    return n


def weight_read_seconds(model) -> float:
    """Best of 5 of a jitted sum over the weights a decode step reads: the time just to stream
    them once from memory on this backend (a practical floor; no write)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    ws = jax.tree.leaves(nnx.state(model.model.layers)) + [model.model.norm.weight[...]]
    if model.config.tie_word_embeddings:
        ws.append(model.model.embed_tokens.embedding[...])
    else:
        ws += jax.tree.leaves(nnx.state(model.lm_head))
    f = jax.jit(lambda ws: sum(jnp.sum(w) for w in ws))
    jax.block_until_ready(f(ws))
    return min(_timed(lambda: jax.block_until_ready(f(ws))) for _ in range(5))


def run_hf(hf, inputs, n, device, threads=1, repeats=1, temperature=0.0):
    import torch

    ids, mask, pv, grid = inputs
    sp = special_ids(hf.config.text_config.vocab_size)
    tt = np.where(ids == sp["image"], 1, 0)
    kw = dict(
        input_ids=torch.tensor(ids, device=device),
        attention_mask=torch.tensor(mask, device=device),
        mm_token_type_ids=torch.tensor(tt, device=device),
        pixel_values=torch.tensor(pv, device=device, dtype=hf.dtype),
        image_grid_thw=torch.tensor(grid, device=device),
    )
    gen = dict(do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=sp["im_end"])
    if temperature > 0:  # plain sampling: HF's default top_k = 50 off
        gen.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    gen.update(
        pad_token_id=0, suppress_tokens=[sp[k] for k in ("image", "video", "vstart", "vend")]
    )
    if device == "cpu":
        torch.set_num_threads(threads)
    with torch.inference_mode():
        hf.generate(**kw, **dict(gen, max_new_tokens=2, min_new_tokens=2))  # warm-up
        if device == "cuda":
            torch.cuda.synchronize()
        dt = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            out = hf.generate(**kw, **gen)
            if device == "cuda":
                torch.cuda.synchronize()
            dt = min(dt, time.perf_counter() - t)
    return out[:, ids.shape[1] :].cpu().numpy(), dt


def run_jax(model, inputs, n, repeats=1, temperature=0.0):
    """A rollout's call as the trainer makes it: one Sampler kept across calls, and the
    decode weights prepared for the parameters before each call (packed into the buffer of
    the previous call's: `Sampler.decode_weights`), timed together."""
    from flax import nnx

    from jaxvrl.sampling import Sampler, generate
    from jaxvrl.sampling.sampler import generation_config

    ids, mask, pv, grid = inputs
    cfg = generation_config(model.config, max_new_tokens=n, temperature=temperature)
    graphdef, params = nnx.split(model)
    sampler = Sampler(graphdef, cfg)
    kw = dict(
        max_new_tokens=n,
        temperature=temperature,
        eos_token_ids=(),
        pixel_values=pv,
        image_grid_thw=grid,
        sampler=sampler,
    )
    weights = None

    def call():
        nonlocal weights
        weights = sampler.decode_weights(params, ids.shape[0], reuse=weights)
        return generate(model, ids, mask, decode_weights=weights, **kw)

    return timed_calls(call, repeats)


def timed_calls(call, repeats: int):
    """(tokens of the last call, best of `repeats` calls in seconds, first call's seconds) of
    `call() -> SampleOutput`, the first call (compiling) timed apart."""
    import jax

    t = time.perf_counter()
    jax.block_until_ready(call().tokens)
    first_s = time.perf_counter() - t
    dt = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        toks = np.asarray(jax.block_until_ready(call().tokens))
        dt = min(dt, time.perf_counter() - t)
    return toks, dt, first_s


def run_generate(model, inputs, n, repeats=1, temperature=0.0):
    """Sampling as a script calls `generate`: no Sampler or decode weights kept (each call
    makes its own Sampler; the decode weights are prepared inside its decode program).
    Returns (tokens, best call seconds, first call seconds)."""

    from jaxvrl.sampling import generate

    ids, mask, pv, grid = inputs
    kw = dict(
        max_new_tokens=n,
        temperature=temperature,
        eos_token_ids=(),
        pixel_values=pv,
        image_grid_thw=grid,
    )
    return timed_calls(lambda: generate(model, ids, mask, **kw), repeats)


def generate_lines(gen: dict, kept: dict, kept_tokens: dict) -> list[str]:
    """The --generate table: plain `generate` calls against the kept Sampler, per length, and
    the decode step of each from the difference of the two lengths."""
    lines = [
        "\n| new tokens | generate first call s | generate s | kept Sampler s | same tokens |",
        "|---|---|---|---|---|",
    ]
    for n, (toks, t_g, first) in gen.items():
        same = "yes" if np.array_equal(toks, kept_tokens[n]) else "no"
        lines.append(f"| {n} | {first:.2f} | {t_g:.2f} | {kept[n]:.2f} | {same} |")
    if len(gen) >= 2:
        n1, n2 = min(gen), max(gen)
        step_g = (gen[n2][1] - gen[n1][1]) / (n2 - n1)
        step_k = (kept[n2] - kept[n1]) / (n2 - n1)
        lines.append(
            f"\ndecode step (from the {n1}/{n2} difference): generate {step_g * 1e3:.2f} ms, "
            f"kept Sampler {step_k * 1e3:.2f} ms"
        )
    return lines


def random_model(size: Size, dtype: str, seed: int = 0, **load_kw):
    """(transformers' model, jaxvrl's): a random Qwen2.5-VL of `size` (torch seed `seed`),
    saved and loaded through jaxvrl's loader in `dtype` ("float32" | "bfloat16")."""
    import jax.numpy as jnp
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from jaxvrl.models import qwen2_5_vl

    torch.manual_seed(seed)
    hf = Qwen2_5_VLForConditionalGeneration(hf_config(size)).eval()
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        return hf, qwen2_5_vl.load(tmp, dtype=getattr(jnp, dtype), **load_kw)


def bench_size(name: str, size: Size, args) -> list[str]:
    import torch

    hf, model = random_model(size, args.dtype, scan_layers=not args.unrolled)
    hf = hf.to(device=args.device, dtype=getattr(torch, args.dtype))
    n_params = sum(p.numel() for p in hf.parameters())
    inputs = image_prompts(args.batch, size.vocab)
    b, p = inputs[0].shape
    lines = [
        f"## {name}: {n_params / 1e6:.1f}M params, {size}, batch {b}, prompt {p} "
        f"(one 224x224 image per row), {args.dtype}, "
        + (f"sampled at temperature {args.temperature}" if args.temperature > 0 else "greedy")
    ]
    lines.append("| new tokens | HF s | HF tok/s | jaxvrl s | jaxvrl tok/s | ratio | "
                 "jaxvrl compile s | same tokens |")  # fmt: skip
    lines.append("|---|---|---|---|---|---|---|---|")
    jax_times, hf_times, best = {}, {}, None
    gen, jax_tokens = {}, {}
    for n in args.new_tokens:
        if args.generate:  # first: its first call compiles the programs
            gen[n] = run_generate(model, inputs, n, args.repeats, args.temperature)
        # every thread count at the first length, then the fastest of them
        threads = [] if args.no_hf else args.hf_threads if best is None else [best]
        runs = {
            th: run_hf(hf, inputs, n, args.device, th, args.repeats, args.temperature)
            for th in threads
        }
        runs = runs or {0: (np.zeros((b, n), np.int64), float("nan"))}
        best = min(runs, key=lambda th: runs[th][1])
        ref, t_hf = runs[best]
        toks, t_jx, t_c = run_jax(model, inputs, n, args.repeats, args.temperature)
        jax_times[n], hf_times[n], jax_tokens[n] = t_jx, t_hf, toks
        same = float(np.mean(np.cumprod(toks == ref, axis=1)))  # common greedy prefix
        same = f"{same:.0%}" if args.temperature <= 0 else "sampled"
        lines.append(
            f"| {n} | {t_hf:.2f} ({best} thr) | {b * n / t_hf:.0f} | {t_jx:.2f} | {b * n / t_jx:.0f} | "
            f"{t_hf / t_jx:.1f}x | {t_c:.1f} | {same} |"
        )
        print(lines[-1], flush=True)
    if gen:
        lines += generate_lines(gen, jax_times, jax_tokens)
    if len(jax_times) < 2:
        return lines
    first = len(lines)
    n1, n2 = min(jax_times), max(jax_times)
    step = (jax_times[n2] - jax_times[n1]) / (n2 - n1)
    hf_step = (hf_times[n2] - hf_times[n1]) / (n2 - n1)
    lines.append(
        f"\ndecode step (from the {n1}/{n2} difference): HF {hf_step * 1e3:.1f} ms, jaxvrl "
        f"{step * 1e3:.1f} ms ({hf_step / step:.1f}x); prefill+setup: HF "
        f"{(hf_times[n1] - n1 * hf_step) * 1e3:.0f} ms, jaxvrl {(jax_times[n1] - n1 * step) * 1e3:.0f} ms"
    )
    if name == "medium" or args.bound_all:
        wbytes = decode_weight_bytes(model)
        bw = copy_bandwidth("cpu" if args.device == "cpu" else "gpu")
        bound = wbytes / bw
        lines.append(
            f"bandwidth bound: {wbytes / 1e6:.0f} MB of weights per decode step, copy "
            f"bandwidth {bw / 1e9:.1f} GB/s -> {bound * 1e3:.2f} ms/step; jaxvrl decode "
            f"{step * 1e3:.2f} ms/step = {bound / step:.0%} of the bound"
        )
        read = weight_read_seconds(model)
        lines.append(
            f"read floor: a jitted sum over the same weights takes {read * 1e3:.2f} ms "
            f"({wbytes / read / 1e9:.1f} GB/s read); jaxvrl decode = {step / read:.1f}x that"
        )
    print("\n".join(lines[first:]), flush=True)
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small config, batch 8, 16/48 tokens")
    ap.add_argument("--configs", default="small,medium")
    ap.add_argument("--new-tokens", default="64,256")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--hf-threads", default=None, help="torch CPU threads to try (best kept)")
    ap.add_argument("--no-hf", action="store_true", help="time jaxvrl only")
    ap.add_argument("--vocab", type=int, default=None, help="override the vocabulary size")
    ap.add_argument("--bound-all", action="store_true", help="bandwidth bound for every config")
    ap.add_argument(
        "--temperature", type=float, default=0.0, help="> 0: plain sampling (no top-k/top-p)"
    )
    ap.add_argument(
        "--repeats", type=int, default=1, help="timed calls per system and length (best kept)"
    )
    ap.add_argument(
        "--unrolled", action="store_true", help="model.scan_layers=False (the default scans)"
    )
    ap.add_argument(
        "--generate", action="store_true", help="also time plain generate() calls (no Sampler kept)"
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.configs, args.new_tokens = "small", "16,48"
    args.new_tokens = [int(x) for x in args.new_tokens.split(",")]

    import jax
    import torch

    ncpu = os.cpu_count()
    args.hf_threads = [int(x) for x in (args.hf_threads or f"{ncpu},1").split(",")]
    print(
        f"# sampler bench {datetime.date.today()} | {platform.processor() or platform.machine()}"
        f", {os.cpu_count()} cores | jax {jax.__version__} ({jax.default_backend()}) | "
        f"torch {torch.__version__} ({args.device}, threads {args.hf_threads}, best kept) | "
        f"load average {os.getloadavg()[0]:.1f}\n"
        f"# python {' '.join(sys.argv)}",
        flush=True,
    )
    for name in args.configs.split(","):
        size = (
            SIZES[name]
            if args.vocab is None
            else dataclasses.replace(SIZES[name], vocab=args.vocab)
        )
        print("\n".join(bench_size(name, size, args)), flush=True)


if __name__ == "__main__":
    main()
