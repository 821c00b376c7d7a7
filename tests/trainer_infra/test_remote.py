"""gs:// model and workdir: localize_dir copies a model once; MirroredDir pulls and pushes
logs; a whole train run (and its resume) against a loopback GCS emulator."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

from jaxvrl import remote
from jaxvrl.remote import MirroredDir, is_remote, localize_dir
from tests.trainer_infra.workers import needs_gcs, run_worker


def test_is_remote():
    assert is_remote("gs://b/x") and is_remote("memory://x")
    assert not is_remote("/tmp/x") and not is_remote(None) and not is_remote("file:///tmp/x")


def test_localize_and_mirror_on_an_in_memory_filesystem(tmp_path):
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.pipe({"/model/config.json": b"{}", "/model/model.safetensors": b"x" * 10})
    local = localize_dir("memory://model", cache_root=str(tmp_path))
    assert sorted(os.listdir(local)) == ["config.json", "model.safetensors"]
    assert open(os.path.join(local, "model.safetensors"), "rb").read() == b"x" * 10
    with pytest.raises(FileNotFoundError, match="memory://missing"):
        localize_dir("memory://missing", cache_root=str(tmp_path))

    fs.pipe({"/run/metrics.jsonl": b'{"step": 0}\n', "/run/checkpoints/1/x": b"big"})
    m = MirroredDir("memory://run", cache_root=str(tmp_path), min_interval_s=3600)
    assert open(os.path.join(m.local, "metrics.jsonl")).read() == '{"step": 0}\n'
    assert not os.path.exists(os.path.join(m.local, "checkpoints"))  # orbax's, not pulled
    with open(os.path.join(m.local, "metrics.jsonl"), "a") as f:
        f.write('{"step": 1}\n')
    assert m.push() == 0  # within min_interval_s
    assert m.push(force=True) == 1 and m.push(force=True) == 0  # only what changed
    assert fs.cat("/run/metrics.jsonl") == b'{"step": 0}\n{"step": 1}\n'


def test_a_failed_upload_names_the_remote_path(tmp_path, monkeypatch, caplog):
    import fsspec

    m = MirroredDir("memory://named", cache_root=str(tmp_path), min_interval_s=0)
    with open(os.path.join(m.local, "metrics.jsonl"), "w") as f:
        f.write("{}\n")

    def stalled(*args, **kwargs):
        raise fsspec.exceptions.FSTimeoutError()  # what a stalled gcsfs request ends in

    monkeypatch.setattr(m.fs, "put", stalled)
    with pytest.raises(fsspec.exceptions.FSTimeoutError) as e:
        m.push(force=True)
    where = "memory://named/metrics.jsonl"
    assert where in caplog.text
    if sys.version_info >= (3, 11):
        assert any(where in note for note in e.value.__notes__)


@pytest.mark.skipif(not importlib.util.find_spec("gcsfs"), reason="needs gcsfs")
def test_gs_requests_get_stall_limits_unless_the_user_set_some(monkeypatch):
    import fsspec.config

    monkeypatch.setattr(fsspec.config, "conf", {})
    monkeypatch.setattr(os, "environ", dict(os.environ))
    for k in remote.TENSORSTORE_STALL:
        os.environ.pop(k, None)
    os.environ["TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES"] = "1000"  # the user's, kept
    remote.bound_remote_io("memory://x")  # not GCS: nothing
    assert not fsspec.config.conf and "TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS" not in os.environ
    remote.bound_remote_io("gs://b/run")
    fs = fsspec.filesystem("gs", token="anon", skip_instance_cache=True)
    t = fs.requests_timeout  # gcsfs's default is None: no timeout at all
    assert t.total is None and t.sock_read == remote.STALL_S
    assert t.sock_connect == remote.CONNECT_S
    assert os.environ["TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS"] == "60"
    assert os.environ["TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES"] == "1000"
    fsspec.config.conf["gs"]["requests_timeout"] = 5.0  # a user's setting, kept
    remote.bound_remote_io("gs://b/run")
    assert fsspec.filesystem("gs", token="anon", skip_instance_cache=True).requests_timeout == 5.0


@pytest.mark.skipif(
    not importlib.util.find_spec("gcp_storage_emulator"), reason="needs gcp-storage-emulator"
)
def test_the_emulator_serves_generations_and_their_conditions_as_gcs_does():
    """What tensorstore's OCDBT relies on when it writes a checkpoint's manifest: a read
    carries the object's generation, and ifGenerationMatch / ifGenerationNotMatch hold."""
    import urllib.error
    import urllib.request

    from tests.trainer_infra.gcs_emulator import BUCKET, Emulator

    server = Emulator()
    upload = f"{server.url}/upload/storage/v1/b/{BUCKET}/o?uploadType=media&name=d%2Fm"
    media = f"{server.url}/storage/v1/b/{BUCKET}/o/d%2Fm?alt=media"

    def call(url, data=None, headers=None):
        req = urllib.request.Request(url, data=data, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, dict(r.headers), r.read()
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), b""

    try:
        status, _, body = call(upload + "&ifGenerationMatch=0", b"abcdef")
        gen = int(json.loads(body)["generation"])
        assert status == 200 and gen > 0
        assert call(upload + "&ifGenerationMatch=0", b"x")[0] == 412  # exists already
        status, headers, body = call(media, headers={"Range": "bytes=1-3"})
        assert (status, body, int(headers["x-goog-generation"])) == (206, b"bcd", gen)
        assert call(f"{media}&ifGenerationNotMatch={gen}")[0] == 304
        assert call(f"{media}&ifGenerationMatch={gen + 1}")[0] == 412
        status, _, body = call(f"{upload}&ifGenerationMatch={gen}", b"ghi")
        assert status == 200 and int(json.loads(body)["generation"]) > gen
        assert call(media)[2] == b"ghi"
    finally:
        server.stop()


@needs_gcs
def test_train_run_with_gs_model_and_workdir(tmp_path):
    """Train 2 steps with the model and the workdir on gs://, then resume from the gs://
    checkpoint at step 2 and train to 3: the second run starts from the saved parameters."""
    env = dict(os.environ, JAXVRL_CACHE=str(tmp_path / "cache"))
    # the worker dumps its threads' stacks and exits by itself after 480 s
    res = run_worker("gcs_train_worker.py", "480", timeout=540, env=env, tail=8000)
    first, second = res["run2"], res["run3"]
    assert first["steps"] == [1, 2] and second["steps"] == [1, 2, 3]  # resumed at 2
    for r in (first, second):
        assert {"metrics.jsonl", "rollout_results.md"} <= set(r["files"]) and r["tb"]
        assert r["loss_finite"]
    assert first["checkpoints"] == ["2"] and "3" in second["checkpoints"]
    assert res["resumed_step"] == 2 and res["params_leaves"] > 0 and res["trained"]
    assert res["resumed_params_equal"]  # exactly the parameters the first run saved
