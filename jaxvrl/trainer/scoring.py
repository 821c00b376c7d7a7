"""The run's rewards on a batch of completions: each row's inputs built from its dataset row
(the rendered prompt, the completion, the label, the row's columns, its images for the forms
that take them), the calls sent to the reward pool (jaxvrl/rl/reward_pool.py: one per batch
chunk, or one per row for the per-row forms), their outcomes counted per function
(jaxvrl/rl/rewards.py: SafeReward) and the rows' values and sub-scores."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable

import numpy as np

from jaxvrl.data.rows import load_image, no_label, row_label
from jaxvrl.rl.reward_forms import RowInput
from jaxvrl.rl.reward_pool import RewardPool
from jaxvrl.rl.rewards import SafeReward

log = logging.getLogger(__name__)

# what the data pipeline adds to a row (encoded arrays, the rendered prompt, image
# references): not the dataset's columns
ENCODED = frozenset(
    {
        "prompt_ids",
        "input_ids",
        "pixel_values",
        "image_grid_thw",
        "pixel_values_videos",
        "video_grid_thw",
        "second_per_grid_ts",
        "prompt_text",
        "image_refs",
    }
)


def ground_truth(row: dict):
    """The row's label (`row_label`: label_idx, answer, solution, verl's nested
    `reward_model.ground_truth`), else a dotted `reward_model.ground_truth` column, else
    `ground_truth`."""
    label = row_label(row)
    if label is None:
        label = row.get("reward_model.ground_truth", row.get("ground_truth"))
    return None if no_label(label) else label


def row_columns(row: dict) -> dict:
    """Every column of the dataset row (what the pipeline added left out)."""
    return {k: v for k, v in row.items() if k not in ENCODED and not str(k).startswith("_")}


@dataclasses.dataclass
class RewardScorer:
    """The run's rewards {name: SafeReward} and the pool their calls run on.

    num_workers: worker processes (0: a thread of this process); timeout_s: each call's
    bound (math.inf: none); image_dir: where the rows' image references are; constants:
    batch-wide keywords of TRL-form functions (mdi_balance_ratio). `seconds`: wall time
    spent waiting for rewards since the last `take_seconds`."""

    rewards: dict
    num_workers: int = 0
    timeout_s: float = math.inf
    image_dir: str | None = None
    max_failure_fraction: float = 0.5
    failure_window: int = 5
    constants: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        fns: list[SafeReward] = list(self.rewards.values())
        self.pool = RewardPool(
            [f.spec for f in fns],
            [f.fn for f in fns],
            [f.form for f in fns],
            [f.kwargs for f in fns],
            self.num_workers,
            self.timeout_s,
        )
        self.seconds = 0.0
        self._images = any(f.form.takes_images for f in fns)
        self._warned_images = False

    def inputs(self, rows: list[dict], texts, lengths, extra: dict | None = None, ids=None):
        """[RowInput] for completion i of dataset row rows[i]; extra: per-row columns from
        the rollout ({"mdi": [...]}); ids: each completion's token ids (None: unknown)."""
        cache: dict[int, list] = {}
        out = []
        for i, (row, text) in enumerate(zip(rows, texts)):
            cols = row_columns(row)
            for k, v in (extra or {}).items():
                cols[k] = v[i]
            prompt = row.get("prompt_text") or row.get("problem") or ""
            images = None
            if self._images:
                if id(row) not in cache:
                    cache[id(row)] = self._load_images(row)
                images = cache[id(row)]
            out.append(
                RowInput(
                    str(prompt),
                    text,
                    int(lengths[i]),
                    ground_truth(row),
                    cols,
                    images,
                    None if ids is None else [int(t) for t in ids[i]],
                )
            )
        return out

    def _load_images(self, row: dict) -> list:
        refs = row.get("image_refs") or []
        try:
            return [load_image(r, self.image_dir) for r in refs]
        except Exception as e:  # noqa: BLE001 -- the row trained with them; a reward sees none
            if not self._warned_images:
                self._warned_images = True
                log.warning("a row's images could not be loaded for the rewards: %s", e)
            return []

    def submit(self, rows, texts, lengths, extra: dict | None = None, ids=None, step=None):
        """Queue every function's calls on the batch -> what `collect` takes. ids: each
        completion's token ids; step: the updates made before this batch (TRL-form rewards'
        `trainer_state.global_step`)."""
        t0 = time.monotonic()
        inputs = self.inputs(rows, texts, lengths, extra, ids)
        constants = self.constants
        if step is not None and "trainer_state" in constants:
            state = dataclasses.replace(constants["trainer_state"], global_step=int(step))
            constants = {**constants, "trainer_state": state}
        calls = {}
        for i, (name, fn) in enumerate(self.rewards.items()):
            # a per-row function's rows spread over the workers; a batch function sees the
            # whole batch in one call, as EasyR1 and TRL call it (it may compare rows)
            if fn.form.per_row:
                parts = [np.array([j]) for j in range(len(inputs))]
            else:
                parts = [np.arange(len(inputs))]
            calls[name] = [
                (self.pool.submit(i, [inputs[j] for j in p], constants), p) for p in parts
            ]
        return t0, len(inputs), calls

    def collect(self, pending, stop: Callable[[], bool] | None = None):
        """-> (values {name: float64[B]}, sub-scores {name/key: float64[B]}, NaN where a row
        has none). Raises RewardsInterrupted when `stop()` turns true first."""
        t0, n, calls = pending
        ids = [tid for parts in calls.values() for tid, _ in parts]
        outcomes = dict(zip(ids, self.pool.collect(ids, stop)))
        values, extras = {}, {}
        for name, parts in calls.items():
            fn: SafeReward = self.rewards[name]
            vals, subs = np.zeros(n), {}
            for tid, p in parts:
                o = outcomes[tid]
                fn.record(o.error, o.trace, o.timed_out)
                for j, (v, more) in zip(p, o.scores or []):
                    vals[j] = v
                    for key, x in more.items():
                        subs.setdefault(key, np.full(n, np.nan))[j] = x
            values[name] = vals
            extras.update({f"{name}/{k}": v for k, v in subs.items()})
        self.seconds += time.monotonic() - t0
        return values, extras

    def score(self, rows, texts, lengths, extra=None, stop=None, ids=None, step=None):
        return self.collect(self.submit(rows, texts, lengths, extra, ids, step), stop)

    def take_seconds(self) -> float:
        s, self.seconds = self.seconds, 0.0
        return s

    def end_step(self, tallies=None) -> str | None:
        """Close the step's tallies (`tallies`: RewardTally, default the rewards') -> why the
        run must end (`RewardTally.failing`), or None."""
        tallies = list(self.rewards.values() if tallies is None else tallies)
        for fn in tallies:
            fn.end_step(self.failure_window)
        for fn in tallies:
            why = fn.failing(self.max_failure_fraction, self.failure_window)
            if why:
                return why
        return None

    def close(self) -> None:
        self.pool.close()
