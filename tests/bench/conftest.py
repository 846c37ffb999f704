"""A real `deltaserve serve` of the tiny model for the serving benchmark's tests, started once."""

from __future__ import annotations

import pytest
from entrypoints.server import RemoteServer


@pytest.fixture(scope="session")
def tiny_server():
    """The random tiny preset (vocab 512) with a 1024-token context, on loopback."""
    with RemoteServer() as s:
        yield s
