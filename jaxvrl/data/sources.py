"""Random-access row sources for grain: JSONL (or a JSON list), parquet, an HF dataset
saved with `save_to_disk` (its arrow files are read with pyarrow; `datasets` is not needed),
a directory of parquet / JSONL files, and a Hugging Face Hub dataset by name (its parquet
shards fetched into the hub's cache by `jaxvrl.hub`, then read as parquet files).
A JSONL, JSON or parquet file may be remote (`gs://...`): it is copied into a local cache
once (`jaxvrl.remote.localize_file`) and named by its URL in every message.

Each source validates its file when opened, so a file that is not valid JSONL / parquet /
arrow fails at start with the path (and line for JSONL). Rows come back as dicts with an
extra `_where` key ("path:line" or "path row i") that bad-row messages and logs quote.
Each source lists its `columns` (paths: ("a",), ("a", "b") for nested fields), against which
a `RowFormat`'s keys are checked when the file is opened (`jaxvrl.data.columns`).
"""

from __future__ import annotations

import bisect
import collections
import json
import logging
import os
import re
import threading

from jaxvrl import hub
from jaxvrl.data.columns import RowFormat, RowMapper, column_paths
from jaxvrl.data.rows import SKIP, DataError
from jaxvrl.remote import is_remote, localize_file

log = logging.getLogger("jaxvrl")


def _holds_a_list(path: str) -> bool:
    """Whether a JSON file's first character (after a byte order mark and blanks) opens a list."""
    with open(path, "rb") as f:
        head = f.read(4096).removeprefix(b"\xef\xbb\xbf").lstrip()
        while not head:
            chunk = f.read(4096)
            if not chunk:
                return False
            head = chunk.lstrip()
    return head.startswith(b"[")


class JsonlSource:
    """One JSON object per line (blank lines ignored), or a `.json` file holding a list (a
    `.json` file of one object per line, as `datasets`' to_json writes, reads as JSON Lines)."""

    def __init__(self, path: str, name: str | None = None):
        self.path = path  # read from here; `name` (default: path) is quoted in messages
        self.name = name or path
        self._rows = None  # .json: parsed list; .jsonl: parsed lazily via line offsets
        self._offsets: list[tuple[int, int]] = []  # (byte offset, line number)
        columns: dict[tuple, None] = {}
        if path.endswith(".json") and _holds_a_list(path):
            with open(path, encoding="utf-8-sig") as f:  # a byte order mark is allowed
                try:
                    rows = json.load(f)
                except json.JSONDecodeError as e:
                    raise DataError(f"{self.name}: invalid JSON at line {e.lineno}: {e.msg}") from e
                except UnicodeDecodeError as e:
                    raise DataError(f"{self.name}: not UTF-8 text ({e})") from e
            for n, r in enumerate(rows):
                _check_object(r, f"{self.name} row {n}")
                columns.update(dict.fromkeys(column_paths(r)))
            self._rows = rows
            self.columns = list(columns)
            return
        with open(path, "rb") as f:
            offset = 0
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        obj = json.loads(line)
                    except (json.JSONDecodeError, UnicodeDecodeError) as e:
                        msg = getattr(e, "msg", str(e))
                        if path.endswith(".json"):
                            msg += "; a .json data file holds a list of rows or one per line"
                        raise DataError(f"{self.name}:{n}: invalid JSONL ({msg})") from e
                    _check_object(obj, f"{self.name}:{n}")
                    columns.update(dict.fromkeys(column_paths(obj)))
                    self._offsets.append((offset, n))
                offset += len(line)
        self.columns = list(columns)

    def __len__(self) -> int:
        return len(self._rows) if self._rows is not None else len(self._offsets)

    def __getitem__(self, i: int) -> dict:
        if self._rows is not None:
            return {**self._rows[i], "_where": f"{self.name} row {i}"}
        offset, line_no = self._offsets[i]
        with open(self.path, "rb") as f:  # one open per read: safe across reader threads
            f.seek(offset)
            row = json.loads(f.readline())
        return {**row, "_where": f"{self.name}:{line_no}"}


