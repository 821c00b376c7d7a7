"""One process of the 2-process test (tests/parallel/test_multihost.py): 4 simulated CPU devices
each, 8 in all, joined by jax.distributed (gloo collectives on the CPU).

    python -m tests.parallel.multihost_worker PROCESS_ID PORT CHECKPOINT_DIR OUT_DIR
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import types

import jax
import numpy as np


def local_rows(batch, pid: int, n_proc: int):
    """This process's rows of a RolloutBatch (what its data-iterator shard would give)."""
    rows = batch.input_ids.shape[0]
    per = rows // n_proc
    take = lambda x: x[pid * per : (pid + 1) * per] if x.shape[0] == rows else x  # noqa: E731
    flat = dataclasses.replace(batch, position_ids=batch.position_ids.swapaxes(0, 1))
    flat = jax.tree.map(take, flat)
    return dataclasses.replace(flat, position_ids=flat.position_ids.swapaxes(0, 1))


def fake_rollout(pid: int):
    """One real group of two completions per process, named after the process."""
    group = types.SimpleNamespace(
        texts=[f"answer of process {pid}, sample {j}" for j in range(2)],
        parts={"accuracy": [1.0, 0.0]},
        totals=[1.0, 0.0],
        example={"problem": f"question of process {pid}"},
        att={"mdi": [0.5 + pid, float("nan")]},
    )
    rollout = types.SimpleNamespace(groups=[group], real=[True])
    return rollout, types.SimpleNamespace(advantages=np.array([0.7, -0.7]), token_weights=None)


def narrowing(model, graphdef, host, pid: int) -> list:
    """Both samplers on a rollout mesh over both processes (data 2 x tensor 4: a process's
    devices per row group), 4 prompts x 2 samples with rows of 1 to 6 tokens, whole and
    narrowed (8 rows halved to 2 as rows end): per engine, whether this process's rows are
    the same, the rows x steps each ran and the rows that came back to this process."""
    import jax.numpy as jnp

    from jaxvrl.parallel import runtime as R
    from jaxvrl.parallel import sharding as S
    from jaxvrl.sampling import Sampler, SamplingConfig, rollout_mesh
    from tests.helpers import G, make_prompts

    train = S.make_mesh(1, -1, 1)
    rmesh = rollout_mesh(train, data=2, tensor=4)
    ready = R.put_on_mesh(host, S.param_shardings(host, train))
    prompts = make_prompts(model, prompts=4, seed=9)
    pos = prompts.pop("position_ids")[:, ::G]
    prompts = dict(jax.tree.map(lambda x: x[::G], prompts), position_ids=pos)
    own = slice(2 * pid, 2 * pid + 2)  # this process's 2 prompts (per-row vision inputs too)
    mine = jax.tree.map(lambda x: x[own], {k: v for k, v in prompts.items() if k != "position_ids"})
    mine["position_ids"] = pos[:, own]
    d = R.place_batch(mine, rmesh)
    rows = np.arange(4 * pid, 4 * pid + 4, dtype=np.int32)  # this process's output rows
    d["limits"] = R.place_batch({"limits": rows % 6 + 1}, rmesh)["limits"]
    args = [d[k] for k in ("input_ids", "attention_mask", "position_ids", "deltas")]
    report = []
    for slots in (0, 8):
        got = {}
        for narrow in (0, 3):
            cfg = SamplingConfig(6, temperature=1.0, slots=slots, page_size=4, narrow=narrow,
                                 narrow_to=2, check_every=1)  # fmt: skip
            out, times = Sampler(graphdef, cfg, rmesh).timed(
                ready, *args, jax.random.key(1), images=d["images"], num_samples=G,
                limits=d["limits"],
            )  # fmt: skip
            got[narrow] = (R.host_local(out.tokens), R.host_local(jnp.asarray(out.logprobs)))
            work = times.get("decode_work", 8 * int(jax.device_get(out.steps)))
        same = np.array_equal(got[0][0], got[3][0])
        mine = len(got[0][0])  # the rows that came back to this process: its own 4
        report.append([same, float(np.abs(got[0][1] - got[3][1]).max()), work, mine])
    return report


