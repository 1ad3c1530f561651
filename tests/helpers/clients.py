"""Clients on in-memory transports: ``Client``, a connection to cg's channel over a
StringTransport (for the clock tests); ``Body``, a protocol collecting a response's body. And
``stream_chat``, the official openai SDK's streamed chat completion."""

import openai
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


def stream_chat(url: str, api_key: str, content: str = "x") -> list:
    """A streamed chat completion with usage through cg at `url`, by the official openai SDK
    (it blocks: run it on a thread)."""
    chunks = openai.OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0).chat.completions.create(
        model="gpt-5", messages=[{"role": "user", "content": content}], stream=True,
        stream_options={"include_usage": True})
    return list(chunks)
