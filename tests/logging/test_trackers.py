"""The trackers: every scalar row of metrics.jsonl reaches each backend at its step (wandb
offline; MLflow's file store, a sqlite:/// URI and its default store; each read back through
its own records), the config once, the rollout samples as a table at the markdown logs'
cadence; a resumed run continues the same tracker run; a backend that raises is warned about
once and skipped, the local logs intact."""

from __future__ import annotations

import glob
import json
import logging
import os
import struct
import time
import types

import numpy as np
import pytest

from jaxvrl.config import ConfigError, load_config
from jaxvrl.logging import trackers
from jaxvrl.trainer.reporting import RunLogs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = {"name": "grpo", "optim.lr": 0.0003, "optim.betas": (0.9, 0.999), "model.path": None}


def fake_scalars(step: int) -> dict:
    """A metrics row: floats, a numpy scalar, a bool, a NaN."""
    return {
        "reward/total": 0.5 * step,
        "loss": np.float32(0.25 / step),
        "train/nonfinite": False,
        "accuracy": float("nan") if step == 2 else 1.0 / step,
    }


def fake_rollout(step: int):
    """Two real groups of two completions: what RunLogs.markdown reads."""
    group = lambda i: types.SimpleNamespace(
        texts=[f"answer {step}.{i}.0", f"answer {step}.{i}.1"],
        parts={"accuracy": [1.0, 0.0], "format": [0.5, 0.5]},
        totals=[1.5, 0.5],
        example={"problem": f"question {i}"},
        att={},
    )
    rollout = types.SimpleNamespace(groups=[group(0), group(1)], real=[True, True])
    extras = types.SimpleNamespace(advantages=np.array([0.7, -0.7, 0.1, -0.1]), token_weights=None)
    return rollout, extras


def write_run(workdir, steps, start=0, backends=("mlflow",), primary=True, samples=3):
    """RunLogs as train.py drives it: a row per step, the samples every other step."""
    resume = start if start else -1
    logs = RunLogs(str(workdir), 4, start, primary, resume, samples, backends=backends,
                   project="jaxvrl-test", run_name="grpo-run", config=CONFIG)  # fmt: skip
    for step in steps:
        logs.scalars(step, fake_scalars(step))
        if step % 2:
            logs.markdown(step, [logs.sample_rows(*fake_rollout(step), tokenizer=None)])
    logs.close()


def jsonl_rows(workdir) -> dict:
    """{step: {name: value}} of metrics.jsonl (None for NaN, as written)."""
    rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    return {r.pop("step"): r for r in rows}


def same(a, b) -> bool:
    nan = lambda v: v is None or (isinstance(v, float) and np.isnan(v))
    return (nan(a) and nan(b)) or np.isclose(a, b, rtol=1e-6)


def assert_received(received: dict, workdir):
    """received: {step: {name: value}}, the backend's last value per step."""
    rows = jsonl_rows(workdir)
    assert sorted(received) == sorted(rows)
    for step, row in rows.items():
        assert set(received[step]) == set(row), step
        for k, v in row.items():
            assert same(received[step][k], v), (step, k, received[step][k], v)


def test_the_backends_setting_names_known_backends():
    base = os.path.join(ROOT, "configs/base.py")
    c = load_config(base, ["logging.backends=console, wandb,mlflow"])
    assert trackers.backend_names(c.logging.backends) == ("console", "wandb", "mlflow")
    with pytest.raises(ConfigError, match=r"logging.backends.*comet is not"):
        load_config(base, ["logging.backends=console,comet"])


# --- MLflow: a local file store, read back with MlflowClient ------------------------------


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file://{tmp_path}/mlruns")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for a database
    from mlflow.tracking import MlflowClient

    return MlflowClient()


def mlflow_received(client, run_id) -> dict:
    out = {}
    for key in client.get_run(run_id).data.metrics:
        for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.timestamp):
            out.setdefault(m.step, {})[key] = m.value  # a rewritten step: its last value
    return out


def test_mlflow_receives_the_scalars_config_and_samples_and_a_resume_continues_it(
    tmp_path, mlflow_store
):
    workdir = tmp_path / "run"
    write_run(workdir, [1, 2, 3])  # cut off after step 3; its checkpoint is at step 2
    run_id = json.load(open(workdir / "trackers.json"))["mlflow"]
    write_run(workdir, [3, 4], start=2)

    assert json.load(open(workdir / "trackers.json")) == {"mlflow": run_id}
    assert len(mlflow_store.search_runs([mlflow_store.get_experiment_by_name("jaxvrl-test").experiment_id])) == 1  # fmt: skip
    run = mlflow_store.get_run(run_id)
    assert run.info.run_name == "grpo-run" and run.info.status == "FINISHED"
    assert run.data.params == {k: str(v) for k, v in CONFIG.items()}
    assert_received(mlflow_received(mlflow_store, run_id), workdir)
    tables = [a.path for a in mlflow_store.list_artifacts(run_id, "rollouts")]
    assert tables == ["rollouts/step_000001.json", "rollouts/step_000003.json"]
    table = json.load(open(mlflow_store.download_artifacts(run_id, "rollouts/step_000003.json")))
    assert table["columns"] == ["prompt", "completion", "accuracy", "format", "total", "advantage"]
    assert table["data"][:3] == [
        ["question 0", "answer 3.0.0", 1.0, 0.5, 1.5, 0.7],
        ["question 0", "answer 3.0.1", 0.0, 0.5, 0.5, -0.7],
        ["question 1", "answer 3.1.0", 1.0, 0.5, 1.5, 0.1],
    ]


