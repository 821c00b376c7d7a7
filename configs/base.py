"""Base config: every option, with its default (what each RL option does: docs/algorithms.md).

The defaults are the embedded default: a tiny Qwen2.5-VL checkpoint shipped in the package and
the built-in visual task, short completions, small batches, so a 2-core CPU finishes a run in
minutes. A real run sets at least the model and the data:

    python -m jaxvrl.train --config configs/grpo.py \
        --config.model.path=/ckpt/Qwen2.5-VL-3B-Instruct \
        --config.data.train_files=train.jsonl --config.data.val_files=val.jsonl \
        --config.data.image_dir=images --config.workdir=gs://bucket/runs/grpo-3b

`--config configs/X.py:runlocal` shrinks any config further (2 steps, 2 prompts x 2
completions of 8 tokens) for smoke tests, big_vision style.

Each key is declared once: `c.key = setting(default, rules...)  # what it does`; the rules
(jaxvrl/config.py) are checked before a run loads anything, naming the key that breaks one.
A key without `setting` is checked by its type alone.
"""

import math
import os
import re

import ml_collections
from ml_collections.config_dict import placeholder

from jaxvrl import models
from jaxvrl.config import (
    CAP,
    COUNT,
    FRACTION,
    NON_EMPTY,
    NON_NEGATIVE,
    POSITIVE,
    PROBABILITY,
    AutoOr,
    Each,
    Range,
    agree,
    at_least,
    increasing,
    one_of,
    ordered,
    parse_arg,
    reward_metric_rule,
    reward_names_rule,
    setting,
)
from jaxvrl.data.synthetic import QUESTIONS
from jaxvrl.data.tasks import TASKS
from jaxvrl.logging.trackers import backends_rule
from jaxvrl.models.attention import IMPLEMENTATIONS
from jaxvrl.models.config import REMAT_POLICIES
from jaxvrl.models.lora import QTYPES
from jaxvrl.rl.advantages import ESTIMATORS
from jaxvrl.rl.attention import LAYER_SETS
from jaxvrl.rl.losses import AGG_MODES, KL_CONTROLLERS, KL_KINDS
from jaxvrl.rl.masks import ENTROPY_SCOPES
from jaxvrl.rl.rewards import reward_kwargs_error
from jaxvrl.sampling.layout import DTYPES as ROLLOUT_DTYPES
from jaxvrl.trainer.build import SCHEDULES
from jaxvrl.trainer.setup import MATMUL_PRECISIONS
from jaxvrl.trainer.state import OLD_LOGPROBS, ROLLOUT_IS

# Rules that several keys share, or that read other keys.
REWARD_KWARGS = agree(
    lambda v, c: reward_kwargs_error(v) is None, "a Python dict literal, e.g. \"{'k': 0.5}\""
)
MESH_AXIS = agree(lambda v, c: v == -1 or v >= 1, "-1 (the rest of the devices) or >= 1")


def ONE_REST(v, c):  # noqa: N802 -- a rule, named like the others
    rest = [k for k, x in (("data", c.mesh.data), ("fsdp", c.mesh.fsdp), ("tensor", v)) if x == -1]
    if len(rest) <= 1:
        return None
    return f"at most one of mesh.data, mesh.fsdp, mesh.tensor set to -1 (-1: mesh.{', mesh.'.join(rest)})"


RECOMPUTED = agree(
    lambda v, c: c.actor.old_logprobs == "recompute",
    "null unless actor.old_logprobs=recompute (it weighs the recomputed old log-probs "
    "against the sampler's)",
)
DIVIDES_PROMPTS = agree(
    lambda v, c: c.prompts_per_step % v == 0,
    "a divisor of prompts_per_step (the rollout batch splits into whole mini-batches)",
)
PRESET = agree(
    lambda v, c: v.lower() in models.preset_names(),
    "a published config: " + ", ".join(models.preset_names()),
)


