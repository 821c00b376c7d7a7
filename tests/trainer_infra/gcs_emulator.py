"""A loopback GCS emulator for the subprocess workers (not collected by pytest): call
start_emulator() before gcsfs or tensorstore are imported, since both read the environment."""

from __future__ import annotations

import logging
import os
import socket

BUCKET = "jaxvrl-test"


def start_emulator():
    """Starts an in-memory emulator with bucket BUCKET on a free loopback port and points
    gcsfs and tensorstore at it; -> (server, url)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    from gcp_storage_emulator.server import create_server

    logging.getLogger("gcp_storage_emulator").setLevel(logging.CRITICAL)
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket=BUCKET)
    server.start()
    url = f"http://127.0.0.1:{port}"
    os.environ["STORAGE_EMULATOR_HOST"] = url  # gcsfs (orbax's epath for gs://)
    os.environ["TENSORSTORE_GCS_HTTP_URL"] = url  # tensorstore (the arrays)
    os.environ["GOOGLE_AUTH_TOKEN_FOR_TESTING"] = "test"  # no credential lookup
    # gcsfs >= 2025.x asks a gRPC control API for the bucket type, which the emulator lacks
    # (a 60 s timeout per filesystem); the plain JSON API is all the emulator serves
    os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
    return server, url
