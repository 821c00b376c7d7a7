"""One GRPO iteration side by side with the JAX peers: jaxvrl, tunix and EasyDeL.

An iteration: sample G completions for each of P prompts (temperature 1, up to N new tokens),
decode and score them with the built-in arithmetic task's reward (`accuracy`, jaxvrl's own
function, imported from this checkout by every side), a reference pass for the KL term, and one
AdamW step (lr 1e-5, gradients clipped to norm 1) on the GRPO loss over all P x G rows: clipped
ratio (epsilon 0.2; with one update the ratio is 1), low-variance KL (k3) with beta 0.04,
per-sequence token mean, then the mean over sequences. With one update no side runs an
old-policy pass (the old log-probs are the current ones, detached, or the sampler's).

The model is a random-weights Qwen3 (or Llama) that transformers makes and saves; each system
loads the directory through its own HF loader. The prompts are the built-in arithmetic task's
(`jaxvrl.data.arithmetic`: "What is a + b?" under its system prompt), rendered with the shipped
tokenizer's chat template: 56 tokens each, so no side pads them.

    python bench/peers.py                             # tiny Qwen3, all peers
    python bench/peers.py --peer tunix --size compute
    python bench/peers.py --peer easydel --family llama
    python bench/peers.py --peer none --unrolled      # jaxvrl alone, model.scan_layers=False
    python bench/peers.py --family qwen3_vl           # vision-language, tiny size only

EasyDeL runs twice: as shipped (its GRPOTrainer traces its compiled generate again every
step) and with that generate kept ("easydel, generate kept").

The vision-language case (`--family qwen3_vl`): a random tiny Qwen3-VL (the tiny text shape
under a 2-layer vision tower), saved with its image processor's settings; each prompt is the
arithmetic question after one 64 x 64 picture (`picture`, the same on every side), 2 prompts x
4 samples, 32 new tokens, 4 iterations. jaxvrl encodes the rows with its pipeline (its own
image processor) and samples as its trainer does (vision tokens suppressed); EasyDeL gets the
same prompts pretokenized by transformers' processor (ids checked equal), with their
`pixel_values` and `image_grid_thw`, the way its GRPOTrainer takes images. tunix has no Qwen-VL
family (0.1.7), so its row is that reason; EasyDeL 0.3.0's Qwen3-VL reads `image_grid_thw` with
numpy inside its jitted generate (a TracerArrayConversionError), so its row is that error
(bench/RESULTS.md).

Sizes: `tiny` (0.85M parameters over the shipped 448-row vocabulary: per-call overhead
dominates) and `compute` (Qwen3-0.6B's published shape, hidden 1024, 16 heads, 8 KV heads,
151,936-row tied vocabulary, with 4 of its 28 layers: 0.22B parameters, fewer rows and tokens:
compute dominates on a 2-core CPU).

Each peer runs in a virtualenv of its own that this script creates under bench/.venvs/<peer>
with pinned versions (`PINS`), jax on the CPU; the project's own environment runs the jaxvrl
side and builds the checkpoint, and is never installed into. Every side is a subprocess of this
script (`--side NAME --job FILE`), all with the same environment: one CPU device, XLA's CPU
runtime with one thread per core, float32.

Timing as in bench/rl_step.py: seconds per iteration, the median over the iterations after the
first (which compiles) and the first one separately; the process's CPU time per iteration; the
mean completion length (a random model rarely draws the end-of-sequence token, so every side
generates close to N tokens). Each side also times its parts (the profile): sampling, the
reference pass, the update and the host work (the rest: decoding, scoring, batching).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
VENVS = os.path.join(BENCH, ".venvs")

KL_COEF = 0.04
CLIP_EPS = 0.2
LR = 1e-5
SEED = 0

# Each peer's virtualenv: the peer and what it runs on, pinned to what pip resolved for it here
# (EasyDeL's kernels package needs jax ~0.9; its HF loader converts through torch, the CPU
# wheel); math-verify as in the project's environment, so `accuracy` does the same work.
PINS = {
    "tunix": [
        "google-tunix==0.1.7",
        "jax==0.10.2",
        "jaxlib==0.10.2",
        "flax==0.12.8",
        "optax==0.2.8",
        "transformers==5.12.1",
        "math-verify==0.9.0",
    ],
    "easydel": [
        "easydel==0.3.0",
        "eformer==0.0.99.12",
        "ejkernel==0.0.78",
        "jax==0.9.2",
        "jaxlib==0.9.2",
        "flax==0.12.3",
        "optax==0.2.8",
        "transformers==5.5.4",
        "torch==2.13.0",
        "pillow==13.0.0",  # imported by its inference engine, not declared
        "math-verify==0.9.0",
    ],
}
PEERS = tuple(PINS)

# (hidden, layers, heads, kv heads, head dim, intermediate, vocabulary)
SIZES = {
    "tiny": (128, 4, 4, 2, 32, 384, 448),
    # Qwen3-0.6B's published config with 4 of its 28 layers
    "compute": (1024, 4, 16, 8, 128, 3072, 151936),
}
# the default work per size: (prompts, samples per prompt, new tokens, iterations)
WORK = {"tiny": (2, 8, 64, 5), "compute": (1, 4, 32, 3)}
ROPE_THETA = {"qwen3": 1_000_000.0, "llama": 10_000.0, "qwen3_vl": 5_000_000.0}
TEXT_FAMILIES = ("qwen3", "llama")
# the vision-language case: the tiny text shape under Qwen3-VL's vision tower, sized down
# (depth, hidden, heads, intermediate, patch, merge, position embeddings, deepstack layers),
# with Qwen3-VL's interleaved multimodal rope split of a 32-wide head (6, 5, 5 of 16 pairs)
VL_FAMILIES = ("qwen3_vl",)
VISION = (2, 64, 2, 128, 16, 2, 64, (0, 1))
MROPE = (6, 5, 5)
VL_WORK = (2, 4, 32, 4)
IMAGE_SIDE = 64  # px: 4 x 4 patches of 16, 4 image tokens after the 2 x 2 merge
# the image processor's pixel limits: jaxvrl's EncodeOptions defaults, written into the
# checkpoint's preprocessor_config.json for the peer (a 64 x 64 picture keeps its size)
PIXELS = (56 * 56, 28 * 28 * 256)


# ----------------------------------------------------------------------------- shared helpers
def env_for_sides() -> dict:
    """The same process environment for every side: the CPU, one device, quiet logs."""
    env = dict(os.environ)
    env.update(
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_force_host_platform_device_count=1",
        TF_CPP_MIN_LOG_LEVEL="3",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        WANDB_MODE="disabled",
        PYTHONPATH=ROOT,
    )
    return env


def settings(package: str, job: dict, prompt_len: int, leaf, loss: str, layers="unrolled"):
    """A side's settings, printed beside its figures: its version, rows, tokens, dtype (of a
    parameter `leaf`), threads, devices, loss and layers."""
    import jax

    return dict(
        version=_version(package),
        jax=jax.__version__,
        flax=_version("flax"),
        rows=f"{job['prompts']} x {job['group']}",
        prompt_tokens=prompt_len,
        new_tokens=job["new_tokens"],
        dtype=str(leaf.dtype),
        threads=threads(),
        devices=len(jax.devices()),
        loss=loss,
        layers=layers,
    )


def threads() -> int:
    return len(os.sched_getaffinity(0))


def score(texts, answers) -> np.ndarray:
    """The built-in arithmetic task's reward: jaxvrl's `accuracy`, weight 1."""
    from jaxvrl.rl.rewards import accuracy_reward

    return np.asarray(accuracy_reward(list(texts), answer=list(answers)), np.float64)


def picture(side: int = IMAGE_SIDE):
    """The one image of every vision-language prompt: a fixed RGB gradient, `side` px square."""
    from PIL import Image

    y, x = np.mgrid[0:side, 0:side] * 255 // (side - 1)
    return Image.fromarray(np.stack([y, x, (x + y) // 2], -1).astype(np.uint8), "RGB")


def task_examples(job: dict, tok):
    """The built-in arithmetic task's rows (each with `picture()` for a vision-language
    family) encoded by jaxvrl's pipeline: the chat-rendered prompt's ids (and patches)."""
    from jaxvrl import models
    from jaxvrl.data import arithmetic
    from jaxvrl.data.pipeline import EncodeOptions, encode_rows

    rows = arithmetic.make_split("train", job["prompts"] * job["iters"], seed=SEED)
    processor = None
    if job["family"] in VL_FAMILIES:
        rows = [dict(r, images=[picture()]) for r in rows]
        processor = models.processor(models.load_config(job["ckpt"]))
    opts = EncodeOptions(
        processor=processor,
        system_prompt=arithmetic.SYSTEM_PROMPT,
        min_pixels=PIXELS[0],
        max_pixels=PIXELS[1],
    )
    examples, _ = encode_rows(rows, tok, opts, source="builtin:arithmetic")
    return examples


class Clock:
    """Wall and process CPU time per iteration, and named parts within one."""

    def __init__(self):
        self.times, self.cpu, self.lengths, self.parts, self.updates = [], [], [], [], []
        self._part: dict = {}

    def add(self, name: str, seconds: float) -> None:
        self._part[name] = self._part.get(name, 0.0) + seconds

    def start(self) -> None:
        self._t, self._c, self._part = time.perf_counter(), time.process_time(), {}

    def stop(self, side: str, length: float, updates: int) -> None:
        self.times.append(time.perf_counter() - self._t)
        self.cpu.append(time.process_time() - self._c)
        self.lengths.append(float(length))
        self.updates.append(int(updates))
        parts = dict(self._part)
        parts["host"] = self.times[-1] - sum(parts.values())
        self.parts.append(parts)
        split = ", ".join(f"{k} {v:.3f}" for k, v in parts.items())
        i = len(self.times) - 1
        print(f"  {side} iteration {i}: {self.times[-1]:.3f} s ({split}), "
              f"mean completion {length:.1f}, updates {updates}", flush=True)  # fmt: skip

    def result(self, settings: dict) -> dict:
        return dict(
            times=self.times,
            cpu=self.cpu,
            lengths=self.lengths,
            parts=self.parts,
            updates=self.updates,
            settings=settings,
        )


def timed(clock: Clock, name: str, fn, block=None):
    """fn wrapped: its wall time (after blocking on what `block` picks from its result)
    added to the clock's part `name`."""

    def wrapper(*a, **k):
        t = time.perf_counter()
        out = fn(*a, **k)
        if block is not None:
            import jax

            jax.block_until_ready(block(out))
        clock.add(name, time.perf_counter() - t)
        return out

    return wrapper


