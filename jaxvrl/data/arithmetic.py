"""The built-in text task: one-digit sums whose answers `accuracy` checks.

Each row asks "What is a + b?" for a and b drawn from 0-9; `answer` holds the sum. Rows use the
standard row format (`problem`, `answer`) and hold no images, so a text-only model trains on
them. The held-out split draws the same 100 sums with another seed: like the visual task's
held-out images, it measures whether the model answers what it has learnt to compute, not
whether it generalises to unseen numbers.
"""

from __future__ import annotations

import numpy as np

SPLIT_SEEDS = {"train": 0, "test": 1_000_003}
SYSTEM_PROMPT = (
    "You are a helpful assistant. Think briefly in <think></think>, then reply with "
    "'Answer: N' where N is the number."
)


def make_split(split: str = "train", n: int = 256, seed: int = 0, **_) -> list[dict]:
    """n rows, deterministic in (split, seed)."""
    if split not in SPLIT_SEEDS:
        raise ValueError(f"split must be one of {sorted(SPLIT_SEEDS)}, got {split!r}")
    rng = np.random.default_rng(SPLIT_SEEDS[split] + seed)
    pairs = rng.integers(0, 10, size=(n, 2))
    return [
        {
            "id": f"{split}-{seed}-{i}",
            "problem": f"What is {a} + {b}?",
            "answer": str(a + b),
            "operands": [int(a), int(b)],
            "kind": "sum",
        }
        for i, (a, b) in enumerate(pairs)
    ]


def target_completion(row: dict, answer: int | None = None) -> str:
    """The answer format the embedded text checkpoint is taught: the sum worked out in the
    think, then the answer (`answer`: another number than the sum, to teach a wrong one)."""
    a, b = row["operands"]
    return f"<think>{a} + {b} = {a + b}</think> Answer: {a + b if answer is None else answer}"