def _check_object(obj, where: str) -> None:
    if not isinstance(obj, dict):
        raise DataError(f"{where}: a row must be a JSON object, got {type(obj).__name__}")


class ParquetSource:
    """Rows of a parquet file. A row is read by decoding its row group, which is kept (as arrow
    columns, up to `cache_bytes` of groups, least recently used dropped first): a shuffled
    epoch then decodes each group about once while the groups fit, where re-reading the group
    for every row cost a whole group's bytes per row (about 0.1 s for a 1,000-row group of
    100 kB images). Only the row asked for becomes Python objects."""

    def __init__(self, path: str, name: str | None = None, cache_bytes: int = 1 << 30):
        import pyarrow.parquet as pq

        self.path, self.name, self.cache_bytes = path, name or path, cache_bytes
        try:
            self._file = pq.ParquetFile(path, memory_map=True)
        except Exception as e:  # noqa: BLE001 -- report any parquet failure with the path
            raise DataError(f"{self.name}: not a readable parquet file ({e})") from e
        self.columns = list(_schema_paths(self._file.schema_arrow))
        meta = self._file.metadata
        sizes = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        self._starts = [sum(sizes[:g]) for g in range(len(sizes))]
        self._len = sum(sizes)
        self._groups: collections.OrderedDict = collections.OrderedDict()  # group -> table
        self._cached = 0  # bytes of the kept groups
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._len

    def _group(self, g: int):
        with self._lock:
            table = self._groups.pop(g, None)
            if table is None:
                table = self._file.read_row_group(g)
                self._cached += table.nbytes
            self._groups[g] = table
            while len(self._groups) > 1 and self._cached > self.cache_bytes:
                self._cached -= self._groups.popitem(last=False)[1].nbytes
            return table

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self._len:
            raise IndexError(f"{self.name}: row {i} out of range [0, {self._len})")
        g = bisect.bisect_right(self._starts, i) - 1
        row = self._group(g).slice(i - self._starts[g], 1).to_pylist()[0]
        return {**row, "_where": f"{self.name} row {i}"}

    def __getstate__(self):  # picklable for grain worker processes: reopen there
        return {"path": self.path, "name": self.name, "cache_bytes": self.cache_bytes}

    def __setstate__(self, state):
        self.__init__(state["path"], state["name"], state.get("cache_bytes", 1 << 30))


class ArrowDatasetSource:
    """An HF `Dataset.save_to_disk` directory (state.json + *.arrow), or one split of a
    `DatasetDict` directory (dataset_dict.json + one folder per split)."""

    def __init__(self, path: str, split: str | None = None):
        import pyarrow as pa

        self.path = path
        if os.path.exists(os.path.join(path, "dataset_dict.json")):
            with open(os.path.join(path, "dataset_dict.json")) as f:
                splits = json.load(f).get("splits", [])
            split = split or "train"
            if split not in splits:
                raise DataError(f"{path}: no split {split!r} (has {splits})")
            path = os.path.join(path, split)
        state = os.path.join(path, "state.json")
        if not os.path.exists(state):
            raise DataError(f"{path}: not a dataset saved with save_to_disk (no state.json)")
        with open(state) as f:
            files = [d["filename"] for d in json.load(f)["_data_files"]]
        tables = []
        for name in files:
            fp = os.path.join(path, name)
            try:
                tables.append(_read_arrow(fp))
            except Exception as e:  # noqa: BLE001 -- report any arrow failure with the path
                raise DataError(f"{fp}: not a readable arrow file ({e})") from e
        self._table = pa.concat_tables(tables) if tables else pa.table({})
        self.where = path
        self.columns = list(_schema_paths(self._table.schema))

    def __len__(self) -> int:
        return self._table.num_rows

    def __getitem__(self, i: int) -> dict:
        row = self._table.slice(i, 1).to_pylist()[0]
        return {**row, "_where": f"{self.where} row {i}"}


