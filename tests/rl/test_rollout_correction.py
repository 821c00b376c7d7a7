"""Rollout correction (docs/algorithms.md#old-log-probs-and-rollout-importance-sampling-correction):
the truncated importance weights, IcePop's band and their metrics against a numpy formula
written out token by token; the band's config rules and the missing sampler log-probs."""

from __future__ import annotations

import math
import os

import jax
import numpy as np
import pytest

from jaxvrl import rl
from jaxvrl.config import ConfigError, load_config
from jaxvrl.trainer.experience import _old_logprobs
from jaxvrl.trainer.state import StepConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LENGTHS = (7, 5, 3, 1, 0, 6)  # completion tokens per row; row 4 is empty


def _batch(seed=0):
    """(old, sampler, mask) float32[6, 7]: differences ~ N(0, 0.5^2) on completion tokens,
    large garbage on padding (the mask must hide it)."""
    rng = np.random.default_rng(seed)
    shape = (len(LENGTHS), 7)
    mask = (np.arange(shape[1])[None] < np.array(LENGTHS)[:, None]).astype(np.int32)
    old = rng.uniform(-4.0, -0.1, shape).astype(np.float32)
    diff = np.where(mask > 0, 0.5 * rng.standard_normal(shape), 9.0)
    return old, (old - diff).astype(np.float32), mask


def _expected(old, sampler, mask, level, threshold, band):
    """(weights, clip_frac, band_frac) token by token in float64."""
    rows, cols = mask.shape
    w = np.zeros((rows, cols))
    clipped = masked = tokens = 0
    for i in range(rows):
        real = [t for t in range(cols) if mask[i, t] > 0]
        row_log = sum(float(old[i, t]) - float(sampler[i, t]) for t in real)
        for t in real:
            tokens += 1
            log_r = row_log if level == "sequence" else float(old[i, t]) - float(sampler[i, t])
            r = math.exp(log_r)
            if level is None:
                weight = 1.0
            else:
                weight = min(r, threshold)
                clipped += r > threshold
            if band is not None and not band[0] <= r <= band[1]:
                weight = 0.0
                masked += 1
            w[i, t] = weight
    return w, clipped / tokens, masked / tokens


CASES = [  # (level, threshold, band)
    ("token", 2.0, None),
    ("token", 1.2, None),
    ("token", 1.2, (0.7, 1.3)),
    ("sequence", 2.0, None),
    ("sequence", 1.5, (0.5, 2.0)),
    (None, 2.0, (0.8, 1.25)),
]


@pytest.mark.parametrize("level, threshold, band", CASES)
def test_weights_and_metrics_equal_the_formula(level, threshold, band):
    old, sampler, mask = _batch()
    w, m = rl.rollout_correction(old, sampler, mask, level, threshold, band)
    want, clip_frac, band_frac = _expected(old, sampler, mask, level, threshold, band)
    np.testing.assert_allclose(np.asarray(w), want, rtol=1e-5, atol=1e-7)
    real = mask > 0
    np.testing.assert_allclose(float(m["rollout_is_mean"]), want[real].mean(), rtol=1e-5)
    np.testing.assert_allclose(float(m["is_weight_mean"]), want[real].mean(), rtol=1e-5)
    np.testing.assert_allclose(float(m["rollout_is_clip_frac"]), clip_frac, rtol=1e-6)
    if level is not None:  # the data truncate some tokens and keep others
        assert 0 < clip_frac < 1
    if band is None:
        assert "rollout_is_band_frac" not in m
    else:
        assert 0 < band_frac < 1
        np.testing.assert_allclose(float(m["rollout_is_band_frac"]), band_frac, rtol=1e-6)
    np.testing.assert_allclose(
        float(m["logprob_abs_diff_max"]), np.abs(old - sampler)[real].max(), rtol=1e-6
    )


def test_no_level_and_no_band_gives_no_weights():
    old, sampler, mask = _batch()
    w, m = rl.rollout_correction(old, sampler, mask, None, 2.0, None)
    assert w is None and not any(k.startswith("rollout_is_") for k in m)


def test_jitted_equals_the_formula():
    old, sampler, mask = _batch(seed=1)
    band = (0.5, 2.0)
    fn = jax.jit(rl.rollout_correction, static_argnums=(3, 4, 5))
    w, m = fn(old, sampler, mask, "sequence", 1.5, band)
    want, clip_frac, band_frac = _expected(old, sampler, mask, "sequence", 1.5, band)
    np.testing.assert_allclose(np.asarray(w), want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(m["rollout_is_clip_frac"]), clip_frac, rtol=1e-6)
    np.testing.assert_allclose(float(m["rollout_is_band_frac"]), band_frac, rtol=1e-6)


RECOMPUTE = "actor.old_logprobs=recompute"


@pytest.mark.parametrize(
    "band, why",
    [
        ("(2.0, 0.5)", "low < high"),
        ("(1.0, 1.0)", "low < high"),
        ("(0.5, 1.0, 2.0)", "2 values"),
        ("(0.5,)", "2 values"),
        ("(0.0, 2.0)", "> 0"),
        ("(-0.5, 2.0)", "> 0"),
    ],
)
def test_a_bad_band_is_refused_naming_the_key(band, why):
    with pytest.raises(ConfigError) as e:
        load_config(
            os.path.join(ROOT, "configs/grpo.py"), [RECOMPUTE, f"algorithm.rollout_is_band={band}"]
        )
    text = str(e.value)
    assert "\n" not in text and text.startswith("config.algorithm.rollout_is_band=")
    assert why in text


def test_the_band_needs_recompute_and_the_samplers_log_probs():
    with pytest.raises(ConfigError, match=r"config\.algorithm\.rollout_is_band=.*recompute"):
        load_config(os.path.join(ROOT, "configs/grpo.py"), ["algorithm.rollout_is_band=(0.5, 2.0)"])
    c = load_config(
        os.path.join(ROOT, "configs/grpo.py"), [RECOMPUTE, "algorithm.rollout_is_band=(0.5, 2.0)"]
    )
    cfg = StepConfig.of(c)
    assert cfg.algorithm.rollout_is_band == (0.5, 2.0) and cfg.algorithm.rollout_is is None
    batch = type("Batch", (), {"old_logprobs": None})()
    with pytest.raises(ValueError, match=r"no sampler log-probs.*rollout_is_band"):
        _old_logprobs(batch, None, cfg, {})
