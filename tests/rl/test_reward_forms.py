"""Reward functions as verl, EasyR1 and TRL users write them, and the `reward_function(data_dict)`
form, run unchanged: the form is recognised by signature, each gets its inputs, and the values and
sub-scores the run logs equal a direct call's."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from jaxvrl.rl import reward_forms as F
from jaxvrl.rl import rewards as R
from jaxvrl.trainer.scoring import RewardScorer

REWARDS = """
import asyncio

REWARD_TYPE = {reward_type!r}
SEEN = []


def verl_score(data_source, solution_str, ground_truth, extra_info=None):
    ok = float(solution_str.strip() == str(ground_truth))
    return {{"score": ok + extra_info["bonus"], "acc": ok, "note": data_source}}


def verl_float(data_source, solution_str, ground_truth, extra_info=None):
    return float(len(solution_str))


def compute_score(reward_inputs, format_weight=0.1):
    out = []
    for r in reward_inputs:
        acc = float(r["response"] == r["ground_truth"])
        fmt = float(r["response_length"] > 0 and r["prompt"].startswith("Q"))
        out.append({{"overall": (1 - format_weight) * acc + format_weight * fmt,
                     "format": fmt, "accuracy": acc}})
    return out


def sequential(reward_input, format_weight=0.5):
    return compute_score([reward_input], format_weight)[0]


def reward_function(data_dict):
    size = data_dict["images"][0].size[0] if data_dict["images"] else 0
    ok = float(data_dict["response"] == data_dict["ground_truth"])
    return ok, {{"width": float(size), "has_prompt": float(bool(data_dict["prompt"]))}}


async def async_score(data_source, solution_str, ground_truth, extra_info=None):
    await asyncio.sleep(0)
    return float(solution_str == ground_truth)


def broken(reward_input):
    raise ValueError("no answer in " + reward_input["response"])


def trl_fn(completions, prompts, answer, **kwargs):
    return [float(c == a) + kwargs.get("offset", 0.0) for c, a in zip(completions, answer)]
