"""The processor with Qwen3-VL's settings equals transformers' Qwen3-VL processor: images of
several sizes and modes (pixel values, grids), a video's frame sampling, frame size, timestamps
and patches, and the expanded prompt (text and token ids) with images and a video."""

from __future__ import annotations

import dataclasses
import re
import types

import numpy as np
import pytest
from PIL import Image

from jaxvrl.data import processor as P
from jaxvrl.data.prompts import default_tokenizer_path
from jaxvrl.models import qwen3_vl as q3

SETTINGS = q3.processor(q3.Qwen3VLConfig())
SIZE = {"shortest_edge": SETTINGS.min_pixels, "longest_edge": SETTINGS.max_pixels}
VIDEO_SIZE = {"shortest_edge": SETTINGS.video_min_pixels, "longest_edge": SETTINGS.video_max_pixels}


def _hf_images(size=SIZE):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    return Qwen2VLImageProcessorPil(
        patch_size=16, image_mean=[0.5] * 3, image_std=[0.5] * 3, size=dict(size)
    )


def _hf_video(**kw):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    return Qwen3VLVideoProcessor(
        size=dict(VIDEO_SIZE), image_mean=[0.5] * 3, image_std=[0.5] * 3, **kw
    )


@pytest.fixture
def hf_processor(monkeypatch):
    """transformers' Qwen3VLProcessor over the PIL image processor and the repository's
    tokenizer. Its video processor's resize and RGB conversion use torchvision, which is not
    installed beside the pinned CPU torch: the videos come at their final size in RGB (both
    steps off), the class check of the video processor is skipped and torchvision's
    normalize is the plain (x - mean) / std."""
    import torch
    import transformers.image_processing_backends as backends
    from transformers import AutoTokenizer
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    def normalize(x, mean, std, inplace=False):
        shape = (-1, 1, 1)
        return (x - torch.as_tensor(mean).view(shape)) / torch.as_tensor(std).view(shape)

    monkeypatch.setattr(backends, "tvF", types.SimpleNamespace(normalize=normalize), raising=False)
    monkeypatch.setattr(Qwen3VLProcessor, "check_argument_for_proper_class", lambda *a: None)
    tok = AutoTokenizer.from_pretrained(default_tokenizer_path())
    video = _hf_video(do_resize=False, do_convert_rgb=False, cap_pixels_per_frame=False)
    return Qwen3VLProcessor(image_processor=_hf_images(), tokenizer=tok, video_processor=video)


def _image(mode: str, w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 4), dtype=np.uint8), "RGBA").convert(mode)


@pytest.mark.parametrize(
    "mode,size", [("RGB", (31, 29)), ("RGBA", (57, 1003)), ("L", (300, 200)), ("P", (900, 700))]
)
def test_images_equal_hf(mode, size):
    images = [_image(mode, *size, seed=size[0])]
    ref = _hf_images()(images, return_tensors="np")
    pv, grid = P.process_images(images, settings=SETTINGS)
    np.testing.assert_array_equal(grid, ref["image_grid_thw"])
    np.testing.assert_allclose(pv, ref["pixel_values"], atol=1e-5, rtol=0)


def test_pixel_limits_and_explicit_arguments():
    images = [_image("RGB", 700, 500, 0), _image("RGB", 40, 90, 1)]
    small = dataclasses.replace(SETTINGS, min_pixels=32 * 32 * 8, max_pixels=32 * 32 * 40)
    ref = _hf_images({"shortest_edge": 32 * 32 * 8, "longest_edge": 32 * 32 * 40})(
        images, return_tensors="np"
    )
    for pv, grid in (
        P.process_images(images, settings=small),
        P.process_images(images, 32 * 32 * 8, 32 * 32 * 40, settings=SETTINGS),
    ):
        np.testing.assert_array_equal(grid, ref["image_grid_thw"])
        np.testing.assert_allclose(pv, ref["pixel_values"], atol=1e-5, rtol=0)
    # without settings: Qwen2-VL's defaults, as before
    from jaxvrl.models import ProcessorSettings

    a, b = P.process_images(images), P.process_images(images, settings=ProcessorSettings())
    np.testing.assert_array_equal(a[0], b[0])


