"""Qwen2-VL-style image/video processing in numpy + PIL, equal to transformers' PIL image
processor: convert to RGB (alpha composited on white), smart_resize (factor patch x merge),
bicubic resize, rescale 1/255, normalisation, and the (t, h, w) patch layout the vision tower
expects. The sizes, pixel limits and mean/std are Qwen2-VL's (CLIP's mean/std) unless given,
or taken from a family's `ProcessorSettings` (`settings=`).

Qwen3-VL's videos (`process_video_qwen3`): frames sampled at 2 per second, resized by its
video rule (pixel limits over all frames), and a timestamp per group of frames that the prompt
spells out before that group's own vision span (`expand_prompt_qwen3`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image

if TYPE_CHECKING:
    from jaxvrl.models import ProcessorSettings

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
IMAGE_MEAN = np.array(CLIP_MEAN, np.float32)
IMAGE_STD = np.array(CLIP_STD, np.float32)
MIN_PIXELS = 56 * 56
MAX_PIXELS = 28 * 28 * 1280
VIDEO_MIN_PIXELS = 128 * 28 * 28
VIDEO_MAX_PIXELS = 768 * 28 * 28


def _sizes(settings, video: bool = False, **given) -> dict:
    """The processor's settings: each given (not None) value, else `settings`' (a
    ProcessorSettings), else Qwen2-VL's. Keys: min_pixels, max_pixels, patch_size,
    temporal_patch_size, merge_size, mean, std (float32[3])."""
    limits = ("video_min_pixels", "video_max_pixels") if video else ("min_pixels", "max_pixels")
    defaults = dict(
        min_pixels=VIDEO_MIN_PIXELS if video else MIN_PIXELS,
        max_pixels=VIDEO_MAX_PIXELS if video else MAX_PIXELS,
        patch_size=14,
        temporal_patch_size=2,
        merge_size=2,
        mean=CLIP_MEAN,
        std=CLIP_STD,
    )
    if settings is not None:
        defaults.update(
            min_pixels=getattr(settings, limits[0]),
            max_pixels=getattr(settings, limits[1]),
            patch_size=settings.patch_size,
            temporal_patch_size=settings.temporal_patch_size,
            merge_size=settings.merge_size,
            mean=settings.image_mean,
            std=settings.image_std,
        )
    out = {k: v if given.get(k) is None else given[k] for k, v in defaults.items()}
    out["mean"], out["std"] = np.array(out["mean"], np.float32), np.array(out["std"], np.float32)
    return out


def hf_image_processor_config(
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    patch_size: int | None = None,
    *,
    settings: ProcessorSettings | None = None,
    processor_class: str = "Qwen2_5_VLProcessor",
) -> dict:
    """preprocessor_config.json for transformers' Qwen2-VL image processor doing what
    process_images does with these limits (and `settings`)."""
    c = _sizes(settings, min_pixels=min_pixels, max_pixels=max_pixels, patch_size=patch_size)
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": processor_class,
        "min_pixels": c["min_pixels"],
        "max_pixels": c["max_pixels"],
        "patch_size": c["patch_size"],
        "temporal_patch_size": c["temporal_patch_size"],
        "merge_size": c["merge_size"],
        "image_mean": [float(x) for x in c["mean"]],
        "image_std": [float(x) for x in c["std"]],
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


def _normalised(
    image: Image.Image, height: int, width: int, mean=IMAGE_MEAN, std=IMAGE_STD
) -> np.ndarray:
    """float32[C, H, W] after bicubic resize, rescale and normalisation."""
    if image.size != (width, height):
        image = image.resize((width, height), resample=Image.BICUBIC)
    arr = np.asarray(image, dtype=np.float64) * (1 / 255)
    arr = arr.astype(np.float32)
    arr = (arr - mean) / std
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
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    patch_size: int | None = None,
    temporal_patch_size: int | None = None,
    merge_size: int | None = None,
    *,
    settings: ProcessorSettings | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """PIL images or uint8 arrays (any mode) -> (pixel_values float32[sum patches, C*T*P*P],
    image_grid_thw int64[N, 3]). Arguments left None: `settings`' values, else Qwen2-VL's."""
    c = _sizes(
        settings,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        patch_size=patch_size,
        temporal_patch_size=temporal_patch_size,
        merge_size=merge_size,
    )
    tps, ps = c["temporal_patch_size"], c["patch_size"]
    patches, grids = [], []
    for img in images:
        img = to_rgb(img)
        h, w = smart_resize(
            img.height, img.width, ps * c["merge_size"], c["min_pixels"], c["max_pixels"]
        )
        frame = _normalised(img, h, w, c["mean"], c["std"])[None]
        p, grid = patchify(np.repeat(frame, tps, 0), ps, tps, c["merge_size"])
        patches.append(p)
        grids.append(grid)
    if not patches:
        return np.zeros((0, 3 * tps * ps**2), np.float32), np.zeros((0, 3), np.int64)
    return np.concatenate(patches), np.asarray(grids, np.int64)


def process_video(
    frames: Sequence,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    patch_size: int | None = None,
    temporal_patch_size: int | None = None,
    merge_size: int | None = None,
    *,
    settings: ProcessorSettings | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Frames of one video (PIL or uint8 arrays, equal sizes) -> (pixel_values_videos,
    video_grid_thw int64[1, 3]); every frame resized to the first frame's smart size (the
    limits per frame, Qwen2-VL's rule). Arguments left None: `settings`' video values, else
    Qwen2-VL's."""
    c = _sizes(
        settings,
        video=True,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        patch_size=patch_size,
        temporal_patch_size=temporal_patch_size,
        merge_size=merge_size,
    )
    rgb = [to_rgb(f) for f in frames]
    factor = c["patch_size"] * c["merge_size"]
    h, w = smart_resize(rgb[0].height, rgb[0].width, factor, c["min_pixels"], c["max_pixels"])
    stack = np.stack([_normalised(f, h, w, c["mean"], c["std"]) for f in rgb])
    p, grid = patchify(stack, c["patch_size"], c["temporal_patch_size"], c["merge_size"])
    return p, np.asarray([grid], np.int64)


