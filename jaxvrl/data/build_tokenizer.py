"""Build the small byte-level BPE tokenizer shipped for the embedded default model.

    python -m jaxvrl.data.build_tokenizer [--out jaxvrl/assets/tokenizer]

It carries the Qwen2 chat special tokens, <think>/<answer> tags as single tokens and the
Qwen2.5-VL chat template, in HF format, so `AutoTokenizer.from_pretrained(path)` loads it
offline. Any text encodes (byte-level BPE over all 256 bytes). The build is deterministic: the
shipped files, and the copy beside the embedded checkpoint (`jaxvrl.models.EMBEDDED`, written by `jaxvrl.sft`
through `build`), are byte-identical to a fresh build.
"""

from __future__ import annotations

import argparse
import json
import os

from jaxvrl.data import synthetic

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# Not special (they are decoded into completions that rewards read), but single tokens.
ADDED_TOKENS = ["<think>", "</think>", "<answer>", "</answer>"]

CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
    "{{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video "
    "{{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def corpus() -> list[str]:
    rows = synthetic.make_split("train", 400, seed=0)
    texts = [
        synthetic.SYSTEM_PROMPT,
        "You are a helpful assistant.",
        "system",
        "user",
        "assistant",
        "Answer: A",
        "Answer: B",
        "Answer: C",
        "Answer: D",
        "The answer is",
        "Picture 1: ",
        "Video 1: ",
    ]
    for r in rows:
        texts.append(r["problem"])
        texts.append(synthetic.target_completion(r))
    return texts


def build(out_dir: str, vocab_size: int = 640) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
        clean_up_tokenization_spaces=False,
    )
    fast.add_tokens(ADDED_TOKENS)
    fast.chat_template = CHAT_TEMPLATE
    os.makedirs(out_dir, exist_ok=True)
    fast.save_pretrained(out_dir)
    # transformers 5 no longer writes this file; older loaders and other tools still read it.
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w", encoding="utf-8") as f:
        json.dump(
            {
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "additional_special_tokens": SPECIAL_TOKENS[1:],
            },
            f,
            indent=2,
        )
        f.write("\n")


def main(argv=None) -> None:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=os.path.join(here, "assets", "tokenizer"))
    p.add_argument("--vocab_size", type=int, default=640)
    args = p.parse_args(argv)
    build(args.out, args.vocab_size)
    print(f"wrote tokenizer to {args.out}")


if __name__ == "__main__":
    main()