"""


@pytest.fixture
def module(tmp_path):
    def write(reward_type=None):
        path = tmp_path / f"rewards_{reward_type}.py"
        path.write_text(REWARDS.format(reward_type=reward_type))
        return str(path)

    return write


def rows_and_texts(tmp_path):
    from PIL import Image

    Image.new("RGB", (12, 8)).save(tmp_path / "a.png")
    rows = [
        {"problem": "Q1", "answer": "4", "data_source": "gsm8k", "extra_info": {"bonus": 0.5}},
        {"problem": "Q2", "answer": "7", "data_source": "gsm8k", "extra_info": {"bonus": 0.0}},
    ]
    for r in rows:
        r["image_refs"] = ["a.png"]
        r["prompt_ids"] = [1, 2, 3]  # what the pipeline adds: not a column
    return rows, ["4", "8"], np.array([1.0, 1.0])


def score(specs, tmp_path, kwargs="{}", **scorer_kw):
    names = R.reward_names(specs)
    kw = R.reward_kwargs(kwargs, names, specs)
    fns = {n: R.SafeReward(n, R.load_reward_fn(s), s, kw[n]) for n, s in zip(names, specs)}
    scorer = RewardScorer(fns, image_dir=str(tmp_path), **scorer_kw)
    rows, texts, lengths = rows_and_texts(tmp_path)
    try:
        return (*scorer.score(rows, texts, lengths), fns)
    finally:
        scorer.close()


def test_each_form_is_recognised_by_its_signature(module):
    path = module()
    form = {n: F.detect(R.load_reward_fn(f"{path}:{n}")).kind for n in (
        "verl_score", "compute_score", "reward_function", "async_score", "trl_fn")}  # fmt: skip
    assert form == {
        "verl_score": F.VERL,
        "compute_score": F.EASYR1_BATCH,  # EasyR1's default type
        "reward_function": F.DATA_DICT,
        "async_score": F.VERL,
        "trl_fn": F.TRL,
    }
    assert F.detect(R.load_reward_fn(f"{path}:async_score")).is_async
    seq = module("sequential")
    assert F.detect(R.load_reward_fn(f"{seq}:sequential")).kind == F.EASYR1_SEQUENTIAL
    assert F.detect(R.mc_idx_reward).kind == F.TRL
    assert F.detect(lambda c, **kw: c).kind == F.TRL  # completions by position
    with pytest.raises(TypeError, match="no reward form fits"):
        F.detect(lambda a, b: a)


def test_values_and_sub_scores_equal_a_direct_call(module, tmp_path):
    path, seq = module(), module("sequential")
    specs = [f"{path}:verl_score", f"{path}:compute_score", f"{seq}:sequential"]
    specs += [f"{path}:reward_function", f"{path}:async_score", "mc_idx", "accuracy"]
    values, subs, _ = score(specs, tmp_path, "{'format_weight': 0.2}")

    rows, texts, _ = rows_and_texts(tmp_path)
    verl = R.load_reward_fn(specs[0])
    direct = [verl(r["data_source"], t, r["answer"], r["extra_info"]) for r, t in zip(rows, texts)]
    np.testing.assert_allclose(values["verl_score"], [d["score"] for d in direct])
    np.testing.assert_allclose(subs["verl_score/acc"], [d["acc"] for d in direct])
    assert "verl_score/note" not in subs  # a string is no metric
    inputs = [
        {"response": t, "response_length": 1, "ground_truth": r["answer"], "prompt": r["problem"]}
        for r, t in zip(rows, texts)
    ]
    easy = R.load_reward_fn(specs[1])(inputs, format_weight=0.2)  # reward.kwargs passed
    np.testing.assert_allclose(values["compute_score"], [d["overall"] for d in easy])
    np.testing.assert_allclose(subs["compute_score/format"], [d["format"] for d in easy])
    np.testing.assert_allclose(subs["compute_score/accuracy"], [d["accuracy"] for d in easy])
    np.testing.assert_allclose(values["sequential"], [d["overall"] for d in easy])
    np.testing.assert_allclose(values["reward_function"], [1.0, 0.0])
    np.testing.assert_allclose(subs["reward_function/width"], [12.0, 12.0])  # its PIL image
    np.testing.assert_allclose(values["async_score"], [1.0, 0.0])  # awaited
    np.testing.assert_allclose(values["accuracy"], R.accuracy_reward(texts, answer=["4", "7"]))


def test_kwargs_by_name_and_the_trl_form_in_workers(module, tmp_path):
    path = module()
    specs = [f"{path}:trl_fn", "mc_idx"]
    values, _, fns = score(specs, tmp_path, "{'trl_fn': {'offset': 2.0}}", num_workers=1)
    np.testing.assert_allclose(values["trl_fn"], [3.0, 2.0])
    assert fns["trl_fn"].kwargs == {"offset": 2.0} and fns["mc_idx"].kwargs == {}
    assert fns["trl_fn"].failures == 0


def test_a_failure_names_the_function_the_error_and_the_form(module, tmp_path, caplog):
    path = module("sequential")
    with caplog.at_level(logging.ERROR):
        values, _, fns = score([f"{path}:broken"], tmp_path, "{'bogus': 1}")
    np.testing.assert_array_equal(values["broken"], [0.0, 0.0])
    [line] = [r.getMessage() for r in caplog.records]  # once, for the first failure
    assert "reward broken" in line and "ValueError: no answer in 4" in line
    assert "easyr1_sequential form" in line and "\n" not in line
    assert fns["broken"].failures == 2  # one call per row


def test_failing_on_most_calls_over_the_window_ends_the_run():
    fn = R.SafeReward("flaky", R.think_format_reward)
    for failed in (True, False, True):
        fn.record("RuntimeError: x" if failed else None)
        fn.end_step(window=3)
        assert fn.failing(0.5, 3) is None or failed
    assert fn.failing(0.5, 3) is not None  # 2 of 3 > 0.5
    assert "max_failure_fraction=0.5" in fn.failing(0.5, 3)
    assert fn.failing(0.7, 3) is None
    fn.record(None)
    fn.end_step(window=3)
    assert fn.failing(0.5, 3) is None  # 1 of the last 3
