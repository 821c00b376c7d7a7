"""Rewards off the main thread: a call that hangs is bounded by the timeout (in-process and
in worker processes), scores 0, is counted, and its worker is replaced; a stop request
abandons the calls."""

from __future__ import annotations

import time

import numpy as np
import pytest

from jaxvrl.rl import rewards as R
from jaxvrl.rl.reward_forms import RowInput
from jaxvrl.rl.reward_pool import RewardPool, RewardsInterrupted
from jaxvrl.trainer.scoring import RewardScorer

HANGS = """
import os, time

def hang(completions, **kw):
    if any("hang" in c for c in completions):
        time.sleep(3600)
    return [1.0] * len(completions)

def pid(completions, **kw):
    return [float(os.getpid())] * len(completions)
"""


@pytest.fixture
def hang_file(tmp_path):
    path = tmp_path / "hangs.py"
    path.write_text(HANGS)
    return str(path)


@pytest.mark.parametrize("workers", [0, 1])
def test_a_hanging_call_is_bounded_counted_and_its_worker_replaced(hang_file, workers):
    spec = f"{hang_file}:hang"
    fns = {"hang": R.SafeReward("hang", R.load_reward_fn(spec), spec)}
    scorer = RewardScorer(fns, num_workers=workers, timeout_s=0.5)
    scorer.pool.start()
    time.sleep(0.5 * workers)  # the worker's start is not the call's time
    rows = [{"problem": "p", "answer": "a"}] * 2
    try:
        t0 = time.monotonic()
        values, _ = scorer.score(rows, ["ok", "hang"], np.ones(2))
        assert time.monotonic() - t0 < 3.0
        np.testing.assert_array_equal(values["hang"], [0.0, 0.0])
        assert fns["hang"].timeouts == fns["hang"].failures == 1
        assert scorer.pool.replaced == 1
        values, _ = scorer.score(rows, ["ok", "fine"], np.ones(2))  # the replacement works
        np.testing.assert_array_equal(values["hang"], [1.0, 1.0])
        assert fns["hang"].timeouts == 1
    finally:
        scorer.close()


def test_workers_score_in_other_processes_and_a_stop_abandons_the_calls(hang_file):
    import os

    specs = [f"{hang_file}:pid", f"{hang_file}:hang"]
    fns = [R.load_reward_fn(s) for s in specs]
    forms = [R.SafeReward(s, f).form for s, f in zip(specs, fns)]
    pool = RewardPool(specs, fns, forms, [{}, {}], num_workers=2, timeout_s=60)
    row = RowInput("p", "hang", 1, None, {})
    try:
        [out] = pool.collect([pool.submit(0, [row])])
        assert out.scores[0][0] not in (0.0, float(os.getpid()))
        tid = pool.submit(1, [row])
        t0 = time.monotonic()
        with pytest.raises(RewardsInterrupted):
            pool.collect([tid], stop=lambda: time.monotonic() - t0 > 0.3)
        assert time.monotonic() - t0 < 2.0
    finally:
        pool.close()