# ----------------------------------------------------------------------------- jaxvrl
def side_jaxvrl(job: dict) -> dict:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from transformers import AutoTokenizer

    from configs import base as base_config
    from jaxvrl.config import set_values
    from jaxvrl.data.pipeline import collate
    from jaxvrl.models import load
    from jaxvrl.sampling import Sampler, generation_config
    from jaxvrl.trainer.experience import experience
    from jaxvrl.trainer.rollout import assemble_prompts
    from jaxvrl.trainer.step import StepConfig, TrainState, make_train_step

    P, G, N = job["prompts"], job["group"], job["new_tokens"]
    tok = AutoTokenizer.from_pretrained(job["ckpt"])
    model = load(job["ckpt"], scan_layers=job.get("scan_layers", True))
    mcfg = model.config
    examples = task_examples(job, tok)
    # as the trainer's rollout samples: a vision-language model's image/video pads and vision
    # start/end tokens suppressed (none for a text model)
    scfg = generation_config(
        mcfg,
        max_new_tokens=N,
        temperature=1.0,
        eos_token_ids=(job["eos_id"],),
        pad_token_id=job["pad_id"],
    )
    sampler = Sampler(nnx.graphdef(model), scfg)
    values = {
        "rollout.num_generations": G,
        "prompts_per_step": P,
        "actor.global_batch_size": P,  # one update per rollout batch
        "actor.old_logprobs": "sampler",
        "actor.loss_agg_mode": "seq-mean-token-mean",
        "actor.use_kl_loss": True,
        "actor.kl_loss_coef": KL_COEF,
        "actor.kl_loss_type": "low_var_kl",
        "actor.clip_ratio_low": CLIP_EPS,
        "actor.clip_ratio_high": CLIP_EPS,
    }
    step_cfg = StepConfig.of(set_values(base_config.get_config(), values))
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(LR, weight_decay=0.0))
    graphdef, params = nnx.split(model, nnx.Param)
    ref_params = jax.tree.map(jnp.array, params)
    state = TrainState(params, tx.init(params), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))
    train_step = make_train_step(graphdef, tx, step_cfg)
    rng = jax.random.key(SEED)
    kept: dict = {}
    clock = Clock()
    prompt_len = 0
    for i in range(job["iters"]):
        clock.start()
        batch = collate(examples[i * P : (i + 1) * P], G, mcfg, tok,
                        prompt_bucket=job["prompt_len"], with_pools=False)  # fmt: skip
        prompt_len = batch["input_ids"].shape[1]
        rng, k_sample, k_step = jax.random.split(rng, 3)
        t = time.perf_counter()
        kept["w"] = sampler.decode_weights(state.params, P * G, reuse=kept.pop("w", None))
        out = sampler(
            state.params,
            jnp.asarray(batch["input_ids"]),
            jnp.asarray(batch["attention_mask"]),
            jnp.asarray(batch["position_ids"]),
            jnp.asarray(batch["deltas"]),
            k_sample,
            images=None if batch["images"] is None else jax.tree.map(jnp.asarray, batch["images"]),
            decode_weights=kept["w"],
        )
        tokens, mask = np.asarray(out.tokens), np.asarray(out.mask)
        clock.add("sample", time.perf_counter() - t)
        texts = [tok.decode(r[: int(m.sum())].tolist(), skip_special_tokens=True)
                 for r, m in zip(tokens, mask)]  # fmt: skip
        rewards = score(texts, [r["answer"] for r in batch["rows"]])
        rb = jax.tree.map(jnp.asarray, assemble_prompts(batch, tokens, mask, rewards,
                                                        old_logprobs=out.logprobs))  # fmt: skip
        t = time.perf_counter()
        state, _, _ = train_step(state, ref_params, rb, k_step)
        jax.block_until_ready(state.params)
        clock.add("step", time.perf_counter() - t)
        clock.stop("jaxvrl", mask.sum(1).mean(), int(state.step))

    # the profile: the step's experience phase (the reference pass here) on its own, so that
    # the update's share is the step's time less it
    def exp_only(state, ref_params, batch, rng):
        rows_only = batch.replace(update_starts=None, update_rows=None)
        return experience(graphdef, state, ref_params, rows_only, rng, step_cfg).rows

    exp_fn = jax.jit(exp_only)
    jax.block_until_ready(exp_fn(state, ref_params, rb, k_step))
    ref_times = []
    for _ in range(3):
        t = time.perf_counter()
        jax.block_until_ready(exp_fn(state, ref_params, rb, k_step))
        ref_times.append(time.perf_counter() - t)
    ref_s = statistics.median(ref_times)
    for parts in clock.parts:
        parts["reference"] = min(ref_s, parts["step"])
        parts["update"] = parts.pop("step") - parts["reference"]
    return clock.result(
        settings(
            "jaxvrl", job, prompt_len, jax.tree.leaves(state.params)[0],
            f"GRPO, clip {CLIP_EPS}, low_var_kl {KL_COEF}, seq-mean-token-mean",
            layers="scan" if job.get("scan_layers", True) else "unrolled",
        )
    )  # fmt: skip