def partial_on_pod(model, graphdef, host, pid: int) -> dict:
    """Partial rollouts over both processes (a rollout mesh of data 2 x tensor 4 in reversed
    device order: process 1's rows first in every global array of the sampler): 4 steps
    of one group per process, 2 prompts started per call, the policy of step v the weights
    scaled by 1 + 0.1 v; rows end at every 9th token id, so some outlive their step. Per
    process: the groups each step trained, the largest difference between a token's sampler
    log-prob and a teacher-forced pass of the version that sampled it (on this process's
    first device), the rows that spanned two versions, each step's metrics and the rows this
    process carried after it, and each step's decode work (this process's share of the slots
    x steps) and decode steps."""
    from jax.sharding import Mesh

    from jaxvrl.parallel import runtime as R
    from jaxvrl.parallel import sharding as S
    from jaxvrl.trainer.partial import PartialRollouts
    from tests.trainer.test_partial import G, N, example_stream, phase_of, teacher_forced

    train = S.make_mesh(1, -1, 1)
    reversed_mesh = Mesh(np.array(jax.devices())[::-1].reshape(2, 1, 1, 1, 4), S.MESH_AXES)
    assert reversed_mesh.devices.flat[0].process_index == 1
    phase = phase_of(model, graphdef, reversed_mesh, R.max_across_processes)
    shardings = S.param_shardings(host, train)
    versions = [jax.tree.map(lambda x, v=v: x * np.float32(1 + 0.1 * v), host) for v in range(4)]
    partial = PartialRollouts(1, G, N, oversample=2.0, max_staleness=5)
    examples = example_stream(100 + pid)  # each process its own prompts
    rows, trained, metrics, mixed, work = [], [], [], 0, []
    for step in range(4):
        key = jax.random.fold_in(jax.random.key(0), step)
        ready = R.put_on_mesh(versions[step], shardings)
        groups, info = partial.generate(phase, ready, examples, key, step)
        work.append([info["decode_work"], info["decode_steps"]])
        carried = int(sum((f.length > 0).sum() for f in partial.flights))
        metrics.append(dict(partial.take_metrics(groups, step), carried_here=carried))
        trained.append(len(groups))
        for x in groups:
            for j in range(G):
                n = int(x.mask[j].sum())
                v = x.versions[j, :n]
                mixed += len(set(v.tolist())) > 1
                rows.append((x.example, x.tokens[j, :n], v, x.logprobs[j, :n]))
    err = 0.0
    for ver in sorted({int(u) for *_, v, _ in rows for u in v}):
        ref = teacher_forced(graphdef, versions[ver], [(ex, t) for ex, t, _, _ in rows])
        for r, (_, toks, v, lp) in enumerate(rows):
            at = v == ver
            err = max(err, float(np.abs(lp[at] - ref[r, : len(toks)][at]).max(initial=0.0)))
    return {"trained": trained, "err": err, "mixed": mixed, "metrics": metrics, "work": work}


def packing_plans(model, mesh, pid: int) -> list:
    """A padding-free step's packing plan (`packing.fit_batch`) of 8 rows, 4 per process, on
    the training mesh `mesh` and on it in reversed device order (process 1's rows first in
    the global batch): per mesh, whether this process's share is its rows' part of the plan
    of the 8 rows in the order that mesh lays them out."""
    from jax.sharding import Mesh

    from jaxvrl.trainer.packing import fit_batch, plan_batch
    from tests.helpers import make_batch, step_config

    cfg = step_config({"actor.padding_free": True})
    batch = make_batch(model, 4, 4, pools=False, completion_seed=9, host=True)
    lengths = np.asarray(batch.attention_mask).sum(1)
    comp = (np.asarray(batch.completion_mask) > 0).sum(1)
    grid = np.asarray(mesh.devices)
    flipped = Mesh(grid.reshape(-1)[::-1].reshape(grid.shape), mesh.axis_names)
    same = []
    for m, first in ((mesh, 0), (flipped, 1)):  # the process whose rows come first
        got = fit_batch(local_rows(batch, pid, 2), jax.random.key(3), cfg, m)
        order = np.r_[4 * first : 4 * first + 4, 4 * (1 - first) : 4 * (1 - first) + 4]
        ref = plan_batch(lengths[order], comp[order], got.input_ids.shape[1],
                         jax.random.key(3), cfg, m)  # fmt: skip
        at = slice(0, 4) if pid == first else slice(4, 8)
        same.append(
            all(np.array_equal(getattr(got, k), ref[k][at]) for k in ("pack_start", "pack_order"))
            and got.pack_buffers == ref["pack_buffers"]
        )
    return same


