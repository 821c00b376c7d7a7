"""`gather_rows`: an injective gather whose gradient is the gather by the inverse map, equal to
the plain gather's gradient (a scatter-add) and free of scatters; and `Packing.pack` built on
it packs rows into buffers and back."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxvrl.models import Packing, gather_rows


def _maps(rng, groups, sources, reads):
    """index int32[G, J] (an injective map onto sources, `sources` = none) and its inverse."""
    index = np.full((groups, reads), sources, np.int32)
    inverse = np.full((groups, sources), reads, np.int32)
    for g in range(groups):
        n = rng.integers(1, min(sources, reads) + 1)
        js, ss = rng.choice(reads, n, replace=False), rng.choice(sources, n, replace=False)
        index[g, js], inverse[g, ss] = ss, js
    return jnp.asarray(index), jnp.asarray(inverse)


def test_value_and_gradient_equal_the_plain_gather():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(3, 7, 5)), jnp.float32)
    index, inverse = _maps(rng, 3, 7, 9)
    w = jnp.asarray(rng.normal(size=(3, 9, 5)), jnp.float32)

    def plain(x):  # zero-padded take_along_axis: its transpose is a scatter-add
        full = jnp.concatenate([x, jnp.zeros((3, 1, 5))], axis=1)
        return jnp.take_along_axis(full, index[..., None], axis=1)

    want = np.asarray(x)[np.arange(3)[:, None], np.minimum(np.asarray(index), 6)]
    want[np.asarray(index) == 7] = 0
    np.testing.assert_array_equal(gather_rows(x, index, inverse), want)
    loss = lambda f: lambda x: jnp.sum(jnp.sin(f(x)) * w)  # noqa: E731
    got = jax.grad(loss(lambda x: gather_rows(x, index, inverse)))(x)
    np.testing.assert_array_equal(got, jax.grad(loss(plain))(x))
    hlo = jax.jit(jax.grad(loss(lambda x: gather_rows(x, index, inverse)))).lower(x).as_text()
    assert "scatter" not in hlo and "scatter" in jax.jit(jax.grad(loss(plain))).lower(x).as_text()


def test_pack_puts_each_real_token_in_its_slot_and_zeros_elsewhere():
    mask = jnp.asarray([[0, 1, 1, 1], [1, 1, 0, 0], [0, 0, 1, 1], [0, 1, 1, 1]], jnp.int32)
    start = jnp.asarray([0, 3, 0, 3], jnp.int32)  # groups of 2 rows, 2 buffers of 3 slots
    p = Packing.build(mask, start, groups=2, buffers=2, length=3)
    x = jnp.arange(1, 17, dtype=jnp.float32).reshape(4, 4)
    packed = np.asarray(p.pack(x))
    want = np.array([[2, 3, 4], [5, 6, 0], [11, 12, 0], [14, 15, 16]], np.float32)
    np.testing.assert_array_equal(packed, want)
    np.testing.assert_array_equal(p.segments, [[1, 1, 1], [2, 2, 0], [1, 1, 0], [2, 2, 2]])
    grad = jax.grad(lambda x: jnp.sum(p.pack(x) * jnp.arange(12.0).reshape(4, 3)))(x)
    # each real token's gradient is its slot's weight; padding tokens get none
    np.testing.assert_array_equal(grad, [[0, 0, 1, 2], [3, 4, 0, 0], [0, 0, 6, 7], [0, 9, 10, 11]])