def get_config(arg=None):
    arg = parse_arg(arg, runlocal=False)
    c = ml_collections.ConfigDict()
    # the run's name: printed at start, stored in <workdir>/run.json
    c.name = setting("base", NON_EMPTY)
    # data order, built-in task, LoRA / critic init, sampling
    c.seed = setting(0, Range(0, 2**63, hi_open=True))
    c.workdir = placeholder(str)  # None: runs/<config>-<YYYYmmdd-HHMMSS>; gs:// allowed
    # continue from the latest checkpoint in workdir (False: a fresh run, refused where
    # workdir holds an earlier run's checkpoints, which its own would not replace)
    c.resume = True
    # <workdir>/checkpoints/<step> of another run: start from its parameters (fresh optimizer,
    # step 0; also the reference, but with LoRA the base model stays the reference); ignored
    # when workdir has a checkpoint to resume
    c.load_checkpoint_path = setting(
        None,
        agree(
            lambda v, c: os.path.basename(v.rstrip("/")).isdigit(),
            "<dir>/<step>, e.g. runs/x/checkpoints/40",
        ),
        type=str,
    )
    # training (rollout) steps; the cosine schedule ends here
    c.total_steps = setting(60, at_least(1))
    # prompts per step; rows = prompts_per_step * num_generations
    c.prompts_per_step = setting(8, Range(1, 2**31 - 1))
    c.val_freq = setting(20, NON_NEGATIVE)  # validate every this many steps (and at the last step)
    c.val_before_train = True  # validate at step 0
    # validate and exit (needs held-out rows: data.val_files, or val_size > 0 with the built-in
    # task)
    c.val_only = setting(
        False,
        agree(
            lambda v, c: (
                not v or bool(c.data.val_files) or (c.val_size > 0 and not c.data.train_files)
            ),
            "false unless there are held-out rows (data.val_files, or val_size > 0 and no "
            "data.train_files)",
        ),
    )
    c.val_size = setting(96, NON_NEGATIVE)  # held-out prompts of the built-in task (0: none)
    c.save_freq = setting(20, NON_NEGATIVE)  # checkpoint every this many steps (0: only at the end)
    c.max_to_keep = setting(2, at_least(1))  # checkpoints kept in workdir/checkpoints
    # stop after this many consecutive non-finite updates
    c.max_nonfinite_steps = setting(10, at_least(1))
    c.log_rollouts_every = setting(5, NON_NEGATIVE)  # steps between entries of the markdown logs
    c.log_samples = setting(8, NON_NEGATIVE)  # samples per markdown entry
    # save and stop cleanly after this many seconds; 0 = no limit
    c.time_budget_s = setting(0, NON_NEGATIVE)

    # where the scalars, the config and the rollout samples go besides metrics.jsonl and the
    # markdown logs (README "What a run writes")
    c.logging = ml_collections.ConfigDict()
    # comma-separated: console (progress line), tensorboard (<workdir>/tb), wandb, mlflow
    c.logging.backends = setting("console,tensorboard", backends_rule)
    c.logging.project = setting("jaxvrl", NON_EMPTY)  # wandb project / MLflow experiment
    # the trackers' run name; None: <name>-<the workdir's basename>
    c.logging.run_name = placeholder(str)
    # logged rollouts drawn as attention heatmaps and coloured tokens at log_rollouts_every
    # (PNGs under <workdir>/attention, TensorBoard images; needs matplotlib); 0 = off. Its cost
    # on the embedded default: bench/RESULTS.md ("Attention pictures")
    c.logging.attention_samples = setting(2, NON_NEGATIVE)

    c.model = ml_collections.ConfigDict()
    # HF checkpoint: a directory (local or gs://) or a Hub name org/name[@revision]; None = the
    # embedded tiny checkpoint of data.builtin_task
    c.model.path = setting(
        None, agree(lambda v, c: bool(v), "a path or a Hub name (null: the embedded one)"), type=str
    )
    # a published config without weights (qwen2.5-vl-3b | 7b | 32b | 72b): shapes for
    # `python -m jaxvrl.aot` only; training needs model.path
    c.model.preset = setting(None, PRESET, type=str)
    c.model.dtype = setting("float32", one_of(*models.DTYPES))  # compute dtype: float32 | bfloat16
    # master weights (float32 with bfloat16 compute)
    c.model.param_dtype = setting("float32", one_of(*models.DTYPES))
    # gradient checkpointing of every decoder layer and vision block: none | full |
    # dots_saveable | dots_with_no_batch_dims_saveable (docs/scaling.md: full beyond toy sizes)
    c.model.remat_policy = setting("none", one_of(*REMAT_POLICIES))
    # decoder layers and vision blocks stacked on a leading layer axis and run by a scan, so
    # the layer program compiles once (docs/scaling.md); False: unrolled, the same outputs.
    # Part of the param tree: a checkpoint resumes only with the value it was saved with
    c.model.scan_layers = True
    # attention of the forward passes without a KV cache (train step, scoring, the vision
    # tower): auto | xla | flash | splash | cudnn. auto follows the mesh's devices: splash on
    # TPUs, flash on GPUs, xla (dense) on the CPU; see jaxvrl/models/attention.py
    c.model.attention = setting("auto", one_of("auto", *IMPLEMENTATIONS))
    # with mesh.expert > 1: the (token, expert) pairs each device sends each device, as a
    # multiple of its pairs / mesh.expert (0: all of them, none ever dropped, at the cost of a
    # buffer mesh.expert times the pairs); a pair past it is dropped (its expert's output left
    # out) and counted (train/expert_dropped)
    c.model.expert_capacity = setting(0.0, NON_NEGATIVE)
    # float32 matmuls of the programs a run builds: default (the backend's own: full float32
    # on the CPU, TF32 on recent NVIDIA GPUs, one bfloat16 pass on TPUs) | high (3 bfloat16
    # passes on TPUs, TF32 on GPUs) | highest (full float32 everywhere, several times slower
    # on TPUs). bfloat16 compute is unaffected.
    c.model.matmul_precision = setting("default", one_of(*MATMUL_PRECISIONS))

    c.data = ml_collections.ConfigDict()
    # comma-separated JSONL / JSON / parquet files or directories of them (local or gs://),
    # save_to_disk directories, or Hub datasets org/name[:config][@split]; None = the built-in
    # task
    c.data.train_files = setting(
        None,
        agree(lambda v, c: bool(v), "files, folders or a Hub dataset (null: the built-in task)"),
        type=str,
    )
    # held-out files, same formats; None: the built-in task's test split (val_size prompts), or
    # no validation when train_files is set
    c.data.val_files = placeholder(str)
    c.data.image_dir = placeholder(str)  # root of relative image paths (local or gs://)
    # The dataset's columns (JSONL, JSON, parquet; local or gs://). Each key is a column name
    # or a dotted path into nested objects (meta.question); null reads the built-in names. A
    # key naming no column of a file stops the run at start, listing the file's columns.
    c.data.prompt_key = placeholder(str)  # the prompt text; null: `problem`, else `prompt`
    # the label the rewards score (mc_idx: an option letter or 0-based index; accuracy: the
    # reference answer); null: `label_idx`, else `answer`, else `solution`
    c.data.answer_key = placeholder(str)
    # the images: a path (relative to image_dir), bytes, base64 text, {"bytes", "path"} or a
    # list of those; null: `images` (a list)
    c.data.image_key = placeholder(str)
    c.data.video_key = placeholder(str)  # a video's frame list (or a list of them); null: `videos`
    c.data.choices_key = placeholder(str)  # the options list; null: `choices`
    # frames per second of the videos' frame lists (temporal positions)
    c.data.video_fps = setting(2.0, POSITIVE)
    # module:function or path/to/file.py:function mapping each raw row (a dict) to a row with
    # the built-in names (problem, images, label_idx / answer, ...); the keys read its output.
    # Data files only (train_files or val_files): the built-in task's rows need none
    c.data.format = setting(
        None,
        agree(
            lambda v, c: v is None or bool(c.data.train_files or c.data.val_files),
            "null unless data.train_files or data.val_files are given",
        ),
        type=str,
    )
    # tokens; longer prompts are skipped and counted
    c.data.max_prompt_length = setting(256, at_least(1))
    c.data.max_image_side = setting(1024, at_least(1))  # px; larger images are skipped and counted
    c.data.min_pixels = setting(56 * 56, at_least(1))  # images resized to at least this area, px
    # images resized to at most this area, px (28 x 28 per token)
    c.data.max_pixels = setting(
        28 * 28 * 256, at_least(1), agree(lambda v, c: v >= c.data.min_pixels, ">= data.min_pixels")
    )
    # video frames resized to at least this area, px (Qwen3-VL: all of a video's frames
    # together); null: the model's processor's (Qwen2/2.5-VL: 128 tokens of 28 x 28)
    c.data.video_min_pixels = setting(None, at_least(1), type=int)
    # video frames resized to at most this area, px; null: the processor's (768 tokens)
    c.data.video_max_pixels = setting(
        None,
        at_least(1),
        agree(
            lambda v, c: c.data.video_min_pixels is None or v >= c.data.video_min_pixels,
            ">= data.video_min_pixels",
        ),
        type=int,
    )
    c.data.system_prompt = placeholder(str)  # None: the built-in task's, none for files
    # a Jinja file (EasyR1's format_prompt) rendering each prompt's text as `content`, e.g.
    # "{{ content | trim }} Put the final answer in \boxed{}."; `<image>` / `<video>` in the
    # result place each image / video, in order (without them the media come first)
    c.data.format_prompt = placeholder(str)
    # keyword arguments of the chat template (verl's apply_chat_template_kwargs), a Python dict
    # literal, e.g. "{'enable_thinking': False}" for Qwen3's non-thinking prompts
    c.data.chat_template_kwargs = setting("{}", REWARD_KWARGS)
    # prompt lengths padded to a multiple (one compile per bucket)
    c.data.prompt_bucket = setting(32, at_least(1))
    # the task trained on when train_files is unset: shapes (multiple choice about a drawn
    # shape, for the embedded vision-language model) | arithmetic (one-digit sums, for the
    # embedded text-only model); with model.path unset, the embedded model taught that task
    c.data.builtin_task = setting("shapes", one_of(*TASKS))
    c.data.synthetic_train_size = setting(2048, at_least(1))  # built-in task only
    # the shapes task's question kinds: colour, shape, count, position
    c.data.synthetic_kinds = setting(("colour",), Each(one_of(*QUESTIONS), allow_empty=False))

    c.rollout = ml_collections.ConfigDict()
    # G completions per prompt (the group)
    c.rollout.num_generations = setting(
        8,
        at_least(1),
        agree(
            lambda v, c: v > 1 or c.algorithm.adv_estimator not in ("grpo", "rloo"),
            ">= 2 with algorithm.adv_estimator grpo or rloo (a group of one has no baseline: "
            "every advantage would be 0); for one completion per prompt use remax, "
            "reinforce_plus_plus or gae",
        ),
    )
    c.rollout.max_new_tokens = setting(16, at_least(1))  # response_length / max_completion_length
    # sampling temperature; 0 = greedy (with grpo, rloo or remax every advantage is then 0:
    # the run warns at start)
    c.rollout.temperature = setting(1.0, NON_NEGATIVE)
    c.rollout.top_p = setting(1.0, FRACTION)  # nucleus sampling, in (0, 1]; 1 = off
    c.rollout.top_k = setting(0, NON_NEGATIVE)  # 0 = off; 1 = greedy, as temperature 0
    # The sampler's own layout over the same devices (docs/scaling.md#rollouts): the policy's
    # weights are resharded and cast once per rollout phase (LoRA merged). tensor=1, data=-1:
    # every device holds the whole model.
    c.rollout.mesh = ml_collections.ConfigDict()
    # groups of devices splitting the rows; -1 = the rest
    c.rollout.mesh.data = setting(-1, MESH_AXIS)
    # devices per group splitting heads, MLP, vocab; 0 = the divisor of a host's devices whose
    # decode step reads the fewest bytes per device (weights / group + its share of the cache)
    c.rollout.mesh.tensor = setting(0, NON_NEGATIVE)
    # devices each prompt's prefill splits its tokens over (sequence parallelism: long prompts,
    # videos); the prefill joins this many data groups, the decode steps run as before; 1 = off
    c.rollout.mesh.sequence = setting(1, at_least(1))
    # groups of tensor devices each holding 1/expert of a mixture-of-experts model's experts
    # (the decode step sends each token to its experts' devices and back; the rows split over
    # it as over data, the other weights whole in each group); it divides the experts. 0 =
    # auto: the most devices that divide the experts and leave the rows a split (1 without
    # experts or with rollout.mesh.sequence > 1); 1 = off
    c.rollout.mesh.expert = setting(0, NON_NEGATIVE)
    # compute dtype of sampling: auto (bfloat16 on accelerators, model.dtype on the CPU) |
    # float32 | bfloat16. With actor.old_logprobs=sampler the ratio's old log-probs come from
    # this dtype; recompute takes them from a pass in model.dtype.
    c.rollout.dtype = setting("auto", one_of(*ROLLOUT_DTYPES))
    # Decode rows at once (jaxvrl/sampling/engine.py): 0 = every row of a generation batch
    # until the longest ends; S > 0 = S slots, an ended row's slot taken by the next waiting
    # row, over a paged KV cache (a prompt's pages shared by its samples). Same completions.
    # auto: slots where decode steps read pages in place (TPUs' paged kernel) or with
    # rollout.partial, a slot per row of the step (fewer where the pages would not fit in
    # rollout.memory_fraction); else 0
    c.rollout.slots = setting("auto", AutoOr(COUNT), type=object)
    # positions per KV-cache page (with slots)
    c.rollout.page_size = setting(16, at_least(1))
    # how many times a rollout's decode loop may halve its rows (slots) once no row waits:
    # each time half of them or fewer still run it goes on at half (a program per row count,
    # compiled once, at the first rollout; never below 8 rows), so the long tail's steps
    # carry about the rows that run; both engines; 0 = every step at all rows
    c.rollout.narrow = setting(3, NON_NEGATIVE)
    # with rollout.slots=auto: the share of each rollout device's memory its decode weights
    # and KV-cache pages may take (verl's gpu_memory_utilization)
    c.rollout.memory_fraction = setting(0.5, FRACTION)
    # how decode steps attend over the KV cache: auto (the CPU form on the CPU, tpu on TPUs,
    # dense elsewhere) | dense (XLA's einsums around a masked softmax, every platform) | tpu
    # (one Pallas kernel per layer on TPUs, jaxvrl/models/cached_kernels.py; docs/scaling.md)
    # | gpu (the slots engine's pages read in place by a Pallas Triton kernel on GPUs; page
    # size and head dim powers of two; not yet timed on a GPU). Same completions.
    c.rollout.decode_attention = setting("auto", one_of("auto", "dense", "tpu", "gpu"))
    # Partial rollouts (docs/algorithms.md#partial-rollouts): a step's rollout starts
    # oversample x prompts_per_step prompts, stops once prompts_per_step groups are complete
    # and carries the unfinished rows (their tokens and log-probs so far) into the next step's
    # rollout, where they continue first. Needs slots (rollout.slots auto or > 0).
    c.rollout.partial = setting(
        False,
        agree(
            lambda v, c: not v or c.rollout.slots != 0, "false unless rollout.slots is auto or > 0"
        ),
        agree(  # the greedy baseline is sampled with the step's prompts
            lambda v, c: not v or c.algorithm.adv_estimator != "remax",
            "false with algorithm.adv_estimator=remax (its greedy baseline)",
        ),
    )
    c.rollout.oversample = setting(2.0, at_least(1))  # prompts a step starts, x prompts_per_step
    # with rollout.partial: the policy versions (steps) a row may span; a group with an older
    # row is dropped whole and counted (rollout/dropped_stale_rows)
    c.rollout.max_staleness = setting(
        1,
        NON_NEGATIVE,
        agree(
            lambda v, c: v >= 1 or not c.rollout.partial,
            ">= 1 with rollout.partial (at 0 every carried row would be dropped)",
        ),
    )
    # One-step-off training (docs/scaling.md#one-step-off-training): K > 0 gives the sampler K
    # devices of its own (K / hosts on each host) and the train step the rest (config.mesh
    # lays those out); while step k trains, the sampler generates step k+1's batch with the
    # weights before step k's update (staleness 1), copied to its devices once per step
    # (rollout/weight_sync_s). 0: the sampler and the train step share every device in turn.
    c.rollout.devices = setting(0, NON_NEGATIVE)

    c.algorithm = ml_collections.ConfigDict()
    # grpo | rloo | remax | reinforce_plus_plus | gae
    c.algorithm.adv_estimator = setting("grpo", one_of(*ESTIMATORS))
    c.algorithm.norm_adv_by_std = True  # False = Dr.GRPO
    c.algorithm.gamma = setting(1.0, PROBABILITY)  # discount (gae, reinforce_plus_plus)
    c.algorithm.lam = setting(1.0, PROBABILITY)  # GAE lambda (gae only)
    c.algorithm.use_kl_in_reward = False  # subtract kl_ctrl.kl_coef * KL from the reward
    # KL-in-reward estimator: kl | abs | mse | low_var_kl
    c.algorithm.kl_penalty = setting("kl", one_of(*KL_KINDS))
    c.algorithm.kl_ctrl = ml_collections.ConfigDict()
    c.algorithm.kl_ctrl.type = setting("fixed", one_of(*KL_CONTROLLERS))  # fixed | adaptive
    # beta, the KL-in-reward weight (adaptive: its start)
    c.algorithm.kl_ctrl.kl_coef = setting(0.001, NON_NEGATIVE)
    # adaptive only: the KL beta steers towards
    c.algorithm.kl_ctrl.target_kl = setting(0.1, POSITIVE)
    # adaptive only: larger = slower beta changes
    c.algorithm.kl_ctrl.horizon = setting(10000, at_least(1))
    # verl's rollout correction, with actor.old_logprobs=recompute: the loss's per-token terms
    # times min(exp(recomputed - sampler), threshold), per token or per sequence (exp of the
    # row's summed difference); null = off. For sampling in other numerics (bf16) than training
    # null | token | sequence
    c.algorithm.rollout_is = setting(None, one_of(*ROLLOUT_IS), RECOMPUTED, type=str)
    c.algorithm.rollout_is_threshold = setting(2.0, CAP)  # cap of the rollout_is weights
    # IcePop's band (lo, hi), with actor.old_logprobs=recompute: tokens whose ratio
    # exp(recomputed - sampler) (the row's at rollout_is=sequence, else the token's) lies
    # outside [lo, hi] get weight 0 in the loss, the rest keep their rollout_is weight (1 with
    # rollout_is null); null = off
    c.algorithm.rollout_is_band = setting(
        None, Each(CAP, length=2), increasing, RECOMPUTED, type=tuple
    )

    c.actor = ml_collections.ConfigDict()
    # Policy updates per rollout batch: each of ppo_epochs epochs walks the batch in
    # prompts_per_step / global_batch_size mini-batches (rows = global_batch_size x
    # num_generations, shuffled between epochs), one optimizer update each; optim.micro_batches
    # splits each mini-batch. null = prompts_per_step (one mini-batch)
    c.actor.global_batch_size = setting(None, at_least(1), DIVIDES_PROMPTS, type=int)
    c.actor.ppo_epochs = setting(1, at_least(1))  # passes over each rollout batch (>= 1)
    # the ratio's old log-probs: sampler (those the rollout returned; no extra pass) or
    # recompute (a no-grad pass before the first update; logs rollout/logprob_abs_diff_*).
    # With one update per batch the loss pass's own (detached) log-probs are exact and used
    c.actor.old_logprobs = setting("sampler", one_of(*OLD_LOGPROBS))
    # where token shaping (perception and entropy masks, TAS) reads the old policy's
    # log-probs and entropies when the ratio's old log-probs are the sampler's: sampler (the
    # rollout returns them: the experience phase runs no clean pass of its own), recompute
    # (a no-grad pass in model.dtype), auto (sampler where the rollout computes in model.dtype,
    # recompute where it does not, e.g. a bfloat16 rollout of a float32 model)
    c.actor.shaping_source = setting("auto", one_of("auto", "sampler", "recompute"))
    # token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm
    c.actor.loss_agg_mode = setting("seq-mean-token-mean", one_of(*AGG_MODES))
    # PPO ratio clip below: 1 - low
    c.actor.clip_ratio_low = setting(0.2, Range(0, 1, hi_open=True))
    # PPO ratio clip above: 1 + high (DAPO clip-higher: 0.28)
    c.actor.clip_ratio_high = setting(0.2, Range(0, finite=False))
    # dual clip: for A < 0 the loss is at most -A * dual
    c.actor.clip_ratio_dual = setting(3.0, Range(1, lo_open=True, finite=False))
    # add kl_loss_coef * KL(policy || reference) to the loss
    c.actor.use_kl_loss = setting(
        False,
        agree(
            lambda v, c: not v or c.actor.kl_loss_coef > 0,
            "false, or true with actor.kl_loss_coef > 0 (0 adds no KL term; verl's "
            "default is 0.001)",
        ),
    )
    c.actor.kl_loss_coef = setting(0.0, NON_NEGATIVE)  # KL loss weight (with use_kl_loss; 0 = off)
    c.actor.kl_loss_type = setting("low_var_kl", one_of(*KL_KINDS))  # kl | abs | mse | low_var_kl
    c.actor.entropy_coef = setting(0.0, Range())  # entropy bonus
    c.actor.use_entropy_penalty = False  # VPPO: + coef * agg(-logp)
    # the entropy penalty's weight (with use_entropy_penalty)
    c.actor.entropy_penalty_coef = setting(0.06, NON_NEGATIVE)
    # a mixture-of-experts policy's load-balancing loss (moe.load_balancing_loss) added to
    # the loss at this weight (0 = off; a model without experts refuses it)
    c.actor.router_aux_loss_coef = setting(0.0, NON_NEGATIVE)
    # a mixture-of-experts policy's passes over a rollout route every token by the experts
    # the sampler chose for it (Rollout Routing Replay, arXiv 2510.11370: the selection
    # from the rollout, the weights from the live router); the sampler records the routes
    # of such a policy either way, and train/router_mismatch is the share of token-layer
    # routes a fresh router would choose otherwise (not with rollout.partial; a model
    # without experts refuses it)
    c.actor.routing_replay = False
    # the optimizer's state (Adam's moments: 2x the trainable parameters in float32) kept in
    # host memory between updates and brought to the devices for each update
    # (docs/scaling.md#host-offload); for devices with a host memory space (TPU, GPU, CPU)
    c.actor.offload_optimizer = False
    # the reference policy's weights (KL loss or KL in the reward, without LoRA) kept in host
    # memory between steps and brought to the devices for the reference pass
    c.actor.offload_reference = False
    # every pass computes real tokens only: each micro-batch's rows (their prompt's and
    # completion's real tokens) packed into buffers of the padded row's length, attention
    # inside each row (false: padded rows [rows, prompt + completion]). Either way the
    # completion axis is cut to the batch's longest completion, in eighths of max_new_tokens
    c.actor.padding_free = True
    # micro-batches formed by a token budget: each step takes the fewest micro-batches (a
    # divisor of an update's rows; optim.micro_batches then only sets the first try's floor
    # of 1) whose packed slots per device (padded: rows x row length) stay within
    # actor.max_token_len_per_device; the count is logged (train/micro_batches)
    c.actor.dynamic_batching = setting(
        False,
        agree(
            lambda v, c: not v or c.actor.max_token_len_per_device is not None,
            "needs actor.max_token_len_per_device (tokens per device per micro-batch)",
        ),
    )
    # dynamic_batching budget
    c.actor.max_token_len_per_device = setting(None, at_least(1), type=int)

    c.critic = ml_collections.ConfigDict()  # value head, used by adv_estimator=gae only
    # the critic's AdamW learning rate (constant, no weight decay)
    c.critic.lr = setting(1e-5, POSITIVE)
    # the policy is not updated before this step (the critic is)
    c.critic.warmup_steps = setting(
        0,
        NON_NEGATIVE,
        agree(
            lambda v, c: v < c.total_steps or c.algorithm.adv_estimator != "gae",
            "< total_steps (the policy would never be updated)",
        ),
    )
    c.critic.grad_clip = setting(1.0, CAP)  # the critic's gradient global-norm clip
    c.critic.cliprange_value = setting(0.5, CAP)  # value clip: new values within old +- this
    c.critic.value_loss_coef = setting(0.5, NON_NEGATIVE)  # the value loss's weight
    c.critic.share_backbone = False  # True: value head on the policy's hidden states

    c.tprl = ml_collections.ConfigDict()  # VPPO (arXiv 2510.09285)
    c.tprl.enable_perception_filtering = False  # loss only on the most image-dependent tokens
    # fraction of each row's tokens it keeps, in (0, 1]
    c.tprl.top_p_perception_tokens = setting(0.2, FRACTION)
    # patch blackening probability of the perturbed image
    c.tprl.black_prob = setting(0.5, PROBABILITY)
    c.tprl.enable_entropy_filtering = False  # loss only on high-entropy tokens (arXiv 2506.01939)
    # fraction of tokens it keeps (per scope), in (0, 1]
    c.tprl.top_p_entropy_tokens = setting(0.2, FRACTION)
    c.tprl.entropy_filter_scope = setting("sequence", one_of(*ENTROPY_SCOPES))  # sequence | batch
    c.tprl.enable_trajectory_reweighting = False  # TAS
    # TAS: the smallest advantage scale, in [0, 1]
    c.tprl.trajectory_scaling_min = setting(0.8, PROBABILITY)

    c.vgr = ml_collections.ConfigDict()  # attention-derived token weights
    c.vgr.enable_token_weights = False  # weight each token's loss by its vision/text attention
    # (low, high) clip of the weights over their row mean
    c.vgr.token_weight_clip = setting(
        (0.2, 3.0),
        Each(NON_NEGATIVE, length=2),
        ordered,
        agree(lambda v, c: v[1] > 0, "an upper bound above 0 (weights all 0 train nothing)"),
    )
    c.vgr.token_weight_smooth_sigma = setting(0.0, NON_NEGATIVE)  # 0 = no smoothing
    # >0: mean over the last K layers (wins over layer_set)
    c.vgr.token_weight_last_k_layers = setting(0, NON_NEGATIVE)
    c.vgr.layer_set = setting("all", one_of(*LAYER_SETS))  # all | early | middle | late

    c.reward = ml_collections.ConfigDict()
    # built-ins, module:fn, path.py:fn or path.py (its compute_score, else main)
    c.reward.funcs = setting(("mc_idx", "think_format"), Each(NON_EMPTY, allow_empty=False))
    # one per func (the regular weights)
    c.reward.weights = setting(
        (4.0, 1.0),
        Each(Range(), length="reward.funcs", allow_empty=False),
        agree(
            lambda v, c: any(v) or bool(c.reward.model.path),
            "a weight other than 0 (all 0 and no reward model: every reward 0, nothing learned)",
        ),
    )
    # one per func: the names its metrics (reward/<name>, reward/<name>_failures), the markdown
    # logs and the filters use. () = a built-in's name, else the function's (a.py:fn -> fn)
    c.reward.names = setting((), reward_names_rule)
    # two-stage: weights for the first early_steps
    c.reward.early_weights = setting((), Each(Range(), length="reward.funcs"))
    # steps that use early_weights (0 = off); set both or neither
    c.reward.early_steps = setting(
        0,
        NON_NEGATIVE,
        agree(
            lambda v, c: (v > 0) == bool(c.reward.early_weights),
            "> 0 exactly when reward.early_weights are given",
        ),
    )
    # R in clip(1 - |ln MDI| / ln R, 0, 1)
    c.reward.mdi_balance_ratio = setting(2.0, Range(1, lo_open=True))
    # keyword arguments of the reward functions (EasyR1's reward_function_kwargs), a Python
    # dict: {"format_weight": 0.5} goes to every function whose signature takes it,
    # {"<reward name>": {...}} to that one only
    c.reward.kwargs = setting("{}", REWARD_KWARGS)
    # worker processes that score in parallel: per-row functions' rows, and each batch
    # function's one call on the whole batch (0 = a thread of the trainer)
    c.reward.num_workers = setting(0, NON_NEGATIVE)
    # seconds each reward call may take (a batch for TRL / EasyR1-batch functions, a row for
    # per-row ones); past it the rows score 0, counted in reward/<name>_timeouts, and the
    # worker is replaced (inf = no bound)
    c.reward.timeout_s = setting(300.0, CAP)
    # a function failing (raising, timing out, wrong count, non-finite) on more than this
    # fraction of its calls over the last failure_window steps ends the run (exit 2, saved)
    c.reward.max_failure_fraction = setting(0.5, PROBABILITY)
    c.reward.failure_window = setting(5, at_least(1))  # steps the failure fraction is over
    # a reward model: one more reward, `model`, scored on the mesh after the rollout
    c.reward.model = ml_collections.ConfigDict()
    # a sequence classifier with one label (Qwen2/Llama/Qwen3ForSequenceClassification): a
    # directory (local or gs://) or a Hub name org/name[@revision]; None or "" = none
    c.reward.model.path = placeholder(str)
    c.reward.model.weight = setting(1.0, Range())  # its weight in the total reward

    c.filter = ml_collections.ConfigDict()
    # DAPO: drop groups whose metric is constant
    c.filter.dynamic_sampling = setting(
        False,
        agree(
            lambda v, c: not v or c.rollout.num_generations > 1,
            "false with rollout.num_generations=1 (a group of one never varies: every group "
            "would be dropped)",
        ),
    )
    # overall (total reward) or a reward name
    c.filter.dynamic_sampling_metric = setting("overall", reward_metric_rule)
    # generation batches per step to fill it with informative groups; short: the rest is
    # padding (mask 0). 0 = no limit (an error after a whole pass over the data)
    c.filter.max_num_gen_batches = setting(1, NON_NEGATIVE)
    c.filter.online_filtering = setting(  # keep filter_low < mean score < filter_high
        False,
        agree(
            lambda v, c: not v or c.rollout.num_generations > 1,
            "false with rollout.num_generations=1 (a group of one is never strictly inside "
            "the band of a 0/1 score: every group would be dropped)",
        ),
    )
    # overall (the weighted total: 0..5 with the built-in mc_idx 4 + think_format 1, so the
    # default 0.01 / 0.99 suit a reward name such as mc_idx better) or a reward name
    c.filter.filter_key = setting("overall", reward_metric_rule)
    # online filtering: keep a group if its mean score > this
    c.filter.filter_low = setting(0.01, Range(finite=False))
    # online filtering: keep a group if its mean score < this
    c.filter.filter_high = setting(
        0.99, agree(lambda v, c: v > c.filter.filter_low, "> filter.filter_low")
    )
    # uninformative groups (and slots dynamic sampling left empty) are replaced by
    # stored informative groups of earlier steps, each used once. Not in the checkpoint: a
    # resumed run starts with an empty buffer
    c.filter.replay_buffer = ml_collections.ConfigDict()
    c.filter.replay_buffer.enable = False  # True: refill uninformative groups from the buffer
    c.filter.replay_buffer.capacity = setting(64, at_least(1))  # groups
    c.filter.replay_buffer.min_std = setting(1e-6, NON_NEGATIVE)  # informative: std >= min_std and
    # min_mean <= mean <= max_mean
    c.filter.replay_buffer.min_mean = setting(
        float("-inf"), Range(None, math.inf, hi_open=True, finite=False)
    )
    # informative: mean <= max_mean
    c.filter.replay_buffer.max_mean = setting(
        float("inf"),
        agree(
            lambda v, c: v >= c.filter.replay_buffer.min_mean, ">= filter.replay_buffer.min_mean"
        ),
    )
    c.filter.mask_truncated_completions = False  # DAPO: completions without EOS leave the loss
    # soft overlong punishment over the last N tokens; 0 = off
    c.filter.overlong_buffer_len = setting(
        0,
        NON_NEGATIVE,
        agree(lambda v, c: v <= c.rollout.max_new_tokens, "<= rollout.max_new_tokens"),
    )
    # overlong penalty at max_new_tokens: -factor
    c.filter.overlong_penalty_factor = setting(1.0, NON_NEGATIVE)

    c.optim = ml_collections.ConfigDict()
    c.optim.lr = setting(3e-4, NON_NEGATIVE)  # the policy's AdamW peak learning rate (0: frozen)
    # constant | cosine (after warmup, to lr * min_lr_ratio)
    c.optim.schedule = setting("constant", one_of(*SCHEDULES))
    # cosine only: the learning rate at the last step, over lr
    c.optim.min_lr_ratio = setting(0.0, PROBABILITY)
    c.optim.warmup_steps = setting(0, NON_NEGATIVE)  # linear warm-up from 0 over this many steps
    # AdamW (beta1, beta2)
    c.optim.betas = setting((0.9, 0.999), Each(Range(0, 1, hi_open=True), length=2))
    c.optim.weight_decay = setting(0.0, NON_NEGATIVE)  # AdamW decoupled weight decay
    c.optim.grad_clip = setting(1.0, CAP)  # global norm
    # gradient accumulation: rows split into this many chunks
    c.optim.micro_batches = setting(1, at_least(1))

    # device mesh axis sizes, one of them may be -1 (the rest of the devices); their product is
    # the device count (docs/scaling.md). One device: a 1x1x1x1 mesh
    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = setting(1, MESH_AXIS)  # data parallel: batch sharded, parameters replicated
    c.mesh.fsdp = setting(-1, MESH_AXIS)  # FSDP: batch and parameters sharded; -1 = the rest
    c.mesh.tensor = setting(1, MESH_AXIS, ONE_REST)  # tensor parallel: mlp, heads and vocab sharded
    # expert parallel (a mixture-of-experts model): each device holds 1/expert of every sparse
    # layer's experts, tokens go to their experts' devices and back (all-to-all); the rows
    # split over it elsewhere, as over data. 1 = off; it divides the experts
    c.mesh.expert = setting(1, at_least(1))
    # sequence parallel: every row's tokens (and the vision tower's patches) split over it,
    # attention by an all-to-all over heads (Ulysses) where it divides the heads, else over
    # keys and values gathered; the weights split over it too, as over fsdp. 1 = off
    c.mesh.sequence = setting(1, at_least(1))

    # multi-host: jax.distributed.initialize before anything touches a device (launch/*.sh)
    c.distributed = ml_collections.ConfigDict()
    c.distributed.enable = False  # True: from the platform's environment unless set below
    # host:port of process 0; None: env
    c.distributed.coordinator_address = setting(
        None,
        agree(
            lambda v, c: re.fullmatch(r"\S+:\d+", v) is not None, "host:port, e.g. 10.0.0.2:1234"
        ),
        type=str,
    )
    # processes (hosts) in the run; None: env
    c.distributed.num_processes = setting(None, at_least(1), type=int)
    # this process's index; None: env
    c.distributed.process_id = setting(
        None,
        NON_NEGATIVE,
        agree(
            lambda v, c: c.distributed.num_processes is None or v < c.distributed.num_processes,
            "< distributed.num_processes",
        ),
        type=int,
    )

    c.lora = ml_collections.ConfigDict()
    c.lora.rank = setting(0, NON_NEGATIVE)  # 0 = off (full fine-tuning)
    c.lora.alpha = setting(16.0, POSITIVE)  # adapter scale alpha / rank
    # dropout on the adapters' input (training only)
    c.lora.dropout = setting(0.05, Range(0, 1, hi_open=True))
    # Linear names (last path part) or path regexes
    c.lora.target_modules = setting(("q_proj", "v_proj"), Each(NON_EMPTY, allow_empty=False))
    c.lora.train_vision = False  # also adapt the vision tower
    # QLoRA base weights: none | int8 | int4 | nf4 (needs qwix)
    c.lora.quantize = setting(
        "none",
        one_of("none", *QTYPES),
        agree(lambda v, c: v == "none" or c.lora.rank > 0, "none unless lora.rank > 0"),
    )

    if arg.runlocal:
        runlocal(c)
    return c


def runlocal(c):
    """A smoke-test shrink: seconds per step on a CPU."""
    c.total_steps = 2
    c.val_freq = 2
    c.save_freq = 0
    c.prompts_per_step = 2
    c.rollout.num_generations = 2
    c.rollout.max_new_tokens = 8
    c.val_size = 4
    c.data.synthetic_train_size = 16
    c.log_rollouts_every = 1
