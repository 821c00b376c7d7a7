"""Sequence parallelism (`mesh.sequence`): on 8 simulated CPU devices, every row's tokens and
the vision tower's patches split over 2 or 4 devices give what one unsplit mesh gives.

- `attend` (dense causal and not, blocked causal; packed segments, pools) and its
  gradients, and `attend_key_masses`, on rows split over the axis: by an all-to-all over heads
  (Ulysses) where the heads divide, else by keys and values gathered (context parallel; with
  the blocked kernel under a causal mask, each device's queries in the load-balanced zigzag
  order).
- The tiny Qwen2.5-VL (4 query and 2 key/value heads, 2 in the tower: Ulysses on
  sequence=2, context parallel on 4) on a batch of a text-only prompt, one image, two images
  and a video, its prompts one column wider than a multiple of the split (the step pads them
  to one): the log-probs, entropies and attention masses of padded rows, and of packed
  rows (padding-free, buffers a multiple of the split long) a loss of every completion
  token's log-prob and entropy and its gradients.
- The rollout sampler's prefill split over the rollout mesh's sequence (its data groups
  joined): the same tokens, log-probs and masses, static and slots engines.

Tolerance: float32; the split changes only the order of sums (the gradients' over the
sequence devices, the attention masses' over heads): attention outputs and gradients agree
to 1e-5 of their scale, log-probs and entropies to 2e-5, masses to 1e-6, the loss to 1e-5
relative (observed: ~1e-6, ~1e-6, 1e-7).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.parallel.common import tiny_model_report

SCRIPT = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
import ml_collections
from flax import nnx
from jaxvrl.models import qwen2_5_vl as qwen
from jaxvrl.models.attention import attend, attend_key_masses
from jaxvrl.parallel import runtime as R, sharding as S
from jaxvrl.trainer import packing
from jaxvrl.trainer.passes import batch_rows, completion_hidden
from tests.helpers import step_config
from tests.trainer.test_packing import TPRL, mixed_batch

MESHES = {"one": dict(fsdp=8), "ulysses": dict(fsdp=4, sequence=2),
          "context": dict(fsdp=2, sequence=4)}
meshes = {k: R.mesh_from_config(ml_collections.ConfigDict(dict(data=1, tensor=1, **v)))
          for k, v in MESHES.items()}
report = {k: {} for k in MESHES}

# attention alone: 2 rows of 32 tokens, 8 query heads
rng = np.random.default_rng(0)
B, L, H = 2, 32, 8
q = jnp.asarray(rng.normal(size=(B, L, 8, H)), jnp.float32)
k, v = (jnp.asarray(rng.normal(size=(B, L, 2, H)), jnp.float32) for _ in range(2))
seg = jnp.asarray(np.sort(rng.integers(0, 3, size=(B, L)), axis=1), jnp.int32)
pools = {p: jnp.asarray(rng.random((B, L)) < 0.5) for p in ("vision", "text", "prompt")}
chosen = jnp.asarray(rng.random((B, L)) < 0.5)


def attention(q, k, v, impl, causal):
    out, stats = attend(q, k, v, scale=0.3, key_valid=seg > 0, q_segments=seg, k_segments=seg,
                        causal=causal, pools=pools, implementation=impl, block_q=8, block_k=8)
    return (out ** 2).sum(), (out, stats)


def key_masses(q, k, v, impl):
    return attend_key_masses(q, k, v, scale=0.3, key_valid=seg > 0, queries=chosen,
                             implementation=impl, block=8)


for name, mesh in meshes.items():
    got, text = {}, ""
    # key/value heads a device's share divides by the axis (4 of them over 2), or not (2 over 4)
    for kv in {"one": (2, 4), "ulysses": (4,), "context": (2,)}[name]:
        kk, vv = jnp.tile(k, (1, 1, kv // 2, 1)), jnp.tile(v, (1, 1, kv // 2, 1))
        with jax.set_mesh(mesh):
            # the dense form both ways, the blocked one causal (context parallel's positions)
            for impl, causal in (("xla", True), ("xla", False), ("flash", True)):
                grad = jax.value_and_grad(attention, argnums=(0, 1, 2), has_aux=True)
                f = jax.jit(grad, static_argnums=(3, 4))
                got[f"{impl}/{causal}/{kv}"] = jax.tree.map(np.asarray, f(q, kk, vv, impl, causal))
            got[f"masses/{kv}"] = jax.tree.map(
                np.asarray, jax.jit(key_masses, static_argnums=3)(q, kk, vv, "flash"))
            f = jax.jit(attention, static_argnums=(3, 4))
            text += f.lower(q, kk, vv, "xla", True).as_text()
    report[name]["attention"] = {k: [x.tolist() for x in jax.tree.leaves(v)] for k, v in got.items()}
    report[name]["collectives"] = [op for op in ("all_to_all", "all_gather") if op in text]

# the blocked kernel's causal context parallel reorders each device's queries (zigzag): the
# positions each device holds, and back
from jaxvrl.models.attention import _zigzag
spec = jax.sharding.PartitionSpec(None, "sequence")
zig = [jax.shard_map(lambda x, back=back: _zigzag("sequence", 4, [x], back)[0],
                     mesh=meshes["context"], in_specs=spec, out_specs=spec) for back in (0, 1)]
held = zig[0](jnp.broadcast_to(jnp.arange(L), (B, L)))
report["context"]["zigzag"] = [np.asarray(held)[0].tolist(), np.asarray(zig[1](held))[0].tolist()]

# the model
model = qwen.load(sys.argv[1])
graphdef, params0 = nnx.split(model, nnx.Param)
host = jax.tree.map(np.asarray, params0)
base = dict(TPRL, **{"optim.micro_batches": 1, "actor.global_batch_size": None})
cfgs = {name: step_config(dict(base, **{"actor.padding_free": name == "packed"}))
        for name in ("padded", "packed")}
batch = mixed_batch(model, seed=1)
width = batch.input_ids.shape[1] + batch.completion_length
batch = packing.pad_prompts(batch, width + 1)  # one column past a multiple of 4
key = jax.random.key(0)


def outputs(params, b):
    m = nnx.merge(graphdef, params)
    h, att = completion_hidden(m, b, pools=True)
    lp, ent = h.logprobs(m, 0.7, entropy="value")
    return lp, ent, att.vision_mass, att.text_mass


def loss(params, b, weights):  # a policy-gradient-shaped loss of every completion token
    starts = b.pack_start  # the plan's rows in its order, as the experience passes take them
    b = batch_rows(b.replace(pack_order=None, pack_start=None), b.pack_order)
    lp, ent, vision, text = outputs(params, b.replace(pack_start=starts))
    return jnp.sum(lp * weights) + 0.1 * jnp.sum(ent), (lp, vision)


weights = np.random.default_rng(2).normal(size=batch.completion_mask.shape) * batch.completion_mask
for name, mesh in meshes.items():
    psh = S.param_shardings(host, mesh)
    params = R.put_on_mesh(host, psh)
    padded = packing.fit_batch(batch, key, cfgs["padded"], mesh)
    packed = packing.fit_batch(batch, key, cfgs["packed"], mesh)
    n = packed.completion_length
    with jax.set_mesh(mesh):
        got = jax.jit(outputs)(params, R.place_batch(padded, mesh))
        grad = jax.jit(jax.value_and_grad(loss, has_aux=True))
        rows = weights[packed.pack_order, :n]
        (value, (lp, vision)), grads = grad(params, R.place_batch(packed, mesh), rows)
    report[name]["width"] = [int(batch.input_ids.shape[1]), int(padded.input_ids.shape[1])]
    report[name]["outputs"] = [np.asarray(x).tolist() for x in got]
    back = np.argsort(packed.pack_order)  # rows in the batch's order again
    report[name]["packed"] = [float(value), np.asarray(lp)[back].tolist(),
                              np.asarray(vision)[:, back].tolist()]
    report[name]["grads"] = {".".join(map(str, p)): np.asarray(v.get_value()).tolist()
                             for p, v in nnx.to_flat_state(grads)}
    report[name]["pack_length"] = int(packed.pack_length)

# the sampler's prefill split over the rollout mesh's sequence (data 8, sequence 2: Ulysses;
# data 4 x tensor 2, sequence 4: context parallel), static and slots engines
import dataclasses
from jaxvrl.sampling import Sampler, layout, rollout_mesh
from jaxvrl.sampling.sampler import generation_config, row_vision_inputs
from tests.models import hf_tiny as T
rng = np.random.default_rng(4)
rows = [T.prompt(rng, images=[[1, 4, 4]]), T.prompt(rng, text_len=(9, 12)),
        T.prompt(rng, images=[[1, 4, 4], [1, 2, 2]]), T.prompt(rng, videos=[[2, 4, 4]])]
P = -(-max(map(len, rows)) // 4) * 4 + 4
ids, mask = T.left_pad(rows, length=P)
grids, vgrids = np.array([[1, 4, 4], [1, 4, 4], [1, 2, 2]]), np.array([[2, 4, 4]])
cfg = model.config
pos, deltas = qwen.get_rope_index(ids, mask, cfg, grids, vgrids, np.array([1.0]))
images = row_vision_inputs(T.patches(rng, grids), grids, ids, cfg.image_token_id, cfg)
videos = row_vision_inputs(T.patches(rng, vgrids), vgrids, ids, cfg.video_token_id, cfg)
pools = qwen.attention_pools(ids, mask, P, **T.POOL_IDS)
args = jax.tree.map(jnp.asarray, (ids, mask, pos, deltas))
kw = jax.tree.map(jnp.asarray, dict(images=images, videos=videos, pools=pools))
gen = generation_config(cfg, max_new_tokens=6, temperature=1.0, eos_token_ids=T.IM_END)
SAMPLERS = {"one": (1, 1), "ulysses": (1, 2), "context": (2, 4)}  # tensor, sequence
for name, (tensor, seq) in SAMPLERS.items():
    rmesh = rollout_mesh(meshes["one"], -1, tensor)
    got = {}
    for kind, c in (("static", gen), ("slots", dataclasses.replace(gen, slots=4))):
        sampler = Sampler(graphdef, c, rmesh, sequence=seq)
        ready = sampler.prepare(params0)
        out = sampler(ready, *args, jax.random.key(3), **kw, num_samples=2)
        got[kind] = [np.asarray(x).tolist() for x in (out.tokens, out.mask, out.logprobs,
                                                      out.vision_mass, out.text_mass)]
    report[name]["sampler"] = got
    text = sampler.lower(ready, *args, jax.random.key(3), **kw, num_samples=2).as_text()
    report[name]["prefill_collectives"] = [op for op in ("all_to_all", "all_gather") if op in text]
    pm = sampler.prefill_mesh
    report[name]["prefill_mesh"] = [int(pm.shape[a]) for a in S.MESH_AXES]
    # equivalent shardings across the two meshes: no copy either way
    leaf = jax.tree.leaves(ready.params)[0]
    rows8 = jax.device_put(jnp.zeros((8, 4)), jax.NamedSharding(pm, jax.P(("data", "sequence"))))
    same = [onto_ is not None and [s.data.unsafe_buffer_pointer() for s in a.addressable_shards]
            == [s.data.unsafe_buffer_pointer() for s in onto_.addressable_shards]
            for a, onto_ in ((leaf, layout.onto(leaf, pm)), (rows8, layout.onto(rows8, rmesh)))]
    report[name]["in_place"] = same
print("REPORT" + json.dumps(report))
"""


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return tiny_model_report(SCRIPT, tmp_path_factory, "sequence_model")


