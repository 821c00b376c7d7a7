"""A user's dataset columns -> the row format that `jaxvrl.data.rows` encodes.

`RowFormat` names the columns to read (`config.data.prompt_key`, ...). Each key is a column
name or a dotted path into nested objects (`meta.question`; a column literally named
`meta.question` wins). An unset key reads the row format's own names, as the row format says:
`problem` else `prompt`; `label_idx` else `answer` else `solution`; `images` else `image`;
`videos` else `video`; `choices`; a verl row that also holds those names is read as verl
reads it (`verl_keys`). With no key, no hook and no such row, rows pass through untouched.

A set key maps its column to the row format's name:
  prompt_key  -> `problem` (the prompt text)
  answer_key  -> `answer` (the label the rewards score; the row's own `label_idx`, `answer`
                 and `solution` are then ignored, so the key alone decides)
  image_key   -> `images`: a path (relative to `image_dir`), bytes, base64 text, a
                 {"bytes", "path"} dict, or a list of those; null = no image
  video_key   -> `videos`: one video as a list of frames, or a list of such lists
  choices_key -> `choices`
`format` names a function (`module:function` or `path/to/file.py:function`) that maps each raw
row (a dict) to a dict; the keys then read its output.

`RowMapper.check` runs when a file is opened: a key that names no column there fails at start,
with the file, the key and the columns the file has; so does a file with no prompt column or no
label column under the row format's own names when no key names one (`MissingColumn`, a
ConfigError too: the main job prints it as one `error:` line).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from jaxvrl.config import ConfigError
from jaxvrl.data.prompts import is_chat
from jaxvrl.data.rows import (
    LABELS,
    NESTED_LABEL,
    SKIP,
    DataError,
    media_list,
    no_label,
    video_lists,
)
from jaxvrl.plugins import LOAD_ERRORS, load_function

MISSING = object()
PROMPTS = ("problem", "prompt")


class MissingColumn(DataError, ConfigError):
    """A data file without a column the run needs (named in the message, with the key to set)."""


def lookup(row: dict, key: str):
    """row[key], else the value at the dotted path `key`; MISSING when there is none."""
    if key in row:
        return row[key]
    node = row
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return MISSING
        node = node[part]
    return node


def verl_keys(row: dict) -> dict:
    """The keys that read a row in verl's layout as verl does, where it also holds the row
    format's own names that would win otherwise (a verl file that kept its source dataset's
    `problem`, `answer` or `solution`): a `prompt` of chat messages is the prompt, and
    `reward_model.ground_truth` the label (unless the row has a `label_idx`). Keys set in the
    config come after these and decide."""
    keys = {}
    if is_chat(row.get("prompt")) and row.get("problem"):
        keys["prompt_key"] = "prompt"
    truth = lookup(row, ".".join(NESTED_LABEL))
    if (
        truth is not MISSING
        and not no_label(truth)
        and no_label(row.get("label_idx"))
        and any(not no_label(row.get(k)) for k in LABELS)
    ):
        keys["answer_key"] = ".".join(NESTED_LABEL)
    return keys


def column_paths(row: dict, prefix: tuple = ()) -> Iterable[tuple[str, ...]]:
    """Every column of `row` as a path: ("a",), and ("a", "b") for a nested dict's keys."""
    for k, v in row.items():
        yield (*prefix, k)
        if isinstance(v, dict):
            yield from column_paths(v, (*prefix, k))


@dataclasses.dataclass(frozen=True)
class RowFormat:
    """The columns to read; None reads the row format's own name (module docstring)."""

    prompt_key: str | None = None
    answer_key: str | None = None
    image_key: str | None = None
    video_key: str | None = None
    choices_key: str | None = None
    format: str | None = None  # 'module:function' or 'path/to/file.py:function'

    def keys(self) -> dict[str, str]:
        """{config name: column} of the keys that are set."""
        names = ("prompt_key", "answer_key", "image_key", "video_key", "choices_key")
        return {n: getattr(self, n) for n in names if getattr(self, n)}


