"""Remote paths (`gs://bucket/...`, any fsspec URL) for the model, the data and the workdir.

Checkpoints go to the remote workdir directly (orbax writes gs:// itself). Everything else is
plain file I/O, so:
- `localize_dir(url)` copies a remote model directory (config.json, safetensors shards,
  tokenizer files) into a local cache once and returns the local path;
- `localize_file(url)` does the same for one data file (JSONL, JSON, parquet), and
  `read_bytes(url)` reads one image;
- `MirroredDir(url)` is a local directory whose files (metrics.jsonl, markdown logs,
  TensorBoard events) are pulled from `url` at start (a resumed run appends to them) and pushed
  back when they change, at most every `min_interval_s` seconds and at close.

Requests to gs:// never wait forever: `bound_remote_io(url)` (called before the first access
here, in checkpoint.py and export.py) makes a request that receives nothing for a while fail,
to be retried and then raised; an error names the remote path it was about.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import time

log = logging.getLogger("jaxvrl")

CONNECT_S = 60.0  # a gs:// connection not made in this long fails (gcsfs retries it)
STALL_S = 120.0  # a gs:// request that receives nothing for this long fails (gcsfs retries it)
# tensorstore's curl: a transfer below LIMIT bytes/s for TIME seconds fails and is retried
# (what JAX itself sets on TPU VMs; elsewhere tensorstore has no such limit)
TENSORSTORE_STALL = {
    "TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS": "60",
    "TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES": "256",
}


def is_remote(path: str | None) -> bool:
    return bool(path) and "://" in path and not path.startswith("file://")


def request_timeouts():
    """aiohttp timeouts for gcsfs: none on a whole transfer (a model shard may take minutes),
    CONNECT_S to connect, STALL_S between two reads of the response."""
    import aiohttp

    return aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_S, sock_read=STALL_S)


def bound_remote_io(url: str | None) -> None:
    """Process-wide stall limits for GCS when `url` is on gs:// (else nothing); settings the
    user made (fsspec config, environment) are kept. Call before the first gs:// access:
    fsspec caches filesystems, and tensorstore reads its settings when it first connects.

    gcsfs (the logs and the model here, orbax's checkpoint metadata through etils.epath) sends
    every request without a timeout, so a connection that goes silent (e.g. an idle pooled
    one dropped without a reset) blocks fsspec's sync(), hence the run, forever; with
    request_timeouts() such a request fails, gcsfs retries it (6 attempts) and then raises.
    tensorstore (the checkpoint arrays) gets the low-speed limit TENSORSTORE_STALL."""
    if not (url or "").startswith(("gs://", "gcs://")):
        return
    for k, v in TENSORSTORE_STALL.items():
        os.environ.setdefault(k, v)
    if importlib.util.find_spec("gcsfs") is None:
        return
    import fsspec.config

    fsspec.config.conf.setdefault("gs", {}).setdefault("requests_timeout", request_timeouts())


def forget_listings() -> None:
    """Drops the directory listings that fsspec's GCS filesystems have cached (gcsfs answers
    "no such file" from a cached listing of the parent that lacks it), so the next access
    asks the bucket."""
    if importlib.util.find_spec("gcsfs") is None:
        return
    import gcsfs

    for fs in list(gcsfs.GCSFileSystem._cache.values()):
        fs.invalidate_cache()


@contextlib.contextmanager
def naming(what: str):
    """Names `what` (e.g. 'uploading x to gs://b/run/x') on an exception raised inside: logged,
    and added to its traceback as a note (Python >= 3.11); the exception is re-raised as is."""
    try:
        yield
    except Exception as e:
        log.error("%s failed: %s: %s", what, type(e).__name__, e)
        if hasattr(e, "add_note"):
            e.add_note(f"while {what}")
        raise


def _fs(url: str):
    import fsspec

    bound_remote_io(url)
    return fsspec.core.url_to_fs(url)


def _cache_dir(url: str, root: str | None) -> str:
    root = root or os.environ.get("JAXVRL_CACHE", os.path.expanduser("~/.cache/jaxvrl"))
    name = url.rstrip("/").rsplit("/", 1)[-1] or "root"
    return os.path.join(root, f"{name}-{hashlib.sha1(url.encode()).hexdigest()[:12]}")


def localize_dir(url: str, cache_root: str | None = None) -> str:
    """A local copy of the files directly under `url` (sub-directories are not needed by an
    HF checkpoint). Files already cached with the same size are not copied again. A local
    path is returned unchanged."""
    if not is_remote(url):
        return url
    fs, root = _fs(url)
    with naming(f"looking up {url}"):
        found = fs.exists(root)
    if not found:
        raise FileNotFoundError(f"model directory {url} does not exist")
    local = _cache_dir(url, cache_root)
    os.makedirs(local, exist_ok=True)
    with naming(f"listing {url}"):
        entries = [e for e in fs.ls(root, detail=True) if e["type"] == "file"]
    if not entries:
        raise FileNotFoundError(f"model directory {url} holds no files")
    for e in entries:
        name = e["name"].rstrip("/").rsplit("/", 1)[-1]
        dst = os.path.join(local, name)
        if os.path.exists(dst) and os.path.getsize(dst) == e["size"]:
            continue
        t0 = time.time()
        with naming(f"copying {url}/{name}"):
            fs.get(e["name"], dst + ".part")
        os.replace(dst + ".part", dst)  # a cut copy never looks complete
        log.info("copied %s (%.1f MB, %.1fs)", name, e["size"] / 1e6, time.time() - t0)
    return local


def localize_file(url: str, cache_root: str | None = None) -> str:
    """A local copy of the file `url` (copied once; kept while the sizes agree). A local path
    is returned unchanged. Raises FileNotFoundError."""
    if not is_remote(url):
        return url
    fs, root = _fs(url)
    if not fs.isfile(root):
        raise FileNotFoundError(f"{url} not found")
    local = os.path.join(_cache_dir(url, cache_root), url.rstrip("/").rsplit("/", 1)[-1])
    size = fs.size(root)
    if os.path.exists(local) and os.path.getsize(local) == size:
        return local
    os.makedirs(os.path.dirname(local), exist_ok=True)
    t0 = time.time()
    fs.get(root, local + ".part")
    os.replace(local + ".part", local)
    log.info("copied %s (%.1f MB, %.1fs)", url, size / 1e6, time.time() - t0)
    return local


def probe_writable(url: str) -> None:
    """Creates the directory `url` (local or remote) if needed and writes, then removes, a
    small file in it; raises OSError (or the filesystem's error) when that fails."""
    name = f".jaxvrl-write-probe-{os.getpid()}"
    if not is_remote(url):
        os.makedirs(url, exist_ok=True)
        path = os.path.join(url, name)
        with open(path, "wb") as f:
            f.write(b"ok")
        os.remove(path)
        return
    fs, root = _fs(url)
    path = root.rstrip("/") + "/" + name
    fs.pipe_file(path, b"ok")
    fs.rm_file(path)


def read_bytes(url: str) -> bytes:
    """The whole file at `url`; FileNotFoundError when there is none."""
    fs, root = _fs(url)
    return fs.cat_file(root)


class MirroredDir:
    """A local working copy of a remote log directory; `local` is where writers write."""

    def __init__(self, url: str, cache_root: str | None = None, min_interval_s: float = 30.0):
        self.url = url.rstrip("/")
        self.fs, self.root = _fs(self.url)
        self.local = _cache_dir(self.url, cache_root) + "-logs"
        self.min_interval_s = min_interval_s
        self._pushed: dict[str, tuple[int, int]] = {}
        self._last_push = 0.0
        os.makedirs(self.local, exist_ok=True)
        self.pull()
        self._last_push = time.time()

    def _rel(self, remote_name: str) -> str:
        return remote_name[len(self.root.rstrip("/")) + 1 :]

    def pull(self) -> int:
        """Copies the remote log files (not the checkpoints) into `local`; -> files copied."""
        with naming(f"listing {self.url}"):
            names = self.fs.find(self.root) if self.fs.exists(self.root) else []
        n = 0
        for name in names:
            rel = self._rel(name)
            if rel.startswith("checkpoints/"):
                continue
            dst = os.path.join(self.local, rel)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            with naming(f"copying {self.url}/{rel}"):
                self.fs.get(name, dst)
            self._pushed[rel] = self._signature(dst)
            n += 1
        return n

    @staticmethod
    def _signature(path: str) -> tuple[int, int]:
        st = os.stat(path)
        return st.st_size, st.st_mtime_ns

    def push(self, force: bool = False) -> int:
        """Uploads the files changed since the last push; -> files uploaded. Without `force`,
        does nothing within `min_interval_s` of the previous push."""
        if not force and time.time() - self._last_push < self.min_interval_s:
            return 0
        n = 0
        for dirpath, _, files in os.walk(self.local):
            for f in files:
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, self.local).replace(os.sep, "/")
                sig = self._signature(path)
                if self._pushed.get(rel) == sig:
                    continue
                with naming(f"uploading {rel} to {self.url}/{rel}"):
                    self.fs.put(path, f"{self.root}/{rel}")
                self._pushed[rel] = sig
                n += 1
        self._last_push = time.time()
        return n
