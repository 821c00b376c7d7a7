"""The token methods' table: a throwaway token mask, added as one table entry plus one config
key, trains a step and takes effect; the step's settings are the typed values it reads."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from configs import base
from jaxvrl.config import set_values
from jaxvrl.trainer.methods import TOKEN_METHODS, Term
from jaxvrl.trainer.state import StepConfig
from jaxvrl.trainer.step import make_train_step
from tests.helpers import G, init_state, make_batch, metrics_adv


def _first_tokens(cols, opts):
    """1 on the first tprl.first_tokens completion columns, 0 after."""
    k = opts["tprl.first_tokens"]
    return jnp.zeros_like(cols["completion_mask"]).at[:, :k].set(1.0), {}


# what a user adds: one entry ...
FIRST_TOKENS = Term(
    "first_tokens_mask",
    "mask",
    (),
    _first_tokens,
    ("tprl.first_tokens",),
    lambda opts: opts["tprl.first_tokens"] is not None,
)


def _config(first_tokens: int | None, values=None) -> StepConfig:
    c = base.get_config()
    set_values(c, {"rollout.num_generations": G, "actor.loss_agg_mode": "token-mean"})
    set_values(c, values or {})
    c.tprl.first_tokens = first_tokens  # ... and its config key (in configs/base.py for a run)
    return StepConfig.of(c, table=TOKEN_METHODS + (FIRST_TOKENS,))


def _step(model, cfg, batch):
    graphdef, _ = nnx.split(model, nnx.Param)
    tx = optax.sgd(0.5)
    state = init_state(model, tx)
    before = jax.tree.map(np.array, state.params)
    state, metrics, _ = make_train_step(graphdef, tx, cfg)(state, None, batch, jax.random.key(0))
    moved = max(
        float(np.max(np.abs(a.get_value() - b.get_value())))
        for (_, a), (_, b) in zip(
            nnx.to_flat_state(state.params), nnx.to_flat_state(before), strict=True
        )
    )
    return metrics, moved


def test_a_token_mask_added_as_one_entry_takes_effect(model):
    batch = make_batch(model, prompts=1, seed=2)  # G = 2 rows of N = 5 and 1 tokens
    assert [t.name for t in _config(None).terms] == [] and not _config(None).shapes_tokens

    # on, inside the loss pass (one update, one micro-batch): on-policy the ratio is 1 and the
    # token-mean loss is -sum_i A_i (row i's tokens in the mask) / (all completion tokens)
    on = _config(2)
    assert [t.name for t in on.terms] == ["first_tokens_mask"] and on.shaping_in_loss
    metrics, moved = _step(model, on, batch)
    m = np.asarray(batch.completion_mask)
    kept = m[:, :2].sum(1)  # 2 and 1
    want = -(metrics_adv(batch).reshape(-1) * kept).sum() / m.sum()
    assert abs(want) > 0.1  # the full mask's loss would be -(5 A_0 + A_1) / 6
    assert abs(float(metrics["pg_loss"]) - want) < 1e-5, (float(metrics["pg_loss"]), want)
    assert float(metrics["perception_token_fraction"]) == pytest.approx(kept.sum() / m.sum())
    assert moved > 0

    # a mask of zeros (no first token), computed before the updates (two micro-batches): no
    # token enters the loss, nothing moves
    zero = _config(0, {"optim.micro_batches": 2})
    assert zero.old_pass and not zero.shaping_in_loss
    metrics, moved = _step(model, zero, batch)
    assert float(metrics["pg_loss"]) == 0.0 and float(metrics["perception_token_fraction"]) == 0
    assert moved == 0.0


def test_the_step_settings_are_the_typed_values_it_reads():
    both = {"tprl.enable_entropy_filtering": True, "vgr.enable_token_weights": True}
    cfg = _config(3, both)
    assert cfg.option("tprl.first_tokens") == 3
    assert cfg.option("tprl.top_p_entropy_tokens") == 0.2  # a key the table declares
    assert [t.name for t in cfg.terms] == ["entropy_mask", "vgr_weights", "first_tokens_mask"]
    assert cfg.needs_attention and not cfg.needs_perturbed and not cfg.needs_ref
    assert cfg == _config(3, both) and hash(cfg) == hash(_config(3, both))
    two = cfg.with_values({"optim.micro_batches": 2, "tprl.first_tokens": None})
    assert two.micro_batches == 2 and "first_tokens_mask" not in [t.name for t in two.terms]
    assert not hasattr(cfg, "config")  # no ConfigDict behind it
    with pytest.raises(AttributeError):
        cfg.reward  # noqa: B018  (a group the step does not read)
    with pytest.raises(KeyError, match="reads no config key 'reward.funcs'"):
        cfg.with_values({"reward.funcs": ("mc_idx",)})
    c = base.get_config()
    with pytest.raises(KeyError, match="'first_tokens_mask' reads config key"):
        StepConfig.of(c, table=TOKEN_METHODS + (FIRST_TOKENS,))  # the key is not declared


def test_the_perception_masks_metrics_are_the_kept_and_left_tokens_mean_dependency():
    """low_var_kl_mean_selected / _rejected: the mean visual dependency S of the completion
    tokens the perception mask keeps and of those it leaves out (padding in neither)."""
    from jaxvrl.trainer.methods import _perception_mask

    rng = np.random.default_rng(0)
    mask = (np.arange(9)[None] < np.array([[9], [5], [1], [0]])).astype(np.float32)
    score = rng.uniform(0, 3, mask.shape).astype(np.float32)
    cols = {"visual_dependency": jnp.asarray(score), "completion_mask": jnp.asarray(mask)}
    chosen, m = _perception_mask(cols, {"tprl.top_p_perception_tokens": 0.4})
    chosen = np.asarray(chosen)
    keep, leave = chosen * mask > 0, (1 - chosen) * mask > 0
    assert keep.sum() == 4 + 2 + 1 and leave.sum() == 5 + 3  # ceil(n * 0.4) per row
    np.testing.assert_allclose(float(m["low_var_kl_mean_selected"]), score[keep].mean(), rtol=1e-6)
    np.testing.assert_allclose(float(m["low_var_kl_mean_rejected"]), score[leave].mean(), rtol=1e-6)