def _schema_paths(fields, prefix: tuple = ()):
    """Column paths of an arrow schema (or struct type): nested struct fields included."""
    import pyarrow as pa

    for field in fields:
        yield (*prefix, field.name)
        if pa.types.is_struct(field.type):
            yield from _schema_paths(field.type, (*prefix, field.name))


def _read_arrow(path: str):
    import pyarrow as pa

    source = pa.memory_map(path)
    try:  # `datasets` writes the IPC stream format
        return pa.ipc.open_stream(source).read_all()
    except pa.ArrowInvalid:
        return pa.ipc.open_file(pa.memory_map(path)).read_all()


class ConcatSource:
    """Several sources as one index space, in order."""

    def __init__(self, sources: list):
        self.sources = sources
        self._starts = []
        n = 0
        for s in sources:
            self._starts.append(n)
            n += len(s)
        self._len = n

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self._len:
            raise IndexError(f"row {i} out of range [0, {self._len})")
        k = bisect.bisect_right(self._starts, i) - 1
        return self.sources[k][i - self._starts[k]]


class FormattedSource:
    """A source whose rows come back in the row format (`RowMapper`); its keys are checked
    against the source's columns (or, with a format hook, its output for the first row),
    which `columns` lists."""

    def __init__(self, source, fmt: RowFormat, name: str):
        self.source, self.mapper = source, RowMapper(fmt)
        self.columns = source.columns
        if len(source) == 0:
            return
        if fmt.format:
            first = self.mapper(source[0])
            if SKIP in first:  # the hook fails on the first row: most likely on every row
                raise DataError(f"{first.get('_where', name + ' row 0')}: {first[SKIP][1]}")
            self.columns = list(column_paths({k: v for k, v in first.items() if k != "_where"}))
        self.mapper.check(self.columns, name)

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> dict:
        return self.mapper(self.source[i])


