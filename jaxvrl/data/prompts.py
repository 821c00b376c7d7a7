"""Prompt ids from the checkpoint's chat template (the plain text for a base model without one),
with vision pads expanded per image/video exactly as transformers' Qwen2.5-VL processor does.

A prompt is a text (one user turn) or a list of chat messages ({"role", "content"}: verl's
`prompt` column). `<image>` / `<video>` in its text place each image / video at its
placeholder, in order (EasyR1's and verl's datasets do the same); without placeholders the
media come first, then the text. `format_prompt` (an EasyR1-style Jinja template rendered
with `content`) rewrites the last user turn's text before the placeholders are read.
"""

from __future__ import annotations

import os
import re
import weakref
from collections.abc import Sequence

import numpy as np

from jaxvrl.data.processor import expand_prompt_qwen3, family_tokens

PLACEHOLDERS = re.compile(r"(<image>|<video>)")
PART = {"<image>": "image", "<video>": "video"}


class PlaceholderMismatch(ValueError):
    """A prompt whose `<image>` / `<video>` placeholders do not match the row's media."""


def default_tokenizer_path() -> str:
    """Directory of the tokenizer shipped in the package (HF format, loads offline)."""
    return os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "tokenizer"
    )


def special_token_ids(tokenizer, tokens=None) -> dict[str, int]:
    """Ids the model config needs: image/video pad, vision start/end (the family's tokens,
    `tokens`: its ProcessorSettings, default Qwen's), im_start/im_end, pad, eos.

    Raises if the tokenizer lacks one (a tokenizer without them cannot drive Qwen2.5-VL)."""
    tok = family_tokens(tokens)
    names = {
        "image_token_id": tok.image_pad,
        "video_token_id": tok.video_pad,
        "vision_start_token_id": tok.vision_start,
        "vision_end_token_id": tok.vision_end,
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


def prompt_template(text: str):
    """The compiled `format_prompt` template (sandboxed Jinja, as transformers renders chat
    templates; stripped first, as EasyR1 reads its files). Raises jinja2's TemplateError.
    Compiled per row (well under a millisecond, beside the row's image processing)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    return ImmutableSandboxedEnvironment().from_string(text.strip())


def chat_messages(prompt, system: str | None = None, format_prompt: str | None = None):
    """A row's prompt (a text, or a list of {"role", "content"} messages) as messages: the
    system prompt first where the row has none of its own; `format_prompt` renders the last
    user turn's text as `content`. Raises ValueError for a prompt of neither form."""
    if isinstance(prompt, str):
        msgs = [{"role": "user", "content": prompt}]
    elif is_chat(prompt):
        msgs = [{"role": m["role"], "content": m["content"]} for m in prompt]
    else:
        raise ValueError("a prompt is a text or a list of {'role', 'content'} messages")
    if format_prompt:
        users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
        if users:  # a list of parts is read as its text with a placeholder per medium
            text = content_text(msgs[users[-1]]["content"])
            msgs[users[-1]]["content"] = prompt_template(format_prompt).render(content=text)
    if system and not any(m["role"] == "system" for m in msgs):
        msgs = [{"role": "system", "content": system}, *msgs]
    return msgs


def is_chat(prompt) -> bool:
    """Whether a row's prompt is a list of {"role", "content"} messages (verl's and TRL's
    conversational prompts)."""
    return (
        isinstance(prompt, list | tuple)
        and bool(prompt)
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m
                for m in prompt)
    )  # fmt: skip


# content part types that name an image or a video (OpenAI-style messages among them)
MEDIA_TYPES = {"image": "image", "image_url": "image", "input_image": "image", "video": "video",
               "video_url": "video"}  # fmt: skip


def content_parts(content) -> list[dict]:
    """A message's content as a list of parts: None is none; a text, a number or a part of a
    list given as a bare string is a text part; a dict without a type is text when it holds
    "text"; media part types are named as the chat templates read them ("image", "video")."""
    if content is None:
        return []
    if not isinstance(content, list | tuple):
        content = [content]
    parts = []
    for part in content:
        if not isinstance(part, dict):
            part = {"type": "text", "text": "" if part is None else str(part)}
        kind = part.get("type") or ("text" if "text" in part else None)
        kind = MEDIA_TYPES.get(kind, kind)
        parts.append({"type": "text", "text": str(part.get("text") or "")} if kind == "text"
                     else {"type": kind})  # fmt: skip
    return parts


def content_text(content) -> str:
    """A message's content as text with `<image>` / `<video>` where its media parts are."""
    out = []
    for p in content_parts(content):
        out.append(p["text"] if p["type"] == "text" else f"<{p['type']}>")
    return "".join(out)


