"""Clients on in-memory transports: ``Client``, a connection to cg's channel over a
StringTransport (for the clock tests); ``Body``, a protocol collecting a response's body."""

from rawhttp import dechunk
from twisted.internet import defer, protocol
from twisted.internet.address import IPv4Address
from twisted.internet.testing import StringTransport

from helpers.streams import names

PEER = IPv4Address("TCP", "127.0.0.1", 40000)
CG_PORT = 18000  # where conftest's cg_in_memory listens on its MemoryReactorClock


class Client:
    """A client connection as the channel sees it: bytes in through `channel`, out on `transport`."""

    def __init__(self, channel):
        self.channel = channel
        self.transport = StringTransport(peerAddress=PEER)
        channel.makeConnection(self.transport)

    def body(self) -> tuple[bytes, bool]:
        """The de-chunked response body so far, and whether its last chunk came."""
        head, _, rest = self.transport.value().partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        return dechunk(rest)

    def pings(self) -> int:
        """Pings cg wrote since round one's text block (round one's own ping is before it)."""
        seen = names(self.body()[0])
        return seen[seen.index("content_block_stop") :].count("ping")


class Body(protocol.Protocol):
    def __init__(self):
        self.chunks: list[bytes] = []
        self.done = defer.Deferred()
        self.reason = None  # how the body ended, once it has

    def dataReceived(self, data):
        self.chunks.append(data)

    def connectionLost(self, reason):
        self.reason = reason
        self.done.callback(None)
