"""Mesh and sharding rules on 8 simulated CPU devices (run in a subprocess: the device count is
fixed when jax starts)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxvrl.parallel import sharding as S
from tests.parallel.common import run_with_devices


def test_param_axes_table():
    assert S.param_axes("model.layers.3.self_attn.q_proj.kernel", 2) == ("embed", "heads")
    assert S.param_axes("model.layers.3.mlp.down_proj.kernel", 2) == ("mlp", "embed")
    assert S.param_axes("visual.blocks.0.attn.proj.kernel", 2) == ("heads", "embed")
    # scanned layers: a leading "layers" axis (never split), then the per-layer axes
    stacked = "opt_state.1.0.mu.model.layers.mlp.down_proj.base.kernel"
    assert S.param_axes(stacked, 3) == ("layers", "mlp", "embed")
    assert S.param_axes("visual.blocks.norm1.weight", 2) == ("layers", "norm")
    assert S.LOGICAL_RULES["layers"] is None
    assert S.param_axes("model.norm.weight", 1) == ("norm",)
    assert S.param_axes("lm_head.kernel", 2) == ("embed", "vocab")
    # a mixture-of-experts layer: experts' kernels [E, D, F] like the dense MLP's, router
    experts = "model.layers.mlp.experts.up_proj.kernel"
    assert S.param_axes(experts, 4) == ("layers", "experts", "embed", "mlp")
    assert S.param_axes("model.layers.0.mlp.experts.down_proj.kernel", 3) == (
        "experts",
        "mlp",
        "embed",
    )
    # QLoRA's quantized experts: qvalue like the kernel, scale [E, D_in / tile, D_out]
    q = "model.layers.mlp.experts.gate_up_proj."
    assert S.param_axes(q + "qvalue", 4) == ("layers", "experts", "embed", "mlp")
    assert S.param_axes(q + "scale", 4) == ("layers", "experts", None, "mlp")
    q = "model.layers.0.mlp.experts.down_proj."
    assert S.param_axes(q + "qvalue", 3) == ("experts", "mlp", "embed")
    assert S.param_axes(q + "scale", 3) == ("experts", None, "embed")
    assert S.param_axes("model.layers.0.mlp.gate.kernel", 2) == ("embed", None)


def test_make_mesh_errors():
    import jax

    n = len(jax.devices())
    with pytest.raises(ValueError, match="at most one mesh axis"):
        S.make_mesh(data=-1, fsdp=-1)
    with pytest.raises(ValueError, match="needs"):
        S.make_mesh(data=n + 1, fsdp=1, tensor=1)


def test_fsdp_params_hold_one_eighth_each(tmp_path):
    out = run_with_devices(
        f"""
        import jax, numpy as np
        from flax import nnx
        from jaxvrl.models import qwen2_5_vl as q
        from jaxvrl.parallel import sharding as S
        from tests.models import hf_tiny as T
        T.build({str(tmp_path)!r}, hidden=64, heads=4, kv_heads=2, v_hidden=32)
        model = q.load({str(tmp_path)!r})
        mesh = S.make_mesh(data=1, fsdp=8, tensor=1)
        _, state = nnx.split(model, nnx.Param)
        shardings = S.param_shardings(state, mesh)
        state = jax.device_put(state, shardings)
        n_sharded = 0
        for path, var in nnx.to_flat_state(state):
            arr = var.get_value()
            shard = arr.addressable_shards[0].data
            if arr.sharding.spec and any(s is not None for s in arr.sharding.spec):
                assert shard.size * 8 == arr.size, (path, shard.shape, arr.shape)
                n_sharded += 1
        print("sharded", n_sharded)
        """
    )
    assert int(out.split("sharded")[-1]) >= 17  # scanned layers: one matrix per projection


def test_a_mixture_of_experts_model_on_expert_meshes_equals_one_device():
    """Qwen3-MoE (8 experts, top 2) with its experts split over the `expert` axis: with the
    rows split over it too (fsdp 2 x expert 4, 8 rows) tokens go to their experts' devices by
    all-to-all; with rows it does not divide (data 2 x expert 2 x tensor 2, 4 rows) every
    device runs its own experts and the sums are added. Logits (real tokens'), the loss and
    its gradients equal one device's; with a capacity, the dropped share counts the real
    tokens' pairs, padding taking no buffer place."""
    out = run_with_devices(
        """
        import json
        import jax, jax.numpy as jnp, numpy as np
        from flax import nnx
        from jaxvrl import models as M
        from jaxvrl.parallel import sharding as S
        from tests.models import hf_tiny_text as T
        d = dict(
            model_type="qwen3_moe", vocab_size=96, hidden_size=64, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        )
        cfg = M.config_from_hf(d)
        model = M.Model(cfg, rngs=nnx.Rngs(0))

        def loss(m, i, a, p):
            logits = m.forward(i, a, p).logits
            return jnp.mean(jnp.where(a[..., None] > 0, logits, 0.0) ** 2), logits

        grad = nnx.jit(nnx.value_and_grad(loss, has_aux=True))
        leaves = lambda g: jax.tree.leaves(nnx.state(g))
        for lengths, sizes, shard in (
            ((7, 11, 4, 9, 5, 8, 10, 6), dict(fsdp=2, expert=4), (2, 2, 32, 32)),
            ((7, 11, 4, 9), dict(data=2, fsdp=1, expert=2, tensor=2), (2, 4, 64, 16)),
        ):
            ids, mask = T.prompts(seed=1, lengths=lengths)
            pos, _ = M.rope_index(cfg, ids, mask)
            (want, want_logits), want_grad = grad(model, ids, mask, pos)
            mesh = S.make_mesh(**sizes)
            graphdef, state = nnx.split(model)
            with jax.set_mesh(mesh):
                state = jax.device_put(state, S.param_shardings(state, mesh))
                sharded = nnx.merge(graphdef, state)
                kernel = sharded.model.layers.mlp.experts.gate_proj.kernel[...]
                assert kernel.addressable_shards[0].data.shape == shard, kernel.sharding
                (got, logits), got_grad = grad(sharded, ids, mask, pos)
            scale = max(float(jnp.abs(g).max()) for g in leaves(want_grad))
            real = mask[..., None] > 0  # padding's expert outputs are 0 where pairs are sent
            errors = (
                abs(float(got - want)) / float(want),
                float(jnp.abs(jnp.where(real, logits - want_logits, 0)).max()
                      / jnp.abs(want_logits).max()),
                max(float(jnp.abs(a - b).max()) for a, b in zip(leaves(got_grad), leaves(want_grad))) / scale,
            )
            print("errors", max(errors))
        # a capacity of half the pairs a device would send each device: pairs past it are
        # dropped, and their share is each device's overflow counted from the routes its real
        # tokens used (left padding takes no place and is not counted)
        ids, mask = T.prompts(seed=1, lengths=(7, 11, 4, 9, 5, 8, 10, 6))
        pos, _ = M.rope_index(cfg, ids, mask)
        model.set_expert_capacity(0.5)
        graphdef, state = nnx.split(model)
        mesh = S.make_mesh(fsdp=2, expert=4)
        forward = nnx.jit(lambda m, i, a, p: m.forward(i, a, p, record_routes=True))
        with jax.set_mesh(mesh):
            state = jax.device_put(state, S.param_shardings(state, mesh))
            out = forward(nnx.merge(graphdef, state), ids, mask, pos)
        routes = np.asarray(out.routes).reshape(2, 8, -1, 2)  # [L', device (its row), n, k]
        n = routes.shape[2]
        cap = -(-n * 2 // 2 // 4)  # ceil(0.5 * n k / 4)
        real = np.asarray(mask, bool)[None, :, :, None]  # [1, device, n, 1]
        per_device = np.stack([((routes // 2 == d) & real).sum(axis=(2, 3)) for d in range(4)], -1)
        want = np.maximum(per_device - cap, 0).sum(axis=(1, 2)) / (real.sum() * 2)
        assert want.max() > 0 and (np.asarray(mask) == 0).any()
        got = [float(x) for x in np.asarray(out.expert_dropped)]
        print("dropped" + json.dumps([got, [float(x) for x in want]]))

        # the sampler on rollout meshes with an expert axis (8 rows: the decode steps send
        # tokens to their experts' devices; the prefill's 4 prompts do not split over 8 or 4
        # row groups: every device runs its own experts), static and slots engines
        import dataclasses
        from jaxvrl.sampling import Sampler, rollout_mesh
        from jaxvrl.sampling.sampler import generation_config
        # rollout.mesh.expert=0: the most devices that divide the 8 experts and the rows' split
        from jaxvrl.trainer.setup import auto_experts
        eight = S.make_mesh(fsdp=-1)
        picks = [auto_experts(eight, (-1, 0, 2, 0, 0), cfg.text, rows, sequence)
                 for rows, sequence in ((8, 1), (4, 1), (8, 2))]
        print("auto" + json.dumps(picks))
        # (the model keeps its capacity of 0.5: the sampler drops no pair all the same)
        graphdef, params = nnx.split(model)
        ids, mask = T.prompts(seed=2, lengths=(5, 9, 7, 3))
        gen = generation_config(cfg, max_new_tokens=5, temperature=1.0, routes=True)
        args = (ids, mask, *M.rope_index(cfg, ids, mask), jax.random.key(4))
        want = Sampler(graphdef, gen)(params, *args, num_samples=2)
        for sizes, slots in ((dict(data=2, expert=4, tensor=1), 0),
                             (dict(data=1, expert=4, tensor=2), 0),
                             (dict(data=2, expert=4, tensor=1), 8)):
            rmesh = rollout_mesh(S.make_mesh(fsdp=-1), **sizes)
            sampler = Sampler(graphdef, dataclasses.replace(gen, slots=slots, page_size=4), rmesh)
            ready = sampler.prepare(params).params
            shards = [x.addressable_shards[0].data.shape for x in (
                ready["model"]["layers"]["mlp"]["experts"]["gate_proj"]["kernel"],
                ready["model"]["layers"]["self_attn"]["q_proj"]["kernel"])]
            got = sampler(params, *args, num_samples=2)
            print("sampled" + json.dumps([
                dict(rmesh.shape), shards, bool(np.array_equal(got.tokens, want.tokens)),
                bool(np.array_equal(got.routes, want.routes)),
                float(np.abs(np.asarray(got.logprobs) - np.asarray(want.logprobs)).max())]))
        """
    )
    errors = [float(x.split()[0]) for x in out.split("errors")[1:]]
    assert len(errors) == 2 and max(errors) < 1e-5, errors
    got, want = json.loads(out.split("dropped")[-1].splitlines()[0])
    assert len(want) == 2 and min(want) > 0, want  # the capacity binds
    np.testing.assert_allclose(got, want, rtol=1e-6)
    # 8 rows: all 8 devices; 4 rows: 4 (tensor 2: its 2 KV heads); a prompt split over
    # devices: none
    assert json.loads(out.split("auto")[1].splitlines()[0]) == [8, 4, 1]
    sampled = [json.loads(x.splitlines()[0]) for x in out.split("sampled")[1:]]
    assert [s[0]["expert"] for s in sampled] == [4, 4, 4], sampled
    # the experts split 4 ways (and their width over tensor), attention whole over the expert
    # axis (over tensor by head): [L, E, D, F], [L, D, H]
    assert [s[1] for s in sampled] == [
        [[2, 2, 64, 32], [2, 64, 64]],
        [[2, 2, 64, 16], [2, 64, 32]],
        [[2, 2, 64, 32], [2, 64, 64]],
    ], sampled
    for mesh, _, tokens, routes, logprobs in sampled:
        assert tokens and routes and logprobs < 1e-5, (mesh, tokens, routes, logprobs)


def test_an_expert_axis_is_refused_where_it_does_not_divide_the_experts(tmp_path):
    """The train step's expert axis and the sampler's."""
    from configs import base
    from jaxvrl import models as M
    from jaxvrl.config import ConfigError, set_values
    from jaxvrl.trainer.setup import check_model_settings
    from tests.models import hf_tiny_text as T

    T.make_config("qwen3").save_pretrained(tmp_path / "dense")
    T.make_config("qwen3_moe", num_experts=6, num_experts_per_tok=2).save_pretrained(
        tmp_path / "moe"
    )
    c = base.get_config()
    set_values(c, {"data.builtin_task": "arithmetic"})
    for key in ("mesh.expert", "rollout.mesh.expert"):  # the train step's, the sampler's
        set_values(c, {"mesh.expert": 1, "rollout.mesh.expert": 1, key: 4})
        for name, says in (("dense", "no mixture-of-experts layers"), ("moe", "6 experts")):
            with pytest.raises(ConfigError, match=rf"^config\.{key}=4: model type .* has {says}; "):
                check_model_settings(c, M.load_config(tmp_path / name))
    set_values(c, {"mesh.expert": 3, "rollout.mesh.expert": 2, "model.expert_capacity": 1.25})
    check_model_settings(c, M.load_config(tmp_path / "moe"))
    set_values(c, {"mesh.expert": 1})  # a capacity with nothing to bound
    with pytest.raises(ConfigError, match=r"^config\.model\.expert_capacity=1.25: it bounds "):
        check_model_settings(c, M.load_config(tmp_path / "moe"))


class _Chip:  # a device as device_split sees one: id, host, torus coordinates (TPU) or none
    def __init__(self, i, host, coords=None):
        self.id, self.process_index = i, host
        if coords is not None:
            self.coords = coords

    def __repr__(self):
        return f"chip{self.id}"


def _is_box(chips) -> bool:
    xyz = np.asarray([d.coords for d in chips])
    return (
        len({tuple(c) for c in xyz.tolist()})
        == len(chips)
        == int(np.prod(xyz.max(0) - xyz.min(0) + 1))
    )


def _split(devices, k):
    from ml_collections import ConfigDict

    from jaxvrl.trainer.setup import device_split

    return device_split(ConfigDict({"rollout": {"devices": k}}), devices)


def test_one_step_off_splits_each_host_into_two_boxes_of_the_torus():
    """rollout.devices=K on TPU chips: every host gives K / hosts chips, a slab of its box,
    to the sampler and keeps its first chip for the train step; the sizes offered are
    those with such slabs (v5p-32: 4 hosts of 2x2x1; v5e-8: one host of 2x4)."""
    from jaxvrl.config import ConfigError
    from jaxvrl.trainer.setup import split_sizes

    v5p = [_Chip(4 * z + x + 2 * y, z, (x, y, z)) for z in range(4) for y in (0, 1) for x in (0, 1)]
    v5e = [_Chip(i, 0, (i % 2, i // 2, 0)) for i in range(8)]
    assert split_sizes(v5p) == [8] and split_sizes(v5e) == [2, 4, 6]
    for devices, k in [(v5p, 8), (v5e, 2), (v5e, 4), (v5e, 6)]:
        train, roll = _split(devices, k)
        assert len(roll) == k and sorted(train + roll, key=id) == sorted(devices, key=id)
        for h in {d.process_index for d in devices}:
            mine = [d for d in devices if d.process_index == h]
            t = [d for d in train if d.process_index == h]
            r = [d for d in roll if d.process_index == h]
            assert len(r) == k // len({d.process_index for d in devices})
            assert _is_box(t) and _is_box(r) and min(mine, key=lambda d: d.id) in t, (k, t, r)
    cpu = [_Chip(i, i // 4) for i in range(8)]  # no coordinates: the last K / hosts of each
    assert split_sizes(cpu) == [2, 4, 6]
    assert [d.id for d in _split(cpu, 4)[1]] == [2, 3, 6, 7]
    assert _split(v5p, 4)[1] == [v5p[3], v5p[7], v5p[11], v5p[15]]  # no slab of 1: in order
    for k in (3, 16):
        with pytest.raises(ConfigError, match=f"rollout.devices={k}"):
            _split(cpu, k)


def test_host_offload_is_refused_where_the_devices_have_no_host_memory():
    import types

    import jax

    from jaxvrl.config import ConfigError, load_config
    from jaxvrl.trainer.setup import check_offload

    class NoHost:
        platform = "gpu"

        def addressable_memories(self):
            return [types.SimpleNamespace(kind="device")]

    bare = types.SimpleNamespace(devices=np.asarray([NoHost()], dtype=object))
    both = load_config(
        "configs/grpo.py", ["actor.offload_optimizer=true", "actor.offload_reference=true"]
    )
    with pytest.raises(ConfigError, match=r"actor.offload_optimizer=True: gpu devices have no "):
        check_offload(both, bare)
    assert check_offload(load_config("configs/grpo.py"), bare) == ()
    cpu = types.SimpleNamespace(devices=np.asarray(jax.devices()[:1], dtype=object))
    assert check_offload(both, cpu) == ("optimizer", "reference")  # CPUs have pinned host
    remat = load_config("configs/grpo.py", ["model.remat_policy=offload"])
    with pytest.raises(ConfigError, match=r"model.remat_policy='offload': gpu devices have no "):
        check_offload(remat, bare)
    assert check_offload(remat, cpu) == ()  # no part of the state moves; the residuals do
