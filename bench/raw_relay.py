"""A reference HTTP/1.1 reverse proxy on raw Twisted: the least any Twisted proxy can cost per request.

    python bench/raw_relay.py PORT UPSTREAM_PORT

A reference for ``bench/overhead.py``, not a product. No HTTP framework: one ``Protocol`` per
client connection reads a request head up to CRLF CRLF and its Content-Length body, replaces
Host, drops Connection, and forwards it over a pooled keep-alive connection to the upstream on
127.0.0.1; the response bytes go back verbatim as they arrive, while the relay counts the
Content-Length or scans the chunk sizes to see where the response ends and the upstream
connection can go back to the pool. TCP_NODELAY on both legs, a listen backlog of 1024.

What a proxy needs beyond this (header and body inspection, error handling, timeouts, limits,
logs) is not here: what this relay costs is Twisted's and the kernel's, and whatever cg costs
above it is cg's. It knows no chunked request bodies (it answers 501), trailers, interim 1xx
responses or HTTP/1.0; a client's Connection: close closes that client's connection after the
reply; an unreachable upstream gets a bare 502.

Prints ``listening N`` (the port; ``PORT`` 0 picks a free one) on stdout, then nothing else.
"""

from __future__ import annotations

import sys

from twisted.internet import reactor
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.protocol import Factory, Protocol

HOST = "127.0.0.1"
END_OF_HEAD = b"\r\n\r\n"
BAD_GATEWAY = b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
NOT_IMPLEMENTED = b"HTTP/1.1 501 Not Implemented\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
DROPPED = (b"host", b"connection")


def content_length(head: bytes) -> int | None:
    """The Content-Length of a lowercased head, ``None`` without one."""
    at = head.find(b"\r\ncontent-length:")
    if at < 0:
        return None
    eol = head.find(b"\r\n", at + 2)
    return int(head[at + 17 : eol if eol >= 0 else len(head)])


def forward_head(head: bytes, host_line: bytes) -> bytes:
    """The request head for the upstream: our Host, no Connection (HTTP/1.1 keeps alive anyway)."""
    lines = head.split(b"\r\n")
    kept = [line for line in lines[1:] if line.split(b":", 1)[0].lower() not in DROPPED]
    return b"\r\n".join([lines[0], host_line, *kept]) + END_OF_HEAD


class BodyEnd:
    """Where a response body ends, found by counting bytes, never by decoding them.

    ``left`` is how many bytes the current stretch still has: the Content-Length body, or one
    chunk's data and its CRLF. Between stretches of a chunked body sits a size line, which may
    arrive split (``line`` holds its start). A body with neither framing ends when the
    upstream closes, and then its connection cannot be reused."""

    def __init__(self, head: bytes):
        head = head.lower()
        status = int(head[9:12])
        self.chunked = b"\r\ntransfer-encoding: chunked" in head
        length = None if self.chunked else content_length(head)
        if status in (204, 304):
            length = 0
        self.framed = self.chunked or length is not None
        self.reusable = self.framed and b"\r\nconnection: close" not in head
        self.left = length or 0
        self.last = False
        self.line = b""

    def feed(self, data: bytes) -> bool:
        """True once ``data`` has brought the body's last byte."""
        if not self.chunked:
            self.left -= len(data)
            return self.framed and self.left <= 0
        pos, end = 0, len(data)
        while True:
            skip = min(self.left, end - pos)
            self.left -= skip
            pos += skip
            if self.left:
                return False
            if self.last:  # the last chunk's CRLF is in
                return True
            eol = data.find(b"\n", pos)
            if eol < 0:
                self.line += data[pos:]
                return False
            size = int((self.line + data[pos:eol]).split(b";", 1)[0], 16)
            self.line, pos = b"", eol + 1
            self.last = size == 0
            self.left = size + 2  # the data and its CRLF; for the last chunk, the final CRLF


