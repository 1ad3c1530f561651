"""sd_notify(3) in a few lines: Twisted has none, and Type=notify needs READY=1."""

import os
import socket


def notify(state: bytes) -> bool:
    """Tell systemd `state` (e.g. b"READY=1"); False when not run by systemd."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    if path.startswith("@"):  # abstract namespace
        path = "\0" + path[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        sock.connect(path)
        sock.sendall(state)
    return True
