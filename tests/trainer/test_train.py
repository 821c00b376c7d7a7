"""The main job end to end on the embedded default: every config runs, resume equals an
uninterrupted run (with partial rollouts: rows in flight at the checkpoint), SIGTERM saves and exits, one compilation per shape, config errors."""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from jaxvrl.config import ConfigError, load_config, parse_argv, validate
from jaxvrl.train import run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# every config a user runs; configs/base.py is configs/grpo.py under another name (grpo's
# get_config is base's with c.name set), so grpo's run covers it
CONFIGS = sorted(
    os.path.relpath(p, ROOT)
    for p in glob.glob(os.path.join(ROOT, "configs", "*.py"))
    if not p.endswith(("__init__.py", "base.py"))
)
TINY = [
    "prompts_per_step=2",
    "rollout.num_generations=2",
    "rollout.max_new_tokens=8",
    "val_size=4",
    "data.synthetic_train_size=16",
    "log_rollouts_every=1",
    "logging.attention_samples=0",  # the pictures have their own test (test_diagnostics.py)
]


def tiny_config(path, workdir, *extra):
    overrides = TINY + [f"workdir={workdir}", *extra]
    return load_config(os.path.join(ROOT, path), overrides)


def _two_steps(path, workdir):
    cfg = tiny_config(path, workdir, "total_steps=2", "val_freq=2")
    return cfg, run(cfg)


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory):
    """configs/ppo.py's two steps: (workdir, config, metrics). A run started from its
    checkpoint reads it too (test_load_checkpoint_path_starts_from_...)."""
    workdir = tmp_path_factory.mktemp("ppo")
    return workdir, *_two_steps("configs/ppo.py", workdir)


@pytest.mark.parametrize("path", CONFIGS)
def test_every_config_runs_two_steps(path, tmp_path, request):
    assert f"python -m jaxvrl.train --config {path}" in open(os.path.join(ROOT, path)).read()
    if path == "configs/ppo.py":
        tmp_path, cfg, metrics = request.getfixturevalue("ppo_run")
    else:
        cfg, metrics = _two_steps(path, tmp_path)
    assert np.isfinite(metrics["loss"]) and "val/accuracy" in metrics
    # one program per batch shape (completion columns, packed buffers): no step recompiles
    assert metrics["compiles/train_step"] == metrics["compiles/train_step_shapes"] <= 2
    # at most one new program per sampler in this run (none if an earlier test in this process
    # already compiled the same shape)
    assert metrics["compiles/sampler"] <= 1 and metrics["compiles/greedy_sampler"] <= 1
    if path == "configs/mdi.py":  # the greedy completions' own attention, not a neutral 0
        assert metrics["val/reward/mdi"] != 0
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for key in (
        "reward/total",
        "loss",
        "kl",
        "entropy",
        "perception_token_fraction",
        "scaling_factor_mean",
        "tokens_per_s",
        "rollout/tokens_per_s",
    ):
        assert key in rows[-1], key
    for r in rows[1:]:  # generated tokens / (rows x decode steps) = mean length / steps
        assert 0 < r["rollout/slot_utilization"] <= 1, r
        # the sampler's two programs, each waited for, inside the sampling time
        spent = r["rollout/prefill_s"] + r["rollout/decode_s"]
        assert r["rollout/prefill_s"] > 0 and r["rollout/decode_s"] > 0, r
        assert spent <= r["rollout/sample_s"], r
        if r["rollout/gen_batches"] == 1 and not cfg.filter.mask_truncated_completions:
            want = r["response_length"] / r["rollout/decode_steps"]
            assert abs(r["rollout/slot_utilization"] - want) < 1e-9 and 0 < want <= 1, r
    assert (tmp_path / "rollout_results.md").read_text().count("### Sample") >= 2
    assert glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))
    if path.endswith("ppo.py"):  # the critic, its optimizer and the adaptive KL run and are saved
        for key in ("train/vf_loss", "train/critic_grad_norm", "train/kl_coef", "train/kl_reward"):
            assert np.isfinite(rows[-1][key]), key
        assert rows[-1]["train/policy_updated"] == 1
        _, arrays = _final_params(tmp_path)
        assert any("critic_params" in k and "head" in k for k in arrays)
        assert any("kl_coef" in k for k in arrays)


def _final_item(workdir, item: str):
    """(latest step, that checkpoint's `item`: "state", "meta", ...)."""
    from jaxvrl.checkpoint import Checkpointer

    ck = Checkpointer(os.path.join(workdir, "checkpoints"))
    step = ck.latest_step()
    value = ck.manager.restore(step)[item]
    ck.close()
    return step, value


def _final_params(workdir):
    step, arrays = _final_item(workdir, "state")
    return step, {k: np.asarray(v) for k, v in arrays.items()}


