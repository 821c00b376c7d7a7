"""Tiny random text-only checkpoints (Llama, Qwen2, Qwen3, Mistral; causal LMs and sequence
classifiers, the reward models) built with transformers (no downloads) for parity tests."""

from __future__ import annotations

import numpy as np

VOCAB = 96
EOS = 3
SLIDING_WINDOW = 4

ROPES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    # max_position_embeddings 8: prompts and completions of the tests run past it
    "dynamic": {"rope_type": "dynamic", "factor": 8.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8,
    },
    # an original length whose correction range falls inside the head's 8 frequencies
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
}


def make_config(
    model_type="llama",
    *,
    hidden=32,
    layers=2,
    heads=4,
    kv_heads=2,
    rope="default",
    tie=False,
    vocab=VOCAB,
    **extra,
):
    """A transformers config; head_dim 16 for Qwen3 (not hidden / heads), 8 otherwise;
    Mistral's sliding window SLIDING_WINDOW."""
    from transformers import AutoConfig

    rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    rope_parameters |= ROPES[rope] or {}
    kw = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=8 if rope == "dynamic" else 64,
        rope_parameters=rope_parameters,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=EOS,
        **extra,
    )
    if model_type == "qwen3":
        kw["head_dim"] = 16
    if model_type == "mistral":  # a window shorter than the prompts (and their completions)
        kw.setdefault("sliding_window", SLIDING_WINDOW)
    return AutoConfig.for_model(model_type, **kw)


def build(path, model_type="llama", seed=0, **kw):
    """save_pretrained a random model at `path`; returns the torch model (eval mode)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(model_type, **kw)).eval()
    _spread(model)
    model.save_pretrained(path)
    return model


def build_classifier(path, model_type="llama", seed=0, num_labels=1, tokenizer_dir=None, **kw):
    """save_pretrained a random `<Family>ForSequenceClassification` (pad token 0) at `path`,
    with the tokenizer files of `tokenizer_dir` (then the vocabulary is 448, the embedded
    tokenizer's); returns the torch model (eval mode)."""
    import shutil

    import torch
    from transformers import AutoModelForSequenceClassification

    if tokenizer_dir is not None:
        kw.setdefault("vocab", 448)
    cfg = make_config(model_type, num_labels=num_labels, pad_token_id=0, **kw)
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(cfg).eval()
    _spread(model)
    model.save_pretrained(path)
    if tokenizer_dir is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(f"{tokenizer_dir}/{name}", f"{path}/{name}")
    return model


def _spread(model):
    """Spread the weights a little so that logits are far from zero and differences show."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("weight") and p.ndim >= 2:
                p.mul_(3.0)
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))


def prompts(seed=0, lengths=(7, 11, 4)):
    """Left-padded rows of random tokens (ids 4..VOCAB-1): (ids int64[B, T], mask)."""
    rng = np.random.default_rng(seed)
    n = max(lengths)
    ids = np.zeros((len(lengths), n), np.int64)
    mask = np.zeros((len(lengths), n), np.int64)
    for i, k in enumerate(lengths):
        ids[i, n - k :] = rng.integers(4, VOCAB, k)
        mask[i, n - k :] = 1
    return ids, mask


def hf_greedy(hf, ids, mask, n: int) -> np.ndarray:
    """transformers' greedy `generate` of exactly n new tokens after left-padded prompts
    int[B, P] (pad 0): int[B, n]."""
    import torch

    with torch.no_grad():
        out = hf.generate(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    return out[:, ids.shape[1] :].numpy()