@pytest.mark.parametrize("split", ["ulysses", "context"])
def test_split_attention_equals_unsplit(report, split):
    want = {"ulysses": ["all_to_all", "all_gather"], "context": ["all_gather"]}[split]
    assert report[split]["collectives"] == want  # all_gather: the keys' ids and pools
    assert report["one"]["collectives"] == []
    want, got = report["one"]["attention"], report[split]["attention"]
    assert len(got) == 4
    for case in got:
        for a, b in zip(got[case], want[case]):
            a, b = np.asarray(a), np.asarray(b)
            np.testing.assert_allclose(a, b, atol=1e-5 * max(np.abs(b).max(), 1.0), err_msg=case)


def test_context_parallel_balances_causal_queries_over_devices(report):
    """Each of the 4 devices holds the row's eighths d and 7 - d (as many keys seen under a
    causal mask on every device), and the inverse gives back the row's order."""
    held, back = report["context"]["zigzag"]
    eighths = np.arange(32).reshape(8, 4)
    assert held == np.concatenate([np.r_[eighths[d], eighths[7 - d]] for d in range(4)]).tolist()
    assert back == list(range(32))


@pytest.mark.parametrize("split", ["ulysses", "context"])
def test_a_vision_language_model_on_split_rows_equals_unsplit(report, split):
    want, got = report["one"], report[split]
    size = {"ulysses": 2, "context": 4}[split]
    assert got["width"][0] % size and got["width"][1] % size == 0  # the prompts were padded
    assert want["width"][1] == want["width"][0]
    assert got["pack_length"] % size == 0
    lp, ent, vision, text = (np.asarray(x) for x in got["outputs"])
    w_lp, w_ent, w_vision, w_text = (np.asarray(x) for x in want["outputs"])
    np.testing.assert_allclose(lp, w_lp, atol=2e-5)
    np.testing.assert_allclose(ent, w_ent, atol=2e-5)
    np.testing.assert_allclose(vision, w_vision, atol=1e-6)
    np.testing.assert_allclose(text, w_text, atol=1e-6)
    assert w_vision.max() > 0.05 and np.abs(w_lp).max() > 0.1  # not all zero
    value, lp, vision = got["packed"]
    np.testing.assert_allclose(lp, want["packed"][1], atol=2e-5)
    np.testing.assert_allclose(vision, want["packed"][2], atol=1e-6)
    assert value == pytest.approx(want["packed"][0], rel=1e-5)
    scale = max(np.abs(np.asarray(g)).max() for g in want["grads"].values())
    for p, g in want["grads"].items():
        np.testing.assert_allclose(np.asarray(got["grads"][p]), np.asarray(g), atol=1e-5 * scale,
                                   err_msg=p)  # fmt: skip


