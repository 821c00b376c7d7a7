"""Export from a gs:// workdir to a gs:// directory on a loopback GCS emulator, the base model
also on gs:// (run by test_export.py in a subprocess: the emulator's environment must be set
before gcsfs and tensorstore start).

    python gcs_export_worker.py LOCAL_WORKDIR TMP_DIR

Uploads LOCAL_WORKDIR (run.json, checkpoints) and the embedded model, exports, downloads the
export into TMP_DIR/downloaded and prints one JSON line."""

from __future__ import annotations

import json
import os
import sys


def main(workdir: str, tmp: str) -> None:
    from tests.trainer_infra.gcs_emulator import start_emulator

    server, url = start_emulator()
    import fsspec

    from jaxvrl import export as E

    fs = fsspec.filesystem("gs", endpoint_url=url, token="anon")
    fs.put(os.path.join(workdir, "run.json"), "jaxvrl-test/runs/full/run.json")
    fs.put(os.path.join(workdir, "checkpoints"), "jaxvrl-test/runs/full/", recursive=True)
    for name in os.listdir(E.EMBEDDED):
        fs.put(os.path.join(E.EMBEDDED, name), f"jaxvrl-test/models/tiny/{name}")
    r = E.export(
        "gs://jaxvrl-test/runs/full",
        "gs://jaxvrl-test/exports/full",
        base_model="gs://jaxvrl-test/models/tiny",
    )
    try:
        E.export("gs://jaxvrl-test/runs/none", "gs://jaxvrl-test/exports/none")
        missing = None
    except E.ExportError as e:
        missing = str(e)
    # the emulator keeps an upload's last byte whatever it is (a "\r" before gcsfs's closing
    # "\n--boundary" was once dropped: a checkpoint file ending so could not be read)
    kept = []
    for end in (b"\r", b"\n\r", b"\n", b"\r\n"):
        path = os.path.join(tmp, "ends_" + end.hex())
        with open(path, "wb") as f:
            f.write(b"\x00\r\n" * 100 + end)
        fs.put(path, f"jaxvrl-test/ends/{end.hex()}")
        kept.append(fs.cat(f"jaxvrl-test/ends/{end.hex()}") == open(path, "rb").read())
    fs.invalidate_cache()
    local = os.path.join(tmp, "downloaded")
    os.makedirs(local, exist_ok=True)
    files = sorted(p.rsplit("/", 1)[-1] for p in fs.ls("jaxvrl-test/exports/full"))
    for name in files:
        fs.get(f"jaxvrl-test/exports/full/{name}", os.path.join(local, name))
    server.stop()
    report = {"step": r.step, "files": files, "missing_run_error": missing, "kept": kept}
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    main(*sys.argv[1:3])