def _parts(content) -> list[dict]:
    """A message's content as parts, its text split at the placeholders (empty text dropped,
    as EasyR1 and verl do)."""
    parts = []
    for part in content_parts(content):
        if part["type"] != "text":
            parts.append(part)
            continue
        for piece in PLACEHOLDERS.split(part["text"]):
            if piece in PART:
                parts.append({"type": PART[piece]})
            elif piece:
                parts.append({"type": "text", "text": piece})
    return parts


def place_media(messages: list[dict], n_images: int = 0, n_videos: int = 0) -> list[dict]:
    """Messages with each image / video part where its placeholder is (in order). Without any
    placeholder the media go first in the first user turn, images then videos (Qwen's usual
    order); a message without media keeps its text as a plain string (text-only chat templates
    read no list of parts). Raises PlaceholderMismatch when placeholders and media disagree."""
    split = [_parts(m["content"]) for m in messages]
    count = {k: sum(p["type"] == k for parts in split for p in parts) for k in ("image", "video")}
    if count["image"] or count["video"]:
        wrong = [
            f"{count[k]} <{k}> for {n} {k}s"
            for k, n in (("image", n_images), ("video", n_videos))
            if count[k] != n
        ]
        if wrong:
            raise PlaceholderMismatch(" and ".join(wrong))
    elif n_images or n_videos:
        first = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
        if first is None:
            raise PlaceholderMismatch("images or videos, and no user turn to put them in")
        media = [{"type": "image"}] * n_images + [{"type": "video"}] * n_videos
        split[first] = media + split[first]
    out = []
    for m, parts in zip(messages, split):
        if all(p["type"] == "text" for p in parts):
            content = (
                m["content"] if isinstance(m["content"], str) else "".join(p["text"] for p in parts)
            )
        else:
            content = parts
        out.append({"role": m["role"], "content": content})
    return out


def render_prompt(
    tokenizer,
    prompt,
    n_images: int = 0,
    n_videos: int = 0,
    system: str | None = None,
    format_prompt: str | None = None,
    placeholders: bool = True,
    template_kwargs: dict | None = None,
) -> str:
    """The prompt as the chat template writes it (generation prompt appended), one vision span
    (`<|vision_start|><|image_pad|><|vision_end|>`) per medium, before the pads are expanded.
    A tokenizer without a chat template (a base model) gets the plain text: the system
    prompt, a blank line and the text (its ids then carry the tokenizer's own special tokens,
    e.g. Llama's BOS; the main job says so once when it loads such a tokenizer). placeholders:
    read `<image>` / `<video>` (False: a text-only model, whose prompts keep them as text,
    and whose turns given as lists of parts are read as their text: text-only chat templates
    read no list of parts). template_kwargs: the chat template's keyword arguments (e.g.
    Qwen3's enable_thinking). Raises PlaceholderMismatch (`place_media`)."""
    msgs = chat_messages(prompt, system, format_prompt)
    if placeholders:
        msgs = place_media(msgs, n_images, n_videos)
    else:
        msgs = [{"role": m["role"], "content": content_text(m["content"])} for m in msgs]
    if not getattr(tokenizer, "chat_template", None):
        if n_images or n_videos:
            raise ValueError("the tokenizer has no chat template to place images or videos in")
        return "\n\n".join(_text(m["content"]) for m in msgs)
    return tokenizer.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True, **(template_kwargs or {})
    )


def _text(content) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.get("text") or "" for p in content if p.get("type") == "text")


def expand_vision_pads(
    prompt: str, image_tokens: Sequence[int], video_tokens: Sequence[int] = (), tokens=None
) -> str:
    """Replace the k-th <|image_pad|> (<|video_pad|>) by image_tokens[k] copies (the family's
    pads, `tokens`: its ProcessorSettings, default Qwen's)."""
    tok = family_tokens(tokens)
    for pad, counts in ((tok.image_pad, image_tokens), (tok.video_pad, video_tokens)):
        parts = prompt.split(pad)
        if len(parts) - 1 != len(counts):
            raise ValueError(f"prompt has {len(parts) - 1} {pad} but {len(counts)} inputs")
        out = parts[0]
        for k, rest in zip(counts, parts[1:]):
            out += pad * int(k) + rest
        prompt = out
    return prompt


def shown_prompt(tokenizer, ids, tokens=None) -> str:
    """Prompt ids as text for a reader: special tokens kept, each run of vision pads written
    once with its length (`<|vision_start|><|image_pad|>x64<|vision_end|>`; the family's
    pads, `tokens`, default Qwen's)."""
    text = tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)
    tok = family_tokens(tokens)
    for pad in (tok.image_pad, tok.video_pad):
        run = re.compile(f"(?:{re.escape(pad)})+")
        text = run.sub(lambda m, pad=pad: f"{pad}x{len(m.group()) // len(pad)}", text)
    return text