@pytest.mark.parametrize("split", ["ulysses", "context"])
def test_a_sampler_prefill_split_over_the_sequence_axis_equals_unsplit(report, split):
    """The prompts' prefill on the rollout mesh's data groups joined 2 (Ulysses) or 4 (context
    parallel, with tensor 2) at a time: the same sampled tokens, log-probs and attention
    masses (static and slots engines) as the unsplit sampler; the prefill program
    splits attention; its weights and its carry cross between the meshes without a copy."""
    want, got = report["one"], report[split]
    size = {"ulysses": 2, "context": 4}[split]
    tensor = {"ulysses": 1, "context": 2}[split]
    assert got["prefill_mesh"] == [8 // size // tensor, 1, 1, size, tensor]
    assert got["prefill_collectives"] == {"ulysses": ["all_to_all", "all_gather"],
                                          "context": ["all_gather"]}[split]  # fmt: skip
    assert got["in_place"] == [True, True]
    for kind in ("static", "slots"):
        tokens, mask, lp, vision, text = (np.asarray(x) for x in got["sampler"][kind])
        w_tokens, w_mask, w_lp, w_vision, w_text = (np.asarray(x) for x in want["sampler"][kind])
        np.testing.assert_array_equal(tokens, w_tokens, err_msg=kind)
        np.testing.assert_array_equal(mask, w_mask, err_msg=kind)
        np.testing.assert_allclose(lp, w_lp, atol=2e-5, err_msg=kind)
        np.testing.assert_allclose(vision, w_vision, atol=1e-6, err_msg=kind)
        np.testing.assert_allclose(text, w_text, atol=1e-6, err_msg=kind)
        assert mask.sum() > 8 and w_vision.max() > 0.05
