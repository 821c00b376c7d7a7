"""Sharded training: on 8 simulated CPU devices, 3 train steps on meshes (data=8),
(fsdp=8) and (data=2, fsdp=2, tensor=2) (there also padding-free: rows packed per device)
give the losses and parameters of one device, the
sampler gives the same greedy tokens and grouped samples on the last of them (every axis
split; the rollout's own meshes, below, are what the trainer samples on), and with fsdp=8
each device holds 1/8 of every fsdp-sharded parameter (and of its optimizer state).

Tolerance: float32 everywhere; a mesh changes only the order of reductions (partial matmul
sums over fsdp/tensor shards, gradient sums over data shards), so losses agree to rtol 1e-5
and parameters to atol 1e-6 after 3 SGD-momentum steps (observed: ~1e-7). SGD with momentum,
not Adam: Adam divides by sqrt(v), which turns float noise in near-zero gradients into
lr-sized steps; momentum still gives an optimizer state to shard like the parameters.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import G
from tests.parallel.common import tiny_model_report

SCRIPT = """
import json, sys
import jax, jax.numpy as jnp, numpy as np, optax
import ml_collections
from flax import nnx
from jaxvrl.models import qwen2_5_vl as q
from jaxvrl.parallel import runtime as R, sharding as S
from jaxvrl.sampling import Sampler, SamplingConfig
from jaxvrl.trainer.packing import fit_batch
from jaxvrl.trainer.step import TrainState, build_train_step, make_train_step
from tests.models import hf_tiny as T
from tests.helpers import G, make_batch, make_prompts, step_config

assert jax.device_count() == 8
model = q.load(sys.argv[1])
graphdef, params0 = nnx.split(model, nnx.Param)
host = jax.tree.map(np.asarray, params0)
tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.05, momentum=0.9))
# the reference model is used (KL loss): it has to be sharded too
cfg = step_config({"actor.use_kl_loss": True, "actor.kl_loss_coef": 0.1})
batches = [make_batch(model, 4, s, pools=False, completion_seed=s + 1000, host=True) for s in range(3)]  # 8 rows each
keys = [jax.random.key(s) for s in range(3)]
prompts = make_prompts(model, prompts=4, seed=7)
greedy = Sampler(
    nnx.graphdef(model),
    SamplingConfig(6, temperature=0.0, eos_token_ids=(T.IM_END,),
                   suppress_token_ids=(T.IMAGE, T.VIDEO, T.VSTART, T.VEND)),
)
# 8 distinct prompts, each prefilled once and sampled G times (the rollout's call)
distinct = make_prompts(model, prompts=8, seed=9)  # G repeated rows per prompt
pos = distinct.pop("position_ids")[:, ::G]
distinct = dict(jax.tree.map(lambda x: x[::G], distinct), position_ids=pos)
rollout = Sampler(
    nnx.graphdef(model),
    SamplingConfig(6, temperature=1.0, eos_token_ids=(T.IM_END,),
                   suppress_token_ids=(T.IMAGE, T.VIDEO, T.VSTART, T.VEND)),
)


def init(p):
    z = lambda: jnp.zeros((), jnp.int32)  # noqa: E731  (two buffers: the state is donated)
    return TrainState(p, tx.init(p), z(), z()), jax.tree.map(jnp.copy, p)


def sample(params, pr):
    out = greedy(params, pr["input_ids"], pr["attention_mask"], pr["position_ids"],
                 pr["deltas"], jax.random.key(0), images=pr["images"])
    return np.asarray(out.tokens)


def sample_groups(params, pr):
    out = rollout(params, pr["input_ids"], pr["attention_mask"], pr["position_ids"],
                  pr["deltas"], jax.random.key(1), images=pr["images"], num_samples=G)
    return R.host_local(out.tokens)


def flat(tree):
    return [(".".join(map(str, p)), v.get_value()) for p, v in nnx.to_flat_state(tree)]


# one device: the plain jitted step, no mesh
step1 = make_train_step(graphdef, tx, cfg)
state, ref = init(jax.tree.map(jnp.asarray, host))
loss1 = []
for b, k in zip(batches, keys):
    state, m, _ = step1(state, ref, jax.tree.map(jnp.asarray, b), k)
    loss1.append(float(m["loss"]))
params1 = {p: np.asarray(v) for p, v in flat(state.params)}
tokens1 = sample(jax.tree.map(jnp.asarray, host), jax.tree.map(jnp.asarray, prompts))
groups1 = sample_groups(jax.tree.map(jnp.asarray, host), jax.tree.map(jnp.asarray, distinct))

