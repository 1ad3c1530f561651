"""A raw HTTP/1.1 client over a real socket, for byte-level and flow-control tests."""

import fcntl
import socket
import struct
import termios

from twisted.internet import defer, protocol, reactor
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol


class RawClient(protocol.Protocol):
    """Sends one request as given and records every byte of the answer, with arrival order."""

    def __init__(self, request: bytes, pause_after_first=False):
        self.request = request
        self.pause_after_first = pause_after_first
        self.chunks: list[bytes] = []
        self.first_data = defer.Deferred()
        self.closed = defer.Deferred()
        self.reason = None

    def connectionMade(self):
        self.transport.write(self.request)

    def dataReceived(self, data):
        self.chunks.append(data)
        if len(self.chunks) == 1:
            if self.pause_after_first:
                self.transport.pauseProducing()
            self.first_data.callback(data)

    def connectionLost(self, reason):
        self.reason = reason
        self.closed.callback(self.data)

    @property
    def data(self) -> bytes:
        return b"".join(self.chunks)

    def unread_kernel_bytes(self) -> int:
        """Bytes in this socket's receive queue (FIONREAD): handed to the client, not yet read."""
        return _ioctl_int(self.transport.getHandle(), termios.FIONREAD)


def kernel_send_queue(sock: socket.socket) -> int:
    """Bytes written to `sock` that the kernel has not delivered yet (SIOCOUTQ)."""
    return _ioctl_int(sock, termios.TIOCOUTQ)


def _ioctl_int(sock, op) -> int:
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), op, b"\0\0\0\0"))[0]


def connect(port: int, request: bytes, **kwargs) -> defer.Deferred:
    endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", port)
    return connectProtocol(endpoint, RawClient(request, **kwargs))


def http_request(method: str, path: str, body: bytes = b"", headers=(), close=True) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
    if close:  # first: twisted.web reads only the first Connection header
        lines.append("Connection: close")
    lines += [f"{k}: {v}" for k, v in headers]
    if body or method == "POST":
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def split_response(raw: bytes) -> tuple[int, dict[bytes, list[bytes]], bytes]:
    """Status, headers (lower-case names) and the de-chunked body of a raw response."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    headers: dict[bytes, list[bytes]] = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers.setdefault(name.strip().lower(), []).append(value.strip())
    if headers.get(b"transfer-encoding") == [b"chunked"]:
        body, complete = dechunk(rest)
        if not complete:
            raise ValueError("truncated chunked body")
        return status, headers, body
    return status, headers, rest


def dechunk(data: bytes) -> tuple[bytes, bool]:
    """The payload of a chunked body, and whether its terminating chunk arrived."""
    out, pos = [], 0
    while True:
        end = data.find(b"\r\n", pos)
        if end < 0:
            return b"".join(out), False
        size = int(data[pos:end].split(b";")[0], 16)
        if size == 0:
            return b"".join(out), True
        out.append(data[end + 2 : end + 2 + size])
        pos = end + 2 + size + 2
