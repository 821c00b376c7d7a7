"""Mesh and sharding rules on 8 simulated CPU devices (run in a subprocess: the device count is
fixed when jax starts)."""

from __future__ import annotations

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


def test_a_mixture_of_experts_model_sharded_gives_its_logits():
    """Qwen3-MoE's experts' kernels split on fsdp and tensor like a dense MLP's (the experts'
    axis replicated): the grouped matmuls of the sharded model give the unsharded logits."""
    out = run_with_devices(
        """
        import jax, numpy as np
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
        ids, mask = T.prompts(seed=1, lengths=(7, 11, 4, 9))
        pos, _ = M.rope_index(cfg, ids, mask)
        forward = nnx.jit(lambda m, i, a, p: m.forward(i, a, p).logits)
        want = np.asarray(forward(model, ids, mask, pos))
        mesh = S.make_mesh(data=1, fsdp=4, tensor=2)
        graphdef, state = nnx.split(model)
        with jax.set_mesh(mesh):
            state = jax.device_put(state, S.param_shardings(state, mesh))
            sharded = nnx.merge(graphdef, state)
            kernel = sharded.model.layers.mlp.experts.gate_proj.kernel[...]
            assert kernel.addressable_shards[0].data.shape == (2, 8, 16, 16)
            got = np.asarray(forward(sharded, ids, mask, pos))
        print("error", np.abs(got - want).max() / np.abs(want).max())
        """
    )
    assert float(out.split("error")[-1]) < 1e-5
