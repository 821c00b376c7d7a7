"""process_images / process_video equal transformers' Qwen2-VL PIL image processor (and its
video patch layout) for any size and mode."""

from __future__ import annotations

import importlib
import sys
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from jaxvrl.data import process_images, process_video, smart_resize

MODES = ["RGB", "L", "RGBA", "P", "P+transparency", "LA", "PA", "CMYK", "1", "I", "I;16", "F"]


def _hf_images(**kw):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    return Qwen2VLImageProcessorPil(**kw)


def _image(mode: str, w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    if mode == "I;16":
        return Image.fromarray(rng.integers(0, 65536, (h, w), dtype=np.uint16))
    if mode == "F":
        return Image.fromarray(rng.random((h, w), dtype=np.float32) * 255)
    rgba = Image.fromarray(rng.integers(0, 256, (h, w, 4), dtype=np.uint8), "RGBA")
    if mode == "P+transparency":  # palette image with a transparent index: composited on white
        img = rgba.convert("RGB").convert("P")
        img.info["transparency"] = 3
        return img
    return rgba.convert(mode)


def _assert_same(images, **kw):
    ref = _hf_images(**kw)(images, return_tensors="np")
    pv, grid = process_images(images, **kw)
    np.testing.assert_array_equal(grid, ref["image_grid_thw"])
    assert pv.dtype == np.float32 and pv.shape == ref["pixel_values"].shape
    np.testing.assert_allclose(pv, ref["pixel_values"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("size", [(31, 29), (57, 1003), (1400, 900)])
def test_images_equal_hf_for_every_mode(mode, size):
    _assert_same([_image(mode, *size, seed=size[0])])


@settings(max_examples=12, deadline=None)
@given(
    w=st.integers(1, 700),
    h=st.integers(1, 700),
    mode=st.sampled_from(["RGB", "L", "RGBA", "P"]),
    seed=st.integers(0, 2**16),
)
def test_images_equal_hf_random_sizes(w, h, mode, seed):
    if max(w, h) / min(w, h) > 200:
        with pytest.raises(ValueError, match="aspect ratio"):
            process_images([_image(mode, w, h, seed)])
        return
    _assert_same([_image(mode, w, h, seed)])


def test_several_images_and_pixel_limits_equal_hf():
    imgs = [_image("RGB", 90, 64, 0), _image("L", 300, 41, 1), _image("RGBA", 28, 28, 2)]
    _assert_same(imgs)
    _assert_same(imgs, min_pixels=28 * 28 * 8, max_pixels=28 * 28 * 20)
    arr = np.asarray(_image("RGB", 45, 77, 3))  # uint8 HWC arrays are accepted like HF
    _assert_same([arr], min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16)


def test_smart_resize_limits():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as ref

    for h, w in [(31, 29), (1, 200), (57, 1003), (1400, 900), (10000, 60), (28, 28)]:
        assert smart_resize(h, w) == ref(h, w, max_pixels=28 * 28 * 1280)
    assert smart_resize(31, 29) == (84, 56)  # below min_pixels: scaled up, rounded up per side
    h, w = smart_resize(4000, 3000, max_pixels=28 * 28 * 256)
    assert h % 28 == w % 28 == 0 and h * w <= 28 * 28 * 256
    with pytest.raises(ValueError, match="aspect ratio must be smaller than 200"):
        smart_resize(28, 5800)
    with pytest.raises(ValueError, match="aspect ratio"):
        process_images([Image.new("RGB", (5000, 20))])


def _hf_video_patchify():
    """transformers' Qwen2-VL video patchify (torch). Its module imports torchvision, which is
    not installed beside the pinned CPU torch; patchify does not use it, so stub the import."""
    import transformers  # noqa: F401 -- resolve transformers' own torchvision probe first

    names = [
        "torchvision",
        "torchvision.transforms",
        "torchvision.transforms.v2",
        "torchvision.transforms.v2.functional",
    ]
    missing = [n for n in names if n not in sys.modules]
    for n in missing:
        sys.modules[n] = types.ModuleType(n)
    try:
        mod = importlib.import_module("transformers.models.qwen2_vl.video_processing_qwen2_vl")
    finally:
        for n in missing:
            sys.modules.pop(n, None)
    return mod.Qwen2VLVideoProcessor.patchify


def _hf_frame(img, min_pixels, max_pixels) -> np.ndarray:
    """One frame through HF's PIL image processor (RGB, resize, rescale, normalise), unpacked
    back from its patch layout to float32[C, H, W]."""
    out = _hf_images(min_pixels=min_pixels, max_pixels=max_pixels)([img], return_tensors="np")
    _, gh, gw = out["image_grid_thw"][0]
    x = out["pixel_values"].reshape(gh // 2, gw // 2, 2, 2, 3, 2, 14, 14)[:, :, :, :, :, 0]
    return x.transpose(4, 0, 2, 5, 1, 3, 6).reshape(3, gh * 14, gw * 14)


@pytest.mark.parametrize("n_frames,size", [(4, (90, 60)), (3, (57, 103)), (1, (200, 150))])
def test_video_equals_hf_frames_and_patch_layout(n_frames, size):
    import torch

    lo, hi = 28 * 28 * 4, 28 * 28 * 64
    frames = [_image("RGB", *size, seed=k) for k in range(n_frames)]
    pv, grid = process_video(frames, min_pixels=lo, max_pixels=hi)
    ref_frames = np.stack([_hf_frame(f, lo, hi) for f in frames])
    ref, t, h, w = _hf_video_patchify()(None, torch.from_numpy(ref_frames)[None], 14, 2, 2)
    assert grid.tolist() == [[t, h, w]]
    assert t == (n_frames + 1) // 2  # odd counts repeat the last frame, like HF
    np.testing.assert_allclose(pv, ref[0].numpy(), atol=1e-5, rtol=0)
