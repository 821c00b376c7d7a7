"""A text-only model in the main job: a tiny Llama saved by transformers (over the embedded
tokenizer) trains GRPO on a text dataset scored by `accuracy` and a reward model (a tiny
Qwen3-MoE's main job runs on an expert mesh: tests/parallel/test_mesh_main_job.py); rows with
images are skipped and counted;
the built-in task (its rows hold images) and the settings that read the image are refused at
start, naming the key and the model type."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from jaxvrl import models
from jaxvrl.config import ConfigError, load_config
from jaxvrl.train import run
from tests.models import hf_tiny_text as T
from tests.trainer.test_train import ROOT, TINY


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny random Llama over the embedded tokenizer's vocabulary, with its files."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=448, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, eos_token_id=2,
                      bos_token_id=None, max_position_embeddings=512)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(models.EMBEDDED, name), path / name)
    return path


def _config(path, workdir, data, config="configs/grpo.py", *extra):
    overrides = TINY + [
        f"workdir={workdir}",
        f"model.path={path}",
        f"data.train_files={data}",
        "data.prompt_key=question",
        "data.answer_key=answer",
        "reward.funcs=('accuracy',)",
        "reward.weights=(1.0,)",
        "total_steps=1",
        "val_before_train=False",
        "val_size=0",
        *extra,
    ]
    return load_config(os.path.join(ROOT, config), overrides)


def _text_rows(path):
    rows = [{"question": f"What is {a} + {b}?", "answer": f"#### {a + b}"} for a in range(4)
            for b in range(3)]  # fmt: skip
    rows.append({"question": "Which colour?", "answer": "red", "images": ["red.png"]})
    with open(path, "w") as f:
        f.write("\n".join(json.dumps(r) for r in rows))
    return str(path)


def test_grpo_trains_a_text_model_on_text_rows(llama, tmp_path):
    """... with a reward model (a tiny LlamaForSequenceClassification): one more reward,
    logged as reward/model and weighted into the total."""
    data = _text_rows(tmp_path / "math.jsonl")
    rm = tmp_path / "rm"
    T.build_classifier(rm, "llama", tokenizer_dir=models.EMBEDDED_TEXT)
    extra = (f"reward.model.path={rm}", "reward.model.weight=0.5")
    metrics = run(_config(llama, tmp_path / "run", data, "configs/grpo.py", *extra))
    assert np.isfinite(metrics["loss"]) and metrics["train/nonfinite"] == 0
    assert "reward/accuracy" in metrics and metrics["reward/model"] != 0
    total = metrics["reward/accuracy"] + 0.5 * metrics["reward/model"]
    assert np.isclose(metrics["reward/total"], total, rtol=1e-5, atol=1e-6)
    # the data is encoded as it is drawn: the row with an image is skipped and counted
    from transformers import AutoTokenizer

    from jaxvrl.data.from_config import row_format
    from jaxvrl.data.pipeline import EncodeOptions, encode_rows, read_rows

    rows = read_rows(data, fmt=row_format(_config(llama, tmp_path / "x", data)))
    examples, stats = encode_rows(rows, AutoTokenizer.from_pretrained(llama),
                                  EncodeOptions(processor=None))  # fmt: skip
    assert len(examples) == 12 and dict(stats.counts) == {"media_for_text_model": 1}


@pytest.mark.parametrize(
    "config, extra, key",
    [
        ("configs/tprl.py", (), "tprl.enable_perception_filtering"),
        ("configs/vgr.py", (), "vgr.enable_token_weights"),
        ("configs/grpo.py", ("data.train_files=null",), "data.builtin_task"),
    ],
)
def test_what_needs_an_image_is_refused_at_start(llama, tmp_path, config, extra, key):
    data = _text_rows(tmp_path / "math.jsonl")
    with pytest.raises(ConfigError, match=rf"config\.{key}.*'llama'"):
        run(_config(llama, tmp_path / "run", data, config, *extra))
    assert not (tmp_path / "run" / "checkpoints").exists()  # refused before any work


@pytest.mark.parametrize(
    "key", ["tprl.enable_perception_filtering", "tprl.enable_trajectory_reweighting"]
)
def test_the_embedded_text_default_refuses_what_needs_an_image(tmp_path, key):
    c = load_config(
        os.path.join(ROOT, "configs/math_grpo.py"), [f"workdir={tmp_path}", f"{key}=True"]
    )
    with pytest.raises(ConfigError, match=rf"config\.{key}: True needs images.*'llama'"):
        run(c)
    assert not (tmp_path / "checkpoints").exists()


def test_the_embedded_text_default_is_the_arithmetic_tasks_llama(tmp_path):
    """Unset model.path and train_files with data.builtin_task=arithmetic: the shipped tiny
    Llama on one-digit sums; held-out accuracy is scored by `accuracy`, and greedy decoding
    answers in the taught format (the think works the sum out)."""
    from jaxvrl.export import _base_model_path
    from jaxvrl.trainer.setup import run_info

    c = load_config(os.path.join(ROOT, "configs/math_grpo.py"), [f"workdir={tmp_path}"])
    assert models.load_config(models.EMBEDDED_TEXT).model_type == "llama"
    info = run_info(c)
    assert info["model_path"] is None and info["builtin_task"] == "arithmetic"
    assert _base_model_path(info) == models.EMBEDDED_TEXT
    assert _base_model_path({"model_path": None}) == models.EMBEDDED  # run.json before tasks


def test_held_out_rows_are_scored_by_mc_idx_or_accuracy():
    from jaxvrl.trainer.reporting import held_out_score

    texts = ["<think>3 + 4 = 7</think> Answer: 7", "Answer: B", "Answer: 8", "so (C)", "x = 12"]
    examples = [{"answer": "7"}, {"label_idx": 1, "choices": ["a", "b"]}, {"answer": "7"},
                {"answer": "C"}, {"solution": "#### 12"}]  # fmt: skip
    assert held_out_score(texts, examples) == [1.0, 1.0, 0.0, 1.0, 1.0]
    # an option named by its letter form, its index or its text beside `choices`; a NaN
    # label_idx (a pandas cell) falls back to the answer
    texts = ["Answer: B", "Answer: B", "Answer: B", "Answer: (B)", "Answer: B", "Answer: 12"]
    examples = [{"answer": "(B)"}, {"answer": "B. cat", "choices": ["dog", "cat"]},
                {"answer": "Cat", "choices": ["dog", "cat"]}, {"answer": 1, "choices": ["x", "y"]},
                {"label_idx": float("nan"), "answer": "B"}, {"answer": "A cat ate 12"}]  # fmt: skip
    assert held_out_score(texts, examples) == [1.0, 1.0, 1.0, 1.0, 1.0, 0.0]


@pytest.mark.parametrize(
    "extra",
    [
        # RLOO, KL in the loss, LoRA, the replay buffer
        ("algorithm.adv_estimator=rloo", "actor.use_kl_loss=True", "actor.kl_loss_coef=0.01",
         "lora.rank=4", "filter.replay_buffer.enable=True"),
        # ReMax, DAPO (clip-higher, dynamic sampling, overlong punishment), int8 QLoRA
        ("algorithm.adv_estimator=remax", "actor.clip_ratio_high=0.28",
         "filter.dynamic_sampling=True", "filter.overlong_buffer_len=4",
         "filter.overlong_penalty_factor=1.0", "lora.rank=4", "lora.quantize=int8"),
        # REINFORCE++ and Dr.GRPO's aggregation
        ("algorithm.adv_estimator=reinforce_plus_plus", "algorithm.norm_adv_by_std=False",
         "actor.loss_agg_mode=seq-mean-token-sum-norm"),
    ],
)  # fmt: skip
def test_the_text_default_runs_the_methods_that_need_no_image(tmp_path, extra):
    c = load_config(
        os.path.join(ROOT, "configs/math_grpo.py"),
        [*TINY, f"workdir={tmp_path}", "total_steps=1", "val_before_train=False", "val_size=0",
         *extra],
    )  # fmt: skip
    metrics = run(c)
    assert np.isfinite(metrics["loss"]) and metrics["train/nonfinite"] == 0
    assert metrics["accuracy"] == metrics["reward/accuracy"]  # the top-level accuracy too
    if c.filter.overlong_buffer_len:  # the punishment's share of the totals, logged beside
        parts = metrics["reward/accuracy"] + metrics["reward/overlong_penalty"]
        assert metrics["reward/overlong_penalty"] <= 0
        assert np.isclose(metrics["reward/total"], parts, rtol=1e-6, atol=1e-9)
