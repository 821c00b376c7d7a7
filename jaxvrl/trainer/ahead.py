"""One-step-off training's batch in flight (`rollout.devices`): the rollout sampled for the
next step while this one trained, as the checkpoint keeps it (in the replay item's format,
`replay_state.encode_items`) and a resumed run takes it back.

A step's groups and the groups it sampled share objects (`Rollout.groups` are among
`Rollout.sampled`, by identity, which the logged samples read): both are kept as indices into
one list of distinct groups, so the identity survives the round trip. The train batch is
assembled again from the groups (`RolloutPhase._assemble`: the same arrays).
"""

from __future__ import annotations

import jax
import numpy as np

from jaxvrl.trainer.rollout import Rollout


def encode_ahead(rollout: Rollout, key, version: int) -> dict:
    """The in-flight rollout, its train step's key and the policy version that sampled it, as
    a payload of plain values, arrays and groups."""
    pool, at = [], {}
    for g in [*rollout.groups, *rollout.sampled]:
        if id(g) not in at:
            at[id(g)] = len(pool)
            pool.append(g)
    return {
        "pool": pool,
        "groups": [at[id(g)] for g in rollout.groups],
        "sampled": [at[id(g)] for g in rollout.sampled],
        "real": np.asarray(rollout.real, bool),
        "metrics": dict(rollout.metrics),
        "key": np.asarray(jax.random.key_data(key)),
        "version": int(version),
    }


def decode_ahead(payload: dict, phase) -> tuple[Rollout, jax.Array, int]:
    """(the rollout, its train step's key, its version) from `encode_ahead`'s payload; the
    batch is assembled by `phase` (the run's RolloutPhase)."""
    pool = payload["pool"]
    groups = [pool[i] for i in payload["groups"]]
    rollout = Rollout(
        phase._assemble(groups),
        groups,
        payload["real"],
        payload["metrics"],
        [pool[i] for i in payload["sampled"]],
        phase._assemble_rows,
    )
    return rollout, jax.random.wrap_key_data(payload["key"]), payload["version"]
