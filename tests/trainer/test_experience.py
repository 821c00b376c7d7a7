"""The experience phase's no-grad passes against separate plain forwards: old-policy log-probs,
entropies and attention masses on the clean images, log-probs on the perturbed images (run
together as one batch of interleaved rows), the reference pass, in micro-batches."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxvrl.trainer.experience import no_grad_passes
from jaxvrl.trainer.passes import blacken_patches, interleave_rows, unpair_rows
from tests.helpers import N, make_batch, reference_logp, step_config


def _close(actual, desired, rtol=2e-5):
    desired = np.asarray(desired, np.float64)
    atol = rtol * max(float(np.abs(desired).max()), 1e-30)
    np.testing.assert_allclose(np.asarray(actual, np.float64), desired, rtol, atol)


@pytest.mark.parametrize("micro_batches,old_logprobs", [(2, "sampler"), (1, "sampler")])
def test_clean_and_perturbed_passes_equal_separate_forwards(model, micro_batches, old_logprobs):
    # (2, ...): two micro-batches, so the old-policy pass runs before the updates, paired with
    # the perturbed one; (1, "sampler"): one update of one micro-batch needs no old-policy pass
    # before the loss's own, so the perturbed pass runs alone
    graphdef, params = nnx.split(model, nnx.Param)
    batch = make_batch(model, seed=4)
    cfg = step_config(
        {
            "tprl.enable_perception_filtering": True,
            "vgr.enable_token_weights": True,
            "actor.use_kl_loss": True,
            "actor.kl_loss_coef": 0.1,
            "optim.micro_batches": micro_batches,
            "actor.old_logprobs": old_logprobs,
            "rollout.temperature": 0.7,
        }
    )
    rng = jax.random.key(3)
    res = jax.jit(lambda p, b, r: no_grad_passes(graphdef, p, p, b, r, cfg))(params, batch, rng)

    # independent: full logits of each image set's own forward
    aug = blacken_patches(batch.images, rng, cfg.tprl.black_prob)
    assert not np.array_equal(aug.pixel_values, batch.images.pixel_values)
    old, ent = reference_logp(params, graphdef, batch, 0.7)
    perturbed, _ = reference_logp(params, graphdef, batch.replace(images=aug), 0.7)
    _close(res.aug_logp, perturbed)
    _close(res.ref_logp, old)  # the reference policy is the same weights here
    assert np.abs(np.asarray(res.aug_logp) - np.asarray(old)).max() > 1e-3  # images matter
    assert (
        (res.old_logp is not None)
        == cfg.old_pass
        == ((micro_batches, old_logprobs) != (1, "sampler"))
    )
    if not cfg.old_pass:
        return
    _close(res.old_logp, old)
    _close(res.entropy, ent)
    out = nnx.merge(graphdef, params).forward(
        batch.input_ids, batch.attention_mask, batch.position_ids, images=batch.images,
        pools=batch.pools,
    )  # fmt: skip
    _close(res.vision_mass, out.vision_mass[:, :, -N - 1 : -1])
    _close(res.text_mass, out.text_mass[:, :, -N - 1 : -1])


def test_interleaved_rows_come_apart():
    x = jnp.arange(24).reshape(3, 4, 2)  # an array with rows on axis 1
    a, b = unpair_rows(jnp.stack([x, -x], 2).reshape(3, 8, 2), axis=1)
    np.testing.assert_array_equal(a, x)
    np.testing.assert_array_equal(b, -x)


def test_interleave_rows_pairs_every_field(model):  # noqa: F811
    batch = make_batch(model, seed=1)
    other = batch.replace(input_ids=batch.input_ids + 1)
    both = interleave_rows(batch, other)
    assert both.position_ids.shape == (3, 2 * batch.input_ids.shape[0], batch.input_ids.shape[1])
    np.testing.assert_array_equal(both.input_ids[0::2], batch.input_ids)
    np.testing.assert_array_equal(both.input_ids[1::2], other.input_ids)
    np.testing.assert_array_equal(both.position_ids[:, 1::2], batch.position_ids)
    np.testing.assert_array_equal(both.images.pixel_values[1::2], batch.images.pixel_values)
    np.testing.assert_array_equal(both.pools["vision"][0::2], batch.pools["vision"])
