"""A run's data from its ConfigDict (`config.data`): the built-in task, how rows become
examples (`encode_options`), the dataset's columns (`row_format`) and the training rows
(`train_source`). The main job (jaxvrl/train.py) and `python -m jaxvrl.data` read the data
through these, so that both see the same prompts.
"""

from __future__ import annotations

import ast
import os

from jaxvrl import models
from jaxvrl.config import ConfigError
from jaxvrl.data.columns import RowFormat
from jaxvrl.data.rows import EncodeOptions
from jaxvrl.data.sources import DataNotFound, open_source, open_sources
from jaxvrl.data.tasks import TASKS, BuiltinTask


def builtin_task(c) -> BuiltinTask:
    """The built-in task (`data.builtin_task`): the rows when `data.train_files` is unset, and
    with its embedded checkpoint the model when `model.path` is unset."""
    return TASKS[c.data.builtin_task]


def format_prompt(c) -> str | None:
    """The text of the `data.format_prompt` Jinja file (None: unset); a file that is missing
    or no valid template is a ConfigError."""
    path = c.data.format_prompt
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"config.data.format_prompt={path!r}: {e.strerror or e}") from None
    from jinja2 import TemplateError

    from jaxvrl.data.prompts import prompt_template

    try:
        prompt_template(text).render(content="")
    except TemplateError as e:
        raise ConfigError(
            f"config.data.format_prompt={path!r}: not a valid template ({e})"
        ) from None
    return text


def encode_options(c, model_config=None) -> EncodeOptions:
    """How rows become examples for the model of `model_config` (its image/video processor;
    None: the embedded model's)."""
    builtin = not c.data.train_files
    if model_config is None:
        model_config = models.load_config(builtin_task(c).checkpoint)
    task_prompt = builtin_task(c).system_prompt if builtin else None
    return EncodeOptions(
        processor=models.processor(model_config),
        image_dir=c.data.image_dir or None,
        max_prompt_length=c.data.max_prompt_length,
        max_image_side=c.data.max_image_side,
        min_pixels=c.data.min_pixels,
        max_pixels=c.data.max_pixels,
        # "" is no system prompt, also for the built-in task; None its own
        system_prompt=task_prompt if c.data.system_prompt is None else c.data.system_prompt,
        format_prompt=format_prompt(c),
        chat_template_kwargs=tuple(sorted(ast.literal_eval(c.data.chat_template_kwargs).items())),
        video_fps=c.data.video_fps,
        video_min_pixels=c.data.video_min_pixels,
        video_max_pixels=c.data.video_max_pixels,
    )


def row_format(c) -> RowFormat:
    """The dataset's columns (config.data.*_key) and its format hook (config.data.format)."""
    d = c.data
    return RowFormat(
        prompt_key=d.prompt_key,
        answer_key=d.answer_key,
        image_key=d.image_key,
        video_key=d.video_key,
        choices_key=d.choices_key,
        format=d.format,
    )


def data_paths(text: str) -> list[str]:
    """The paths of `data.train_files` / `data.val_files`: comma-separated (spaces around each
    stripped), or a list as verl's configs write it (`['train.parquet', 'more.parquet']`)."""
    text = text.strip()
    if text.startswith("[") and text.endswith("]"):
        import ast

        try:
            items = ast.literal_eval(text)
        except (ValueError, SyntaxError):  # unquoted names: [a.parquet, b.parquet]
            items = text[1:-1].split(",")
        return [str(p).strip().strip("'\"") for p in items if str(p).strip()]
    return [p.strip() for p in text.split(",") if p.strip()]


def train_source(c):
    """The training rows, random access: the files of `data.train_files` (each checked at
    open: a file that is not there or lacks a column the run needs, or files without a row, are
    a ConfigError), else the built-in task's train split."""
    if c.data.train_files:
        try:
            source = open_sources(data_paths(c.data.train_files), fmt=row_format(c))
        except DataNotFound as e:  # a file, directory or Hub dataset that is not there
            raise ConfigError(f"config.data.train_files={e.path!r}: {e.reason}") from None
        if not len(source):
            raise ConfigError(f"config.data.train_files={c.data.train_files!r}: no rows")
        return source
    kinds = tuple(c.data.synthetic_kinds)
    make = builtin_task(c).make_split
    return make("train", c.data.synthetic_train_size, c.seed, kinds=kinds)


def val_sources(c) -> list[tuple[str, object]]:
    """[(path, source)] of `data.val_files` ([] without them), each opened and checked as
    `train_source` checks its own (a file that is not there or lacks a column is a
    ConfigError)."""
    if not c.data.val_files:
        return []
    try:
        return [(p, open_source(p, fmt=row_format(c))) for p in data_paths(c.data.val_files)]
    except DataNotFound as e:
        raise ConfigError(f"config.data.val_files={e.path!r}: {e.reason}") from None


def model_dir(c) -> str:
    """The local directory of the checkpoint whose tokenizer and processor read the rows:
    `model.path` (a local directory; a Hub name or gs:// directory as the main job fetches
    it), else the built-in task's embedded one."""
    return checkpoint_dir(c.model.path or builtin_task(c).checkpoint, "model.path")[0]


def checkpoint_dir(path: str, key: str) -> tuple[str, str | None]:
    """-> (local directory, Hub commit or None) of the checkpoint `path` that config key `key`
    names (model.path, reward.model.path): a Hub name fetched into the Hugging Face cache, a
    gs:// directory mirrored locally, or a local directory."""
    from jaxvrl import hub
    from jaxvrl.remote import localize_dir

    try:
        if hub.model_name(path):
            snapshot = hub.fetch_model(path)
            return snapshot.path, snapshot.commit
        local = localize_dir(path)
    except (hub.NotFound, FileNotFoundError) as e:
        raise ConfigError(f"config.{key}={path!r}: {e}") from None
    if not os.path.isdir(local):
        raise ConfigError(
            f"config.{key}={path!r}: no such directory; set a local or gs:// model "
            "directory, or a Hugging Face Hub name (org/name or org/name@revision)"
        )
    return local, None
