"""What the attention pictures cost: the main job (`jaxvrl.train.run`) on the embedded default
with and without `logging.attention_samples`, the same run otherwise (the default cadence,
`log_rollouts_every`, unless overridden).

    python bench/diagnostics.py                                   # configs/vgr.py, 10 steps
    python bench/diagnostics.py --steps 60 --samples 2            # the default run's length
    python bench/diagnostics.py --config configs/tprl.py --set log_rollouts_every=5
    python bench/diagnostics.py --draw-only                       # the drawing alone, seconds

Each round runs the job once with `logging.attention_samples=0` and once with `--samples`
(order alternating between rounds), each in a fresh workdir, and prints the wall time of
`run()` (compiles included: the diagnostic pass compiles its own program once), the
difference and the ratio; the summary takes the minimum over rounds per variant.

`--draw-only` skips the runs: it draws the pictures of `--samples` synthetic samples of the
embedded default's sizes (`draw_only`) through `RunLogs.attention_maps`, as a logged step
does, and prints the seconds per logged step and where they go.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import tempfile
import time

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


def synthetic_sample(rng, frames: int = 1, perturbed: bool = False, tokens: int = 12) -> dict:
    """One diagnostic sample (`AttentionMaps.__call__`'s layout) of the embedded default's sizes:
    `frames` frames float[56, 56, 3] (patch 14, merge 2: a 2 x 2 merged grid each), 4 layers,
    a completion of `tokens` tokens with VGR weights and entropies; perturbed: also the
    blackened image's maps, perception scores and mask (a TPRL run)."""
    import numpy as np

    from jaxvrl.trainer.diagnostics import BANDS

    def grids():
        return {band: [rng.random((2, 2)) for _ in range(frames)] for band in BANDS}

    shown = {"clean": [rng.random((56, 56, 3)).astype(np.float32) for _ in range(frames)]}
    maps = {"clean": grids()}
    values = {"VGR weight": rng.uniform(0.2, 3.0, tokens), "entropy": rng.random(tokens) * 4}
    if perturbed:
        shown["perturbed"] = [f * (rng.random((56, 56, 1)) > 0.5) for f in shown["clean"]]
        maps["perturbed"] = grids()
        values["perception score"] = rng.normal(size=tokens)
        values["perception mask"] = (rng.random(tokens) > 0.5).astype(np.float64)
    layers = {"mdi": rng.random(4) * 3, "aei_vision": rng.random(4)}
    ids = rng.integers(14, 448, tokens)
    return {"frames": shown, "maps": maps, "tokens": ids, "values": values, "layers": layers}


def draw_only(samples: int, repeats: int, frames: int = 1, perturbed: bool = False) -> float:
    """Seconds per logged step of `RunLogs.attention_maps` (drawing, PNGs, TensorBoard images,
    the markdown) for `samples` synthetic samples, over `repeats` logged steps after one warm-up
    step (imports, fonts); prints them, the seconds per call of each `heatmaps` function and of
    the trackers' images, and the drawing's share (the `heatmaps` calls but `save_png`)."""
    import numpy as np

    from jaxvrl.logging import heatmaps
    from jaxvrl.trainer.reporting import RunLogs

    class Tokenizer:  # token texts of the usual shapes: words, a newline, a tag
        def decode(self, ids):
            return [" the", "red", "\n", "<think>", " A", "square"][ids[0] % 6]

    spent: dict[str, list[float]] = {}

    def timed(name, fn):
        def call(*args, **kwargs):
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            spent.setdefault(name, []).append(time.perf_counter() - t)
            return out

        return call

    names = ("attention_overlay", "token_panel", "token_html", "layers_over_steps", "save_png")
    originals = {n: getattr(heatmaps, n) for n in names}
    for n in names:
        setattr(heatmaps, n, timed(n, originals[n]))
    rng = np.random.default_rng(0)
    try:
        with tempfile.TemporaryDirectory() as workdir:
            logs = RunLogs(workdir, total_steps=5 * (repeats + 1), backends=("tensorboard",))
            logs.trackers.log_image = timed("trackers.log_image", logs.trackers.log_image)
            for step in range(repeats + 1):
                batch = [synthetic_sample(rng, frames, perturbed) for _ in range(samples)]
                if step == 1:
                    spent.clear()
                    start = time.perf_counter()
                logs.attention_maps(5 * (step + 1), batch, Tokenizer())
                logs.wait_pictures()  # drawn on a thread of their own: count them whole
            per_step = (time.perf_counter() - start) / max(repeats, 1)
            logs.close()
    finally:
        for n in names:
            setattr(heatmaps, n, originals[n])
    print(f"draw only: {samples} samples, {frames} frame(s), perturbed={perturbed}: "
          f"{per_step:.3f} s per logged step (mean of {repeats})")  # fmt: skip
    for n, ts in spent.items():
        print(f"  {n}: {len(ts) / max(repeats, 1):.0f} per step, {np.mean(ts):.4f} s per call")
    drawing = sum(sum(ts) for n, ts in spent.items() if n in names and n != "save_png")
    print(f"  drawing: {drawing / max(repeats, 1):.3f} s per logged step")
    return per_step


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/vgr.py")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--samples", type=int, default=2, help="logging.attention_samples when on")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--set", nargs="*", default=[], help="more overrides, key=value")
    p.add_argument("--draw-only", action="store_true", help="time the drawing alone, no runs")
    p.add_argument("--repeats", type=int, default=5, help="logged steps timed (--draw-only)")
    p.add_argument("--frames", type=int, default=1, help="frames per sample (--draw-only)")
    p.add_argument("--perturbed", action="store_true", help="TPRL's pictures (--draw-only)")
    args = p.parse_args(argv)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    if args.draw_only:
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        print(f"{stamp}, commit {commit}, {machine}, load average {load}")
        draw_only(args.samples, args.repeats, args.frames, args.perturbed)
        return
    print(f"{stamp}, commit {commit}, {machine}; {args.config}, {args.steps} steps, {args.set}")
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
