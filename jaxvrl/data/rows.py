"""Rows -> encoded examples (prompt ids + vision patches), with bad-row accounting.

Row format: `problem` (or `prompt`) text, or `prompt` as a list of chat messages (verl's
layout); `<image>` / `<video>` in the text place each medium at its placeholder
(`jaxvrl.data.prompts`); `images`: a list of images, each a path (relative to
`image_dir`, which may be a `gs://` URL), raw bytes, base64 text (or a `data:` URI), a
{"bytes": ..., "path": ...} dict (HF datasets' Image feature) or a PIL image; optional
`videos`: a list of videos, each a list of frames in the same forms, sampled at
`EncodeOptions.video_fps`; `label_idx` (with `choices`) for multiple choice, or `answer` /
`solution`, else verl's `reward_model.ground_truth`. `image` / `video` are read where
`images` / `videos` are unset (TRL's datasets name a single image so). Other columns (verl's
`data_source`, `extra_info`, ...) ride along to the rewards. A dataset laid out otherwise is
read through `jaxvrl.data.columns` (column keys, a format hook).

Bad rows (missing or corrupt image, image side over `max_image_side` or an aspect ratio
over 200, prompt over `max_prompt_length` tokens, missing prompt or label, placeholders that
do not match the media, a video file instead of frames, a format hook that failed on the row,
anything else a row holds that cannot be encoded) never raise: they are counted per reason in
`SkipStats`, and the first row of each reason is logged with its file and row index.
"""

from __future__ import annotations

import base64
import binascii
import collections
import dataclasses
import io
import json
import logging
import os
import threading

import numpy as np
from PIL import Image

from jaxvrl.config import ConfigError
from jaxvrl.data.processor import process_images, process_video, process_video_qwen3
from jaxvrl.data.prompts import (
    PlaceholderMismatch,
    content_parts,
    encode_rendered,
    render_prompt,
)
from jaxvrl.models import ProcessorSettings
from jaxvrl.remote import is_remote, read_bytes

log = logging.getLogger(__name__)

REASONS = (
    "missing_prompt",
    "missing_label",
    "missing_image",
    "corrupt_image",
    "oversized_image",
    "prompt_too_long",
    "media_for_text_model",
    "placeholder_mismatch",
    "video_file",
    "format_error",
    "bad_row",
)
# a row that `config.data.format` could not map: {SKIP: (reason, detail)} (columns.RowMapper)
SKIP = "_skip"
VIDEO_FILES = (".mp4", ".avi", ".mov", ".mkv", ".webm", ".flv", ".m4v", ".mpeg", ".mpg")
LABELS = ("label_idx", "answer", "solution")
NESTED_LABEL = ("reward_model", "ground_truth")  # verl's parquet layout


class DataError(ValueError):
    """A data file that cannot be read at all (fails at start, naming the file and line)."""


def checkpoint_json_key(directory: str, name: str, key: str):
    """`key` of the JSON file `name` in a checkpoint directory (generation_config.json,
    chat_template.json); None where the file or the key is absent. A file that cannot be
    read is a ConfigError naming it (the model's, as config.json's)."""
    file = os.path.join(directory, name)
    if not os.path.isfile(file):
        return None
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f).get(key)
    except (OSError, ValueError, AttributeError) as e:
        raise ConfigError(f"{file}: cannot be read ({e})") from None


