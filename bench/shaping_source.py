"""Where token shaping should read the old policy's log-probs and entropies: the sampler's
(returned with the completions) or a no-grad clean pass's (`actor.shaping_source`). For one
rollout batch, the perception mask (top-p of the visual dependency against the perturbed
image, TPRL) and the entropy mask from both sources are compared token by token, with the
sampler computing in float32 and in bfloat16 (the training passes in float32).

    python bench/shaping_source.py                  # the embedded default model and `small`
    python bench/shaping_source.py --models small --prompts 8 --new-tokens 128

The model is the embedded tiny one (jaxvrl/assets/tiny_qwen2_5_vl, what the main job trains)
or the small random-init Qwen2.5-VL of bench/sampler.py; the prompts are the built-in task's
with their images, G completions each sampled at temperature 1. Agreement: the share of
completion tokens on which the two masks agree, and the Jaccard index of the selected tokens
(|both| / |either|); also the largest log-prob and entropy differences.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile

import numpy as np

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH))
sys.path.insert(0, BENCH)

import rl_step  # noqa: E402  (bench/rl_step.py: tokenizer, rows, checkpoint)

TOP_P = 0.4  # configs/tprl.py's perception and entropy top-p


def measure(args, model, tok, rows, rollout_dtype: str) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from configs import base as base_config
    from jaxvrl import rl
    from jaxvrl.config import set_values
    from jaxvrl.data import synthetic
    from jaxvrl.data.pipeline import EncodeOptions, collate, encode_rows
    from jaxvrl.sampling import Sampler
    from jaxvrl.sampling.sampler import generation_config
    from jaxvrl.trainer.experience import no_grad_passes
    from jaxvrl.trainer.rollout import assemble_prompts
    from jaxvrl.trainer.step import StepConfig

    opts = EncodeOptions(system_prompt=synthetic.SYSTEM_PROMPT, **rl_step.pixel_limits(args))
    examples, _ = encode_rows(rows[: args.prompts], tok, opts, source="builtin:train")
    g, cfg_m = args.group, model.config
    prompts = collate(examples, 1, cfg_m, tok, with_pools=False)
    sampling = generation_config(cfg_m, max_new_tokens=args.new_tokens, temperature=1.0,
                                 eos_token_ids=(tok.eos_token_id,))  # fmt: skip
    import dataclasses

    sampling = dataclasses.replace(sampling, entropies=True)
    dtype = None if rollout_dtype == "float32" else rollout_dtype
    sampler = Sampler(nnx.graphdef(model), sampling, None, dtype)
    args_in = [jnp.asarray(prompts[k]) for k in ("input_ids", "attention_mask", "position_ids", "deltas")]  # fmt: skip
    out = sampler(nnx.state(model), *args_in, jax.random.key(args.seed),
                  images=jax.tree.map(jnp.asarray, prompts["images"]), num_samples=g)  # fmt: skip
    out = jax.tree.map(np.asarray, out)
    batch = assemble_prompts(
        collate(examples, g, cfg_m, tok, with_pools=False),
        out.tokens,
        out.mask,
        np.zeros(len(out.tokens), np.float32),
        old_logprobs=out.logprobs,
        old_entropy=out.entropies,
    )
    values = {
        "rollout.num_generations": g,
        "tprl.enable_perception_filtering": True,
        "tprl.enable_entropy_filtering": True,
        "tprl.top_p_perception_tokens": TOP_P,
        "tprl.top_p_entropy_tokens": TOP_P,
        "actor.ppo_epochs": 2,
        "actor.shaping_source": "recompute",
    }
    cfg = StepConfig.of(set_values(base_config.get_config(), values))
    graphdef, params = nnx.split(model, nnx.Param)
    passes = no_grad_passes(graphdef, params, None, jax.tree.map(jnp.asarray, batch),
                            jax.random.key(1), cfg)  # fmt: skip
    m = jnp.asarray(batch.completion_mask)
    res = {"tokens": int(batch.completion_mask.sum())}
    sources = {"recompute": (passes.old_logp, passes.entropy),
               "sampler": (jnp.asarray(out.logprobs), jnp.asarray(out.entropies))}  # fmt: skip
    masks = {}
    for name, (logp, ent) in sources.items():
        score = rl.visual_dependency(passes.aug_logp, logp, m)
        masks[name] = (
            np.asarray(rl.top_p_token_mask(score, m, TOP_P)) > 0,
            np.asarray(rl.entropy_token_mask(ent, m, TOP_P)) > 0,
        )
    real = batch.completion_mask > 0
    for i, kind in enumerate(("perception", "entropy")):
        a, b = masks["recompute"][i][real], masks["sampler"][i][real]
        res[f"{kind}_agree"] = float(np.mean(a == b))
        res[f"{kind}_jaccard"] = float(np.sum(a & b) / max(np.sum(a | b), 1))
    d_lp = np.abs(np.asarray(sources["recompute"][0]) - out.logprobs)[real]
    d_ent = np.abs(np.asarray(sources["recompute"][1]) - out.entropies)[real]
    res.update(logp_diff_max=float(d_lp.max()), entropy_diff_max=float(d_ent.max()))
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="embedded,small")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--image-size", type=int, default=56)
    ap.add_argument("--min-pixels", type=int, default=56 * 56)
    ap.add_argument("--max-pixels", type=int, default=28 * 28 * 256)
    args = ap.parse_args(argv)
    args.iters, args.size, args.vocab = 0, "small", None
    import jax

    from jaxvrl import models

    print(
        f"# shaping_source bench {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC | "
        f"{platform.machine()}, {os.cpu_count()} cores | jax {jax.__version__} | "
        f"{jax.devices()[0].device_kind}\n# python {' '.join(sys.argv)}",
        flush=True,
    )
    tok, rows = rl_step.tokenizer_and_rows(args)
    print("\n| model | rollout dtype | tokens | perception agree | perception Jaccard | "
          "entropy agree | entropy Jaccard | max abs logp diff | max abs entropy diff |\n"
          "|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    for name in args.models.split(","):
        with tempfile.TemporaryDirectory() as ckpt:
            if name == "embedded":
                from jaxvrl.data.tasks import TASKS

                path = TASKS["shapes"].checkpoint
            else:
                rl_step.make_checkpoint(args, tok, ckpt)
                path = ckpt
            model = models.load(path)
            for dtype in ("float32", "bfloat16"):
                r = measure(args, model, tok, rows, dtype)
                print(
                    f"| {name} | {dtype} | {r['tokens']} | {r['perception_agree']:.4f} | "
                    f"{r['perception_jaccard']:.4f} | {r['entropy_agree']:.4f} | "
                    f"{r['entropy_jaccard']:.4f} | {r['logp_diff_max']:.2e} | "
                    f"{r['entropy_diff_max']:.2e} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
