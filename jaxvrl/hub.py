"""Models and datasets named on the Hugging Face Hub, fetched into its cache.

    model.path=Qwen/Qwen2.5-VL-3B-Instruct            (or org/name@revision)
    data.train_files=HuggingFaceM4/A-OKVQA@train      (or org/name, org/name:config@split)

`fetch_model` and `fetch_dataset` download with `huggingface_hub.snapshot_download` into the
hub's cache (HF_HOME, HF_HUB_CACHE) only what a run reads: for a model its config, safetensors
weights and tokenizer / processor / chat-template files (no .bin or .pth copies, no
`original/`); for a dataset the parquet shards of one config and split, from the repository's
own layout (`data/<split>-*.parquet`, `<config>/<split>-*.parquet`) or else from the Hub's
parquet conversion (revision `refs/convert/parquet`, `<config>/<split>/*.parquet`).
huggingface_hub reads HF_TOKEN, HF_ENDPOINT and HF_HUB_OFFLINE itself; offline, a cached
snapshot is used as it is. On several hosts each host fetches to its own disk; processes that
share a disk wait on snapshot_download's file locks, so none reads a half-written file.

A snapshot directory is named by the commit it holds (`Snapshot.commit`, recorded in run.json).
A name that cannot be fetched raises `NotFound`, one line saying why and what to do.

`push_folder` goes the other way: it creates a model repository (if it does not exist) and
uploads a local directory to it in one commit (`python -m jaxvrl.export --push_to_hub`); a
push that fails raises `PushFailed`, one line.
"""

from __future__ import annotations

import dataclasses
import os
import re

# org/name as the Hub spells repository ids (no local path starts with a letter and has one '/'
# unless it is relative: a local path that exists always wins over a name)
_REPO = r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*"
_MODEL = re.compile(rf"(?P<repo>{_REPO})(?:@(?P<revision>[^@\s]+))?")
_DATASET = re.compile(rf"(?P<repo>{_REPO})(?::(?P<config>[\w.-]+))?(?:@(?P<split>[\w.-]+))?")

MODEL_FILES = [
    "*.json",  # config, generation config, safetensors index, tokenizer / processor files
    "*.safetensors",
    "*.jinja",  # chat templates
    "tokenizer.model",
    "merges.txt",
    "vocab.*",
]
IGNORED = ["*.bin", "*.pth", "*.pt", "original/*"]  # other copies of the same weights
PARQUET_REVISION = "refs/convert/parquet"  # where the Hub keeps its parquet conversion


class NotFound(LookupError):
    """A Hub name that cannot be fetched (the message is one line)."""


class NoRevision(NotFound):
    """The repository exists but not this revision."""


class PushFailed(RuntimeError):
    """A push to the Hub that did not happen (the message is one line)."""


@dataclasses.dataclass(frozen=True)
class Snapshot:
    path: str  # the local directory (a snapshot in the hub's cache)
    commit: str  # the commit it holds: the snapshot directory's name


def model_name(text: str | None) -> tuple[str, str | None] | None:
    """(repo id, revision or None) when `text` is a Hub model name (`org/name`,
    `org/name@revision`) and no local path; else None."""
    if not text or "://" in text or os.path.exists(text):
        return None
    m = _MODEL.fullmatch(text)
    return (m["repo"], m["revision"]) if m else None


def is_repo_id(text: str) -> bool:
    """`org/name` as the Hub spells repository ids (no revision)."""
    return re.fullmatch(_REPO, text) is not None


def dataset_name(text: str | None) -> tuple[str, str | None, str] | None:
    """(repo id, config or None, split) when `text` is a Hub dataset name (`org/name`,
    `org/name@split`, `org/name:config@split`; split default `train`) and no local path;
    else None."""
    if not text or "://" in text or os.path.exists(text):
        return None
    m = _DATASET.fullmatch(text)
    return (m["repo"], m["config"], m["split"] or "train") if m else None


def _offline() -> bool:
    from huggingface_hub import constants

    return constants.is_offline_mode()


def _not_cached(what: str) -> str:
    from huggingface_hub import constants

    if _offline():
        return (
            f"not found on the Hugging Face Hub and not cached (offline: HF_HUB_OFFLINE is set, "
            f"cache {constants.HF_HUB_CACHE}); fetch {what} once with network access (unset "
            "HF_HUB_OFFLINE, or `hf download` it on a host that has one and copy HF_HOME), or set"
        )
    return (
        f"not cached and the Hugging Face Hub ({constants.ENDPOINT}) could not be reached; check "
        "the network (HF_ENDPOINT for a mirror), or set"
    )


