"""What a user reads (SPEC section 9): metrics.jsonl, TensorBoard events, markdown logs of
rollouts, token weights and attention diagnostics, and a console progress line."""

from __future__ import annotations

import json
import math
import os
import sys
import time


def _clean(v):
    v = float(v)
    return v if math.isfinite(v) else None


class MetricsWriter:
    """One JSON object per step in metrics.jsonl plus the same scalars in TensorBoard."""

    def __init__(self, workdir: str, enabled: bool = True):
        self.enabled = enabled
        if not enabled:
            return
        os.makedirs(workdir, exist_ok=True)
        self.path = os.path.join(workdir, "metrics.jsonl")
        self._f = open(self.path, "a", buffering=1)
        from tensorboardX import SummaryWriter

        self._tb = SummaryWriter(os.path.join(workdir, "tb"))

    def write(self, step: int, scalars: dict) -> None:
        if not self.enabled:
            return
        row = {"step": int(step)}
        row.update({k: _clean(v) for k, v in sorted(scalars.items())})
        self._f.write(json.dumps(row) + "\n")
        for k, v in row.items():
            if k != "step" and v is not None:
                self._tb.add_scalar(k, v, step)
        self._tb.flush()

    def close(self) -> None:
        if self.enabled:
            self._f.close()
            self._tb.close()


class MarkdownLog:
    """Appends sections to <workdir>/<name>.md."""

    def __init__(self, workdir: str, name: str, title: str, enabled: bool = True):
        self.enabled = enabled
        self.path = os.path.join(workdir, f"{name}.md")
        if enabled and not os.path.exists(self.path):
            os.makedirs(workdir, exist_ok=True)
            with open(self.path, "w") as f:
                f.write(f"# {title}\n\n")

    def append(self, text: str) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(text.rstrip() + "\n\n")


def rollout_section(step, prompts, completions, rewards: dict, totals, advantages, limit=8):
    lines = [f"## Step {step}", ""]
    for i in range(min(limit, len(completions))):
        parts = ", ".join(f"{k}={float(v[i]):.2f}" for k, v in rewards.items())
        lines += [
            f"### Sample {i}",
            f"**Prompt:** {prompts[i]}",
            "",
            f"**Completion:** {completions[i]}",
            "",
            f"**Rewards:** {parts}; total={float(totals[i]):.3f}; "
            f"advantage={float(advantages[i]):.3f}",
            "",
        ]
    return "\n".join(lines)


def token_weight_section(step, token_texts: list[list[str]], weights, limit=4):
    lines = [f"## Step {step}", ""]
    for i in range(min(limit, len(token_texts))):
        words = " ".join(f"{t}({float(w):.2f})" for t, w in zip(token_texts[i], weights[i]))
        lines += [f"- sample {i}: {words}"]
    return "\n".join(lines)


def attention_section(step, metrics: dict):
    lines = [f"## Step {step}", "", "| metric | mean |", "|---|---|"]
    for k, v in sorted(metrics.items()):
        lines.append(f"| {k} | {float(v):.4f} |")
    return "\n".join(lines)


class Progress:
    """A console line per step: step/total, key metrics, rate and ETA."""

    def __init__(self, total: int, start: int = 0, enabled: bool = True):
        self.total, self.start, self.enabled = total, start, enabled
        self.t0 = time.time()

    def update(self, step: int, scalars: dict, keys=("reward/total", "loss", "val/accuracy")):
        if not self.enabled:
            return
        done = step + 1 - self.start
        rate = (time.time() - self.t0) / max(done, 1)
        eta = rate * (self.total - step - 1)
        shown = "  ".join(f"{k}={scalars[k]:.3f}" for k in keys if k in scalars)
        print(
            f"[{step + 1}/{self.total}] {shown}  {rate:.1f}s/step  ETA {eta / 60:.1f} min",
            file=sys.stdout,
            flush=True,
        )
