"""A loopback GCS emulator for the subprocess workers (not collected by pytest): call
start_emulator() before gcsfs or tensorstore are imported, since both read the environment.

gcp-storage-emulator's object store and routes, served by a server of our own that behaves
like GCS where orbax's writers rely on it:
- every object download carries `x-goog-generation` (the emulator sends none; tensorstore then
  stamps what it read with generation 0, and its next conditional read of that object, e.g.
  OCDBT re-reading `manifest.ocdbt` while a checkpoint is written, fails with "Malformed
  StorageGeneration");
- `ifGenerationMatch` / `ifGenerationNotMatch` are honoured on object reads and uploads (412 /
  304), as OCDBT's conditional manifest writes expect;
- requests are accepted concurrently (tensorstore keeps many in flight; the emulator's
  single-threaded server has a listen backlog of 5) and handled one at a time (its store is
  not thread-safe), a request body being read before the turn comes;
- its threads are daemons, and a client that stops sending is dropped after a timeout, so
  neither can keep a worker process alive (the emulator's own serving thread is not a daemon:
  a worker that raised before stopping it never exited);
- multipart uploads keep every byte: the emulator reads them with Python's email parser,
  which takes a file's last byte "\r" for part of the "\n" line break gcsfs puts before the
  closing boundary (an object one byte short: a checkpoint uploaded with `fs.put` was
  unreadable whenever one of its files ended in "\r").
"""

from __future__ import annotations

import io
import logging
import os
import re
import sys
import threading
from http.server import ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlparse

BUCKET = "jaxvrl-test"
TIMEOUT_S = 60  # a connection idle this long is dropped

_OBJECT = re.compile(r"^(?:/download)?/storage/v1/b/(?P<bucket>[-.\w]+)/o/(?P<object>.*[^/]+)$")
_UPLOAD = re.compile(r"^/upload/storage/v1/b/(?P<bucket>[-.\w]+)/o$")


def _handler_class():
    from gcp_storage_emulator.exceptions import NotFound
    from gcp_storage_emulator.server import RequestHandler

    class Handler(RequestHandler):
        timeout = TIMEOUT_S
        _extra_headers: dict = {}

        def parse_request(self):
            ok = super().parse_request()
            # the base class answers `Expect: 100-continue` only when it speaks HTTP/1.1;
            # without the interim reply curl waits a second before each large upload
            expect = self.headers.get("Expect", "") if ok else ""
            if expect.lower() == "100-continue" and self.request_version >= "HTTP/1.1":
                self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                self.wfile.flush()
            return ok

        def end_headers(self):
            for k, v in self._extra_headers.items():
                self.send_header(k, v)
            super().end_headers()

        def _generation(self, bucket, name):
            try:
                return int(self.storage.get_file_obj(bucket, name)["generation"])
            except NotFound:
                return None

        def _precondition(self, method):
            """-> (status, extra headers): a status when a generation condition fails
            (answered here, as GCS would), else None and the headers for the reply."""
            url = urlparse(self.path)
            query = parse_qs(url.query)
            m = _OBJECT.match(url.path) if method == "GET" else None
            if m:
                name = unquote(m["object"])
            elif method == "POST" and _UPLOAD.match(url.path) and "name" in query:
                m = _UPLOAD.match(url.path)
                name = query["name"][0]
            else:
                return None, {}
            gen = self._generation(m["bucket"], name)
            match = query.get("ifGenerationMatch", [None])[0]
            not_match = query.get("ifGenerationNotMatch", [None])[0]
            if match is not None and (gen or 0) != int(match):
                return 412, {}
            if method == "GET" and gen is not None:
                if not_match is not None and gen == int(not_match):
                    return 304, {"x-goog-generation": str(gen)}
                meta = self.storage.get_file_obj(m["bucket"], name)
                return None, {
                    "x-goog-generation": str(gen),
                    "x-goog-metageneration": str(meta.get("metageneration", "1")),
                }
            return None, {}

        def _serve(self, method):
            n = self.headers.get("Content-Length")
            if n:  # read outside the lock: a slow sender holds up no one else
                self.rfile = io.BytesIO(self.rfile.read(int(n)))
            with self.server.lock:
                status, self._extra_headers = self._precondition(method)
                if status is not None:
                    self.send_response(status)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                getattr(super(), f"do_{method}")()

        def do_GET(self):
            self._serve("GET")

        def do_POST(self):
            self._serve("POST")

        def do_PUT(self):
            self._serve("PUT")

        def do_PATCH(self):
            self._serve("PATCH")

        def do_DELETE(self):
            self._serve("DELETE")

    return Handler


