"""The attention pictures: tracker images (TensorBoard events; a backend that raises is warned
once and skipped), the per-layer heatmap over steps, the coloured tokens, a video's strip, the
reused figures drawing each call's data, and a run without matplotlib skipping them with one
warning."""

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


COLOURS = [(0.8, 0.1, 0.1), (0.1, 0.8, 0.1), (0.1, 0.1, 0.8)]  # a video's 3 frames


def video(planted=(1, 1, 0)):
    """3 frames float[56, 56, 3] of one colour each, and their 2 x 2 merged-patch grids with
    all the mass on `planted` (frame, row, col)."""
    frames = [np.broadcast_to(np.float32(c), (56, 56, 3)) for c in COLOURS]
    grids = [np.zeros((2, 2)) for _ in frames]
    f, y, x = planted
    grids[f][y, x] = 1.0
    return frames, grids


def test_video_strip_data():
    frames, grids = video()
    base, heat = heatmaps.strip(frames), heatmaps.upsample(grids, frames)
    assert base.shape == heat.shape + (3,) == (56, 3 * 56 + 2 * 2, 3)
    for k, f in enumerate(frames):  # side by side, 2 black columns apart
        np.testing.assert_array_equal(base[:, k * 58 : k * 58 + 56], f)
    assert not base[:, 56:58].any() and not base[:, 114:116].any()
    hot = np.zeros_like(heat)
    hot[28:, 58:86] = 1.0  # frame 2's lower-left merged patch
    np.testing.assert_array_equal(heat, hot)


@pytest.mark.parametrize("planted", [1, 2, 0])
def test_video_strip_picture(planted):
    """The drawn overlay of a 3-frame video with the mass on one frame's lower-left patch
    (frame 2 of 3 first): each frame's panel in its own colour under the cold end of the
    colormap, left to right, and the hot end only on that frame's lower-left quarter."""
    pytest.importorskip("matplotlib")
    frames, grids = video((planted, 1, 0))
    picture = heatmaps.attention_overlay(frames, {"clean": {"all": grids}}, "a video")

    def shown(colour, heat):  # pixels of that frame colour under that heat
        want = heatmaps.blend(np.float64(colour)[None, None], np.array([[heat]]))[0, 0] * 255
        return np.all(np.abs(picture.astype(int) - np.round(want)) <= 2, axis=-1)

    cold = [shown(c, 0.0) for c in COLOURS]
    hot = [shown(c, 1.0) for c in COLOURS]
    assert all(m.sum() > 500 for m in cold)  # each frame's panel
    assert [bool(m.any()) for m in hot] == [k == planted for k in range(3)]
    xs = [np.flatnonzero(m.any(0)) for m in cold]
    assert xs[0].max() < xs[1].min() and xs[1].max() < xs[2].min()
    frame = cold[planted] | hot[planted]  # its panel: the hot patch is the lower-left quarter
    rows, cols = np.flatnonzero(frame.any(1)), np.flatnonzero(frame.any(0))
    hy, hx = np.nonzero(hot[planted])
    assert hx.min() - cols.min() <= 2 and hx.max() < (cols.min() + cols.max()) / 2 + 2
    assert rows.max() - hy.max() <= 2 and hy.min() > (rows.min() + rows.max()) / 2 - 2
    assert hot[planted].sum() == pytest.approx(frame.sum() / 4, rel=0.15)


def test_reused_figures_draw_each_call():
    """The figures are kept between calls: an overlay or token panel drawn after others of
    other shapes (other frame sizes, line counts) equals the one a fresh figure draws; the
    per-layer heatmap, laid out once, draws A, B, A as A twice and spans its colormap for B."""
    matplotlib = pytest.importorskip("matplotlib")
    frames, grids = video()
    kept = heatmaps.Figures()  # a run's
    calls = [
        lambda: heatmaps.attention_overlay(frames, {"clean": {"all": grids}}, "a", kept),
        lambda: heatmaps.attention_overlay(
            [np.full((28, 84, 3), 0.5, np.float32)], {"clean": {"all": [np.eye(1, 3)]}}, "", kept
        ),
        lambda: heatmaps.attention_overlay(frames[:1], {"clean": {"all": grids[:1]}}, "c", kept),
        lambda: heatmaps.token_panel(["red"], {"w": np.ones(1)}, figures=kept),
        lambda: heatmaps.token_panel(["token"] * 60, {"w": np.arange(60.0)}, figures=kept),
    ]
    fresh = []
    for call in calls:
        kept.__init__()  # nothing kept: a fresh figure
        fresh.append(call())
    assert len({p.shape for p in fresh}) == len(calls)  # shapes all differ
    for call, picture in zip(calls[::-1] + calls, fresh[::-1] + fresh):
        np.testing.assert_array_equal(call(), picture)
    untitled = heatmaps.attention_overlay(frames, {"clean": {"all": grids}}, figures=kept)
    assert not np.array_equal(untitled, fresh[0])
    m = {"mdi": np.arange(8.0).reshape(4, 2)}
    x = heatmaps.layers_over_steps([5, 10], m, kept)
    y = heatmaps.layers_over_steps([5, 10], {"mdi": 2 * m["mdi"] + 1}, kept)
    np.testing.assert_array_equal(heatmaps.layers_over_steps([5, 10], m, kept), x)
    np.testing.assert_array_equal(heatmaps.layers_over_steps([5, 10], m), x)  # none kept

    def cells(value):  # pixels coloured as `value` of the colormap: one cell's, at each end
        want = np.round(np.array(matplotlib.colormaps[heatmaps.CMAP](value)[:3]) * 255)
        return np.all(np.abs(y.astype(int) - want) <= 1, axis=-1).sum()

    assert cells(0.0) > 500 and cells(1.0) == pytest.approx(cells(0.0), rel=0.2)


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