def _download(repo: str, repo_type: str, revision: str | None, allow: list[str]) -> str | None:
    """snapshot_download's directory; None when the Hub is out of reach (offline or
    unreachable) and the cache lacks this revision. A missing or gated repository raises
    NotFound, a missing revision NoRevision."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    kind = "dataset" if repo_type == "dataset" else "model"
    try:
        return snapshot_download(
            repo,
            repo_type=repo_type,
            revision=revision,
            allow_patterns=allow,
            ignore_patterns=IGNORED,
            local_files_only=_offline(),
        )
    except GatedRepoError:
        raise NotFound(
            f"the {kind} {repo} is gated on the Hugging Face Hub: accept its terms on its page "
            "and set HF_TOKEN to a token of that account"
        ) from None
    except RepositoryNotFoundError:
        raise NotFound(
            f"no {kind} {repo} on the Hugging Face Hub (a wrong name, or a private repository: "
            "set HF_TOKEN)"
        ) from None
    except HFValidationError as e:
        raise NotFound(f"{repo!r} is not a valid Hugging Face Hub name ({e})") from None
    except RevisionNotFoundError:
        raise NoRevision(
            f"the {kind} {repo} has no revision {revision!r} on the Hugging Face Hub"
        ) from None
    except LocalEntryNotFoundError:
        return None


def fetch_model(text: str, weights: bool = True) -> Snapshot:
    """The snapshot of Hub model `text` (`org/name[@revision]`): its config, tokenizer and
    processor files, and (weights=True) its safetensors weights. Raises NotFound."""
    repo, revision = model_name(text) or (text, None)
    allow = MODEL_FILES if weights else [p for p in MODEL_FILES if p != "*.safetensors"]
    path = _download(repo, "model", revision, allow)
    if path is None:
        raise NotFound(f"{_not_cached(text)} a local model directory")
    if not os.path.exists(os.path.join(path, "config.json")):
        raise NotFound(f"{repo} has no config.json: not a model repository")
    if weights and not any(f.endswith(".safetensors") for f in os.listdir(path)):
        raise NotFound(
            f"{repo} has no safetensors weights (only .bin or .pth files?): convert them with "
            "transformers' save_pretrained and set a local model directory"
        )
    return Snapshot(path, os.path.basename(os.path.normpath(path)))


def _own_layout(config: str | None, split: str) -> tuple[list[str], re.Pattern]:
    """(allow patterns, file regex) of the parquet files `push_to_hub` writes: data/ for the
    default config, <config>/ for the others; one shard `<split>.parquet` or several
    `<split>-0000i-of-0000n[-fingerprint].parquet`."""
    folder = config if config and config != "default" else "data"
    s = re.escape(split)
    names = rf"{s}(?:-\d+-of-\d+(?:-[0-9a-f]+)?)?\.parquet"
    return [f"{folder}/{split}-*.parquet", f"{folder}/{split}.parquet"], re.compile(
        rf"{re.escape(folder)}/{names}"
    )


def _converted_layout(config: str | None, split: str) -> tuple[list[str], re.Pattern]:
    folder = f"{config or 'default'}/{split}"
    return [f"{folder}/*.parquet"], re.compile(rf"{re.escape(folder)}/[^/]+\.parquet")


def _matching(path: str, pattern: re.Pattern) -> list[str]:
    found = []
    for dirpath, _, files in os.walk(path):
        for f in files:
            rel = os.path.relpath(os.path.join(dirpath, f), path).replace(os.sep, "/")
            if pattern.fullmatch(rel):
                found.append(rel)
    return sorted(found)  # shard order: -00000-of-, -00001-of-, ... or 0000, 0001, ...


def fetch_dataset(text: str) -> tuple[Snapshot, list[str]]:
    """(snapshot, its parquet files in order, relative to snapshot.path) of the config and
    split that Hub dataset name `text` names. Raises NotFound."""
    repo, config, split = dataset_name(text) or (text, None, "train")
    reached = False
    for revision, layout in (("main", _own_layout), (PARQUET_REVISION, _converted_layout)):
        allow, pattern = layout(config, split)
        try:
            path = _download(repo, "dataset", revision, allow)
        except NoRevision:  # no parquet conversion
            path = None
            reached = True
        if path is None:
            continue
        reached = True
        files = _matching(path, pattern) if os.path.isdir(path) else []
        if files:
            return Snapshot(path, os.path.basename(os.path.normpath(path))), files
    if not reached:
        raise NotFound(f"{_not_cached(text)} local data files")
    which = f"config {config!r}, split {split!r}" if config else f"split {split!r}"
    raise NotFound(
        f"the dataset {repo} has no parquet files for {which} (looked for "
        f"{_own_layout(config, split)[0][0]} and, at revision {PARQUET_REVISION}, "
        f"{_converted_layout(config, split)[0][0]}); name another split (@split) or config "
        "(:config), or set local data files"
    )


# --- pushing ----------------------------------------------------------------------------------


def _api():
    """The Hub client (HF_TOKEN and HF_ENDPOINT are read by huggingface_hub)."""
    from huggingface_hub import HfApi

    return HfApi()


def one_line(e: BaseException) -> str:
    """`Type: message` on one line (the Hub's HTTP errors span several: request id, body)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def push_folder(
    folder: str,
    repo_id: str,
    *,
    private: bool = False,
    message: str | None = None,
    allow: list[str] | None = None,
    delete: list[str] | None = None,
) -> str:
    """Creates model repository `repo_id` (`private` when it is new; an existing one is kept
    as it is) and uploads local directory `folder` to its main branch in one commit: only the
    files matching `allow` (default: all), and the repository's files matching `delete` that
    the upload does not replace are removed in the same commit (e.g. the shards of an earlier,
    bigger upload). -> the commit's URL. Any failure (no token, no network, offline mode, a
    refusal by the Hub) raises PushFailed."""
    step = "creating the repository"
    try:
        api = _api()
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        step = "uploading"
        info = api.upload_folder(
            repo_id=repo_id,
            folder_path=folder,
            repo_type="model",
            commit_message=message,
            allow_patterns=allow,
            delete_patterns=delete,
        )
    except Exception as e:  # noqa: BLE001 - every failure is the caller's one line
        raise PushFailed(f"{step} failed: {one_line(e)}") from e
    return str(getattr(info, "commit_url", info))
