"""A console progress line per step (plain prints, readable in CI logs and `tail -f`)."""

from __future__ import annotations

import logging
import sys
import time

DEFAULT_KEYS = ("reward/total", "accuracy", "loss", "kl", "entropy", "val/accuracy")


def show_logs() -> None:
    """jaxvrl's INFO messages on the console (stderr), others' from WARNING: the libraries
    we import may have configured the root logger first (absl does at import, at WARNING),
    which makes a later `logging.basicConfig` a no-op."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("jaxvrl").setLevel(logging.INFO)


def format_duration(seconds: float) -> str:
    """3725 -> '1:02:05'."""
    s = max(0, int(round(seconds)))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class Progress:
    """`[####......] 12/60  reward/total=3.125  loss=0.012  4.1s/step  ETA 0:03:17`.

    The rate is measured from the first update on (the first step's compilation does not
    count); before that, from construction. Only the primary process prints.
    """

    def __init__(
        self, total: int, start: int = 0, enabled: bool = True, keys=DEFAULT_KEYS, file=None
    ):
        self.total, self.start, self.enabled, self.keys = total, start, enabled, tuple(keys)
        self.file = file
        self.t0 = time.time()
        self._first: tuple[int, float] | None = None

    def line(self, step: int, scalars: dict, now: float | None = None) -> str:
        """The line after finishing `step` (0-based: step + 1 steps done)."""
        now = time.time() if now is None else now
        done = step + 1
        if self._first is None or done <= self._first[0]:
            rate = (now - self.t0) / max(done - self.start, 1)
        else:
            rate = (now - self._first[1]) / (done - self._first[0])
        eta = rate * max(self.total - done, 0)
        frac = min(max(done / max(self.total, 1), 0.0), 1.0)
        bar = "#" * int(frac * 20) + "." * (20 - int(frac * 20))
        shown = "  ".join(f"{k}={float(scalars[k]):.4g}" for k in self.keys if k in scalars)
        parts = [f"[{bar}] {done}/{self.total}", shown, f"{rate:.2f}s/step"]
        return "  ".join(p for p in parts if p) + f"  ETA {format_duration(eta)}"

    def update(self, step: int, scalars: dict) -> None:
        if not self.enabled:
            return
        now = time.time()
        print(self.line(step, scalars, now), file=self.file or sys.stdout, flush=True)
        if self._first is None:
            self._first = (step + 1, now)