report = {"one_device": {"losses": loss1, "tokens": tokens1.tolist(), "groups": groups1.tolist()}}
for sizes in (dict(data=8, fsdp=1, tensor=1), dict(data=1, fsdp=8, tensor=1),
              dict(data=2, fsdp=2, tensor=2)):
    mesh = R.mesh_from_config(ml_collections.ConfigDict(sizes))
    psh = S.param_shardings(host, mesh)
    params = R.put_on_mesh(host, psh)
    (state, ref), (ssh, rsh) = R.sharded_init(init, mesh, params)
    step = R.jit_train_step(build_train_step(graphdef, tx, cfg), mesh, ssh, rsh)
    losses = []
    for b, k in zip(batches, keys):
        batch = R.place_batch(b, mesh)
        rows = batch.input_ids.addressable_shards[0].data.shape[0]
        assert rows * sizes["data"] * sizes["fsdp"] == 8, rows
        state, m, _ = step(state, ref, batch, k)
        losses.append(float(m["loss"]))
    diffs = [float(np.max(np.abs(params1[p] - np.asarray(v)))) for p, v in flat(state.params)]
    packed = {}
    if sizes["tensor"] == 2:  # the same steps padding-free: rows packed per device group
        (pstate, pref), _ = R.sharded_init(init, mesh, R.put_on_mesh(host, psh))
        plosses, groups = [], set()
        for b, k in zip(batches, keys):
            pb = fit_batch(b, k, cfg, mesh)
            groups.add(pb.pack_groups)
            pstate, m, _ = step(pstate, pref, R.place_batch(pb, mesh), k)
            plosses.append(float(m["loss"]))
        pd = [float(np.max(np.abs(params1[p] - np.asarray(v)))) for p, v in flat(pstate.params)]
        packed = {"losses": plosses, "max_param_diff": max(pd), "groups": sorted(groups)}
    tokens = groups = np.zeros(0)
    if sizes["tensor"] == 2:  # parameters as training shards them, rows over data x fsdp
        tokens = sample(R.put_on_mesh(host, psh), R.place_batch(prompts, mesh))
        groups = sample_groups(R.put_on_mesh(host, psh), R.place_batch(distinct, mesh))

    # shardings: params per the rules, kept across steps; momentum and reference like params
    fsdp_sharded, matrices = 0, 0
    trace = state.opt_state[1][0].trace
    for (p, v), (_, t), (_, r) in zip(flat(state.params), flat(trace), flat(ref)):
        spec = v.sharding.spec
        # per-layer dimensions (scanned layers' params lead with a "layers" axis)
        ndim = v.ndim - (S.param_axes(p, v.ndim)[:1] == ("layers",))
        matrices += ndim >= 2
        assert t.sharding.spec == spec and r.sharding.spec == spec, (p, t.sharding, spec)
        if sizes["fsdp"] == 8 and ndim >= 2:
            assert "fsdp" in str(spec), (p, spec)
        if "fsdp" in str(spec):
            fsdp_sharded += 1
            for arr in (v, t, r):
                for shard in arr.addressable_shards:  # all 8 devices
                    assert shard.data.size * sizes["fsdp"] * (
                        sizes["tensor"] if "tensor" in str(spec) else 1
                    ) == arr.size, (p, shard.data.shape, arr.shape)
        if sizes["data"] == 8:
            assert all(s is None for s in spec), (p, spec)
    report[json.dumps(sizes)] = {
        "losses": losses,
        "max_param_diff": max(diffs),
        "tokens": tokens.tolist(),
        "groups": groups.tolist(),
        "fsdp_sharded": fsdp_sharded,
        "n_params": len(diffs),
        "n_matrices": matrices,
        "step": int(state.step),
        "packed": packed,
    }

# the rollout's own layout: parameters on the fsdp=8 training mesh, prepared (resharded) for
# rollout meshes over the same devices, one of them in another device order
import dataclasses
from jax.sharding import Mesh
from jaxvrl.sampling import rollout_mesh

train = R.mesh_from_config(ml_collections.ConfigDict(dict(data=1, fsdp=8, tensor=1)))
on_train = R.put_on_mesh(host, S.param_shardings(host, train))
layouts = {
    "data2_tensor4": rollout_mesh(train, data=2, tensor=4),
    "reordered": Mesh(np.array(jax.devices())[::-1].reshape(2, 1, 1, 1, 4), S.MESH_AXES),
}
report["layouts"] = {}
for name, rmesh in layouts.items():
    g_s = Sampler(greedy.graphdef, greedy.cfg, rmesh)
    r_s = Sampler(rollout.graphdef, rollout.cfg, rmesh)
    ready = g_s.prepare(on_train)
    kernel = dict(flat(ready.params))["model.layers.self_attn.q_proj.kernel"]
    out = g_s(ready, *(R.place_batch(prompts, rmesh)[k] for k in
              ("input_ids", "attention_mask", "position_ids", "deltas")),
              jax.random.key(0), images=R.place_batch(prompts, rmesh)["images"])
    d = R.place_batch(distinct, rmesh)
    grp = r_s(ready, d["input_ids"], d["attention_mask"], d["position_ids"], d["deltas"],
              jax.random.key(1), images=d["images"], num_samples=G)
    if name == "data2_tensor4":  # the slots engine, its slots halved down to 2 as rows end
        cfg = dataclasses.replace(rollout.cfg, slots=8 * G, page_size=4, narrow=3, narrow_to=2,
                                  check_every=1)  # fmt: skip
        limits = jnp.asarray(np.arange(8 * G) % 6 + 1, jnp.int32)  # rows of 1 to 6 tokens
        grp_s, times = Sampler(rollout.graphdef, cfg, rmesh).timed(
            ready, d["input_ids"], d["attention_mask"], d["position_ids"], d["deltas"],
            jax.random.key(1), images=d["images"], num_samples=G, limits=limits)
        report["narrowed"] = [R.host_local(grp_s.tokens).tolist(),
                              times["decode_work"], int(grp_s.steps)]
    report["layouts"][name] = {
        "tokens": np.asarray(out.tokens).tolist(),
        "groups": R.host_local(grp.tokens).tolist(),
        "spec": str(kernel.sharding.spec),
        "on_rollout_mesh": kernel.sharding.mesh == rmesh,
        "source_kept": not any(x.is_deleted() for x in jax.tree.leaves(on_train)),
    }
