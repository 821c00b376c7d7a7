"""The streamed optimizer update (actor.offload_optimizer): the same params and AdamW state as
the update with the state on the devices, for the policy's and the critic's optimizers, with
the global-norm clip binding or not and a skipped update; the new state stays in host memory."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxvrl.config import load_config
from jaxvrl.trainer import build
from jaxvrl.trainer import critic as critic_lib
from jaxvrl.trainer.update import _apply


def _tree(rng, scale=1.0):
    """Params keyed as a scanned model's: stacked layers (28 and 3 of them), unstacked
    leaves, a single-layer stack and a scalar-free bias."""
    a = lambda *s: jnp.asarray(rng.normal(size=s) * scale, jnp.float32)  # noqa: E731
    return {
        "lm_head": {"kernel": a(6, 11)},
        "model": {
            "embed_tokens": {"embedding": a(11, 6)},
            "layers": {"mlp": {"up_proj": {"kernel": a(5, 6, 9)}}, "norm": {"weight": a(5, 6)}},
            "norm": {"weight": a(6)},
        },
        "visual": {"blocks": {"attn": {"qkv": {"kernel": a(3, 4, 12), "bias": a(3, 12)}}}},
    }


@pytest.mark.parametrize("which", ["policy", "critic"])
@pytest.mark.parametrize("clip_binds", [True, False])
@pytest.mark.parametrize("ok", [True, False])
def test_streamed_update_equals_the_update_on_the_devices(which, clip_binds, ok):
    rng = np.random.default_rng(0)
    params = _tree(rng)
    if which == "policy":
        o = load_config("configs/grpo.py", ["optim.grad_clip=0.7", "optim.weight_decay=0.1"]).optim
        tx, clip = build.make_optimizer(o), 0.7
    else:
        tx, clip = critic_lib.make_optimizer(1e-2, 0.7), 0.7
    # a state some updates in: moments away from zero, the step count past 0
    opt = tx.init(params)
    for _ in range(2):
        _, opt = tx.update(_tree(rng, 0.01), opt, params)
    grads = _tree(rng, 1.0 if clip_binds else 1e-3)
    norm = float(jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(grads))))
    assert (norm > clip) == clip_binds

    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    ref = jax.jit(lambda g, o, p: _apply(tx, g, o, p, ok))(grads, opt, params)
    got = jax.jit(lambda g, o, p: _apply(tx, g, o, p, ok, True, clip))(
        grads, jax.device_put(opt, host), params
    )
    assert jax.tree.structure(got) == jax.tree.structure(ref)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(got[1])} == {"pinned_host"}
    for r, g in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
        r, g = np.asarray(r), np.asarray(g)
        if not ok:  # a skipped update keeps the old values exactly
            np.testing.assert_array_equal(g, r)
        else:  # elementwise terms: a few float32 roundings of each value's own size
            np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-6 * float(np.abs(r).max() or 1))
    if ok:  # the update did move the params and count the step
        assert not np.allclose(np.asarray(got[0]["lm_head"]["kernel"]), params["lm_head"]["kernel"])
