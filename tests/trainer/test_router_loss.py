"""The experts' load-balancing loss in the policy loss (actor.router_aux_loss_coef), on a tiny
Qwen3-MoE: the loss pass's router logits are transformers' (`output_router_logits`), and the
loss grows by coef times the loss of those logits over the real tokens, padded or packed."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import base
from jaxvrl import models as M
from jaxvrl.config import ConfigError, set_values
from jaxvrl.models import moe
from jaxvrl.trainer import packing, update
from jaxvrl.trainer.experience import Rows
from jaxvrl.trainer.passes import completion_hidden, router_tokens
from jaxvrl.trainer.rollout import assemble
from jaxvrl.trainer.setup import check_model_settings
from tests.helpers import step_config
from tests.models import hf_tiny_text as T
from tests.models.test_qwen3_moe import TOP_K, _numpy_balance_loss, build

P, N = 6, 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(HF model, our model, a host rollout batch of 4 left-padded rows)."""
    path = tmp_path_factory.mktemp("qwen3_moe_loss")
    hf = build(path)
    rng = np.random.default_rng(3)
    mask = (np.arange(P) >= np.array([[0], [3], [1], [4]])).astype(np.int32)
    ids = rng.integers(3, 90, (4, P)) * mask
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    comp = np.ones((4, N), np.float32)
    comp[1, 2:] = 0  # an EOS: the tokens after it are padding
    comp[3, 1:] = 0
    tokens = rng.integers(3, 90, (4, N))
    batch = assemble(
        ids, mask, positions, np.zeros(4, np.int32), tokens, comp, rng.normal(size=4),
        np.zeros(4, bool),
    )  # fmt: skip
    return hf, M.load(path), batch


def hf_router_logits(hf, batch) -> np.ndarray:
    """transformers' router logits [L, B * T, E] of the batch's rows (float32)."""
    import torch

    with torch.no_grad():
        out = hf(
            input_ids=torch.tensor(np.asarray(batch.input_ids)),
            attention_mask=torch.tensor(np.asarray(batch.attention_mask)),
            position_ids=torch.tensor(np.asarray(batch.position_ids)),
            output_router_logits=True,
        )
    return np.stack([x.float().numpy() for x in out.router_logits])


def test_the_loss_pass_gives_transformers_router_logits(tiny):
    hf, model, batch = tiny
    real = np.asarray(batch.attention_mask).reshape(-1) > 0
    _, out = completion_hidden(model, jax.tree.map(jnp.asarray, batch), router=True)
    assert out.router_logits.shape == (2, batch.input_ids.size, 8)
    want = hf_router_logits(hf, batch)
    np.testing.assert_allclose(out.router_logits[:, real], want[:, real], rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(router_tokens(batch), real)
    _, plain = completion_hidden(model, jax.tree.map(jnp.asarray, batch))
    assert plain.router_logits is None
    from jaxvrl.models import KVCache

    cache = KVCache.init(model.config.text, *batch.input_ids.shape, stacked=True)
    with pytest.raises(ValueError, match=r"^router_logits: only for a forward pass without a"):
        model.forward(
            *(batch.input_ids, batch.attention_mask, batch.position_ids),
            cache=cache,
            router_logits=True,
        )


@pytest.mark.parametrize("padding_free", [False, True])
def test_the_loss_adds_coef_times_the_load_balancing_loss(tiny, padding_free):
    hf, model, batch = tiny
    real = np.asarray(batch.attention_mask).reshape(-1) > 0
    want = _numpy_balance_loss(hf_router_logits(hf, batch), TOP_K, real)
    graphdef, params = nnx.split(model)
    aux = update.MicroInputs(Rows(jnp.asarray([1.0, -0.5, 0.3, -1.0])), jnp.float32(1.0))

    def loss(coef, params):  # jitted: the gradients below are taken in one program each
        cfg = step_config({
            "actor.router_aux_loss_coef": coef, "actor.padding_free": padding_free,
            "rollout.max_new_tokens": N, "rollout.num_generations": 4,
        })  # fmt: skip
        mb = packing.fit_batch(batch, jax.random.key(0), cfg)
        assert (mb.pack_start is not None) == padding_free
        mb = jax.tree.map(jnp.asarray, mb)
        return jax.jit(lambda p: update._loss(p, None, graphdef, mb, aux, cfg))(params)

    off, on = loss(0.0, params), loss(0.25, params)
    assert "router_aux_loss" not in off[1].sums
    np.testing.assert_allclose(on[1].sums["router_aux_loss"], want, rtol=1e-5)
    np.testing.assert_allclose(on[0] - off[0], 0.25 * want, rtol=1e-4, atol=1e-7)
    if padding_free:  # the gradients differ by coef times the auxiliary loss's own

        def grad(coef):
            cfg = step_config({
                "actor.router_aux_loss_coef": coef, "actor.padding_free": True,
                "rollout.max_new_tokens": N, "rollout.num_generations": 4,
            })  # fmt: skip
            mb = jax.tree.map(jnp.asarray, packing.fit_batch(batch, jax.random.key(0), cfg))
            fn = lambda p: update._loss(p, None, graphdef, mb, aux, cfg)[0]  # noqa: E731
            return jax.jit(jax.grad(fn))(params)

        @jax.jit
        def balance_grad(p):
            return jax.grad(balance)(p)

        def balance(p):
            out = nnx.merge(graphdef, p).forward(
                jnp.asarray(batch.input_ids), jnp.asarray(batch.attention_mask),
                jnp.asarray(batch.position_ids), return_logits=False, router_logits=True,
            )  # fmt: skip
            return moe.load_balancing_loss(out.router_logits, TOP_K, jnp.asarray(real))

        diff = jax.tree.map(jnp.subtract, grad(0.25), grad(0.0))
        expected = jax.tree.map(lambda g: 0.25 * g, balance_grad(params))
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-6), diff, expected)
        gate = diff["model"]["layers"]["mlp"]["gate"]["kernel"][...]
        assert np.abs(np.asarray(gate)).max() > 1e-4  # the routers do get a gradient


def test_a_model_without_experts_refuses_the_setting(tmp_path):
    T.make_config("qwen3").save_pretrained(tmp_path)
    c = base.get_config()
    set_values(c, {"actor.router_aux_loss_coef": 0.01, "data.builtin_task": "arithmetic"})
    with pytest.raises(ConfigError, match=r"^config\.actor\.router_aux_loss_coef=0.01: "):
        check_model_settings(c, M.load_config(tmp_path))
    set_values(c, {"actor.router_aux_loss_coef": 0.0})
    check_model_settings(c, M.load_config(tmp_path))
