"""`python -m jaxvrl.train` on a device mesh: on 8 simulated CPU devices the main job (GRPO
with a KL loss, so the reference copy is sharded too) trains on the mesh (data=2, fsdp=2,
sequence=2: every row's tokens and image patches split over 2 devices),
samples on the rollout's own mesh (data=4, tensor=2; each prompt's prefill split over 2 of its
data groups, rollout.mesh.sequence=2), and matches the same run on one device
with its optimizer state and reference weights in host memory; a run resumed on the mesh equals an uninterrupted one bit
for bit. One-step-off training (rollout.devices=4: the sampler on 4 devices, the train step
on the other 4) equals a synchronous run whose sampler is one update behind, and resumes
with its next batch in flight bit for bit. A tiny Qwen3-MoE trains on fsdp 2 x expert 4,
replaying its rollout's routes, and resumes bit for bit. (Tensor parallelism, data=2 x fsdp=2 x tensor=2, is checked step by step and for the
sampler in test_mesh_step.py.)

Tolerance: the mesh changes only the order of float32 reductions. Before the first update the
train step sees the same parameters: step 1's entropy and gradient norm agree to rtol 1e-5,
its loss (a sum of cancelling terms, ~1e-8) to atol 1e-6. After that AdamW divides by
sqrt(v), which turns ~1e-7 differences in near-zero gradients into lr-sized steps (see
test_mesh_step.py), so later losses and KLs agree to rtol 2e-2 + atol 1e-6 (observed: up
to 2e-3). The sampled completions, and so every reward, accuracy and length, are identical.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.parallel.common import ROOT, run_with_devices

OVERRIDES = [
    "prompts_per_step=4",  # 8 rows: one per device
    "val_freq=100",  # validation at step 0 and the last step only
    "actor.use_kl_loss=True",
    "actor.kl_loss_coef=0.1",
    # two epochs per batch: the second update's ratio takes the sampler's log-probs as the old
    # ones, as one-step-off always does, so that the synchronous reference of the one-step-off
    # run ("stale") is the mesh run's programs fed other weights (no compile of its own)
    "actor.ppo_epochs=2",
]

SCRIPT = """
import json, sys
import jax
from jaxvrl.config import load_config
from jaxvrl.parallel import runtime as R
from jaxvrl.train import run

import jax.numpy as jnp
import jaxvrl.train as T

seen, on = [], []
place_batch = R.place_batch
sampling_params = T.sampling_params
versions = {}


def spy(batch, mesh):  # what the train loop and the sampler put on the mesh
    out = place_batch(batch, mesh)
    ids = out["input_ids"] if isinstance(out, dict) else out.input_ids
    entry = [dict(mesh.shape), len(ids.sharding.device_set),
             ids.addressable_shards[0].data.shape[0], ids.shape[0]]
    if entry not in seen:
        seen.append(entry)
    where = [isinstance(batch, dict), sorted(d.id for d in ids.sharding.device_set)]
    if where not in on:
        on.append(where)
    return out


def stale(state):  # the weights before the last update: the batch one-step-off samples
    versions[int(jax.device_get(state.step))] = jax.tree.map(jnp.copy, sampling_params(state))
    return versions[max(int(jax.device_get(state.step)) - 1, 0)]


R.place_batch = spy
report = {}
for name, overrides in RUNS:
    c = load_config("configs/grpo.py:runlocal", OVERRIDES + overrides)
    seen.clear(), on.clear(), versions.clear()
    T.sampling_params = stale if name == "stale" else sampling_params
    m = run(c)
    report[name] = {"compiles": {k: v for k, v in m.items() if k.startswith("compiles/")},
                    "placed": list(seen), "devices": jax.device_count(), "on": list(on),
                    "host_programs": sum("pinned_host" in str(k) for k in R._KEPT)}
T.sampling_params = sampling_params
if COMPARE:  # 3 x 2 rows do not split over data x fsdp = 8: a clear error before any work
    from jaxvrl.config import ConfigError

    c = load_config("configs/grpo.py:runlocal", ["prompts_per_step=3", "mesh.fsdp=8",
                                                   f"workdir={COMPARE[0]}_rows"])
    try:
        run(c)
    except ConfigError as e:
        report["rows_error"] = str(e)
    # a prefill split over 3 of the rollout mesh's 4 data groups
    c = load_config("configs/grpo.py:runlocal", OVERRIDES + ["rollout.mesh.sequence=3",
                                                   f"workdir={COMPARE[0]}_split"])
    try:
        run(c)
    except ConfigError as e:
        report["split_error"] = str(e)
