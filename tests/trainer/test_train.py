"""The main job end to end on the embedded default: every config runs, resume equals an
uninterrupted run, SIGTERM saves and exits, one compilation per shape, config errors."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from jaxvrl.config import ConfigError, load_config, parse_argv
from jaxvrl.train import run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = sorted(
    os.path.relpath(p, ROOT)
    for p in glob.glob(os.path.join(ROOT, "configs", "*.py"))
    if not p.endswith("__init__.py")
)
TINY = [
    "prompts_per_step=2",
    "rollout.num_generations=2",
    "rollout.max_new_tokens=8",
    "val_size=4",
    "data.synthetic_train_size=16",
    "log_rollouts_every=1",
]


def tiny_config(path, workdir, *extra):
    overrides = TINY + [f"workdir={workdir}", *extra]
    return load_config(os.path.join(ROOT, path), overrides)


@pytest.mark.parametrize("path", CONFIGS)
def test_every_config_runs_two_steps(path, tmp_path):
    cfg = tiny_config(path, tmp_path, "total_steps=2", "val_freq=2")
    assert f"python -m jaxvrl.train --config {path}" in open(os.path.join(ROOT, path)).read() or (
        path.endswith("base.py")
    )
    metrics = run(cfg)
    assert np.isfinite(metrics["loss"]) and "val/accuracy" in metrics
    assert metrics["compiles/train_step"] == 1  # one prompt/patch bucket in the built-in task
    # at most one new program per sampler in this run (none if an earlier test in this process
    # already compiled the same shape)
    assert metrics["compiles/sampler"] <= 1 and metrics["compiles/greedy_sampler"] <= 1
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
    ):
        assert key in rows[-1], key
    assert (tmp_path / "rollout_results.md").read_text().count("### Sample") >= 2
    assert glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))


def _final_params(workdir):
    from jaxvrl.checkpoint import Checkpointer

    ck = Checkpointer(os.path.join(workdir, "checkpoints"))
    step = ck.latest_step()
    arrays = ck.manager.restore(step)["state"]
    ck.close()
    return step, {k: np.asarray(v) for k, v in arrays.items()}


def test_resume_equals_uninterrupted_run(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    run(tiny_config("configs/tprl.py", a, "total_steps=4", "save_freq=0", "val_freq=100"))
    run(tiny_config("configs/tprl.py", b, "total_steps=2", "save_freq=0", "val_freq=100"))
    run(tiny_config("configs/tprl.py", b, "total_steps=4", "save_freq=0", "val_freq=100"))
    sa, pa = _final_params(a)
    sb, pb = _final_params(b)
    assert sa == sb == 4
    assert pa.keys() == pb.keys()
    for k in pa:
        np.testing.assert_array_equal(pa[k], pb[k], err_msg=k)
    steps = [json.loads(line)["step"] for line in open(b / "metrics.jsonl")]
    assert steps == [0, 1, 2, 3, 4]  # the resumed run continues at step 3, no repeats


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


def test_config_overrides_and_errors(tmp_path):
    path, overrides = parse_argv(
        [
            "--config",
            "configs/tprl.py",
            "--config.rollout.top_p=0.9",
            "--config.vgr.token_weight_clip=(0.1, 2.0)",
            "--config.actor.use_kl_loss",
            "true",
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