def test_mlflow_default_store_and_a_sqlite_uri_receive_the_scalars(tmp_path, monkeypatch, caplog):
    """No MLFLOW_TRACKING_URI: MLflow 3's default, a SQLite store at ./mlflow.db (MLflow 2's:
    ./mlruns), which the mlflow extra's sqlalchemy and alembic open; then a second run named
    by a sqlite:/// URI (MLflow 3: the same file; a new one would cost MLflow's schema
    migrations again, seconds)."""
    pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")
    pytest.importorskip("alembic")
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with caplog.at_level(logging.WARNING, logger="jaxvrl.logging.trackers"):
        write_run(tmp_path / "default", [1, 2, 3])
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
        write_run(tmp_path / "sqlite", [1, 2, 3])
    assert [r.getMessage() for r in caplog.records if r.name == trackers.__name__] == []
    for workdir in (tmp_path / "default", tmp_path / "sqlite"):
        run_id = json.load(open(workdir / "trackers.json"))["mlflow"]
        client = MlflowClient()
        assert client.get_run(run_id).info.status == "FINISHED"
        assert_received(mlflow_received(client, run_id), workdir)
        assert [a.path for a in client.list_artifacts(run_id, "rollouts")] == [
            "rollouts/step_000001.json",
            "rollouts/step_000003.json",
        ]


def test_a_fresh_start_over_an_old_run_starts_a_new_tracker_run(tmp_path, mlflow_store):
    write_run(tmp_path, [1, 2])
    first = json.load(open(tmp_path / "trackers.json"))["mlflow"]
    write_run(tmp_path, [1], start=0)
    second = json.load(open(tmp_path / "trackers.json"))["mlflow"]
    assert second != first
    assert sorted(mlflow_received(mlflow_store, second)) == [1]


# --- wandb offline: the run's records read from its .wandb files --------------------------


def wandb_records(path):
    """The protobuf records of an offline run's `run-<id>.wandb` file: a 7-byte header
    (`:W&B`, magic, version), then LevelDB-log blocks of 32 KiB whose records (a 7-byte header:
    crc32, length, type) carry the data whole (FULL) or split (FIRST, MIDDLE, LAST)."""
    from wandb.proto import wandb_internal_pb2

    data, block = open(path, "rb").read(), 32768
    assert data[:4] == b":W&B"
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if pos + 7 + n > len(data):  # a record still being written
            return
        buf, pos = buf + data[pos + 7 : pos + 7 + n], pos + 7 + n
        if kind in (1, 4):  # FULL or LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            buf = b""
            yield record


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for var in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        os.makedirs(tmp_path / "wandb-home", exist_ok=True)
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    return tmp_path / "wandb-home"


def test_wandb_receives_the_scalars_config_and_samples_and_a_resume_continues_it(
    tmp_path, wandb_offline
):
    workdir = tmp_path / "run"
    write_run(workdir, [1, 2, 3], backends=("wandb",))
    run_id = json.load(open(workdir / "trackers.json"))["wandb"]
    write_run(workdir, [3, 4], start=2, backends=("wandb",))

    files = sorted(glob.glob(str(wandb_offline / "wandb" / "offline-run-*" / "run-*.wandb")))
    assert len(files) == 2 and all(f.endswith(f"run-{run_id}.wandb") for f in files)
    # wandb's service process may still be writing a file after run.finish() returns: wait
    # for each run's closing record
    deadline = time.time() + 30
    while not all(any(r.HasField("exit") for r in wandb_records(f)) for f in files):
        assert time.time() < deadline, "a wandb run file has no exit record"
        time.sleep(0.2)
    received, config, tables, names = {}, {}, [], set()
    for path in files:
        for r in wandb_records(path):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                assert r.run.run_id == run_id
                names.add(r.run.display_name)
                config.update({u.key: json.loads(u.value_json) for u in r.run.config.update})
            elif kind == "config":
                config.update({u.key: json.loads(u.value_json) for u in r.config.update})
            elif kind == "history":
                items = {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in r.history.item
                }
                step = items["_step"]
                if items.get("rollouts/_type") == "table-file":
                    tables.append((step, items["rollouts/ncols"], items["rollouts/nrows"]))
                row = {k: v for k, v in items.items() if not k.startswith(("_", "rollouts/"))}
                received.setdefault(step, {}).update(row)
    assert names == {"grpo-run"}
    assert {k: config[k] for k in CONFIG} == {**CONFIG, "optim.betas": [0.9, 0.999]}
    assert_received({s: row for s, row in received.items() if row}, workdir)
    assert tables == [(1, 6, 3), (3, 6, 3), (3, 6, 3)]  # step 3 again after the resume


