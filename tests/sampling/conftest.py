"""Fixtures shared by the sampler tests."""

import pytest

from jaxvrl.models.qwen2_5_vl import vision


@pytest.fixture
def tower_rows(monkeypatch) -> list:
    """The rows reaching the vision tower, one entry per call traced (programs traced while
    the test runs: make a fresh sampler)."""
    rows = []
    call = vision.VisionTower.window_order  # what every caller of the tower runs

    def counted(self, inputs):
        rows.append(inputs.pixel_values.shape[0])
        return call(self, inputs)

    monkeypatch.setattr(vision.VisionTower, "window_order", counted)
    return rows