def test_video_sampling_size_and_timestamps_equal_hf():
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize
    from transformers.video_utils import VideoMetadata

    hf = _hf_video()
    for total, fps in [(21, 3.0), (7, 30.0), (300, 24.0), (5000, 1.0), (2, 2.0)]:
        meta = VideoMetadata(total_num_frames=total, fps=fps)
        idx = P.sample_frame_indices(total, fps)
        np.testing.assert_array_equal(idx, hf.sample_frames(meta))
        want = Qwen3VLProcessor._calculate_timestamps(None, idx, fps, 2)
        assert P.frame_timestamps(idx, fps) == want
    for t, h, w in [(4, 64, 96), (14, 480, 640), (768, 1080, 1920), (3, 20, 700), (2, 5, 5)]:
        lo, hi = SETTINGS.video_min_pixels, SETTINGS.video_max_pixels
        assert P.smart_resize_video(t, h, w, 2, 32, lo, hi) == smart_resize(t, h, w, 2, 32, lo, hi)
    with pytest.raises(ValueError, match="temporal_factor"):
        P.smart_resize_video(1, 64, 64)
    frames = [np.zeros((360, 640, 3), np.uint8)] * 120
    for cap in (False, True):
        pv, grid, _ = P.process_video_qwen3(frames, 30.0, SETTINGS, cap_pixels_per_frame=cap)
        kw = {"cap_pixels_per_frame": cap}
        assert len(pv) == int(np.prod(grid)) == hf.get_num_of_video_patches(8, 360, 640, kw)


def test_prompt_and_inputs_equal_hf_processor(hf_processor):
    rng = np.random.default_rng(0)
    images = [_image("RGB", 70, 50, 1), _image("RGB", 300, 120, 2)]
    frames = rng.integers(0, 256, (21, 64, 96, 3), dtype=np.uint8)  # 3 fps, 64 x 96: kept
    span = "<|vision_start|>{}<|vision_end|>"
    text = (
        "<|im_start|>user\n"
        + span.format("<|image_pad|>")
        + "Look. "
        + span.format("<|video_pad|>")
        + span.format("<|image_pad|>")
        + "What moves?<|im_end|>\n<|im_start|>assistant\n"
    )
    from transformers.video_utils import VideoMetadata

    meta = VideoMetadata(total_num_frames=21, fps=3.0, frames_indices=list(range(21)))
    ref = hf_processor(
        text=[text], images=images, videos=[frames], video_metadata=[meta], return_tensors="np"
    )
    pv, grid = P.process_images(images, settings=SETTINGS)
    vpv, vgrid, seconds = P.process_video_qwen3(list(frames), 3.0, SETTINGS)
    assert vgrid.tolist() == [[7, 4, 6]] and seconds[:2] == pytest.approx([1 / 3, 4 / 3])
    np.testing.assert_array_equal(grid, ref["image_grid_thw"])
    np.testing.assert_allclose(pv, ref["pixel_values"], atol=1e-5, rtol=0)
    np.testing.assert_array_equal(vgrid, ref["video_grid_thw"])
    np.testing.assert_allclose(vpv, ref["pixel_values_videos"], atol=1e-5, rtol=0)
    expanded = P.expand_prompt_qwen3(text, grid, vgrid, [seconds])
    assert "<0.3 seconds><|vision_start|><|video_pad|>" in expanded  # frames 0 and 2 of 14
    tok = hf_processor.tokenizer
    ids = tok(expanded, add_special_tokens=False)["input_ids"]
    np.testing.assert_array_equal(ids, ref["input_ids"][0])
    assert tok.decode(ref["input_ids"][0]) == expanded
    with pytest.raises(ValueError, match=re.escape("2 <|image_pad|> but 1 inputs")):
        P.expand_prompt_qwen3(text, grid[:1], vgrid, [seconds])
