"""The sampler casts float32 master weights to a bfloat16 model's compute dtype once, before
its loop (`compute_params`): the model computes the same numbers from the cast copy as from
the stored weights (it casts each weight to that dtype where it uses it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxvrl.models import qwen2_5_vl
from jaxvrl.models.lora import apply_lora
from jaxvrl.sampling.layout import compute_params
from tests.models import hf_tiny
from tests.sampling.test_prefill import inputs, prompts


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    path = tmp_path_factory.mktemp("compute_params_model")
    hf_tiny.build(path, seed=2)
    return path


@pytest.mark.parametrize("lora", ["none", "lora", "qlora"])
def test_cast_once_computes_what_the_stored_weights_do(path, lora):
    model = qwen2_5_vl.load(path, dtype=jnp.bfloat16, param_dtype=jnp.float32)
    if lora != "none":
        quantize = "int8" if lora == "qlora" else "none"
        apply_lora(model, 4, 8.0, 0.0, "q_proj,up_proj", quantize=quantize, seed=1)
    graphdef, params = nnx.split(model)
    cast = compute_params(graphdef, params)
    kinds = {}
    for (kp, a), b in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(cast)):
        name = jax.tree_util.keystr(kp)
        if jnp.issubdtype(a.dtype, jnp.floating):
            kinds[b.dtype == jnp.bfloat16] = name
        else:
            assert b.dtype == a.dtype, name
    assert kinds[True]  # weights cast ...
    if lora == "qlora":  # ... but a quantized kernel's scales are kept as stored
        assert "scale" in kinds[False]
    ids, mask, vis = prompts("two_images", np.random.default_rng(3))
    (ids, mask, pos, _), kw = inputs(model, ids, mask, **vis)

    @jax.jit
    def forward(p):
        out = nnx.merge(graphdef, p).forward(ids, mask, pos, images=kw["images"])
        return out.logits

    want, got = forward(params), forward(cast)
    assert got.dtype == want.dtype and float(jnp.abs(want).max()) > 1.0
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
