"""Rollout-level filtering and reward shaping on the host (docs/algorithms.md: rewards,
overlong completions, rollout filtering). numpy arrays; rows come in groups of G consecutive
rows (one prompt)."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np


def _groups(x: np.ndarray, group_size: int) -> np.ndarray:
    x = np.asarray(x, np.float64)
    if x.shape[0] % group_size:
        raise ValueError(f"{x.shape[0]} rows are not a whole number of groups of {group_size}")
    return x.reshape(-1, group_size)


def dynamic_sampling_keep(metric: np.ndarray, group_size: int) -> np.ndarray:
    """DAPO dynamic sampling: keep groups whose metric (float[B], e.g. the total reward) is
    not identical across the group (equal within 1e-9). Returns bool[B / G]."""
    g = _groups(metric, group_size)
    return ~np.all(np.isclose(g, g[:, :1], rtol=0.0, atol=1e-9), axis=1)


def online_filter_keep(scores: np.ndarray, group_size: int, low: float, high: float) -> np.ndarray:
    """Online filtering: keep groups with filter_low < mean score < filter_high (strict).
    scores: float[B]. Returns bool[B / G]."""
    mean = _groups(scores, group_size).mean(axis=1)
    return (mean > low) & (mean < high)


def mask_truncated_completions(mask: np.ndarray, truncated: np.ndarray) -> np.ndarray:
    """DAPO: remove truncated rows (no EOS within the length budget) from the loss.
    mask: [B, T]; truncated: bool[B]. Returns mask with those rows zeroed."""
    return np.asarray(mask) * (~np.asarray(truncated, bool))[:, None]


def soft_overlong_punishment(
    lengths: np.ndarray, max_length: int, buffer_length: int, factor: float = 1.0
) -> np.ndarray:
    """DAPO soft overlong punishment of completion lengths int[B]: 0 up to max_length -
    buffer_length, then linear down to -1 at max_length (and -1 beyond), times factor.
    buffer_length <= 0 gives a hard -factor at max_length. float64[B], added to the reward."""
    lengths = np.asarray(lengths, np.float64)
    start = max_length - buffer_length
    if buffer_length <= 0:
        return np.where(lengths >= max_length, -factor, 0.0)
    pen = -np.clip((lengths - start) / buffer_length, 0.0, 1.0)
    return pen * factor


def stage_reward_weights(
    step: int, regular: dict[str, float], early: dict[str, float] | None, early_steps: int
) -> dict[str, float]:
    """Two-stage reward weights: for step < early_steps the `early` weights (each name in
    `early` overrides `regular`), then `regular`."""
    if early and step < early_steps:
        return {**regular, **early}
    return dict(regular)


@dataclasses.dataclass
class DynamicSampler:
    """DAPO dynamic sampling across generation batches (host side): collect the kept groups
    of each generated batch until `target_groups` are there or `max_num_gen_batches` batches
    were generated (0 = no limit). Groups are opaque payloads.

    Usage: `while not s.done: s.add(groups, keep)`, then `s.take()`. When the limit is hit
    first, take() returns the groups it has (possibly fewer than target_groups); the caller
    decides whether to train on a short batch or to skip the step.
    """

    target_groups: int
    max_num_gen_batches: int = 0
    groups: list = dataclasses.field(default_factory=list)
    num_gen_batches: int = 0

    def add(self, groups: list, keep: np.ndarray) -> None:
        keep = np.asarray(keep, bool)
        if len(keep) != len(groups):
            raise ValueError(f"{len(groups)} groups but {len(keep)} keep flags")
        self.num_gen_batches += 1
        self.groups.extend(g for g, k in zip(groups, keep) if k)

    @property
    def full(self) -> bool:
        return len(self.groups) >= self.target_groups

    @property
    def done(self) -> bool:
        limit = self.max_num_gen_batches
        return self.full or (limit > 0 and self.num_gen_batches >= limit)

    def take(self) -> list:
        """The first target_groups groups; resets the sampler for the next step."""
        out = self.groups[: self.target_groups]
        self.groups, self.num_gen_batches = [], 0
        return out


@dataclasses.dataclass
class ReplayBuffer:
    """Replay buffer for uninformative groups (host side; groups are opaque payloads, e.g.
    the rows of one prompt with their rewards).

    A group is informative when its rewards have population std >= min_std and min_mean <=
    mean <= max_mean. fill() stores this batch's informative groups (the oldest fall out past
    `capacity`) and replaces each uninformative group by a stored one from an earlier batch,
    most recent first; a replayed group leaves the buffer, so it is used once. Uninformative
    groups with no replacement available stay as they are.
    """

    capacity: int = 64
    min_std: float = 1e-6
    min_mean: float = -np.inf
    max_mean: float = np.inf
    _items: collections.deque = dataclasses.field(default_factory=collections.deque)

    def informative(self, rewards: np.ndarray, group_size: int) -> np.ndarray:
        """rewards float[B] -> bool[B / G]."""
        g = _groups(rewards, group_size)
        mean, std = g.mean(1), g.std(1)
        return (std >= self.min_std) & (mean >= self.min_mean) & (mean <= self.max_mean)

    def add(self, group) -> None:
        self._items.append(group)
        while len(self._items) > self.capacity:
            self._items.popleft()

    def __len__(self) -> int:
        return len(self._items)

    def contents(self) -> list:
        """The stored groups, oldest first (what a checkpoint keeps)."""
        return list(self._items)

    def load(self, items: list) -> None:
        """Replaces the contents by `items` (oldest first; past `capacity`, the oldest fall
        out), e.g. a checkpoint's `contents()`."""
        self._items = collections.deque()
        for x in items:
            self.add(x)

    def fill(self, groups: list, informative: np.ndarray) -> tuple[list, int]:
        """Returns (groups with uninformative ones replaced, number replaced)."""
        informative = np.asarray(informative, bool)
        if len(informative) != len(groups):
            raise ValueError(f"{len(groups)} groups but {len(informative)} flags")
        out, replaced = list(groups), 0
        for i in np.flatnonzero(~informative):
            if not self._items:
                break
            out[i] = self._items.pop()  # most recent first; taken before this batch is stored
            replaced += 1
        for i in np.flatnonzero(informative):
            self.add(groups[i])
        return out, replaced
