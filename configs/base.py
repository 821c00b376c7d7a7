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
"""

import ml_collections
from ml_collections.config_dict import placeholder

from jaxvrl.config import parse_arg


def get_config(arg=None):
    arg = parse_arg(arg, runlocal=False)
    c = ml_collections.ConfigDict()
    c.name = "base"  # the run's name: printed at start, stored in <workdir>/run.json
    c.seed = 0  # data order, built-in task, LoRA / critic init, sampling
    c.workdir = placeholder(str)  # None: runs/<config>-<YYYYmmdd-HHMMSS>; gs:// allowed
    c.resume = True  # continue from the latest checkpoint in workdir
    # <workdir>/checkpoints/<step> of another run: start from its parameters (fresh optimizer,
    # step 0); ignored when workdir has a checkpoint to resume
    c.load_checkpoint_path = placeholder(str)
    c.total_steps = 60  # training (rollout) steps; the cosine schedule ends here
    c.prompts_per_step = 8  # prompts per step; rows = prompts_per_step * num_generations
    c.val_freq = 20  # validate every this many steps (and at the last step)
    c.val_before_train = True  # validate at step 0
    c.val_only = False  # validate and exit
    c.val_size = 96  # held-out prompts of the built-in task
    c.save_freq = 20  # checkpoint every this many steps (0: only at the end)
    c.max_to_keep = 2  # checkpoints kept in workdir/checkpoints
    c.max_nonfinite_steps = 10  # stop after this many consecutive non-finite updates
    c.log_rollouts_every = 5  # steps between entries of the markdown logs
    c.log_samples = 8  # samples per markdown entry
    c.time_budget_s = 0  # save and stop cleanly after this many seconds; 0 = no limit

    c.model = ml_collections.ConfigDict()
    c.model.path = placeholder(str)  # HF checkpoint dir; None = the embedded tiny checkpoint
    # a published config without weights (qwen2.5-vl-3b | 7b | 32b | 72b): shapes for
    # `python -m jaxvrl.aot` only; training needs model.path
    c.model.preset = placeholder(str)
    c.model.dtype = "float32"  # compute dtype: float32 | bfloat16
    c.model.param_dtype = "float32"  # master weights (float32 with bfloat16 compute)
    # gradient checkpointing of every decoder layer and vision block: none | full |
    # dots_saveable | dots_with_no_batch_dims_saveable (docs/scaling.md: full beyond toy sizes)
    c.model.remat_policy = "none"
    # decoder layers and vision blocks stacked on a leading layer axis and run by a scan, so
    # the layer program compiles once (docs/scaling.md); False: unrolled, the same outputs.
    # Part of the param tree: a checkpoint resumes only with the value it was saved with
    c.model.scan_layers = True
    # attention of the forward passes without a KV cache (train step, scoring, the vision
    # tower): auto | xla | flash | splash | cudnn. auto follows the mesh's devices: splash on
    # TPUs, flash on GPUs, xla (dense) on the CPU; see jaxvrl/models/attention.py
    c.model.attention = "auto"
    # float32 matmuls of the programs a run builds: default (the backend's own: full float32
    # on the CPU, TF32 on recent NVIDIA GPUs, one bfloat16 pass on TPUs) | high (3 bfloat16
    # passes on TPUs, TF32 on GPUs) | highest (full float32 everywhere, several times slower
    # on TPUs). bfloat16 compute is unaffected.
    c.model.matmul_precision = "default"

    c.data = ml_collections.ConfigDict()
    # comma-separated JSONL / JSON / parquet files (local or gs://); None = the built-in task
    c.data.train_files = placeholder(str)
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
    c.data.video_fps = 2.0  # frames per second of the videos' frame lists (temporal positions)
    # module:function or path/to/file.py:function mapping each raw row (a dict) to a row with
    # the built-in names (problem, images, label_idx / answer, ...); the keys read its output
    c.data.format = placeholder(str)
    c.data.max_prompt_length = 256  # tokens; longer prompts are skipped and counted
    c.data.max_image_side = 1024  # px; larger images are skipped and counted
    c.data.min_pixels = 56 * 56  # images resized to at least this area, px
    c.data.max_pixels = 28 * 28 * 256  # images resized to at most this area, px (28 x 28 per token)
    c.data.system_prompt = placeholder(str)  # None: the built-in task's, none for files
    c.data.prompt_bucket = 32  # prompt lengths padded to a multiple (one compile per bucket)
    c.data.synthetic_train_size = 2048  # built-in task only
    c.data.synthetic_kinds = ("colour",)  # built-in task question kinds: colour, shape

    c.rollout = ml_collections.ConfigDict()
    c.rollout.num_generations = 8  # G completions per prompt (the group)
    c.rollout.max_new_tokens = 16  # response_length / max_completion_length
    c.rollout.temperature = 1.0  # sampling temperature; 0 = greedy
    c.rollout.top_p = 1.0  # nucleus sampling, in (0, 1]; 1 = off
    c.rollout.top_k = 0  # 0 = off
    # The sampler's own layout over the same devices (docs/scaling.md#rollouts): the policy's
    # weights are resharded and cast once per rollout phase (LoRA merged). tensor=1, data=-1:
    # every device holds the whole model.
    c.rollout.mesh = ml_collections.ConfigDict()
    c.rollout.mesh.data = -1  # groups of devices splitting the rows; -1 = the rest
    # devices per group splitting heads, MLP, vocab; 0 = the divisor of a host's devices whose
    # decode step reads the fewest bytes per device (weights / group + its share of the cache)
    c.rollout.mesh.tensor = 0
    # compute dtype of sampling: auto (bfloat16 on accelerators, model.dtype on the CPU) |
    # float32 | bfloat16. With actor.old_logprobs=sampler the ratio's old log-probs come from
    # this dtype; recompute takes them from a pass in model.dtype.
    c.rollout.dtype = "auto"
    # Decode rows at once (jaxvrl/sampling/engine.py): 0 = every row of a generation batch
    # until the longest ends; S > 0 = S slots, an ended row's slot taken by the next waiting
    # row, over a paged KV cache (a prompt's pages shared by its samples). Same completions.
    c.rollout.slots = 0
    c.rollout.page_size = 16  # positions per KV-cache page (with rollout.slots > 0)

    c.algorithm = ml_collections.ConfigDict()
    c.algorithm.adv_estimator = "grpo"  # grpo | rloo | remax | reinforce_plus_plus | gae
    c.algorithm.norm_adv_by_std = True  # False = Dr.GRPO
    c.algorithm.gamma = 1.0  # discount (gae, reinforce_plus_plus)
    c.algorithm.lam = 1.0  # GAE lambda (gae only)
    c.algorithm.use_kl_in_reward = False  # subtract kl_ctrl.kl_coef * KL from the reward
    c.algorithm.kl_penalty = "kl"  # KL-in-reward estimator: kl | abs | mse | low_var_kl
    c.algorithm.kl_ctrl = ml_collections.ConfigDict()
    c.algorithm.kl_ctrl.type = "fixed"  # fixed | adaptive
    c.algorithm.kl_ctrl.kl_coef = 0.001  # beta, the KL-in-reward weight (adaptive: its start)
    c.algorithm.kl_ctrl.target_kl = 0.1  # adaptive only: the KL beta steers towards
    c.algorithm.kl_ctrl.horizon = 10000  # adaptive only: larger = slower beta changes
    # verl's rollout correction, with actor.old_logprobs=recompute: the loss's per-token terms
    # times min(exp(recomputed - sampler), threshold), per token or per sequence (exp of the
    # row's summed difference); null = off. For sampling in other numerics (bf16) than training
    c.algorithm.rollout_is = placeholder(str)  # null | token | sequence
    c.algorithm.rollout_is_threshold = 2.0  # cap of the rollout_is weights

    c.actor = ml_collections.ConfigDict()
    # Policy updates per rollout batch: each of ppo_epochs epochs walks the batch in
    # prompts_per_step / global_batch_size mini-batches (rows = global_batch_size x
    # num_generations, shuffled between epochs), one optimizer update each; optim.micro_batches
    # splits each mini-batch. null = prompts_per_step (one mini-batch)
    c.actor.global_batch_size = placeholder(int)
    c.actor.ppo_epochs = 1  # passes over each rollout batch (>= 1)
    # the ratio's old log-probs: sampler (those the rollout returned; no extra pass) or
    # recompute (a no-grad pass before the first update; logs rollout/logprob_abs_diff_*).
    # With one update per batch the loss pass's own (detached) log-probs are exact and used
    c.actor.old_logprobs = "sampler"
    # token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm
    c.actor.loss_agg_mode = "seq-mean-token-mean"
    c.actor.clip_ratio_low = 0.2  # PPO ratio clip below: 1 - low
    c.actor.clip_ratio_high = 0.2  # PPO ratio clip above: 1 + high (DAPO clip-higher: 0.28)
    c.actor.clip_ratio_dual = 3.0  # dual clip: for A < 0 the loss is at most -A * dual
    c.actor.use_kl_loss = False  # add kl_loss_coef * KL(policy || reference) to the loss
    c.actor.kl_loss_coef = 0.0  # KL loss weight (with use_kl_loss; 0 = off)
    c.actor.kl_loss_type = "low_var_kl"  # kl | abs | mse | low_var_kl
    c.actor.entropy_coef = 0.0  # entropy bonus
    c.actor.use_entropy_penalty = False  # VPPO: + coef * agg(-logp)
    c.actor.entropy_penalty_coef = 0.06  # the entropy penalty's weight (with use_entropy_penalty)

    c.critic = ml_collections.ConfigDict()  # value head, used by adv_estimator=gae only
    c.critic.lr = 1e-5  # the critic's AdamW learning rate (constant, no weight decay)
    c.critic.warmup_steps = 0  # the policy is not updated before this step (the critic is)
    c.critic.grad_clip = 1.0  # the critic's gradient global-norm clip
    c.critic.cliprange_value = 0.5  # value clip: new values within old +- this
    c.critic.value_loss_coef = 0.5  # the value loss's weight
    c.critic.share_backbone = False  # True: value head on the policy's hidden states

    c.tprl = ml_collections.ConfigDict()  # VPPO (arXiv 2510.09285)
    c.tprl.enable_perception_filtering = False  # loss only on the most image-dependent tokens
    c.tprl.top_p_perception_tokens = 0.2  # fraction of each row's tokens it keeps, in (0, 1]
    c.tprl.black_prob = 0.5  # patch blackening probability of the perturbed image
    c.tprl.enable_entropy_filtering = False  # loss only on high-entropy tokens (arXiv 2506.01939)
    c.tprl.top_p_entropy_tokens = 0.2  # fraction of tokens it keeps (per scope), in (0, 1]
    c.tprl.entropy_filter_scope = "sequence"  # sequence | batch
    c.tprl.enable_trajectory_reweighting = False  # TAS
    c.tprl.trajectory_scaling_min = 0.8  # TAS: the smallest advantage scale, in [0, 1]

    c.vgr = ml_collections.ConfigDict()  # attention-derived token weights
    c.vgr.enable_token_weights = False  # weight each token's loss by its vision/text attention
    c.vgr.token_weight_clip = (0.2, 3.0)  # (low, high) clip of the weights over their row mean
    c.vgr.token_weight_smooth_sigma = 0.0  # 0 = no smoothing
    c.vgr.token_weight_last_k_layers = 0  # >0: mean over the last K layers (wins over layer_set)
    c.vgr.layer_set = "all"  # all | early | middle | late

    c.reward = ml_collections.ConfigDict()
    c.reward.funcs = ("mc_idx", "think_format")  # built-ins, module:fn or path.py:fn
    c.reward.weights = (4.0, 1.0)  # one per func (the regular weights)
    # one per func: the names its metrics (reward/<name>, reward/<name>_failures), the markdown
    # logs and the filters use. () = a built-in's name, else the function's (a.py:fn -> fn)
    c.reward.names = ()
    c.reward.early_weights = ()  # two-stage: weights for the first early_steps
    c.reward.early_steps = 0  # steps that use early_weights (0 = off)
    c.reward.mdi_balance_ratio = 2.0  # R in clip(1 - |ln MDI| / ln R, 0, 1)

    c.filter = ml_collections.ConfigDict()
    c.filter.dynamic_sampling = False  # DAPO: drop groups whose metric is constant
    c.filter.dynamic_sampling_metric = "overall"  # overall (total reward) or a reward name
    # generation batches per step to fill it with informative groups; short: the rest is
    # padding (mask 0). 0 = no limit (an error after a whole pass over the data)
    c.filter.max_num_gen_batches = 1
    c.filter.online_filtering = False  # keep filter_low < mean score < filter_high
    # overall (the weighted total: 0..5 with the built-in mc_idx 4 + think_format 1, so the
    # default 0.01 / 0.99 suit a reward name such as mc_idx better) or a reward name
    c.filter.filter_key = "overall"
    c.filter.filter_low = 0.01  # online filtering: keep a group if its mean score > this
    c.filter.filter_high = 0.99  # online filtering: keep a group if its mean score < this
    # uninformative groups (and slots dynamic sampling left empty) are replaced by
    # stored informative groups of earlier steps, each used once. Not in the checkpoint: a
    # resumed run starts with an empty buffer
    c.filter.replay_buffer = ml_collections.ConfigDict()
    c.filter.replay_buffer.enable = False  # True: refill uninformative groups from the buffer
    c.filter.replay_buffer.capacity = 64  # groups
    c.filter.replay_buffer.min_std = 1e-6  # informative: std >= min_std and
    c.filter.replay_buffer.min_mean = float("-inf")  # min_mean <= mean <= max_mean
    c.filter.replay_buffer.max_mean = float("inf")  # informative: mean <= max_mean
    c.filter.mask_truncated_completions = False  # DAPO: completions without EOS leave the loss
    c.filter.overlong_buffer_len = 0  # soft overlong punishment over the last N tokens; 0 = off
    c.filter.overlong_penalty_factor = 1.0  # overlong penalty at max_new_tokens: -factor

    c.optim = ml_collections.ConfigDict()
    c.optim.lr = 3e-4  # the policy's AdamW peak learning rate
    c.optim.schedule = "constant"  # constant | cosine (after warmup, to lr * min_lr_ratio)
    c.optim.min_lr_ratio = 0.0  # cosine only: the learning rate at the last step, over lr
    c.optim.warmup_steps = 0  # linear warm-up from 0 over this many steps
    c.optim.betas = (0.9, 0.999)  # AdamW (beta1, beta2)
    c.optim.weight_decay = 0.0  # AdamW decoupled weight decay
    c.optim.grad_clip = 1.0  # global norm
    c.optim.micro_batches = 1  # gradient accumulation: rows split into this many chunks

    # device mesh axis sizes, one of them may be -1 (the rest of the devices); their product is
    # the device count (docs/scaling.md). One device: a 1x1x1 mesh
    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = 1  # data parallel: batch sharded, parameters replicated
    c.mesh.fsdp = -1  # FSDP: batch and parameters sharded; -1 = the rest
    c.mesh.tensor = 1  # tensor parallel: mlp, heads and vocab sharded

    # multi-host: jax.distributed.initialize before anything touches a device (launch/*.sh)
    c.distributed = ml_collections.ConfigDict()
    c.distributed.enable = False  # True: from the platform's environment unless set below
    c.distributed.coordinator_address = placeholder(str)  # host:port of process 0; None: env
    c.distributed.num_processes = placeholder(int)  # processes (hosts) in the run; None: env
    c.distributed.process_id = placeholder(int)  # this process's index; None: env

    c.lora = ml_collections.ConfigDict()
    c.lora.rank = 0  # 0 = off (full fine-tuning)
    c.lora.alpha = 16.0  # adapter scale alpha / rank
    c.lora.dropout = 0.05  # dropout on the adapters' input (training only)
    c.lora.target_modules = ("q_proj", "v_proj")  # Linear names (last path part) or path regexes
    c.lora.train_vision = False  # also adapt the vision tower
    c.lora.quantize = "none"  # QLoRA base weights: none | int8 | int4 | nf4 (needs qwix)

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