print("REPORT" + json.dumps(report))
"""


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return tiny_model_report(SCRIPT, tmp_path_factory, "mesh_model")


MESHES = (
    '{"data": 8, "fsdp": 1, "tensor": 1}',
    '{"data": 1, "fsdp": 8, "tensor": 1}',
    '{"data": 2, "fsdp": 2, "tensor": 2}',
)


@pytest.mark.parametrize("mesh", MESHES)
def test_three_steps_match_one_device(report, mesh):
    one, got = report["one_device"], report[mesh]
    assert got["step"] == 3
    for a, b in zip(one["losses"], got["losses"]):
        assert abs(a - b) <= 1e-5 * abs(a) + 1e-7, (one["losses"], got["losses"])
    assert got["max_param_diff"] < 1e-6


def test_packed_steps_on_a_mesh_match_one_device(report):
    """Padding-free on 8 devices (data 2 x fsdp 2 x tensor 2): each device's rows packed in
    its own buffers (4 groups), 3 steps give the padded single-device losses and parameters."""
    one, got = report["one_device"], report[MESHES[2]]["packed"]
    assert got["groups"] == [4]
    for a, b in zip(one["losses"], got["losses"]):
        assert abs(a - b) <= 1e-5 * abs(a) + 1e-7, (one["losses"], got["losses"])
    assert got["max_param_diff"] < 1e-6


def test_greedy_tokens_match_one_device(report):
    assert report[MESHES[2]]["tokens"] == report["one_device"]["tokens"]


def test_one_prefill_per_prompt_samples_match_one_device(report):
    """8 prompts over the mesh's rows, each prefilled once and sampled G times: per-row keys
    make the sampled tokens those of one device."""
    got = np.asarray(report[MESHES[2]]["groups"])
    assert got.shape == (8 * G, 6)
    np.testing.assert_array_equal(got, report["one_device"]["groups"])


@pytest.mark.parametrize("layout", ["data2_tensor4", "reordered"])
def test_the_rollout_layout_samples_what_one_device_samples(report, layout):
    """Parameters on the fsdp=8 training mesh, prepared for a rollout mesh (rows over data,
    heads / MLP / vocabulary over tensor; one mesh in another device order than training's)
    sample the greedy tokens and the G samples per prompt of one device (the main job's
    default layout, data 4 x tensor 2: test_mesh_main_job.py); the weights are
    split over the tensor axis only, and the training copy is left intact."""
    got, one = report["layouts"][layout], report["one_device"]
    assert got["tokens"] == one["tokens"]
    np.testing.assert_array_equal(got["groups"], one["groups"])
    assert got["on_rollout_mesh"] and got["source_kept"]
    assert "tensor" in got["spec"] and "fsdp" not in got["spec"], got["spec"]
    if layout == "data2_tensor4":  # the slots engine narrowing its slots over the 2 row groups
        tokens, work, steps = report["narrowed"]
        for b, (row, want) in enumerate(zip(tokens, one["groups"])):  # each row's first tokens
            k = b % 6 + 1
            assert row[:k] == list(want[:k]), (b, row, want)
        assert work < steps * 8 * G, (work, steps)


def test_fsdp8_every_matrix_is_split_eight_ways(report):
    got = report['{"data": 1, "fsdp": 8, "tensor": 1}']
    # every >= 2-D parameter (the script checks each one's shards on all 8 devices, and its
    # momentum and reference copy); 1-D norms and q/k/v biases are replicated. Scanned
    # layers: one stacked matrix per projection (7 text, 5 vision) beside 5 others
    assert got["fsdp_sharded"] == got["n_matrices"] >= 17, got
    assert report['{"data": 8, "fsdp": 1, "tensor": 1}']["fsdp_sharded"] == 0
