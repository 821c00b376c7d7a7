"""Rollout-level filtering and reward shaping on the host (SPEC section 7). numpy arrays; rows
come in groups of G consecutive rows (one prompt)."""

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
    """DAPO dynamic sampling: keep groups whose metric is not identical across the group.
    Returns bool[num_groups]."""
    g = _groups(metric, group_size)
    return ~np.all(np.isclose(g, g[:, :1], rtol=0.0, atol=1e-9), axis=1)


def online_filter_keep(scores: np.ndarray, group_size: int, low: float, high: float) -> np.ndarray:
    """Seed 004 online filtering: keep groups with low < mean score < high. bool[num_groups]."""
    mean = _groups(scores, group_size).mean(axis=1)
    return (mean > low) & (mean < high)


def expand_groups(keep: np.ndarray, group_size: int) -> np.ndarray:
    """bool[num_groups] -> bool[B] row mask."""
    return np.repeat(np.asarray(keep, bool), group_size)


def mask_truncated_completions(mask: np.ndarray, truncated: np.ndarray) -> np.ndarray:
    """Remove truncated rows (no EOS within the length budget) from the loss."""
    return np.asarray(mask) * (~np.asarray(truncated, bool))[:, None]


def soft_overlong_punishment(
    lengths: np.ndarray, max_length: int, buffer_length: int, factor: float = 1.0
) -> np.ndarray:
    """0 below max_length - buffer_length, then linearly down to -1 at max_length (and
    beyond), times factor. float64[B]."""
    lengths = np.asarray(lengths, np.float64)
    start = max_length - buffer_length
    if buffer_length <= 0:
        return np.where(lengths >= max_length, -factor, 0.0)
    pen = -np.clip((lengths - start) / buffer_length, 0.0, 1.0)
    return pen * factor


def stage_reward_weights(
    step: int, regular: dict[str, float], early: dict[str, float] | None, early_steps: int
) -> dict[str, float]:
    """Two-stage reward weights (seed 001): `early` for the first `early_steps` steps."""
    if early and step < early_steps:
        return {**regular, **early}
    return dict(regular)


@dataclasses.dataclass
class ReplayBuffer:
    """Seed 001: informative groups (reward std >= min_std and min_mean <= mean <= max_mean)
    are kept; when a batch cannot be filled with informative groups, its uninformative groups
    are replaced by groups from the buffer (most recent first). Groups are opaque payloads."""

    capacity: int = 64
    min_std: float = 1e-6
    min_mean: float = -np.inf
    max_mean: float = np.inf
    _items: collections.deque = dataclasses.field(default_factory=collections.deque)

    def informative(self, rewards: np.ndarray, group_size: int) -> np.ndarray:
        g = _groups(rewards, group_size)
        mean, std = g.mean(1), g.std(1)
        return (std >= self.min_std) & (mean >= self.min_mean) & (mean <= self.max_mean)

    def add(self, group) -> None:
        self._items.append(group)
        while len(self._items) > self.capacity:
            self._items.popleft()

    def __len__(self) -> int:
        return len(self._items)

    def fill(self, groups: list, informative: np.ndarray) -> tuple[list, int]:
        """Store the informative groups; replace uninformative ones from the buffer.

        Returns (groups, number replaced). Groups with no replacement available stay."""
        out, replaced = list(groups), 0
        for i, ok in enumerate(informative):
            if ok:
                self.add(groups[i])
        stock = list(reversed(self._items))
        fresh = {id(groups[i]) for i, ok in enumerate(informative) if ok}
        stock = [g for g in stock if id(g) not in fresh]
        for i, ok in enumerate(informative):
            if not ok and stock:
                out[i] = stock.pop(0)
                replaced += 1
        return out, replaced
