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
