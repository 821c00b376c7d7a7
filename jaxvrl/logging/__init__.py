"""Run logs (README, "What a run writes"): metrics.jsonl + TensorBoard, markdown logs of
rollouts, token weights and attention diagnostics, and a console progress line. Only process 0
writes: each writer takes `enabled` (pass `jax.process_index() == 0`)."""

from jaxvrl.logging.markdown import (
    MarkdownLog,
    attention_section,
    decode_pieces,
    fenced,
    rollout_section,
    show_token,
    token_weight_section,
)
from jaxvrl.logging.metrics import MetricsWriter, to_scalar
from jaxvrl.logging.progress import Progress, format_duration

__all__ = [
    "MarkdownLog",
    "MetricsWriter",
    "Progress",
    "attention_section",
    "decode_pieces",
    "fenced",
    "format_duration",
    "rollout_section",
    "show_token",
    "to_scalar",
    "token_weight_section",
]
