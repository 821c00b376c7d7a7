"""parallel.runtime pieces without a train step: distributed init from config, mesh errors,
optimizer-state and batch shardings, host -> mesh placement (8 simulated devices, no
compilation beyond placement)."""

from __future__ import annotations

import json

import jax
import ml_collections
import pytest

from jaxvrl.parallel import runtime as R
from tests.parallel.common import run_with_devices


def test_initialize_distributed_is_a_noop_when_disabled():
    cfg = ml_collections.ConfigDict(
        dict(enable=False, coordinator_address=None, num_processes=None, process_id=None)
    )
    assert R.initialize_distributed(cfg) is False
    assert jax.process_count() == 1


def test_on_host_creates_arrays_on_the_cpu_backend():
    with R.on_host():
        x = jax.numpy.ones(3)
    assert next(iter(x.sharding.device_set)).platform == "cpu"


@pytest.mark.parametrize(
    "sizes, message",
    [
        (dict(data=3, fsdp=-1, tensor=1), "multiply to 3, which does not divide the 1 devices"),
        (dict(data=1, fsdp=1, tensor=2), "needs 2 devices, have 1"),
        (dict(data=-1, fsdp=-1, tensor=1), "at most one mesh axis may be -1"),
        (dict(data=0, fsdp=-1, tensor=1), "positive or -1"),
    ],
)
def test_mesh_from_config_names_the_sizes(sizes, message):
    with pytest.raises(ValueError, match=message) as e:
        R.mesh_from_config(ml_collections.ConfigDict(sizes))
    assert "'data'" in str(e.value)


# The 8-device cases run in one subprocess (one jax start and one checkpoint for all four):
# each case is a function whose failure is reported with its traceback, not a stop.
SCRIPT = """
import json, sys, traceback
import jax, jax.numpy as jnp, numpy as np, optax, ml_collections
from flax import nnx
from jax.sharding import PartitionSpec as P
from jaxvrl.config import load_config
from jaxvrl.models import qwen2_5_vl as q
from jaxvrl.parallel import runtime as R, sharding as S
from jaxvrl.trainer.build import init_train_state
from jaxvrl.trainer.step import TrainState
from tests.models import hf_tiny as T
from tests.helpers import make_batch

CKPT = sys.argv[1]
T.build(CKPT, seed=1)


def placement():
    model = q.load(CKPT)
    _, params = nnx.split(model, nnx.Param)
    host = jax.tree.map(np.asarray, params)
    mesh = R.mesh_from_config(ml_collections.ConfigDict(dict(data=2, fsdp=4, tensor=1)))
    tx = optax.adamw(1e-3)
    abstract = jax.eval_shape(
        lambda p: TrainState(p, tx.init(p), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32)),
        host,
    )
    sh = R.state_shardings(abstract, mesh)
    adam = sh.opt_state[0]
    assert adam.count.spec == P() and sh.step.spec == P() and sh.skipped.spec == P()
    flat = lambda t: [(p, v.get_value()) for p, v in nnx.to_flat_state(t)]
    n = 0
    for (p, a), (_, m), (_, v) in zip(flat(sh.params), flat(adam.mu), flat(adam.nu)):
        assert a.spec == m.spec == v.spec, (p, a.spec, m.spec)
        n += "fsdp" in str(a.spec)
    assert n >= 17  # every matrix (scanned layers: one stacked matrix per projection)

    placed = R.put_on_mesh(host, sh.params)  # numpy -> each device only its slice
    emb = placed["model"]["embed_tokens"]["embedding"].get_value()
    assert emb.sharding.spec == P(None, "fsdp")
    assert {s.data.shape for s in emb.addressable_shards} == {(300, 16)}

    batch = make_batch(model, 4, pools=False, completion_seed=1000, host=True)
    bs = R.batch_shardings(batch, mesh)
    rows = ("data", "fsdp")
    assert bs.input_ids.spec == P(rows, None)
    assert bs.position_ids.spec == P(None, rows, None)
    assert bs.rewards.spec == P(rows)
    assert bs.images.pixel_values.spec == P(rows, None, None)  # per-row layout
    packed = {"input_ids": batch.input_ids, "pixel_values": np.zeros((12, 1176))}
    assert R.batch_shardings(packed, mesh)["pixel_values"].spec == P(None, None)
    gb = R.place_batch(batch, mesh)
    assert gb.input_ids.addressable_shards[0].data.shape == (1, batch.input_ids.shape[1])
    assert (np.asarray(gb.position_ids) == batch.position_ids).all()

    key = R.replicate(jax.random.key(3), mesh)
    assert key.sharding.is_fully_replicated and len(key.sharding.device_set) == 8
    return "ok"


def sharded_init(spec, overrides):
    c = load_config(spec, overrides)
    g1, _, state1, ref1 = init_train_state(q.load(CKPT), c)
    mesh = R.mesh_from_config(ml_collections.ConfigDict(dict(data=2, fsdp=4, tensor=1)))
    model = q.load(CKPT)
    got = R.sharded_train_state(init_train_state, model, mesh, c)
    assert got.graphdef == g1
    assert (ref1 is None) == (got.ref_params is None)
    one = jax.tree.leaves((state1, ref1))
    many = jax.tree.leaves((got.state, got.ref_params))
    shs = jax.tree.leaves((got.state_shardings, got.ref_shardings))
    assert len(one) == len(many) == len(shs)
    n_fsdp = 0
    for a, b, sh in zip(one, many, shs):
        assert b.sharding == sh, (b.sharding, sh)
        # random inits (the critic head) under jit may differ from eager in the last bit
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-9)
        n_fsdp += "fsdp" in str(sh.spec)
    return n_fsdp


report = {}
for name, case, args in CASES:
    try:
        report[name] = {"value": {"placement": placement, "init": sharded_init}[case](*args)}
    except Exception:
        report[name] = {"error": traceback.format_exc()}
print("REPORT" + json.dumps(report))
"""

