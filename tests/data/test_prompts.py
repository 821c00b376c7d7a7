"""Prompt ids from the shipped tokenizer's chat template equal transformers' Qwen2.5-VL
processor + apply_chat_template for the same messages."""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest
from PIL import Image

from jaxvrl.data import encode_prompt, process_images, process_video

TEXT = "What is shown? A. red B. green"


class _VideoGrids:
    """Stands in for transformers' video processor (torchvision is not installed): it returns
    the grids of our own `process_video`, whose layout test_processor checks against HF."""

    merge_size, temporal_patch_size = 2, 2

    def __call__(self, videos, **kwargs):
        grids = np.concatenate([process_video(v, min_pixels=28 * 28 * 4)[1] for v in videos])
        meta = [types.SimpleNamespace(sampled_fps=2.0) for _ in videos]
        return {"video_grid_thw": grids, "video_metadata": meta}


def _hf_processor(tokenizer):
    from transformers import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    class Processor(Qwen2_5_VLProcessor):
        def __init__(self, tokenizer):  # ProcessorMixin.__init__ type-checks the video processor
            self.image_processor = Qwen2VLImageProcessorPil()
            self.video_processor = _VideoGrids()
            self.tokenizer = tokenizer
            self.chat_template = tokenizer.chat_template
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)

    return Processor(tokenizer)


def _images():
    rng = np.random.default_rng(0)
    sizes = [(60, 90, 3), (200, 120, 3)]
    return [Image.fromarray(rng.integers(0, 256, s, dtype=np.uint8)) for s in sizes]


def _video():
    rng = np.random.default_rng(1)
    return [Image.fromarray(rng.integers(0, 256, (56, 84, 3), dtype=np.uint8)) for _ in range(3)]


@pytest.mark.parametrize(
    "n_images,n_videos,system",
    [(0, 0, None), (1, 0, None), (2, 0, None), (2, 0, "Be brief."), (0, 1, None), (1, 1, "sys")],
)
def test_prompt_ids_equal_hf_processor(tokenizer, n_images, n_videos, system):
    proc = _hf_processor(tokenizer)
    images, videos = _images()[:n_images], [_video()] * n_videos
    content = [{"type": "image"}] * n_images + [{"type": "video"}] * n_videos
    msgs = [{"role": "user", "content": content + [{"type": "text", "text": TEXT}]}]
    if system:
        msgs = [{"role": "system", "content": system}] + msgs
    text = proc.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    ref = proc(text=[text], images=images or None, videos=videos or None, return_tensors="np")

    _, grid = process_images(images)
    vgrid = (
        np.concatenate([process_video(v, min_pixels=28 * 28 * 4)[1] for v in videos])
        if videos
        else None
    )
    ours = encode_prompt(tokenizer, TEXT, grid if images else None, vgrid, system=system)
    assert ours == ref["input_ids"][0].tolist()
    ids = np.asarray(ours)
    n_pad = int(np.prod(grid, axis=-1).sum()) // 4 if images else 0
    assert (ids == tokenizer.convert_tokens_to_ids("<|image_pad|>")).sum() == n_pad
    if system is None:
        assert tokenizer.decode(ours).startswith("<|im_start|>system\nYou are a helpful assistant.")


def test_pad_count_mismatch_is_an_error(tokenizer):
    from jaxvrl.data.prompts import expand_vision_pads

    with pytest.raises(ValueError, match="1 <\\|image_pad\\|> but 2 inputs"):
        expand_vision_pads("<|image_pad|>", [4, 4])