if COMPARE:  # checkpoints saved on 8 devices restore on 8 devices (orbax checks the topology)
    import numpy as np
    from jaxvrl.checkpoint import Checkpointer

    def final(workdir):
        ck = Checkpointer(workdir + "/checkpoints")
        step = ck.latest_step()
        arrays = ck.manager.restore(step)["state"]
        ck.close()
        return step, {k: np.asarray(v) for k, v in arrays.items()}

    report["final_params"] = []
    for a, b in zip(COMPARE[::2], COMPARE[1::2]):  # (uninterrupted, resumed) pairs
        (sa, pa), (sb, pb) = final(a), final(b)
        report["final_params"].append({
            "steps": [sa, sb], "keys": len(pa), "same_keys": pa.keys() == pb.keys(),
            "differ": [k for k in pa if k not in pb or not np.array_equal(pa[k], pb[k])],
        })
print("REPORT" + json.dumps(report))
"""

TIMING = ("_s", "tokens_per_s")
# what depends on the process's history: a run reuses the step program an earlier run of its
# process compiled
HISTORY = ("compiles/",)


def _run(runs, n, compare=()):
    code = SCRIPT.replace("OVERRIDES", repr(OVERRIDES)).replace("RUNS", repr(runs))
    code = code.replace("COMPARE", repr(list(compare)))
    out = run_with_devices(code, n=n)
    return json.loads(out.split("REPORT")[-1])


def _rows(workdir):
    rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    return {r["step"]: r for r in rows}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("train_mesh")
    names = ("one", "mesh", "resumed", "off", "off_resumed", "stale", "moe", "moe_resumed")
    w = {k: str(d / k) for k in names}
    # the mesh runs keep their optimizer state and reference weights in host memory
    # (actor.offload_*): the same arithmetic, so they still match one device
    # and every row's tokens (and image patches) split over 2 devices (sequence parallel),
    # in the train step and in the sampler's prefill
    mesh = ["mesh.data=2", "mesh.fsdp=2", "mesh.sequence=2", "actor.offload_optimizer=true",
            "actor.offload_reference=true", "rollout.mesh.sequence=2"]  # fmt: skip
    # one-step-off: the sampler on devices 4-7, the train step on 0-3 (fsdp); two steps, the
    # resumed run stopped after one (its 1 s time budget spent) with the second step's batch in
    # flight
    off = ["rollout.devices=4", "mesh.data=1", "mesh.fsdp=4", "logging.attention_samples=0"]
    # a mixture of experts (tiny Qwen3-MoE, 4 experts) on fsdp 2 x expert 4, sampled with its
    # experts split 4 ways too (rollout.mesh.expert=0, auto: the most devices that divide
    # them), replaying the rollout's routes, on the arithmetic task
    moe = [f"model.path={_tiny_moe(d / 'qwen3_moe')}", "data.builtin_task=arithmetic",
           "mesh.fsdp=2", "mesh.expert=4", "actor.routing_replay=True",
           "actor.old_logprobs=recompute", "val_before_train=False", "val_size=0"]  # fmt: skip
    report = _run(
        [
            ("mesh", [f"workdir={w['mesh']}", "total_steps=2", *mesh]),
            ("resumed_a", [f"workdir={w['resumed']}", "total_steps=1", *mesh]),
            ("resumed", [f"workdir={w['resumed']}", "total_steps=2", *mesh]),
            ("off", [f"workdir={w['off']}", "total_steps=2", *off]),
            (
                "off_resumed_a",
                [f"workdir={w['off_resumed']}", "total_steps=2", "time_budget_s=1", *off],
            ),
            ("off_resumed", [f"workdir={w['off_resumed']}", "total_steps=2", *off]),
            # synchronous on all 8 devices, each step sampled with the weights before the
            # last update (the batch one-step-off training samples)
            ("stale", [f"workdir={w['stale']}", "total_steps=2", *mesh]),
            ("moe", [f"workdir={w['moe']}", "total_steps=2", *moe]),
            ("moe_resumed_a", [f"workdir={w['moe_resumed']}", "total_steps=1", *moe]),
            ("moe_resumed", [f"workdir={w['moe_resumed']}", "total_steps=2", *moe]),
        ],
        n=8,
        compare=(w["mesh"], w["resumed"], w["off"], w["off_resumed"], w["moe"], w["moe_resumed"]),
    )
    report["one"] = _run_here([f"workdir={w['one']}", "total_steps=2"])
    return report, w


def _tiny_moe(path) -> str:
    """A tiny random Qwen3-MoE (2 sparse layers of 4 experts, top 2) over the embedded
    tokenizer, saved at `path`."""
    import shutil

    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from jaxvrl import models

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=448, hidden_size=32, intermediate_size=64, head_dim=16,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                         eos_token_id=2, bos_token_id=None, max_position_embeddings=512)  # fmt: skip
    Qwen3MoeForCausalLM(cfg).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(models.EMBEDDED, name), path / name)
    return str(path)


def _run_here(overrides) -> dict:
    """The one-device run in this process (one CPU device), spied on as SCRIPT's runs are."""
    import jax

    from jaxvrl.config import load_config
    from jaxvrl.parallel import runtime as R
    from jaxvrl.train import run

    seen, place_batch = [], R.place_batch

    def spy(batch, mesh):
        out = place_batch(batch, mesh)
        ids = out["input_ids"] if isinstance(out, dict) else out.input_ids
        entry = [dict(mesh.shape), len(ids.sharding.device_set),
                 ids.addressable_shards[0].data.shape[0], ids.shape[0]]  # fmt: skip
        if entry not in seen:
            seen.append(entry)
        return out

    assert jax.device_count() == 1
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(R, "place_batch", spy)
        m = run(load_config(os.path.join(ROOT, "configs/grpo.py:runlocal"), OVERRIDES + overrides))
    compiles = {k: v for k, v in m.items() if k.startswith("compiles/")}
    return json.loads(json.dumps({"compiles": compiles, "placed": seen, "devices": 1}))


