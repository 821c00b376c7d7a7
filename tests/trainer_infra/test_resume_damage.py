"""Resume past damage: a step whose files are missing, cut short or not decodable is named in
one warning and moved aside, the previous step restores exactly, and saving goes on around the
moved copy (the same step again, max_to_keep); other failures move nothing. The console shows
that one warning, not the failed reads. A run resumes past damaged steps as if it had stopped
before them. A workdir saved with another model, scan_layers or LoRA setting is refused before
anything is loaded."""

from __future__ import annotations

import gc
import json
import logging
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxvrl import train
from jaxvrl.checkpoint import Checkpointer, CheckpointError, saved_with_other_settings
from jaxvrl.config import ConfigError, load_config
from jaxvrl.export import write_run_info
from tests.trainer_infra.ckpt_worker import many_arrays
from tests.trainer_infra.test_checkpoint import assert_trees_equal
from tests.trainer_infra.workers import HERE, ROOT, needs_gcs, run_worker

# orbax leaves the reads of a failed restore to be collected later, each reporting its error
# (expected here: the steps are damaged on purpose); they are collected before this module ends,
# not in whichever test the worker runs next
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.fixture(scope="module", autouse=True)
def _collect_failed_reads():
    yield
    gc.collect()


def state(step: int) -> dict:
    """Random weights: the array data is the largest file of a step's `state` item."""
    w = np.random.default_rng(step).normal(size=(64, 64)).astype(np.float32)
    return {"params": {"w": jnp.asarray(w), "b": jnp.arange(8.0) + step}, "step": jnp.int32(step)}


def save(ck: Checkpointer, step: int) -> None:
    items = {"state": state(step), "rng": jax.random.key(step), "meta": {"step": step}}
    items.update(data_state={"pos": step}, counters={"rows": step}, replay=bytes([step]) * 10)
    ck.save(step, items)


def largest_file(step_dir) -> str:
    files = [
        os.path.join(d, f) for d, _, fs in os.walk(os.path.join(step_dir, "state")) for f in fs
    ]
    return max(files, key=os.path.getsize)


def cut_in_half(path) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


# how a step is damaged -> the item its warning names and the start of what failed
DAMAGE = {
    "array file cut in half": (lambda d: cut_in_half(largest_file(d)), "state: OUT_OF_RANGE"),
    "array file removed": (lambda d: os.remove(largest_file(d)), "state: "),
    "iterator state cut short": (lambda d: cut_in_half(d / "data" / "metadata"), "data: JSON"),
    "replay file removed": (lambda d: os.remove(d / "replay" / "0-of-1"), "replay: FileNotF"),
    "rng item removed": (lambda d: shutil.rmtree(d / "rng"), "rng: KeyError"),
}


