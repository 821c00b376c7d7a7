"""Run logs (README, "What a run writes"): metrics.jsonl, markdown logs of rollouts, token
weights and attention diagnostics, a console progress line, and the trackers (TensorBoard,
wandb, MLflow). Only process 0 writes: each writer takes `enabled` (pass
`jax.process_index() == 0`)."""

from jaxvrl.logging.markdown import (
    MarkdownLog,
    attention_section,
    decode_pieces,
    fenced,
    rollout_section,
    rollout_table,
    show_token,
    token_weight_section,
)
from jaxvrl.logging.metrics import MetricsWriter, to_scalar
from jaxvrl.logging.progress import Progress, format_duration, show_logs
from jaxvrl.logging.trackers import RunInfo, Tracker, Trackers, backend_names

__all__ = [
    "MarkdownLog",
    "MetricsWriter",
    "Progress",
    "RunInfo",
    "Tracker",
    "Trackers",
    "attention_section",
    "backend_names",
    "decode_pieces",
    "fenced",
    "format_duration",
    "rollout_section",
    "rollout_table",
    "show_logs",
    "show_token",
    "to_scalar",
    "token_weight_section",
]