def test_the_runs_use_the_mesh(runs):
    report, _ = runs
    one = {"data": 1, "fsdp": 1, "expert": 1, "sequence": 1, "tensor": 1}
    # the validation and train batches (8 rows) and the prompts (4 rows: each once)
    assert sorted(report["one"]["placed"], key=str) == [[one, 1, 4, 4], [one, 1, 8, 8]]
    # the train batch on the training mesh, two rows per device (each split over the
    # sequence axis inside the step); the sampler's 4 prompts and
    # the 8 validation rows on the prefill's mesh: the rollout mesh (default: the tensor group
    # reading the fewest bytes per device, for the tiny model 2 devices, its KV heads; 4 data
    # groups) with its data groups joined two at a time (rollout.mesh.sequence=2), split over
    # its 2 data groups
    placed = report["mesh"]["placed"]
    prefill = {"data": 2, "fsdp": 1, "expert": 1, "sequence": 2, "tensor": 2}
    train = {"data": 2, "fsdp": 2, "expert": 1, "sequence": 2, "tensor": 1}
    assert [train, 8, 2, 8] in placed, placed
    assert [prefill, 8, 2, 4] in placed and [prefill, 8, 4, 8] in placed, placed
    assert len(placed) == 3, placed
    for name in ("one", "mesh", "resumed"):
        got = report[name]["compiles"]
        assert got["compiles/train_step"] == got["compiles/train_step_shapes"] <= 2, got


def test_rows_that_do_not_split_over_the_mesh_are_a_config_error(runs):
    report, _ = runs
    assert "6 rows per process" in report["rows_error"], report.get("rows_error")
    assert "mesh.data x mesh.fsdp x mesh.expert = 8" in report["rows_error"]
    assert report["split_error"].startswith("config.rollout.mesh.sequence=3: a prompt split over")
    assert "the rollout mesh has 4 (of 2 devices each)" in report["split_error"]


def test_mesh_run_matches_one_device(runs):
    _, w = runs
    one, got = _rows(w["one"]), _rows(w["mesh"])
    assert sorted(got) == sorted(one) == [0, 1, 2]
    for step in sorted(got):
        a, b = one[step], got[step]
        assert a.keys() == b.keys(), step
        for k in sorted(a.keys() & b.keys()):
            if k.endswith(TIMING) or k in ("step", "time"):
                continue
            if k.startswith(("reward", "accuracy", "response_length", "rollout/", "val/")):
                assert a[k] == b[k], (step, k, a[k], b[k])  # the same sampled tokens
            elif step == 1 and k in ("entropy", "train/entropy", "train/grad_norm"):
                assert b[k] == pytest.approx(a[k], rel=1e-5), (step, k)
            elif k in ("loss", "kl", "entropy", "train/grad_norm", "train/kl_loss"):
                tol = 1e-6 if step == 1 else 2e-2
                assert b[k] == pytest.approx(a[k], rel=tol, abs=1e-6), (step, k, a[k], b[k])