def vision_token_counts(grid_thw, merge_size: int = 2) -> list[int]:
    """Pad tokens per image/video: t*h*w / merge_size**2 for each row of int[N, 3]."""
    return [int(np.prod(g)) // merge_size**2 for g in np.asarray(grid_thw).reshape(-1, 3)]


def encode_prompt(
    tokenizer,
    text,
    image_grid_thw=None,
    video_grid_thw=None,
    system: str | None = None,
    merge_size: int = 2,
    video_timestamps=None,
    format_prompt: str | None = None,
) -> list[int]:
    """Token ids of the rendered chat prompt (generation prompt appended) of `text` (a text or
    a list of messages; `<image>` / `<video>` placeholders place the media, `render_prompt`).
    video_timestamps: per video the seconds of its frame groups, for a family that writes
    them (Qwen3-VL: each frame group its `<t seconds>` text and its own vision span), else
    None."""
    n_img = 0 if image_grid_thw is None else len(np.asarray(image_grid_thw).reshape(-1, 3))
    n_vid = 0 if video_grid_thw is None else len(np.asarray(video_grid_thw).reshape(-1, 3))
    rendered = render_prompt(tokenizer, text, n_img, n_vid, system, format_prompt)
    return encode_rendered(
        tokenizer, rendered, image_grid_thw, video_grid_thw, merge_size, video_timestamps
    )


def encode_rendered(
    tokenizer,
    rendered: str,
    image_grid_thw=None,
    video_grid_thw=None,
    merge_size: int = 2,
    video_timestamps=None,
    tokens=None,
) -> list[int]:
    """Token ids of a prompt `render_prompt` wrote, each vision span's pad expanded to its
    image's (video's) merged tokens (`encode_prompt`'s arguments; tokens: the family's
    ProcessorSettings, whose pads the template wrote, default Qwen's)."""
    if not getattr(tokenizer, "chat_template", None):
        return tokenizer(rendered)["input_ids"]  # the plain prompt: the tokenizer's own BOS
    img = vision_token_counts(image_grid_thw, merge_size) if image_grid_thw is not None else []
    vid = vision_token_counts(video_grid_thw, merge_size) if video_grid_thw is not None else []
    if video_timestamps is not None:
        expanded = expand_prompt_qwen3(
            rendered, image_grid_thw, video_grid_thw, video_timestamps, merge_size, tokens
        )
    else:
        expanded = expand_vision_pads(rendered, img, vid, tokens)
    return tokenizer(expanded, add_special_tokens=False)["input_ids"]


def _token_id(tokenizer, token: str) -> int:
    """The id of `token`, or -1 (matches no id) when the tokenizer lacks it (e.g. a Llama
    tokenizer has no Qwen chat or vision tokens)."""
    i = tokenizer.convert_tokens_to_ids(token)
    return -1 if i is None or i == tokenizer.unk_token_id else int(i)


_POOL_IDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def pool_token_ids(tokenizer, tokens=None) -> dict:
    """Token ids that `attention_pools` needs, read from the tokenizer (-1 for a token it
    lacks: a text-only model's tokenizer has no vision tokens, and its chat turns may be
    marked otherwise than Qwen's `<|im_start|>`); the vision tokens are the family's
    (`tokens`: its ProcessorSettings, default Qwen's). Read once per tokenizer and family."""
    per_tokenizer = _POOL_IDS.setdefault(tokenizer, {})
    if tokens not in per_tokenizer:
        per_tokenizer[tokens] = _read_pool_token_ids(tokenizer, tokens)
    return per_tokenizer[tokens]


def _read_pool_token_ids(tokenizer, tokens) -> dict:
    tok = family_tokens(tokens)
    vision = (tok.vision_start, tok.vision_end, tok.image_pad, tok.video_pad)
    names = ("<|im_start|>", "<|im_end|>", *vision)
    ids = {t: _token_id(tokenizer, t) for t in names}
    special = set(tokenizer.all_special_ids) | {i for i in ids.values() if i >= 0}
    header = tokenizer("user\n", add_special_tokens=False)["input_ids"]
    return dict(
        im_start_id=ids["<|im_start|>"],
        im_end_id=ids["<|im_end|>"],
        user_header_ids=header,
        special_ids=sorted(special),
        vision_ids=[ids[tok.image_pad], ids[tok.video_pad]],
        header_breaks=_header_breaks(tokenizer, header),
    )


def _header_breaks(tokenizer, header: list[int]) -> list[int]:
    """The tokens the user header's line break becomes when the user's text starts with line
    breaks of its own (a tokenizer that merges "\n\n" into one token)."""
    out = set()
    for extra in ("\n", "\n\n", "\n\n\n", "\r\n", "\n ", "\n\t"):
        ids = tokenizer("user\n" + extra + "x", add_special_tokens=False)["input_ids"]
        if len(ids) > len(header) and ids[: len(header) - 1] == header[:-1]:
            out.add(ids[len(header) - 1])
    return sorted(out)
