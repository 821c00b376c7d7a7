"""Ahead-of-time compilation of the main job's programs for TPU slices: `python -m jaxvrl.aot`
(see `jaxvrl/aot/__main__.py`)."""