# ----------------------------------------------------------------------------- tunix
def side_tunix(job: dict) -> dict:
    import jax
    import optax
    from flax import nnx
    from transformers import AutoTokenizer
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout
    from tunix.sft import metrics_logger

    P, G, N = job["prompts"], job["group"], job["new_tokens"]
    tok = AutoTokenizer.from_pretrained(job["ckpt"])
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    policy, ref = (tunix_model(job, mesh) for _ in range(2))  # the reference: its own copy
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(LR, weight_decay=0.0))
    workdir = tempfile.mkdtemp(prefix="tunix_bench_")
    rollout = base_rollout.RolloutConfig(
        max_tokens_to_generate=N,
        max_prompt_length=job["prompt_len"],
        kv_cache_size=job["prompt_len"] + N,
        temperature=1.0,
        top_p=1.0,
        top_k=None,
        eos_tokens=[job["eos_id"]],
        seed=SEED,
    )
    cluster_config = rl_cluster_lib.ClusterConfig(
        role_to_mesh={r: mesh for r in rl_cluster_lib.Role},
        rollout_engine="vanilla",
        offload_to_cpu=False,
        training_config=rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=tx,
            eval_every_n_steps=10**9,
            max_steps=job["iters"],
            mini_batch_size=P,
            train_micro_batch_size=P,
            metrics_logging_options=metrics_logger.MetricsLoggerOptions(
                log_dir=os.path.join(workdir, "logs"), flush_every_n_steps=10**9
            ),
            pbar_description=None,
        ),
        rollout_config=rollout,
    )
    cluster = rl_cluster_lib.RLCluster(
        actor=policy, reference=ref, tokenizer=tok, cluster_config=cluster_config
    )
    algo = grpo_learner.GRPOConfig(
        num_generations=G,
        num_iterations=1,
        beta=KL_COEF,
        epsilon=CLIP_EPS,
        kl_loss_mode="low_var_kl",
        loss_agg_mode="sequence-mean-token-mean",
    )

    def accuracy(prompts, completions, answer, **_):
        return list(score(completions, answer))

    learner = grpo_learner.GRPOLearner(rl_cluster=cluster, algo_config=algo, reward_fns=[accuracy])
    clock = Clock()
    lengths: list = []
    calls = {"n": 0}
    generate = cluster.generate

    def generate_fresh(*a, **k):  # a new seed per call (the config's stays fixed otherwise)
        rollout.seed = SEED + calls["n"]
        calls["n"] += 1
        out = generate(*a, **k)
        lengths.append(np.mean([len(t) for t in out.tokens]))
        return out

    cluster.generate = timed(clock, "sample", generate_fresh)
    cluster.get_ref_per_token_logps = timed(
        clock, "reference", cluster.get_ref_per_token_logps, block=lambda x: x
    )
    actor_state = lambda: nnx.state(cluster.actor_trainer.model, nnx.Param)  # noqa: E731
    cluster.update_actor = timed(
        clock, "update", cluster.update_actor, block=lambda _: actor_state()
    )
    run_global_step = learner._run_global_step

    def global_step(*a, **k):  # one iteration: P prompts x G samples, one update
        clock.start()
        out = run_global_step(*a, **k)
        jax.block_until_ready(actor_state())
        clock.stop("tunix", lengths[-1], cluster.actor_trainer.train_steps)
        return out

    learner._run_global_step = global_step
    data = [
        {
            # numpy arrays: tunix repeats each leaf of a batch G times (a list's strings would
            # each become a leaf)
            "prompts": np.array(job["prompt_texts"][i * P : (i + 1) * P]),
            "answer": np.array(job["answers"][i * P : (i + 1) * P]),
        }
        for i in range(job["iters"])
    ]
    ids = tok(job["prompt_texts"][0], add_special_tokens=True)["input_ids"]
    assert ids == job["prompt_ids"][0], "tunix's tokenizer gives other prompt ids"
    learner.train(data)
    p0 = jax.tree.leaves(actor_state())[0]
    loss = f"GRPO, clip {algo.epsilon}, {algo.kl_loss_mode} {algo.beta}, {algo.loss_agg_mode}"
    return clock.result(settings("google-tunix", job, job["prompt_len"], p0, loss))


