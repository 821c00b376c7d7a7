"""The rollout phase's group collection (no model): dynamic sampling refill across generation
batches, its limit and endless-loop guard, online filtering, the replay buffer, and batch
assembly with padding groups."""

from __future__ import annotations

import numpy as np
import pytest

from jaxvrl import rl
from jaxvrl.trainer.groups import GroupsExhausted
from jaxvrl.trainer.rollout import FilterOptions, Group, assemble, collect_groups

G, N = 2, 3


def group(name: str, rewards, acc=None) -> Group:
    r = np.asarray(rewards, np.float64)
    return Group(
        example={"problem": name},
        tokens=np.ones((G, N), np.int32),
        mask=np.ones((G, N), np.float32),
        truncated=np.zeros(G, bool),
        totals=r,
        parts={"acc": np.asarray(r if acc is None else acc, np.float64)},
        texts=[name] * G,
        att={},
    )


def batches(*specs):
    """generate(i) over lists of (name, rewards) -> groups; records the calls."""
    calls = []

    def generate(i):
        calls.append(i)
        return [group(n, r) for n, r in specs[i]]

    return generate, calls


def names(slots):
    return [None if s is None else s.example["problem"] for s in slots]


VAR, CONST = (0.0, 1.0), (1.0, 1.0)


def test_dynamic_sampling_refills_until_the_batch_is_full():
    gen, calls = batches(
        [("a", CONST), ("b", VAR), ("c", CONST)],
        [("d", VAR), ("e", (0.0, 0.0)), ("f", VAR)],
        [("g", VAR), ("h", VAR), ("i", VAR)],
    )
    opts = FilterOptions(G, 3, N, dynamic_sampling=True, max_num_gen_batches=5)
    got = collect_groups(gen, opts)
    assert calls == [0, 1] and got.gen_batches == 2
    assert names(got.groups) == ["b", "d", "f"]  # the informative groups, in order
    assert got.kept == 3 and len(got.sampled) == 6


def test_dynamic_sampling_stops_at_the_limit_and_leaves_slots_empty():
    gen, calls = batches(
        [("a", CONST), ("b", VAR), ("c", CONST)],
        [("d", CONST), ("e", CONST), ("f", CONST)],
        [("g", VAR), ("h", VAR), ("i", VAR)],
    )
    opts = FilterOptions(G, 3, N, dynamic_sampling=True, max_num_gen_batches=2)
    got = collect_groups(gen, opts)
    assert calls == [0, 1] and names(got.groups) == ["b", None, None]


def test_dynamic_sampling_without_limit_is_guarded_by_one_pass_over_the_data():
    gen, calls = batches(*[[("x", CONST)] * 3] * 10)
    opts = FilterOptions(G, 3, N, dynamic_sampling=True, max_num_gen_batches=0)
    with pytest.raises(GroupsExhausted, match=r"found 0 of the 3 groups.*after 4 generation batc"):
        collect_groups(gen, opts, max_prompts=10)
    assert calls == [0, 1, 2, 3]  # 12 prompts >= the 10 training prompts


def test_a_done_process_keeps_generating_while_another_needs_groups():
    """Several processes: generate() is a collective, so a process whose groups are complete
    after batch 0 must go on calling it (and drop what it gets) until the others are done."""
    gen, calls = batches(*[[("a", VAR), ("b", VAR)], [("c", VAR), ("d", VAR)]] * 2)
    other_needs = iter([True, True, False])  # another process fills its slots after 3 batches

    def any_process(pending):
        return pending or next(other_needs)

    opts = FilterOptions(G, 2, N, dynamic_sampling=True, max_num_gen_batches=0)
    got = collect_groups(gen, opts, any_process=any_process)
    assert calls == [0, 1, 2]
    assert names(got.groups) == ["a", "b"] and len(got.sampled) == 2 and got.gen_batches == 1


def test_dynamic_sampling_metric_by_reward_name():
    got = collect_groups(
        lambda i: [group("a", VAR, acc=(1.0, 1.0)), group("b", CONST, acc=(0.0, 1.0))],
        FilterOptions(G, 2, N, dynamic_sampling=True, dynamic_sampling_metric="acc"),
    )
    assert names(got.groups) == ["b", None]


def test_without_dynamic_sampling_one_batch_is_used_as_it_is():
    gen, calls = batches([("a", CONST), ("b", VAR)], [("c", VAR), ("d", VAR)])
    got = collect_groups(gen, FilterOptions(G, 2, N, max_num_gen_batches=4))
    assert calls == [0] and names(got.groups) == ["a", "b"]


def test_online_filtering_keeps_groups_with_mean_strictly_inside():
    gen, _ = batches([("a", (0.0, 0.0)), ("b", (0.0, 1.0)), ("c", (1.0, 1.0))])
    opts = FilterOptions(G, 3, N, online_filtering=True, filter_key="acc", filter_low=0.01)
    assert names(collect_groups(gen, opts).groups) == ["b", None, None]


def test_replay_buffer_replaces_uninformative_groups_and_stores_informative_ones():
    buf = rl.ReplayBuffer(capacity=2)
    opts = FilterOptions(G, 3, N)
    first = collect_groups(lambda i: [group(n, VAR) for n in "abc"], opts, replay=buf)
    assert first.replaced == 0 and len(buf) == 2  # capacity 2: "a" fell out
    second = collect_groups(
        lambda i: [group("d", CONST), group("e", VAR), group("f", CONST)], opts, replay=buf
    )
    # most recent first; a replayed group is used once; "e" goes into the buffer
    assert names(second.groups) == ["c", "e", "b"] and second.replaced == 2
    assert [g.example["problem"] for g in buf._items] == ["e"]


def test_replay_buffer_fills_slots_dynamic_sampling_left_empty():
    buf = rl.ReplayBuffer()
    buf.add(group("old", VAR))
    opts = FilterOptions(G, 2, N, dynamic_sampling=True, max_num_gen_batches=1)
    got = collect_groups(lambda i: [group("a", CONST), group("b", VAR)], opts, replay=buf)
    assert names(got.groups) == ["b", "old"] and got.replaced == 1 and len(buf) == 1


def test_padding_groups_take_no_part_in_the_batch():
    pad = Group.padding({"problem": "p"}, G, N)
    real = group("a", VAR)
    groups = [real, pad]
    rb = assemble(
        np.ones((4, 2), np.int32),
        np.ones((4, 2), np.int32),
        np.zeros((3, 4, 2), np.int32),
        np.zeros(4, np.int32),
        np.concatenate([g.tokens for g in groups]),
        np.concatenate([g.mask for g in groups]),
        np.concatenate([g.totals for g in groups]),
        np.ones(4, bool),
    )
    np.testing.assert_array_equal(rb.completion_mask.sum(1), [N, N, 0, 0])
    np.testing.assert_array_equal(rb.attention_mask[:, 2:].sum(1), [N, N, 0, 0])
    np.testing.assert_array_equal(rb.rewards, [0.0, 1.0, 0.0, 0.0])
    assert rb.input_ids.shape == (4, 2 + N)
