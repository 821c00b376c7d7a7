"""A train run whose model and workdir are gs:// paths on a loopback GCS emulator (run by
test_remote.py in a subprocess: the emulator's environment must be set before gcsfs and
tensorstore start). Prints one JSON line with what the bucket holds after each run."""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    from tests.trainer_infra.gcs_emulator import start_emulator

    server, url = start_emulator()
    import fsspec

    from jaxvrl.config import load_config
    from jaxvrl.train import EMBEDDED, run

    fs = fsspec.filesystem("gs", endpoint_url=url, token="anon")
    for name in os.listdir(EMBEDDED):
        fs.put(os.path.join(EMBEDDED, name), f"jaxvrl-test/models/tiny/{name}")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    overrides = [
        "model.path=gs://jaxvrl-test/models/tiny",
        "workdir=gs://jaxvrl-test/runs/grpo",
        "val_freq=2",
    ]
    out = {}
    for total in (2, 3):  # the second run resumes from the first's checkpoint at step 2
        cfg = load_config(
            os.path.join(root, "configs/grpo.py") + ":runlocal",
            [f"total_steps={total}", *overrides],
        )
        metrics = run(cfg)
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
    server.stop()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    main()