def tunix_model(job: dict, mesh):
    """The checkpoint through tunix's safetensors loader, its model config from config.json."""
    with open(os.path.join(job["ckpt"], "config.json")) as f:
        hf = json.load(f)
    if hf["model_type"] == "qwen3":
        from tunix.models.qwen3 import model as model_lib
        from tunix.models.qwen3 import params as params_lib

        tied = {"use_tied_embedding": hf["tie_word_embeddings"]}
    elif hf["model_type"] == "llama":
        from tunix.models.llama3 import model as model_lib
        from tunix.models.llama3 import params as params_lib

        tied = {"weight_tying": hf["tie_word_embeddings"]}  # llama3's name for it
    else:
        raise SystemExit(f"tunix: no model of type {hf['model_type']!r} here")
    cfg = model_lib.ModelConfig(
        num_layers=hf["num_hidden_layers"],
        vocab_size=hf["vocab_size"],
        embed_dim=hf["hidden_size"],
        hidden_dim=hf["intermediate_size"],
        num_heads=hf["num_attention_heads"],
        head_dim=hf["head_dim"],
        num_kv_heads=hf["num_key_value_heads"],
        rope_theta=int(hf["rope_parameters"]["rope_theta"]),
        norm_eps=hf["rms_norm_eps"],
        **tied,
    )
    with mesh:
        return params_lib.create_model_from_safe_tensors(job["ckpt"], cfg, mesh)


