"""trainer/build.py end to end: 2-step runs of configs/tprl.py with lora.rank=8 through
jaxvrl.train.run, PPO + LoRA resumes, and the LoRA train step's compiled memory below the full
fine-tune's on the same batch (configs/ppo.py's own 2-step run, critic and adaptive KL
checked: tests/trainer/test_train.py)."""

from __future__ import annotations

import importlib.util
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxvrl.checkpoint import Checkpointer
from jaxvrl.models import qwen2_5_vl as q
from jaxvrl.train import run
from jaxvrl.trainer.build import init_train_state, step_config
from jaxvrl.trainer.step import make_train_step
from tests.helpers import G, N, make_batch
from tests.models import hf_tiny as T
from tests.trainer.test_train import ROOT, tiny_config


def _saved_state(workdir):
    ck = Checkpointer(os.path.join(workdir, "checkpoints"))
    step = ck.latest_step()
    arrays = ck.manager.restore(step)["state"]
    ck.close()
    return step, arrays


def test_tprl_lora_runs_two_steps_with_adapter_only_optimizer(tmp_path):
    metrics = run(
        tiny_config("configs/tprl.py", tmp_path, "total_steps=2", "val_freq=2", "lora.rank=8")
    )
    assert np.isfinite(metrics["loss"]) and metrics["compiles/train_step"] == metrics["compiles/train_step_shapes"]
    _, arrays = _saved_state(tmp_path)
    opt = [k for k in arrays if k.startswith("opt_state") and arrays[k].size > 1]
    assert opt and all("lora_" in k for k in opt), opt
    assert any("lora_b" in k for k in arrays if k.startswith("params"))


def test_ppo_with_lora_resumes(tmp_path):
    common = ("save_freq=0", "val_freq=100", "lora.rank=4", "critic.warmup_steps=1")
    run(tiny_config("configs/ppo.py", tmp_path, "total_steps=2", *common))
    metrics = run(tiny_config("configs/ppo.py", tmp_path, "total_steps=3", *common))
    assert np.isfinite(metrics["loss"]) and metrics["train/policy_updated"] == 1
    step, arrays = _saved_state(tmp_path)
    assert step == 3
    backbone = [k for k in arrays if "critic_params" in k and "backbone" in k]
    assert backbone and all("lora_" in k for k in backbone)  # the base weights are shared
    steps = [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")]
    assert steps == [0, 1, 2, 3]


def test_qlora_runs_two_steps(tmp_path):
    pytest.importorskip("qwix")
    c = tiny_config(
        "configs/grpo.py",
        tmp_path,
        "total_steps=2",
        "val_freq=2",
        "lora.rank=8",
        "lora.quantize=int8",
    )
    metrics = run(c)
    assert np.isfinite(metrics["loss"]) and "val/accuracy" in metrics
    _, arrays = _saved_state(tmp_path)
    assert any("qvalue" in k and arrays[k].dtype == np.int8 for k in arrays)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("mem_model")
    T.build(path, seed=3, layers=1, v_depth=2)  # compiled three times: the size adds nothing
    return path


def _step_bytes(ckpt, **lora):
    from jaxvrl.config import load_config

    c = load_config(os.path.join(ROOT, "configs/tprl.py"), [f"rollout.num_generations={G}"])
    c.lora.update(lora)
    model = q.load(ckpt)
    graphdef, tx, state, ref = init_train_state(model, c)
    # tprl's 2 updates per batch read the sampler's log-probs (and its shaping, entropies)
    batch = make_batch(model, seed=0, old_logprobs=np.zeros((2 * G, N), np.float32))
    batch = batch.replace(old_entropy=np.zeros((2 * G, N), np.float32))
    step = make_train_step(graphdef, tx, step_config(c))
    mem = step.lower(state, ref, batch, jax.random.key(0)).compile().memory_analysis()
    sizes = {
        "argument": mem.argument_size_in_bytes,
        "output": mem.output_size_in_bytes,
        "temp": mem.temp_size_in_bytes,
        "alias": mem.alias_size_in_bytes,
    }
    sizes["total"] = sizes["argument"] + sizes["output"] + sizes["temp"]
    # donated arguments share their buffers with the outputs
    sizes["peak"] = sizes["total"] - sizes["alias"]
    return sizes


def test_lora_step_memory_below_full_fine_tune(ckpt):
    full = _step_bytes(ckpt)
    lora = _step_bytes(ckpt, rank=8)
    runs = [("full fine-tune", full), ("LoRA rank 8", lora)]
    if importlib.util.find_spec("qwix") is not None:
        runs.append(("QLoRA rank 8 int8", _step_bytes(ckpt, rank=8, quantize="int8")))
    for name, s in runs:
        print(f"\n{name}: " + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in s.items()))
    assert lora["peak"] < full["peak"] and lora["total"] < full["total"]
    assert lora["temp"] < full["temp"]
    if len(runs) == 3:
        assert runs[2][1]["argument"] < lora["argument"]  # int8 base weights


def _optim(**kw):
    import ml_collections

    o = ml_collections.ConfigDict(
        dict(
            lr=1e-2,
            schedule="constant",
            warmup_steps=0,
            betas=(0.9, 0.999),
            weight_decay=0.0,
            grad_clip=1e9,
            min_lr_ratio=0.0,
        )  # fmt: skip
    )
    o.update(kw)
    return o


def test_cosine_schedule_follows_its_formula():
    from jaxvrl.trainer.build import learning_rate

    o = _optim(schedule="cosine", warmup_steps=4, min_lr_ratio=0.1)
    lr = learning_rate(o, total_steps=20)
    for t in (0, 2, 4, 10, 19, 20, 25):
        if t < 4:
            want = 1e-2 * t / 4
        else:
            frac = min(t - 4, 16) / 16
            want = 1e-3 + (1e-2 - 1e-3) * 0.5 * (1 + math.cos(math.pi * frac))
        assert abs(float(lr(t)) - want) < 1e-9, t
    assert learning_rate(_optim(), 20) == 1e-2
    with pytest.raises(ValueError, match="optim.schedule='linear'"):
        learning_rate(_optim(schedule="linear"), 20)


def test_optimizer_uses_the_configured_betas():
    import optax

    from jaxvrl.trainer.build import make_optimizer

    params = {"w": jnp.zeros(3)}
    grads = [{"w": jnp.asarray(g, jnp.float32)} for g in ([1.0, -2.0, 0.5], [0.3, 1.0, -1.0])]

    def run(tx):
        p, s = params, tx.init(params)
        for g in grads:
            u, s = tx.update(g, s, p)
            p = optax.apply_updates(p, u)
        return np.asarray(p["w"])

    ours = run(make_optimizer(_optim(betas=(0.5, 0.7))))
    ref = run(optax.adamw(1e-2, b1=0.5, b2=0.7, weight_decay=0.0))
    default = run(optax.adamw(1e-2, weight_decay=0.0))
    np.testing.assert_allclose(ours, ref, rtol=1e-6)
    assert not np.allclose(ours, default, rtol=1e-3)
