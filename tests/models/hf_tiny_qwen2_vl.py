"""Tiny random Qwen2-VL checkpoints built with transformers (no downloads) for parity tests.

Token ids and prompt helpers are `hf_tiny`'s."""

from __future__ import annotations

from tests.models.hf_tiny import IM_END, IMAGE, VEND, VIDEO, VSTART


def make_config(
    *,
    vocab=300,
    hidden=64,
    layers=2,
    heads=4,
    kv_heads=2,
    mrope=(2, 3, 3),
    v_depth=2,
    v_embed=32,
    v_heads=2,
    mlp_ratio=2,
    tie=False,
):
    from transformers import Qwen2VLConfig

    return Qwen2VLConfig(
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
            rms_norm_eps=1e-6,
            bos_token_id=None,
            eos_token_id=IM_END,
            tie_word_embeddings=tie,
        ),
        vision_config=dict(
            depth=v_depth,
            embed_dim=v_embed,
            mlp_ratio=mlp_ratio,
            num_heads=v_heads,
            hidden_size=hidden,
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
    from transformers import Qwen2VLForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(make_config(**kw)).eval()
    # Spread the weights a little so that logits are far from zero and differences show.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("weight") and p.ndim >= 2:
                p.mul_(3.0)
            elif ("norm" in name or "ln_q" in name) and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    model.save_pretrained(path)
    return model
