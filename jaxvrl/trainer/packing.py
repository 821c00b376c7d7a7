"""Fitting a rollout batch to its real tokens before the train step (on the host).

1. The completion axis is cut to the batch's longest completion, rounded up to one of eight
   buckets of max_new_tokens (`completion_bucket`), so no pass computes columns that every
   row left empty; the RL math is unchanged (cut columns are padding of every row).
2. With `actor.padding_free`, each micro-batch's rows are packed into buffers
   (`jaxvrl.models.Packing`): the host spreads the rows of every pass the step makes (the
   experience passes' and each update's, of `update_order`) over its micro-batches and device
   groups by token load, and places each group's rows in its device's buffers, first-fit by
   decreasing length; the buffer count (a power of two) and length (a quarter of the padded
   row times 1, 2, 3, 4, 6, ..., up to four rows) are those of the fewest slots that hold
   every micro-batch, the experience's and the updates' each their own.
3. A run compiles one program per step shape; its `StepShapes` lets a batch take a shape
   compiled before where that costs little more than its own (`StepShapes.choose`).
4. With `actor.dynamic_batching`, the micro-batch count too is the batch's: the fewest whose
   micro-batches fit `actor.max_token_len_per_device` tokens per device.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import numpy as np

from jaxvrl.data.buckets import length_bucket
from jaxvrl.parallel import runtime
from jaxvrl.parallel.sharding import row_shards, sequence_shards
from jaxvrl.trainer.passes import RolloutBatch
from jaxvrl.trainer.state import StepConfig
from jaxvrl.trainer.update import update_order

log = logging.getLogger("jaxvrl")

BUCKETS = 8  # completion lengths are cut to a multiple of max_new_tokens / BUCKETS


def completion_bucket(longest: int, max_new_tokens: int) -> int:
    """The completion length a batch whose longest completion has `longest` tokens runs at:
    a multiple of ceil(max_new_tokens / 8), at most max_new_tokens."""
    step = -(-max_new_tokens // BUCKETS)
    return min(max_new_tokens, length_bucket(max(longest, 1), step))


def cut_completions(batch: RolloutBatch, n: int) -> RolloutBatch:
    """The batch (host arrays) with its completion axis cut to the first n columns."""
    keep = batch.input_ids.shape[1] - batch.completion_length + n
    cut = lambda x: None if x is None else x[..., :keep]  # noqa: E731
    return batch.replace(
        input_ids=cut(batch.input_ids),
        attention_mask=cut(batch.attention_mask),
        position_ids=cut(batch.position_ids),
        completion_mask=batch.completion_mask[:, :n],
        pools=None if batch.pools is None else {k: cut(v) for k, v in batch.pools.items()},
        old_logprobs=None if batch.old_logprobs is None else batch.old_logprobs[:, :n],
        old_entropy=None if batch.old_entropy is None else batch.old_entropy[:, :n],
        old_vision_mass=None if batch.old_vision_mass is None else batch.old_vision_mass[..., :n],
        old_text_mass=None if batch.old_text_mass is None else batch.old_text_mass[..., :n],
        routes=None if batch.routes is None else batch.routes[:, :keep],
    )


def pad_prompts(batch: RolloutBatch, multiple: int) -> RolloutBatch:
    """The batch (host arrays) with its prompt axis left-padded (tokens no query sees) so that
    a row's length is a multiple of `multiple` (the devices a row's tokens split over)."""
    extra = -batch.input_ids.shape[1] % multiple
    if not extra:
        return batch

    def pad(x, axis=-1, mode="constant"):  # zeros (token 0, no pool, no route) in front
        if x is None:
            return None
        x = np.asarray(x)
        widths = [(0, 0)] * x.ndim
        widths[axis] = (extra, 0)
        return np.pad(x, widths, mode=mode)

    return batch.replace(
        input_ids=pad(batch.input_ids),
        attention_mask=pad(batch.attention_mask),
        position_ids=pad(batch.position_ids, mode="edge"),
        pools=None if batch.pools is None else {k: pad(v) for k, v in batch.pools.items()},
        routes=pad(batch.routes, axis=1),
    )


def span_unit(length: int, mesh) -> int:
    """A quarter of the padded row `length` (the step packed buffers' lengths are multiples
    of), rounded up to a multiple of the devices a row's tokens split over."""
    return length_bucket(-(-length // SPANS), sequence_shards(mesh))


SPANS = 4  # buffer lengths are multiples of a quarter of the padded row, up to four rows


def first_fit(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, int]:
    """(start int32[b], buffers): rows of `lengths` tokens placed in buffers of `capacity`
    slots (flattened: buffer i's slots are i x capacity ...), first-fit by decreasing
    length; buffers: how many it opened."""
    start = np.zeros(len(lengths), np.int32)
    fill: list[int] = []  # tokens used in each open buffer
    for r in np.argsort(-lengths, kind="stable"):
        n = int(lengths[r])
        k = next((i for i, used in enumerate(fill) if used + n <= capacity), len(fill))
        if k == len(fill):
            fill.append(0)
        start[r] = k * capacity + fill[k]
        fill[k] += n
    return start, len(fill)


def balance(rows: np.ndarray, lengths: np.ndarray, bins: int) -> np.ndarray:
    """`rows` reordered into `bins` equal runs (a micro-batch's device group each) whose
    token loads are even: longest rows first, each to the least loaded run with room; rows
    keep their relative order inside a run."""
    per = len(rows) // bins
    load, members = np.zeros(bins), [[] for _ in range(bins)]
    for i in np.argsort(-lengths[rows], kind="stable"):
        open_ = [k for k in range(bins) if len(members[k]) < per]
        k = min(open_, key=lambda k: load[k])
        members[k].append(i)
        load[k] += lengths[rows[i]]
    return np.concatenate([rows[np.sort(m)] for m in members])


def half_octaves(limit: int) -> list[int]:
    """1, 2, 3, 4, 6, 8, 12, 16, ... up to `limit`: the multiples a packed shape is rounded
    to, so that a run meets a few shapes (at most a third more than needed)."""
    out, g = [], 1
    while g <= limit:
        out += [g] + ([g * 3 // 2] if g >= 2 and g * 3 // 2 <= limit else [])
        g *= 2
    return out


def choose_buffers(groups: list[np.ndarray], length: int, most: int, mesh=None) -> tuple[int, int]:
    """(buffers, capacity) for groups of rows (each a device's rows of one micro-batch, their
    lengths): the fewest slots, buffers x capacity, with which first-fit places every group;
    buffers a power of two (or `most`, the rows of the largest group), capacity a quarter of
    the padded row `length` times one of `half_octaves`, up to four rows (so attention,
    quadratic in the buffer, stays near the padded rows'). Ties go to more, shorter
    buffers."""
    unit = span_unit(length, mesh)
    longest = max(int(x.max()) for x in groups)
    options = sorted({1 << i for i in range(most.bit_length()) if 1 << i <= most} | {most})
    steps = [g for g in half_octaves(SPANS * SPANS) if g * unit >= longest]
    best = (most * steps[0] * unit, most, steps[0] * unit)
    for k in reversed(options):
        for g in steps:
            if all(first_fit(x, g * unit)[1] <= k for x in groups):
                if k * g * unit < best[0]:
                    best = (k * g * unit, k, g * unit)
                break
    return best[1], best[2]


def row_groups(rows_per_micro_batch: int, mesh) -> int:
    """How many devices split a micro-batch's rows: `row_shards(mesh)` where that divides
    them, else 1 (the rows are not split)."""
    n = row_shards(mesh)
    return n if rows_per_micro_batch % n == 0 else 1


def plan_packing(
    lengths: np.ndarray,
    length: int,
    rng,
    cfg: StepConfig,
    mesh=None,
    completions=None,
    micro_batches: int | None = None,
    fixed: tuple | None = None,
    head_room: float = 1.0,
) -> dict | None:
    """The packing plan of a step's rows (real tokens `lengths` int[B], every process's, in
    global row order; padded row `length`): `pack_order` int32[B] (the rows in the order the
    experience passes' micro-batches take them, `balance`d) and `pack_start` int32[B] (their
    first slots, in that order), `update_rows` and `update_starts` int32[updates, rows per
    update] (the same for each update: its rows of `update_order(rng, ...)`, balanced), and
    the static `pack_groups`, `pack_buffers`, `pack_length` (`choose_buffers` over the
    experience's micro-batches), `pack_completions` (the most completion tokens,
    `completions` int[B] of the completion mask, default none, of any device group of them,
    in `half_octaves` of a quarter of `length`) and `update_pack`: the same three for the
    updates' micro-batches.
    micro_batches: default optim.micro_batches.
    fixed: (experience's, updates') shapes to place the rows in instead of the fewest
        slots' (a shape the run has compiled); None where the rows do not fit them.
    head_room: head slots for this many times the most completion tokens (room for later
        batches' longer completions)."""
    b, m = len(lengths), micro_batches or cfg.micro_batches
    per_update = b // cfg.mini_batches
    groups = row_groups(per_update // m, mesh)
    order = np.asarray(jax.device_get(update_order(rng, b, cfg.epochs, cfg.mini_batches)))
    comp = np.zeros(b, np.int64) if completions is None else np.asarray(completions)
    unit = span_unit(length, mesh)

    def place(schedules: list, shape=None) -> tuple | None:  # these passes' micro-batches
        parts = [g for rows in schedules for mb in np.split(rows, m) for g in np.split(mb, groups)]
        groups_ = [lengths[g] for g in parts]
        most = max(int(comp[g].sum()) for g in parts)
        if shape is None:
            buffers, capacity = choose_buffers(groups_, length, len(parts[0]), mesh)
            want = min(int(np.ceil(most * head_room)), len(parts[0]) * length)
            slots = next(g for g in half_octaves(max(want, 1)) if g * unit >= want) * unit
        else:
            buffers, capacity, slots = shape
            fits = lambda x: x.max() <= capacity and first_fit(x, capacity)[1] <= buffers  # noqa: E731
            if most > slots or not all(fits(x) for x in groups_):
                return None
        starts = [
            np.concatenate([first_fit(lengths[g], capacity)[0] for g in np.split(rows, m * groups)])
            for rows in schedules
        ]
        for rows, st in zip(schedules, starts):  # no row may lose a token
            if int((st + lengths[rows]).max()) > buffers * capacity:
                raise AssertionError(f"packing plan overflows {buffers} buffers of {capacity}")
        return starts, (buffers, capacity, slots)

    # rows balanced over each pass's micro-batches and device groups (an update's gradient
    # sums the same rows; the experience's per-row outputs go back to their rows); the
    # experience's micro-batches split all rows, an update's only its share: each kind gets
    # its own shape
    exp_rows = balance(np.arange(b), lengths, m * groups)
    upd_rows = [balance(rows, lengths, m * groups) for rows in order]
    exp_fixed, upd_fixed = fixed or (None, None)
    placed = place([exp_rows], exp_fixed), place(upd_rows, upd_fixed)
    if None in placed:
        return None
    (exp, exp_shape), (upd, upd_shape) = placed
    return dict(
        pack_order=exp_rows.astype(np.int32),
        update_rows=np.stack(upd_rows).astype(np.int32),
        pack_start=exp[0],
        update_starts=np.stack(upd).astype(np.int32),
        pack_groups=groups,
        pack_buffers=exp_shape[0],
        pack_length=exp_shape[1],
        pack_completions=exp_shape[2],
        update_pack=upd_shape,
    )


def plan_batch(
    lengths, completions, length: int, rng, cfg: StepConfig, mesh=None, head_room: float = 1.0
) -> dict:
    """What `fit_batch` sets on a batch of rows with `lengths` real tokens, `completions` of
    them completion tokens and padded row `length`: the packing plan (actor.padding_free)
    and, with actor.dynamic_batching, `micro_batches`: the fewest (a divisor of an update's
    rows) whose micro-batches hold at most actor.max_token_len_per_device slots per device
    (the most: one row per device, with a warning, where a row alone is over the budget)."""
    free = cfg.actor.padding_free

    def plan(m):
        return plan_packing(lengths, length, rng, cfg, mesh, completions, m, head_room=head_room)

    if not cfg.actor.dynamic_batching:
        return plan(None) if free else {}
    b = len(lengths)
    per_update = b // cfg.mini_batches
    budget = cfg.actor.max_token_len_per_device
    out = {}
    for m in [d for d in range(1, per_update + 1) if per_update % d == 0]:
        out = dict(plan(m) if free else {}, micro_batches=m)
        groups = row_groups(per_update // m, mesh)
        slots = out["pack_buffers"] * out["pack_length"] if free else b // m // groups * length
        if slots <= budget:
            return out
    log.warning(
        "actor.max_token_len_per_device=%d: a micro-batch of one row per device needs more "
        "(%d slots); running %d micro-batches",
        budget,
        slots,
        out["micro_batches"],
    )
    return out


@dataclasses.dataclass
class StepShapes:
    """The train step's shapes a run has compiled (prompt columns, completion columns,
    micro-batches, the experience's and the updates' packed shapes), for `fit_batch` to
    reuse: a batch takes the cheapest of them that holds its rows (completion columns at
    least its own bucket, the same micro-batch count) when that costs at most `slack` times
    the slots of its own plan. Only else does it get a shape (a program) of its own, with
    the most completion columns that cost at most `grow` times its own plan, so that later
    batches with longer completions fit it. The train loop holds one per run."""

    slack: float = 1.5
    grow: float = 1.25
    seen: list = dataclasses.field(default_factory=list)

    def to_json(self) -> list:
        """The seen shapes as JSON (a checkpoint's run state)."""
        return [list(k) for k in self.seen]

    @classmethod
    def from_json(cls, items: list) -> StepShapes:
        """`to_json`'s shapes back (tuples, as `choose` compares them)."""
        back = lambda x: tuple(x) if isinstance(x, list) else x  # noqa: E731
        return cls(seen=[tuple(back(x) for x in k) for k in items])

    def choose(self, lengths, comp, prompt: int, n: int, full: int, rng, cfg, mesh=None):
        """(completion columns, plan) for a batch whose completions fit in n columns (of
        `full`): a seen shape's or a new one (then seen)."""
        plan = plan_batch(lengths, comp, prompt + n, rng, cfg, mesh)
        key = _shape(prompt, n, plan, cfg)
        cost = shape_cost(key, cfg)
        if key in self.seen:
            return n, plan
        for k in sorted(self.seen, key=lambda k: shape_cost(k, cfg)):
            if (k[0], k[2]) != (prompt, key[2]) or not n <= k[1] <= full:
                continue
            if shape_cost(k, cfg) > self.slack * cost:
                break
            fixed = {}
            if k[3] is not None:  # its buffers and head slots must hold every micro-batch
                fixed = plan_packing(lengths, prompt + k[1], rng, cfg, mesh, comp, k[2], k[3:])
            if fixed is not None:
                extra = {"micro_batches": k[2]} if cfg.actor.dynamic_batching else {}
                return k[1], dict(fixed, **extra)
        step = -(-full // BUCKETS)
        for wider in sorted({full, *range(n, full, step)}, reverse=True):
            wide = plan_batch(lengths, comp, prompt + wider, rng, cfg, mesh, self.grow)
            same = wide.get("micro_batches") == plan.get("micro_batches")
            if same and shape_cost(_shape(prompt, wider, wide, cfg), cfg) <= self.grow * cost:
                n, plan = wider, wide
                break
        self.seen.append(_shape(prompt, n, plan, cfg))
        log.info("train step shape %d (a new program): %s", len(self.seen), describe(self.seen[-1]))
        return n, plan


def _shape(prompt: int, n: int, plan: dict, cfg: StepConfig) -> tuple:
    m = plan.get("micro_batches", cfg.micro_batches)
    if "pack_start" not in plan:
        return prompt, n, m, None, None
    exp = (plan["pack_buffers"], plan["pack_length"], plan["pack_completions"])
    return prompt, n, m, exp, tuple(plan["update_pack"])


def describe(key: tuple) -> str:
    """A step shape in words."""
    prompt, n, m, exp, upd = key
    out = f"{prompt} prompt + {n} completion columns, {m} micro-batch(es)"
    if exp is None:
        return out
    words = lambda s: f"{s[0]} buffer(s) of {s[1]}, {s[2]} head slots"  # noqa: E731
    return f"{out}; experience {words(exp)}; updates {words(upd)}"


def shape_cost(key: tuple, cfg: StepConfig) -> float:
    """Slots a step of shape `key` computes, an update's (forward and backward) weighing three
    times a no-grad pass's; per row of the experience where the rows are not packed."""
    prompt, n, m, exp, upd = key
    if exp is None:
        return prompt + n
    return m * (exp[0] * exp[1] + 3 * cfg.epochs * cfg.mini_batches * upd[0] * upd[1])


def fit_batch(batch: RolloutBatch, rng, cfg: StepConfig, mesh=None, shapes=None) -> RolloutBatch:
    """A rollout batch (host arrays: this process's rows of the step) fitted to its real
    tokens: the completion axis cut to its bucket, and with actor.padding_free the packing
    plan; with `shapes` (the run's `StepShapes`), a shape the run has compiled where one
    serves. Every process calls it at the same point (the lengths are gathered)."""
    local = np.asarray(batch.attention_mask).sum(axis=1)
    comp = (np.asarray(batch.completion_mask) > 0).sum(axis=1)
    starts = [0]
    if jax.process_count() > 1:  # every process cuts and plans from every row, in the
        # global batch's order (each process's rows where the mesh puts them)
        every = runtime.gather_json([local.tolist(), comp.tolist()])
        starts = runtime.row_starts(mesh, len(local))
        at = np.argsort(starts, kind="stable")
        lengths = np.concatenate([np.asarray(every[p][0], np.int64) for p in at])
        comp = np.concatenate([np.asarray(every[p][1], np.int64) for p in at])
    else:
        lengths = local
    full = batch.completion_length
    prompt = int(batch.input_ids.shape[1]) - full
    n = completion_bucket(int(comp.max(initial=0)), full)
    if shapes is None:  # the batch's own plan
        plan = plan_batch(lengths, comp, prompt + n, rng, cfg, mesh)
    else:
        n, plan = shapes.choose(lengths, comp, prompt, n, full, rng, cfg, mesh)
    if n < full:  # the cut columns are padding: no row's length changes
        batch = cut_completions(batch, n)
    if "pack_start" not in plan:  # padded rows: each split evenly over the sequence axis
        batch = pad_prompts(batch, sequence_shards(mesh))
    else:  # this process's share of the row-long arrays
        first = starts[jax.process_index()]
        for k in ("pack_start", "pack_order"):
            plan[k] = plan[k][first : first + len(local)]
    return batch.replace(**plan)
