"""The attention diagnostic pass: per-key masses of a query set equal the dense softmax's sums
(numpy), xla and flash alike; a planted attention shows its patch hottest in the heatmap, a
video's in its frame of the strip; the model's forward exposes them per layer; a short VGR
run writes the pictures."""

from __future__ import annotations

import glob
import os
import re
import struct

import numpy as np
import pytest

from jaxvrl.logging import heatmaps
from jaxvrl.models.attention import attend, attend_key_masses
from jaxvrl.trainer.diagnostics import AttentionMaps

B, T, N, K, H = 2, 13, 4, 2, 8


def softmax_sums(q, k, valid, chosen):
    """Independent reference: per key, the heads-mean causal softmax summed over chosen rows."""
    g = q.shape[2] // k.shape[2]
    out = np.zeros(valid.shape)
    for b in range(q.shape[0]):
        for n in range(q.shape[2]):
            logits = q[b, :, n] @ k[b, :, n // g].T * q.shape[-1] ** -0.5
            seen = np.tril(np.ones((q.shape[1],) * 2, bool)) & valid[b][None]
            top = np.where(seen, logits, -np.inf).max(-1, keepdims=True)
            e = np.exp(np.where(seen, logits - np.where(np.isfinite(top), top, 0), -np.inf))
            p = e / np.maximum(e.sum(-1, keepdims=True), 1e-30)
            out[b] += (p * chosen[b][:, None]).sum(0) / q.shape[2]
    return out


@pytest.mark.parametrize("impl", ["xla", "flash"])
def test_key_masses_equal_numpy_softmax_sums(impl):
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=s).astype(np.float32) for s in [(B, T, N, H), *[(B, T, K, H)] * 2])
    valid = np.ones((B, T), bool)
    valid[1, :3] = False  # a left-padded row
    chosen = np.zeros((B, T), bool)
    chosen[:, 8:12] = True
    out, masses = attend_key_masses(
        q, k, v, scale=H**-0.5, key_valid=valid, queries=chosen, implementation=impl, block=4
    )
    np.testing.assert_allclose(masses, softmax_sums(q, k, valid, chosen), atol=1e-6)
    ref, _ = attend(q, k, v, scale=H**-0.5, key_valid=valid, implementation=impl, block_q=4)
    np.testing.assert_allclose(out, ref, atol=1e-6)  # the pass's output is the forward's