def test_resume_on_the_mesh_equals_an_uninterrupted_run(runs):
    """Bit for bit, with the optimizer state and reference weights in host memory
    (actor.offload_*: saved from there and restored there)."""
    report, w = runs
    assert report["mesh"]["host_programs"] > 0  # the step program's shardings hold pinned_host
    final = report["final_params"][0]
    assert final["steps"] == [2, 2] and final["same_keys"] and final["keys"] > 30, final
    assert final["differ"] == [], final  # bit for bit
    a, b = _rows(w["mesh"]), _rows(w["resumed"])
    assert sorted(b) == [0, 1, 2]
    for step in (2,):
        for k in a[step]:
            if not k.endswith(TIMING) and not k.startswith(HISTORY) and k != "time":
                assert a[step][k] == b[step][k], (step, k)


def test_one_step_off_samples_on_its_own_devices_and_trains_on_the_rest(runs):
    report, _ = runs
    on = report["off"]["on"]  # (a prompt batch for the sampler?, the devices its rows are on)
    sampler = {d for is_prompts, ids in on if is_prompts for d in ids}
    train = {d for is_prompts, ids in on if not is_prompts for d in ids}
    assert sampler == {4, 5, 6, 7} and train == {0, 1, 2, 3}, on


def test_one_step_off_equals_a_synchronous_run_fed_the_stale_batch(runs):
    """Step 1's batch is sampled before any update (as a synchronous run's); every later
    step's with the weights before the last update, while that update runs. The reference:
    a synchronous run on 8 devices whose sampler gets the weights one update behind. The
    sampled completions and rewards are the same; the losses differ by the meshes' float32
    reduction orders (test_mesh_run_matches_one_device's tolerance)."""
    _, w = runs
    got, ref = _rows(w["off"]), _rows(w["stale"])
    assert sorted(got) == sorted(ref) == [0, 1, 2]
    for step in (1, 2):
        a, b = ref[step], got[step]
        assert b["rollout/staleness_mean"] == b["rollout/staleness_max"] == min(step - 1, 1)
        assert b["rollout/weight_sync_s"] >= 0 and "rollout/staleness_mean" not in a
        for k in sorted(a.keys() & b.keys()):
            if k.endswith(TIMING) or k.startswith(("compiles/", "val/")) or k in ("step", "time"):
                continue
            if k.startswith(("reward", "accuracy", "response_length", "rollout/")):
                assert a[k] == b[k], (step, k, a[k], b[k])  # the same sampled tokens
            elif k in ("loss", "kl", "entropy", "train/grad_norm", "train/kl_loss"):
                tol = 1e-5 if step == 1 else 2e-2
                assert b[k] == pytest.approx(a[k], rel=tol, abs=1e-6), (step, k, a[k], b[k])


def test_one_step_off_resumes_with_its_batch_in_flight(runs):
    report, w = runs
    final = report["final_params"][1]
    assert final["steps"] == [2, 2] and final["differ"] == [], final  # bit for bit
    a, b = _rows(w["off"]), _rows(w["off_resumed"])
    assert sorted(b) == [0, 1, 2]
    for k in a[2]:
        if not k.endswith(TIMING) and not k.startswith(HISTORY) and k != "time":
            assert a[2][k] == b[2][k], k


def test_a_mixture_of_experts_trains_on_an_expert_axis_and_resumes_exactly(runs):
    """Its experts split over expert 4 (the rows over fsdp 2 x expert 4, one per device), in
    the train step and in the sampler, the rollout's routes replayed: two steps, and a run stopped after one and resumed equals
    them bit for bit."""
    report, w = runs
    moe = {"data": 1, "fsdp": 2, "expert": 4, "sequence": 1, "tensor": 1}
    placed = report["moe"]["placed"]
    assert [moe, 8, 1, 8] in placed, placed
    # the prompts on the rollout mesh: its experts over 4 devices, rows over data x expert
    assert any(p[0]["expert"] == 4 and p[0]["fsdp"] == 1 for p in placed), placed
    final = report["final_params"][2]
    assert final["steps"] == [2, 2] and final["differ"] == [], final  # bit for bit
    a, b = _rows(w["moe"]), _rows(w["moe_resumed"])
    assert sorted(b) == [1, 2] and 0.0 <= a[2]["train/router_mismatch"] <= 1.0
    assert a[2]["rollout/logprob_abs_diff_max"] < 1e-4  # replayed: the sampler's log-probs
    for k in a[2]:
        if not k.endswith(TIMING) and not k.startswith(HISTORY) and k != "time":
            assert a[2][k] == b[2][k], k
