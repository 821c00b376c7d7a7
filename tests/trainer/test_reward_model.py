"""Reward models: tiny random `Qwen2ForSequenceClassification` (tied embeddings) and
`LlamaForSequenceClassification` checkpoints saved by transformers (over the embedded
tokenizer): the scorer renders (prompt, completion) with the reward model's chat template as
TRL does for reward models and its scores equal transformers' `logits[:, 0]` for the same
texts (float32, right-padded texts of different lengths; on one device and on a mesh); the
`score` head's logits at the last real token equal transformers' for rows padded on the left
and on the right, and after export; a causal LM or a classifier of two labels is refused
naming the key."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from flax import nnx

from jaxvrl import models as M
from jaxvrl.config import ConfigError
from jaxvrl.models import text
from jaxvrl.parallel.sharding import make_mesh
from jaxvrl.trainer.reward_model import RewardModel
from tests.models import hf_tiny_text as T

FAMILIES = [("qwen2", True), ("llama", False)]  # (model_type, tied embeddings)
PROMPTS = ["What is 2 + 3?", "Name a colour.", "x"]
COMPLETIONS = ["<think>2 + 3 = 5</think> 5", "red", "a longer completion that goes on a while"]


@pytest.fixture(scope="module")
def classifiers(tmp_path_factory):
    """model_type -> (transformers model, path)."""
    out = {}
    for i, (model_type, tie) in enumerate(FAMILIES):
        path = tmp_path_factory.mktemp(f"rm_{model_type}")
        hf = T.build_classifier(path, model_type, seed=i, tie=tie, tokenizer_dir=M.EMBEDDED_TEXT)
        out[model_type] = (hf, path)
    return out


def _padded(lengths, left, seed=0):
    """Rows of random real tokens (ids 4..95, never the pad id 0), each padded on the left
    (left[i]) or the right."""
    rng = np.random.default_rng(seed)
    n = max(lengths)
    ids, mask = np.zeros((len(lengths), n), np.int64), np.zeros((len(lengths), n), np.int64)
    for i, (k, lft) in enumerate(zip(lengths, left)):
        s = slice(n - k, n) if lft else slice(0, k)
        ids[i, s], mask[i, s] = rng.integers(4, T.VOCAB, k), 1
    return ids, mask


@pytest.mark.parametrize("model_type", [f for f, _ in FAMILIES])
def test_scores_equal_transformers_logits(classifiers, model_type, tmp_path):
    from transformers import AutoTokenizer

    hf, path = classifiers[model_type]
    rm = RewardModel.load(str(path))
    # the scorer: rendered as TRL renders for a reward model, right-padded texts of three
    # lengths
    scores = rm(PROMPTS, COMPLETIONS)
    tok = AutoTokenizer.from_pretrained(path)
    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": p}, {"role": "assistant", "content": c}], tokenize=False
        )
        for p, c in zip(PROMPTS, COMPLETIONS)
    ]
    assert texts[1].endswith("<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\nred<|im_end|>\n")  # fmt: skip
    enc = tok(texts, return_tensors="pt", padding=True, padding_side="right",
              add_special_tokens=False)  # fmt: skip
    assert len(set(enc["attention_mask"].sum(1).tolist())) == 3
    with torch.no_grad():
        want = hf(**enc).logits[:, 0].numpy()
    assert scores.dtype == np.float64 and scores.shape == (3,)
    np.testing.assert_allclose(scores, want, rtol=1e-5, atol=1e-5)
    # on a mesh (as a run scores): rows placed over (data, fsdp), params by the rules table
    on_mesh = dataclasses.replace(rm, mesh=make_mesh(1, -1, 1))
    np.testing.assert_allclose(on_mesh(PROMPTS, COMPLETIONS), want, rtol=1e-5, atol=1e-5)
    # the model's score head on token ids: rows padded on the left and on the right
    model = nnx.merge(rm.graphdef, rm.params)
    assert model.config.num_labels == 1 and model.head is model.score
    assert model.config.to_hf_dict()["architectures"] == [hf.config.architectures[0]]
    ids, mask = _padded((7, 11, 4, 6), (True, True, False, False))
    pos, _ = text.rope_index(ids, mask)
    ours = np.asarray(nnx.jit(type(model).classify)(model, ids, mask, pos))
    with torch.no_grad():
        want = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits
    assert ours.shape == (4, 1)
    np.testing.assert_allclose(ours, want.numpy(), rtol=1e-5, atol=1e-5)
    if model_type == "qwen2":  # exported, transformers loads the same classifier
        from transformers import AutoModelForSequenceClassification

        M.save(model, tmp_path)
        back = AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
        with torch.no_grad():
            again = back(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits
        np.testing.assert_allclose(again.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)


def test_the_filters_may_name_the_reward_model_and_no_function_takes_its_name(tmp_path):
    from jaxvrl.config import load_config
    from jaxvrl.trainer.setup import reward_model
    from tests.trainer.test_train import ROOT

    base = f"{ROOT}/configs/grpo.py"
    with pytest.raises(ConfigError, match=r"filter\.filter_key"):
        load_config(base, ["filter.filter_key=model"])
    c = load_config(base, ["filter.filter_key=model", f"reward.model.path={tmp_path}"])
    with pytest.raises(ConfigError, match=r"config\.reward\.names: 'model' is the reward model"):
        reward_model(c, ("mc_idx", "model"))


def test_a_causal_lm_or_two_labels_is_refused_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"config\.reward\.model\.path=.*LlamaForCausalLM is not a sequence classifier"):  # fmt: skip
        RewardModel.load(M.EMBEDDED_TEXT)
    T.build_classifier(tmp_path, "qwen3", num_labels=2)
    with pytest.raises(ConfigError, match=r"config\.reward\.model\.path=.*has 2 labels"):
        RewardModel.load(str(tmp_path))


def test_conversations_the_pad_token_and_non_finite_scores_as_trl_reads_them(classifiers):
    """A row's chat messages reach the reward model whole (system turn included, as TRL
    renders a conversational prompt); a text ending in the pad token (pad = EOS, as TRL sets
    it for a tokenizer without one) is read at its last token that is not the pad token, as
    transformers reads it; a non-finite score is 0 and counted as the reward's failure."""
    import copy

    import jax

    from jaxvrl.trainer.reward_model import pad_id

    hf, path = classifiers["llama"]
    rm = RewardModel.load(str(path))
    tok = copy.copy(rm.tokenizer)
    msgs = [
        {"role": "system", "content": "You are a strict grader."},
        {"role": "user", "content": "Name a colour."},
    ]
    cases = [(msgs, "red"), (PROMPTS[0], COMPLETIONS[0])]

    def want(tokenizer, pad):
        hf.config.pad_token_id = pad
        out = []
        for p, c in cases:
            turns = p if isinstance(p, list) else [{"role": "user", "content": p}]
            t = tokenizer.apply_chat_template(
                turns + [{"role": "assistant", "content": c}], tokenize=False
            )
            enc = tokenizer([t], return_tensors="pt", add_special_tokens=False)
            with torch.no_grad():
                out.append(float(hf(**enc).logits[0, 0]))
        return np.array(out)

    got = rm([p for p, _ in cases], [c for _, c in cases])
    np.testing.assert_allclose(got, want(tok, pad_id(tok)), rtol=1e-5, atol=1e-5)
    # turns that end in the EOS, which pads: the score is read before it
    tok.pad_token = tok.eos_token
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
        "{{ eos_token }}{% endfor %}"
    )
    ends = dataclasses.replace(rm, tokenizer=tok)
    got = ends([p for p, _ in cases], [c for _, c in cases])
    np.testing.assert_allclose(got, want(tok, tok.eos_token_id), rtol=1e-5, atol=1e-5)
    # a classifier whose score is NaN (its tally the run's: the calls above were fine)
    assert rm.tally.failures == 0 and rm.tally.step_calls == [2, 0]
    broken = dataclasses.replace(
        rm, params=jax.tree.map(lambda x: x * np.nan if x.ndim == 2 else x, rm.params)
    )
    np.testing.assert_array_equal(broken(PROMPTS, COMPLETIONS), [0.0, 0.0, 0.0])
    assert broken.tally.failures == 1 and broken.tally.step_calls == [3, 1]