def slots_on_pod(model, mesh, pid: int) -> list:
    """rollout.slots=auto on a pod whose devices report memory (as TPUs do; a stub here: a
    device of this process reports 1x or 2x a size where the slots do not fit every row, a
    device of the other process reports nothing): -> [the slots each process resolves, those
    of the smaller size given]. Every process must compile the same slots."""
    from unittest import mock

    from jaxvrl.config import ConfigError, load_config
    from jaxvrl.trainer import setup
    from tests.parallel.common import ROOT

    overrides = ["rollout.partial=true", "rollout.slots=auto", "model.dtype=float32"]
    c = load_config(os.path.join(ROOT, "configs", "base.py"), overrides)
    text = model.config.text
    rows = setup.rollout_slots(c, text, mesh, hbm=0)  # no memory figure: a slot per row
    low, high = 0, 2**40  # bisect for a size where 1 <= slots < rows (the same on both)
    while True:
        size = (low + high) // 2
        try:
            slots = setup.rollout_slots(c, text, mesh, hbm=size)
        except ConfigError:  # not one slot fits
            low = size
            continue
        if slots < rows:
            break
        high = size

    def reported(device):
        mine = device.process_index == jax.process_index()
        return size * (1 + pid) if mine else None

    with mock.patch.object(setup, "device_memory", reported):
        got = setup.rollout_slots(c, text, mesh)
    return [got, setup.rollout_slots(c, text, mesh, hbm=size)]