# ----------------------------------------------------------------------------- EasyDeL
def side_easydel(job: dict) -> dict:
    import easydel as ed
    import jax
    import jax.numpy as jnp
    from datasets import Dataset
    from transformers import AutoTokenizer

    P, G, N = job["prompts"], job["group"], job["new_tokens"]
    tok = AutoTokenizer.from_pretrained(job["ckpt"], padding_side="left")
    vl = job["family"] in VL_FAMILIES
    auto = ed.AutoEasyDeLModelForImageTextToText if vl else ed.AutoEasyDeLModelForCausalLM
    # HF safetensors go through its torch converter (from_torch); one device, no sharding
    model = auto.from_pretrained(
        job["ckpt"],
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        sharding_axis_dims=(1, 1, 1, 1, 1),
        from_torch=True,
        verbose=False,
    )
    with open(os.path.join(job["ckpt"], "config.json")) as f:
        hf = json.load(f)
    vocab = hf.get("text_config", hf)["vocab_size"]
    workdir = tempfile.mkdtemp(prefix="easydel_bench_")
    args = ed.GRPOConfig(
        save_directory=workdir,
        max_prompt_length=job["prompt_len"],
        max_completion_length=N,
        num_generations=G,
        total_batch_size=P,
        max_training_steps=job["iters"],
        num_train_epochs=1,
        learning_rate=LR,
        optimizer="adamw",
        scheduler="none",
        weight_decay=0.0,
        clip_grad=1.0,
        beta=KL_COEF,
        epsilon=CLIP_EPS,
        loss_type="grpo",
        temperature=1.0,
        top_p=1.0,
        # `generation_top_k or 64`: 0 means 64, so the whole vocabulary stands for "no top-k"
        generation_top_k=vocab,
        skip_apply_chat_template=True,  # the prompts are rendered already
        # its default engine (eSurge) reserves a 4 GiB KV page pool and was killed for memory
        # at its first generation here (see RESULTS.md): the compiled `generate` instead
        use_esurge_generation=False,
        shuffle_train_dataset=False,
        do_last_save=False,
        save_steps=None,
        use_wandb=False,
        report_metrics=False,
        log_steps=10**9,
        progress_bar_type="json",
    )
    if vl:  # prompts tokenized by transformers' processor, with their patches
        tok = easydel_processor(job["ckpt"], tok)
        data = Dataset.from_list(easydel_image_rows(job, tok))
    else:
        data = Dataset.from_list(
            [{"prompt": t, "answer": a} for t, a in zip(job["prompt_texts"], job["answers"])]
        )

    # its batches keep no text columns for the reward functions: each prompt's answer is found
    # by the question the prompt holds
    by_question = dict(zip(job["questions"], job["answers"]))

    def answer_of(prompt) -> str:
        text = prompt if isinstance(prompt, str) else json.dumps(prompt)
        return next(a for q, a in by_question.items() if q in text)

    def accuracy(prompts, completions, **_):
        return list(score(completions, [answer_of(p) for p in prompts]))

    trainer = ed.GRPOTrainer(
        arguments=args,
        model=model,
        reward_funcs=[accuracy],
        train_dataset=data,
        processing_class=tok,
    )
    clock = Clock()
    generate = trainer.generate_unified
    if job.get("keep_generate"):  # its default drops the compiled generate after each step

        def generate(*a, _generate=generate, **k):
            return _generate(*a, **{**k, "release_runtime_after_generation": False})

    trainer.generate_unified = timed(clock, "sample", generate, block=lambda r: r.sequences)
    trainer.compute_refmodel_logps = timed(
        clock, "reference", trainer.compute_refmodel_logps, block=lambda x: x
    )
    trainer.sharded_training_step_function = timed(
        clock, "update", trainer.sharded_training_step_function, block=lambda x: x
    )
    execute = trainer._execute_train_step
    steps = {"n": 0}

    def one_iteration(state, batch):
        clock.start()
        state, metrics, exc = execute(state, batch)
        if exc is None:
            steps["n"] += 1
            info = metrics.other_metrics or {}
            clock.stop("easydel", float(info.get("completion_length", float("nan"))), steps["n"])
        return state, metrics, exc

    trainer._execute_train_step = one_iteration
    trainer.train()
    p0 = jax.tree.leaves(trainer.model_state.graphstate)[0]
    loss = f"GRPO ({args.loss_type}), clip {args.epsilon}, k3 KL {args.beta}, seq-mean-token-mean"
    return clock.result(settings("easydel", job, job["prompt_len"], p0, loss))


