"""One RL iteration priced ahead of time for a completion-length mix (`python -m jaxvrl.aot
--iteration=K`): synchronous (rollout, then the train step, on every chip), partial rollouts
(`rollout.partial`), one-step-off training (`rollout.devices=K`: the rollout on K chips, the
train step on the rest, at once) and both.

A rollout's decode steps come from the slots engine's queue run on the drawn lengths
(`schedule`: every row holds a slot for as many steps as it has tokens, an ended row's slot
taken by the next waiting row at once, the loop checked every `check_every` steps and
narrowed to fewer slots as `rollout.narrow` says, each step priced at its width); partial
rollouts are `PartialRollouts` itself (trainer/partial.py) over that queue, several steps in a
row, so that carried rows and their prefills are counted as a run has them. Each decode step
costs the compiled decode step's cost-model time less the cache its running rows do not read
(on TPUs the paged kernel reads each running row's pages up to its written slot, `at_widths`:
the positions read), each prefilled token the sampler's prefill time per prompt token, the train
step its own program's time, and the weight copy of one-step-off the rollout's weights per
sampler chip over half a chip's bidirectional ICI bandwidth.
"""

from __future__ import annotations

import math
import types

import jax
import numpy as np

from jaxvrl.sampling import SampleOutput
from jaxvrl.trainer.partial import PartialRollouts

# bidirectional inter-chip interconnect bandwidth per chip, GB/s (Cloud TPU's system
# architecture pages); a copy into a chip gets half of it
ICI_GBPS = {"TPU v4": 600.0, "TPU v5e": 400.0, "TPU v5p": 1200.0, "TPU v6e": 800.0}


def _starts(lengths: np.ndarray, slots: int) -> np.ndarray:
    """int[W]: the decode step at which each row of `lengths` (queue order) takes a slot: the
    slot that frees first (the lowest-numbered on ties), as the engine's queue gives them."""
    free = np.zeros(max(1, min(slots, len(lengths))), np.int64)  # each slot's next free step
    start = np.zeros(len(lengths), np.int64)
    for r, length in enumerate(lengths):
        s = int(np.argmin(free))
        start[r], free[s] = free[s], free[s] + length
    return start


