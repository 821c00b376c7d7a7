"""A run's running totals: what the metrics rows count from the run's start, so that the last
row tells the whole run. Rows skipped per reason (`data/skipped_<reason>`), reward failures
and timeouts per function (`reward/<name>_failures`, `reward/<name>_timeouts`, counted by the
rollout phase's SafeRewards) and the
sums of per-step counts in `TOTALS`; `train/nonfinite_total` lives in the train state.

Each process keeps its own (its data shard's skipped rows, its rewards' failures), saved in
the checkpoint beside the data-iterator state (`state`, `load`), so a resumed run counts on
from the checkpoint and a row read again after the resume is not counted twice. The logged
skip counts and failures are sums over the processes.
"""

from __future__ import annotations

import collections
import dataclasses

import jax

from jaxvrl.data.rows import SkipStats
from jaxvrl.parallel import runtime

# per-step metric (the same on every process: already combined) -> its running total
TOTALS = {
    "rollout/gen_batches": "rollout/gen_batches_total",
    "replay/replaced": "replay/replaced_total",
}


@dataclasses.dataclass
class RunCounters:
    """skipped: the training data's live SkipStats; rewards: {name: SafeReward}, the rollout
    phase's; totals: {total name: value} of `TOTALS`."""

    skipped: SkipStats
    rewards: dict
    totals: dict = dataclasses.field(default_factory=dict)

    def state(self) -> dict:
        """This process's counters, JSON for the checkpoint."""
        return {
            "skipped": self.skipped.state(),
            "reward_failures": {k: fn.failures for k, fn in self.rewards.items()},
            "reward_timeouts": {k: fn.timeouts for k, fn in self.rewards.items()},
            "totals": dict(self.totals),
        }

    def load(self, state: dict | None) -> None:
        """Continue from `state()`; None (a checkpoint written before counters were saved)
        leaves them at zero. Counts of a reward this run does not have are dropped."""
        if state is None:
            return
        self.skipped.set_state(state.get("skipped", {}))
        for item, attr in (("reward_failures", "failures"), ("reward_timeouts", "timeouts")):
            for name, n in state.get(item, {}).items():
                if name in self.rewards:
                    setattr(self.rewards[name], attr, int(n))
        self.totals = dict(state.get("totals", {}))

    def update(self, metrics: dict) -> dict:
        """Adds a step's `metrics` to the totals -> the running totals and the skip counts
        (summed over processes: a collective with several; reasons with no row left out)."""
        for key, total in TOTALS.items():
            if key in metrics:
                self.totals[total] = self.totals.get(total, 0.0) + float(metrics[key])
        counts = dict(self.skipped.counts)
        if jax.process_count() > 1:
            summed = collections.Counter()
            for c in runtime.gather_json(counts):
                summed.update(c)
            counts = dict(summed)
        return {**self.totals, **{f"data/skipped_{k}": v for k, v in counts.items() if v}}