class DataNotFound(DataError):
    """A data path that names no file, directory or Hub dataset (`reason` says why)."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


def _file_source(local: str, name: str):
    """The source of one data file, chosen by the suffix of its name."""
    if name.endswith(".parquet"):
        return ParquetSource(local, name=name)
    if name.endswith((".jsonl", ".json")):
        return JsonlSource(local, name=name)
    raise DataError(
        f"{name}: unknown data format (expected .jsonl, .json, .parquet, a directory or a "
        "Hugging Face Hub dataset name)"
    )


def _formatted(src, fmt: RowFormat | None, name: str):
    """`src` read in the row format `fmt` (None: raw rows, unchecked). Without keys or a hook
    the rows still pass the mapper: a verl row that kept its source's columns is read as verl
    reads it (`columns.verl_keys`)."""
    return src if fmt is None else FormattedSource(src, fmt, name)


# the files a data folder is read from: .json files only where it holds neither of the
# others, and never a dataset's metadata (a save_to_disk folder's state.json and
# dataset_dict.json mark it as one, `_directory_source`)
DATA_FILES = (".parquet", ".jsonl")
METADATA = ("dataset_info.json", "dataset_infos.json", "dataset_dict.json", "state.json")


def _directory_files(path: str, split: str | None) -> list[str]:
    """The .parquet and .jsonl files under `path` (hidden folders skipped), else its .json
    files (`DATA_FILES`), sorted; with a split, those named for it (`<split>.jsonl`,
    `<split>-00000-of-00002.parquet`, or any file in a folder `<split>/`)."""
    named = re.compile(rf"(?:.*/)?{re.escape(split)}(?:/.*|[-.][^/]*)") if split else None
    found, json_files = [], []
    for dirpath, dirs, files in os.walk(path):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for f in files:
            rel = os.path.relpath(os.path.join(dirpath, f), path).replace(os.sep, "/")
            if named is not None and not named.fullmatch(rel):
                continue
            if f.endswith(DATA_FILES):
                found.append(rel)
            elif f.endswith(".json") and f not in METADATA:
                json_files.append(rel)
    return sorted(found or json_files)


def _directory_source(path: str, split: str | None, fmt: RowFormat | None):
    """A `save_to_disk` directory (state.json or dataset_dict.json beside arrow files), or
    one holding parquet / JSONL files (read in the order of their sorted paths)."""
    if any(os.path.exists(os.path.join(path, f)) for f in ("state.json", "dataset_dict.json")):
        return _formatted(ArrowDatasetSource(path, split), fmt, path)
    files = _directory_files(path, split)
    if not files:
        which = f" for split {split!r}" if split else ""
        raise DataError(
            f"{path}: no .parquet, .jsonl or .json files{which}, and not a dataset saved with "
            "save_to_disk (no state.json)"
        )
    names = [os.path.join(path, f) for f in files]
    return ConcatSource([_formatted(_file_source(n, n), fmt, n) for n in names])


def _hub_source(text: str, fmt: RowFormat | None):
    """The parquet shards of a Hub dataset's config and split (`jaxvrl.hub.fetch_dataset`),
    each named `hf://datasets/<repo>@<commit>/<file>` in messages."""
    try:
        snap, files = hub.fetch_dataset(text)
    except hub.NotFound as e:  # the name could be a mistyped local path too: say both
        raise DataNotFound(text, f"{e} (no local file or directory has that name)") from None
    repo = hub.dataset_name(text)[0]
    log.info("%s: %d parquet files of %s at commit %s", text, len(files), repo, snap.commit)
    sources = []
    for f in files:
        name = f"hf://datasets/{repo}@{snap.commit[:12]}/{f}"
        sources.append(_formatted(ParquetSource(os.path.join(snap.path, f), name=name), fmt, name))
    return ConcatSource(sources)


def open_source(path: str, split: str | None = None, fmt: RowFormat | None = None):
    """The source for one data path, chosen by its form: a `.jsonl` / `.json` / `.parquet`
    file (local or a remote URL), a local directory (`save_to_disk`, or parquet / JSONL
    files; `dir@split` picks a split), or a Hugging Face Hub dataset name (`org/name`,
    `org/name@split`, `org/name:config@split`; a local path of the same text wins). With
    `fmt`, rows come back in the row format, and a key naming no column of a file fails
    here. A path that names nothing raises DataNotFound."""
    if is_remote(path):
        if not path.endswith((".parquet", ".jsonl", ".json")):
            raise DataError(f"{path}: a remote data path must be a .jsonl, .json or .parquet file")
        try:
            local = localize_file(path)
        except FileNotFoundError:
            raise DataNotFound(path, "data file not found") from None
        return _formatted(_file_source(local, path), fmt, path)
    if os.path.isdir(path):
        return _directory_source(path, split, fmt)
    if os.path.exists(path):
        return _formatted(_file_source(path, path), fmt, path)
    base, _, at = path.rpartition("@")
    if base and os.path.isdir(base):
        return _directory_source(base, at, fmt)
    if hub.dataset_name(path) and not path.endswith((".parquet", ".jsonl", ".json", ".arrow")):
        return _hub_source(path, fmt)
    raise DataNotFound(path, "data file not found")


def open_sources(paths, split: str | None = None, fmt: RowFormat | None = None) -> ConcatSource:
    """All data paths as one source (each validated now)."""
    paths = [paths] if isinstance(paths, str) else list(paths)
    return ConcatSource([open_source(p, split, fmt) for p in paths])


def read_rows(path: str, split: str | None = None, fmt: RowFormat | None = None) -> list[dict]:
    """All rows of one data path, eagerly (validated like the lazy sources)."""
    src = open_source(path, split, fmt)
    return [src[i] for i in range(len(src))]
