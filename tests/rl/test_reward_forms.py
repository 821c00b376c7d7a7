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


def verl_batch(data_sources, solution_strs, ground_truths, extra_infos, scale=1.0):
    SEEN.append([list(data_sources), list(ground_truths), [dict(e) for e in extra_infos]])
    out = []
    for s, g, e in zip(solution_strs, ground_truths, extra_infos):
        ok = float(s.strip() == str(g))
        out.append({{"score": scale * ok + e["bonus"], "acc": ok}} if ok else scale * ok - 1)
    return out


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


def scorer(predict_str, ground_truth, format_score=0.1):
    return float(predict_str.strip() == ground_truth) + format_score


def scorer_with_info(predict_str, ground_truth, extra_info=None, data_source=None, **kwargs):
    SEEN.append((predict_str, ground_truth, extra_info, data_source, kwargs))
    ok = float(predict_str == ground_truth)
    return {{"overall": ok + extra_info["bonus"], "accuracy": ok}}


def needs_kwargs(reward_inputs, max_response_length, overlong_buffer_length, factor=1.0):
    expected = max_response_length - overlong_buffer_length
    return [{{"overall": factor * (r["response_length"] <= expected)}} for r in reward_inputs]


def broken(reward_input):
    raise ValueError("no answer in " + reward_input["response"])


def trl_fn(completions, prompts, answer, **kwargs):
    return [float(c == a) + kwargs.get("offset", 0.0) for c, a in zip(completions, answer)]


def easyr1_lists(predicts, ground_truths, format_weight=0.1):  # EasyR1's spring-2025 batch form
    return [dict(overall=float(p == g) + format_weight, format=format_weight)
            for p, g in zip(predicts, ground_truths)]


def trl_ids(completion_ids, **kwargs):  # TRL's length rewards read token ids, not texts
    return [float(len(ids)) for ids in completion_ids]


