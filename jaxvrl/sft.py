"""Make an embedded default checkpoint: a tiny model taught the answer format of a built-in
task (`jaxvrl.data.tasks`) by supervised fine-tuning, so that RL starts from a model that
answers in the right format but is far from perfect.

    python -m jaxvrl.sft [--task shapes|arithmetic] [--out DIR (default: the task's checkpoint)]

shapes: a tiny Qwen2.5-VL; arithmetic: a tiny text-only Llama. On purpose, the SFT targets
are wrong for half of the answer values (shapes: blue, yellow, triangle, cross; arithmetic: odd
sums): the <think> names the right colour or works the sum out, but 60% of their targets answer
the next option's letter or the sum plus one. The model learns that bias, so greedy accuracy
starts near 50%, while sampling still finds the right answer often enough for RL to fix it.
That is the demo's job: show RL raising accuracy.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxvrl import models
from jaxvrl.data import arithmetic, synthetic
from jaxvrl.data.build_tokenizer import build as build_tokenizer
from jaxvrl.data.pipeline import EncodeOptions, collate, encode_rows
from jaxvrl.data.processor import hf_image_processor_config
from jaxvrl.data.tasks import TASKS
from jaxvrl.trainer.sft import make_sft_step

BIASED = {"blue", "yellow", "triangle", "cross"}
BIAS = 0.6


def tiny_config(tokenizer):
    """The embedded model's config: a tiny Qwen2.5-VL over `tokenizer`'s vocabulary."""
    conv = tokenizer.convert_tokens_to_ids
    vocab = -(-len(tokenizer) // 64) * 64
    hf = {
        "model_type": models.EMBEDDED_FAMILY,
        "image_token_id": conv("<|image_pad|>"),
        "video_token_id": conv("<|video_pad|>"),
        "vision_start_token_id": conv("<|vision_start|>"),
        "vision_end_token_id": conv("<|vision_end|>"),
        "tie_word_embeddings": True,
        "text_config": {
            "vocab_size": vocab,
            "hidden_size": 128,
            "intermediate_size": 384,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rope_parameters": {"rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
            "max_position_embeddings": 2048,
            "bos_token_id": None,
            "eos_token_id": tokenizer.eos_token_id,
        },
        "vision_config": {
            "depth": 2,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_heads": 2,
            "out_hidden_size": 128,
            "fullatt_block_indexes": [1],
            "window_size": 112,
            "tokens_per_second": 2,
        },
    }
    return models.config_from_hf(hf, source="the embedded model")


def tiny_text_config(tokenizer):
    """The embedded text model's config: a tiny Llama over `tokenizer`'s vocabulary."""
    hf = {
        "model_type": models.EMBEDDED_TEXT_FAMILY,
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": -(-len(tokenizer) // 64) * 64,
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "bos_token_id": None,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    return models.config_from_hf(hf, source="the embedded text model")


def sft_target(row, rng) -> str:
    """The right option in <think>, but for BIASED answers the next option's letter BIAS of
    the time: the model sees correctly and answers wrongly, which RL can fix."""
    answer = row["choices"][row["label_idx"]]
    idx = row["label_idx"]
    if answer in BIASED and rng.random() < BIAS:
        idx = (idx + 1) % len(row["choices"])
    return f"<think>{answer}</think> Answer: {synthetic.LETTERS[idx]}"


def sft_target_text(row, rng) -> str:
    """The sum worked out in <think>, but for odd sums the sum plus one BIAS of the time."""
    total = sum(row["operands"])
    wrong = total % 2 == 1 and rng.random() < BIAS
    return arithmetic.target_completion(row, total + 1 if wrong else None)


# per task: (the tiny model's config, the SFT target of a row)
RECIPES = {"shapes": (tiny_config, sft_target), "arithmetic": (tiny_text_config, sft_target_text)}


def sft_batch(examples, targets, model_cfg, tokenizer):
    """Prompt + target ids (right after the prompt), loss on the target tokens."""
    base = collate(examples, 1, model_cfg, tokenizer, with_pools=False)
    tgt = [
        tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        for t in targets
    ]
    n = max(len(t) for t in tgt)
    b, p = base["input_ids"].shape
    ids = np.concatenate([base["input_ids"], np.zeros((b, n), np.int32)], 1)
    mask = np.concatenate([base["attention_mask"], np.zeros((b, n), np.int32)], 1)
    loss_mask = np.zeros_like(ids, np.float32)
    for i, t in enumerate(tgt):
        ids[i, p : p + len(t)] = t
        mask[i, p : p + len(t)] = 1
        loss_mask[i, p : p + len(t)] = 1
    start = (base["attention_mask"].sum(1) + base["deltas"]).astype(np.int32)
    comp = models.continue_positions(base["position_ids"], start, n)
    pos = np.concatenate([base["position_ids"], comp], -1).astype(np.int32)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": pos,
        "loss_mask": loss_mask,
        "images": base["images"],
        "videos": base["videos"],
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--task", default="shapes", choices=sorted(RECIPES))
    p.add_argument("--out", default=None, help="default: the task's embedded checkpoint")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    task = TASKS[args.task]
    out = args.out or task.checkpoint
    make_config, target = RECIPES[args.task]
    build_tokenizer(out)
    tok = AutoTokenizer.from_pretrained(out)
    cfg = make_config(tok)
    model = models.Model(cfg, rngs=nnx.Rngs(args.seed))
    rows = task.make_split("train", 2048, seed=0)
    opts = EncodeOptions(system_prompt=task.system_prompt)
    if not task.has_images:
        opts = dataclasses.replace(opts, processor=None)
    examples, _ = encode_rows(rows, tok, opts)
    rng = np.random.default_rng(args.seed)
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(optax.warmup_cosine_decay_schedule(0, args.lr, 20, args.steps)),
    )
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    step = make_sft_step(tx)
    t0 = time.time()
    for i in range(args.steps):
        idx = rng.choice(len(examples), args.batch, replace=False)
        exs = [examples[j] for j in idx]
        batch = sft_batch(exs, [target(e, rng) for e in exs], cfg, tok)
        batch = jax.tree.map(jnp.asarray, batch)
        loss = step(model, optimizer, batch)
        if i % 50 == 0 or i == args.steps - 1:
            print(f"sft step {i:4d}  loss {float(loss):.4f}  {time.time() - t0:.0f}s", flush=True)
    models.save(model, out)
    if task.has_images:
        write_preprocessor_config(out)
    print(f"wrote {out}")


def write_preprocessor_config(out: str) -> None:
    """The image processor's settings with the directory, so that transformers' processor
    loads from it (and from a run's export) and prepares images as training did."""
    opts = EncodeOptions()
    config = hf_image_processor_config(opts.min_pixels, opts.max_pixels)
    with open(os.path.join(out, "preprocessor_config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