def main(pid: int, port: int, ckpt_dir: str, out_dir: str) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    import ml_collections

    from jaxvrl.parallel import runtime as R

    cfg = dict(enable=True, coordinator_address=f"127.0.0.1:{port}", num_processes=2)
    assert R.initialize_distributed(ml_collections.ConfigDict(dict(cfg, process_id=pid)))

    import jax.numpy as jnp
    import optax
    from flax import nnx
    from jax.experimental import multihost_utils

    from jaxvrl.checkpoint import Checkpointer
    from jaxvrl.models import qwen2_5_vl as q
    from jaxvrl.parallel import sharding as S
    from jaxvrl.sampling.layout import across
    from jaxvrl.trainer.reporting import RunLogs
    from jaxvrl.trainer.setup import device_split
    from jaxvrl.trainer.step import TrainState, build_train_step
    from tests.helpers import make_batch, step_config

    assert (jax.process_count(), jax.device_count(), jax.local_device_count()) == (2, 8, 4)
    model = q.load(ckpt_dir)
    graphdef, params0 = nnx.split(model, nnx.Param)
    host = jax.tree.map(np.asarray, params0)  # every process loads the same checkpoint
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.05, momentum=0.9))
    step_cfg = step_config({"actor.use_kl_loss": True, "actor.kl_loss_coef": 0.1})

    def init(p):
        z = lambda: jnp.zeros((), jnp.int32)  # noqa: E731
        return TrainState(p, tx.init(p), z(), z()), jax.tree.map(jnp.copy, p)

    mesh = R.mesh_from_config(ml_collections.ConfigDict(dict(data=2, fsdp=4, tensor=1)))
    params = R.put_on_mesh(host, S.param_shardings(host, mesh))
    (state, ref), (ssh, rsh) = R.sharded_init(init, mesh, params)
    step = R.jit_train_step(build_train_step(graphdef, tx, step_cfg), mesh, ssh, rsh)
    losses = []
    for seed in range(2):
        batch = make_batch(model, 4, seed, pools=False, completion_seed=seed + 1000, host=True)
        mine = local_rows(batch, pid, 2)
        global_batch = R.place_batch(mine, mesh)
        back = R.host_local(global_batch)  # what the sampler's outputs go through
        for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(mine)):
            assert (np.asarray(a) == np.asarray(b)).all()
        full = multihost_utils.process_allgather(global_batch.input_ids, tiled=True)
        assert (np.asarray(full) == batch.input_ids).all()  # process i's rows at [4i, 4i+4)
        state, metrics, _ = step(state, ref, global_batch, jax.random.key(seed))
        losses.append(float(metrics["loss"]))

    gather = lambda t: {  # noqa: E731
        ".".join(map(str, k)): np.asarray(multihost_utils.process_allgather(v.get_value(), True))
        for k, v in nnx.to_flat_state(t)
    }
    # one-step-off's weight copy: from the train step's devices to the sampler's on every
    # host, paired device to device (2 + 2 on each process) or through the hosts (3 + 1)
    copied = []
    for k, layout in ((4, (1, 2, 2)), (2, (1, 2, 1))):
        train, roll = device_split(ml_collections.ConfigDict({"rollout": {"devices": k}}))
        src = R.put_on_mesh(host, S.param_shardings(host, S.make_mesh(1, -1, 1, devices=train)))
        dst = S.param_shardings(host, S.make_mesh(*layout, devices=roll))
        moved = across(src, dst)
        pairs = zip(jax.tree.leaves(moved), jax.tree.leaves(host), jax.tree.leaves(dst))
        copied.append(  # each process's shards hold their slice of the weights
            all(
                a.sharding == sh
                and all(
                    np.array_equal(np.asarray(x.data), v[x.index]) for x in a.addressable_shards
                )
                for a, v, sh in pairs
            )
            and sorted(d.process_index for d in roll) == [0] * (k // 2) + [1] * (k // 2)
        )
    narrowed = narrowing(model, graphdef, host, pid)
    plans = packing_plans(model, mesh, pid)
    slots = slots_on_pod(model, mesh, pid)
    partial = partial_on_pod(model, graphdef, host, pid)
    after = gather(state.params)
    # every process writes its shards; then every process restores into the sharded target
    ckpt = Checkpointer(os.path.join(out_dir, "ckpt"), 2)
    # The loop's rng must be replicated on the mesh to be saved on a pod (a single-device key
    # cannot be); restored replicated over all devices (the default with several processes).
    rng = R.replicate(jax.random.key(9), mesh)
    assert rng.sharding.is_fully_replicated and not rng.is_fully_addressable
    # each process's data iterator is at its own place in its own shard
    data_state = {"shard": pid, "next_index": 7 + 3 * pid}
    replay = bytes([pid]) * (5 + pid)  # and its own replay buffer, written by itself
    meta = {"note": "multihost"}
    items = {"state": state, "rng": rng, "meta": meta, "data_state": data_state}
    ckpt.save(2, {**items, "replay": replay}, force=True)
    ckpt.manager.wait_until_finished()
    restored = ckpt.restore_latest({"state": state})
    rng_back = jax.random.key_data(restored.rng).addressable_data(0)
    same_sharding = all(
        a.sharding == b.sharding
        for a, b in zip(jax.tree.leaves(restored.state), jax.tree.leaves(state))
    )
    back = gather(restored.state.params)
    ckpt.close()
    if pid == 0:
        np.savez(os.path.join(out_dir, "params.npz"), **after)
    # the markdown samples: each process's rows, written by process 0
    logs = RunLogs(os.path.join(out_dir, "logs"), 1, primary=pid == 0, samples=4, backends=())
    logs.markdown(1, R.gather_json(logs.sample_rows(*fake_rollout(pid), tokenizer=None)))
    logs.close()
    print(
        "RESULT"
        + json.dumps(
            {
                "pid": pid,
                "copied": copied,
                "narrowed": narrowed,
                "partial": partial,
                "plans": plans,
                "slots": slots,
                "losses": losses,
                "restored_equal": all(np.array_equal(after[k], back[k]) for k in after),
                "restored_sharding": same_sharding,
                "restored_step": int(restored.step),
                "data_state_equal": restored.data_state == data_state,
                "replay_equal": restored.replay == replay,
                # host-side collectives of the rollout loop
                "any_process": [R.any_process(pid == 1), R.any_process(False)],
                # the collated batch's shapes every process's rows share
                "sizes": R.max_across_processes(
                    {"width": 32 * (pid + 1), "images": [16, 0][pid], "videos": 0}
                ),
                "metrics": R.metrics_across_processes(
                    {"a": pid + 1.0, "n_failures": 1.0, "attn/x": [float("nan"), 2.0][pid]},
                    weight=pid + 1,
                    sums={"n_failures"},
                ),
                # a sub-score that only one process's rows returned, one key more there
                "uneven": R.metrics_across_processes(
                    {"a": pid + 1.0, f"only{pid}": 5.0 + pid, **({"b": 7.0} if pid else {})},
                    weight=1,
                ),
                "rng_equal": bool(
                    np.array_equal(rng_back, jax.random.key_data(jax.random.key(9)))
                    and restored.rng.sharding.is_fully_replicated
                ),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
