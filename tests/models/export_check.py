"""Our export of a model loaded from a transformers checkpoint holds exactly that checkpoint's
tensors (names, dtypes and values)."""

from __future__ import annotations

import numpy as np


def export_equals_checkpoint(model, checkpoint, out) -> dict:
    """`jaxvrl.models.save(model, out)`, then every tensor of out's model.safetensors equals the
    one of `checkpoint`'s (the directory `model` was loaded from), and no tensor is missing or
    extra. Returns the exported tensors by name."""
    from safetensors.numpy import load_file

    from jaxvrl import models

    models.save(model, out)
    original = load_file(checkpoint / "model.safetensors")
    exported = load_file(out / "model.safetensors")
    assert set(original) == set(exported)
    for k in original:
        assert original[k].dtype == exported[k].dtype, k
        np.testing.assert_array_equal(original[k], exported[k], err_msg=k)
    return exported
