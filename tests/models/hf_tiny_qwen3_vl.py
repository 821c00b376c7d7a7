"""Tiny random Qwen3-VL checkpoints built with transformers (no downloads) for parity tests.

Prompts use the token ids of `hf_tiny` (image pad 290, video pad 291, vision start/end
292/293, im_start/im_end 294/295); a video's frame groups each get their own vision span after
a few "timestamp" text tokens, as Qwen3-VL's processor writes them.
"""

from __future__ import annotations

import numpy as np

from tests.models.hf_tiny import IM_END, IM_START, IMAGE, VEND, VIDEO, VSTART

PATCH = 16
PATCH_DIM = 3 * 2 * PATCH * PATCH


def make_config(
    *,
    vocab=300,
    hidden=64,
    layers=3,
    heads=4,
    kv_heads=2,
    head_dim=24,
    mrope=(4, 4, 4),
    v_depth=3,
    v_hidden=32,
    v_heads=2,
    deepstack=(0, 2),
    positions=36,
    tie=False,
):
    from transformers import Qwen3VLConfig

    return Qwen3VLConfig(
        text_config=dict(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": list(mrope),
                "mrope_interleaved": True,
            },
            max_position_embeddings=2048,
            bos_token_id=None,
            eos_token_id=IM_END,
            tie_word_embeddings=tie,
        ),
        vision_config=dict(
            depth=v_depth,
            hidden_size=v_hidden,
            intermediate_size=2 * v_hidden,
            num_heads=v_heads,
            out_hidden_size=hidden,
            patch_size=PATCH,
            num_position_embeddings=positions,
            deepstack_visual_indexes=list(deepstack),
        ),
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=VSTART,
        vision_end_token_id=VEND,
        tie_word_embeddings=tie,
    )


def build(path, seed=0, **kw):
    """save_pretrained a random model at `path`; returns the torch model (eval mode)."""
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(make_config(**kw)).eval()
    # Spread the weights a little so that logits are far from zero and differences show.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("weight") and p.ndim >= 2:
                p.mul_(3.0)
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


def vision_tokens(grid, merge=2):
    t, h, w = grid
    return t * h * w // merge**2


def video_span(rng, grid, merge=2):
    """Each of a video's t frame groups: 2 timestamp tokens, then its own vision span."""
    t, h, w = grid
    ids = []
    for _ in range(t):
        ids += list(rng.integers(20, 280, 2)) + [VSTART] + [VIDEO] * (h * w // merge**2) + [VEND]
    return ids


def prompt(rng, images=(), videos=(), text_len=(3, 4)):
    """[im_start, 'user', '\\n', (vstart pads vend)*, (vstart frames vend)*, text, im_end,
    im_start, 'assistant', '\\n']"""
    ids = [IM_START, 10, 11]
    for grid in images:
        ids += [VSTART] + [IMAGE] * vision_tokens(grid) + [VEND]
    for grid in videos:
        ids += [VSTART] + video_span(rng, grid) + [VEND]
    n = rng.integers(*text_len) if text_len[1] > text_len[0] else text_len[0]
    ids += list(rng.integers(20, 280, n))
    ids += [IM_END, IM_START, 12, 11]
    return ids


def patches(rng, grids):
    n = int(sum(np.prod(g) for g in grids))
    return rng.standard_normal((n, PATCH_DIM)).astype(np.float32)