def schedule(lengths, slots: int, widths=None, groups=None, need: int = 0, check_every: int = 8):
    """The slots engine's queue on rows of `lengths` (int[W], queue order), step by step as
    `Sampler` runs it: every row holds a slot for as many steps as it has tokens, an ended
    row's slot taken by the next waiting row at once, the loop checked every `check_every`
    steps. With `groups` (int[W], -1: none) and `need`, it stops at the first check after
    `need` groups have ended whole (`sampling.engine`); with `widths` (`steps.widths`, from
    the call's slots), at each check where no row waits and at most the next width's rows
    run, it goes on at that many slots (narrowing). -> {"steps", "made": int[W] tokens each
    row produced, "ended": bool[W], "width": int[steps] the slots each step ran at, "live":
    int[steps] its running rows, "own": int[steps] their own tokens in the cache after the
    step's write}."""
    lengths = np.asarray(lengths, np.int64)
    w, start = len(lengths), _starts(lengths, slots)
    end, k = start + lengths, max(1, check_every)
    stop = int(end.max()) if w else 0
    if groups is not None and need > 0:
        groups = np.asarray(groups)
        done = sorted(end[groups == g].max() for g in set(groups.tolist()) - {-1})
        if need <= len(done):
            stop = min(stop, done[need - 1])
    stop = min(int(end.max()), -(-stop // k) * k) if w else 0
    made = np.clip(stop - start, 0, lengths)
    t = np.arange(stop)
    running = (start[None, :] <= t[:, None]) & (t[:, None] < end[None, :])
    live = running.sum(axis=1)
    own = np.where(running, t[:, None] - start[None, :] + 1, 0).sum(axis=1)
    widths = list(widths or [max(1, min(slots, w))])
    width = np.empty(stop, np.int64)
    last_start, level = int(start.max()) if w else 0, 0
    for i in range(stop):
        if i % k == 0 and i >= last_start:  # a check with no row waiting
            while level + 1 < len(widths) and live[i] <= widths[level + 1]:
                level += 1
        width[i] = widths[level]
    return dict(steps=stop, made=made, ended=made == lengths, width=width, live=live, own=own)


def at_widths(run: dict, prompt_width: int) -> dict:
    """A `schedule`'s steps by width: {width: {"steps", "read"}}, read: the cache positions
    its running rows read (each its prompt place of `prompt_width` and its own tokens up to
    the slot just written: a row that made m tokens reads prompt_width + 1, ...,
    prompt_width + m)."""
    out = {}
    for width in np.unique(run["width"]).tolist():
        at = run["width"] == width
        read = float((run["live"][at] * prompt_width + run["own"][at]).sum())
        out[width] = {"steps": float(at.sum()), "read": read}
    return out


def engine_loop(
    lengths,
    slots: int,
    prompt_len: int,
    n: int,
    *,
    widths: list[int],
    step_at: dict,
    per_slot: float,
    check_every: int = 8,
) -> dict:
    """The slots engine's decode loop on rows of `lengths` (int[W], queue order) priced step
    by step, narrowing as `Sampler` does (`schedule`). A step at width S costs `step_at[S]` =
    (the compiled decode step's seconds at S rows, the seconds per byte it was priced at)
    less the cache its running rows do not read (the step prices S rows x (prompt_len + n)
    slots of `per_slot` bytes; the paged kernel reads each running row's pages up to the
    slot just written). -> {"steps", "loop_s", "at": {S: steps at S slots}}."""
    lengths = np.minimum(np.asarray(lengths, np.int64), n)
    run = schedule(lengths, slots, widths, check_every=check_every)
    loop, at = 0.0, {}
    for width, a in at_widths(run, prompt_len).items():
        step_s, rate = step_at[width]
        unread = a["steps"] * width * (prompt_len + n) - a["read"]
        loop += a["steps"] * step_s - per_slot * unread * rate
        at[width] = int(a["steps"])
    return {"steps": run["steps"], "loop_s": loop, "at": at}


def decode_loop(
    lengths,
    prompt_len: int,
    n: int,
    *,
    step_s: float,
    weights: float,
    cache: float,
    bandwidth: float,
    check_every: int = 8,
    written_only: bool = False,
    row_block: int = 8,
    step_bytes: float = 0.0,
) -> dict:
    """A generation batch's decode loop on the static sampler, priced for completion
    `lengths` (int[B], at most n) against the sum of its steps' bounds.

    The static sampler runs every row until the longest has ended (checked every
    `check_every` steps), each step at the compiled step's time `step_s`. A step's bound is
    what it must read over the chip's HBM `bandwidth`: the decode weights (`weights` bytes
    per chip) and only the filled cache of the rows still running, each holding its prompt
    and its tokens so far (`cache`: the whole cache's bytes per chip, B rows of prompt_len +
    n slots, read in proportion). written_only: the decode kernel's reading (TPUs'
    `rollout.decode_attention`), where the compiled step is priced at the whole cache: each
    block of `row_block` rows (consecutive rows) reads up to the slot just written while
    one of its rows runs, and nothing once they have all ended; each step is priced at
    `step_s` less the unread slots' bytes at the rate the compiled step's bytes were priced
    (`step_bytes` per `step_s`: XLA's TPU cost model charges a share of the bandwidth;
    without step_bytes, at the bandwidth). -> {"steps", "loop_s",
    "bound_s", "full_bound_s"} (full_bound_s: the steps at the full cache's bound, what the
    step's own bound says)."""
    lengths = np.minimum(np.asarray(lengths, np.int64), n)
    rows = len(lengths)
    k = max(d for d in range(1, max(1, min(n, check_every)) + 1) if n % d == 0)
    steps = min(n, -(-int(lengths.max()) // k) * k) if rows else 0
    t = np.arange(steps)
    live = (lengths[None, :] > t[:, None]).sum(axis=1)  # rows fed a token at step t
    slots = live * (prompt_len + t + 1)  # their filled slots after step t's write
    per_slot = cache / (rows * (prompt_len + n))
    bound = (steps * weights + per_slot * float(slots.sum())) / bandwidth
    loop = steps * step_s
    if written_only:
        blocks = lengths.reshape(-1, row_block).max(axis=1)  # when each block's last row ends
        running = (blocks[None, :] > t[:, None]).sum(axis=1) * row_block
        read = running * (prompt_len + t + 1)
        rate = step_s / step_bytes if step_bytes else 1.0 / bandwidth  # seconds per byte
        loop -= per_slot * float((rows * (prompt_len + n) - read).sum()) * rate
    return dict(steps=steps, loop_s=loop, bound_s=bound,
                full_bound_s=steps * (weights + cache) / bandwidth)  # fmt: skip


class _Queued(PartialRollouts):
    """`PartialRollouts` whose sampler calls are the engine's queue (`schedule`) on the rows'
    forced lengths; counts decode steps (by width) and prefilled tokens."""

    def __init__(self, *args, slots: int, check_every: int, widths=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.slots, self.check_every, self.widths = slots, check_every, widths
        self.steps = self.prefilled = 0
        self.at: dict = {}

    def _sample(self, phase, params, examples, key, prefixes, **rows):
        limits = np.asarray(rows["limits"])
        run = schedule(
            limits, self.slots, self.widths, rows["groups"], int(rows["need"]), self.check_every
        )
        steps, made, ended = run["steps"], run["made"], run["ended"]
        self.steps += steps
        # every prompt place prefilled to the longest prompt's width
        width = max(len(ex["prompt_ids"]) for ex in examples)
        self.prefilled += len(examples) * width
        _add(self.at, at_widths(run, width))
        n, w = self.max_new_tokens, len(limits)
        mask = (np.arange(n)[None, :] < made[:, None]).astype(np.float32)
        zeros = np.zeros((w, n), np.float32)
        out = SampleOutput(
            tokens=zeros.astype(np.int32),
            logprobs=zeros,
            mask=mask,
            truncated=ended & (made >= limits),
            ended=ended,
        )
        return out, {"tokens": float(made.sum()), "rows": w, "prefill_s": 0.0, "decode_s": 0.0,
                     "decode_steps": float(steps), "decode_work": float(run["width"].sum())}  # fmt: skip


def _add(total: dict, at: dict, scale: float = 1.0) -> dict:
    """`total` += `at` * scale, for {width: {"steps", "read"}} entries."""
    for width, a in at.items():
        t = total.setdefault(width, {"steps": 0.0, "read": 0.0})
        for key in t:
            t[key] += a[key] * scale
    return total


def _reads(at: dict) -> float:
    """The cache positions read over every width of an `at_widths` count."""
    return float(sum(a["read"] for a in at.values()))


def rollout_work(
    lengths: np.ndarray,
    prompts: int,
    group: int,
    prompt_len: int,
    max_new_tokens: int,
    *,
    partial: bool,
    oversample: float = 2.0,
    max_staleness: int = 1,
    slots: int | None = None,
    check_every: int = 8,
    widths: list[int] | None = None,
) -> dict:
    """Per trained step, over the steps the drawn `lengths` fill (each step `prompts` groups of
    `group` rows; slots: the decode rows, default the step's rows; widths: the narrowing
    ladder, `steps.widths`, default none): {"decode_steps", "prefill_tokens", "groups",
    "read_positions", "at": {width: {"steps", "read"}}} averaged per step (`at_widths`;
    read_positions: the reads over every width). Synchronous: each step's rows to their end; partial: `PartialRollouts`
    carrying rows from step to step."""
    rows = prompts * group
    slots = slots or rows
    if not partial:
        steps = len(lengths) // rows
        runs = [
            schedule(lengths[i * rows : (i + 1) * rows], slots, widths, check_every=check_every)
            for i in range(steps)
        ]
        at: dict = {}
        for r in runs:
            _add(at, at_widths(r, prompt_len), 1.0 / steps)
        return {"decode_steps": float(np.mean([r["steps"] for r in runs])),
                "prefill_tokens": float(prompts * prompt_len), "groups": float(prompts),
                "read_positions": _reads(at), "at": at}  # fmt: skip
    queue = _Queued(
        prompts, group, max_new_tokens, oversample=oversample, max_staleness=max_staleness,
        row_limit=lambda ex, j: ex["lengths"][j], slots=slots, check_every=check_every,
        widths=widths,
    )  # fmt: skip
    per = iter(lengths.reshape(-1, group))

    def examples():
        for _ in range(len(lengths) // rows):
            yield [{"prompt_ids": [0] * prompt_len, "lengths": next(per)} for _ in range(prompts)]

    phase = types.SimpleNamespace(
        make_groups=lambda p, ex, *a: [types.SimpleNamespace() for _ in ex]
    )
    it, trained, steps = examples(), 0, 0
    budget = len(lengths) // rows - math.ceil(oversample) - 1  # leave rows for the last call
    for step in range(max(1, budget)):
        try:
            groups, _ = queue.generate(phase, None, it, jax.random.key(step), step)
        except StopIteration:
            break
        trained, steps = trained + len(groups), step + 1
        queue.take_metrics(groups, step)
    at = _add({}, queue.at, 1.0 / steps)
    return {"decode_steps": queue.steps / steps, "prefill_tokens": queue.prefilled / steps,
            "groups": trained / steps, "read_positions": _reads(at), "at": at}  # fmt: skip


def price(
    *,
    decode_s: float | dict,
    prefill_s_per_token: float,
    train_s: float,
    work: dict,
    copy_s: float = 0.0,
    positions: float = 0.0,
    position_s: float | dict = 0.0,
    split_train_s: float | None = None,
    split_decode_s: float | dict | None = None,
    split_prefill_s_per_token: float | None = None,
    split_position_s: float | dict = 0.0,
    split_work: dict | None = None,
) -> dict:
    """One iteration's phases (seconds): the rollout from `work` (`rollout_work`) at
    `decode_s` per decode step, less `position_s` for each of the compiled step's cache
    `positions` (its rows x their slots, all priced in `decode_s`) its running rows do not
    read, and `prefill_s_per_token`, then `train_s`; with the split's figures (one-step-off;
    its own `split_work` where its rollout narrows otherwise), the larger of its rollout and
    its train step, plus the copy. A narrowing rollout: `decode_s` and `position_s` by width
    ({rows: seconds}, each width's own compiled step), `positions` each row's slots, and the
    work's steps and reads by width (`work["at"]`)."""

    def decoding(work, step_s, per_position):
        if isinstance(step_s, dict):
            total = 0.0
            for width, a in work["at"].items():
                unread = max(a["steps"] * width * positions - a["read"], 0.0)
                total += a["steps"] * step_s[width] - unread * per_position[width]
            return total
        unread = max(work["decode_steps"] * positions - work.get("read_positions", 0.0), 0.0)
        return work["decode_steps"] * step_s - unread * per_position

    rollout = decoding(work, decode_s, position_s) + work["prefill_tokens"] * prefill_s_per_token
    out = {
        "rollout_s": rollout,
        "train_s": train_s,
        "copy_s": 0.0,
        "iteration_s": rollout + train_s,
    }
    if split_train_s is not None:
        work = split_work or work
        rollout = (
            decoding(work, split_decode_s, split_position_s)
            + work["prefill_tokens"] * split_prefill_s_per_token
        )
        out = {"rollout_s": rollout, "train_s": split_train_s, "copy_s": copy_s,
               "iteration_s": max(rollout, split_train_s) + copy_s}  # fmt: skip
    return out
