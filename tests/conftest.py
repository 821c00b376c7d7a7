"""Shared pytest setup: float32 everywhere, quiet logs."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
