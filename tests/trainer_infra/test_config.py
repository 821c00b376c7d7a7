"""Config files and overrides: every type, close-name errors, file:arg, validation, defaults."""

from __future__ import annotations

import glob
import math
import os
import re

import ml_collections
import pytest

from jaxvrl.config import (
    ConfigError,
    apply_override,
    default_workdir,
    flat_keys,
    load_config,
    parse_arg,
    parse_argv,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = os.path.join(ROOT, "configs", "base.py")
CONFIGS = sorted(
    os.path.relpath(p, ROOT)
    for p in glob.glob(os.path.join(ROOT, "configs", "*.py"))
    if not p.endswith("__init__.py")
)


def cfg_of(*overrides, path=BASE):
    return load_config(path, list(overrides))


def test_parse_argv_forms():
    assert parse_argv(["--config", "configs/tprl.py"]) == ("configs/tprl.py", [])
    assert parse_argv(["--config=configs/tprl.py:runlocal"]) == ("configs/tprl.py:runlocal", [])
    path, ov = parse_argv(
        [
            "--config.rollout.top_p=0.9",
            "--config",
            "configs/grpo.py",
            "--config.seed",
            "3",
            "--config.val_only",
            "--config.reward.funcs=a=b",
        ]
    )
    assert path == "configs/grpo.py"
    assert ov == ["rollout.top_p=0.9", "seed=3", "val_only", "reward.funcs=a=b"]
    with pytest.raises(ConfigError, match="missing --config"):
        parse_argv(["--config.seed=1"])
    with pytest.raises(ConfigError, match="needs a path"):
        parse_argv(["--config"])
    with pytest.raises(ConfigError, match="unknown argument '--lr=1'"):
        parse_argv(["--config", "configs/grpo.py", "--lr=1"])


def test_scalar_overrides_take_the_type_of_the_value_they_replace():
    c = cfg_of(
        "seed=7",
        "total_steps=1e3",
        "optim.lr=1e-5",
        "rollout.temperature=1",
        "rollout.top_p= 0.95",
        "val_only=True",
        "resume=no",
        "actor.loss_agg_mode=token-mean",
        "data.system_prompt='Be brief.'",
    )
    assert c.seed == 7 and type(c.seed) is int
    assert c.total_steps == 1000 and type(c.total_steps) is int
    assert c.optim.lr == 1e-5 and type(c.rollout.temperature) is float
    assert c.rollout.temperature == 1.0 and c.rollout.top_p == 0.95
    assert c.val_only is True and c.resume is False
    assert c.actor.loss_agg_mode == "token-mean"
    assert c.data.system_prompt == "Be brief."
    assert cfg_of("val_only").val_only is True  # bare flag


def test_none_able_and_tuple_overrides():
    c = cfg_of(
        "model.path=/ckpt/Qwen2.5-VL-3B-Instruct",
        "distributed.num_processes=4",
        "reward.funcs=mc_idx,think_format,mdi",
        "reward.weights=4,1,1",
        "reward.early_weights=(2, 1, 0)",
        "reward.early_steps=3",
        "vgr.token_weight_clip=[0.1, 2]",
        "lora.target_modules=('q_proj',)",
        "data.synthetic_kinds=colour",
    )
    assert c.model.path == "/ckpt/Qwen2.5-VL-3B-Instruct"
    assert c.distributed.num_processes == 4 and type(c.distributed.num_processes) is int
    assert c.reward.funcs == ("mc_idx", "think_format", "mdi")
    assert c.reward.weights == (4.0, 1.0, 1.0) and type(c.reward.weights[0]) is float
    assert c.reward.early_weights == (2, 1, 0)
    assert c.vgr.token_weight_clip == (0.1, 2.0)
    assert c.lora.target_modules == ("q_proj",)
    assert c.data.synthetic_kinds == ("colour",)
    c = cfg_of("model.path=/x", "model.path=None", "data.train_files=null")
    assert c.model.path is None and c.data.train_files is None
    assert cfg_of("reward.early_weights=()").reward.early_weights == ()
    assert cfg_of("filter.replay_buffer.min_mean=-inf").filter.replay_buffer.min_mean == float(
        "-inf"
    )


@pytest.mark.parametrize(
    "item, message",
    [
        ("total_steps=many", "--config.total_steps: expected an int, got 'many'"),
        ("total_steps=1.5", "expected an int"),
        ("optim.lr=fast", "--config.optim.lr: expected a float, got 'fast'"),
        ("val_only=maybe", "--config.val_only: expected a bool"),
        ("seed=None", "expected an int"),
        ("seed", "--config.seed needs a value"),
        ("reward.weights=a,b", "--config.reward.weights: expected a float"),
        ("distributed.num_processes=x", "expected an int"),
    ],
)
def test_bad_values_name_the_key(item, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        cfg_of(item)


def test_unknown_key_lists_close_names_and_the_file():
    with pytest.raises(ConfigError) as e:
        cfg_of("rollout.temprature=0.5")
    msg = str(e.value)
    assert "unknown config key 'rollout.temprature'" in msg
    assert "rollout.temperature" in msg and BASE in msg
    with pytest.raises(ConfigError, match=r"'temperature'.*close names: rollout\.temperature"):
        cfg_of("temperature=0.5")
    with pytest.raises(ConfigError, match=r"tprl\.top_p_perception_tokens"):
        cfg_of("tprl.top_p_perception=0.3")
    # EasyR1 / verl names of settings we name otherwise
    theirs = {
        "worker.actor.ulysses_size=2": r"'worker.actor.ulysses_size'.*close names: mesh\.sequence",
        "actor.max_grad_norm=1.0": r"close names: optim\.grad_clip",
        "worker.actor.model.enable_gradient_checkpointing=true": r"close names: model\.remat_policy",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true":
            r"close names: actor\.offload_optimizer",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2":
            r"close names: rollout\.mesh\.tensor",
        "actor_rollout_ref.rollout.expert_parallel_size=8": r"close names: rollout\.mesh\.expert",
        "actor_rollout_ref.actor.megatron.expert_model_parallel_size=8":
            r"close names: mesh\.expert",
        # a part of the key names it: the reward's file, not the reward model's path
        "custom_reward_function.path=r.py": r"close names: reward\.funcs, model\.path",
        "worker.reward.reward_function=r.py:f": r"close names: reward\.funcs",
        "custom_reward_function.reward_kwargs={}": r"close names: reward\.kwargs, reward\.funcs",
        "actor_rollout_ref.rollout.n=8": r"close names: rollout\.num_generations",
        "data.max_response_length=512": r"close names: rollout\.max_new_tokens",
        "data.train_batch_size=128": r"close names: prompts_per_step",
        "actor_rollout_ref.actor.ppo_mini_batch_size=64": r"close names: actor\.global_batch",
        "reward_model.overlong_buffer.len=512": r"close names: filter\.overlong_buffer_len",
        "algorithm.filter_groups.enable=true": r"close names: filter\.dynamic_sampling,",
        "trainer.total_training_steps=10": r"close names: total_steps",
        "trainer.default_local_dir=/tmp/x": r"close names: workdir",
    }  # fmt: skip
    for item, message in theirs.items():
        with pytest.raises(ConfigError, match=message):
            cfg_of(item)
    with pytest.raises(ConfigError, match=r"'rollout' in .* is a group; set one of: .*top_k"):
        cfg_of("rollout=3")
    with pytest.raises(ConfigError, match="groups: "):  # nothing close: the groups are listed
        cfg_of("zzzzzzzz=1")


def test_validation_of_choices_fractions_and_weights():
    with pytest.raises(ConfigError, match=r"algorithm\.adv_estimator='ppo'.*grpo, rloo, remax"):
        cfg_of("algorithm.adv_estimator=ppo")
    with pytest.raises(ConfigError, match=r"actor\.kl_loss_type='k3'"):
        cfg_of("actor.kl_loss_type=k3")
    with pytest.raises(ConfigError, match=r"tprl\.top_p_perception_tokens=0\.0"):
        cfg_of("tprl.top_p_perception_tokens=0")
    per_func = r".*2 values, one per reward\.funcs item"
    with pytest.raises(ConfigError, match=r"reward\.weights=\(1\.0, 2\.0, 3\.0\)" + per_func):
        cfg_of("reward.weights=1,2,3")
    with pytest.raises(ConfigError, match=r"early_weights=\(1,\)" + per_func + r" \(1 given\)"):
        cfg_of("reward.early_weights=1")
    with pytest.raises(ConfigError, match=r"filter\.filter_key='acc'.*overall, mc_idx, think_"):
        cfg_of("filter.filter_key=acc")
    with pytest.raises(ConfigError, match=r"filter\.dynamic_sampling_metric='mdi'"):
        cfg_of("filter.dynamic_sampling_metric=mdi")
    assert cfg_of("filter.filter_key=mc_idx").filter.filter_key == "mc_idx"
    c = cfg_of(
        "reward.funcs=mc_idx,mdi", "reward.weights=1,1", "filter.dynamic_sampling_metric=mdi"
    )
    assert c.filter.dynamic_sampling_metric == "mdi"
    # two rewards of one name: an error at start that asks for reward.names
    two = ("reward.funcs=('a/flaky.py:flaky', 'b/flaky.py:flaky')", "reward.weights=1,1")
    with pytest.raises(ConfigError, match=r"both named 'flaky'.*config\.reward\.names"):
        cfg_of(*two)
    c = cfg_of(*two, "reward.names=('flaky_a', 'flaky_b')", "filter.filter_key=flaky_b")
    assert c.reward.names == ("flaky_a", "flaky_b")


def test_config_is_locked_and_workdir_defaults_to_runs_name_time():
    c = cfg_of()
    assert re.fullmatch(r"runs/base-\d{8}-\d{6}", c.workdir)
    with pytest.raises(AttributeError):
        c.new_option = 1
    assert cfg_of("workdir=gs://b/run").workdir == "gs://b/run"
    assert default_workdir("configs/tprl.py:runlocal", now=0.0).startswith("runs/tprl-19")


def test_file_arg_and_parse_arg():
    c = load_config(os.path.join(ROOT, "configs/tprl.py:runlocal"), ["total_steps=3"])
    assert c.total_steps == 3 and c.rollout.num_generations == 2 and c.name == "tprl"
    a = parse_arg("runlocal,steps=3,name=x", runlocal=False, steps=1, name="")
    assert a.runlocal is True and a.steps == 3 and a.name == "x"
    assert parse_arg(None, runlocal=False).runlocal is False
    with pytest.raises(ConfigError, match="unknown config argument 'fast'"):
        load_config(os.path.join(ROOT, "configs/tprl.py:fast"))


def test_missing_or_bad_files(tmp_path):
    with pytest.raises(ConfigError, match=r"config file configs/nope\.py not found"):
        load_config("configs/nope.py")
    bad = tmp_path / "bad.py"
    bad.write_text("x = 1\n")
    with pytest.raises(ConfigError, match="defines no get_config"):
        load_config(str(bad))
    with pytest.raises(ConfigError, match=r"README\.md: not a Python file defining get_config"):
        load_config(os.path.join(ROOT, "README.md"))
    for text, message in (
        ("def get_config():\n    return None\n", r"bad\.py: TypeError: get_config\(\) takes 0"),
        ("def get_config(arg=None)\n", r"bad\.py: SyntaxError"),
        # the line of the file that raised, with its source
        (
            "def get_config(arg=None):\n    return {}['x']\n",
            r"bad\.py, line 2 \(return \{\}\['x'\]\): KeyError",
        ),
        (
            "from configs import base\n\n\ndef get_config(arg=None):\n"
            "    c = base.get_config(arg)\n    c.rollout.temperature = 'hot'\n    return c\n",
            r"bad\.py, line 6 \(c\.rollout\.temperature = 'hot'\): TypeError: .*'temperature'",
        ),
    ):
        bad.write_text(text)
        with pytest.raises(ConfigError, match=message):
            load_config(str(bad))


def test_a_misspelt_key_in_a_config_file_is_refused(tmp_path):
    """A preset's `c.actor.clip_ratio_hihg = 0.5` would be a new key that nothing reads; a new
    option declared with setting(...) is welcome."""
    (tmp_path / "typo.py").write_text(
        "from configs import base\n\n\ndef get_config(arg=None):\n"
        "    c = base.get_config(arg)\n    c.actor.clip_ratio_hihg = 0.5\n    return c\n"
    )
    with pytest.raises(
        ConfigError, match=r"'actor\.clip_ratio_hihg' .*close names: actor\.clip_ratio_high"
    ):
        load_config(str(tmp_path / "typo.py"))


BEFORE_THE_MODEL = [
    ("model.attention=splash", r"model\.attention='splash': that kernel runs on TPUs"),
    ("model.attention=cudnn", r"model\.attention='cudnn': that kernel runs on GPUs"),
    ("rollout.mesh.tensor=3", r"config\.rollout\.mesh: .*'tensor': 3"),
    ("data.train_files=/nonexistent/x.jsonl", r"train_files='/nonexistent/x\.jsonl'"),
    ("data.val_files=/nonexistent/v.jsonl", r"val_files='/nonexistent/v\.jsonl'"),
    ("reward.model.path=/nonexistent/rm", r"reward\.model\.path.*/nonexistent/rm"),
    ("data.prompt_key=question", r"no column 'question' for config\.data\.prompt_key"),
]


@pytest.mark.parametrize("override,message", BEFORE_THE_MODEL, ids=[b[0] for b in BEFORE_THE_MODEL])
def test_what_would_end_the_run_later_ends_it_before_the_model_loads(
    override, message, tmp_path, monkeypatch
):
    import json

    import jaxvrl.train as T

    monkeypatch.setattr(T, "load_model", lambda *a: pytest.fail("the model was loaded"))
    (tmp_path / "rows.jsonl").write_text(json.dumps({"problem": "1+1?", "answer": "2"}) + "\n")
    more = [f"data.train_files={tmp_path / 'rows.jsonl'}"] if "prompt_key" in override else []
    c = load_config(
        os.path.join(ROOT, "configs/grpo.py"), [f"workdir={tmp_path / 'run'}", override, *more]
    )
    with pytest.raises(ConfigError, match=message):
        T.run(c)


def test_actor_options_live_only_under_actor():
    c = cfg_of("actor.use_kl_loss=true", "actor.kl_loss_coef=0.05")
    assert c.actor.use_kl_loss is True and c.actor.kl_loss_coef == 0.05
    assert "use_kl_loss" not in c.algorithm and "loss_agg_mode" not in c.algorithm
    with pytest.raises(ConfigError, match=r"close names: actor\.use_kl_loss"):
        cfg_of("algorithm.use_kl_loss=true")


def test_apply_override_on_a_plain_configdict():
    c = ml_collections.ConfigDict({"a": {"b": 1}, "t": (1.0,)})
    apply_override(c, "a.b=2")
    apply_override(c, "t=3,4")
    assert c.a.b == 2 and c.t == (3.0, 4.0) and flat_keys(c) == ["a.b", "t"]


DOCUMENTED_KEYS = [  # the option names docs/algorithms.md and the README document
    "model.path",
    "model.dtype",
    "model.remat_policy",
    "data.train_files",
    "data.val_files",
    "data.image_dir",
    "data.prompt_key",
    "data.answer_key",
    "data.max_prompt_length",
    "data.max_image_side",
    "data.min_pixels",
    "data.max_pixels",
    "rollout.num_generations",
    "rollout.max_new_tokens",
    "rollout.temperature",
    "rollout.top_p",
    "rollout.top_k",
    "algorithm.adv_estimator",
    "algorithm.norm_adv_by_std",
    "algorithm.gamma",
    "algorithm.lam",
    "algorithm.use_kl_in_reward",
    "algorithm.kl_ctrl.type",
    "algorithm.kl_ctrl.kl_coef",
    "algorithm.kl_ctrl.target_kl",
    "algorithm.kl_ctrl.horizon",
    "actor.loss_agg_mode",
    "actor.clip_ratio_low",
    "actor.clip_ratio_high",
    "actor.clip_ratio_dual",
    "actor.use_kl_loss",
    "actor.kl_loss_coef",
    "actor.kl_loss_type",
    "actor.entropy_coef",
    "actor.use_entropy_penalty",
    "actor.entropy_penalty_coef",
    "critic.cliprange_value",
    "tprl.enable_perception_filtering",
    "tprl.top_p_perception_tokens",
    "tprl.black_prob",
    "tprl.enable_entropy_filtering",
    "tprl.top_p_entropy_tokens",
    "tprl.entropy_filter_scope",
    "tprl.enable_trajectory_reweighting",
    "tprl.trajectory_scaling_min",
    "vgr.enable_token_weights",
    "vgr.token_weight_clip",
    "vgr.token_weight_smooth_sigma",
    "vgr.token_weight_last_k_layers",
    "vgr.layer_set",
    "reward.funcs",
    "reward.weights",
    "reward.early_weights",
    "reward.early_steps",
    "reward.mdi_balance_ratio",
    "filter.dynamic_sampling",
    "filter.dynamic_sampling_metric",
    "filter.max_num_gen_batches",
    "filter.online_filtering",
    "filter.filter_low",
    "filter.filter_high",
    "filter.replay_buffer.enable",
    "filter.replay_buffer.min_std",
    "filter.mask_truncated_completions",
    "filter.overlong_buffer_len",
    "filter.overlong_penalty_factor",
    "optim.lr",
    "optim.warmup_steps",
    "optim.weight_decay",
    "optim.grad_clip",
    "optim.micro_batches",
    "prompts_per_step",
    "total_steps",
    "val_freq",
    "val_only",
    "save_freq",
    "seed",
    "workdir",
    "resume",
    "max_nonfinite_steps",
    "mesh.data",
    "mesh.fsdp",
    "mesh.tensor",
    "lora.rank",
    "lora.alpha",
    "lora.dropout",
    "lora.target_modules",
    "reward.model.path",
    "reward.model.weight",
]


def test_base_has_every_documented_option():
    keys = set(flat_keys(cfg_of()))
    assert [k for k in DOCUMENTED_KEYS if k not in keys] == []


@pytest.mark.parametrize("path", CONFIGS)
def test_every_config_loads_and_documents_its_run_command(path):
    c = load_config(os.path.join(ROOT, path), [])
    text = open(os.path.join(ROOT, path)).read()
    assert f"python -m jaxvrl.train --config configs/{os.path.basename(path)}" in text or (
        path.endswith("base.py")
    )
    assert c.model.path is None and c.data.train_files is None  # the embedded default
    assert c.rollout.max_new_tokens <= 32 and c.total_steps <= 100  # small on a CPU


def test_what_each_config_changes():
    get = lambda n: load_config(os.path.join(ROOT, f"configs/{n}.py"), [])
    grpo, dapo, tprl, mdi, vgr = map(get, ("grpo", "dapo", "tprl", "mdi", "vgr"))
    assert grpo.actor.loss_agg_mode == "seq-mean-token-mean" and grpo.algorithm.norm_adv_by_std
    assert dapo.actor.loss_agg_mode == "token-mean"
    assert (dapo.actor.clip_ratio_low, dapo.actor.clip_ratio_high) == (0.2, 0.28)
    assert dapo.filter.dynamic_sampling and not dapo.actor.use_kl_loss
    assert tprl.actor.loss_agg_mode == "token-mean" and tprl.filter.dynamic_sampling
    assert tprl.tprl.enable_perception_filtering and tprl.tprl.enable_entropy_filtering
    assert tprl.tprl.enable_trajectory_reweighting and tprl.tprl.trajectory_scaling_min == 0.8
    assert dict(zip(mdi.reward.funcs, mdi.reward.weights)) == {
        "mc_idx": 4.0,
        "think_format": 1.0,
        "mdi": 1.0,
    }
    assert vgr.vgr.enable_token_weights and vgr.vgr.token_weight_clip == (0.2, 3.0)
    for c in (grpo, dapo, mdi, vgr):
        assert not c.tprl.enable_perception_filtering


def test_help_config_prints_every_key_with_its_value_and_comment(capsys):
    from jaxvrl.config import base_comments
    from jaxvrl.train import main

    main(["--config", "configs/tprl.py", "--config.rollout.temperature=0.7", "--help_config"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("# configs/tprl.py")
    lines = {line.split(" = ", 1)[0]: line for line in out[1:]}
    assert lines["rollout.temperature"].startswith("rollout.temperature = 0.7")
    assert "# kl | abs | mse | low_var_kl" in lines["actor.kl_loss_type"]
    assert "seq-mean-token-sum-norm" in lines["actor.loss_agg_mode"]
    assert "seq-mean" not in lines["actor.clip_ratio_low"]  # a comment is its key's own
    assert set(base_comments("configs/base.py")) <= set(lines)


def test_every_base_key_has_a_comment():
    from jaxvrl.config import base_comments

    comments = base_comments(BASE)
    keys = flat_keys(cfg_of())
    assert keys and [k for k in keys if not comments.get(k)] == []
    assert set(comments) <= set(keys)  # no comment documents a key that does not exist


def test_a_setting_declared_in_one_place_reaches_the_step_with_its_rule(tmp_path):
    """A throwaway key added to a copy of configs/base.py, one line with its rule and nothing
    else: an override sets it, the step's settings carry it once a token method declares it
    (and not before: the step holds only what it reads), its rule refuses a bad value."""
    from jaxvrl.trainer.build import step_config
    from jaxvrl.trainer.methods import TOKEN_METHODS, Term, flag

    src = open(BASE).read()
    anchor = "    c.actor.entropy_coef = "
    assert anchor in src
    line = "    c.actor.throwaway_coef = setting(0.5, PROBABILITY)  # a key no code knows\n"
    (tmp_path / "configs").mkdir()
    path = tmp_path / "configs" / "base.py"
    path.write_text(src.replace(anchor, line + anchor, 1))
    c = load_config(str(path), ["actor.throwaway_coef=0.25"])
    with pytest.raises(KeyError):
        step_config(c).option("actor.throwaway_coef")
    keys = ("actor.throwaway_coef",)
    term = Term("throwaway", "loss", ("logp",), lambda cols, o: (0.0, {}), keys, flag(keys[0]))
    assert step_config(c, table=TOKEN_METHODS + (term,)).option("actor.throwaway_coef") == 0.25
    with pytest.raises(ConfigError, match=r"config\.actor\.throwaway_coef=1\.5 .*in \[0, 1\]"):
        load_config(str(path), ["actor.throwaway_coef=1.5"])


# A user's mistakes: each refused at load, naming its key (the whole run's check is `validate`).
BAD = [
    ("save_freq=-1", r"save_freq=-1 .*>= 0"),
    ("seed=9223372036854775808", r"config\.seed: expected a 64-bit int"),
    ("seed=-1", r"seed=-1 .*in \[0, 9223372036854775808\)"),
    ("model.path=", r"model\.path='' .*null: the embedded one"),  # an unset $MODEL
    ("filter.replay_buffer.min_mean=inf", r"min_mean=inf .*< inf"),  # nothing stored
    ("data.train_files=", r"train_files='' .*null: the built-in task"),
    ("prompts_per_step=1e30", r"prompts_per_step: expected a 64-bit int"),
    ("prompts_per_step=1e12", r"prompts_per_step=1000000000000 .*in \[1, 2147483647\]"),
    ("load_checkpoint_path=abc", r"load_checkpoint_path='abc' .*<dir>/<step>"),
    ("distributed.coordinator_address=abc", r"coordinator_address='abc' .*host:port"),
    ("reward.weights=0,0", r"reward\.weights=\(0\.0, 0\.0\) .*a weight other than 0"),
    ("lora.target_modules=''", r"lora\.target_modules=\(\) .*at least one value"),
    ("reward.early_steps=5", r"early_steps=5 .*exactly when reward\.early_weights are given"),
    ("data.format=rows.py:f", r"data\.format='rows\.py:f' .*null unless data\.train_files"),
    ("reward.weights=nan,1", r"reward\.weights=.*a number \(not NaN\) \(nan is not\)"),
    ("actor.entropy_coef=nan", r"actor\.entropy_coef=nan .*a number \(not NaN\)"),
    ("filter.filter_low=nan", r"filter\.filter_low=nan .*a number \(not NaN\)"),
    ("optim.lr=-1e-3", r"optim\.lr=-0\.001 .*>= 0"),
    ("optim.lr=inf", r"optim\.lr=inf .*a finite number >= 0"),
    ("data.video_fps=inf", r"video_fps=inf .*a finite number > 0"),
    ("reward.weights=inf,1", r"reward\.weights=.*a finite number \(inf is not\)"),
    ("algorithm.rollout_is_band=0.5", r"rollout_is_band=\(0\.5,\) .*2 values \(1 given\)"),
    ("rollout.top_p=1.5", r"rollout\.top_p=1\.5 .*in \(0, 1\]"),
    ("rollout.num_generations=0", r"rollout\.num_generations=0 .*>= 1"),
    ("rollout.max_new_tokens=0", r"rollout\.max_new_tokens=0 .*>= 1"),
    ("rollout.temperature=-1", r"rollout\.temperature=-1\.0 .*>= 0"),
    ("actor.clip_ratio_low=2", r"actor\.clip_ratio_low=2\.0 .*in \[0, 1\)"),
    ("optim.micro_batches=0", r"optim\.micro_batches=0 .*>= 1"),
    ("lora.rank=-1", r"lora\.rank=-1 .*>= 0"),
    ("reward.weights=1,2,3", r"reward\.weights=.*2 values"),
    ("vgr.token_weight_clip=3,0.2", r"vgr\.token_weight_clip=\(3\.0, 0\.2\) .*low <= high"),
    ("filter.replay_buffer.capacity=0", r"replay_buffer\.capacity=0 .*>= 1"),
    ("actor.global_batch_size=3", r"actor\.global_batch_size=3 .*divisor of prompts_per_step"),
    ("mesh.data=-1", r"at most one of mesh\.data, .* \(-1: mesh\.data, mesh\.fsdp\)"),
    ("model.attention=fast", r"model\.attention='fast' .*auto, xla, flash, splash, cudnn"),
    ("lora.quantize=int8", r"lora\.quantize='int8' .*none unless lora\.rank > 0"),
    # settings that would train nothing
    ("rollout.num_generations=1", r"num_generations=1 .*>= 2 with .*grpo or rloo"),
    ("vgr.token_weight_clip=0,0", r"token_weight_clip=\(0\.0, 0\.0\) .*upper bound above 0"),
    ("actor.use_kl_loss=true", r"use_kl_loss=True .*kl_loss_coef > 0"),
]


def test_dapo_splits_any_prompt_count_into_equal_mini_batches():
    """configs/dapo.py updates on half the prompts at a time; an odd count takes its largest
    divisor below half (a prime: one prompt per update); one completion per prompt is refused
    (its dynamic sampling would drop every group)."""
    dapo = os.path.join(ROOT, "configs/dapo.py")
    for prompts, per_update in ((1, 1), (2, 1), (5, 1), (6, 3), (8, 4), (9, 3), (512, 256)):
        c = cfg_of(f"prompts_per_step={prompts}", path=dapo)
        assert c.actor.global_batch_size == per_update, prompts
    assert (
        cfg_of("prompts_per_step=8", "actor.global_batch_size=2", path=dapo).actor.global_batch_size
        == 2
    )
    with pytest.raises(ConfigError, match=r"dynamic_sampling=True .*num_generations=1"):
        cfg_of("rollout.num_generations=1", "algorithm.adv_estimator=remax", path=dapo)


@pytest.mark.parametrize("override,message", BAD, ids=[b[0] for b in BAD])
def test_a_bad_value_is_refused_naming_its_key(override, message):
    with pytest.raises(ConfigError, match=message):
        cfg_of(override)


def test_rollout_devices_that_leave_no_device_to_train_name_that_key():
    from jaxvrl.trainer.setup import training_mesh

    with pytest.raises(ConfigError, match=r"^config\.rollout\.devices=1: .* of the 1 devices$"):
        training_mesh(cfg_of("rollout.devices=1"))  # the one CPU device of the tests


@pytest.mark.parametrize(
    "overrides,warning",
    [
        ((), None),
        (("rollout.temperature=0",), r"^rollout\.temperature=0 samples greedily: .*advantage is 0"),
        (
            ("rollout.top_k=1", "algorithm.adv_estimator=remax"),
            r"^rollout\.top_k=1 samples greedily",
        ),
        (("rollout.temperature=0", "algorithm.adv_estimator=gae"), None),
        (
            ("actor.kl_loss_coef=0.1",),
            r"^actor\.kl_loss_coef=0\.1 does nothing without .*use_kl_loss",
        ),
        (
            ("algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.kl_coef=0"),
            r"kl_coef=0 subtracts",
        ),
        (("algorithm.kl_ctrl.type=adaptive",), r"type=adaptive does nothing without .*_in_reward"),
        (
            ("optim.min_lr_ratio=0.1",),
            r"min_lr_ratio=0\.1 does nothing with optim\.schedule=constant",
        ),
        (("optim.min_lr_ratio=0.1", "optim.schedule=cosine"), None),
        (("lora.train_vision=true",), r"train_vision=true does nothing without lora\.rank > 0"),
        (("actor.max_token_len_per_device=64",), r"=64 does nothing without .*dynamic_batching"),
    ],
)
def test_settings_that_do_nothing_or_train_nothing_are_warned_of(overrides, warning):
    """One line at start naming the keys, not a refusal: a deterministic (greedy) rollout is
    how runs are checked against references, and a sweep may switch a feature off and leave
    its settings."""
    from jaxvrl.trainer.setup import inert_settings

    got = inert_settings(cfg_of(*overrides))
    if warning is None:
        assert got == []
    else:
        assert len(got) == 1 and re.search(warning, got[0]), got


def test_settings_that_would_do_nothing_or_something_else_are_refused():
    with pytest.raises(ConfigError, match=r"rollout\.partial=True .*remax"):
        cfg_of("rollout.partial=true", "algorithm.adv_estimator=remax")
    with pytest.raises(ConfigError, match=r"max_staleness=0 .*>= 1 with rollout\.partial"):
        cfg_of("rollout.partial=true", "rollout.max_staleness=0")
    with pytest.raises(ConfigError, match=r"online_filtering=True .*num_generations=1"):
        cfg_of("filter.online_filtering=true", "rollout.num_generations=1",
               "algorithm.adv_estimator=remax")  # fmt: skip
    path = os.path.join(ROOT, "configs/ppo.py")
    with pytest.raises(ConfigError, match=r"critic\.warmup_steps=60 .*< total_steps"):
        cfg_of("critic.warmup_steps=60", "total_steps=60", path=path)
    with pytest.raises(ConfigError, match=r"reward\.names=\('model', 'f'\) .*reward model's"):
        cfg_of("reward.model.path=rm", "reward.names=model,f")
    # where inf turns a cap or a bound off, it is a value
    c = cfg_of("optim.grad_clip=inf", "reward.timeout_s=inf", "actor.old_logprobs=recompute",
               "algorithm.rollout_is_band=(0.5, inf)", "filter.replay_buffer.max_mean=inf")  # fmt: skip
    assert c.optim.grad_clip == c.reward.timeout_s == c.algorithm.rollout_is_band[1] == math.inf
    from jaxvrl.data.from_config import encode_options

    # the built-in task's system prompt unless one is given, "" (none) included
    assert encode_options(cfg_of()).system_prompt
    assert encode_options(cfg_of("data.system_prompt=")).system_prompt == ""


def test_val_only_needs_held_out_rows():
    assert cfg_of("val_only=true").val_only  # the built-in task's val_size rows
    assert cfg_of("val_only=true", "data.train_files=t.jsonl", "data.val_files=v.jsonl").val_only
    for extra in ("val_size=0", "data.train_files=t.jsonl"):
        with pytest.raises(ConfigError, match=r"val_only=True .*held-out rows"):
            cfg_of("val_only=true", extra)


def test_zero_frequencies_mean_only_at_the_end():
    c = cfg_of("val_freq=0", "save_freq=0", "log_rollouts_every=0")
    assert (c.val_freq, c.save_freq, c.log_rollouts_every) == (0, 0, 0)


def test_the_cli_prints_a_users_error_in_one_line():
    import subprocess
    import sys

    res = subprocess.run(
        [sys.executable, "-m", "jaxvrl.train", "--config", BASE, "--config.optim.lr=-1e-3"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert res.returncode == 2, res.stderr[-2000:]
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert lines[-1].startswith("error: config.optim.lr=-0.001") and "Traceback" not in res.stderr


def test_a_workdir_that_cannot_be_written_ends_the_run_before_loading(tmp_path):
    from jaxvrl.train import run

    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    c = cfg_of(f"workdir={blocker}/run", path=os.path.join(ROOT, "configs", "grpo.py"))
    with pytest.raises(ConfigError, match=r"config\.workdir=.*a_file/run.*cannot be written"):
        run(c)
