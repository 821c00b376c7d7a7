"""Our export of a model loaded from a transformers checkpoint holds exactly that checkpoint's
tensors (names, dtypes and values); a run's export (`python -m jaxvrl.export`) holds exactly
those of its merged model."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def same_tensors(a, b) -> dict:
    """The model.safetensors of directories `a` and `b` hold the same tensors: names, dtypes
    and values. Returns b's by name."""
    from safetensors.numpy import load_file

    want, got = (load_file(Path(d) / "model.safetensors") for d in (a, b))
    assert set(want) == set(got)
    for k in want:
        assert want[k].dtype == got[k].dtype, k
        np.testing.assert_array_equal(want[k], got[k], err_msg=k)
    return got


def export_equals_checkpoint(model, checkpoint, out) -> dict:
    """`jaxvrl.models.save(model, out)`, then every tensor of out's model.safetensors equals the
    one of `checkpoint`'s (the directory `model` was loaded from), and no tensor is missing or
    extra. Returns the exported tensors by name."""
    from jaxvrl import models

    models.save(model, out)
    return same_tensors(checkpoint, out)


def run_export_equals_merged(model, base, tmp, lora_settings: dict) -> dict:
    """`model`'s params saved as a run's checkpoint (run.json: base model directory `base`,
    float32, `lora_settings`) and exported by `jaxvrl.export`: its tensors are, name for name,
    those `models.save` writes of `lora.merge_lora(model)`. Returns them by name (the export
    is at tmp / "hf")."""
    from flax import nnx

    from jaxvrl import export, models
    from jaxvrl.checkpoint import Checkpointer
    from jaxvrl.models import lora

    _, params = nnx.split(model, nnx.Param)
    ck = Checkpointer(str(tmp / "run" / "checkpoints"))
    ck.save(1, {"state": {"params": params}}, force=True)
    ck.close()
    info = {"model_path": str(base), "param_dtype": "float32", "lora": lora_settings}
    export.write_run_info(str(tmp / "run"), info)
    export.export(str(tmp / "run"), str(tmp / "hf"))
    models.save(lora.merge_lora(model), tmp / "merged")
    return same_tensors(tmp / "merged", tmp / "hf")
