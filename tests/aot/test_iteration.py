"""The AOT tool's iteration price (`jaxvrl.aot.iteration`): the synchronous rollout's decode
steps are each step's longest row when every row has a slot; partial rollouts (the trainer's
own `PartialRollouts` over the engine's queue) train the step's groups every step in fewer
decode steps on a long-tailed mix, and count the carried rows' prefills; one-step-off is the
larger of the two sides plus the weight copy. (That the queue model counts the engine's steps:
tests/sampling/test_engine.py.) A static sampler's decode loop for a length mix runs to its
longest row (rounded up to its checks) at the compiled step's time; its bound sums each
step's weights and the filled cache of the rows still running."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from jaxvrl.aot.iteration import decode_loop, engine_loop, price, rollout_work, schedule
from jaxvrl.aot.plan import completion_lengths

P, G, N, PROMPT = 4, 4, 256, 32


@pytest.fixture(scope="module")
def lengths():
    return completion_lengths("lognormal:median=48,sigma=0.8", P * G * 20, N, seed=3)


def test_synchronous_steps_are_each_steps_longest_row(lengths):
    got = rollout_work(lengths, P, G, PROMPT, N, partial=False)
    want = lengths.reshape(-1, P * G).max(axis=1).mean()
    # each row reads PROMPT + 1, ..., PROMPT + length positions over its steps
    read = sum(PROMPT + t for n in lengths for t in range(1, int(n) + 1)) / (len(lengths) / P / G)
    at = got.pop("at")
    assert got == pytest.approx(
        {"decode_steps": want, "prefill_tokens": P * PROMPT, "groups": P, "read_positions": read}
    )
    assert list(at) == [P * G]  # every step at all rows: no narrowing
    assert at[P * G] == pytest.approx({"steps": want, "read": read})
    # fewer slots than rows: each row holds a slot for its length, the queue in order
    run = schedule([5, 3, 4, 1], slots=2, check_every=1)
    steps, made, ended = run["steps"], run["made"], run["ended"]
    assert (steps, made.tolist(), ended.all()) == (7, [5, 3, 4, 1], True)  # 0-5, 0-3, 3-7, 5-6


def test_partial_rollouts_train_every_group_in_fewer_steps(lengths):
    sync = rollout_work(lengths, P, G, PROMPT, N, partial=False)
    part = rollout_work(lengths, P, G, PROMPT, N, partial=True, max_staleness=4)
    assert part["groups"] == P
    assert part["decode_steps"] < 0.8 * sync["decode_steps"], (part, sync)
    assert part["prefill_tokens"] > sync["prefill_tokens"]  # carried rows prefilled again


def test_one_step_off_takes_the_larger_side_plus_the_copy():
    work = {"decode_steps": 100.0, "prefill_tokens": 1000.0}
    whole = dict(decode_s=0.01, prefill_s_per_token=1e-4, train_s=3.0, work=work)
    sync = price(**whole)
    assert sync["iteration_s"] == pytest.approx(1.0 + 0.1 + 3.0)
    off = price(**whole, split_train_s=5.0, split_decode_s=0.02, split_prefill_s_per_token=2e-4,
                copy_s=0.5)  # fmt: skip
    assert off["rollout_s"] == pytest.approx(2.2) and off["iteration_s"] == pytest.approx(5.5)


def test_decode_steps_are_priced_less_the_cache_their_rows_do_not_read(lengths):
    """The paged kernel reads each running row's pages to its written slot: a step priced at
    the compiled step's whole cache (rows x slots positions) is charged less for each position
    no running row reads."""
    # 2 rows, a prompt of 3 and 4 slots each; rows of 2 and 4 tokens: 4 steps of 2 x 7
    # positions priced; read 3 + 1, 3 + 2 then 3 + 1, ..., 3 + 4
    steps = schedule([2, 4], slots=2, check_every=1)["steps"]
    read = (4 + 5) + (4 + 5 + 6 + 7)
    work = {"decode_steps": float(steps), "prefill_tokens": 0.0, "read_positions": read}
    got = price(decode_s=1.0, prefill_s_per_token=0.0, train_s=0.0, work=work, positions=14.0,
                position_s=0.01)  # fmt: skip
    assert got["rollout_s"] == pytest.approx(4 * 1.0 - (4 * 14 - read) * 0.01)
    from jaxvrl.aot.iteration import at_widths

    assert at_widths(schedule([2, 4], slots=2, check_every=1), 3) == {
        2: {"steps": 4.0, "read": read}
    }
    # partial rollouts count what their calls' rows read, after prompt places of their width
    part = rollout_work(lengths, P, G, PROMPT, N, partial=True)
    assert 0 < part["read_positions"] < part["decode_steps"] * 2 * P * G * (PROMPT + N)


def test_the_decode_loop_against_the_running_rows_filled_cache():
    # rows of 3, 1 and 5 tokens after prompts of 4 slots, caches of 4 + 6: at steps 0..4 the
    # running rows are 3, 2, 2, 1, 1, holding 5, 6, 7, 8, 9 slots each after the step's write
    got = decode_loop([3, 1, 5], 4, 6, step_s=2.0, weights=100.0, cache=30.0, bandwidth=1.0,
                      check_every=1)  # fmt: skip
    slots = 3 * 5 + 2 * 6 + 2 * 7 + 1 * 8 + 1 * 9
    want = dict(steps=5, loop_s=10.0, bound_s=5 * 100 + slots * 30 / (3 * 10),
                full_bound_s=5 * 130.0)  # fmt: skip
    assert got == pytest.approx(want)
    # the decode kernel, blocks of one row: row r reads 4 + t + 1 of its 10 slots at step t
    # while it runs, nothing after; the compiled step (130 here) is priced at all 10
    kernel_loop = functools.partial(
        decode_loop, step_s=130.0, weights=100.0, bandwidth=1.0, check_every=1, written_only=True
    )
    kernel = kernel_loop([3, 1, 5], 4, 6, cache=30.0, row_block=1)
    unread = 5 * 3 * 10 - slots
    assert kernel["loop_s"] == pytest.approx(5 * 130.0 - unread * 30 / (3 * 10))
    # blocks of rows (0, 1) and (2, 3): the first reads while row 0 runs (3 steps)
    two = kernel_loop([3, 1, 5, 2], 4, 6, cache=40.0, row_block=2)
    read = 2 * sum(5 + t for t in range(3)) + 2 * sum(5 + t for t in range(5))
    assert two["loop_s"] == pytest.approx(5 * 130.0 - (5 * 4 * 10 - read) * 40 / (4 * 10))
    # the compiled step priced its 520 bytes at 130 s (a quarter of a second a byte, where
    # the bandwidth says one): the unread bytes at that rate
    rated = kernel_loop([3, 1, 5, 2], 4, 6, cache=40.0, row_block=2, step_bytes=520.0)
    assert rated["loop_s"] == pytest.approx(5 * 130.0 - (5 * 4 * 10 - read) * 40 / (4 * 10) / 4)
    # checked every 8 steps (the largest divisor of n = 6 up to 8: 6), the 5-token row's loop
    # runs 6 steps; checked every 4 (divisor 3), rows of 2 and 1 tokens: 3
    assert decode_loop([3, 1, 5], 4, 6, step_s=1, weights=1, cache=1, bandwidth=1)["steps"] == 6
    assert decode_loop([2, 1], 4, 6, step_s=1, weights=1, cache=1, bandwidth=1,
                       check_every=4)["steps"] == 3  # fmt: skip


def test_the_engine_loop_narrows_as_the_sampler_does():
    """`engine_loop` with one width is the paged kernel's slot-per-row loop above; narrowing
    [4, 2, 1] on rows of 3, 1, 5 and 2 tokens (checked every 2 steps): at step 0 four run
    (4 slots), at the check of step 2 two (rows 0 and 2: 2 slots), at step 4 one (row 2: 1
    slot), each step priced at its width's own compiled step less the slots it does not
    read (each width prices width x 10 slots of 1 byte)."""
    lengths, prompt, n = [3, 1, 5, 2], 4, 6
    kw = dict(per_slot=1.0, check_every=2)
    one = engine_loop(lengths, 4, prompt, n, widths=[4], step_at={4: (130.0, 1.0)}, **kw)
    kernel = decode_loop(lengths, prompt, n, step_s=130.0, weights=100.0, cache=40.0,
                         bandwidth=1.0, check_every=1, written_only=True, row_block=1)  # fmt: skip
    assert one["steps"] == kernel["steps"] == 5 and one["loop_s"] == pytest.approx(kernel["loop_s"])
    step_at = {4: (130.0, 1.0), 2: (60.0, 0.5), 1: (30.0, 0.25)}
    got = engine_loop(lengths, 4, prompt, n, widths=[4, 2, 1], step_at=step_at, **kw)
    # positions read at step t: each running row's 4 + t + 1
    read = [4 * 5, 2 * 6, 2 * 7, 1 * 8, 1 * 9]  # rows running: 4, 3 -> (0, 2) at 2, 2 at 4
    read[1] = 3 * 6
    want = (130 - (40 - read[0])) + (130 - (40 - read[1]))
    want += (60 - (20 - read[2]) * 0.5) + (60 - (20 - read[3]) * 0.5) + (30 - (10 - read[4]) / 4)
    assert got == {"steps": 5, "loop_s": pytest.approx(want), "at": {4: 2, 2: 2, 1: 1}}


def test_an_iteration_prices_each_width_of_a_narrowing_rollout(lengths):
    """With the narrowing ladder, `rollout_work` counts each call's steps and reads by width
    (as `engine_loop` runs them; summing to the totals), and `price` charges each width's own
    step less what its running rows do not read."""
    ladder = [P * G, P * G // 2, P * G // 4]
    for partial in (False, True):
        flat = rollout_work(lengths, P, G, PROMPT, N, partial=partial)
        got = rollout_work(lengths, P, G, PROMPT, N, partial=partial, widths=ladder)
        if not partial:  # the same steps and reads, now by width; the same as engine_loop's
            assert got["decode_steps"] == flat["decode_steps"]
            one = lengths[: P * G]
            loop = engine_loop(one, P * G, PROMPT, N, widths=ladder,
                               step_at={w: (0.0, 0.0) for w in ladder}, per_slot=0.0)  # fmt: skip
            assert sum(loop["at"].values()) == loop["steps"] and set(loop["at"]) <= set(ladder)
            assert got["at"][P * G // 4]["steps"] > 0  # the long tail at a quarter of the rows
        assert set(got["at"]) <= set(ladder)
        assert sum(a["steps"] for a in got["at"].values()) == pytest.approx(got["decode_steps"])
        # narrowing moves the steps between widths, not what the rows read
        assert got["read_positions"] == pytest.approx(flat["read_positions"])
    # by hand: 2 rows of 2 and 4 tokens after a prompt of 3, 4 slots each, checked every step,
    # narrowing [2, 1]: 2 steps at 2 rows (read 4 + 4, 5 + 5), 2 at 1 row (read 6, 7)
    work = rollout_work(np.array([2, 4]), 1, 2, 3, 4, partial=False, widths=[2, 1], check_every=1)
    assert work["at"] == {2: {"steps": 2.0, "read": 18.0}, 1: {"steps": 2.0, "read": 13.0}}
    got = price(decode_s={2: 1.0, 1: 0.5}, prefill_s_per_token=0.0, train_s=0.0, work=work,
                positions=7.0, position_s={2: 0.01, 1: 0.02})  # fmt: skip
    want = 2 * 1.0 - (2 * 14 - 18) * 0.01 + 2 * 0.5 - (2 * 7 - 13) * 0.02
    assert got["rollout_s"] == pytest.approx(want)
    # one width: the same price as the totals' (the whole cache's positions per step)
    one = rollout_work(np.array([2, 4]), 1, 2, 3, 4, partial=False, check_every=1)
    by_width = price(decode_s={2: 1.0}, prefill_s_per_token=0.0, train_s=0.0, work=one,
                     positions=7.0, position_s={2: 0.01})  # fmt: skip
    total = price(decode_s=1.0, prefill_s_per_token=0.0, train_s=0.0, work=one, positions=14.0,
                  position_s=0.01)  # fmt: skip
    assert by_width["rollout_s"] == pytest.approx(total["rollout_s"])
