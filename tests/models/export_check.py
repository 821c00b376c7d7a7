"""Our export of a model loaded from a transformers checkpoint holds exactly that checkpoint's
tensors (names, dtypes and values); a run's export (`python -m jaxvrl.export`) holds exactly
those of its merged model."""

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


def run_export_equals_merged(model, base, tmp, lora_settings: dict) -> dict:
    """`model`'s params saved as a run's checkpoint (run.json: base model directory `base`,
    float32, `lora_settings`) and exported by `jaxvrl.export`: its tensors are, name for name,
    those `models.save` writes of `lora.merge_lora(model)`. Returns them by name (the export
    is at tmp / "hf")."""
    from flax import nnx
    from safetensors.numpy import load_file

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
    exported = load_file(tmp / "hf" / "model.safetensors")
    merged = load_file(tmp / "merged" / "model.safetensors")
    assert set(exported) == set(merged)
    for k in merged:
        np.testing.assert_array_equal(exported[k], merged[k], err_msg=k)
    return exported
