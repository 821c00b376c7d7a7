"""Subprocess helpers for the checkpoint tests (not collected by pytest).

python ckpt_worker.py sigterm DIR  : a loop that saves and exits 0 when SIGTERM arrives
python ckpt_worker.py gcs          : save/restore against a loopback GCS emulator
python ckpt_worker.py gcs-damaged  : resume past a damaged step against the emulator
python ckpt_worker.py resume DIR   : train.resume from DIR (steps of `many_arrays`), on the console
"""

from __future__ import annotations

import json
import os
import sys
import time


def sigterm_loop(directory: str) -> None:
    import jax.numpy as jnp

    from jaxvrl.checkpoint import Checkpointer, PreemptionFlag

    flag = PreemptionFlag()
    ckpt = Checkpointer(directory, max_to_keep=1)
    state = {"w": jnp.zeros(3)}
    print("ready", flush=True)
    for step in range(1, 10_000):
        state = {"w": state["w"] + 1}
        time.sleep(0.01)
        if flag.requested:
            ckpt.save(step, {"state": state, "meta": {"stopped_by": flag.signal_name}}, force=True)
            ckpt.close()
            print(f"saved {step} on {flag.signal_name}", flush=True)
            return
    sys.exit(3)  # never got the signal


def gcs_round_trip() -> None:
    from tests.trainer_infra.gcs_emulator import start_emulator

    server, url = start_emulator()
    import gcsfs
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxvrl.checkpoint import Checkpointer

    directory = "gs://jaxvrl-test/run/checkpoints"
    state = {"w": jnp.arange(6.0).reshape(2, 3), "step": jnp.int32(0)}
    ckpt = Checkpointer(directory, max_to_keep=2)
    for step in (1, 2, 3):
        state = {"w": state["w"] * 2, "step": jnp.int32(step)}
        replay = bytes(range(256)) * step  # the replay buffer's bytes, one file per process
        meta = {"kl_coef": 0.1 * step}
        items = {"state": state, "rng": jax.random.key(step), "meta": meta, "replay": replay}
        ckpt.save(step, {**items, "data_state": {"pos": step}})
    ckpt.close()
    fs = gcsfs.GCSFileSystem(endpoint_url=url, token="anon")
    listed = sorted(p.rsplit("/", 1)[-1] for p in fs.ls("jaxvrl-test/run/checkpoints"))
    fresh = Checkpointer(directory, max_to_keep=2)
    r = fresh.restore_latest({"state": jax.eval_shape(lambda: state)})
    fresh.close()
    server.stop()
    ok = (
        np.array_equal(np.asarray(r.state["w"]), np.arange(6.0).reshape(2, 3) * 8)
        and int(r.state["step"]) == 3
        and np.array_equal(jax.random.key_data(r.rng), jax.random.key_data(jax.random.key(3)))
        and r.replay == bytes(range(256)) * 3
    )
    print(
        json.dumps(
            {"ok": ok, "step": r.step, "meta": r.meta, "data": r.data_state, "listed": listed}
        ),
        flush=True,
    )


def gcs_damaged() -> None:
    """Steps 1-3 in the bucket, step 3's largest array file cut in half: restore_latest warns,
    moves 3 aside and restores 2; steps 3 and 4 are saved again, max_to_keep=2 keeps them."""
    from tests.trainer_infra.gcs_emulator import start_emulator

    server, url = start_emulator()
    import gcsfs
    import jax.numpy as jnp
    import numpy as np

    from jaxvrl.checkpoint import Checkpointer

    directory, root = "gs://jaxvrl-test/damaged/checkpoints", "jaxvrl-test/damaged/checkpoints"
    fs = gcsfs.GCSFileSystem(endpoint_url=url, token="anon")

    def listed():
        fs.invalidate_cache()
        return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root))

    def weights(step):  # random: the array data is the largest file of the step
        return {"w": jnp.asarray(np.random.default_rng(step).normal(size=(64, 64)), jnp.float32)}

    ckpt = Checkpointer(directory, max_to_keep=3)
    for step in (1, 2, 3):
        ckpt.save(step, {"state": weights(step), "data_state": {"pos": step}})
    ckpt.close()
    size, big = max((fs.size(p), p) for p in fs.find(f"{root}/3/state"))
    fs.pipe(big, fs.cat(big)[: size // 2])
    ckpt = Checkpointer(directory, max_to_keep=2)
    r = ckpt.restore_latest({"state": weights(0)})
    after_restore = listed()
    for step in (3, 4):
        ckpt.save(step, {"state": weights(10 * step)})
    ckpt.close()
    fresh = Checkpointer(directory)
    last = fresh.restore_latest({"state": weights(0)})
    fresh.close()
    out = {
        "damaged_file": big.rsplit("/3/", 1)[-1],
        "restored": r.step,
        "restored_ok": np.array_equal(r.state["w"], weights(2)["w"]) and r.data_state == {"pos": 2},
        "after_restore": after_restore,
        "after_saves": listed(),
        "last": last.step,
        "last_ok": np.array_equal(last.state["w"], weights(40)["w"]),
    }
    server.stop()
    print(json.dumps(out), flush=True)


def many_arrays(step: int, n: int = 128) -> dict:
    """A train state of `n` small arrays (a tiny model's count) and a large one."""
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(step)
    params = {f"p{i:03d}": rng.normal(size=(16, 16)).astype(np.float32) for i in range(n)}
    params["embed"] = rng.normal(size=(256, 256)).astype(np.float32)
    return {"params": {k: jnp.asarray(v) for k, v in params.items()}, "step": jnp.int32(step)}


def resume(directory: str) -> None:
    """train.resume from `directory` as the trainer calls it, with the trainer's console
    logging; prints what it restored as one JSON line, after the reads' threads had a moment
    to report anything left over."""
    import gc
    from types import SimpleNamespace

    import jax
    import numpy as np

    from jaxvrl import train
    from jaxvrl.checkpoint import Checkpointer
    from jaxvrl.logging import show_logs

    show_logs()
    got = {}
    data = SimpleNamespace(set_state=lambda s: got.update(data=s))
    counters = SimpleNamespace(load=lambda s: got.update(counters=s))
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("data",))
    c = SimpleNamespace(resume=True, seed=0)
    ckpt = Checkpointer(directory, max_to_keep=3)
    state = jax.eval_shape(lambda: many_arrays(0))
    start, state, _, meta, _ = train.resume(c, ckpt, state, data, mesh, counters)
    ckpt.close()
    ok = bool(np.array_equal(state["params"]["embed"], many_arrays(start)["params"]["embed"]))
    gc.collect()
    time.sleep(1)
    print(json.dumps({"start": start, "ok": ok, "meta": meta, **got}), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    if sys.argv[1] == "sigterm":
        sigterm_loop(sys.argv[2])
    elif sys.argv[1] == "gcs-damaged":
        gcs_damaged()
    elif sys.argv[1] == "resume":
        resume(sys.argv[2])
    else:
        gcs_round_trip()
