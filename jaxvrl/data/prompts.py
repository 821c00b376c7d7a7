"""Prompt ids from the checkpoint's chat template (the plain text for a base model without one),
with vision pads expanded per image/video exactly as transformers' Qwen2.5-VL processor does."""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from jaxvrl.data.processor import expand_prompt_qwen3

IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"


def default_tokenizer_path() -> str:
    """Directory of the tokenizer shipped in the package (HF format, loads offline)."""
    return os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "tokenizer"
    )


def special_token_ids(tokenizer) -> dict[str, int]:
    """Ids the model config needs: image/video pad, vision start/end, im_start/im_end, pad, eos.

    Raises if the tokenizer lacks one (a tokenizer without them cannot drive Qwen2.5-VL)."""
    names = {
        "image_token_id": IMAGE_PAD,
        "video_token_id": VIDEO_PAD,
        "vision_start_token_id": VISION_START,
        "vision_end_token_id": VISION_END,
        "im_start_id": "<|im_start|>",
        "im_end_id": "<|im_end|>",
    }
    ids = {}
    for key, tok in names.items():
        ids[key] = _token_id(tokenizer, tok)
        if ids[key] < 0:
            raise ValueError(f"tokenizer has no {tok} token (needed for {key})")
    ids["pad_token_id"] = int(tokenizer.pad_token_id)
    ids["eos_token_id"] = int(tokenizer.eos_token_id)
    return ids


def messages_for(text: str, n_images: int = 0, n_videos: int = 0, system: str | None = None):
    """Chat messages for one user turn: images, then videos, then the text (Qwen's usual
    order); without media the content is the text itself, the form every chat template reads
    (text-only templates such as Qwen2.5's do not read a list of parts)."""
    content = [{"type": "image"}] * n_images + [{"type": "video"}] * n_videos
    content = content + [{"type": "text", "text": text}] if content else text
    msgs = [{"role": "system", "content": system}] if system else []
    return msgs + [{"role": "user", "content": content}]


def expand_vision_pads(
    prompt: str, image_tokens: Sequence[int], video_tokens: Sequence[int] = ()
) -> str:
    """Replace the k-th <|image_pad|> (<|video_pad|>) by image_tokens[k] copies."""
    for pad, counts in ((IMAGE_PAD, image_tokens), (VIDEO_PAD, video_tokens)):
        parts = prompt.split(pad)
        if len(parts) - 1 != len(counts):
            raise ValueError(f"prompt has {len(parts) - 1} {pad} but {len(counts)} inputs")
        out = parts[0]
        for k, rest in zip(counts, parts[1:]):
            out += pad * int(k) + rest
        prompt = out
    return prompt


def vision_token_counts(grid_thw, merge_size: int = 2) -> list[int]:
    """Pad tokens per image/video: t*h*w / merge_size**2 for each row of int[N, 3]."""
    return [int(np.prod(g)) // merge_size**2 for g in np.asarray(grid_thw).reshape(-1, 3)]


def encode_prompt(
    tokenizer,
    text: str,
    image_grid_thw=None,
    video_grid_thw=None,
    system: str | None = None,
    merge_size: int = 2,
    video_timestamps=None,
) -> list[int]:
    """Token ids of the rendered chat prompt (generation prompt appended). video_timestamps:
    per video the seconds of its frame groups, for a family that writes them (Qwen3-VL: each
    frame group its `<t seconds>` text and its own vision span), else None."""
    img = vision_token_counts(image_grid_thw, merge_size) if image_grid_thw is not None else []
    vid = vision_token_counts(video_grid_thw, merge_size) if video_grid_thw is not None else []
    if not getattr(tokenizer, "chat_template", None):
        return plain_prompt(tokenizer, text, system, media=bool(img or vid))
    rendered = tokenizer.apply_chat_template(
        messages_for(text, len(img), len(vid), system),
        tokenize=False,
        add_generation_prompt=True,
    )
    if video_timestamps is not None:
        expanded = expand_prompt_qwen3(
            rendered, image_grid_thw, video_grid_thw, video_timestamps, merge_size
        )
    else:
        expanded = expand_vision_pads(rendered, img, vid)
    return tokenizer(expanded, add_special_tokens=False)["input_ids"]


def plain_prompt(tokenizer, text: str, system: str | None = None, media: bool = False):
    """Token ids of a prompt for a tokenizer without a chat template (a base model): the
    system prompt, a blank line and the text, with the tokenizer's own special tokens (e.g.
    Llama's BOS). The main job says so once when it loads such a tokenizer."""
    if media:
        raise ValueError("the tokenizer has no chat template to place images or videos in")
    return tokenizer(f"{system}\n\n{text}" if system else text)["input_ids"]


def _token_id(tokenizer, token: str) -> int:
    """The id of `token`, or -1 (matches no id) when the tokenizer lacks it (e.g. a Llama
    tokenizer has no Qwen chat or vision tokens)."""
    i = tokenizer.convert_tokens_to_ids(token)
    return -1 if i is None or i == tokenizer.unk_token_id else int(i)


def pool_token_ids(tokenizer) -> dict:
    """Token ids that `attention_pools` needs, read from the tokenizer (-1 for a token it
    lacks: a text-only model's tokenizer has no vision tokens, and its chat turns may be
    marked otherwise than Qwen's `<|im_start|>`)."""
    names = ("<|im_start|>", "<|im_end|>", VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
    ids = {t: _token_id(tokenizer, t) for t in names}
    special = set(tokenizer.all_special_ids) | {i for i in ids.values() if i >= 0}
    return dict(
        im_start_id=ids["<|im_start|>"],
        im_end_id=ids["<|im_end|>"],
        user_header_ids=tokenizer("user\n", add_special_tokens=False)["input_ids"],
        special_ids=sorted(special),
        vision_ids=[ids[IMAGE_PAD], ids[VIDEO_PAD]],
    )