def easydel_processor(ckpt: str, tok):
    """transformers' Qwen3-VL processor over the checkpoint's image processor settings (the PIL
    image processor: the torchvision one and the video processor need torchvision, which the
    CPU torch pin does not bring) and the tokenizer `tok`."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    class ImageTextProcessor(Qwen3VLProcessor):
        def check_argument_for_proper_class(self, name, arg):  # no video processor
            if name != "video_processor":
                return super().check_argument_for_proper_class(name, arg)

    images = Qwen2VLImageProcessorPil.from_pretrained(ckpt)
    return ImageTextProcessor(image_processor=images, tokenizer=tok, video_processor=None)


def easydel_image_rows(job: dict, processor) -> list[dict]:
    """One pretokenized row per prompt, as its GRPO trainer takes images (a dataset with
    `input_ids`, `attention_mask` and the model's inputs `pixel_values`, `image_grid_thw`):
    the rendered prompt text and `picture()` through the processor, checked equal to the ids
    jaxvrl's pipeline gives."""
    rows = []
    for text, ids in zip(job["prompt_texts"], job["prompt_ids"]):
        enc = processor(text=[text], images=[picture()], return_tensors="np")
        assert enc["input_ids"][0].tolist() == ids, "the processor gives other prompt ids"
        rows.append(
            dict(
                input_ids=enc["input_ids"][0],
                attention_mask=enc["attention_mask"][0],
                pixel_values=enc["pixel_values"],
                image_grid_thw=enc["image_grid_thw"],
            )
        )
    return rows


# ----------------------------------------------------------------------------- the driver
SIDES = {"jaxvrl": side_jaxvrl, "tunix": side_tunix, "easydel": side_easydel}


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "?"


def venv_python(peer: str) -> str:
    """The peer's virtualenv, created (or brought to the pins) first: `python -m venv`, then
    pip installs the pins into it, never into the environment running this script."""
    path = os.path.join(VENVS, peer)
    python = os.path.join(path, "bin", "python")
    stamp = os.path.join(path, "pins.txt")
    want = "\n".join(PINS[peer]) + "\n"
    if os.path.exists(stamp) and open(stamp).read() == want:
        return python
    print(f"# creating {os.path.relpath(path, ROOT)}: {' '.join(PINS[peer])}", flush=True)
    if not os.path.exists(python):
        subprocess.run([sys.executable, "-m", "venv", path], check=True)
    pip = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run(pip + PINS[peer], check=True)
    with open(stamp, "w") as f:
        f.write(want)
    return python


def make_checkpoint(family: str, size: str, path: str) -> int:
    """A random-weights checkpoint made by transformers over the shipped tokenizer."""
    import shutil

    import torch
    import transformers

    from jaxvrl.data.prompts import default_tokenizer_path

    hidden, layers, heads, kv, head_dim, inter, vocab = SIZES[size]
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        rms_norm_eps=1e-6,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=2,
        pad_token_id=0,
        bos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA[family]},
    )
    torch.manual_seed(SEED)
    if family == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
    elif family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif family == "qwen3_vl":
        model = transformers.Qwen3VLForConditionalGeneration(qwen3_vl_config(common))
    else:
        raise SystemExit(f"no checkpoint maker for {family!r}")
    model.save_pretrained(path)
    tok_dir = default_tokenizer_path()
    for name in os.listdir(tok_dir):
        shutil.copy(os.path.join(tok_dir, name), os.path.join(path, name))
    if family in VL_FAMILIES:  # the image processor's settings (transformers' PIL processor)
        patch, merge = VISION[4:6]
        pre = dict(
            image_processor_type="Qwen2VLImageProcessor",
            processor_class="Qwen3VLProcessor",
            patch_size=patch,
            merge_size=merge,
            temporal_patch_size=2,
            image_mean=[0.5] * 3,
            image_std=[0.5] * 3,
            size={"shortest_edge": PIXELS[0], "longest_edge": PIXELS[1]},
        )
        with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
            json.dump(pre, f, indent=2)
    return sum(p.numel() for p in model.parameters())


