"""Host-side assembly of a rollout: prompts + sampled completions -> RolloutBatch."""

from __future__ import annotations

import numpy as np

from jaxvrl.trainer.policy import RolloutBatch


def completion_positions(prompt_mask: np.ndarray, deltas: np.ndarray, n: int) -> np.ndarray:
    """int32[3, B, n]: the i-th completion token of row b sits at n_valid + delta + i."""
    start = prompt_mask.sum(axis=1) + deltas  # [B]
    pos = start[:, None] + np.arange(n)[None, :]
    return np.broadcast_to(pos[None], (3,) + pos.shape).astype(np.int32)


def assemble(
    prompt_ids: np.ndarray,
    prompt_mask: np.ndarray,
    prompt_positions: np.ndarray,
    deltas: np.ndarray,
    tokens: np.ndarray,
    completion_mask: np.ndarray,
    rewards: np.ndarray,
    has_image: np.ndarray,
    *,
    images=None,
    pools: dict | None = None,
    baseline: np.ndarray | None = None,
) -> RolloutBatch:
    """Concatenate prompt [B, P] and completion [B, N] into one RolloutBatch (numpy arrays).

    Completion tokens after the first EOS get attention_mask 0; they never influence a loss.
    """
    n = tokens.shape[1]
    comp_mask = completion_mask.astype(np.int32)
    pos = np.concatenate(
        [prompt_positions, completion_positions(prompt_mask, deltas, n)], axis=2
    ).astype(np.int32)
    if pools is not None:
        pad = np.zeros((tokens.shape[0], n), bool)
        pools = {k: np.concatenate([v, pad], axis=1) for k, v in pools.items()}
    return RolloutBatch(
        input_ids=np.concatenate([prompt_ids, tokens], axis=1).astype(np.int32),
        attention_mask=np.concatenate([prompt_mask, comp_mask], axis=1).astype(np.int32),
        position_ids=pos,
        completion_mask=completion_mask.astype(np.float32),
        rewards=np.asarray(rewards, np.float32),
        has_image=np.asarray(has_image, bool),
        baseline=np.zeros(len(tokens), np.float32) if baseline is None else baseline,
        images=images,
        pools=pools,
    )
