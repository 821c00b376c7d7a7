"""The CPU decode kernel (jaxvrl/sampling/rows_kernel.cc): x @ w.T against a float64
reference on odd shapes, its gate, the fallback when it cannot be built, and the sampler's
tokens and log-probs with and without it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxvrl.sampling import cpu_kernels, generate, make_sampler
from tests.models import hf_tiny as T

needs_kernel = pytest.mark.skipif(
    not cpu_kernels.available(), reason="no C++ compiler here: the kernel cannot be built"
)


@needs_kernel
@pytest.mark.parametrize(
    "m,k,n",
    [(1, 1, 1), (3, 7, 5), (8, 256, 1000), (9, 130, 77), (5, 37, 20001), (32, 896, 300)],
)
def test_rows_by_weight_matches_float64(m, k, n):
    """Every row count (full and partial blocks of 8), N with and without a partial last
    panel, over many chunks (several threads) and one."""
    rng = np.random.default_rng(m * 1000 + k)
    w = rng.standard_normal((n, k), np.float32)
    x = rng.standard_normal((m, k), np.float32)
    packed = cpu_kernels.pack(jnp.asarray(w))
    assert packed.shape == (-(-n // 8), k, 8)
    f = jax.jit(cpu_kernels.rows_by_weight, static_argnums=2)
    got = np.asarray(f(packed, jnp.asarray(x), n))
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    assert got.shape == (m, n) and got.dtype == np.float32
    # a float32 sum of k products: error within a few ulp of sum |x w| times k
    bound = 4 * np.finfo(np.float32).eps * k * (np.abs(x) @ np.abs(w).T)
    assert np.all(np.abs(got - ref) <= bound + 1e-30)
    # deterministic: the thread split does not change the summation order
    np.testing.assert_array_equal(got, np.asarray(f(packed, jnp.asarray(x), n)))


def test_rows_by_weight_rejects_an_unpacked_weight():
    with pytest.raises(ValueError, match="is not pack"):
        cpu_kernels.rows_by_weight(jnp.zeros((16, 8)), jnp.zeros((2, 8)), 16)


def test_gate():
    many = cpu_kernels.MAX_ROWS + 1
    assert not cpu_kernels.applies(2, jnp.bfloat16)
    assert not cpu_kernels.applies(many, jnp.float32)
    assert cpu_kernels.applies(2, jnp.float32) == cpu_kernels.available()


def test_build_failure_warns_and_falls_back(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXVRL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    cpu_kernels.available.cache_clear()
    try:
        with pytest.warns(UserWarning, match="could not be built or loaded"):
            assert not cpu_kernels.available()
        assert not cpu_kernels.applies(2, jnp.float32)
        assert not list(tmp_path.rglob("*.so"))  # no half-written library left behind
    finally:
        monkeypatch.undo()
        cpu_kernels.available.cache_clear()


@needs_kernel
def test_sampler_with_and_without_the_kernel(tmp_path, monkeypatch):
    """Greedy and sampled decoding through the kernel give the tokens of XLA's dot and the
    same log-probs (tied head: the kernel also does the 151936-row-style table product)."""
    from jaxvrl.models import qwen2_5_vl as q

    T.build(tmp_path, seed=8, tie=True)
    model = q.load(tmp_path)
    rng = np.random.default_rng(12)
    ids, mask = T.left_pad(
        [T.prompt(rng, images=[[1, 4, 4]], text_len=(3, 6)), T.prompt(rng, text_len=(9, 12))]
    )
    grid = np.array([[1, 4, 4]])
    kw = dict(max_new_tokens=10, pixel_values=T.patches(rng, grid), image_grid_thw=grid)
    runs, traced = {}, []
    real = cpu_kernels.rows_by_weight
    monkeypatch.setattr(
        cpu_kernels, "rows_by_weight", lambda w, x, n: traced.append(n) or real(w, x, n)
    )
    for name in ("kernel", "xla"):
        if name == "xla":
            assert traced  # the kernel was in the first runs' programs
            monkeypatch.setattr(cpu_kernels, "applies", lambda rows, dtype: False)
        make_sampler.cache_clear()
        runs[name] = [
            generate(model, ids, mask, temperature=t, rng=jax.random.key(2), **kw)
            for t in (0.0, 1.0)
        ]
    make_sampler.cache_clear()
    for a, b in zip(runs["kernel"], runs["xla"]):
        np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
        np.testing.assert_allclose(np.asarray(a.logprobs), np.asarray(b.logprobs), atol=1e-5)
