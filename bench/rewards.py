"""Reward scoring in worker processes against in-process: a reward taking 0.2 s per row
(a stand-in for an LLM judge or a slow math check) over 64 rows.

    python bench/rewards.py [--rows 64] [--per_row_s 0.2] [--workers 4]

Both run through the trainer's scorer (jaxvrl/trainer/scoring.py: RewardScorer), the verl
per-row form; the workers are started and warmed by one call before the timing (a run
starts them once)."""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np

REWARD = """
import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep({per_row_s})
    return float(solution_str == ground_truth)
"""


def timed(spec: str, rows: int, workers: int) -> tuple[float, float]:
    from jaxvrl.rl.rewards import SafeReward, load_reward_fn
    from jaxvrl.trainer.scoring import RewardScorer

    fns = {"slow": SafeReward("slow", load_reward_fn(spec), spec)}
    scorer = RewardScorer(fns, num_workers=workers, timeout_s=60.0)
    data = [{"problem": f"q{i}", "answer": str(i % 4)} for i in range(rows)]
    texts = [str(i % 3) for i in range(rows)]
    try:
        t0 = time.perf_counter()
        scorer.score(data[: workers or 1], texts[: workers or 1], np.ones(rows))  # warm-up
        start_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        values, _ = scorer.score(data, texts, np.ones(rows))
        wall = time.perf_counter() - t0
    finally:
        scorer.close()
    assert fns["slow"].failures == 0
    expect = [float(t == d["answer"]) for t, d in zip(texts, data)]
    np.testing.assert_array_equal(values["slow"], expect)
    return wall, start_s


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--per_row_s", type=float, default=0.2)
    p.add_argument("--workers", type=int, default=4)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "slow_reward.py")
        with open(path, "w") as f:
            f.write(REWARD.format(per_row_s=a.per_row_s))
        spec = f"{path}:compute_score"
        base, _ = timed(spec, a.rows, 0)
        pool, start = timed(spec, a.rows, a.workers)
    print(f"{a.rows} rows x {a.per_row_s} s, os.cpu_count()={os.cpu_count()}")
    print("| scoring | wall s | vs in-process |")
    print("|---|---|---|")
    print(f"| in-process (num_workers=0) | {base:.2f} | 1.00x |")
    print(f"| num_workers={a.workers} | {pool:.2f} | {pool / base:.2f}x |")
    print(f"(workers' start and first call: {start:.2f} s, once per run)")


if __name__ == "__main__":
    main()
