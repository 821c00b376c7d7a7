"""The attention pictures: tracker images (TensorBoard events; a backend that raises is warned
once and skipped), the per-layer heatmap over steps, the coloured tokens, and a run without
matplotlib skipping them with one warning."""

from __future__ import annotations

import glob
import logging

import numpy as np
import pytest

from jaxvrl.logging import RunInfo, Tracker, Trackers, heatmaps, trackers
from jaxvrl.trainer import reporting

IMAGE = np.zeros((8, 12, 3), np.uint8)


def test_trackers_send_images_and_skip_a_failing_backend(tmp_path, monkeypatch, caplog):
    class Broken(Tracker):
        def __init__(self, info):
            pass

        def log_image(self, step, name, image):
            raise RuntimeError("no images here")

    monkeypatch.setitem(trackers.REGISTRY, "broken", Broken)
    t = Trackers(("tensorboard", "broken"), RunInfo(str(tmp_path)), resume=False)
    with caplog.at_level(logging.WARNING):
        t.log_image(1, "attention/sample_0", IMAGE)
        t.log_image(2, "attention/sample_0", IMAGE)
    assert sum("broken" in r.message for r in caplog.records) == 1
    assert list(t.live) == ["tensorboard"]
    t.close()
    from tensorboardX.proto import event_pb2

    (path,) = glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))
    data, at, shapes = open(path, "rb").read(), 0, []
    while at < len(data):
        n = int.from_bytes(data[at : at + 8], "little")
        event = event_pb2.Event.FromString(data[at + 12 : at + 12 + n])
        shapes += [(v.image.height, v.image.width) for v in event.summary.value if v.image.width]
        at += n + 16
    assert shapes == [(8, 12), (8, 12)]


def test_pictures_and_html():
    pytest.importorskip("matplotlib")
    tokens, w = ["<think>", "red", "\n", " A"], np.array([0.2, 3.0, 1.0, 1.0])
    panel = heatmaps.token_panel(tokens, {"VGR weight": w, "entropy": w[::-1]})
    assert panel.dtype == np.uint8 and panel.shape[2] == 3
    text = heatmaps.token_html(tokens, w, "VGR weight")
    assert text.count("<span") == 4 and "&lt;think&gt;" in text and 'title="VGR weight 3"' in text
    image = heatmaps.layers_over_steps([5, 10, 15], {"mdi": np.arange(12.0).reshape(4, 3)})
    assert image.ndim == 3 and image.shape[0] > 50


def test_without_matplotlib_one_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(heatmaps, "available", lambda: False)
    logs = reporting.RunLogs(str(tmp_path), total_steps=2, backends=())
    sample = {"frames": {}, "maps": {}, "tokens": [], "values": {}, "layers": {}}
    with caplog.at_level(logging.WARNING):
        logs.attention_maps(1, [sample], tokenizer=None)
        logs.attention_maps(2, [sample], tokenizer=None)
    assert sum("matplotlib" in r.message for r in caplog.records) == 1
    assert not (tmp_path / "attention").exists()
    logs.close()