class RowMapper:
    """raw row -> a row of the format (its `_where` kept), for one RowFormat; the format hook
    is loaded once here (and again after unpickling, e.g. in a grain worker process)."""

    def __init__(self, fmt: RowFormat):
        self.fmt = fmt
        self.hook = None
        if fmt.format:
            try:
                self.hook = load_function(fmt.format, "config.data.format")
            except LOAD_ERRORS as e:
                raise ConfigError(str(e)) from None

    def __getstate__(self):
        return {"fmt": self.fmt}

    def __setstate__(self, state):
        self.__init__(state["fmt"])

    def __call__(self, raw: dict) -> dict:
        where = raw.get("_where")
        row = {k: v for k, v in raw.items() if k != "_where"}
        if self.hook is not None:
            row = self._hook(row, where)
        if SKIP not in row:
            row = self._keys(row)
        if where is not None:
            row["_where"] = where
        return row

    def _hook(self, row: dict, where) -> dict:
        """The hook's row, or for a row it fails on {SKIP: ("format_error", why)}: the row is
        skipped and counted (`rows.encode_row`), the run goes on."""
        try:
            out = self.hook(row)
        except Exception as e:  # noqa: BLE001 -- name the hook and the error, skip the row
            why = f"config.data.format {self.fmt.format!r} raised {type(e).__name__}: {e}"
            return {SKIP: ("format_error", why)}
        if not isinstance(out, dict):
            why = (
                f"config.data.format {self.fmt.format!r} returned {type(out).__name__}, "
                "expected a dict (a row)"
            )
            return {SKIP: ("format_error", why)}
        return out

    def _keys(self, row: dict) -> dict:
        f = self.fmt
        keys = {**verl_keys(row), **f.keys()}
        if not keys:
            return row
        value = {name: lookup(row, key) for name, key in keys.items()}
        out = dict(row)
        for name in ("image_key", "video_key"):  # their payloads leave the row
            key = getattr(f, name)
            if key:
                out = _without(out, key)
        if "prompt_key" in value:
            out["problem"] = None if value["prompt_key"] is MISSING else value["prompt_key"]
        if "answer_key" in value:
            # a set key alone decides; verl's label only takes `answer`'s place (a `solution`
            # column stays for the rewards that read it)
            for k in LABELS if f.answer_key else ("answer",):
                out.pop(k, None)
            out["answer"] = None if value["answer_key"] is MISSING else value["answer_key"]
        if "image_key" in value:
            out["images"] = [] if value["image_key"] is MISSING else media_list(value["image_key"])
        if "video_key" in value:
            out["videos"] = [] if value["video_key"] is MISSING else video_lists(value["video_key"])
        if "choices_key" in value:
            out["choices"] = None if value["choices_key"] is MISSING else value["choices_key"]
        return out

    def check(self, paths: Iterable[tuple[str, ...]], where: str) -> None:
        """MissingColumn unless every set key names one of `paths` (the columns of `where`),
        and a prompt and a label column are there (a key's, or one of the built-in names)."""
        paths = list(dict.fromkeys(tuple(p) for p in paths))
        after = " (as config.data.format returns its rows)" if self.hook else ""
        for name, key in self.fmt.keys().items():
            if (key,) in paths or tuple(key.split(".")) in paths:
                continue
            raise MissingColumn(
                f"{where}: no column {key!r} for config.data.{name}{after}; its columns: "
                f"{_listed(paths, nested='.' in key)}"
            )
        needed = (
            ("prompt_key", "prompt", [(k,) for k in PROMPTS]),
            ("answer_key", "label", [(k,) for k in LABELS] + [NESTED_LABEL]),
        )
        for name, what, names in needed:
            if getattr(self.fmt, name) or any(n in paths for n in names):
                continue
            looked = ", ".join(".".join(n) for n in names)
            raise MissingColumn(
                f"{where}: no {what} column (looked for {looked}){after}; its columns: "
                f"{_listed(paths)}; set config.data.{name} to the {what}'s column"
            )


def _without(row: dict, key: str) -> dict:
    """`row` without the column or dotted path `key` (only its leaf: the nested dicts on the
    way are copied, their other entries kept)."""
    if key in row or "." not in key:
        return {k: v for k, v in row.items() if k != key}
    head, rest = key.split(".", 1)
    if not isinstance(row.get(head), dict):
        return row
    return {**row, head: _without(row[head], rest)}


def _listed(paths: list[tuple[str, ...]], nested: bool = False) -> str:
    """The top-level columns, and with `nested` the nested ones too, for a message."""
    listed = ", ".join(p[0] for p in paths if len(p) == 1) or "none"
    if nested:
        listed += "; nested: " + (", ".join(".".join(p) for p in paths if len(p) > 1) or "none")
    return listed
