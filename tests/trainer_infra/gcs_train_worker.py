"""A train run whose model and workdir are gs:// paths on a loopback GCS emulator (run by
test_remote.py in a subprocess: the emulator's environment must be set before gcsfs and
tensorstore start). Prints one JSON line with what the bucket holds after each run and
whether the second run resumed with the parameters the first one saved.

    python gcs_train_worker.py [DEADLINE_S]

After DEADLINE_S seconds (default 480) every thread's stack is written to stderr and the
process exits: a hang shows where it is instead of running into the test's timeout."""

from __future__ import annotations

import faulthandler
import json
import os
import sys


def _host_params(state):
    import jax
    import numpy as np

    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(state.params))]


def _watch(train):
    """Wraps train.Checkpointer.save and train.resume (looked up when a run starts) to keep a
    host copy of the parameters saved and of those a resumed run starts from."""
    seen = {"saved": {}, "started": []}

    class Checkpointer(train.Checkpointer):
        def save(self, step, items, *args, **kwargs):
            seen["saved"][step] = _host_params(items["state"])
            return super().save(step, items, *args, **kwargs)

    resume = train.resume

    def watched_resume(*args, **kwargs):
        start, state, *rest = resume(*args, **kwargs)
        seen["started"].append((start, _host_params(state)))
        return (start, state, *rest)

    train.Checkpointer = Checkpointer
    train.resume = watched_resume
    return seen


def main() -> None:
    from tests.trainer_infra.gcs_emulator import start_emulator

    server, url = start_emulator()
    try:
        out = runs(url)
    finally:
        server.stop()
    print(json.dumps(out), flush=True)


def runs(url: str) -> dict:
    import fsspec
    import numpy as np

    from jaxvrl import train
    from jaxvrl.config import load_config

    seen = _watch(train)
    fs = fsspec.filesystem("gs", endpoint_url=url, token="anon")
    for name in os.listdir(train.EMBEDDED):
        fs.put(os.path.join(train.EMBEDDED, name), f"jaxvrl-test/models/tiny/{name}")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    overrides = [
        "model.path=gs://jaxvrl-test/models/tiny",
        "workdir=gs://jaxvrl-test/runs/grpo",
        "val_before_train=False",
        "val_size=0",  # no validation
    ]
    out = {}
    for total in (2, 3):  # the second run resumes from the first's checkpoint at step 2
        cfg = load_config(
            os.path.join(root, "configs/grpo.py") + ":runlocal",
            [f"total_steps={total}", *overrides],
        )
        metrics = train.run(cfg)
        fs.invalidate_cache()
        listed = sorted(
            p.split("runs/grpo/", 1)[1] for p in fs.find("jaxvrl-test/runs/grpo") if "/tb/" not in p
        )
        with fs.open("jaxvrl-test/runs/grpo/metrics.jsonl") as f:
            steps = [json.loads(line)["step"] for line in f.read().decode().splitlines()]
        out[f"run{total}"] = {
            "steps": steps,
            "files": [p for p in listed if not p.startswith("checkpoints/")],
            "checkpoints": sorted(
                {p.split("/")[1] for p in listed if p.startswith("checkpoints/")}
            ),
            "tb": bool(fs.find("jaxvrl-test/runs/grpo/tb")),
            "loss_finite": bool(metrics.get("loss") == metrics.get("loss")),
        }
    (_, initial), (start, resumed) = seen["started"]
    saved = seen["saved"][2]

    def equal(xs, ys):
        return len(xs) == len(ys) and all(
            a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(xs, ys)
        )

    out["resumed_step"] = start
    out["resumed_params_equal"] = equal(saved, resumed)
    out["trained"] = not equal(saved, initial)  # so the equality says something
    out["params_leaves"] = len(saved)
    return out


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    faulthandler.dump_traceback_later(float(sys.argv[1]) if len(sys.argv) > 1 else 480, exit=True)
    main()