def test_the_vision_tokens_are_the_familys():
    """A family whose processor names other vision tokens: its pads are the ones expanded
    (and Qwen's are left alone), its video spans use its start and end."""
    import dataclasses

    from jaxvrl.data.processor import video_placeholder_qwen3
    from jaxvrl.data.prompts import expand_vision_pads
    from jaxvrl.models import ProcessorSettings

    own = dataclasses.replace(
        ProcessorSettings(), image_pad="<img>", video_pad="<vid>", vision_start="[", vision_end="]"
    )
    text = "a <img> b <vid> c <|image_pad|>"
    assert (
        expand_vision_pads(text, [2], [3], own) == "a <img><img> b <vid><vid><vid> c <|image_pad|>"
    )
    assert video_placeholder_qwen3([2, 2, 2], [0.5, 1.5], 2, own) == (
        "<0.5 seconds>[<vid>]<1.5 seconds>[<vid>]"
    )


def test_a_tokenizer_without_a_chat_template_gets_the_plain_prompt(tokenizer):
    """A base model's tokenizer (no chat template): the system prompt, a blank line and the
    text, with the tokenizer's own special tokens."""
    import copy

    base = copy.deepcopy(tokenizer)
    base.chat_template = None
    ids = [encode_prompt(base, TEXT, system=s) for s in (None, "Be brief.")]
    assert ids[0] == base(TEXT)["input_ids"]
    assert ids[1] == base("Be brief.\n\n" + TEXT)["input_ids"]
    assert ids[0] != encode_prompt(tokenizer, TEXT)  # the chat template's differs
    with pytest.raises(ValueError, match="no chat template"):
        encode_prompt(base, TEXT, image_grid_thw=np.array([[1, 4, 4]]))


def test_a_text_only_prompt_renders_the_same_as_a_list_of_parts(tokenizer):
    """Without media the user turn's content is the text itself (text-only chat templates read
    no list of parts); the shipped template renders both forms alike."""
    from jaxvrl.data.prompts import messages_for

    as_text = messages_for(TEXT, system="sys")
    as_parts = [as_text[0], {"role": "user", "content": [{"type": "text", "text": TEXT}]}]
    assert as_text[1]["content"] == TEXT
    render = lambda m: tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
    assert render(as_text) == render(as_parts)


