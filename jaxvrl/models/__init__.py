"""Models. `DTYPES`: the compute and parameter dtypes a config may name; `preset_names`: the
published configs shipped without weights (shapes for `python -m jaxvrl.aot`)."""

import os

import jax.numpy as jnp

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
PRESETS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets", "presets")


def preset_names() -> tuple[str, ...]:
    return tuple(sorted(f[: -len(".json")] for f in os.listdir(PRESETS) if f.endswith(".json")))