def test_resume_equals_uninterrupted_run(tmp_path, monkeypatch):
    import collections

    from jaxvrl.parallel import runtime

    # no step program kept from earlier tests: the first run compiles its own, and the two
    # runs after it (the same step settings) reuse that one
    monkeypatch.setattr(runtime, "_KEPT", collections.OrderedDict())
    a, b = tmp_path / "a", tmp_path / "b"
    # partial rollouts: the checkpoint also holds the rows in flight (and the data drawn for
    # them), which the resumed run continues (host offload of the optimizer and reference,
    # resumed: tests/parallel/test_mesh_main_job.py)
    keys = ["save_freq=0", "val_freq=100", "rollout.slots=2", "rollout.partial=true"]
    whole = run(tiny_config("configs/tprl.py", a, "total_steps=4", *keys))
    (kept,) = runtime._KEPT.values()
    half = run(tiny_config("configs/tprl.py", b, "total_steps=2", *keys))
    assert half["rollout/carried_rows"] > 0
    rest = run(tiny_config("configs/tprl.py", b, "total_steps=4", *keys))
    assert [p is kept for p in runtime._KEPT.values()] == [True]  # one program for the three
    for m in (half, rest):  # programs only for shapes the first run did not train
        assert m["compiles/train_step"] == m["compiles/train_step_shapes"], m
    sa, pa = _final_params(a)
    sb, pb = _final_params(b)
    assert sa == sb == 4
    assert pa.keys() == pb.keys()
    for k in pa:
        np.testing.assert_array_equal(pa[k], pb[k], err_msg=k)
    steps = [json.loads(line)["step"] for line in open(b / "metrics.jsonl")]
    assert steps == [0, 1, 2, 3, 4]  # the resumed run continues at step 3, no repeats
    # the checkpoint keeps the step shapes compiled so far (a resumed run reuses them as
    # the uninterrupted run does); the logged shapes agree
    shapes = [_final_item(d, "meta")[1]["step_shapes"] for d in (a, b)]
    assert len(shapes[0]) == whole["compiles/train_step"] and shapes[0] == shapes[1]
    shape = lambda d: [  # noqa: E731
        [r.get(k) for k in ("train/completion_columns", "train/pack_buffers")]
        for r in map(json.loads, open(d / "metrics.jsonl"))
    ]
    assert shape(a) == shape(b)
    # the last step's metrics, all but times and compile counts
    rows = [list(map(json.loads, open(d / "metrics.jsonl")))[-1] for d in (a, b)]
    timeless = [
        {k: v for k, v in r.items() if not k.endswith("_s") and not k.startswith("compiles/")}
        for r in rows
    ]
    assert timeless[0] == timeless[1] and "rollout/staleness_mean" in timeless[0]


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path):
    args = [
        sys.executable,
        "-m",
        "jaxvrl.train",
        "--config",
        "configs/grpo.py",
        *[f"--config.{o}" for o in TINY],
        "--config.total_steps=500",
        "--config.val_freq=1000",
        "--config.save_freq=0",
        f"--config.workdir={tmp_path}",
    ]
    proc = subprocess.Popen(
        args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.time() + 300
    metrics = tmp_path / "metrics.jsonl"
    while time.time() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert "SIGTERM" in out
    step, _ = _final_params(tmp_path)
    assert 2 <= step < 500


def test_sigterm_during_the_first_validation_stops_before_the_first_step(
    tmp_path, monkeypatch, capsys
):
    """The flag is set from the first validation on (before, the signal killed the process;
    on a pod jax.distributed's handler took it and the run trained on, to be killed
    unsaved): the run stops before its first step, with the validation logged."""
    from jaxvrl import train

    real = train.make_validate

    def signalled(*args, **kwargs):
        validate = real(*args, **kwargs)

        def first(params):
            os.kill(os.getpid(), signal.SIGTERM)
            return validate(params)

        return first

    monkeypatch.setattr(train, "make_validate", signalled)
    handler = signal.getsignal(signal.SIGTERM)
    run(tiny_config("configs/grpo.py", tmp_path, "total_steps=3"))
    assert "stopping before step 1 (SIGTERM)" in capsys.readouterr().out
    assert [r["step"] for r in _rows(tmp_path)] == [0]
    assert signal.getsignal(signal.SIGTERM) is handler  # the flag is gone again


def test_config_overrides_and_errors(tmp_path):
    path, overrides = parse_argv(
        [
            "--config",
            "configs/tprl.py",
            "--config.rollout.top_p=0.9",
            "--config.vgr.token_weight_clip=(0.1, 2.0)",
            "--config.actor.use_kl_loss",
            "true",
            "--config.actor.kl_loss_coef=0.01",
        ]
    )
    cfg = load_config(os.path.join(ROOT, path), overrides + [f"workdir={tmp_path}"])
    assert cfg.rollout.top_p == 0.9 and cfg.actor.use_kl_loss is True
    assert tuple(cfg.vgr.token_weight_clip) == (0.1, 2.0)
    assert cfg.tprl.enable_perception_filtering
    with pytest.raises(
        ConfigError, match=r"unknown config key 'rollout.temprature'.*rollout\.temperature"
    ):
        load_config(os.path.join(ROOT, "configs/tprl.py"), ["rollout.temprature=0.5"])
    with pytest.raises(ConfigError, match="expected an int"):
        load_config(os.path.join(ROOT, "configs/tprl.py"), ["total_steps=many"])
    with pytest.raises(ConfigError, match="not found"):
        load_config("configs/nope.py")


def test_rows_must_split_over_the_mesh_and_the_micro_batches():
    from types import SimpleNamespace

    from jaxvrl.trainer.setup import check_rows

    mesh = SimpleNamespace(shape={"data": 1, "fsdp": 2, "tensor": 1})
    c = load_config(os.path.join(ROOT, "configs/grpo.py"), ["prompts_per_step=3"])
    c.rollout.num_generations = 4
    check_rows(c, mesh)  # 12 rows, 2 devices, 1 micro-batch
    c.optim.micro_batches = 5
    with pytest.raises(ConfigError, match=r"micro_batches = 5 does not divide the 12 rows"):
        check_rows(c, mesh)
    c.optim.micro_batches, c.rollout.num_generations = 1, 3
    with pytest.raises(ConfigError, match=r"9 rows per process.*2 devices"):
        check_rows(c, mesh)
    c = load_config(os.path.join(ROOT, "configs/grpo.py"), ["prompts_per_step=6"])
    c.rollout.num_generations = 2
    c.actor.global_batch_size = 3  # 2 mini-batches of 6 rows
    check_rows(c, mesh)
    c.actor.global_batch_size = 4  # a rule of the setting, checked before the mesh exists
    with pytest.raises(ConfigError, match=r"global_batch_size=4 .*divisor of prompts_per_step"):
        validate(c)
    c.actor.global_batch_size, c.optim.micro_batches = 3, 4
    with pytest.raises(
        ConfigError, match=r"micro_batches = 4 does not divide the 6 rows of a mini"
    ):
        check_rows(c, mesh)
    c.optim.micro_batches, c.prompts_per_step, c.actor.global_batch_size = 1, 4, 1
    with pytest.raises(ConfigError, match=r"global_batch_size = 1: a mini-batch's 2 rows"):
        check_rows(c, SimpleNamespace(shape={"data": 1, "fsdp": 4, "tensor": 1}))
    with pytest.raises(ConfigError, match=r"rollout_is='token'.*old_logprobs=recompute"):
        load_config(os.path.join(ROOT, "configs/grpo.py"), ["algorithm.rollout_is=token"])


def test_rollout_correction_with_a_band_logs_its_metrics(tmp_path):
    """old_logprobs=recompute, rollout_is=token and an IcePop band: the step row of
    metrics.jsonl carries the applied weights' mean, the truncated and the masked shares."""
    cfg = tiny_config(
        "configs/grpo.py",
        tmp_path,
        "total_steps=1",
        "val_size=0",
        "actor.old_logprobs=recompute",
        "algorithm.rollout_is=token",
        "algorithm.rollout_is_band=(0.5, 2.0)",
    )
    run(cfg)
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    row = rows[-1]
    assert row["step"] == 1 and np.isfinite(row["rollout/logprob_abs_diff_mean"])
    assert 0 < row["train/rollout_is_mean"] <= 2.0  # the threshold
    for key in ("train/rollout_is_clip_frac", "train/rollout_is_band_frac"):
        assert 0 <= row[key] <= 1, key


LABEL_REWARD = '''
import json

def reward(completions, label_idx=None, **kw):
    """0/1 alternating within the group for prompts with label 1 (informative), else 0."""
    with open({log!r}, "a") as f:
        f.write(json.dumps([int(x) for x in label_idx]) + "\\n")
    return [float(i % 2) if label_idx[i] == 1 else 0.0 for i in range(len(completions))]


def reward_common(completions, label_idx=None, **kw):
    """The same, informative for every label but 0."""
    with open({log!r}, "a") as f:
        f.write(json.dumps([int(x) for x in label_idx]) + "\\n")
    return [float(i % 2) if label_idx[i] != 0 else 0.0 for i in range(len(completions))]


def broken(completions, **kw):
    raise RuntimeError("this reward is broken")
'''


def _reward_file(tmp_path):
    log = tmp_path / "reward_calls.jsonl"
    path = tmp_path / "label_reward.py"
    path.write_text(LABEL_REWARD.format(log=str(log)))
    return f"{path}:reward", f"{path}:broken", log


def _informative_groups(labels, informative=(1,), g=2):
    """Per group of one reward call: is its label an informative one?"""
    return [labels[i] in informative for i in range(0, len(labels), g)]


def _rows(workdir):
    return [json.loads(line) for line in open(workdir / "metrics.jsonl")]


def test_dynamic_sampling_refills_with_new_generation_batches(tmp_path):
    fn, _, log = _reward_file(tmp_path)
    cfg = tiny_config(
        "configs/dapo.py",
        tmp_path,
        "total_steps=3",
        "val_size=0",  # validation scores with the training rewards too: no calls but the steps'
        f"reward.funcs=('{fn}',)",
        "reward.weights=(1.0,)",
        "filter.max_num_gen_batches=3",
        "log_samples=8",
    )
    metrics = run(cfg)
    # one program per batch shape (padding groups keep the prompt and patch buckets)
    assert metrics["compiles/train_step"] == metrics["compiles/train_step_shapes"] <= 2
    calls = [json.loads(line) for line in open(log)]
    # replay the collection from the reward calls: generation batches per step until 2
    # informative groups or 3 batches
    expected, i = [], 0
    for _ in range(3):
        n, kept = 0, 0
        while kept < 2 and n < 3:
            kept += sum(_informative_groups(calls[i]))
            i, n = i + 1, n + 1
        expected.append((n, min(kept, 2) / 2))
    assert i == len(calls)
    rows = [r for r in _rows(tmp_path) if r["step"] > 0]
    assert [(r["rollout/gen_batches"], r["rollout/filled_fraction"]) for r in rows] == expected
    assert sum(n for n, _ in expected) > 3  # the refill happened
    # the samples come from every group sampled, kept (first) or filtered (marked): the
    # batch holds only informative groups (each kept pair has rewards 0 and 1), and a step
    # that kept nothing still shows its samples
    text = (tmp_path / "rollout_results.md").read_text()
    for step, (n, filled) in enumerate(expected, start=1):
        section = text.split(f"## Step {step}\n")[1].split("## Step")[0]
        samples = section.split("### Sample")[1:]
        assert len(samples) == min(8, 4 * n), step  # n batches of 2 groups of 2
        totals = [float(re.search(r"\| \*\*total\*\* \| ([-\d.]+) \|", s)[1]) for s in samples]
        kept = ["(filtered)" not in s.splitlines()[0] for s in samples]
        for i in range(0, len(samples), 2):
            assert kept[i] == kept[i + 1], (step, kept)
            assert not kept[i] or totals[i : i + 2] == [0.0, 1.0], (step, totals)
        assert kept == sorted(kept, reverse=True) and any(kept) == bool(filled), (step, kept)


def test_replay_buffer_replaces_uninformative_groups(tmp_path):
    fn, _, log = _reward_file(tmp_path)
    cfg = tiny_config(
        "configs/grpo.py",
        tmp_path,
        "total_steps=4",
        "val_size=0",  # validation scores with the training rewards too: no calls but the steps'
        f"reward.funcs=('{fn}_common',)",
        "reward.weights=(1.0,)",
        "filter.replay_buffer.enable=true",
    )
    run(cfg)
    calls = [json.loads(line) for line in open(log)]
    assert len(calls) == 4  # one generation batch per step without dynamic sampling
    size, expected = 0, []
    for labels in calls:
        informative = _informative_groups(labels, (1, 2, 3))
        replaced = min(size, informative.count(False))
        size = size - replaced + informative.count(True)
        expected.append((replaced, size))
    rows = [r for r in _rows(tmp_path) if r["step"] > 0]
    assert [(r["replay/replaced"], r["replay/buffer_size"]) for r in rows] == expected
    assert sum(r for r, _ in expected) > 0


SUB_SCORES = """
import json

def scored(data_source, solution_str, ground_truth, extra_info=None):
    out = {{"score": 0.5, "chars": float(len(solution_str))}}
    if len(solution_str) % 2:  # a sub-score only some rows have
        out["odd_chars"] = float(len(solution_str))
    with open({log!r}, "a") as f:
        f.write(json.dumps(out) + "\\n")
    return out
"""


def test_a_reward_that_raises_gives_zero_and_training_goes_on(tmp_path, caplog):
    _, broken, _ = _reward_file(tmp_path)
    log = tmp_path / "scored.jsonl"  # and a verl reward with sub-scores, logged at validation
    (tmp_path / "scored.py").write_text(SUB_SCORES.format(log=str(log)))
    cfg = tiny_config(
        "configs/grpo.py",
        tmp_path,
        "total_steps=2",
        "val_freq=100",
        f"reward.funcs=('mc_idx', '{broken}', '{tmp_path / 'scored.py'}:scored')",
        "reward.weights=(1.0, 1.0, 0.0)",
    )
    with caplog.at_level("ERROR", logger="jaxvrl"):
        metrics = run(cfg)
    assert np.isfinite(metrics["loss"])
    # the final validation's calls are the last val_size: each sub-score's mean over the rows
    # that have it
    val = [json.loads(line) for line in open(log)][-cfg.val_size :]
    assert metrics["val/reward/scored"] == 0.5
    assert metrics["val/reward/scored/chars"] == pytest.approx(np.mean([r["chars"] for r in val]))
    odd = [r["odd_chars"] for r in val if "odd_chars" in r]
    assert metrics.get("val/reward/scored/odd_chars") == (
        pytest.approx(np.mean(odd)) if odd else None
    )
    # logged under the function's name, not its file path
    # two rollout calls and the final validation's (val/reward/broken)
    assert metrics["reward/broken"] == 0.0 and metrics["reward/broken_failures"] == 3
    assert (
        caplog.text.count("RuntimeError: this reward is broken") == 1
    )  # the traceback is logged once


def test_non_finite_steps_are_skipped_then_the_run_stops_with_a_clear_message(
    tmp_path, monkeypatch
):
    import jax.numpy as jnp

    import jaxvrl.train as train

    real = train.build_train_step

    def poisoned(graphdef, tx, cfg):
        step = real(graphdef, tx, cfg)

        def nan_rewards(state, ref, batch, key):
            return step(state, ref, batch.replace(rewards=batch.rewards * jnp.nan), key)

        return nan_rewards

    monkeypatch.setattr(train, "build_train_step", poisoned)
    cfg = tiny_config(
        "configs/grpo.py", tmp_path, "total_steps=10", "val_freq=100", "max_nonfinite_steps=3"
    )
    with pytest.raises(FloatingPointError, match=r"3 consecutive steps with a non-finite loss"):
        run(cfg)
    rows = _rows(tmp_path)[1:]
    assert [r["train/nonfinite"] for r in rows] == [1.0, 1.0, 1.0]
    assert all(r["loss"] is None for r in rows)  # NaN is written as null


def test_training_data_without_one_usable_row_stops_with_the_reasons(tmp_path):
    from jaxvrl.data.rows import DataError

    data = tmp_path / "bad.jsonl"
    rows = [{"problem": f"q{i}?", "answer": None} for i in range(3)]  # a label column, empty
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = tiny_config("configs/grpo.py", tmp_path, "total_steps=2", f"data.train_files={data}")
    with pytest.raises(DataError, match=r"no usable row among the 3 rows.*missing_label': 3"):
        run(cfg)


def test_remax_uses_the_greedy_completion_reward_as_baseline(tmp_path):
    """The baseline is the greedy completion's total reward, here the mdi reward alone: from
    the greedy completion's own attention (a neutral 0 without it)."""
    cfg = tiny_config("configs/mdi.py", tmp_path, "total_steps=2", "val_freq=2",
                      "algorithm.adv_estimator=remax", "reward.funcs=('mdi',)",
                      "reward.weights=(1.0,)")  # fmt: skip
    metrics = run(cfg)
    assert np.isfinite(metrics["loss"]) and "reward/greedy_baseline" in metrics
    assert metrics["reward/greedy_baseline"] != 0 and metrics["val/reward/mdi"] != 0
    assert metrics["compiles/greedy_sampler"] <= 1  # the validation shape: no extra program
    # advantage = reward - the prompt's greedy reward, so its mean is the difference of means
    # over the batch's rows (every group is real without dynamic sampling)
    rows = _rows(tmp_path)[1:]
    for r in rows:
        assert r["train/advantage_mean"] == pytest.approx(
            r["reward/total"] - r["reward/greedy_baseline"], abs=1e-5
        )


def test_load_checkpoint_path_starts_from_that_checkpoints_parameters(tmp_path, ppo_run):
    """A GRPO run started from a PPO run's checkpoint reads its policy parameters only (not
    its critic or optimizer state, which the GRPO run does not have)."""
    a, b = ppo_run[0], tmp_path / "b"
    run(
        tiny_config(
            "configs/grpo.py",
            b,
            "total_steps=1",
            "val_freq=100",
            "optim.lr=0.0",
            f"load_checkpoint_path={a / 'checkpoints' / '2'}",
        )
    )
    (sa, pa), (sb, pb) = _final_params(a), _final_params(b)
    assert (sa, sb) == (2, 1)
    params = [k for k in pa if k.startswith("params/")]
    assert params
    for k in params:  # lr 0: step 1 kept the loaded parameters
        np.testing.assert_array_equal(pa[k], pb[k], err_msg=k)
    from flax import nnx

    from jaxvrl.checkpoint import tree_keys
    from jaxvrl.models.qwen2_5_vl import load
    from jaxvrl.train import EMBEDDED

    init = nnx.state(load(EMBEDDED), nnx.Param)
    init = dict(zip(tree_keys(init), map(np.asarray, jax.tree.leaves(init))))
    assert any(not np.array_equal(pa[k], init[k.removeprefix("params/")]) for k in params)
    assert any(k.startswith("critic") for k in pa)  # the PPO run's, left unread
    # other parameters than the run's (a LoRA run's, another model's): one line naming them
    with pytest.raises(ConfigError, match=r"load_checkpoint_path=.*holds other parameters"):
        run(tiny_config("configs/grpo.py", tmp_path / "c", "total_steps=1", "lora.rank=2",
                        f"load_checkpoint_path={a / 'checkpoints' / '2'}"))  # fmt: skip


def test_matmul_precision_is_a_context_of_the_run_not_a_process_flag():
    import jax
    import jax.numpy as jnp

    from jaxvrl.config import ConfigError
    from jaxvrl.trainer import setup

    before = jax.config.jax_default_matmul_precision
    x = jnp.ones((4, 4))
    texts = {}
    for name in ("default", "highest"):
        with setup.matmul_precision(name):
            texts[name] = jax.jit(jnp.matmul).lower(x, x).as_text()
    assert "HIGHEST" in texts["highest"] and "HIGHEST" not in texts["default"]
    assert jax.config.jax_default_matmul_precision == before
    with pytest.raises(ConfigError, match="matmul_precision='fast'"):
        setup.matmul_precision("fast")


FLAKY_REWARD = """
def flaky(completions, label_idx=None, **kw):
    if 0 in label_idx:  # raises on every generation batch holding the label-0 row
        raise RuntimeError("flaky")
    return [float(i % 2) if label_idx[i] == 1 else 0.0 for i in range(len(completions))]
"""


def _data_with_a_bad_row_of_each_reason(tmp_path):
    from PIL import Image

    from jaxvrl.data import synthetic
    from jaxvrl.data.rows import REASONS

    rows = []
    # an epoch (23 rows) spans several steps, and the run reads it more than once
    for i, r in enumerate(synthetic.make_split("train", 16, seed=0)):
        r["images"][0].save(tmp_path / f"img{i}.png")
        rows.append({**r, "images": [f"img{i}.png"]})
    Image.new("RGB", (80, 80)).save(tmp_path / "big.png")  # over data.max_image_side=64
    (tmp_path / "corrupt.png").write_bytes(b"not a png")
    good = rows[1]
    rows += [
        {k: v for k, v in good.items() if k != "problem"},
        {**good, "label_idx": None, "answer": None},
        {**good, "images": ["missing.png"]},
        {**good, "images": ["corrupt.png"]},
        {**good, "images": ["big.png"]},
        {**good, "problem": "why? " * 300},
        {**good, "problem": "<image> or <image>? " + good["problem"]},  # 2 placeholders, 1 image
    ]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # a vision-language model's run on raw rows: the reasons of a text-only model, a format
    # function, video files and rows that fail otherwise are counted in tests/data
    other = ("media_for_text_model", "video_file", "format_error", "bad_row")
    return data, tuple(r for r in REASONS if r not in other)


def test_counters_after_a_sigterm_and_resume_equal_an_uninterrupted_runs(tmp_path, monkeypatch):
    """Rows skipped per reason (some before the stop, the rest after; all seen again in later
    epochs), failures of a reward that raises on a fixed schedule, generation batches and
    non-finite updates: the last metrics row of a run stopped by SIGTERM at step 3 and resumed
    equals an uninterrupted run's. With dynamic sampling and a replay buffer of 2 groups that
    fills empty slots before and after the stop (step 4 replays groups stored by step 3), every step's rewards, filtering and
    replay metrics and the final parameters are the same bit for bit (the checkpoint keeps
    the buffer)."""
    import jax.numpy as jnp

    import jaxvrl.train as train

    data, reasons = _data_with_a_bad_row_of_each_reason(tmp_path)
    (tmp_path / "flaky.py").write_text(FLAKY_REWARD)
    real_step = train.build_train_step

    def nan_at_step_2(graphdef, tx, cfg):  # traced: the same schedule in every run
        step = real_step(graphdef, tx, cfg)

        def poisoned(state, ref, batch, key):
            nan = jnp.where(state.step == 1, jnp.nan, 1.0)
            return step(state, ref, batch.replace(rewards=batch.rewards * nan), key)

        return poisoned

    monkeypatch.setattr(train, "build_train_step", nan_at_step_2)

    def config(workdir):
        return tiny_config(
            "configs/dapo.py",
            workdir,
            "total_steps=8",
            "val_before_train=false",
            "filter.max_num_gen_batches=2",
            f"data.train_files={data}",
            f"data.image_dir={tmp_path}",
            "data.max_image_side=64",
            f"reward.funcs=('{tmp_path / 'flaky.py'}:flaky',)",
            "reward.weights=(1.0,)",
            "filter.replay_buffer.enable=true",
            "filter.replay_buffer.capacity=2",
        )

    a, b = tmp_path / "a", tmp_path / "b"
    run(config(a))
    real_scalars, calls = train.step_scalars, []

    def sigterm_after_step_3(*args):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_scalars(*args)

    monkeypatch.setattr(train, "step_scalars", sigterm_after_step_3)
    run(config(b))
    assert [r["step"] for r in _rows(b)] == [1, 2, 3]
    monkeypatch.setattr(train, "step_scalars", real_scalars)
    run(config(b))

    ra, rb = _rows(a), _rows(b)
    assert [r["step"] for r in rb] == list(range(1, 9))
    assert np.isfinite(ra[-1]["loss"]) and np.isfinite(rb[-1]["loss"])  # training goes on
    counters = [
        k for k in ra[-1] if k.startswith("data/skipped_") or k.endswith(("_failures", "_total"))
    ]
    assert {k: ra[-1][k] for k in counters} == {k: rb[-1][k] for k in counters}
    assert {r: ra[-1][f"data/skipped_{r}"] for r in reasons} == dict.fromkeys(reasons, 1)
    assert 0 < sum(v for k, v in rb[1].items() if k.startswith("data/skipped_")) < len(reasons)
    # dapo makes 2 updates per step: both skipped at step 2
    assert ra[-1]["train/nonfinite_total"] == ra[1]["train/nonfinite"] == 2
    assert ra[-1]["rollout/gen_batches_total"] == sum(r["rollout/gen_batches"] for r in ra)
    assert rb[1]["reward/flaky_failures"] > 0  # before the stop, and counted on after it
    for r0, r1 in zip(rb, rb[1:]):
        assert all(r1.get(k, 0) >= r0.get(k, 0) for k in counters), (r0["step"], r1["step"])
    assert rb[-1]["reward/flaky_failures"] > rb[1]["reward/flaky_failures"]
    assert "| flaky |" in (b / "rollout_results.md").read_text()

    per_step = [k for k in ra[-1] if k.startswith(("reward/", "replay/", "rollout/"))]
    per_step = [k for k in per_step if not k.endswith("_s")]  # timings
    assert {"replay/replaced", "replay/buffer_size", "replay/replaced_total"} <= set(per_step)
    for r0, r1 in zip(ra, rb):
        assert {k: r0[k] for k in per_step} == {k: r1[k] for k in per_step}, r0["step"]
    replaced = [r["replay/replaced"] for r in rb]
    assert sum(replaced[:3]) > 0 and replaced[3] > 0  # step 4 replays groups saved at step 3
    assert rb[-1]["replay/replaced_total"] == sum(replaced)
    (sa, pa), (sb, pb) = _final_params(a), _final_params(b)
    assert sa == sb == 8 and pa.keys() == pb.keys()
    for k in pa:
        np.testing.assert_array_equal(pa[k], pb[k], err_msg=k)


def test_a_dataset_read_by_its_own_column_names_trains(tmp_path):
    """question / answer / image_path columns, named by the keys: every row is used, and
    mc_idx scores the option letters in `answer`. A wrong key stops the run at start."""
    from jaxvrl.data import synthetic
    from jaxvrl.data.rows import DataError

    rows = []
    for i, r in enumerate(synthetic.make_split("train", 4, seed=0)):
        r["images"][0].save(tmp_path / f"img{i}.png")
        letter = "ABCD"[r["label_idx"]]
        rows.append({"question": r["problem"], "answer": letter, "image_path": f"img{i}.png"})
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    keys = [f"data.train_files={data}", f"data.image_dir={tmp_path}", "data.prompt_key=question"]
    cfg = tiny_config(
        "configs/grpo.py",
        tmp_path / "run",
        "total_steps=2",
        "val_freq=100",
        f"data.system_prompt={synthetic.SYSTEM_PROMPT}",
        *keys,
        "data.image_key=image_path",
    )
    metrics = run(cfg)
    assert np.isfinite(metrics["loss"])
    assert not [k for k in metrics if k.startswith("data/skipped")]  # only counts above 0
    assert any(r["reward/mc_idx"] > 0 for r in _rows(tmp_path / "run")[1:])  # the letters count
    with pytest.raises(DataError) as e:
        run(tiny_config("configs/grpo.py", tmp_path / "bad", *keys, "data.image_key=image"))
    assert str(e.value) == (
        f"{data}: no column 'image' for config.data.image_key; "
        "its columns: question, answer, image_path"
    )


def test_dynamic_sampling_that_finds_no_group_saves_and_stops_with_one_line(tmp_path, capsys):
    """DAPO's dynamic sampling without a batch limit, greedy sampling (every group's rewards
    equal): after a pass over the data the run saves and stops with one `error:` line, exit 2
    (a traceback before)."""
    from jaxvrl.train import main

    argv = ["--config", os.path.join(ROOT, "configs/dapo.py")]
    argv += [f"--config.{k}" for k in TINY + [f"workdir={tmp_path}", "total_steps=3",
             "val_before_train=false", "rollout.temperature=0",
             "filter.max_num_gen_batches=0"]]  # fmt: skip
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and len(err) == 1, err
    assert err[0].startswith("error: dynamic sampling found 0 of the 2 groups"), err
    assert os.path.isdir(tmp_path / "checkpoints" / "0")


def test_the_slot_engine_leaves_the_run_unchanged(tmp_path):
    """The mdi config (its reward reads the sampler's attention masses) with 3 slots for the 4
    rows of a generation batch and pages of 5 positions: the same completions, rewards,
    masses and losses as the static sampler; only the decode rows and steps differ."""
    got = {}
    for slots in (0, 3):
        w = tmp_path / f"slots{slots}"
        run(tiny_config("configs/mdi.py", w, "total_steps=1", "val_freq=100",
                        f"rollout.slots={slots}", "rollout.page_size=5"))  # fmt: skip
        got[slots] = _rows(w)
    for a, b in zip(got[0], got[3]):
        for k, v in a.items():
            if k.startswith(("reward/", "attn/", "val/")) or k in ("response_length", "loss"):
                assert abs(b[k] - v) <= 1e-5 * max(1.0, abs(v)), (k, v, b[k])
        if a["step"] > 0:  # 3 slots for 4 rows: more steps, each of 3 rows
            assert 0 < b["rollout/slot_utilization"] <= 1, b
            assert b["rollout/decode_steps"] >= a["rollout/decode_steps"], (a, b)
    assert any(k.startswith("attn/") for k in got[0][-1])


HANGING_REWARD = """
import os, signal, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    os.kill(os.getpid(), signal.SIGTERM)  # the trainer's process: this call runs on its thread
    time.sleep(30)
"""


def test_a_reward_failing_every_call_ends_the_run_and_sigterm_during_one_saves(tmp_path, capsys):
    """A verl-form reward raising on every call: the run saves and ends with RewardFailing
    (a ConfigError: main prints one `error:` line, exit 2) after failure_window steps. A
    reward that never returns: each call times out and scores 0, the run ends its steps. A
    reward that hangs: SIGTERM during it saves a checkpoint and the run ends at once (its
    timeout is 600 s)."""
    from jaxvrl.rl.rewards import RewardFailing

    broken = tmp_path / "broken.py"
    broken.write_text("def compute_score(data_source, solution_str, ground_truth):\n    1 / 0\n")
    (tmp_path / "hang.py").write_text(HANGING_REWARD)

    def config(workdir, fn, *extra):
        return tiny_config(
            "configs/grpo.py",
            workdir,
            "total_steps=3",
            "val_before_train=false",
            f"reward.funcs=('{fn}:compute_score',)",
            "reward.weights=(1.0,)",
            *extra,
        )

    # on the command line: the run saves, then one `error:` line on stderr and exit status 2
    from jaxvrl.train import main

    argv = ["--config", os.path.join(ROOT, "configs/grpo.py")]
    argv += [f"--config.{k}" for k in TINY + [f"workdir={tmp_path / 'a'}", "total_steps=3",
             "val_before_train=false", f"reward.funcs=('{broken}:compute_score',)",
             "reward.weights=(1.0,)", "reward.failure_window=1"]]  # fmt: skip
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and len(err) == 1, err
    assert err[0].startswith("error: ") and "failed on 4 of its 4 calls" in err[0], err
    assert "verl form" in err[0] and os.path.isdir(tmp_path / "a" / "checkpoints" / "1")
    assert issubclass(RewardFailing, ConfigError)  # what main turns into that line

    # a reward that never returns: each call scores 0 after reward.timeout_s, is counted, and
    # the run ends its steps (the rule that ends a run of failing calls set off)
    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text("import time\n\ndef compute_score(data_source, solution_str, "
                       "ground_truth, extra_info=None):\n    time.sleep(3600)\n")  # fmt: skip
    t0 = time.time()
    run(config(tmp_path / "c", sleeper, "reward.timeout_s=0.25", "reward.max_failure_fraction=1",
               "total_steps=2", "val_size=0"))  # fmt: skip
    assert time.time() - t0 < 60
    rows = _rows(tmp_path / "c")
    assert [r["step"] for r in rows] == [1, 2]
    # a verl function is called per row: 4 rows a step, each call timed out (a running count)
    assert [r["reward/compute_score_timeouts"] for r in rows] == [4.0, 8.0], rows
    assert all(r["reward/total"] == 0.0 for r in rows)

    t0 = time.time()
    run(config(tmp_path / "b", tmp_path / "hang.py", "reward.timeout_s=600"))
    assert time.time() - t0 < 60 and os.path.isdir(tmp_path / "b" / "checkpoints" / "0")
    # the checkpoint holds the data iterator as it was before the cut rollout (a resumed run
    # samples the same prompts again, none skipped)
    saved = json.loads((tmp_path / "b" / "checkpoints" / "0" / "data" / "metadata").read_text())
    assert saved["value"] == [{"kind": "json", "value": {"next_index": 0}}], saved