@pytest.mark.parametrize("impl", ["xla", "flash"])
def test_planted_attention_heats_its_patch(impl):
    """Prompt: 2 text tokens, a 2 x 3 grid of image tokens, 2 text tokens; completion: 4
    queries whose vector matches image token 4's key: that merged patch is the hottest."""
    rng = np.random.default_rng(1)
    t, first, grid, planted = 12, 2, (2, 3), 4
    q = rng.normal(size=(1, t, N, H)).astype(np.float32) * 0.1
    k = rng.normal(size=(1, t, K, H)).astype(np.float32) * 0.1
    u = np.zeros(H, np.float32)
    u[0] = 1.0
    k[0, first + planted] = 8.0 * u
    q[0, 8:12] = 8.0 * u
    chosen = np.zeros((1, t), bool)
    chosen[0, 8:12] = True
    _, masses = attend_key_masses(
        q, k, k, scale=H**-0.5, key_valid=None, queries=chosen, implementation=impl, block=4
    )
    image = np.asarray(masses[0, first : first + 6])
    (g,) = AttentionMaps.grids(image, [grid])
    assert np.unravel_index(np.argmax(g), grid) == np.unravel_index(planted, grid)
    frames = [np.full((grid[0] * 28, grid[1] * 28, 3), 0.5, np.float32)]
    heat = heatmaps.upsample([g], frames)  # what the overlay draws, one value per pixel
    y, x = np.unravel_index(np.argmax(heat), heat.shape)
    assert (y // 28, x // 28) == np.unravel_index(planted, grid)
    assert heat.max() == 1.0
    pytest.importorskip("matplotlib")
    picture = heatmaps.attention_overlay(frames, {"clean": {"all": [g]}})
    assert picture.dtype == np.uint8 and picture.ndim == 3


def test_video_frames_and_planted_mass_make_a_strip():
    """A video of 3 frames (6 raw frames in temporal pairs), one colour each, through the
    processor and the per-row patch layout (window order): AttentionMaps rebuilds each frame
    from its patches, and a mass planted on the lower-left merged patch of frame 2 (processor
    order: frame, row, col) lands there in the grids and in the strip the overlay draws (a
    smaller one on frame 3 in its place)."""
    from jaxvrl import models
    from jaxvrl.data.processor import process_video
    from jaxvrl.sampling.sampler import row_vision_inputs

    cfg = models.load_config(models.EMBEDDED)
    colours = np.array([[200, 30, 30], [30, 200, 30], [30, 30, 200]], np.uint8)
    raw = [np.full((56, 56, 3), c, np.uint8) for c in colours for _ in range(2)]
    raw[2][28:, :28] = 255  # frame 2's lower-left quarter is white
    raw[3][28:, :28] = 255
    settings = models.processor(cfg)
    pv, grid = process_video(raw, min_pixels=56 * 56, max_pixels=56 * 56, settings=settings)
    ids = np.array([[20, 21] + [cfg.video_token_id] * 12 + [22]])  # 3 frames of 2 x 2
    frames, order = AttentionMaps(None, cfg).frames(
        row_vision_inputs(pv, grid, ids, cfg.video_token_id, cfg), 0
    )
    assert order == [(2, 2)] * 3
    for f, r in zip(frames, raw[::2]):
        np.testing.assert_allclose(f * 255, r, atol=0.5)
    masses = np.random.default_rng(2).uniform(0.0, 0.1, 12)
    masses[1 * 4 + 1 * 2 + 0] = 1.0
    masses[2 * 4 + 0 * 2 + 1] = 0.5  # and half as much on frame 3's upper right: the order
    grids = AttentionMaps.grids(masses, order)
    assert grids[0].max() < 0.1 and grids[1][1, 0] == 1.0 and grids[2][0, 1] == 0.5
    heat = heatmaps.upsample(grids, frames)
    assert heat.shape == (56, 3 * 56 + 2 * 2)
    y, x = np.unravel_index(np.argmax(heat), heat.shape)
    assert (x // 58, y // 28, x % 58 // 28) == (1, 1, 0)  # frame 2, its lower-left patch
    assert np.all(heat[28:, 58:86] == 1.0) and np.all(heat[:28, 144:172] == 0.5)
    np.testing.assert_array_equal(heatmaps.strip(frames)[:, 58:114], frames[1])


def test_forward_returns_per_layer_key_masses():
    """The embedded model's forward with key_queries: float32[L, B, T], each layer's masses
    summing to the number of queries (probabilities), equal for xla and flash."""
    from jaxvrl import models

    model = models.load(models.EMBEDDED)
    cfg = model.config
    ids = np.array([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14]], np.int32)
    mask = np.ones_like(ids)
    pos = np.broadcast_to(np.arange(ids.shape[1]), (3, 1, ids.shape[1])).astype(np.int32)
    queries = np.zeros(ids.shape, bool)
    queries[0, 6:] = True
    got = {}
    for impl in ("xla", "flash"):
        model.set_attention(impl, block=4)
        out = model.forward(ids, mask, pos, key_queries=queries, return_logits=False)
        assert out.text_mass is None
        got[impl] = np.asarray(out.vision_mass)
    assert got["xla"].shape == (cfg.text.num_hidden_layers, 1, ids.shape[1])
    np.testing.assert_allclose(got["xla"].sum(-1), 4.0, rtol=1e-5)
    np.testing.assert_allclose(got["flash"], got["xla"], atol=1e-5)


def _tb_images(workdir) -> dict:
    """{tag: PNG bytes} of the image summaries in the run's TensorBoard event files."""
    from tensorboardX.proto import event_pb2

    found = {}
    for path in glob.glob(os.path.join(workdir, "tb", "events.out.tfevents.*")):
        data = open(path, "rb").read()
        at = 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            event = event_pb2.Event.FromString(data[at + 12 : at + 12 + length])
            at += 12 + length + 4
            for value in event.summary.value:
                if value.HasField("image"):
                    found[value.tag] = value.image.encoded_image_string
    return found


def test_vgr_run_writes_heatmaps(tmp_path, monkeypatch):
    """A 2-step VGR run draws both logged steps; the diagnostic passes run the programs
    compiled beside the train step (`AttentionMaps.prepare`), whose outputs equal jit's."""
    pytest.importorskip("matplotlib")
    from PIL import Image

    from jaxvrl.train import run
    from jaxvrl.trainer import diagnostics
    from tests.trainer.test_train import tiny_config

    prepared, original = [], AttentionMaps._run

    def checked(self, params, rows, images):
        got = original(self, params, rows, images)
        program = self.programs.get(("_pass", diagnostics._shapes(params, rows, images)))
        prepared.append(program is not None and program.done())
        pooled = self._pooled(rows)  # the per-layer statistics' pass, compiled beside it too
        pool_key = ("_pool_pass", diagnostics._shapes(params, pooled))
        prepared.append(pool_key in self.programs)
        want = diagnostics._pass(self.graphdef, params, rows, images)
        for a, b in zip(got, want):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
        return got

    monkeypatch.setattr(AttentionMaps, "_run", checked)

    cfg = tiny_config(
        "configs/vgr.py",
        tmp_path,
        "total_steps=2",
        "val_freq=0",
        "val_before_train=False",
        "logging.attention_samples=2",
    )
    run(cfg)
    assert prepared and all(prepared)  # (a step whose groups all were filtered draws none)
    images = _tb_images(tmp_path)
    assert "attention/sample_0" in images and "attention/layers_over_steps" in images
    assert "attention/sample_0_tokens" in images  # the VGR weights and entropies
    for png in images.values():
        Image.open(__import__("io").BytesIO(png)).verify()
    text = (tmp_path / "attention_diagnostics.md").read_text()
    links = re.findall(r"!\[[^]]*\]\(([^)]+\.png)\)", text)
    assert links
    for rel in links:  # a token panel of a filtered sample (no VGR weights) is one block high
        with Image.open(tmp_path / rel) as im:
            assert im.size[0] > 50 and im.size[1] > (30 if "_tokens" in rel else 50)
    assert (tmp_path / "attention" / "layers_over_steps.png").exists()
    assert '<span title="VGR weight' in (tmp_path / "token_weights.md").read_text()


def test_per_layer_statistics_are_the_runs_statistics_one_layer_at_a_time(model):
    """attention/layers.jsonl's per-layer MDI and AEI: each completion token's pool masses of
    that layer (renormalised over the prompt, as the train step's passes compute them),
    averaged over the completion (numpy); the pools of the batch, or made from the tokenizer's
    ids where it has none. The embedded 4-layer model's last layer is MDI's late band. Before,
    they were ratios of raw key masses over every non-vision prompt token."""
    import jax
    from flax import nnx

    from jaxvrl import rl
    from jaxvrl.trainer.passes import completion_hidden
    from tests.helpers import make_batch
    from tests.models import hf_tiny as T

    batch = make_batch(model, host=True)
    graphdef, params = nnx.split(model)
    layers = model.config.text.num_hidden_layers
    maps = AttentionMaps(graphdef, model.config, pool_tokens=T.POOL_IDS)
    got = maps.layer_balance(params, batch, layers)
    _, out = jax.jit(lambda m, b: completion_hidden(m, b, pools=True))(model, batch)
    a_v, a_x = np.asarray(out.vision_mass, np.float64), np.asarray(out.text_mass, np.float64)
    m = np.asarray(batch.completion_mask) > 0
    nv, nx = (np.asarray(batch.pools[k]).sum(-1) for k in ("vision", "text"))
    mean = lambda a: (a * m).sum(-1) / m.sum(-1)  # noqa: E731 -- over each row's completion
    mdi = (mean(a_x) / nx) / (mean(a_v) / nv + 1e-6)
    aei = (mean(a_v) / (mean(a_v) + mean(a_x))) / (nv / (nv + nx))
    np.testing.assert_allclose(got["mdi"], mdi, rtol=1e-5)
    np.testing.assert_allclose(got["aei_vision"], aei, rtol=1e-5)
    late = rl.attention_metrics(out.vision_mass, out.text_mass, nv, nx, batch.completion_mask)
    np.testing.assert_allclose(got["mdi"][-1], late["mdi_late"], rtol=1e-5)
    # a batch without pools: made from the token ids, the same
    made = maps.layer_balance(params, batch.replace(pools=None), layers)
    np.testing.assert_allclose(made["mdi"], got["mdi"], rtol=1e-6)
