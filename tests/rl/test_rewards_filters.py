"""Host-side rewards and rollout filters (SPEC sections 6-7)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from jaxvrl import rl
from jaxvrl.rl import rewards as R


@pytest.mark.parametrize(
    "text,letter",
    [
        ("Answer: B", "B"),
        ("the answer is (C).", "C"),
        ("答案: D", "D"),
        ("答案：A", "A"),
        ("选项: E", "E"),
        ("I pick (F)", "F"),
        ("<answer>G</answer>", "G"),
        ("答案：Ｈ", "H"),
        ("<think>maybe A or B</think> Answer: C", "C"),
        ("<think>Answer: A</think>so it is B", "B"),
        ("A cat sits. I think J", "J"),
        ("no letter here", None),
        ("answer: c", "C"),
    ],
)
def test_extract_choice(text, letter):
    assert R.extract_choice(text) == letter


def test_mc_idx_and_think_format():
    comps = ["<think>red</think>Answer: A", "<think>x</think>", "Answer: B", "(C)"]
    assert R.mc_idx_reward(comps, label_idx=[0, 1, 1, "C"]) == [1.0, 0.0, 1.0, 1.0]
    assert R.think_format_reward(comps) == [1.0, 0.0, 0.0, 0.0]
    assert R.think_format_reward(["<think>a</think><think>b</think>c"]) == [0.0]


def test_accuracy_and_mdi_rewards():
    assert R.accuracy_reward(
        ["<think>..</think> 42.0", "Paris.", "x"], answer=["42", "paris", "y"]
    ) == [1.0, 1.0, 0.0]
    out = R.mdi_reward(["a", "b", "c"], mdi=[1.0, None, 4.0])
    assert out == [1.0, 0.0, -1.0]


def test_user_reward_by_path_and_safe_wrapper(tmp_path, caplog):
    f = tmp_path / "my_reward.py"
    f.write_text(
        "def length(completions, **kw):\n    return [float(len(c)) for c in completions]\n"
        "def boom(completions, **kw):\n    raise RuntimeError('bad reward')\n"
    )
    fn = R.load_reward_fn(f"{f}:length")
    assert fn(["ab", "c"]) == [2.0, 1.0]
    assert R.load_reward_fn("jaxvrl.rl.rewards:think_format_reward") is R.think_format_reward
    with pytest.raises(AttributeError, match="no function"):
        R.load_reward_fn(f"{f}:nope")
    safe = R.SafeReward("boom", R.load_reward_fn(f"{f}:boom"))
    with caplog.at_level(logging.ERROR):
        for _ in range(3):
            np.testing.assert_array_equal(safe(["a", "b"]), [0.0, 0.0])
    assert safe.failures == 3
    assert caplog.text.count("RuntimeError: bad reward") == 1  # traceback logged once
    total, parts = R.total_reward(
        {"len": R.SafeReward("len", fn), "boom": safe}, {"len": 0.5}, ["abcd", "ab"]
    )
    np.testing.assert_array_equal(total, [2.0, 1.0])


def test_filters():
    scores = np.array([1, 1, 1, 0, 1, 0, 0, 0, 0], float)
    np.testing.assert_array_equal(rl.dynamic_sampling_keep(scores, 3), [False, True, False])
    np.testing.assert_array_equal(rl.online_filter_keep(scores, 3, 0.1, 0.9), [False, True, False])
    np.testing.assert_array_equal(rl.expand_groups([True, False], 2), [True, True, False, False])
    mask = np.ones((2, 3))
    np.testing.assert_array_equal(
        rl.mask_truncated_completions(mask, np.array([False, True])), [[1, 1, 1], [0, 0, 0]]
    )
    pen = rl.soft_overlong_punishment(np.array([5, 8, 9, 10, 12]), 10, 4, factor=2.0)
    np.testing.assert_allclose(pen, [0, -1.0, -1.5, -2.0, -2.0])
    w = rl.stage_reward_weights(3, {"a": 1.0, "b": 2.0}, {"b": 0.0}, 5)
    assert w == {"a": 1.0, "b": 0.0}
    assert rl.stage_reward_weights(5, {"a": 1.0, "b": 2.0}, {"b": 0.0}, 5)["b"] == 2.0


def test_replay_buffer_replaces_uninformative_groups():
    buf = rl.ReplayBuffer(capacity=2, min_std=0.1)
    good = [{"id": 1}, {"id": 2}]
    info = buf.informative(np.array([0, 1, 1, 1]), 2)
    np.testing.assert_array_equal(info, [True, False])
    out, n = buf.fill(good, info)
    assert n == 0 and out == good  # nothing older in the buffer yet
    later = [{"id": 3}, {"id": 4}]
    out, n = buf.fill(later, np.array([False, False]))
    assert n == 1 and out == [{"id": 1}, {"id": 4}]  # one stored group, one replacement
    assert len(buf) == 1