def _multipart_related(raw: bytes, content_type: str) -> dict | None:
    """An upload's `multipart/related` body as the emulator's handlers read it ({"meta",
    "content", "content-type"}), each part's content exactly the bytes between the line
    break after its headers and the one before the next boundary, line breaks of the body's
    own style (gcsfs writes "\n", RFC 2046 "\r\n"); None where it is not two parts."""
    import json

    m = re.search(r'boundary="?([^";]+)"?', content_type)
    if not m:
        return None
    parts = raw.split(b"--" + m[1].encode())[1:-1]  # between the first and the closing one
    if len(parts) != 2:
        return None
    nl = b"\r\n" if parts[0].startswith(b"\r\n") else b"\n"
    out = []
    for part in parts:
        head, _, body = part[len(nl) :].partition(nl + nl)
        body = body[: -len(nl)] if body.endswith(nl) else body
        kind = "application/octet-stream"
        for line in head.decode("latin-1").split(nl.decode()):
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-type":
                kind = value.strip().split(";")[0]
        out.append((kind, body))
    return {"meta": json.loads(out[0][1]), "content": out[1][1], "content-type": out[1][0]}


def _exact_multipart():
    """The emulator's request reader, with `multipart/related` uploads read exactly."""
    from gcp_storage_emulator import server

    if getattr(server._read_data, "exact", False):
        return
    read = server._read_data

    def read_data(handler, query):
        kind = handler.headers.get("Content-Type") or ""
        n = handler.headers.get("Content-Length")
        encoded = handler.headers.get("Content-Encoding") or handler.headers.get(
            "Transfer-Encoding"
        )
        if kind.startswith("multipart/related") and n and not encoded:
            raw = handler.rfile.read(int(n))
            got = _multipart_related(raw, kind)
            if got is not None:
                return got
            handler.rfile = io.BytesIO(raw)  # not ours: the emulator's own reading
        return read(handler, query)

    read_data.exact = True
    server._read_data = read_data


class Emulator:
    """The emulator's in-memory store behind a threaded loopback server."""

    def __init__(self, bucket: str = BUCKET):
        from gcp_storage_emulator.handlers import buckets
        from gcp_storage_emulator.storage import Storage

        self.storage = Storage(use_memory_fs=True)
        buckets.create_bucket(bucket, self.storage)
        _exact_multipart()
        handler = _handler_class()
        storage = self.storage

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            block_on_close = False
            request_queue_size = 128
            lock = threading.Lock()

            def handle_error(self, request, client_address):
                # gcsfs's info() asks for an object and a one-item listing at once and drops
                # the connection of whichever answers second
                if not isinstance(sys.exc_info()[1], ConnectionError):
                    super().handle_error(request, client_address)

        self.httpd = Server(("127.0.0.1", 0), lambda *a: handler(storage, *a))
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, name="gcs-emulator", daemon=True
        )
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def start_emulator():
    """Starts an emulator with bucket BUCKET on a free loopback port and points gcsfs and
    tensorstore at it; -> (server, url)."""
    logging.getLogger("gcp_storage_emulator").setLevel(logging.CRITICAL)
    server = Emulator(BUCKET)
    url = server.url
    os.environ["STORAGE_EMULATOR_HOST"] = url  # gcsfs (orbax's epath for gs://)
    os.environ["TENSORSTORE_GCS_HTTP_URL"] = url  # tensorstore (the arrays)
    os.environ["GOOGLE_AUTH_TOKEN_FOR_TESTING"] = "test"  # no credential lookup
    # gcsfs >= 2025.x asks a gRPC control API for the bucket type, which the emulator lacks
    # (a 60 s timeout per filesystem); the plain JSON API is all the emulator serves
    os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
    return server, url
