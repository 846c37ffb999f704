"""A mooncake_master for the tests: found beside the Mooncake Store client, started in its own process
group on free ports (so it can be restarted in place), killed by the test that started it."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

import pytest

try:
    from mooncake import store as store_module
except ImportError:  # the tests that need it skip
    store_module = None

MASTER_START_TIMEOUT_S = 20.0


def find_master_binary() -> str | None:
    if store_module is None:
        return None
    candidates = [shutil.which("mooncake_master"), str(Path(sys.executable).parent / "mooncake_master"),
                  str(Path(store_module.__file__).parent / "mooncake_master")]
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


MASTER_BINARY = find_master_binary()


def free_port() -> int:
    with closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Master:
    """A mooncake_master in its own process group, on fixed ports so it can be restarted in place."""

    def __init__(self, log_path: Path) -> None:
        self.rpc_port, self.metrics_port = free_port(), free_port()
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"mooncake://127.0.0.1:{self.rpc_port}"

    def start(self) -> None:
        command = [MASTER_BINARY, f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1",
                   f"--metrics_port={self.metrics_port}", "--enable_metric_reporting=false"]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + MASTER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"mooncake_master exited with {self.process.returncode}: {self.log_path.read_text()}")
            try:
                socket.create_connection(("127.0.0.1", self.rpc_port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.02)
        self.stop()
        pytest.fail(f"mooncake_master did not listen on {self.rpc_port}: {self.log_path.read_text()}")

    def stop(self) -> None:
        """Kills the master's process group (and waits for it)."""
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)
