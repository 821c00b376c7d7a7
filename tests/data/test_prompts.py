"""Prompt ids from the shipped tokenizer's chat template equal transformers' Qwen2.5-VL
processor + apply_chat_template for the same messages."""

from __future__ import annotations

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
