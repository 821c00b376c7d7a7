"""What the attention pictures cost: the main job (`jaxvrl.train.run`) on the embedded default
with and without `logging.attention_samples`, the same run otherwise (the default cadence,
`log_rollouts_every`, unless overridden).

    python bench/diagnostics.py                                   # configs/vgr.py, 10 steps
    python bench/diagnostics.py --steps 60 --samples 2            # the default run's length
    python bench/diagnostics.py --config configs/tprl.py --set log_rollouts_every=5

Each round runs the job once with `logging.attention_samples=0` and once with `--samples`
(order alternating between rounds), each in a fresh workdir, and prints the wall time of
`run()` (compiles included: the diagnostic pass compiles its own program once), the
difference and the ratio; the summary takes the minimum over rounds per variant.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import tempfile

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, ROOT)


def one_run(config: str, steps: int, samples: int, extra: list[str]) -> float:
    """Wall seconds of one `run()` in a fresh process (no compile cache shared between the
    variants) and a fresh workdir."""
    code = (
        "import sys, time; from jaxvrl.config import load_config; from jaxvrl.train import run\n"
        "c = load_config(sys.argv[1], sys.argv[2:]); t = time.time(); run(c)\n"
        "print('WALL', time.time() - t)\n"
    )
    with tempfile.TemporaryDirectory() as workdir:
        overrides = [
            f"total_steps={steps}",
            f"workdir={workdir}",
            f"logging.attention_samples={samples}",
            "logging.backends=tensorboard",
            *extra,
        ]
        out = subprocess.run(
            [sys.executable, "-c", code, os.path.join(ROOT, config), *overrides],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    return float([line for line in out.splitlines() if line.startswith("WALL")][-1].split()[1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/vgr.py")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--samples", type=int, default=2, help="logging.attention_samples when on")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--set", nargs="*", default=[], help="more overrides, key=value")
    args = p.parse_args(argv)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"{stamp}, commit {commit}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores; {args.config}, {args.steps} steps, {args.set}")  # fmt: skip
    times = {0: [], args.samples: []}
    for r in range(args.rounds):
        order = (0, args.samples) if r % 2 == 0 else (args.samples, 0)
        for samples in order:
            t = one_run(args.config, args.steps, samples, args.set)
            times[samples].append(t)
            print(f"round {r}: attention_samples={samples}: {t:.1f} s", flush=True)
    off, on = min(times[0]), min(times[args.samples])
    print(f"| attention_samples | wall s (min of {args.rounds}) |\n|---|---|")
    print(f"| 0 | {off:.1f} |\n| {args.samples} | {on:.1f} |")
    print(f"overhead: {on - off:+.1f} s ({(on / off - 1) * 100:+.1f}%)")


if __name__ == "__main__":
    main()
