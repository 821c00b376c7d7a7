"""The main job: sample -> reward -> filter -> fused train step -> log -> checkpoint.

    python -m jaxvrl.train --config configs/tprl.py [--config.key=value ...]

Read top to bottom: config, model and tokenizer, data, optimizer and state, resume, jitted
sampler and train step, then the loop. Only this file reads the ConfigDict.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxvrl import rl
from jaxvrl.checkpoint import Checkpointer, PreemptionFlag
from jaxvrl.config import load_config, parse_argv
from jaxvrl.data import synthetic
from jaxvrl.data.pipeline import EncodeOptions, EpochIterator, collate, encode_rows, read_rows
from jaxvrl.logging.writers import (
    MarkdownLog,
    MetricsWriter,
    Progress,
    attention_section,
    rollout_section,
    token_weight_section,
)
from jaxvrl.models.qwen2_5_vl import load
from jaxvrl.rl.rewards import SafeReward, load_reward_fn, total_reward
from jaxvrl.sampling import SamplingConfig, make_sampler
from jaxvrl.trainer.build import init_train_state, step_config
from jaxvrl.trainer.rollout import assemble
from jaxvrl.trainer.step import make_train_step

log = logging.getLogger("jaxvrl")
EMBEDDED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "tiny_qwen2_5_vl")


def load_examples(c, tokenizer, split: str):
    """Encoded examples of the train or val split (files, or the built-in task)."""
    files = c.data.train_files if split == "train" else c.data.val_files
    builtin = not c.data.train_files
    system = c.data.system_prompt or (synthetic.SYSTEM_PROMPT if builtin else None)
    opts = EncodeOptions(
        image_dir=c.data.image_dir or None,
        max_prompt_length=c.data.max_prompt_length,
        max_image_side=c.data.max_image_side,
        min_pixels=c.data.min_pixels,
        max_pixels=c.data.max_pixels,
        system_prompt=system,
    )
    if files:
        examples, stats = [], None
        for path in files.split(","):
            ex, stats = encode_rows(read_rows(path), tokenizer, opts, source=path, stats=stats)
            examples += ex
    elif builtin:
        n = c.data.synthetic_train_size if split == "train" else c.val_size
        rows = synthetic.make_split(
            "train" if split == "train" else "test",
            n,
            seed=c.seed,
            kinds=tuple(c.data.synthetic_kinds),
        )
        examples, stats = encode_rows(rows, tokenizer, opts, source=f"builtin:{split}")
    else:
        return [], None
    if stats is not None and stats.total:
        log.warning("%s: skipped %d rows: %s", split, stats.total, dict(stats.counts))
    return examples, stats


def completions_text(tokenizer, tokens, mask) -> list[str]:
    out = []
    for row, m in zip(tokens, mask):
        n = int(m.sum())
        out.append(tokenizer.decode(row[:n].tolist(), skip_special_tokens=True))
    return out


def rollout(sampler, params, batch, key):
    """Sample completions for a collated prompt batch; host numpy results."""
    out = sampler(
        params,
        jnp.asarray(batch["input_ids"]),
        jnp.asarray(batch["attention_mask"]),
        jnp.asarray(batch["position_ids"]),
        jnp.asarray(batch["deltas"]),
        key,
        images=None if batch["images"] is None else jax.tree.map(jnp.asarray, batch["images"]),
        pools=None if batch.get("stat_pools") is None else batch["stat_pools"],
    )
    return jax.tree.map(lambda x: None if x is None else np.asarray(x), out)


def evaluate(val_examples, sampler_greedy, params, model_cfg, tokenizer, c) -> dict:
    """Greedy accuracy (mc_idx) on held-out examples."""
    if not val_examples:
        return {}
    correct, fmt, n = 0.0, 0.0, 0
    bs = max(1, c.prompts_per_step * c.rollout.num_generations)
    for i in range(0, len(val_examples), bs):
        chunk = val_examples[i : i + bs]
        chunk = chunk + [chunk[-1]] * (bs - len(chunk))  # one compiled shape
        batch = collate(chunk, 1, model_cfg, tokenizer, c.data.prompt_bucket, with_pools=False)
        out = rollout(sampler_greedy, params, batch, jax.random.key(0))
        texts = completions_text(tokenizer, out.tokens, out.mask)
        k = min(bs, len(val_examples) - i)
        labels = [ex.get("label_idx", ex.get("answer")) for ex in chunk[:k]]
        correct += sum(rl.rewards.mc_idx_reward(texts[:k], labels))
        fmt += sum(rl.rewards.think_format_reward(texts[:k]))
        n += k
    return {"val/accuracy": correct / n, "val/format": fmt / n}


def build_rewards(c):
    fns = {name: SafeReward(name, load_reward_fn(name)) for name in c.reward.funcs}
    if len(c.reward.weights) != len(c.reward.funcs):
        raise ValueError("config.reward.weights must have one weight per config.reward.funcs")
    regular = dict(zip(c.reward.funcs, c.reward.weights))
    early = dict(zip(c.reward.funcs, c.reward.early_weights)) if c.reward.early_weights else None
    return fns, regular, early


def attention_stats(out, batch, c) -> dict:
    """Rollout attention metrics (MDI per row etc.) from decode-time masses."""
    if out.vision_mass is None:
        return {}
    pools = batch["pools"]
    m = rl.attention_metrics(
        jnp.asarray(out.vision_mass),
        jnp.asarray(out.text_mass),
        jnp.asarray(pools["vision"].sum(1)),
        jnp.asarray(pools["text"].sum(1)),
        jnp.asarray(out.mask),
        last_k=c.vgr.token_weight_last_k_layers,
    )
    return {k: np.asarray(v) for k, v in m.items()}


def run(c) -> dict:
    """Train (or only validate) per config `c`; returns the last metrics."""
    from transformers import AutoTokenizer

    t_start = time.time()
    jax.config.update("jax_default_matmul_precision", "highest")
    os.makedirs(c.workdir, exist_ok=True)
    primary = jax.process_index() == 0
    path = c.model.path or EMBEDDED
    dtype = jnp.bfloat16 if c.model.dtype == "bfloat16" else jnp.float32
    model = load(path, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(path)
    mcfg = model.config
    print(
        f"model {path} ({sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))) / 1e6:.2f}M params), workdir {c.workdir}",
        flush=True,
    )

    train_ex, train_stats = load_examples(c, tokenizer, "train")
    val_ex, _ = load_examples(c, tokenizer, "val")
    it = EpochIterator(
        train_ex,
        c.prompts_per_step,
        seed=c.seed,
        shard_index=jax.process_index(),
        shard_count=jax.process_count(),
    )

    graphdef, tx, state, ref_params = init_train_state(model, c)
    scfg = step_config(c)
    rng = jax.random.key(c.seed)
    ckpt = Checkpointer(os.path.join(c.workdir, "checkpoints"), c.max_to_keep)
    start = 0
    if c.resume and ckpt.latest_step() is not None:
        start = ckpt.latest_step()
        state, rng, meta = ckpt.restore(start, state)
        it.set_state(meta["iterator"])
        print(f"resumed from step {start}", flush=True)

    eos = (
        tuple(int(x) for x in np.atleast_1d(mcfg.eos_token_id))
        if mcfg.eos_token_id is not None
        else (tokenizer.eos_token_id,)
    )
    suppress = (
        mcfg.image_token_id,
        mcfg.video_token_id,
        mcfg.vision_start_token_id,
        mcfg.vision_end_token_id,
    )
    model_graph = nnx.graphdef(model)
    scfg_sample = SamplingConfig(
        c.rollout.max_new_tokens,
        c.rollout.temperature,
        c.rollout.top_p,
        c.rollout.top_k,
        eos,
        tokenizer.pad_token_id or 0,
        suppress,
    )
    sampler = make_sampler(model_graph, scfg_sample)
    greedy = make_sampler(model_graph, dataclasses.replace(scfg_sample, temperature=0.0))
    # make_sampler is cached per (model, config) across runs in one process: count new entries
    compiled_before = sampler._cache_size(), greedy._cache_size()
    train_step = make_train_step(graphdef, tx, scfg)
    reward_fns, regular_w, early_w = build_rewards(c)
    need_stats = "mdi" in c.reward.funcs or scfg.token_weights

    writer = MetricsWriter(c.workdir, primary)
    md_roll = MarkdownLog(c.workdir, "rollout_results", "Rollout results", primary)
    md_tok = MarkdownLog(c.workdir, "token_weights", "Token weights", primary)
    md_att = MarkdownLog(c.workdir, "attention_diagnostics", "Attention diagnostics", primary)
    progress = Progress(c.total_steps, start, primary)
    flag = PreemptionFlag()
    metrics = {}
    if start == 0 or c.val_only:
        metrics = evaluate(val_ex, greedy, state.params, mcfg, tokenizer, c)
        if train_stats is not None:
            metrics.update({f"data/skipped_{k}": v for k, v in train_stats.counts.items()})
        writer.write(start, metrics)
        print(f"step {start}: {metrics}", flush=True)
    if c.val_only:
        writer.close()
        return metrics

    nonfinite = 0
    step = start
    for step in range(start, c.total_steps):
        t0 = time.time()
        rng, k_sample, k_step = jax.random.split(rng, 3)
        batch = collate(
            next(it),
            c.rollout.num_generations,
            mcfg,
            tokenizer,
            c.data.prompt_bucket,
            with_pools=True,
        )
        if need_stats:
            batch["stat_pools"] = {k: jnp.asarray(v) for k, v in batch["pools"].items()}
        out = rollout(sampler, state.params, batch, k_sample)
        t_sample = time.time() - t0
        texts = completions_text(tokenizer, out.tokens, out.mask)
        rows = batch["rows"]
        att = attention_stats(out, batch, c)
        columns = {key: [r.get(key) for r in rows] for key in ("label_idx", "answer", "solution")}
        columns["mdi"] = list(att["mdi"]) if "mdi" in att else None
        columns["mdi_balance_ratio"] = c.reward.mdi_balance_ratio
        weights = rl.stage_reward_weights(step, regular_w, early_w, c.reward.early_steps)
        totals, parts = total_reward(reward_fns, weights, texts, **columns)
        comp_mask = out.mask.astype(np.float32)
        lengths = comp_mask.sum(1)
        if c.filter.overlong_buffer_len:
            totals = totals + rl.soft_overlong_punishment(
                lengths,
                c.rollout.max_new_tokens,
                c.filter.overlong_buffer_len,
                c.filter.overlong_penalty_factor,
            )
        if c.filter.mask_truncated_completions:
            comp_mask = rl.mask_truncated_completions(comp_mask, out.truncated)
        G = c.rollout.num_generations
        keep = np.ones(len(totals) // G, bool)
        if c.filter.dynamic_sampling:
            keep &= rl.dynamic_sampling_keep(totals, G)
        if c.filter.online_filtering:
            keep &= rl.online_filter_keep(
                parts[c.reward.funcs[0]], G, c.filter.filter_low, c.filter.filter_high
            )
        comp_mask = comp_mask * rl.expand_groups(keep, G)[:, None]
        rb = assemble(
            batch["input_ids"],
            batch["attention_mask"],
            batch["position_ids"],
            batch["deltas"],
            out.tokens,
            comp_mask,
            totals,
            batch["has_image"],
            images=batch["images"],
            pools=batch["pools"] if scfg.token_weights else None,
        )
        rb = jax.tree.map(jnp.asarray, rb)
        state, m, extras = train_step(state, ref_params, rb, k_step)
        m = {k: float(v) for k, v in jax.device_get(m).items()}
        nonfinite = nonfinite + 1 if m["nonfinite"] else 0
        dt = time.time() - t0
        metrics = {f"train/{k}": v for k, v in m.items()}
        metrics.update({f"reward/{k}": float(np.mean(v)) for k, v in parts.items()})
        metrics.update(
            {
                "reward/total": float(np.mean(totals)),
                "loss": m["loss"],
                "kl": m.get("kl", 0.0),
                "entropy": m["entropy"],
                "perception_token_fraction": m.get("perception_token_fraction", 1.0),
                "scaling_factor_mean": m.get("scaling_factor_mean", 1.0),
                "sensitivity_score_mean": m.get("sensitivity_score_mean", 0.0),
                "response_length": float(lengths.mean()),
                "kept_groups_fraction": float(keep.mean()),
                "tokens_per_s": float(lengths.sum() / max(t_sample, 1e-6)),
                "step_time_s": dt,
            }
        )
        if att:
            metrics.update(
                {f"attn/{k}": float(np.nanmean(v)) for k, v in att.items() if v.ndim == 1}
            )
        if "mc_idx" in parts:
            metrics["accuracy"] = float(np.mean(parts["mc_idx"]))
        if (step + 1) % c.val_freq == 0 or step + 1 == c.total_steps:
            metrics.update(evaluate(val_ex, greedy, state.params, mcfg, tokenizer, c))
        writer.write(step + 1, metrics)
        progress.update(step, metrics)
        if step % c.log_rollouts_every == 0:
            adv = np.asarray(extras["advantages"])
            md_roll.append(
                rollout_section(step, [r["problem"] for r in rows], texts, parts, totals, adv)
            )
            if extras["token_weights"] is not None:
                w = np.asarray(extras["token_weights"])
                toks = [
                    [tokenizer.decode([t]) for t in out.tokens[i][: int(out.mask[i].sum())]]
                    for i in range(min(4, len(texts)))
                ]
                md_tok.append(token_weight_section(step, toks, w))
            if att:
                md_att.append(
                    attention_section(
                        step, {k: np.nanmean(v) for k, v in att.items() if v.ndim == 1}
                    )
                )
        if nonfinite >= c.max_nonfinite_steps:
            raise FloatingPointError(
                f"{nonfinite} consecutive steps with a non-finite loss or gradient (limit "
                f"config.max_nonfinite_steps={c.max_nonfinite_steps}); stopping"
            )
        over_budget = c.time_budget_s and time.time() - t_start > c.time_budget_s
        if (c.save_freq and (step + 1) % c.save_freq == 0) or flag.requested or over_budget:
            ckpt.save(step + 1, state, rng, {"iterator": it.get_state()})
        if flag.requested or over_budget:
            print(
                f"stopping at step {step + 1} ({'SIGTERM' if flag.requested else 'time budget'}); checkpoint saved",
                flush=True,
            )
            break
    else:
        if c.total_steps > start:
            ckpt.save(c.total_steps, state, rng, {"iterator": it.get_state()})
    flag.restore()
    ckpt.close()
    writer.close()
    metrics["compiles/train_step"] = train_step._cache_size()
    metrics["compiles/sampler"] = sampler._cache_size() - compiled_before[0]
    metrics["compiles/greedy_sampler"] = greedy._cache_size() - compiled_before[1]
    return metrics


def main(argv=None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    path, overrides = parse_argv(sys.argv[1:] if argv is None else argv)
    config = load_config(path, overrides)
    final = run(config)
    if "val/accuracy" in final:
        print(f"final val/accuracy {final['val/accuracy']:.3f}", flush=True)
    if math.isnan(final.get("loss", 0.0)):
        sys.exit(1)


if __name__ == "__main__":
    main()
