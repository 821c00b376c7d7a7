"""Fixtures shared by the sampler tests."""

import jax
import pytest

from jaxvrl.models import vision


@pytest.fixture
def retrace():
    """`jax.clear_caches`, for a test to call after patching what the sampler's programs trace
    (a form, a kernel): those programs are module-level jits that jax keeps for the whole
    process, so without it a call would run a program traced before the patch. The caches
    are emptied again after the test, so that no later test runs a program traced with it."""
    yield jax.clear_caches
    jax.clear_caches()


@pytest.fixture
def tower_rows(monkeypatch, retrace) -> list:
    """The rows reaching the vision tower, one entry per call traced (programs traced while
    the test runs: jax's caches are emptied first)."""
    rows = []
    call = vision.VisionTower.features  # what every caller of the tower runs

    def counted(self, inputs):
        rows.append(inputs.pixel_values.shape[0])
        return call(self, inputs)

    monkeypatch.setattr(vision.VisionTower, "features", counted)
    retrace()
    return rows
