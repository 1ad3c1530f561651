"""A real ``redis-server`` for the tests, on 127.0.0.1 on a free port, in a temporary directory.

The tests that need one skip, saying why, only where it cannot be started (no ``redis-server``
on PATH, or the ``redis`` client not installed); CI installs both.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time

import pytest

START_TIMEOUT = 15.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """``start()`` runs it (again, on the same port and directory, after ``kill()``);
    ``admin`` is a client of its own, for a test to look inside or to break the server."""

    def __init__(self, directory, *config: str):
        self.directory = str(directory)
        self.config = config
        self.port = _free_port()
        self.process: subprocess.Popen | None = None
        self._admin = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def socket_path(self) -> str:
        return os.path.join(self.directory, "redis.sock")

    def start(self) -> None:
        """Start it and wait until it answers; raises RuntimeError if it does not."""
        self.process = subprocess.Popen(
            [
                "redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                "--unixsocket", self.socket_path, "--unixsocketperm", "700",
                "--dir", self.directory, "--save", "", "--appendonly", "no",
                "--enable-debug-command", "local", "--logfile", os.path.join(self.directory, "redis.log"),
                *self.config,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.process.returncode}: {self.log()[-500:]}")
            try:
                if self.admin.ping():
                    return
            except Exception:  # noqa: BLE001 -- not up yet
                time.sleep(0.02)
        raise RuntimeError(f"redis-server did not answer within {START_TIMEOUT} s")

    @property
    def admin(self):
        if self._admin is None:
            import redis

            self._admin = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=30)
        return self._admin

    def kill(self) -> None:
        """As a crash would: SIGKILL, and what was in memory is gone (no persistence)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()
        if self._admin is not None:
            self._admin.close()

    def log(self) -> str:
        try:
            with open(os.path.join(self.directory, "redis.log")) as f:
                return f.read()
        except OSError:
            return ""


def start_redis(tmp_path_factory, *config: str) -> RedisServer:
    """A started RedisServer, or the test skipped saying why it cannot be."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (Debian: apt-get install redis-server)")
    try:
        import redis  # noqa: F401
    except ImportError:
        pytest.skip("the redis client is not installed (pip install 'cg[redis]')")
    server = RedisServer(tmp_path_factory.mktemp("redis"), *config)
    for attempt in range(3):
        try:
            server.start()
            return server
        except RuntimeError as e:
            server.kill()
            if attempt == 2:
                pytest.skip(f"redis-server cannot be started here: {e}")
            server.port = _free_port()  # someone took the port meanwhile
    raise AssertionError("unreachable")