def qwen3_vl_config(text: dict):
    """Qwen3-VL's config over the text settings `text` (the tiny shape) and `VISION`, with
    the shipped tokenizer's image/video pad and vision start/end ids."""
    import transformers

    from jaxvrl.data.prompts import default_tokenizer_path, special_token_ids

    sp = special_token_ids(transformers.AutoTokenizer.from_pretrained(default_tokenizer_path()))
    depth, vh, vheads, vinter, patch, merge, npos, deepstack = VISION
    rope = dict(text["rope_parameters"], mrope_section=list(MROPE), mrope_interleaved=True)
    return transformers.Qwen3VLConfig(
        text_config=dict(text, rope_parameters=rope),
        vision_config=dict(
            depth=depth,
            hidden_size=vh,
            num_heads=vheads,
            intermediate_size=vinter,
            out_hidden_size=text["hidden_size"],
            patch_size=patch,
            spatial_merge_size=merge,
            temporal_patch_size=2,
            num_position_embeddings=npos,
            deepstack_visual_indexes=list(deepstack),
        ),
        image_token_id=sp["image_token_id"],
        video_token_id=sp["video_token_id"],
        vision_start_token_id=sp["vision_start_token_id"],
        vision_end_token_id=sp["vision_end_token_id"],
        tie_word_embeddings=text["tie_word_embeddings"],
    )


def make_job(args, ckpt: str) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    job = dict(
        ckpt=ckpt,
        family=args.family,
        prompts=args.prompts,
        group=args.group,
        new_tokens=args.new_tokens,
        iters=args.iters,
    )
    examples = task_examples(job, tok)
    ids = [list(map(int, e["prompt_ids"])) for e in examples]
    return dict(
        job,
        prompt_ids=ids,
        prompt_texts=[e["prompt_text"] for e in examples],
        answers=[e["answer"] for e in examples],
        questions=[e["problem"] for e in examples],
        prompt_len=max(map(len, ids)),
        eos_id=tok.eos_token_id,
        pad_id=tok.pad_token_id,
        scan_layers=not args.unrolled,
    )


