"""Models. `DTYPES`: the compute and parameter dtypes a config may name; `EMBEDDED`: the tiny
checkpoint shipped in the package; `preset_names`: the published configs shipped without
weights (shapes for `python -m jaxvrl.aot`)."""

import os

import jax.numpy as jnp

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")
PRESETS = os.path.join(ASSETS, "presets")
EMBEDDED = os.path.join(ASSETS, "tiny_qwen2_5_vl")  # the tiny checkpoint of the embedded default


def preset_names() -> tuple[str, ...]:
    return tuple(sorted(f[: -len(".json")] for f in os.listdir(PRESETS) if f.endswith(".json")))
