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


TPRL = {
    "tprl.enable_perception_filtering": True,
    "tprl.enable_entropy_filtering": True,
    "tprl.enable_trajectory_reweighting": True,
}
VGR = {"vgr.enable_token_weights": True, "vgr.token_weight_smooth_sigma": 1.0}


@pytest.mark.parametrize("methods", [{**TPRL, **VGR}, VGR], ids=["tprl-vgr", "vgr"])
def test_sampler_shaping_reads_the_samplers_quantities_and_runs_no_clean_pass(model, methods):
    """Token shaping from the sampler's quantities (2 updates): shaping_source=sampler skips
    the clean pass (TPRL with VGR: one forward per micro-batch, the perturbed one; VGR alone:
    none) and shapes from the batch's old_logprobs / old_entropy / attention masses; given
    the recompute pass's values there, the step equals the recompute step."""
    import optax

    from jaxvrl.trainer.step import make_train_step
    from tests.helpers import init_state

    values = {**methods, "actor.ppo_epochs": 2}
    recompute = step_config(dict(values, **{"actor.shaping_source": "recompute"}))
    sampler = step_config(dict(values, **{"actor.shaping_source": "sampler"}))
    assert sampler.sampler_shaping and not recompute.sampler_shaping
    assert sampler.needs_attention
    graphdef, params = nnx.split(model, nnx.Param)
    batch = make_batch(model, seed=5, old_logprobs=np.full((4, N), -2.0, np.float32))
    key = jax.random.key(1)
    passes = no_grad_passes(graphdef, params, None, batch, key, recompute)
    batch = batch.replace(old_logprobs=passes.old_logp, old_entropy=passes.entropy)
    batch = batch.replace(  # the sampler's masses, rows first [B, L, N]
        old_vision_mass=jnp.moveaxis(passes.vision_mass, 0, 1),
        old_text_mass=jnp.moveaxis(passes.text_mass, 0, 1),
    )

    def flops(cfg):  # the experience phase's, as XLA counts them
        fn = jax.jit(lambda b: no_grad_passes(graphdef, params, None, b, key, cfg))
        return fn.lower(batch).compile().cost_analysis().get("flops", 0.0)

    # the clean rows ran paired with the perturbed ones: half the rows now (none without a
    # perturbed pass)
    assert flops(sampler) < (0.6 if sampler.needs_perturbed else 0.01) * flops(recompute)
    got = no_grad_passes(graphdef, params, None, batch, key, sampler)
    np.testing.assert_array_equal(got.old_logp, passes.old_logp)
    if sampler.needs_perturbed:
        np.testing.assert_allclose(got.aug_logp, passes.aug_logp, atol=1e-5)
    np.testing.assert_array_equal(got.vision_mass, passes.vision_mass)
    np.testing.assert_array_equal(got.text_mass, passes.text_mass)
    tx = optax.sgd(0.3)
    outs = [
        make_train_step(graphdef, tx, cfg)(init_state(model, tx), None, batch, key)
        for cfg in (recompute, sampler)
    ]
    (a, ma, _), (b, mb, _) = outs
    for (path, x), (_, y) in zip(nnx.to_flat_state(a.params), nnx.to_flat_state(b.params)):
        np.testing.assert_allclose(x.get_value(), y.get_value(), atol=1e-6, err_msg=str(path))
    names = ["loss", "entropy"]
    if sampler.needs_perturbed:
        names += ["sensitivity_score_mean", "perception_token_fraction"]
    names += [k for k in ma if "token_weight" in k]
    assert any("token_weight" in k for k in ma), sorted(ma)
    for k in names:
        np.testing.assert_allclose(float(mb[k]), float(ma[k]), rtol=1e-5, atol=1e-7, err_msg=k)
    with pytest.raises(ValueError, match="old_entropy"):
        no_grad_passes(graphdef, params, None, batch.replace(old_entropy=None), key, sampler)
    with pytest.raises(ValueError, match="old_vision_mass"):
        no_grad_passes(graphdef, params, None, batch.replace(old_vision_mass=None), key, sampler)