def run_side(name: str, python: str, job_path: str, out_dir: str, timeout: int) -> dict:
    out = os.path.join(out_dir, f"{name}_{os.path.basename(job_path)}")
    cmd = [python, os.path.abspath(__file__), "--side", name, "--job", job_path, "--out", out]
    print(f"# {name}: {' '.join(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c for c in cmd[:2])}",
          flush=True)  # fmt: skip
    try:
        proc = subprocess.run(cmd, env=env_for_sides(), cwd=ROOT, timeout=timeout,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    except subprocess.TimeoutExpired:
        return dict(error=f"timed out after {timeout} s")
    keep = [ln for ln in proc.stdout.splitlines() if ln.startswith("  ") and "iteration" in ln]
    for ln in keep:
        print(ln, flush=True)
    if proc.returncode or not os.path.exists(out):
        tail = [ln for ln in proc.stdout.splitlines() if ln.strip()][-25:]
        print("\n".join(f"  | {ln}" for ln in tail), flush=True)
        # the last exception line ("NameError: ..."), else the last line that names an error;
        # for an error in tracing, the argument whose value it needed
        raised = [i for i, ln in enumerate(tail) if re.match(r"[\w.]+(Error|Exception): ", ln)]
        named = [ln for ln in tail if "Error" in ln or "error" in ln]
        if not raised:
            return dict(error=(named or tail[-1:] or ["no output"])[-1])
        i = raised[-1]
        traced = re.search(r"value of the argument (.+?)\.?$", " ".join(tail[i + 1 : i + 2]))
        return dict(error=tail[i] + (f" (in tracing: {traced[1]})" if traced else ""))
    with open(out) as f:
        return json.load(f)


def summary(xs: list[float]) -> tuple[float, float]:
    """(the first, the median of the others)."""
    return xs[0], statistics.median(xs[1:] or xs)


def print_tables(results: dict) -> None:
    print("\n| side | version (jax) | rows P x G | prompt + new tokens | updates / iteration "
          "| dtype | threads | first iteration s | s / iteration | CPU s / iteration "
          "| mean completion |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        if "error" in r:
            print(f"| {name} | failed: {r['error'][:300]} |||||||||")
            continue
        s = r["settings"]
        ups = np.diff([0] + r["updates"])
        first, med = summary(r["times"])
        print(
            f"| {name} | {s['version']} ({s['jax']}) | {s['rows']} | {s['prompt_tokens']} + "
            f"{s['new_tokens']} | {int(np.median(ups))} | {s['dtype']} | {s['threads']} | "
            f"{first:.3f} | {med:.3f} | {summary(r['cpu'])[1]:.3f} | "
            f"{np.mean(r['lengths']):.1f} |"
        )
    print("\n| side | loss | layers | sample s | reference s | update s | host s |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        if "error" in r:
            continue
        rest = r["parts"][1:] or r["parts"]
        med = {k: statistics.median(p.get(k, 0.0) for p in rest) for k in rest[0]}
        s = r["settings"]
        print(
            f"| {name} | {s['loss']} | {s['layers']} | {med.get('sample', 0):.3f} | "
            f"{med.get('reference', 0):.3f} | {med.get('update', 0):.3f} | "
            f"{med.get('host', 0):.3f} |"
        )
    ok = {k: v for k, v in results.items() if "error" not in v}
    if "jaxvrl" in ok:
        jx = summary(ok["jaxvrl"]["times"])[1]
        for name, r in ok.items():
            if name != "jaxvrl":
                ratio = jx / summary(r["times"])[1]
                cpu = summary(ok["jaxvrl"]["cpu"])[1] / summary(r["cpu"])[1]
                print(f"\njaxvrl / {name} time per iteration: {ratio:.2f}x (CPU time {cpu:.2f}x)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peer", default="all", choices=["all", "none", *PEERS])
    ap.add_argument("--size", default="tiny", choices=sorted(SIZES))
    ap.add_argument(
        "--family",
        default="qwen3",
        choices=[*TEXT_FAMILIES, *VL_FAMILIES],
        help="qwen3_vl: a vision-language case, one image per prompt (tiny size only)",
    )
    ap.add_argument("--prompts", type=int, default=None, help="prompts per iteration (P)")
    ap.add_argument("--group", type=int, default=None, help="completions per prompt (G)")
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--iters", type=int, default=None, help="iterations (the first compiles)")
    ap.add_argument("--unrolled", action="store_true", help="jaxvrl: model.scan_layers=False")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per side")
    ap.add_argument("--setup-only", action="store_true", help="create the virtualenvs, no run")
    ap.add_argument("--side", choices=sorted(SIDES), help=argparse.SUPPRESS)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.side:  # a worker: one side's iterations, in its own environment
        sys.path.insert(0, ROOT)
        with open(args.job) as f:
            job = json.load(f)
        result = SIDES[args.side](job)
        with open(args.out, "w") as f:
            json.dump(result, f)
        return

    vl = args.family in VL_FAMILIES
    if vl and args.size != "tiny":
        raise SystemExit(f"--family {args.family}: tiny size only (--size {args.size} asked)")
    peers = list(PEERS) if args.peer == "all" else [] if args.peer == "none" else [args.peer]
    pythons = {p: venv_python(p) for p in peers}
    if args.setup_only:
        return
    d = dict(zip(("prompts", "group", "new_tokens", "iters"), VL_WORK if vl else WORK[args.size]))
    for k, v in d.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    sys.path.insert(0, ROOT)
    import jax

    print(
        f"# peers bench {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC | "
        f"{platform.machine()}, {os.cpu_count()} cores, {threads()} threads | "
        f"load average {os.getloadavg()[0]:.1f}\n# python {' '.join(sys.argv)}",
        flush=True,
    )
    results = {}
    with tempfile.TemporaryDirectory(prefix="peers_bench_") as tmp:
        ckpt = os.path.join(tmp, f"{args.family}_{args.size}")
        n = make_checkpoint(args.family, args.size, ckpt)
        job = make_job(args, ckpt)
        job_path = os.path.join(tmp, "job.json")
        with open(job_path, "w") as f:
            json.dump(job, f)
        vision = ""
        if vl:
            vision = (f", vision tower {VISION[:4]} depth/hidden/heads/intermediate, one "
                      f"{IMAGE_SIDE}x{IMAGE_SIDE} image per prompt")  # fmt: skip
        print(
            f"# model: random {args.family} {args.size} ({n / 1e6:.2f}M params, "
            f"{SIZES[args.size]} hidden/layers/heads/kv/head_dim/intermediate/vocab{vision}), "
            f"P={args.prompts} x G={args.group} rows, {job['prompt_len']} prompt + "
            f"{args.new_tokens} new tokens, {args.iters} iterations, float32, one update, "
            f"project env jax {jax.__version__}",
            flush=True,
        )
        results["jaxvrl"] = run_side("jaxvrl", sys.executable, job_path, tmp, args.timeout)
        for p in peers:
            if p == "tunix" and vl:  # its model families (0.1.7): Gemma, Gemma 3/4, Llama 3, ...
                results[p] = dict(error=f"tunix {PINS[p][0].split('==')[1]} has no Qwen-VL "
                                        "family (Gemma, Gemma 3/4, Llama 3, Qwen2, Qwen3)")  # fmt: skip
                continue
            results[p] = run_side(p, pythons[p], job_path, tmp, args.timeout)
            if p == "easydel" and "error" not in results[p]:  # and with its generate kept
                kept = os.path.join(tmp, "job_keep.json")
                with open(kept, "w") as f:
                    json.dump(dict(job, keep_generate=True), f)
                results["easydel, generate kept"] = run_side(p, pythons[p], kept, tmp, args.timeout)
    print_tables(results)


if __name__ == "__main__":
    main()