class Upstream(Protocol):
    """One keep-alive connection to the upstream; relays one response at a time to ``client``."""

    def __init__(self, pool: Pool):
        self.pool = pool
        self.client: Downstream | None = None
        self.head = b""
        self.body: BodyEnd | None = None

    def connectionMade(self):
        self.transport.setTcpNoDelay(True)

    def send(self, request: bytes, client: Downstream) -> None:
        self.client, client.upstream = client, self
        self.head, self.body = b"", None
        self.transport.write(request)

    def dataReceived(self, data):
        if self.client is None:  # bytes nobody asked for: this connection is out of step
            self.transport.abortConnection()
            return
        self.client.transport.write(data)
        if self._ends(data):
            self._done()

    def _ends(self, data: bytes) -> bool:
        """Whether ``data`` ends the response; the head is kept only until it is complete."""
        if self.body is None:
            self.head += data
            end = self.head.find(END_OF_HEAD)
            if end < 0:
                return False
            self.body = BodyEnd(self.head[:end])
            data, self.head = self.head[end + 4 :], b""
        return self.body.feed(data)

    def _done(self) -> None:
        client, self.client = self.client, None
        if self.body.reusable:
            self.pool.idle.append(self)
        else:
            self.transport.loseConnection()
        client.reply_ended()

    def connectionLost(self, reason=None):
        if self in self.pool.idle:
            self.pool.idle.remove(self)
        client, self.client = self.client, None
        if client is None:
            return
        client.upstream = None
        if self.body is None:
            client.fail(BAD_GATEWAY)
        else:  # the end of a body framed by the close, or a cut the client will see as one
            client.transport.loseConnection()


class Pool:
    """Idle keep-alive connections to the upstream, the most recently used first."""

    def __init__(self, port: int):
        self.endpoint = TCP4ClientEndpoint(reactor, HOST, port, timeout=10)
        self.host_line = b"Host: %s:%d" % (HOST.encode(), port)
        self.idle: list[Upstream] = []

    def send(self, request: bytes, client: Downstream) -> None:
        if self.idle:
            self.idle.pop().send(request, client)
            return
        d = connectProtocol(self.endpoint, Upstream(self))
        d.addCallbacks(lambda conn: conn.send(request, client), lambda _: client.fail(BAD_GATEWAY))


class Downstream(Protocol):
    """One client connection: one request at a time, the next one read once the reply ended."""

    def __init__(self, pool: Pool):
        self.pool = pool
        self.buf = b""
        self.busy = False  # a request of ours is at the upstream (maybe still connecting)
        self.close_after = False  # the client sent Connection: close
        self.upstream: Upstream | None = None

    def connectionMade(self):
        self.transport.setTcpNoDelay(True)

    def dataReceived(self, data):
        self.buf += data
        if not self.busy:
            self.next_request()

    def reply_ended(self) -> None:
        self.busy, self.upstream = False, None
        if self.close_after:
            self.transport.loseConnection()
        else:
            self.next_request()

    def next_request(self) -> None:
        """Forward the next complete request in the buffer, if there is one."""
        end = self.buf.find(END_OF_HEAD)
        if end < 0:
            return
        head = self.buf[:end]
        lower = head.lower()
        if b"\r\ntransfer-encoding:" in lower:
            self.fail(NOT_IMPLEMENTED)
            return
        size = end + 4 + (content_length(lower) or 0)
        if len(self.buf) < size:
            return
        request = forward_head(head, self.pool.host_line) + self.buf[end + 4 : size]
        self.buf = self.buf[size:]
        self.busy = True
        self.close_after = b"\r\nconnection: close" in lower
        self.pool.send(request, self)

    def fail(self, response: bytes) -> None:
        self.transport.write(response)
        self.transport.loseConnection()

    def connectionLost(self, reason=None):
        self.buf = b""
        if self.upstream is not None:  # a reply cut halfway leaves its connection unusable
            self.upstream.client = None
            self.upstream.transport.abortConnection()


class RelayFactory(Factory):
    def __init__(self, pool: Pool):
        self.pool = pool

    def buildProtocol(self, addr):
        return Downstream(self.pool)


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__.split("\n\n")[1].strip(), file=sys.stderr)
        return 2
    port, upstream_port = int(argv[1]), int(argv[2])
    listening = reactor.listenTCP(port, RelayFactory(Pool(upstream_port)), backlog=1024, interface=HOST)
    print(f"listening {listening.getHost().port}", flush=True)
    reactor.run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
