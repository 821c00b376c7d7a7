"""Chunked log-probs/entropies of the completion tokens vs the full-logits formulas."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxvrl.models import qwen2_5_vl as q
from jaxvrl.trainer.passes import completion_logprobs, head_chunk
from tests.models import hf_tiny as T


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("policy_model")
    T.build(path, seed=5)
    return q.load(path)


def full_logits_stats(model, hidden, tokens, temperature):
    logits = np.asarray(model.logits(hidden), np.float64) / temperature
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    tok = np.take_along_axis(logp, np.asarray(tokens)[..., None], -1)[..., 0]
    return tok, -(np.exp(logp) * logp).sum(-1)


@pytest.mark.parametrize("chunk", [0, 1, 3, 7, 32])
def test_chunked_logprobs_and_entropy_equal_full_logits(model, chunk):
    rng = np.random.default_rng(chunk)
    b, n, d = 3, 7, model.config.text.hidden_size
    hidden = jnp.asarray(rng.normal(size=(b, n, d)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, model.config.text.vocab_size, (b, n)), jnp.int32)
    logp, ent = completion_logprobs(model, hidden, tokens, 0.7, entropy="value", chunk=chunk)
    want_logp, want_ent = full_logits_stats(model, hidden, tokens, 0.7)
    np.testing.assert_allclose(np.asarray(logp), want_logp, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(ent), want_ent, atol=2e-5, rtol=1e-5)
    none_logp, none_ent = completion_logprobs(model, hidden, tokens, 0.7, chunk=chunk)
    assert none_ent is None
    np.testing.assert_array_equal(np.asarray(none_logp), np.asarray(logp))


def test_chunked_gradients_equal_full_logits_gradients(model):
    """d/d(params, hidden) of sum(w1 logp + w2 entropy) through the chunked scan (with
    recomputation) equals the gradient through the full [B, N, V] logits."""
    graphdef, params = nnx.split(model, nnx.Param)
    rng = np.random.default_rng(0)
    b, n, d = 2, 5, model.config.text.hidden_size
    hidden = jnp.asarray(rng.normal(size=(b, n, d)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, model.config.text.vocab_size, (b, n)), jnp.int32)
    w1, w2 = (jnp.asarray(rng.normal(size=(b, n)), jnp.float32) for _ in range(2))

    def chunked(p, h, mode):
        lp, ent = completion_logprobs(nnx.merge(graphdef, p), h, tokens, 1.3, entropy=mode, chunk=2)
        return jnp.sum(w1 * lp + w2 * ent)

    def full(p, h, ent_grad):
        logp = jax.nn.log_softmax(nnx.merge(graphdef, p).logits(h) / 1.3, -1)
        lp = jnp.take_along_axis(logp, tokens[..., None], -1)[..., 0]
        ent = -jnp.sum(jnp.exp(logp) * logp, -1)
        return jnp.sum(w1 * lp + w2 * (ent if ent_grad else jax.lax.stop_gradient(ent)))

    for mode, ent_grad in (("grad", True), ("value", False)):
        got = jax.grad(chunked, argnums=(0, 1))(params, hidden, mode)
        want = jax.grad(full, argnums=(0, 1))(params, hidden, ent_grad)
        flat_got, flat_want = jax.tree.leaves(got), jax.tree.leaves(want)
        assert any(float(jnp.abs(g).max()) > 1e-3 for g in flat_want)
        for g, w in zip(flat_got, flat_want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, rtol=1e-4)


def test_head_chunk_bounds_the_logits_chunk():
    assert head_chunk(16, 64, 151936) == 10  # 16 x 10 x 151936 x 4 B ~ 93 MiB
    assert head_chunk(1, 5, 1000) == 5  # never more than the completion
    assert head_chunk(4096, 64, 151936) == 1


def test_chunks_per_device_on_a_mesh_equal_one_device():
    """Under a mesh splitting the rows, the chunked head runs per device: vocabulary-parallel
    where fsdp splits the rows (fsdp 4; data 2 x fsdp 2), the whole head gathered once where
    data alone does (data 4). Log-probs, entropies and gradients (params and hidden) equal
    the one-device computation, untied and tied heads."""
    from tests.parallel.common import run_with_devices

    out = run_with_devices(
        """
        import tempfile
        import jax, jax.numpy as jnp, numpy as np
        from flax import nnx
        from jax.sharding import NamedSharding, PartitionSpec as P
        from jaxvrl.models import qwen2_5_vl as q
        from jaxvrl.parallel import sharding as S
        from jaxvrl.trainer.passes import completion_logprobs
        from tests.helpers import batch_sharding
        from tests.models import hf_tiny as T

        jax.config.update("jax_default_matmul_precision", "highest")
        for tie in (False, True):
            path = tempfile.mkdtemp()
            T.build(path, seed=3, tie=tie)
            model = q.load(path)
            graphdef, params = nnx.split(model, nnx.Param)
            rng = np.random.default_rng(1)
            b, n, d = 8, 9, model.config.text.hidden_size
            hidden = jnp.asarray(rng.normal(size=(b, n, d)), jnp.float32)
            tokens = jnp.asarray(rng.integers(0, model.config.text.vocab_size, (b, n)), jnp.int32)
            w1, w2 = (jnp.asarray(rng.normal(size=(b, n)), jnp.float32) for _ in range(2))

            def loss(p, h):
                lp, ent = completion_logprobs(nnx.merge(graphdef, p), h, tokens, 1.3,
                                              entropy="grad", chunk=2)
                return jnp.sum(w1 * lp + w2 * ent), (lp, ent)

            want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, hidden)
            for sizes in (dict(fsdp=4), dict(data=2, fsdp=2), dict(data=4)):
                mesh = S.make_mesh(**sizes, devices=jax.devices()[:4])

                def on_mesh(p, h):
                    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                        assert S.row_axes(b) == tuple(sizes)  # the per-device path
                        return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(p, h)

                assert S.row_axes(b) == ()  # no mesh here
                p = jax.device_put(params, S.param_shardings(params, mesh))
                h = jax.device_put(hidden, batch_sharding(mesh, 3))
                got = jax.jit(on_mesh)(p, h)
                for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
                    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=2e-5)

                def no_entropy(p, h):  # entropy "none": the log-probs alone come back
                    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                        m = nnx.merge(graphdef, p)
                        lp, ent = completion_logprobs(m, h, tokens, 1.3, chunk=2)
                    assert ent is None
                    return lp

                lp = jax.jit(no_entropy)(p, h)
                np.testing.assert_allclose(np.asarray(lp), np.asarray(want[0][1][0]), atol=2e-5, rtol=2e-5)
                print("ok", tie, sizes)
        """,
        n=4,
    )
    assert out.count("ok") == 6, out
