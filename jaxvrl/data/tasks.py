"""The built-in tasks: what a run trains on when `data.train_files` is unset (`data.builtin_task`),
each with the tiny checkpoint shipped in the package that `python -m jaxvrl.sft --task NAME`
taught its answer format (the model when `model.path` is unset).

- shapes: multiple-choice questions about a drawn shape (`jaxvrl.data.synthetic`), for the tiny
  Qwen2.5-VL; scored by `mc_idx`.
- arithmetic: one-digit sums (`jaxvrl.data.arithmetic`), for the tiny text-only Llama; scored by
  `accuracy`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jaxvrl import models
from jaxvrl.data import arithmetic, synthetic


@dataclasses.dataclass(frozen=True)
class BuiltinTask:
    name: str
    checkpoint: str  # directory of the embedded checkpoint taught this task
    system_prompt: str
    make_split: Callable[..., list[dict]]  # (split, n, seed, kinds=...) -> rows
    has_images: bool


TASKS = {
    "shapes": BuiltinTask(
        "shapes", models.EMBEDDED, synthetic.SYSTEM_PROMPT, synthetic.make_split, True
    ),
    "arithmetic": BuiltinTask(
        "arithmetic", models.EMBEDDED_TEXT, arithmetic.SYSTEM_PROMPT, arithmetic.make_split, False
    ),
}