def warnings_of(caplog) -> list[str]:
    """jaxvrl's warnings (others' records, e.g. asyncio's reports of orbax's failed reads of a
    damaged step, which name its path, come and go with garbage collection)."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and r.name.split(".")[0] == "jaxvrl"
    ]


@pytest.mark.parametrize("kind", DAMAGE)
def test_a_damaged_step_is_moved_aside_and_the_previous_one_restored(tmp_path, caplog, kind):
    damage, what = DAMAGE[kind]
    ck = Checkpointer(str(tmp_path), max_to_keep=2)
    for step in (1, 2, 3):
        save(ck, step)
    ck.close()
    damage(tmp_path / "3")
    ck = Checkpointer(str(tmp_path), max_to_keep=2)  # a new run
    with caplog.at_level(logging.WARNING, logger="jaxvrl"):
        r = ck.restore_latest({"state": jax.eval_shape(lambda: state(0))})
    assert r.step == 2  # exactly what step 2 saved
    assert_trees_equal(r.state, state(2))
    np.testing.assert_array_equal(
        jax.random.key_data(r.rng), jax.random.key_data(jax.random.key(2))
    )
    assert (r.meta, r.data_state, r.counters, r.replay) == (
        {"step": 2},
        {"pos": 2},
        {"rows": 2},
        bytes([2]) * 10,
    )
    [warning] = warnings_of(caplog)  # one line: the step, the item and what failed
    assert "\n" not in warning and f"checkpoint step 3 in {tmp_path} is damaged ({what}" in warning
    assert warning.endswith(f": moved to {tmp_path}/3.damaged; resuming from step 2")
    assert sorted(os.listdir(tmp_path)) == ["2", "3.damaged"]
    # step 3 is saved again, then 4: max_to_keep drops step 2, never the damaged copy
    save(ck, 3)
    save(ck, 4)
    assert ck.all_steps() == [3, 4] and sorted(os.listdir(tmp_path)) == ["3", "3.damaged", "4"]
    ck.close()
    ck = Checkpointer(str(tmp_path))
    assert_trees_equal(ck.restore_latest({"state": state(0)}).state, state(4))
    ck.close()


def test_several_damaged_steps_are_each_moved_and_none_readable_moves_nothing(tmp_path, caplog):
    ck = Checkpointer(str(tmp_path), max_to_keep=4)
    for step in (1, 2, 3):
        save(ck, step)
    os.makedirs(tmp_path / "3.damaged")  # from an earlier resume: the next name is taken
    cut_in_half(largest_file(tmp_path / "3"))
    os.remove(tmp_path / "2" / "info" / "metadata")
    with caplog.at_level(logging.WARNING, logger="jaxvrl"):
        r = ck.restore_latest({"state": state(0)})
    assert r.step == 1
    assert_trees_equal(r.state, state(1))
    assert [w.split(": moved to ")[1] for w in warnings_of(caplog)] == [
        f"{tmp_path}/3.damaged-2; resuming from step 1",
        f"{tmp_path}/2.damaged; resuming from step 1",
    ]
    assert "(info: FileNotFoundError: " in warnings_of(caplog)[1]
    cut_in_half(largest_file(tmp_path / "1"))
    with pytest.raises(
        CheckpointError, match=r"no checkpoint in .* reads back \(none was moved\): step 1: state"
    ):
        ck.restore_latest({"state": state(0)})
    assert sorted(os.listdir(tmp_path)) == ["1", "2.damaged", "3.damaged", "3.damaged-2"]
    ck.close()


def test_failures_that_show_no_damage_move_nothing(tmp_path, monkeypatch):
    ck = Checkpointer(str(tmp_path))
    save(ck, 1)
    save(ck, 2)
    other_shape = dict(state(0), params={"w": jnp.zeros((32, 64)), "b": jnp.zeros(8)})
    with pytest.raises(ValueError, match="not compatible with the stored shape"):
        ck.restore_latest({"state": other_shape})
    gc.collect()  # those reads, here
    with pytest.raises(CheckpointError, match=r"missing \['params/v'\]"):
        ck.restore_latest({"state": dict(state(0), params={"v": jnp.zeros(8)})})

    def denied(*args, **kwargs):  # e.g. a bucket this account may not read
        raise ValueError('PERMISSION_DENIED: Error reading "w/0" in OCDBT database at gs://b/2')

    monkeypatch.setattr(ck.manager, "restore", denied)
    with pytest.raises(ValueError, match="PERMISSION_DENIED"):
        ck.restore_latest({"state": state(0)})
    monkeypatch.undo()
    assert ck.all_steps() == [1, 2] and sorted(os.listdir(tmp_path)) == ["1", "2"]
    ck.close()


@needs_gcs
def test_a_damaged_gs_step_is_moved_aside_against_a_loopback_emulator():
    res = run_worker("ckpt_worker.py", "gcs-damaged", tail=3000)
    assert res["damaged_file"].startswith("state/")
    assert res["restored"] == 2 and res["restored_ok"]
    assert res["after_restore"] == ["1", "2", "3.damaged"]
    assert res["after_saves"] == ["3", "3.damaged", "4"]  # max_to_keep=2 deleted 1 and 2
    assert res["last"] == 4 and res["last_ok"]


def cut_index(step_dir) -> None:
    """Cuts the root of the arrays' OCDBT index (`state/d/`) in half: every array is read
    through it."""
    index = os.path.join(step_dir, "state", "d")
    for name in os.listdir(index):
        cut_in_half(os.path.join(index, name))


def test_resuming_past_a_damaged_step_prints_one_warning(tmp_path, capfd):
    # orbax closes its event loop when the first read fails; the reads still in flight used
    # to report against the closed loop, each with a traceback (a few thousand lines): a cut
    # index fails every read (a cut array file, one; its warning and fallback are
    # test_a_damaged_step_is_moved_aside_and_the_previous_one_restored's)
    ck = Checkpointer(str(tmp_path), max_to_keep=3)
    for step in (1, 2, 3):
        ck.save(step, {"state": many_arrays(step), "data_state": {"pos": step}})
    ck.close()
    cut_index(tmp_path / "3")
    capfd.readouterr()
    # the trainer's resume in a process of its own, its console (stdout and stderr) captured
    worker = [sys.executable, os.path.join(HERE, "ckpt_worker.py"), "resume", str(tmp_path)]
    code = subprocess.run(worker, cwd=ROOT, timeout=300).returncode
    out, err = capfd.readouterr()
    assert code == 0, err[-3000:]
    got = json.loads(out.splitlines()[-1])
    assert got == {"start": 2, "ok": True, "meta": {}, "data": {"pos": 2}, "counters": None}
    lines = (out + err).splitlines()
    shown = "\n".join(lines[:40])
    assert len(lines) <= 10 and "Traceback" not in err, f"{len(lines)} lines:\n{shown}"
    [warning] = [line for line in lines if "checkpoint step 3" in line]
    assert f"step 3 in {tmp_path} is damaged (state: " in warning
    assert warning.endswith(f"moved to {tmp_path}/3.damaged; resuming from step 2")
    assert "resumed from step 2" in lines


def config(workdir, *overrides):
    """configs/grpo.py:runlocal (2 prompts x 2 completions of 8 tokens, 4 validation prompts
    at the end), a checkpoint per step."""
    base = ["save_freq=1", "val_before_train=False"]
    return load_config(
        os.path.join(ROOT, "configs", "grpo.py") + ":runlocal",
        [f"workdir={workdir}", *base, *overrides],
    )


def final_state(workdir) -> tuple[int, dict]:
    ck = Checkpointer(os.path.join(workdir, "checkpoints"))
    step = ck.latest_step()
    arrays = ck.manager.restore(step)["state"]  # every array of the train state, as saved
    ck.close()
    return step, {k: np.asarray(v) for k, v in arrays.items()}


def test_a_run_resumes_past_damaged_steps_as_if_it_had_stopped_before_them(tmp_path, caplog):
    first, damaged, stopped = tmp_path / "first", tmp_path / "damaged", tmp_path / "stopped"
    train.run(config(first, "total_steps=3", "max_to_keep=3"))  # steps 1, 2 and 3 saved
    shutil.copytree(first, damaged)
    shutil.copytree(first, stopped)
    cut_in_half(largest_file(damaged / "checkpoints" / "3"))
    os.remove(largest_file(damaged / "checkpoints" / "2"))
    for step in ("2", "3"):  # as if it had stopped after step 1
        shutil.rmtree(stopped / "checkpoints" / step)
    warned = {}
    for workdir in (damaged, stopped):  # each resumes from step 1 and trains steps 2 and 3
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="jaxvrl"):
            train.run(config(workdir, "total_steps=3"))
        warned[workdir] = [w for w in warnings_of(caplog) if "damaged" in w]
    assert warned[stopped] == []
    ckpts = damaged / "checkpoints"
    cut, removed = warned[damaged]  # one line each, newest first
    assert cut.startswith(f"checkpoint step 3 in {ckpts} is damaged (state: OUT_OF_RANGE: ")
    assert cut.endswith(f": moved to {ckpts}/3.damaged; resuming from step 1")
    assert removed.startswith(f"checkpoint step 2 in {ckpts} is damaged (state: ")
    assert removed.endswith(f": moved to {ckpts}/2.damaged; resuming from step 1")
    # steps 2 and 3 saved again; max_to_keep=2 dropped step 1, not the damaged copies
    assert sorted(os.listdir(ckpts)) == ["2", "2.damaged", "3", "3.damaged"]
    (step, got), (want_step, want) = final_state(damaged), final_state(stopped)
    assert step == want_step == 3 and got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    rows = [json.loads(line)["step"] for line in open(damaged / "metrics.jsonl")]
    assert rows == [1, 2, 3]  # the rows after step 1 dropped and written again


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.scan_layers=False", "model.scan_layers=True, this run has False"),
        ("lora.rank=4", "lora.rank=0, this run has 4"),
        (f"model.path={train.EMBEDDED}", f"model.path=None, this run has {train.EMBEDDED}"),
    ],
)
def test_a_workdir_saved_with_another_model_is_refused_before_loading(
    tmp_path, monkeypatch, override, message
):
    saved = config(tmp_path)
    write_run_info(str(tmp_path), train.run_info(saved))
    ck = Checkpointer(str(tmp_path / "checkpoints"))
    ck.save(1, {"state": {"w": jnp.zeros(2)}})
    ck.close()
    before = (tmp_path / "run.json").read_text()

    def no_loading(c, *_):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(train, "load_model", no_loading)
    with pytest.raises(ConfigError) as e:
        train.run(config(tmp_path, override))
    assert str(e.value) == f"{tmp_path}: saved with {message}; use another workdir or set it back"
    assert (tmp_path / "run.json").read_text() == before  # still the saved run's
    assert saved_with_other_settings(str(tmp_path), train.run_info(saved)) is None
    # resume=False does not compare settings, but refuses to start beside an earlier run's
    # checkpoints (its own would not replace them, and exports read the newest)
    with pytest.raises(
        ConfigError, match=r"resume=False: .*holds an earlier run's steps \(up to 1\)"
    ):
        train.run(config(tmp_path, override, "resume=False"))
    assert (tmp_path / "run.json").read_text() == before


def test_settings_a_run_json_lacks_or_a_workdir_without_checkpoints_are_not_compared(tmp_path):
    info = train.run_info(config(tmp_path))
    old = {k: v for k, v in info.items() if k != "scan_layers"}  # written before it was
    write_run_info(str(tmp_path), old)
    other = dict(info, scan_layers=False, lora=dict(info["lora"], rank=8))
    assert saved_with_other_settings(str(tmp_path), other) is None  # no checkpoint yet
    ck = Checkpointer(str(tmp_path / "checkpoints"))
    ck.save(3, {"state": {"w": jnp.zeros(2)}})
    ck.close()
    assert saved_with_other_settings(str(tmp_path), dict(info, scan_layers=False)) is None
    assert saved_with_other_settings(str(tmp_path), other) == "lora.rank=0, this run has 8"