def trl_state(prompts, trainer_state, **kwargs):
    return [trainer_state.global_step + trainer_state.max_steps / 100 for _ in prompts]
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
        "verl_score", "compute_score", "reward_function", "async_score", "trl_fn",
        "verl_batch", "easyr1_lists")}  # fmt: skip
    assert form == {
        "easyr1_lists": F.EASYR1_LISTS,
        "verl_score": F.VERL,
        "verl_batch": F.VERL_BATCH,
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
    specs += [f"{path}:easyr1_lists"]
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
    np.testing.assert_allclose(values["easyr1_lists"], [1.2, 0.2])  # texts and labels as lists
    np.testing.assert_allclose(subs["easyr1_lists/format"], [0.2, 0.2])


def test_the_verl_batch_form_gets_its_rows_as_lists_in_one_call(module, tmp_path):
    """verl's batch reward manager's function: every row's argument in one list each (rows
    without extra_info get {} as in the per-row form), reward.kwargs by name, a float or a
    dict with `score` per row; in workers too."""
    path = module()
    spec = f"{path}:verl_batch"
    rows, texts, _ = rows_and_texts(tmp_path)
    direct = R.load_reward_fn(spec)(
        [r["data_source"] for r in rows], texts, [r["answer"] for r in rows],
        [r["extra_info"] for r in rows], scale=2.0,
    )  # fmt: skip
    assert direct == [{"score": 2.5, "acc": 1.0}, -1.0]
    calls = len(R.load_reward_fn(spec).__globals__["SEEN"])
    for workers in (0, 1):
        values, subs, fns = score([spec], tmp_path, "{'scale': 2.0}", num_workers=workers)
        np.testing.assert_allclose(values["verl_batch"], [2.5, -1.0])
        np.testing.assert_allclose(subs["verl_batch/acc"], [1.0, np.nan])  # the float row: none
        assert fns["verl_batch"].failures == 0 and fns["verl_batch"].kwargs == {"scale": 2.0}
        if workers == 0:  # one call with the batch's lists
            seen = fns["verl_batch"].fn.__globals__["SEEN"]
            assert seen[-1] == [["gsm8k", "gsm8k"], ["4", "7"], [{"bonus": 0.5}, {"bonus": 0.0}]]
            assert len(seen) == calls + 1
    form = F.detect(R.load_reward_fn(spec))
    bare = F.RowInput("p", "4", 1, "4", {})  # a row without data_source and extra_info
    got = []

    def exact(data_sources, solution_strs, ground_truths, extra_infos):
        got.append((data_sources, solution_strs, ground_truths, extra_infos))
        return [1.0]

    assert F.call(exact, form, [bare]) == [(1.0, {})]
    assert got == [([""], ["4"], ["4"], [{}])]
    assert F.call(exact, form, []) == []  # no rows: no call
    with pytest.raises(F.RewardFormError, match="returned 1 values for 2 rows"):
        F.call(exact, form, [bare, bare])


def test_the_scorer_form_gets_the_completion_and_label_by_position(module, tmp_path):
    """verl's built-in scorers and EasyR1's first reward functions, `compute_score(predict_str,
    ground_truth, ...)`: per row, the completion and the label by position, extra_info and
    data_source by keyword when named, reward.kwargs by name; a float, or a dict with
    `score` or `overall`."""
    path = module()
    specs = [f"{path}:scorer", f"{path}:scorer_with_info"]
    assert {F.detect(R.load_reward_fn(s)).kind for s in specs} == {F.SCORER}
    rows, texts, _ = rows_and_texts(tmp_path)
    fn = R.load_reward_fn(specs[1])
    calls = len(fn.__globals__["SEEN"])
    values, subs, fns = score(specs, tmp_path, "{'format_score': 0.25, 'scale': 3}")
    want = [
        R.load_reward_fn(specs[0])(t, r["answer"], format_score=0.25) for r, t in zip(rows, texts)
    ]
    np.testing.assert_allclose(values["scorer"], want)  # [1.25, 0.25]
    np.testing.assert_allclose(values["scorer_with_info"], [1.5, 0.0])
    np.testing.assert_allclose(subs["scorer_with_info/accuracy"], [1.0, 0.0])
    seen = fns["scorer_with_info"].fn.__globals__["SEEN"][calls:]
    kw = {"format_score": 0.25, "scale": 3}  # its **kwargs take every key
    assert seen == [
        ("4", "4", {"bonus": 0.5}, "gsm8k", kw),
        ("8", "7", {"bonus": 0.0}, "gsm8k", kw),
    ]
    # a third required parameter is neither the completion, the label nor a known keyword
    with pytest.raises(TypeError, match="no reward form fits"):
        F.detect(lambda ground_truth, predict_str: 0.0)  # the label first: no form
    form = F.detect(lambda predict, ground_truth, threshold: 0.0)
    assert form.kind == F.SCORER and form.unfilled({}) == ["threshold"]


def test_parameters_without_a_default_must_come_from_reward_kwargs(module, tmp_path):
    """EasyR1's dapo reward takes its lengths as required parameters: without them in
    reward.kwargs every call would raise, so the run stops before it starts, naming them."""
    path = module()
    spec = f"{path}:needs_kwargs"
    fn = R.load_reward_fn(spec)
    with pytest.raises(TypeError) as e:
        R.SafeReward("dapo", fn, spec, {"max_response_length": 8})
    assert str(e.value) == (
        f"reward {spec} (easyr1_batch form): overlong_buffer_length has no default and no value "
        "in reward.kwargs; set it there, e.g. "
        "--config.reward.kwargs=\"{'overlong_buffer_length': ...}\""
    )
    with pytest.raises(TypeError, match="max_response_length, overlong_buffer_length have"):
        R.SafeReward("dapo", fn, spec)
    kwargs = "{'max_response_length': 8, 'overlong_buffer_length': 2, 'factor': 2.0}"
    values, _, fns = score([spec], tmp_path, kwargs)
    np.testing.assert_allclose(values["needs_kwargs"], [2.0, 2.0])  # 1-token completions
    # the forms' own arguments are filled: no error for them
    assert F.detect(R.load_reward_fn(f"{path}:verl_score")).unfilled({}) == []
    assert F.detect(R.load_reward_fn(f"{path}:verl_batch")).unfilled({}) == []
    assert F.detect(R.load_reward_fn(f"{path}:reward_function")).unfilled({}) == []
    assert F.detect(R.load_reward_fn(f"{path}:trl_fn")).unfilled({}) == []  # columns


def test_a_reward_kwarg_that_no_function_takes_is_refused_before_the_run(module):
    """A misspelt keyword would leave the function at its default for the whole run."""
    from jaxvrl.config import ConfigError, load_config
    from jaxvrl.trainer.setup import reward_functions

    path = module()
    easy = f"{path}:compute_score"

    def refusal(specs, kwargs):
        weights = f"reward.weights={[1.0] * len(specs)!r}"
        c = load_config(
            "configs/grpo.py", [f"reward.funcs={specs!r}", weights, f"reward.kwargs={kwargs}"]
        )
        try:
            reward_functions(c)
        except ConfigError as e:
            return str(e)

    assert refusal([easy, "accuracy"], "{'format_weight': 0.2}") is None
    assert refusal([easy, "accuracy"], "{'formt_weight': 0.2}") == (
        "config.reward.kwargs: 'formt_weight' is a parameter of no reward function "
        "(compute_score takes format_weight, reward_inputs; accuracy takes answer, completions, "
        "solution); under a reward's name, a dict of its own keywords"
    )
    assert refusal([easy, "accuracy"], "{'compute_score': {'scale': 2}}") == (
        f"config.reward.kwargs: 'scale' under 'compute_score': reward compute_score ({easy}) "
        "has no such parameter (compute_score takes format_weight, reward_inputs)"
    )
    assert refusal([f"{path}:verl_batch"], f"{{'{path}:verl_batch': {{'scale': 2.0}}}}") is None
    assert refusal([f"{path}:verl_batch"], "{'verl_batch': {'scale': 2.0}}") is None
    assert refusal([f"{path}:trl_fn"], "{'offset': 1.0}") is None  # its **kwargs take it


def test_kwargs_by_name_and_the_trl_form_in_workers(module, tmp_path):
    path = module()
    specs = [f"{path}:trl_fn", "mc_idx"]
    values, _, fns = score(specs, tmp_path, "{'trl_fn': {'offset': 2.0}}", num_workers=1)
    np.testing.assert_allclose(values["trl_fn"], [3.0, 2.0])
    assert fns["trl_fn"].kwargs == {"offset": 2.0} and fns["mc_idx"].kwargs == {}
    assert fns["trl_fn"].failures == 0


def test_a_batch_function_sees_the_whole_batch_with_several_workers(tmp_path):
    """EasyR1 and TRL call a batch function once on the whole batch (a reward may compare a
    group's rows); workers spread only per-row functions' rows. Before, each of 2 workers
    called it on half the batch."""
    path = tmp_path / "probe.py"
    path.write_text(
        "def compute_score(reward_inputs):\n"
        "    return [{'overall': float(len(reward_inputs))} for _ in reward_inputs]\n\n\n"
        "def trl_probe(completions, **kwargs):\n    return [float(len(completions))] * len(completions)\n"
    )
    values, _, _ = score([str(path), f"{path}:trl_probe"], tmp_path, num_workers=2)
    np.testing.assert_array_equal(values["probe"], [2.0, 2.0])
    np.testing.assert_array_equal(values["trl_probe"], [2.0, 2.0])


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


def test_a_file_named_without_its_function_gives_compute_score_else_main(tmp_path):
    """verl names a reward file and defaults its function to compute_score, EasyR1 to main:
    `path.py` alone takes the file's compute_score, else its main, logged under the file's
    name; a file with neither, or one that is missing or fails to import, stops the run at
    start with one line (the config key, the file, what it defines)."""
    from jaxvrl.config import ConfigError, load_config
    from jaxvrl.trainer.setup import reward_functions

    verl, easy, neither, raises = (tmp_path / f"{n}.py" for n in ("verl", "easy", "no", "bad"))
    verl.write_text(
        "def main(x):\n    return 0.0\n\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(solution_str.strip() == ground_truth)\n"
    )
    easy.write_text(
        "def main(reward_inputs):\n    return [{'overall': 2.0} for _ in reward_inputs]\n"
    )
    neither.write_text("import math\n\ndef score(a, b):\n    return 0.0\n")
    raises.write_text("import not_a_module_anywhere\n")
    specs = [str(verl), str(easy)]
    assert R.reward_names(specs) == ("verl", "easy")
    assert R.load_reward_fn(str(verl)).__name__ == "compute_score"
    assert R.load_reward_fn(str(easy)).__name__ == "main"
    values, _, fns = score(specs, tmp_path)
    np.testing.assert_array_equal(values["verl"], [1.0, 0.0])  # "4" right, "8" wrong
    np.testing.assert_array_equal(values["easy"], [2.0, 2.0])
    assert fns["verl"].form.kind == F.VERL and fns["easy"].form.kind == F.EASYR1_BATCH

    def error(spec):
        c = load_config("configs/grpo.py", [f"reward.funcs=('{spec}',)", "reward.weights=(1.0,)"])
        with pytest.raises(ConfigError) as e:
            reward_functions(c)
        assert str(e.value).startswith("config.reward.funcs: ") and "\n" not in str(e.value)
        return str(e.value)

    assert f"{neither} defines none of compute_score, main" in error(neither)
    assert "functions in the file: score)" in error(neither)  # not the imported module
    assert f"file {tmp_path / 'gone.py'} not found" in error(tmp_path / "gone.py")
    assert "ModuleNotFoundError: No module named 'not_a_module_anywhere'" in error(raises)
    assert "has no function 'nope'" in error(f"{verl}:nope")


def test_a_reward_file_with_dataclasses_and_a_process_pool_of_its_own(tmp_path):
    """A reward file is a module in sys.modules while it runs, as verl and EasyR1 load theirs:
    its dataclasses (postponed annotations) resolve, and the functions it hands to a process
    pool of its own pickle by reference. Before, the first failed to load and the second
    failed every call."""
    path = tmp_path / "pooled.py"
    path.write_text(
        "from __future__ import annotations\n\nimport dataclasses\nimport multiprocessing\n"
        "from concurrent.futures import ProcessPoolExecutor\n\n\n@dataclasses.dataclass\n"
        "class Weights:\n    exact: float = 1.0\n\n\ndef _one(pair):\n"
        "    return Weights().exact * float(pair[0].strip() == str(pair[1]))\n\n\n"
        "def compute_score(data_sources, solution_strs, ground_truths, extra_infos):\n"
        "    fork = multiprocessing.get_context('fork')\n"
        "    with ProcessPoolExecutor(1, mp_context=fork) as pool:\n"
        "        return list(pool.map(_one, zip(solution_strs, ground_truths)))\n"
    )
    values, _, fns = score([str(path)], tmp_path)
    np.testing.assert_array_equal(values["pooled"], [1.0, 0.0])  # "4" right, "8" wrong
    assert fns["pooled"].failures == 0


def test_none_is_a_failure_but_in_the_trl_form(tmp_path):
    """TRL's functions return None for rows a reward does not apply to (0 here); in the other
    forms None is a function that fell through without its return: a counted failure, where
    verl and EasyR1 would stop. A None sub-score is left out, not logged as 0."""
    path = tmp_path / "nones.py"
    path.write_text(
        "def verl_none(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if solution_str == '4':\n        return {'score': 1.0, 'pred': None, 'acc': 1}\n\n"
        "def easy_none(reward_inputs):\n    return [None for _ in reward_inputs]\n\n"
        "def trl_none(completions, **kw):\n    return [None, 0.5]\n"
    )
    specs = [f"{path}:{n}" for n in ("verl_none", "easy_none", "trl_none")]
    values, subs, fns = score(specs, tmp_path)
    np.testing.assert_array_equal(values["verl_none"], [1.0, 0.0])  # row 2 fell through
    np.testing.assert_array_equal(values["easy_none"], [0.0, 0.0])
    np.testing.assert_array_equal(values["trl_none"], [0.0, 0.5])
    assert [fns[n].failures for n in ("verl_none", "easy_none", "trl_none")] == [1, 1, 0]
    assert "verl_none/acc" in subs and "verl_none/pred" not in subs


def test_the_trl_form_gets_conversations_for_a_conversational_dataset(tmp_path):
    """TRL passes a conversational dataset's completions as [{"role": "assistant", "content":
    text}] and its prompts as their messages; built-in rewards keep reading texts."""
    path = tmp_path / "conv.py"
    path.write_text(
        "def conv(completions, prompts, **kw):\n"
        "    return [float(c[0]['content'] == '4') + 10 * (p[-1]['role'] == 'user')\n"
        "            for c, p in zip(completions, prompts)]\n"
    )
    specs = [f"{path}:conv", "think_format"]
    rows, texts, lengths = rows_and_texts(tmp_path)
    for r in rows:
        r["prompt"] = [{"role": "user", "content": r["problem"]}]
    names = R.reward_names(specs)
    fns = {n: R.SafeReward(n, R.load_reward_fn(s), s) for n, s in zip(names, specs)}
    scorer = RewardScorer(fns, image_dir=str(tmp_path))
    try:
        values, _ = scorer.score(rows, texts, lengths)
        np.testing.assert_array_equal(values["conv"], [11.0, 10.0])
        np.testing.assert_array_equal(values["think_format"], [0.0, 0.0])
        assert fns["conv"].failures == fns["think_format"].failures == 0
        for r in rows:  # a plain prompt: texts, as before
            del r["prompt"]
        values, _ = scorer.score(rows, texts, lengths)
        assert fns["conv"].failures == 1  # c[0] is a character: the function fails
    finally:
        scorer.close()


@pytest.mark.parametrize("workers", [0, 1])
def test_trl_form_gets_completion_ids_and_trainer_state(module, tmp_path, workers):
    """TRL's GRPOTrainer passes `completion_ids` (each completion's tokens, EOS included) and
    `trainer_state` besides the columns: a function naming them (even first, without
    `completions`) gets them, in a worker process too, never the texts in their place."""
    from jaxvrl.trainer.rollout import completion_ids, reward_constants

    path = module()
    specs = {n: f"{path}:{n}" for n in ("trl_ids", "trl_state")}
    fns = {n: R.SafeReward(n, R.load_reward_fn(s), s) for n, s in specs.items()}
    assert {f.form.kind for f in fns.values()} == {"trl"}
    consts = reward_constants(2.0, max_steps=300)
    scorer = RewardScorer(fns, image_dir=str(tmp_path), num_workers=workers, constants=consts)
    rows, texts, _ = rows_and_texts(tmp_path)
    tokens, mask = np.array([[5, 6, 3, 0], [7, 3, 0, 0]]), np.array([[1, 1, 1, 0], [1, 1, 0, 0]])
    try:
        ids = completion_ids(tokens, mask)
        values, _ = scorer.score(rows, texts, mask.sum(1), ids=ids, step=7)
    finally:
        scorer.close()
    np.testing.assert_array_equal(values["trl_ids"], [3.0, 2.0])
    np.testing.assert_array_equal(values["trl_state"], [10.0, 10.0])
    assert not any(f.failures for f in fns.values())
