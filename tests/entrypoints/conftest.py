"""Servers shared by the API tests: started once per session, on loopback, any free port."""

from __future__ import annotations

import pytest

from entrypoints.server import RemoteServer

API_KEY = "sk-deltaserve-test"


@pytest.fixture(scope="session")
def server():
    """One front end, no API key, a 1 MiB body limit, a 2 s header-read timeout."""
    with RemoteServer("--max-request-body-bytes", str(2**20), "--served-model-name", "tiny", "tiny-alias",
                      "--header-timeout", "2") as s:
        yield s


@pytest.fixture(scope="session")
def two_frontend_server():
    """Two API front-end processes on one port, with an API key."""
    with RemoteServer("--api-server-count", "2", "--api-key", API_KEY, api_key=API_KEY) as s:
        yield s
