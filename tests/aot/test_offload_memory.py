"""With the optimizer state in host memory, the TPU compiler keeps no more than a layer's share
of it on the chips during the update (v5e-8, fsdp 8): the streamed update's temporaries stay a
small part of the state, where bringing the state over whole takes more than the state."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxvrl.config import load_config
from jaxvrl.parallel import topology as T
from jaxvrl.trainer import build, offload

pytest.importorskip("libtpu", reason="the TPU compiler: pip install -e '.[tpu]'")


def _whole(tx, grads, opt, params, ok):
    """The state brought to the chips at once and put back (the form streaming replaces)."""
    on = jax.device_put(opt, jax.memory.Space.Device)
    updates, new = tx.update(grads, on, params)
    new = jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, on)
    params = jax.tree.map(lambda p, u: jnp.where(ok, p + u, p), params, updates)
    return params, jax.device_put(new, jax.memory.Space.Host)


def test_streamed_update_keeps_a_layer_of_the_state_on_the_chips():
    mesh = jax.sharding.Mesh(np.array(T.tpu_devices(T.parse("v5e-8"))), ("fsdp",))
    layers, d, f = 28, 1024, 4096
    params = {
        "model": {
            "layers": {"mlp": {"up_proj": {"kernel": jax.ShapeDtypeStruct((layers, d, f), "f4")}}},
            "embed_tokens": {"embedding": jax.ShapeDtypeStruct((4096, d), "f4")},
        }
    }
    spec = lambda x: P(*([None] * (x.ndim - 1)), "fsdp")  # noqa: E731
    dev = jax.tree.map(lambda x: NamedSharding(mesh, spec(x)), params)
    tx = build.make_optimizer(load_config("configs/grpo.py").optim)
    opt = jax.eval_shape(tx.init, params)
    host = jax.tree.map(
        lambda x: NamedSharding(mesh, spec(x) if x.ndim else P(), memory_kind="pinned_host"), opt
    )
    ok = jax.ShapeDtypeStruct((), jnp.bool_)
    state_bytes = 2 * sum(x.size * 4 for x in jax.tree.leaves(params)) // 8  # mu + nu per chip

    def temps(fn):
        jitted = jax.jit(fn, in_shardings=(dev, host, dev, None), out_shardings=(dev, host))
        return jitted.lower(params, opt, params, ok).compile().memory_analysis().temp_size_in_bytes

    streamed = temps(lambda g, o, p, ok: offload.streamed_update(tx, g, o, p, ok, 1.0))
    whole = temps(lambda g, o, p, ok: _whole(tx, g, o, p, ok))
    assert whole >= state_bytes, (whole, state_bytes)
    # a layer's mu and nu (1/28 of the stacked kernel's) plus the unstacked embedding's
    assert streamed < 0.25 * state_bytes, (streamed, state_bytes)


def test_remat_offload_keeps_the_layer_inputs_in_host_memory():
    """model.remat_policy=offload: a scan of remat'd layers keeps each layer's input (what its
    backward pass recomputes it from) in host memory, not among the chips' temporaries."""
    from flax import nnx

    from jaxvrl.models.layers import remat

    mesh = jax.sharding.Mesh(np.array(T.tpu_devices(T.parse("v5e-8"))), ("fsdp",))
    rows = NamedSharding(mesh, P("fsdp"))
    x = jax.ShapeDtypeStruct((8 * 4096, 1024), jnp.bfloat16, sharding=rows)
    inputs = 16 * 4096 * 1024 * 2  # per chip: 16 layers' inputs of 4,096 rows
    linear = lambda: nnx.Linear(1024, 1024, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))  # noqa: E731
    graphdef, weights = nnx.split(nnx.eval_shape(linear))

    def grads(policy):
        call = remat(lambda m, h: jnp.tanh(m(h)), policy, prevent_cse=False)

        def loss(x, weights):
            layer = nnx.merge(graphdef, weights)
            return jax.lax.scan(lambda h, _: (call(layer, h), None), x, None, length=16)[0].sum()

        mem = jax.jit(jax.grad(loss)).lower(x, weights).compile().memory_analysis()
        return mem.temp_size_in_bytes, mem.host_temp_size_in_bytes

    on_chips, on_host = grads("offload")  # remat full keeps all of them on the chips
    assert on_chips < inputs / 4 and on_host >= inputs, (on_chips, on_host)
