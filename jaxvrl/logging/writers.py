"""Former home of the run logs, kept for `from jaxvrl.logging.writers import ...`; import
from `jaxvrl.logging` instead."""

from jaxvrl.logging.markdown import (
    MarkdownLog,
    attention_section,
    rollout_section,
    token_weight_section,
)
from jaxvrl.logging.metrics import MetricsWriter
from jaxvrl.logging.progress import Progress

__all__ = [
    "MarkdownLog",
    "MetricsWriter",
    "Progress",
    "attention_section",
    "rollout_section",
    "token_weight_section",
]
