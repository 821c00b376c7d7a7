"""Rollout-level filters and reward schedules on the host (docs/algorithms.md: rewards,
overlong completions, rollout filtering)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxvrl import rl


def test_dynamic_sampling_and_online_filter():
    scores = np.array([1, 1, 1, 0, 1, 0, 0, 0, 0, 0.5, 0.5, 0.5 + 1e-6], float)
    np.testing.assert_array_equal(rl.dynamic_sampling_keep(scores, 3), [0, 1, 0, 1])
    np.testing.assert_array_equal(rl.online_filter_keep(scores, 3, 0.1, 0.9), [0, 1, 0, 1])
    # strict bounds: a mean equal to filter_low is dropped
    np.testing.assert_array_equal(rl.online_filter_keep(scores, 3, 1 / 3, 0.9), [0, 0, 0, 1])
    with pytest.raises(ValueError, match="groups"):
        rl.dynamic_sampling_keep(scores, 5)


def test_dynamic_sampler_fills_across_generation_batches():
    s = rl.DynamicSampler(target_groups=3, max_num_gen_batches=3)
    s.add(["a", "b"], [True, False])
    assert not s.done
    s.add(["c", "d"], [True, True])
    assert s.full and s.done
    assert s.take() == ["a", "c", "d"]
    assert s.num_gen_batches == 0 and not s.done
    for _ in range(3):
        s.add(["x"], [False])
    assert s.done and not s.full and s.take() == []  # limit reached, caller decides
    with pytest.raises(ValueError, match="keep"):
        s.add(["a"], [True, False])


def test_mask_truncated_and_soft_overlong():
    np.testing.assert_array_equal(
        rl.mask_truncated_completions(np.ones((2, 3)), np.array([False, True])),
        [[1, 1, 1], [0, 0, 0]],
    )
    # L_max = 10, buffer 4: 0 up to 6, then -(L - 6) / 4, -1 from 10 on; times 2
    pen = rl.soft_overlong_punishment(np.array([5, 6, 8, 9, 10, 12]), 10, 4, factor=2.0)
    np.testing.assert_allclose(pen, [0, 0, -1.0, -1.5, -2.0, -2.0])
    hard = rl.soft_overlong_punishment(np.array([9, 10]), 10, 0, factor=0.5)
    np.testing.assert_allclose(hard, [0, -0.5])


def test_two_stage_reward_weights():
    regular, early = {"mc_idx": 4.0, "think_format": 1.0, "mdi": 1.0}, {"think_format": 2.0}
    assert rl.stage_reward_weights(0, regular, early, 5) == {
        "mc_idx": 4.0,
        "think_format": 2.0,
        "mdi": 1.0,
    }
    assert rl.stage_reward_weights(4, regular, early, 5)["think_format"] == 2.0
    assert rl.stage_reward_weights(5, regular, early, 5) == regular
    assert rl.stage_reward_weights(0, regular, None, 5) == regular


def test_replay_buffer():
    buf = rl.ReplayBuffer(capacity=2, min_std=0.1, max_mean=0.9)
    # groups: std 0.5 mean 0.5 | std 0 | std 0.5 mean 1.5 (> max_mean)
    info = buf.informative(np.array([0, 1, 1, 1, 1, 2]), 2)
    np.testing.assert_array_equal(info, [True, False, False])
    out, n = buf.fill(["g1", "u1", "u2"], info)
    assert n == 0 and out == ["g1", "u1", "u2"]  # empty buffer: nothing to replace with
    assert len(buf) == 1
    out, n = buf.fill(["g2", "g3", "g4"], [True, True, True])
    assert n == 0 and len(buf) == 2  # capacity 2: g1 fell out
    out, n = buf.fill(["u3", "g5", "u4", "u5"], [False, True, False, False])
    # most recent first, each stored group used once, this batch's g5 is not replayed
    assert n == 2 and out == ["g4", "g5", "g3", "u5"]
    assert len(buf) == 1


def test_replay_buffer_contents_and_load():
    buf = rl.ReplayBuffer(capacity=2)
    buf.fill(["g1", "g2", "g3"], [True, True, True])
    assert buf.contents() == ["g2", "g3"]  # oldest first
    fresh = rl.ReplayBuffer(capacity=2)
    fresh.load(["x", "g2", "g3"])  # past capacity, the oldest fall out
    assert fresh.contents() == ["g2", "g3"]
    out, n = fresh.fill(["u"], [False])
    assert n == 1 and out == ["g3"] and fresh.contents() == ["g2"]  # most recent first
