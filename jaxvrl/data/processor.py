"""Qwen2-VL image/video processing in numpy + PIL, equal to transformers' PIL image processor:
convert to RGB (alpha composited on white), smart_resize (factor 28), bicubic resize, rescale
1/255, CLIP normalisation, and the (t, h, w) patch layout the vision tower expects."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from PIL import Image

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
IMAGE_MEAN = np.array(CLIP_MEAN, np.float32)
IMAGE_STD = np.array(CLIP_STD, np.float32)
MIN_PIXELS = 56 * 56
MAX_PIXELS = 28 * 28 * 1280


def hf_image_processor_config(
    min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS, patch_size: int = 14
) -> dict:
    """preprocessor_config.json for transformers' Qwen2-VL image processor doing what
    process_images does with these limits."""
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor",
        "min_pixels": min_pixels,
        "max_pixels": max_pixels,
        "patch_size": patch_size,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": list(CLIP_MEAN),
        "image_std": list(CLIP_STD),
    }


def smart_resize(
    height: int,
    width: int,
    factor: int = 28,
    min_pixels: int = MIN_PIXELS,
    max_pixels: int = MAX_PIXELS,
) -> tuple[int, int]:
    """Target (height, width): multiples of `factor`, area within [min_pixels, max_pixels],
    aspect ratio kept as closely as possible (HF's rule, incl. its rounding)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def to_rgb(image) -> Image.Image:
    """PIL RGB image; transparency is composited on white like transformers' convert_to_rgb."""
    if isinstance(image, np.ndarray):
        image = Image.fromarray(image)
    if image.mode == "RGB":
        return image
    # transformers' rule: composite only when the mode has an alpha band or a transparency key
    if "A" not in image.getbands() and image.info.get("transparency") is None:
        return image.convert("RGB")
    rgba = image.convert("RGBA")
    background = Image.new("RGBA", rgba.size, (255, 255, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")


def _normalised(image: Image.Image, height: int, width: int) -> np.ndarray:
    """float32[C, H, W] after bicubic resize, rescale and normalisation."""
    if image.size != (width, height):
        image = image.resize((width, height), resample=Image.BICUBIC)
    arr = np.asarray(image, dtype=np.float64) * (1 / 255)
    arr = arr.astype(np.float32)
    arr = (arr - IMAGE_MEAN) / IMAGE_STD
    return arr.transpose(2, 0, 1)


def patchify(
    frames: np.ndarray, patch_size: int = 14, temporal_patch_size: int = 2, merge_size: int = 2
) -> tuple[np.ndarray, tuple[int, int, int]]:
    """frames float32[T, C, H, W] -> (patches float32[t*h*w, C*tps*P*P], (t, h, w)); T is
    padded to a multiple of temporal_patch_size by repeating the last frame."""
    if frames.shape[0] % temporal_patch_size:
        pad = temporal_patch_size - frames.shape[0] % temporal_patch_size
        frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
    t, c, h, w = frames.shape
    gt, gh, gw = t // temporal_patch_size, h // patch_size, w // patch_size
    x = frames.reshape(
        gt,
        temporal_patch_size,
        c,
        gh // merge_size,
        merge_size,
        patch_size,
        gw // merge_size,
        merge_size,
        patch_size,
    )
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gt * gh * gw, c * temporal_patch_size * patch_size**2), (gt, gh, gw)


def process_images(
    images: Sequence,
    min_pixels: int = MIN_PIXELS,
    max_pixels: int = MAX_PIXELS,
    patch_size: int = 14,
    temporal_patch_size: int = 2,
    merge_size: int = 2,
) -> tuple[np.ndarray, np.ndarray]:
    """PIL images or uint8 arrays (any mode) -> (pixel_values float32[sum patches, C*T*P*P],
    image_grid_thw int64[N, 3])."""
    patches, grids = [], []
    factor = patch_size * merge_size
    for img in images:
        img = to_rgb(img)
        h, w = smart_resize(img.height, img.width, factor, min_pixels, max_pixels)
        frame = _normalised(img, h, w)[None]
        p, grid = patchify(
            np.repeat(frame, temporal_patch_size, 0), patch_size, temporal_patch_size, merge_size
        )
        patches.append(p)
        grids.append(grid)
    if not patches:
        return np.zeros((0, 3 * temporal_patch_size * patch_size**2), np.float32), np.zeros(
            (0, 3), np.int64
        )
    return np.concatenate(patches), np.asarray(grids, np.int64)


def process_video(
    frames: Sequence,
    min_pixels: int = 128 * 28 * 28,
    max_pixels: int = 768 * 28 * 28,
    patch_size: int = 14,
    temporal_patch_size: int = 2,
    merge_size: int = 2,
) -> tuple[np.ndarray, np.ndarray]:
    """Frames of one video (PIL or uint8 arrays, equal sizes) -> (pixel_values_videos,
    video_grid_thw int64[1, 3]); every frame resized to the first frame's smart size."""
    rgb = [to_rgb(f) for f in frames]
    h, w = smart_resize(
        rgb[0].height, rgb[0].width, patch_size * merge_size, min_pixels, max_pixels
    )
    stack = np.stack([_normalised(f, h, w) for f in rgb])
    p, grid = patchify(stack, patch_size, temporal_patch_size, merge_size)
    return p, np.asarray([grid], np.int64)
