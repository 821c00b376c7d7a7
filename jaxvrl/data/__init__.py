"""Data: Qwen2.5-VL image/video processing (numpy + PIL), chat prompts, the built-in visual task.

Grain pipelines live in `jaxvrl.data.loader` (imported on demand: it pulls in grain), row
encoding in `jaxvrl.data.rows`, the trainer's collate in `jaxvrl.data.pipeline` (its shape
buckets in `jaxvrl.data.buckets`), file sources in `jaxvrl.data.sources`, a dataset's
columns by name (keys, a format hook) in `jaxvrl.data.columns`, and a run's data from its
config in `jaxvrl.data.from_config` (`python -m jaxvrl.data` shows its first rows as the model
will see them).
"""

from jaxvrl.data.processor import process_images, process_video, smart_resize, to_rgb
from jaxvrl.data.prompts import (
    default_tokenizer_path,
    encode_prompt,
    messages_for,
    special_token_ids,
)

__all__ = [
    "default_tokenizer_path",
    "encode_prompt",
    "messages_for",
    "process_images",
    "process_video",
    "smart_resize",
    "special_token_ids",
    "to_rgb",
]
