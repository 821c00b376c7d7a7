"""Orbax checkpoints: train state (params, optimizer state, counters), RNG, data-iterator
state and run metadata, in one step directory, to a local path or `gs://`.

Resume order: build the abstract state, then `restore_latest` fills it (shapes, dtypes and
shardings from the abstract state), then the iterator and RNG continue from their saved state.
"""

from __future__ import annotations

import signal

import jax
import numpy as np
import orbax.checkpoint as ocp


class Checkpointer:
    def __init__(self, directory: str, max_to_keep: int = 2):
        if not directory.startswith("gs://"):
            import os

            directory = os.path.abspath(directory)
        self.manager = ocp.CheckpointManager(
            directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state, rng, meta: dict) -> None:
        """state: any pytree of arrays; meta: JSON-serialisable (iterator state, counters)."""
        leaves = jax.tree.leaves(state)
        arrays = {f"{i:05d}": x for i, x in enumerate(leaves)}
        arrays["rng"] = jax.random.key_data(rng)
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta)
            ),
        )
        self.manager.wait_until_finished()

    def restore(self, step: int, abstract_state, rng_impl=None):
        """-> (state with abstract_state's structure, rng, meta)."""
        leaves, treedef = jax.tree.flatten(abstract_state)
        target = {f"{i:05d}": x for i, x in enumerate(leaves)}
        target["rng"] = jax.ShapeDtypeStruct((2,), np.uint32)
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        out = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()
            ),
        )
        arrays = out["state"]
        state = jax.tree.unflatten(treedef, [arrays[f"{i:05d}"] for i in range(len(leaves))])
        rng = jax.random.wrap_key_data(arrays["rng"], impl=rng_impl)
        return state, rng, dict(out["meta"])

    def close(self) -> None:
        self.manager.close()


class PreemptionFlag:
    """Set by SIGTERM (TPU VM preemption): the loop saves a checkpoint and exits cleanly."""

    def __init__(self):
        self.requested = False
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        del signum, frame
        self.requested = True

    def restore(self) -> None:
        signal.signal(signal.SIGTERM, self._previous)
