"""For the tests that run cg as processes (``twistd`` from this interpreter's bin directory):
their environment, output and exit; the ``spawn`` fixture (conftest.py) starts them."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

TWISTD = Path(sys.executable).with_name("twistd")


WAIT = 10.0  # seconds: the bound on every wait of the process tests


linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")


def env_without_systemd(**extra) -> dict:
    """The test's environment minus any systemd hand-offs it may itself have inherited."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LISTEN_", "NOTIFY_SOCKET"))}
    env.update(extra)
    return env


def output_of(proc) -> str:
    return proc.log.read_text(errors="replace")


def wait_exit(proc) -> int:
    try:
        return proc.wait(timeout=WAIT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"process did not exit within {WAIT}s:\n{output_of(proc)}")


def assert_clean_stop(proc):
    """After SIGTERM: twistd shuts down (stopService, drain) and then re-raises the signal, so
    the status is "killed by SIGTERM", which systemd counts as a clean exit (as it does 0)."""
    status = wait_exit(proc)
    output = output_of(proc)
    assert status in (0, -signal.SIGTERM), output
    assert "Received SIGTERM" in output and "Server Shut Down." in output, output
    assert "Traceback" not in output, output


def announced_port(proc) -> int:
    """The port cg logged ("cg 0.1 listening on http://127.0.0.1:N → ..."), without waiting."""
    match = re.search(r"listening on http://127\.0\.0\.1:(\d+) ", output_of(proc))
    if match is None:
        pytest.fail(f"cg has not logged its port:\n{output_of(proc)}")
    return int(match.group(1))
