"""Scalars per step: `<workdir>/metrics.jsonl` (one JSON object per step); the trackers
(TensorBoard, wandb, MLflow: trackers.py) receive the same names and values."""

from __future__ import annotations

import json
import math
import os

import numpy as np


def to_scalar(key: str, value) -> float:
    """Python / numpy / jax scalar or one-element array -> float (bool -> 0.0 / 1.0)."""
    arr = np.asarray(value)
    if arr.size != 1 or arr.dtype.kind not in "biuf":
        raise TypeError(
            f"metric {key!r} is not a numeric scalar: {type(value).__name__} shape {arr.shape}"
        )
    return float(arr.reshape(()))


def json_value(v: float) -> float | None:
    """NaN / inf -> None (JSON has no NaN; a null stands for 'non-finite')."""
    return v if math.isfinite(v) else None


def _trim_jsonl(path: str, last_step: int) -> None:
    """Drops rows with step > last_step (written after the checkpoint a run resumes from)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = f.readlines()
    kept = []
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a crash
            continue
        if row.get("step", 0) <= last_step:
            kept.append(line if line.endswith("\n") else line + "\n")
    if len(kept) != len(lines):
        with open(path, "w") as f:
            f.writelines(kept)


class MetricsWriter:
    """write(step, {name: scalar}) appends to metrics.jsonl; only the primary process
    (process 0) writes, the others do nothing.

    resume_step: when a run continues from a checkpoint at this step, rows of later steps
    (written before the crash or preemption) are dropped, so no step repeats.
    """

    def __init__(
        self,
        workdir: str,
        enabled: bool = True,
        *,
        resume_step: int | None = None,
    ):
        self.enabled = enabled
        self.path = os.path.join(workdir, "metrics.jsonl")
        if not enabled:
            return
        os.makedirs(workdir, exist_ok=True)
        if resume_step is not None:
            _trim_jsonl(self.path, resume_step)
        self._f = open(self.path, "a", buffering=1)

    def write(self, step: int, scalars: dict) -> dict[str, float]:
        """-> the row's values as floats (what the trackers receive); {} when disabled."""
        if not self.enabled:
            return {}
        values = {k: to_scalar(k, v) for k, v in sorted(scalars.items())}
        row = {"step": int(step), **{k: json_value(v) for k, v in values.items()}}
        self._f.write(json.dumps(row, ensure_ascii=False) + "\n")
        return values

    def close(self) -> None:
        if self.enabled:
            self._f.close()
            self.enabled = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