# ---------------------------------------------------------------------- Qwen3-VL videos
def sample_frame_indices(
    total: int, fps: float, sample_fps: float = 2.0, min_frames: int = 4, max_frames: int = 768
) -> np.ndarray:
    """int64[n]: the frames Qwen3-VL's video processor keeps of `total` frames recorded at
    `fps`: int(total / fps * sample_fps) of them, within [min_frames, max_frames] and at most
    `total`, evenly spaced from the first to the last (rounded)."""
    n = int(total / fps * sample_fps)
    n = min(max(n, min_frames), max_frames, total)
    return np.linspace(0, total - 1, n).round().astype(np.int64)


def smart_resize_video(
    num_frames: int,
    height: int,
    width: int,
    temporal_factor: int = 2,
    factor: int = 32,
    min_pixels: int = 128 * 32 * 32,
    max_pixels: int = 768 * 32 * 32,
) -> tuple[int, int]:
    """Qwen3-VL's frame size: multiples of `factor` (sides below it first scaled up), with
    the pixels of all the frames (their count rounded to temporal_factor) within [min_pixels,
    max_pixels] (transformers' `video_processing_qwen3_vl.smart_resize`, incl. its rounding)."""
    if num_frames < temporal_factor:
        raise ValueError(f"t:{num_frames} must be larger than temporal_factor:{temporal_factor}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def frame_timestamps(indices: Sequence[int], fps: float, temporal_patch_size: int = 2):
    """Seconds of each group of `temporal_patch_size` frames: the mean of its first and last
    frame's times (the last index repeated to fill the last group), as Qwen3-VL's processor."""
    idx = [int(i) for i in indices]
    idx += [idx[-1]] * (-len(idx) % temporal_patch_size)
    times = [i / fps for i in idx]
    return [
        (times[i] + times[i + temporal_patch_size - 1]) / 2
        for i in range(0, len(times), temporal_patch_size)
    ]


def process_video_qwen3(
    frames: Sequence,
    fps: float,
    settings: ProcessorSettings,
    *,
    sample_fps: float | None = 2.0,
    min_frames: int = 4,
    max_frames: int = 768,
    cap_pixels_per_frame: bool = False,
    max_video_tokens: int = 768,
) -> tuple[np.ndarray, np.ndarray, list[float]]:
    """All the frames of one video (PIL or uint8 arrays, equal sizes, recorded at `fps`) ->
    (pixel_values_videos float32[t*h*w, C*T*P*P], video_grid_thw int64[1, 3], the timestamp
    in seconds of each of the t frame groups), as transformers' Qwen3-VL video processor:
    frames sampled at `sample_fps` (None: every frame), the size of `smart_resize_video` with
    `settings`' video limits (cap_pixels_per_frame: transformers' per-frame cap of at most
    max_video_tokens merged tokens), PIL's bicubic resize (transformers resizes video tensors
    with torchvision's), rescale, `settings`' mean/std, the patch layout."""
    if sample_fps is None:
        indices = np.arange(len(frames))
    else:
        indices = sample_frame_indices(len(frames), fps, sample_fps, min_frames, max_frames)
    c = _sizes(settings, video=True)
    tps, factor = c["temporal_patch_size"], c["patch_size"] * c["merge_size"]
    rgb = [to_rgb(frames[i]) for i in indices]
    max_pixels = c["max_pixels"]
    if cap_pixels_per_frame:
        per_frame = min(max_video_tokens * factor * factor, max_pixels // len(rgb))
        max_pixels = max(per_frame, int(c["min_pixels"] * 1.05)) * len(rgb)
    h, w = smart_resize_video(
        len(rgb), rgb[0].height, rgb[0].width, tps, factor, c["min_pixels"], max_pixels
    )
    stack = np.stack([_normalised(f, h, w, c["mean"], c["std"]) for f in rgb])
    p, grid = patchify(stack, c["patch_size"], tps, c["merge_size"])
    return p, np.asarray([grid], np.int64), frame_timestamps(indices, fps, tps)


def family_tokens(settings: ProcessorSettings | None) -> ProcessorSettings:
    """The settings whose special tokens a prompt uses: the family's, or (None) the default
    processor's (Qwen's tokens), imported here so that reading rows needs no jax."""
    if settings is not None:
        return settings
    from jaxvrl.models.families import ProcessorSettings as Default

    return Default()


def video_placeholder_qwen3(
    grid_thw,
    timestamps: Sequence[float],
    merge_size: int = 2,
    tokens: ProcessorSettings | None = None,
) -> str:
    """What Qwen3-VL's processor writes for one `<|video_pad|>`: per frame group its
    timestamp (`<1.3 seconds>`) and its own vision span of h*w / merge^2 pad tokens (the
    family's tokens, `tokens`; default the Qwen ones)."""
    tok = family_tokens(tokens)
    t, h, w = (int(x) for x in np.asarray(grid_thw).reshape(3))
    if len(timestamps) != t:
        raise ValueError(f"a video of {t} frame groups has {len(timestamps)} timestamps")
    span = tok.vision_start + tok.video_pad * (h * w // merge_size**2) + tok.vision_end
    return "".join(f"<{s:.1f} seconds>" + span for s in timestamps)


def expand_prompt_qwen3(
    prompt: str,
    image_grid_thw=None,
    video_grid_thw=None,
    video_timestamps: Sequence[Sequence[float]] = (),
    merge_size: int = 2,
    tokens: ProcessorSettings | None = None,
) -> str:
    """A rendered prompt with its k-th `<|image_pad|>` repeated for the k-th image's merged
    tokens and its k-th `<|video_pad|>` replaced by `video_placeholder_qwen3` of the k-th
    video (the chat template's own vision start/end stay around it), as Qwen3VLProcessor;
    the pads are the family's (`tokens`, default the Qwen ones)."""
    tok = family_tokens(tokens)
    images = [] if image_grid_thw is None else np.asarray(image_grid_thw).reshape(-1, 3)
    videos = [] if video_grid_thw is None else np.asarray(video_grid_thw).reshape(-1, 3)
    if len(videos) != len(video_timestamps):
        raise ValueError(f"{len(videos)} videos but {len(video_timestamps)} timestamp lists")
    fills = {
        tok.image_pad: [tok.image_pad * (int(np.prod(g)) // merge_size**2) for g in images],
        tok.video_pad: [
            video_placeholder_qwen3(g, ts, merge_size, tok)
            for g, ts in zip(videos, video_timestamps)
        ],
    }
    for pad, parts_in in fills.items():
        parts = prompt.split(pad)
        if len(parts) - 1 != len(parts_in):
            raise ValueError(f"prompt has {len(parts) - 1} {pad} but {len(parts_in)} inputs")
        prompt = parts[0] + "".join(fill + rest for fill, rest in zip(parts_in, parts[1:]))
    return prompt
