"""Host-side rewards (docs/algorithms.md#rewards)."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest

from jaxvrl.rl import rewards as R


@pytest.mark.parametrize(
    "text,letter",
    [
        ("Answer: B", "B"),
        ("the answer is (C).", "C"),
        ("The answer is: D", "D"),
        ("ANSWER: **E**", "E"),
        ("答案: D", "D"),
        ("答案：A", "A"),
        ("答案是C", "C"),
        ("选项: E", "E"),
        ("选项：（Ｆ）", "F"),
        ("I pick (F)", "F"),
        ("<answer>G</answer>", "G"),
        ("<answer> (b) </answer>", "B"),
        ("so \\boxed{C}", "C"),
        ("答案：Ｈ", "H"),
        ("（Ｊ）", "J"),
        ("<think>maybe A or B</think> Answer: C", "C"),
        ("<think>Answer: A</think>so it is B", "B"),
        ("<think>it is D</think>", "D"),  # nothing after </think>: the whole text
        ("A cat sits. I think J", "J"),  # article A, pronoun I skipped
        ("Option A is correct", "A"),
        ("I think so", None),
        ("Apple", None),
        ("no letter here", None),
        ("answer: c", "C"),
        ("answer is a.", "A"),
        ("The answer is a dog", None),  # lower-case a followed by a word: an article
        ("Answer: B. Then again (C) looked fine", "B"),  # explicit marker beats "(X)"
        ("Answer: A ... on reflection, Answer: D", "D"),  # last of the winning marker
        ("K", None),
    ],
)
def test_extract_choice(text, letter):
    assert R.extract_choice(text) == letter


def test_mc_idx_reward_labels():
    comps = ["<think>red</think>Answer: A", "<think>x</think>", "Answer: B", "(C)", "Answer: D"]
    labels = [0, 1, "b", "Ｃ", None]
    assert R.mc_idx_reward(comps, label_idx=labels) == [1.0, 0.0, 1.0, 1.0, 0.0]
    assert R.mc_idx_reward(["Answer: C"], label_idx=["2"]) == [1.0]
    assert R.mc_idx_reward(["Answer: C"], label_idx=[np.int64(2)]) == [1.0]
    assert R.mc_idx_reward(["Answer: A"], label_idx=["Apple"]) == [0.0]
    with pytest.raises(ValueError, match="labels"):
        R.mc_idx_reward(["A", "B"], label_idx=[0])


def test_mc_idx_reads_answer_where_a_row_has_no_label_idx():
    comps = ["Answer: B", "Answer: B", "Answer: C", "Answer: A"]
    got = R.mc_idx_reward(comps, label_idx=[None, 2, None, None], answer=["B", "B", 2, "cat"])
    assert got == [1.0, 0.0, 1.0, 0.0]  # label_idx wins; an index or letter in `answer` counts
    assert R.mc_idx_reward(["(D)"], answer=["d"]) == [1.0]
    with pytest.raises(ValueError, match="label_idx"):
        R.mc_idx_reward(["A"])


def test_think_format_reward():
    comps = [
        "<think>red</think>Answer: A",
        "  <think>\nlong\n</think>\nB",
        "<think>x</think>",
        "<think>x</think>   ",
        "Answer: B",
        "<think>a</think><think>b</think>c",
        "pre <think>a</think> c",
        "<think>a</think> c </think>",
    ]
    assert R.think_format_reward(comps) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_accuracy_reward():
    comps = [
        "<think>..</think> 42.0",
        "Paris.",
        "x",
        "The answer is 3/4",
        "<answer> 50% </answer>",
        "so \\boxed{\\frac{1}{2}} done",
        "Answer: \\text{Blue}\nbecause",
        "1,000",
        "<think>7</think> 8",
    ]
    refs = ["42", "paris", "y", "0.75", "0.5", "\\boxed{\\frac{1}{2}}", "blue", "1000", "7"]
    assert R.accuracy_reward(comps, answer=refs) == [1, 1, 0, 1, 1, 1, 1, 1, 0]
    assert R.accuracy_reward(["<answer>4</answer>"], solution=["<answer>4</answer>"]) == [1.0]
    assert R.accuracy_reward(["4"], answer=[None]) == [0.0]
    with pytest.raises(ValueError, match="answer"):
        R.accuracy_reward(["4"])


@pytest.mark.parametrize("with_math_verify", [True, False])
def test_accuracy_reward_numbers_and_words(monkeypatch, with_math_verify):
    """Commas group digits only in threes (a list or a decimal comma is no number), integers
    match exactly, inf/nan are words, and answers of words alone are text (never products of
    one-letter symbols: "no" is not "on") — with math_verify and without."""
    import sys

    if not with_math_verify:
        monkeypatch.setitem(sys.modules, "math_verify", None)  # its import fails
    cases = [
        ("\\boxed{3,5}", "35", 0),
        ("<answer>2,3</answer>", "23", 0),
        ("<answer>1,000,000</answer>", "1000000", 1),
        ("Answer: -1,234.5", "-1234.5", 1),
        ("\\boxed{1000000}", "1000001", 0),
        ("<answer>no</answer>", "on", 0),
        ("Answer: stop", "pots", 0),
        ("<answer>Tom is older</answer>", "older is Tom", 0),
        ("<answer> Yes. </answer>", "yes", 1),
        ("Answer: Infinity", "infinity", 1),
        ("<answer>nan</answer>", "nan", 1),
        ("So 12 pages, then 1,50 more", "50", 1),  # prose: its last number
        ("<answer>2.5e3</answer>", "2500", 1),
        ("<answer>25%</answer>", "0.25", 1),
    ]
    comps, refs, want = zip(*cases)
    assert R.accuracy_reward(comps, answer=refs) == list(want)


def test_accuracy_reward_on_math_text():
    """GSM8K references end in `#### N`; a completion in prose is read by its last number,
    but a marked answer is the answer (no second chance from a number after it)."""
    refs = ["She sells 16 - 3 - 4 = 9 eggs.\n#### 18", "#### 1,000", "#### -0.75", "#### 7"]
    comps = [
        "So she makes 9 * 2 = 18 dollars.",  # prose: its last number
        "In total 1000",
        "The value is -3/4",
        "<answer>8</answer> though 7 is close",  # marked: 8
    ]
    assert R.accuracy_reward(comps, answer=refs) == [1, 1, 1, 0]
    assert R.accuracy_reward(["9 * 2 = 18, not 20"], answer=refs[:1]) == [0]  # last is 20
    assert R.answer_span(refs[0]) == " 18" and R.last_number("a 1,234.5 b") == "1,234.5"


def test_mdi_reward():
    out = R.mdi_reward(["a"] * 5, mdi=[1.0, None, 4.0, float("nan"), 1.5])
    bal = 1 - math.log(1.5) / math.log(2)
    np.testing.assert_allclose(out, [1.0, 0.0, -1.0, 0.0, 2 * bal - 1])
    assert R.mdi_reward(["a", "b"]) == [0.0, 0.0]  # no statistics: neutral
    assert R.mdi_reward(["a"], mdi=[3.0], mdi_balance_ratio=3.0) == [-1.0]
    assert R.mdi_reward(["a"] * 3, mdi=[0.0, -1.0, float("inf")]) == [-1.0, 0.0, 0.0]


def test_load_reward_fn(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text(
        "def length(completions, **kw):\n    return [float(len(c)) for c in completions]\n"
    )
    fn = R.load_reward_fn(f"{f}:length")
    assert fn(["ab", "c"]) == [2.0, 1.0]
    assert R.load_reward_fn("jaxvrl.rl.rewards:think_format_reward") is R.think_format_reward
    assert R.load_reward_fn("mc_idx") is R.mc_idx_reward
    with pytest.raises(AttributeError, match="no function"):
        R.load_reward_fn(f"{f}:nope")
    with pytest.raises(FileNotFoundError):
        R.load_reward_fn(f"{tmp_path}/missing.py:f")
    with pytest.raises(ValueError, match="module:function"):
        R.load_reward_fn("not_a_builtin")


def test_safe_reward_never_raises_and_logs_once(caplog):
    def boom(completions, **kw):
        raise RuntimeError("bad reward")

    safe = R.SafeReward("boom", boom)
    with caplog.at_level(logging.ERROR):
        for _ in range(3):
            np.testing.assert_array_equal(safe(["a", "b"]), [0.0, 0.0])
    assert safe.failures == 3
    assert caplog.text.count("RuntimeError: bad reward") == 1  # traceback logged once
    wrong_len = R.SafeReward("short", lambda c, **kw: [1.0])
    np.testing.assert_array_equal(wrong_len(["a", "b"]), [0.0, 0.0])
    assert wrong_len.failures == 1
    partial = R.SafeReward("partial", lambda c, **kw: [1.0, None, float("nan")])
    np.testing.assert_array_equal(partial(["a", "b", "c"]), [1.0, 0.0, 0.0])
    length = R.SafeReward("len", lambda c, **kw: [float(len(x)) for x in c])
    total, parts = R.total_reward(
        {"len": length, "boom": safe}, {"len": 0.5, "boom": 4.0}, ["abcd", "ab"]
    )
    np.testing.assert_array_equal(total, [2.0, 1.0])
    np.testing.assert_array_equal(parts["len"], [4.0, 2.0])


def test_reward_names_are_the_functions_names_or_the_given_ones():
    funcs = ("mc_idx", "path/to/flaky.py:flaky", "pkg.scores:length")
    assert R.reward_names(funcs) == ("mc_idx", "flaky", "length")
    assert R.reward_names(funcs, ("a", "b", "c")) == ("a", "b", "c")
    with pytest.raises(ValueError, match=r"'a.py:f' and 'b.py:f' are both named 'f'.*reward.names"):
        R.reward_names(("a.py:f", "b.py:f"))
    with pytest.raises(ValueError, match=r"reward/total, a name the run uses.*reward.names"):
        R.reward_names(("mc_idx", "x.py:total"))
    with pytest.raises(ValueError, match=r"reward/f_failures"):
        R.reward_names(("a.py:f", "b.py:f_failures"))
    with pytest.raises(ValueError, match=r"2 reward names"):
        R.reward_names(funcs, ("a", "b"))