def test_pools_of_a_tokenizer_without_qwens_chat_and_vision_tokens():
    """A tokenizer lacking <|im_start|> and the vision tokens (a Llama's): the ids it lacks are
    -1, so no pool is built from them and nothing raises."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from jaxvrl.data.prompts import pool_token_ids
    from jaxvrl.models import attention_pools

    vocab = {"<unk>": 0, "<s>": 1, "a": 2, "b": 3, "user": 4, "\n": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>")
    ids = pool_token_ids(fast)
    assert ids["im_start_id"] == ids["im_end_id"] == -1 and ids["vision_ids"] == [-1, -1]
    assert ids["special_ids"] == [0, 1]
    pools = attention_pools(np.array([[1, 2, 3, 2]]), np.ones((1, 4), int), 3, **ids)
    assert not pools["vision"].any() and not pools["text"].any()
    assert pools["prompt"].tolist() == [[False, True, True, False]]


def test_the_text_pool_holds_a_user_text_that_starts_with_a_line_break(tmp_path):
    """Qwen's tokenizers merge "\\n\\n" into one token: a user text starting with "\\n" merges
    with the header's line break ("user", "\\n\\n", ...), and the turn must still be found (it
    was left out of the text pool: no statistics for the row)."""
    import json
    import os
    import shutil

    from transformers import AutoTokenizer

    from jaxvrl.data import default_tokenizer_path
    from jaxvrl.data.prompts import pool_token_ids, render_prompt
    from jaxvrl.models import attention_pools

    src = default_tokenizer_path()
    for name in os.listdir(src):
        shutil.copy(os.path.join(src, name), tmp_path / name)
    spec = json.load(open(tmp_path / "tokenizer.json"))
    vocab = spec["model"]["vocab"]
    vocab["ĊĊ"] = 1000  # an id no token has
    merges = spec["model"]["merges"]
    merges.append(["Ċ", "Ċ"] if merges and isinstance(merges[0], list) else "Ċ Ċ")
    qwen2 = (  # Qwen2's pre-tokenizer: a run of line breaks is one piece
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"""
        r"""[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
    )
    spec["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": qwen2}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
             "use_regex": False},
        ],
    }  # fmt: skip
    json.dump(spec, open(tmp_path / "tokenizer.json", "w"))
    tok = AutoTokenizer.from_pretrained(tmp_path)
    ids = pool_token_ids(tok)
    for text in ("What is 2+3?", "\nWhat is 2+3?", "\n\nWhat is 2+3?"):
        row = tok(render_prompt(tok, text, 0, 0), add_special_tokens=False)["input_ids"]
        pools = attention_pools(np.array([row]), np.ones((1, len(row)), int), len(row), **ids)
        kept = np.asarray(row)[pools["text"][0]]
        assert tok.decode(kept).strip() == "What is 2+3?", repr(text)
    assert "ĊĊ" in tok.convert_ids_to_tokens(ids["header_breaks"])


def test_a_text_models_turns_given_as_parts_render_as_their_text(tokenizer):
    """A text-only model's chat template (Qwen2.5's, Llama's) concatenates `content` as a
    string: turns given as lists of parts (verl's and TRL's conversational rows) are read as
    their text, every turn, as a string turn renders; `<image>` text stays text."""
    import copy

    from jaxvrl.data.prompts import render_prompt

    tok = copy.copy(tokenizer)
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    parts = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {
            "role": "user",
            "content": [{"type": "text", "text": "2+3?"}, {"type": "text", "text": " <image>"}],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "5"}]},
        {"role": "user", "content": [{"type": "text", "text": TEXT}]},
    ]
    plain = [dict(m, content="".join(p["text"] for p in m["content"])) for m in parts]
    want = tok.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
    assert render_prompt(tok, parts, placeholders=False) == want
    assert render_prompt(tok, plain, placeholders=False) == want
    assert "'type'" not in want and "2+3? <image>" in want


def test_a_chat_template_kept_for_the_processor_only_is_read(tmp_path):
    """A checkpoint whose chat template is only in `chat_template.json` (what transformers'
    processors read; its tokenizers do not) renders with it, not as plain text."""
    import json
    import shutil

    from jaxvrl.data.rows import load_tokenizer
    from jaxvrl.train import EMBEDDED

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{EMBEDDED}/{name}", tmp_path / name)
    template = open(f"{EMBEDDED}/chat_template.jinja", encoding="utf-8").read()
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert not getattr(load_tokenizer(str(tmp_path)), "chat_template", None)
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    assert load_tokenizer(str(tmp_path)).chat_template == template
    assert load_tokenizer(EMBEDDED).chat_template == template  # the tokenizer's own first


def test_chat_template_kwargs_reach_the_template(tokenizer):
    """data.chat_template_kwargs (verl's apply_chat_template_kwargs) are the chat template's
    keyword arguments, e.g. Qwen3's enable_thinking=False (an empty think block)."""
    import copy

    from configs import base
    from jaxvrl.config import ConfigError, set_values, validate
    from jaxvrl.data.from_config import encode_options
    from jaxvrl.data.pipeline import encode_rows

    tok = copy.copy(tokenizer)
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}<|im_start|>assistant\n"
        "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
        "{% endif %}"
    )
    c = base.get_config()
    set_values(c, {"data.chat_template_kwargs": "{'enable_thinking': False}"})
    opts = encode_options(c)
    assert opts.chat_template_kwargs == (("enable_thinking", False),)
    rows = [{"problem": "2+3?", "answer": "5"}]
    thinking = encode_rows(rows, tok, dataclasses.replace(opts, chat_template_kwargs=()))[0]
    plain = encode_rows(rows, tok, opts)[0]
    empty = tok("<think>\n\n</think>\n\n", add_special_tokens=False)["input_ids"]
    assert list(plain[0]["prompt_ids"]) == list(thinking[0]["prompt_ids"]) + empty
    set_values(c, {"data.chat_template_kwargs": "enable_thinking=False"})
    with pytest.raises(ConfigError, match="data.chat_template_kwargs"):
        validate(c)