def tensorboard_scalars(logdir) -> dict:
    """{step: {tag: value}} of the scalar events in logdir (TFRecord files: a little-endian
    uint64 length, a crc32 of it, the Event proto, its crc32)."""
    from tensorboardX.proto.event_pb2 import Event

    out = {}
    for path in sorted(glob.glob(str(logdir / "events.out.tfevents.*"))):
        data, pos = open(path, "rb").read(), 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos : pos + 8])
            event = Event.FromString(data[pos + 12 : pos + 12 + n])
            pos += 16 + n
            for v in event.summary.value:
                if v.WhichOneof("value") == "simple_value":
                    out.setdefault(event.step, {})[v.tag] = v.simple_value
    return out


# --- the fan-out: fake backends -----------------------------------------------------------


class Recorder(trackers.Tracker):
    calls: list = []  # every instance's calls, in order (reset per test)

    def __init__(self, info):
        self.run_id = info.run_id or "rec-1"
        Recorder.calls.append(("start", info.run_id, info.run_name))

    def log_scalars(self, step, scalars):
        Recorder.calls.append(("scalars", step, dict(scalars)))

    def log_table(self, step, name, columns, rows):
        Recorder.calls.append(("table", step, name, list(columns), len(rows)))

    def log_config(self, config):
        Recorder.calls.append(("config", dict(config)))

    def close(self):
        Recorder.calls.append(("close",))


class Raises(trackers.Tracker):
    """Every call raises, from the start (`start`) or from its first call."""

    def __init__(self, info, start=True):
        if start:
            raise ConnectionError("no route to the tracker")

    def _fail(self, *args):
        raise ConnectionError("the tracker went away")

    log_scalars = log_table = log_config = close = _fail


@pytest.fixture
def fakes(monkeypatch):
    monkeypatch.setattr(Recorder, "calls", [])
    monkeypatch.setitem(trackers.REGISTRY, "recorder", Recorder)
    monkeypatch.setitem(trackers.REGISTRY, "dead", Raises)
    monkeypatch.setitem(trackers.REGISTRY, "flaky", lambda info: Raises(info, start=False))


def test_a_failing_backend_warns_once_and_leaves_the_run_and_its_logs_intact(
    tmp_path, fakes, caplog
):
    with caplog.at_level(logging.WARNING, logger="jaxvrl.logging.trackers"):
        write_run(tmp_path, [1, 2, 3], backends=("dead", "flaky", "recorder", "tensorboard"))
    warnings = [r.getMessage() for r in caplog.records if r.name == trackers.__name__]
    assert len(warnings) == 2, warnings
    assert "tracker dead failed to start" in warnings[0] and "no route" in warnings[0]
    assert "tracker flaky failed to log the config" in warnings[1] and "went away" in warnings[1]
    assert sorted(jsonl_rows(tmp_path)) == [1, 2, 3]
    assert open(tmp_path / "rollout_results.md").read().count("## Step") == 2
    assert json.load(open(tmp_path / "trackers.json")) == {"recorder": "rec-1"}
    # the working backend got everything, in the loop's order
    kinds = [c[0] for c in Recorder.calls]
    assert kinds == ["start", "config", "scalars", "table", "scalars", "scalars", "table", "close"]
    assert Recorder.calls[0] == ("start", None, "grpo-run")
    assert Recorder.calls[1] == ("config", CONFIG)
    assert Recorder.calls[3] == ("table", 1, "rollouts", ["prompt", "completion", "accuracy", "format", "total", "advantage"], 3)  # fmt: skip
    scalars = {c[1]: c[2] for c in Recorder.calls if c[0] == "scalars"}
    assert_received(scalars, tmp_path)
    assert_received(tensorboard_scalars(tmp_path / "tb"), tmp_path)


def test_a_resume_passes_the_saved_id_back_and_only_process_0_logs(tmp_path, fakes):
    write_run(tmp_path, [1, 2], backends=("recorder",))
    write_run(tmp_path, [3], start=2, backends=("recorder",))
    starts = [c for c in Recorder.calls if c[0] == "start"]
    assert starts == [("start", None, "grpo-run"), ("start", "rec-1", "grpo-run")]
    Recorder.calls.clear()
    write_run(tmp_path / "other", [1, 2], backends=("console", "recorder"), primary=False)
    assert Recorder.calls == [] and not os.path.exists(tmp_path / "other" / "trackers.json")


def test_console_off_prints_no_progress_line(tmp_path, capsys):
    write_run(tmp_path / "a", [1], backends=())
    assert capsys.readouterr().out == ""
    write_run(tmp_path / "b", [1], backends=("console",))
    assert "1/4" in capsys.readouterr().out
