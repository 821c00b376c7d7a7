"""Experiment trackers (README "What a run writes"): the run's scalars, its config, tables of
rollout samples and images (attention heatmaps) sent to TensorBoard, Weights & Biases or MLflow beside the local logs.

A backend is a `Tracker` (five calls); `Trackers` fans each call out to the configured ones and
never raises into the train loop: a backend that fails to start or to send is named in one
warning and skipped from then on. A resumed run continues the same tracker runs: their ids are
kept in `<workdir>/trackers.json`. wandb and mlflow are optional (`pip install jaxvrl[wandb]`,
`jaxvrl[mlflow]`) and imported only by their backends.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Sequence

log = logging.getLogger(__name__)

IDS_FILE = "trackers.json"
MAX_PARAM_CHARS = 6000  # MLflow's longest parameter value


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """What a backend starts from. run_id: the id this backend gave the run before (from
    trackers.json; None: a new run). resume_step: rows of later steps are dropped where the
    backend can (TensorBoard's purge); -1: a fresh start over an old run, None: no trimming."""

    workdir: str
    project: str = "jaxvrl"
    run_name: str | None = None
    run_id: str | None = None
    resume_step: int | None = None


class Tracker:
    """One backend. `run_id`: the id to continue the run with after a resume (None: the
    backend has none)."""

    run_id: str | None = None

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        pass

    def log_table(self, step: int, name: str, columns: Sequence[str], rows: Sequence) -> None:
        pass

    def log_config(self, config: dict) -> None:
        pass

    def log_image(self, step: int, name: str, image) -> None:
        """image: uint8[H, W, 3]."""

    def close(self) -> None:
        pass


def markdown_table(columns: Sequence[str], rows: Sequence) -> str:
    cell = lambda v: str(v).replace("|", "\\|").replace("\n", "<br>")
    lines = ["| " + " | ".join(map(cell, columns)) + " |", "|---" * len(columns) + "|"]
    return "\n".join(lines + ["| " + " | ".join(map(cell, r)) + " |" for r in rows])


class TensorBoardTracker(Tracker):
    """tensorboardX events under `<workdir>/tb`: scalars, images, tables and the config as
    text."""

    def __init__(self, info: RunInfo):
        from tensorboardX import SummaryWriter

        purge = None if info.resume_step is None else info.resume_step + 1
        self.writer = SummaryWriter(os.path.join(info.workdir, "tb"), purge_step=purge)

    def log_scalars(self, step, scalars):
        for k, v in scalars.items():
            self.writer.add_scalar(k, v, int(step))
        self.writer.flush()

    def log_table(self, step, name, columns, rows):
        self.writer.add_text(name, markdown_table(columns, rows), int(step))

    def log_config(self, config):
        self.writer.add_text("config", markdown_table(("key", "value"), config.items()), 0)

    def log_image(self, step, name, image):
        # no flush per image: the step's scalars flush them all (and close does)
        self.writer.add_image(name, image, int(step), dataformats="HWC")

    def close(self):
        self.writer.close()


class WandbTracker(Tracker):
    """A Weights & Biases run (project, name; continued by id with resume="allow"). The
    WANDB_* environment (WANDB_MODE=offline, WANDB_DIR, WANDB_ENTITY, ...) applies. A resumed
    online run drops rows of steps it already has (wandb's steps only increase)."""

    def __init__(self, info: RunInfo):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(
            project=info.project, name=info.run_name, id=info.run_id, resume="allow"
        )
        self.run_id = self.run.id

    def log_scalars(self, step, scalars):
        self.run.log(dict(scalars), step=int(step))

    def log_table(self, step, name, columns, rows):
        table = self.wandb.Table(columns=list(columns), data=[list(r) for r in rows])
        self.run.log({name: table}, step=int(step))

    def log_config(self, config):
        self.run.config.update(config, allow_val_change=True)

    def log_image(self, step, name, image):
        self.run.log({name: self.wandb.Image(image)}, step=int(step))

    def close(self):
        self.run.finish()


class MlflowTracker(Tracker):
    """An MLflow run in experiment `project` of the tracking server or store that
    MLFLOW_TRACKING_URI names (http(s)://host:port, sqlite:///path.db, file:///path/mlruns
    with MLFLOW_ALLOW_FILE_STORE=true for MLflow 3; unset: MLflow's default, ./mlflow.db in
    MLflow 3, a SQLite store that the mlflow extra's sqlalchemy and alembic open), continued
    by run id. Images go to `<name>/step_<step>.png` artifacts, tables
    to `<name>/step_<step>.json` artifacts
    ({"columns", "data"}, as mlflow.log_table writes them). A parameter keeps its first value:
    a resumed run logs only the keys it does not have (MLflow refuses changed values)."""

    def __init__(self, info: RunInfo):
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient()
        if info.run_id is None:
            exp = self.client.get_experiment_by_name(info.project)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(info.project)
            self.run_id = self.client.create_run(exp_id, run_name=info.run_name).info.run_id
        else:
            self.client.update_run(info.run_id, status="RUNNING")
            self.run_id = info.run_id

    def log_scalars(self, step, scalars):
        from mlflow.entities import Metric

        ms = int(time.time() * 1000)
        metrics = [Metric(k, float(v), ms, int(step)) for k, v in scalars.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def log_table(self, step, name, columns, rows):
        table = {"columns": list(columns), "data": [list(r) for r in rows]}
        self.client.log_dict(self.run_id, table, f"{name}/step_{int(step):06d}.json")

    def log_image(self, step, name, image):
        self.client.log_image(self.run_id, image, f"{name}/step_{int(step):06d}.png")

    def log_config(self, config):
        from mlflow.entities import Param

        have = self.client.get_run(self.run_id).data.params
        params = [Param(k, str(v)[:MAX_PARAM_CHARS]) for k, v in config.items() if k not in have]
        self.client.log_batch(self.run_id, params=params)

    def close(self):
        self.client.set_terminated(self.run_id)


# name -> backend; "console" (the progress line) is no tracker: RunLogs prints it
REGISTRY: dict[str, Callable[[RunInfo], Tracker]] = {
    "tensorboard": TensorBoardTracker,
    "wandb": WandbTracker,
    "mlflow": MlflowTracker,
}


def backend_names(text: str) -> tuple[str, ...]:
    """'console, tensorboard' -> ('console', 'tensorboard'): blanks and repeats dropped."""
    names = [n.strip() for n in text.split(",")]
    return tuple(dict.fromkeys(n for n in names if n))


def known_backends() -> tuple[str, ...]:
    return ("console", *REGISTRY)


def backends_rule(value, config=None):
    """The config rule of logging.backends: every name known."""
    unknown = [n for n in backend_names(value) if n not in known_backends()]
    if unknown:
        known = ", ".join(known_backends())
        return f"comma-separated names of {known} ({', '.join(unknown)} is not)"
    return None


def read_ids(workdir: str) -> dict:
    path = os.path.join(workdir, IDS_FILE)
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


class Trackers:
    """The configured backends (names: REGISTRY keys; others are ignored). Only the enabled
    (primary) process starts them. resume: continue the runs whose ids trackers.json holds;
    otherwise new runs, whose ids replace those there. Each call goes to every live backend; a
    backend that raises is warned about once and dropped."""

    def __init__(self, names: Sequence[str], info: RunInfo, resume: bool, enabled: bool = True):
        self.live: dict[str, Tracker] = {}
        if not enabled:
            return
        ids = read_ids(info.workdir) if resume else {}
        for name in names:
            if name in REGISTRY:
                self._try(name, "start", self._start, name, info, ids.get(name))
        ids.update({k: t.run_id for k, t in self.live.items() if t.run_id is not None})
        if ids:
            os.makedirs(info.workdir, exist_ok=True)
            with open(os.path.join(info.workdir, IDS_FILE), "w") as f:
                json.dump(ids, f, indent=1)

    def _start(self, name: str, info: RunInfo, run_id: str | None) -> None:
        self.live[name] = REGISTRY[name](dataclasses.replace(info, run_id=run_id))

    def _try(self, name: str, what: str, call: Callable, *args) -> None:
        try:
            call(*args)
        except Exception as e:  # a tracker never stops the run
            log.warning("tracker %s failed to %s, skipped from now on: %r", name, what, e)
            tracker = self.live.pop(name, None)
            if tracker is not None:
                try:
                    tracker.close()
                except Exception:
                    pass

    def _each(self, what: str, method: str, *args) -> None:
        for name, tracker in list(self.live.items()):
            self._try(name, what, getattr(tracker, method), *args)

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        self._each(f"log step {step}", "log_scalars", step, scalars)

    def log_table(self, step: int, name: str, columns: Sequence[str], rows: Sequence) -> None:
        self._each(f"log table {name} at step {step}", "log_table", step, name, columns, rows)

    def log_config(self, config: dict) -> None:
        self._each("log the config", "log_config", config)

    def log_image(self, step: int, name: str, image) -> None:
        """image: uint8[H, W, 3] (TensorBoard add_image, wandb.Image, MLflow log_image)."""
        self._each(f"log image {name} at step {step}", "log_image", step, name, image)

    def close(self) -> None:
        for name, tracker in list(self.live.items()):
            try:
                tracker.close()
            except Exception as e:
                log.warning("tracker %s failed to close: %r", name, e)
        self.live = {}