INIT_CASES = {
    "grpo-kl": ("configs/grpo.py", ["actor.use_kl_loss=True", "actor.kl_loss_coef=0.1"]),
    "ppo": ("configs/ppo.py", []),  # critic params and their optimizer state
    "lora": ("configs/grpo.py", ["lora.rank=4"]),  # adapters: init changes the model's graph
}


@pytest.fixture(scope="module")
def on_8_devices(tmp_path_factory):
    cases = [("placement", "placement", ())]
    cases += [(name, "init", args) for name, args in INIT_CASES.items()]
    code = SCRIPT.replace("CASES", repr(cases)).replace(
        "sys.argv[1]", repr(str(tmp_path_factory.mktemp("runtime_model")))
    )
    return json.loads(run_with_devices(code).split("REPORT")[-1])


def _value(report, name):
    assert "error" not in report[name], report[name].get("error")
    return report[name]["value"]


def test_shardings_and_placement_on_8_devices(on_8_devices):
    assert _value(on_8_devices, "placement") == "ok"


@pytest.mark.parametrize("name", sorted(INIT_CASES))
def test_sharded_train_state_equals_one_device_init(on_8_devices, name):
    # every base matrix at least, 17 with scanned layers (one stacked matrix per projection);
    # LoRA adapters and their optimizer state are tiny: replicated
    assert _value(on_8_devices, name) >= 17


def test_metrics_across_one_process_keep_values_and_drop_all_nan_keys():
    m = {"reward/total": 0.25, "tokens_per_s": 100.0, "attn/mdi": float("nan")}
    assert R.metrics_across_processes(m, weight=16, sums={"tokens_per_s"}) == {
        "reward/total": 0.25,
        "tokens_per_s": 100.0,
    }
    assert R.any_process(True) and not R.any_process(False)
