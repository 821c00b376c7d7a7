"""Tiny random Qwen2.5-VL checkpoints built with transformers (no downloads) for parity tests."""

from __future__ import annotations

import numpy as np

IMAGE, VIDEO, VSTART, VEND = 290, 291, 292, 293
IM_START, IM_END = 294, 295
# `attention_pools` keyword arguments for prompts built by `prompt` (user header: 10, 11)
POOL_IDS = dict(
    im_start_id=IM_START,
    im_end_id=IM_END,
    user_header_ids=[10, 11],
    special_ids=[IMAGE, VIDEO, VSTART, VEND, IM_START, IM_END],
    vision_ids=[IMAGE, VIDEO],
)


def make_config(
    *,
    vocab=300,
    hidden=64,
    layers=2,
    heads=4,
    kv_heads=2,
    mrope=(2, 3, 3),
    v_depth=3,
    v_hidden=32,
    v_heads=2,
    fullatt=(1,),
    window=56,
    tokens_per_second=2,
    tie=False,
):
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": list(mrope),
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
            fullatt_block_indexes=list(fullatt),
            window_size=window,
            tokens_per_second=tokens_per_second,
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
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(make_config(**kw)).eval()
    # Spread the weights a little so that logits are far from zero and differences show.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("weight") and p.ndim >= 2:
                p.mul_(3.0)
            elif "norm" in name or "ln_q" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


def vision_tokens(grid, merge=2):
    t, h, w = grid
    return t * h * w // merge**2


def prompt(rng, images=(), videos=(), text_len=(3, 4), token=IMAGE):
    """[im_start, 'user', '\\n', (vstart pads vend)*, text, im_end, im_start, 'assistant', '\\n']"""
    ids = [IM_START, 10, 11]
    for grid in images:
        ids += [VSTART] + [IMAGE] * vision_tokens(grid) + [VEND]
    for grid in videos:
        ids += [VSTART] + [VIDEO] * vision_tokens(grid) + [VEND]
    ids += list(
        rng.integers(20, 280, rng.integers(*text_len) if text_len[1] > text_len[0] else text_len[0])
    )
    ids += [IM_END, IM_START, 12, 11]
    return ids


def left_pad(rows, pad=0, length=None):
    n = max(len(r) for r in rows) if length is None else length
    ids = np.full((len(rows), n), pad, np.int64)
    mask = np.zeros((len(rows), n), np.int64)
    for i, r in enumerate(rows):
        ids[i, n - len(r) :] = r
        mask[i, n - len(r) :] = 1
    return ids, mask


def patches(rng, grids):
    n = int(sum(np.prod(g) for g in grids))
    return rng.standard_normal((n, 1176)).astype(np.float32)


def token_types(ids):
    return np.where(ids == IMAGE, 1, np.where(ids == VIDEO, 2, 0))
