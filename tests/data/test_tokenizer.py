"""The shipped tokenizer: loads offline, is reproducible, carries the Qwen chat tokens."""

from __future__ import annotations

import filecmp
import os

import pytest

from jaxvrl.data import build_tokenizer, default_tokenizer_path, special_token_ids

FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)


def test_shipped_files_equal_a_fresh_build(tmp_path):
    build_tokenizer.build(str(tmp_path))
    for name in FILES:
        assert filecmp.cmp(tmp_path / name, os.path.join(default_tokenizer_path(), name), False), (
            name
        )
    total = sum(os.path.getsize(os.path.join(default_tokenizer_path(), n)) for n in FILES)
    assert total < 1_000_000


@pytest.mark.parametrize("checkpoint", ["tiny_qwen2_5_vl", "tiny_llama"])
def test_embedded_checkpoints_use_the_same_vocabulary(checkpoint):
    embedded = os.path.join(os.path.dirname(default_tokenizer_path()), checkpoint)
    assert filecmp.cmp(
        os.path.join(embedded, "tokenizer.json"),
        os.path.join(default_tokenizer_path(), "tokenizer.json"),
        False,
    )


def test_special_tokens_are_single_ids(tokenizer):
    ids = special_token_ids(tokenizer)
    for tok in build_tokenizer.SPECIAL_TOKENS + build_tokenizer.ADDED_TOKENS:
        enc = tokenizer(tok, add_special_tokens=False)["input_ids"]
        assert len(enc) == 1, tok
    assert ids["image_token_id"] == tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert ids["eos_token_id"] == ids["im_end_id"]
    assert len(set(ids.values()) - {ids["eos_token_id"]}) == len(ids) - 2
    assert 256 < len(tokenizer) < 2048


def test_any_text_roundtrips(tokenizer):
    text = "<think>Ünïcode 漢字 tabs\tand\nnewlines</think> Answer: (B) <answer>B</answer>"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text


def test_chat_template_default_system_prompt(tokenizer):
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        "<|vision_start|><|image_pad|><|vision_end|>Hi<|im_end|>\n<|im_start|>assistant\n"
    )
