"""Base config: every option of SPEC sections 2-9, with the seeds' option names.

Defaults run the embedded default (tiny Qwen2.5-VL + the built-in visual task) on a CPU in a
few minutes. Real runs set at least `model.path` and `data.train_files`:

    python -m jaxvrl.train --config configs/grpo.py \
        --config.model.path=/ckpt/Qwen2.5-VL-3B-Instruct --config.data.train_files=train.jsonl
"""

import ml_collections


def get_config(arg=None):
    del arg
    c = ml_collections.ConfigDict()
    c.name = "base"
    c.seed = 0
    c.workdir = ""  # default: runs/<config>-<time>
    c.resume = True  # pick up the latest checkpoint in workdir
    c.total_steps = 60
    c.prompts_per_step = 8
    c.val_freq = 20
    c.val_only = False
    c.val_size = 96
    c.save_freq = 20  # 0: only at the end
    c.max_to_keep = 2
    c.max_nonfinite_steps = 10
    c.log_rollouts_every = 5
    c.time_budget_s = 0  # stop cleanly (and save) after this many seconds; 0 = no limit

    c.model = ml_collections.ConfigDict()
    c.model.path = ""  # HF checkpoint directory; empty = the embedded tiny checkpoint
    c.model.dtype = "float32"  # compute/param dtype: float32 or bfloat16

    c.data = ml_collections.ConfigDict()
    c.data.train_files = ""  # comma-separated JSONL/JSON/parquet; empty = built-in task
    c.data.val_files = ""
    c.data.image_dir = ""
    c.data.max_prompt_length = 256
    c.data.max_image_side = 1024  # seed 000 filters larger images
    c.data.min_pixels = 56 * 56
    c.data.max_pixels = 28 * 28 * 256
    c.data.system_prompt = ""  # empty: the built-in task's prompt for it, none otherwise
    c.data.prompt_bucket = 32
    c.data.synthetic_train_size = 2048
    c.data.synthetic_kinds = ("colour",)  # built-in task question kinds: colour, shape

    c.rollout = ml_collections.ConfigDict()
    c.rollout.num_generations = 8
    c.rollout.max_new_tokens = 16  # response_length
    c.rollout.temperature = 1.0
    c.rollout.top_p = 1.0
    c.rollout.top_k = 0

    c.algorithm = ml_collections.ConfigDict()
    c.algorithm.adv_estimator = "grpo"  # grpo | rloo | remax | reinforce_plus_plus | gae
    c.algorithm.norm_adv_by_std = True  # False = Dr.GRPO
    c.algorithm.gamma = 1.0
    c.algorithm.lam = 1.0
    c.algorithm.loss_agg_mode = "seq-mean-token-mean"
    c.algorithm.clip_ratio_low = 0.2
    c.algorithm.clip_ratio_high = 0.2
    c.algorithm.clip_ratio_dual = 3.0
    c.algorithm.use_kl_loss = False
    c.algorithm.kl_loss_coef = 0.0
    c.algorithm.kl_loss_type = "low_var_kl"  # kl | abs | mse | low_var_kl
    c.algorithm.use_kl_in_reward = False
    c.algorithm.kl_ctrl_type = "fixed"  # fixed | adaptive
    c.algorithm.kl_coef = 0.001
    c.algorithm.target_kl = 0.1
    c.algorithm.kl_horizon = 10000
    c.algorithm.entropy_coef = 0.0
    c.algorithm.use_entropy_penalty = False
    c.algorithm.entropy_penalty_coef = 0.06

    c.tprl = ml_collections.ConfigDict()
    c.tprl.enable_perception_filtering = False
    c.tprl.top_p_perception_tokens = 0.2
    c.tprl.black_prob = 0.5
    c.tprl.enable_entropy_filtering = False
    c.tprl.top_p_entropy_tokens = 0.2
    c.tprl.entropy_filter_scope = "sequence"  # sequence | batch
    c.tprl.enable_trajectory_reweighting = False
    c.tprl.trajectory_scaling_min = 0.8

    c.vgr = ml_collections.ConfigDict()
    c.vgr.enable_token_weights = False
    c.vgr.token_weight_clip = (0.2, 3.0)
    c.vgr.token_weight_smooth_sigma = 0.0
    c.vgr.token_weight_last_k_layers = 0
    c.vgr.layer_set = "all"  # all | early | middle | late

    c.reward = ml_collections.ConfigDict()
    c.reward.funcs = ("mc_idx", "think_format")  # built-in names, module:fn or file.py:fn
    c.reward.weights = (4.0, 1.0)
    c.reward.early_weights = ()  # seed 001 two-stage weights (same order as funcs)
    c.reward.early_steps = 0
    c.reward.mdi_balance_ratio = 2.0

    c.filter = ml_collections.ConfigDict()
    c.filter.dynamic_sampling = False  # DAPO: drop groups whose total reward is constant
    c.filter.max_num_gen_batches = 1
    c.filter.online_filtering = False  # seed 004
    c.filter.filter_low = 0.0
    c.filter.filter_high = 1.0
    c.filter.mask_truncated_completions = False
    c.filter.overlong_buffer_len = 0
    c.filter.overlong_penalty_factor = 1.0

    c.optim = ml_collections.ConfigDict()
    c.optim.lr = 3e-4
    c.optim.warmup_steps = 0
    c.optim.weight_decay = 0.0
    c.optim.grad_clip = 1.0
    c.optim.micro_batches = 1

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = 1
    c.mesh.fsdp = -1
    c.mesh.tensor = 1
    return c