def load_tokenizer(path: str):
    """transformers' AutoTokenizer of a checkpoint directory, with the chat template its
    processor keeps where the tokenizer has none (`chat_template.json`: transformers'
    processors read it, its tokenizers do not)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if getattr(tokenizer, "chat_template", None):
        return tokenizer
    template = checkpoint_json_key(path, "chat_template.json", "chat_template")
    if isinstance(template, str) and template:
        tokenizer.chat_template = template
    return tokenizer


@dataclasses.dataclass
class SkipStats:
    """Rows skipped per reason. `counts[reason]` counts distinct rows: a row seen again in a
    later epoch (or re-read after a resume) is not counted twice. Thread-safe (grain may
    encode rows in reader threads)."""

    counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    seen: dict = dataclasses.field(default_factory=dict)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def skip(self, reason: str, where: str, detail: str = "") -> None:
        with self._lock:
            rows = self.seen.setdefault(reason, set())
            if where in rows:
                return
            rows.add(where)
            first = not self.counts[reason]
            self.counts[reason] += 1
        if first:
            log.warning(
                "skipping %s (%s)%s; further rows like it are only counted",
                where,
                reason,
                f": {detail}" if detail else "",
            )

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def state(self) -> dict[str, list[str]]:
        """{reason: the rows skipped for it}, JSON for the checkpoint (a resumed run counts on
        from these and still counts each row once)."""
        with self._lock:
            return {r: sorted(rows) for r, rows in self.seen.items() if rows}

    def set_state(self, state: dict[str, list[str]]) -> None:
        """Continue from `state()` (replaces the counts so far)."""
        with self._lock:
            self.seen = {r: set(rows) for r, rows in state.items()}
            self.counts = collections.Counter({r: len(rows) for r, rows in self.seen.items()})

    def report(self) -> dict[str, int]:
        """{reason: count} for every reason (zeros included), for logs and metrics."""
        return {r: int(self.counts.get(r, 0)) for r in REASONS} | dict(self.counts)


def load_image(ref, image_dir: str | None) -> Image.Image:
    """A PIL image from a path (relative to `image_dir`; local, a `file://` URI or a URL such
    as gs://), bytes, base64 text, a `data:` URI, a dict with "bytes"/"path" (HF datasets'
    Image feature) or with "image" (verl's and qwen-vl-utils' form: any of these, or a PIL
    image). A string is a path when that file exists, else base64 when it decodes as such.
    Raises FileNotFoundError or a decode error."""
    in_bytes_field = isinstance(ref, dict) and bool(ref.get("bytes"))
    if isinstance(ref, dict):
        ref = ref.get("bytes") or ref.get("path") or ref.get("image")
    if isinstance(ref, Image.Image):
        return ref
    if ref is None:
        raise FileNotFoundError("image reference is empty")
    guessed = None  # the path a string names when it was taken for base64 instead
    if isinstance(ref, str):
        ref, guessed = _str_image(ref, image_dir)
    if not isinstance(ref, bytes | bytearray):
        img = Image.open(ref)
    elif guessed is None or in_bytes_field:
        img = Image.open(io.BytesIO(ref))
    else:
        try:
            img = Image.open(io.BytesIO(ref))
        except Image.UnidentifiedImageError:  # a missing path that happens to be base64
            raise FileNotFoundError(f"{guessed} not found (nor base64 image data)") from None
    img.load()
    return img


def _str_image(ref: str, image_dir: str | None) -> tuple[bytes | str, str | None]:
    """(the bytes or the local path that a string names, the path it names when taken for
    base64). An existing file wins over base64 (JSON cannot hold bytes, so embedded images
    arrive as base64 text)."""
    if ref.startswith("data:") and "," in ref:
        return base64.b64decode(ref.split(",", 1)[1]), None
    if ref.startswith("file://"):  # a local file's URI (qwen-vl-utils' form)
        ref = ref[len("file://") :]
    path = _resolve(ref, image_dir)
    if is_remote(path):
        try:
            return read_bytes(path), None
        except FileNotFoundError:
            data = _base64(ref)
            if data is None:
                raise FileNotFoundError(f"{path} not found") from None
            return data, path
    if len(path) < 4096 and os.path.exists(path):
        return path, None
    data = _base64(ref)
    return (path, None) if data is None else (data, path)  # a missing path: Image.open names it


def _base64(text: str) -> bytes | None:
    try:  # line breaks allowed: base64 tools wrap at 76 columns
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        return None


def _resolve(path: str, image_dir: str | None) -> str:
    if image_dir is None or os.path.isabs(path) or is_remote(path):
        return path
    if is_remote(image_dir):
        return f"{image_dir.rstrip('/')}/{path}"
    return os.path.join(image_dir, path)


@dataclasses.dataclass(frozen=True)
class EncodeOptions:
    """How rows become examples: `processor` is the model family's image/video processor
    (patch, merge and temporal sizes); the pixel limits are its `min_pixels`/`max_pixels`."""

    processor: ProcessorSettings | None = ProcessorSettings()  # None: a text-only model
    image_dir: str | None = None
    max_prompt_length: int = 512
    max_image_side: int = 1024
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 256
    video_min_pixels: int | None = None  # a video's frames; None: the processor's limits
    video_max_pixels: int | None = None
    system_prompt: str | None = None  # for rows without a system message of their own
    format_prompt: str | None = None  # a Jinja template of the prompt text (`content`)
    # keyword arguments of the chat template, e.g. (("enable_thinking", False),)
    chat_template_kwargs: tuple = ()
    require_label: bool = True
    video_fps: float = 2.0  # frames per second of the videos' frame lists

    def __post_init__(self):
        if not self.video_fps > 0:
            raise ValueError(f"video_fps must be positive, got {self.video_fps}")


def no_label(value) -> bool:
    """Whether a label column's value is missing: None or NaN (a missing number in a pandas
    or parquet column)."""
    return value is None or (isinstance(value, float | np.floating) and bool(np.isnan(value)))


def row_label(row: dict):
    """The row's label: `label_idx`, else `answer`, else `solution`, else
    `reward_model.ground_truth` (None when absent; `no_label` values are absent)."""
    for key in LABELS:
        if not no_label(row.get(key)):
            return row[key]
    nested = row.get(NESTED_LABEL[0])
    label = nested.get(NESTED_LABEL[1]) if isinstance(nested, dict) else None
    return None if no_label(label) else label


def media_list(value) -> list:
    """A row's images: a list of them, or one image (a path, bytes, base64 text, a
    {"bytes", "path"} dict, a PIL image); None = none."""
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]


def _one_video(value) -> bool:
    return isinstance(value, list | tuple) or (isinstance(value, dict) and "video" in value)


def video_lists(value) -> list[list]:
    """A row's videos as frame lists: a list of videos (each a list of frames, or verl's
    {"video": frames or a file} dict), or one video (a list of frames, or a single
    reference); None = none."""
    value = media_list(value)
    if value and all(_one_video(v) for v in value):
        videos = [v["video"] if isinstance(v, dict) else v for v in value]
        return [list(v) if isinstance(v, list | tuple) else [v] for v in videos]
    return [value] if value else []


# the columns a row's media are read from, in order: the first that is set (TRL's datasets
# name a single image `image`)
IMAGE_COLUMNS, VIDEO_COLUMNS = ("images", "image"), ("videos", "video")


def _media_column(row: dict, columns) -> str | None:
    return next((c for c in columns if row.get(c) is not None), None)


def row_media(row: dict) -> tuple[list, list[list]]:
    """The row's images and videos (`media_list`, `video_lists`) from `images` (else `image`)
    and `videos` (else `video`)."""
    images, videos = _media_column(row, IMAGE_COLUMNS), _media_column(row, VIDEO_COLUMNS)
    return (
        media_list(row[images]) if images else [],
        video_lists(row[videos]) if videos else [],
    )


def _load_all(refs, opts: EncodeOptions, stats: SkipStats, where: str):
    """PIL images for `refs`, or None after recording why the row is skipped."""
    try:
        images = [load_image(r, opts.image_dir) for r in refs]
    except FileNotFoundError as e:
        stats.skip("missing_image", where, str(e))
        return None
    except Exception as e:  # noqa: BLE001 -- any decoder error means a corrupt image
        stats.skip("corrupt_image", where, f"{type(e).__name__}: {e}")
        return None
    if any(max(im.size) > opts.max_image_side for im in images):
        sizes = [im.size for im in images]
        stats.skip("oversized_image", where, f"sizes {sizes}, max side {opts.max_image_side}")
        return None
    return images


def encode_row(row: dict, tokenizer, opts: EncodeOptions, where: str, stats: SkipStats):
    """One row -> example dict, or None when the row is bad (recorded in `stats`).

    The example keeps the row's own keys (minus image/video payloads) and adds:
    prompt_ids list[int], pixel_values float32[n_patches, 1176], image_grid_thw int64[n_img, 3],
    pixel_values_videos float32[n_video_patches, 1176], video_grid_thw int64[n_vid, 3],
    second_per_grid_ts float32[n_vid] (seconds per temporal patch of 2 frames: 2 / video_fps,
    the step of the videos' temporal positions as in HF's processor), `problem` (the prompt's
    text: the last user turn of a list of messages), `prompt_text` (the prompt as the chat
    template renders it, one vision span per medium, before the pads are expanded),
    `image_refs` (the row's images as given, for `load_image`) and, for a label found only in
    `reward_model.ground_truth`, `answer`.
    """
    if SKIP in row:  # the format hook failed on it
        reason, detail = row[SKIP]
        stats.skip(reason, where, detail)
        return None
    try:
        return _encode(row, tokenizer, opts, where, stats)
    except Exception as e:  # noqa: BLE001 -- one bad row never ends the run: counted, logged
        stats.skip("bad_row", where, f"{type(e).__name__}: {e}")
        return None


def _encode(row: dict, tokenizer, opts: EncodeOptions, where: str, stats: SkipStats):
    """`encode_row` without its catch-all."""
    prompt = row.get("problem") or row.get("prompt")  # a null or empty problem: the prompt
    if not prompt or not isinstance(prompt, str | list | tuple):
        stats.skip("missing_prompt", where, "no prompt text")
        return None
    messages = not isinstance(prompt, str) and all(isinstance(m, dict) for m in prompt)
    if messages and not any(
        p["type"] != "text" or p["text"].strip()
        for m in prompt
        for p in content_parts(m.get("content"))
    ):
        stats.skip("missing_prompt", where, "messages without content")
        return None
    label = row_label(row)
    if opts.require_label and label is None:
        stats.skip("missing_label", where, "no label")
        return None
    refs, video_refs = row_media(row)
    if opts.processor is None and (refs or video_refs):
        stats.skip("media_for_text_model", where, "images or videos, and the model is text-only")
        return None
    files = [
        r for f in video_refs for r in f if isinstance(r, str) and r.lower().endswith(VIDEO_FILES)
    ]
    if files:  # frames are read, video files are not decoded
        detail = f"{files[0]}: video files are not decoded; give each video as a list of frames"
        stats.skip("video_file", where, detail + " (sampled at data.video_fps)")
        return None
    if any(not frames for frames in video_refs):
        stats.skip("missing_image", where, "a video without frames")
        return None
    vision = opts.processor is not None
    try:
        rendered = render_prompt(
            tokenizer,
            prompt,
            *(len(refs), len(video_refs), opts.system_prompt, opts.format_prompt, vision),
            template_kwargs=dict(opts.chat_template_kwargs),
        )
    except PlaceholderMismatch as e:
        stats.skip("placeholder_mismatch", where, str(e))
        return None
    except ValueError as e:  # a list that is not chat messages
        stats.skip("missing_prompt", where, str(e))
        return None
    media = _encode_media(refs, video_refs, opts, stats, where)
    if media is None:
        return None
    try:
        ids = encode_rendered(
            tokenizer,
            rendered,
            media["image_grid_thw"] if refs else None,
            media["video_grid_thw"] if video_refs else None,
            (opts.processor or ProcessorSettings()).merge_size,
            media.pop("timestamps"),
            opts.processor,
        )
    except ValueError as e:  # the text holds the model's own vision pad tokens
        stats.skip("placeholder_mismatch", where, str(e))
        return None
    if len(ids) > opts.max_prompt_length:
        stats.skip("prompt_too_long", where, f"{len(ids)} > {opts.max_prompt_length} tokens")
        return None
    payload = (_media_column(row, IMAGE_COLUMNS), _media_column(row, VIDEO_COLUMNS))
    out = {k: v for k, v in row.items() if k not in ("images", "videos", *payload)}
    out.update(media, prompt_ids=ids, problem=_question(prompt))
    out.update(prompt_text=rendered, image_refs=refs)
    if label is not None and all(row.get(k) is None for k in LABELS):
        out["answer"] = label  # what the rewards read as the label
    return out


def _question(prompt) -> str:
    """The prompt's text: itself, or the last user turn's text of a list of messages."""
    if isinstance(prompt, str):
        return prompt
    users = [m.get("content") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
    parts = content_parts(users[-1] if users else "")
    return "".join(p["text"] for p in parts if p["type"] == "text")


def _encode_media(refs, video_refs, opts: EncodeOptions, stats: SkipStats, where: str):
    """The row's images and videos loaded and processed -> {pixel_values, image_grid_thw,
    pixel_values_videos, video_grid_thw, second_per_grid_ts, timestamps (per video its frame
    groups' seconds, for a family that writes them, else None)}, or None when the row is bad."""
    images = _load_all(refs, opts, stats, where)
    if images is None:
        return None
    videos = []
    for frames in video_refs:
        loaded = _load_all(frames, opts, stats, where)
        if loaded is None:
            return None
        videos.append(loaded)
    proc = opts.processor or ProcessorSettings()  # None (text-only): the empty arrays' width
    vproc = dataclasses.replace(
        proc,
        video_min_pixels=opts.video_min_pixels or proc.video_min_pixels,
        video_max_pixels=opts.video_max_pixels or proc.video_max_pixels,
    )
    stamps = None
    try:  # the resize refuses an aspect ratio over 200 (as transformers' processors do)
        pv, grid = process_images(images, opts.min_pixels, opts.max_pixels, settings=proc)
        if proc.video_timestamps:  # every frame of the row's list, timed by video_fps
            vids = [process_video_qwen3(v, opts.video_fps, vproc, sample_fps=None) for v in videos]
            stamps = [v[2] for v in vids]
        else:
            vids = [process_video(v, settings=vproc) for v in videos]
    except ValueError as e:  # e.g. a 1-frame video for a family that needs 2: not counted here
        if "aspect ratio" not in str(e):
            raise
        sizes = [im.size for im in images] + [v[0].size for v in videos]
        stats.skip("oversized_image", where, f"{e} (sizes {sizes})")
        return None
    vpv = np.concatenate([v[0] for v in vids]) if vids else np.zeros((0, pv.shape[1]), np.float32)
    vgrid = np.concatenate([v[1] for v in vids]) if vids else np.zeros((0, 3), np.int64)
    seconds = np.full((len(vids),), proc.temporal_patch_size / opts.video_fps, np.float32)
    return dict(
        pixel_values=pv,
        image_grid_thw=grid,
        pixel_values_videos=vpv,
        video_grid_thw=vgrid,
        second_per_grid_ts=seconds,
        timestamps=stamps,
    )


def encode_rows(
    rows, tokenizer, opts: EncodeOptions, source: str = "data", stats: SkipStats | None = None
) -> tuple[list[dict], SkipStats]:
    """Encode rows eagerly (prompt ids, patches); bad rows go to `stats`, never raise."""
    stats = stats or SkipStats()
    out = []
    for i, row in enumerate(rows):
        ex = encode_row(row, tokenizer, opts, row.get("_where", f"{source} row {i}"), stats)
        if ex is not None:
            out.append(ex)
    return out, stats
