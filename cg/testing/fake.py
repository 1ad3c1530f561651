"""The fake provider: ``FakeUpstream``, a real twisted.web server on a TCP port.

Replies are queued in order (``FakeUpstream.enqueue``); when the queue is empty a default reply
is derived from the request (cg.testing.replies). Every request is recorded byte for byte
(``FakeUpstream.received``, each a ``Received``). ``main`` serves it from a process
(``python -m cg.testing --port 0``).
"""

from __future__ import annotations

import argparse
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, cast

import ujson
from attrs import define, field
from twisted.internet.address import IPv4Address, IPv6Address
from twisted.internet.defer import Deferred, gatherResults
from twisted.internet.error import ConnectionDone, ConnectionLost
from twisted.internet.interfaces import (
    IListeningPort,
    IOpenSSLContextFactory,
    IReactorSSL,
    IReactorTCP,
    IReactorTime,
)
from twisted.internet.protocol import connectionDone
from twisted.python.failure import Failure
from twisted.web.http import HTTPChannel
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request, Site

from cg.testing.promptcache import FakePromptCache
from cg.testing.replies import JSONReply, Reply, Reset, _transport, default_reply
from cg.testing.validators import (
    anthropic_request_problems,
    openai_request_problems,
    responses_request_problems,
)

# ---------------------------------------------------------------------------------------------
# Requests as received


def _client_left(failure: Failure) -> str:
    """The client went away: "lost". Anything else (a test's timeout cancelling the wait) stays a failure."""
    failure.trap(ConnectionDone, ConnectionLost)
    return "lost"


@define
class Received:
    """One request as the fake saw it, for asserting what a proxy really forwarded."""

    method: bytes
    path: bytes  # with the query string, exactly as on the request line
    headers: list[tuple[bytes, bytes]]  # in arrival order, names lower-cased, values as sent
    body: bytes
    connection: int  # serial number of the TCP connection, from 1
    nth_on_connection: int  # 1 for the first request on its connection
    finished: Deferred[str] = field(eq=False, repr=False)  # fires "done" or "lost"
    usage: dict[str, Any] | None = None  # as the fake's prompt cache billed it (FakeUpstream.prompt_cache)

    def header(self, name: bytes) -> bytes | None:
        """The first value of header ``name`` (case-insensitive), or None."""
        name = name.lower()
        return next((v for n, v in self.headers if n == name), None)

    def json(self) -> object:
        """The body parsed as JSON."""
        return ujson.loads(self.body)


# ---------------------------------------------------------------------------------------------
# The thinking blocks the fake sent (strict mode checks them when they come back)


def _sse_data(event: bytes) -> object:
    """The JSON of one framed event's data lines, or None."""
    lines = [line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
    try:
        return ujson.loads(b"\n".join(lines)) if lines else None
    except ValueError:
        return None


def _block_thinking(block: object, thinking: dict[str, object], redacted: set[str]) -> None:
    if not isinstance(block, dict):
        return
    if block.get("type") == "thinking" and block.get("signature"):
        thinking[block["signature"]] = block.get("thinking")
    elif block.get("type") == "redacted_thinking" and isinstance(block.get("data"), str):
        redacted.add(block["data"])


# ---------------------------------------------------------------------------------------------
# The server


def _port_number(port: IListeningPort) -> int:
    address = port.getHost()
    assert isinstance(address, (IPv4Address, IPv6Address))  # the fake listens on TCP
    return address.port


class _Request(Request):
    """Keeps the header lines as they arrived (twisted.web's Headers merge and reorder them)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]  # untyped in Twisted
        self.raw_headers: list[tuple[bytes, bytes]] = []


class _Channel(HTTPChannel):
    """An HTTP/1.1 connection that the fake numbers, counts requests on and can abort.

    HTTPChannel.connectionMade already sets TCP_NODELAY, so each SSE write leaves at once.
    """

    def connectionMade(self) -> None:
        super().connectionMade()  # type: ignore[no-untyped-call]  # untyped in Twisted
        self.upstream: FakeUpstream = self.factory.upstream
        self.serial = self.upstream._connected(self)
        self.requests_seen = 0
        self.closed: Deferred[None] = Deferred()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.upstream._channels.discard(self)
        super().connectionLost(reason)  # type: ignore[no-untyped-call]  # untyped in Twisted
        self.closed.callback(None)

    def headerReceived(self, line: bytes) -> bool:
        ok: bool = super().headerReceived(line)  # type: ignore[no-untyped-call]  # untyped in Twisted
        if ok:
            name, value = line.split(b":", 1)
            self.requests[-1].raw_headers.append((name.lower(), value.strip(b" \t")))
        return ok


class _Root(Resource):
    isLeaf = True

    def __init__(self, upstream: FakeUpstream) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # untyped in Twisted
        self._upstream = upstream

    def render(self, request: _Request) -> int:
        self._upstream._handle(request)
        return NOT_DONE_YET


class _Site(Site):
    # Plain HTTP/1.1, no h2 negotiation wrapper: we need the channel itself (which the
    # annotation of Site.protocol, the wrapper's factory, does not foresee).
    protocol = _Channel  # type: ignore[assignment]

    def __init__(self, upstream: FakeUpstream, reactor: IReactorTCP) -> None:
        super().__init__(  # type: ignore[no-untyped-call]  # untyped in Twisted
            _Root(upstream), requestFactory=_Request, reactor=reactor)
        self.upstream = upstream


@define(eq=False)
class FakeUpstream:
    """A fake provider API on a real TCP port, answering from a FIFO of scripted replies.

    ``reset_reused_connections`` is a budget: while positive, a request that is not the first on
    its connection gets the connection aborted (as a server closing an idle keep-alive
    connection would) and the budget drops by one. Such requests are recorded but use no reply.

    ``strict`` (off by default) checks each /v1/messages, /v1/chat/completions and /v1/responses
    request as the real API does (``anthropic_request_problems``, ``openai_request_problems``,
    ``responses_request_problems``; thinking blocks are checked against every one the fake has
    sent, JSON or SSE). A request that fails is recorded, its reasons appended to ``rejections``,
    and answered 400 in the provider's error shape without using a queued reply.

    ``record`` (on by default) keeps every request in ``received``; off, nothing is kept, as in a
    benchmark's fake process that nobody reads and that would otherwise hold every body it was sent.

    ``prompt_cache`` (off by default) bills each request's prompt as the provider would, from a
    prompt cache per (credential, model) on ``clock`` (default: the reactor's, so a test's
    ``Clock`` moves it), and the default replies report that usage (``Received.usage``;
    cg.testing.promptcache). A scripted reply keeps its own usage; its prompt is cached all the same.
    """

    default_reply: Callable[[Received], Reply] = default_reply
    reset_reused_connections: int = 0
    strict: bool = False
    record: bool = True
    prompt_cache: bool = False
    clock: Callable[[], float] | None = None
    rejections: list[str] = field(factory=list, init=False)
    _caches: FakePromptCache | None = field(default=None, init=False)
    _thinking: dict[str, object] = field(factory=dict, init=False)  # signature -> text, as sent
    _redacted: set[str] = field(factory=set, init=False)  # redacted_thinking data, as sent
    received: list[Received] = field(factory=list, init=False)
    flood_bytes_written: int = field(default=0, init=False)  # by Flood replies, cumulative
    reactor: IReactorTCP | None = field(default=None, init=False)
    url: str | None = field(default=None, init=False)
    _queue: deque[Reply] = field(factory=deque, init=False)
    _port: IListeningPort | None = field(default=None, init=False)
    _channels: set[_Channel] = field(factory=set, init=False)
    _serials: itertools.count[int] = field(factory=lambda: itertools.count(1), init=False)

    def listen(
        self, reactor: IReactorTCP, port: int = 0, interface: str = "127.0.0.1",
        tls: IOpenSSLContextFactory | None = None,
    ) -> IListeningPort:
        """Start serving; returns the IListeningPort and sets ``url``.

        ``tls``, a TLS context factory (e.g. ``ssl.CertificateOptions``), serves HTTPS.
        """
        self.reactor = reactor
        site = _Site(self, reactor)
        if tls is None:
            # Twisted's annotations: a Site is a ServerFactory of the h2 wrapper, which its
            # _ProtoWithFactory bound does not admit.
            self._port = reactor.listenTCP(port, site, interface=interface)  # type: ignore[arg-type]
        else:
            self._port = cast(IReactorSSL, reactor).listenSSL(port, site, tls, interface=interface)
        host = f"[{interface}]" if ":" in interface else interface
        scheme = "http" if tls is None else "https"
        self.url = f"{scheme}://{host}:{_port_number(self._port)}"
        return self._port

    def enqueue(self, *replies: Reply) -> None:
        """Script the replies of the next requests, in order, whatever their path."""
        self._queue.extend(replies)

    def stop(self) -> Deferred[None]:
        """Stop listening and abort every open connection; fires once all are closed."""
        waits: list[Deferred[None]] = []
        if self._port is not None:
            stopped = self._port.stopListening()  # "may return a Deferred"
            if stopped is not None:
                waits.append(stopped)
            self._port = None
        for channel in list(self._channels):
            _transport(channel).abortConnection()
            waits.append(channel.closed)
        return gatherResults(waits).addCallback(lambda _: None)

    def _connected(self, channel: _Channel) -> int:
        self._channels.add(channel)
        return next(self._serials)

    def _handle(self, request: _Request) -> None:
        channel = cast(_Channel, request.channel)  # _Site.protocol
        channel.requests_seen += 1
        assert request.content is not None  # set before the request is handled
        received = Received(
            method=request.method,
            path=request.uri,
            headers=request.raw_headers,
            body=request.content.read(),
            connection=channel.serial,
            nth_on_connection=channel.requests_seen,
            finished=request.notifyFinish().addCallbacks(lambda _: "done", _client_left),
        )
        if self.record:
            self.received.append(received)
        if received.nth_on_connection >= 2 and self.reset_reused_connections > 0:
            self.reset_reused_connections -= 1
            Reset().play(request, self)
            return
        if self.strict and self._reject(received, request):
            return
        if self.prompt_cache:
            received.usage = self._billed(received)
        reply = self._queue.popleft() if self._queue else self.default_reply(received)
        reply.play(request, self)


    def _billed(self, received: Received) -> dict[str, Any] | None:
        if self._caches is None:
            clock = self.clock or cast(IReactorTime, self.reactor).seconds
            self._caches = FakePromptCache(clock)
        try:
            body = ujson.loads(received.body)
        except ValueError:
            return None
        credential = received.header(b"x-api-key") or received.header(b"authorization") or b""
        return self._caches.usage(received.path.split(b"?", 1)[0], credential, body)

    def _reject(self, received: Received, request: Request) -> bool:
        """In strict mode: answer 400 if the API would reject the request."""
        path = received.path.split(b"?", 1)[0]
        if path not in (b"/v1/messages", b"/v1/chat/completions", b"/v1/responses"):
            return False
        try:
            body = ujson.loads(received.body)
        except ValueError:
            body = None
        if path == b"/v1/messages":
            problems = anthropic_request_problems(body, self._thinking, self._redacted)
        elif path == b"/v1/responses":
            problems = responses_request_problems(body)
        else:
            problems = openai_request_problems(body)
        if not problems:
            return False
        self.rejections += problems
        message = "; ".join(problems)
        if path == b"/v1/messages":
            error = {"type": "error", "error": {"type": "invalid_request_error", "message": message}}
        else:
            error = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}
        JSONReply(error, status=400).play(request, self)
        return True

    def _sent_json(self, body: bytes) -> None:
        """Remember the thinking blocks of a JSON reply (cheaply skipped when it has none)."""
        if b"thinking" not in body:
            return
        try:
            doc = ujson.loads(body)
        except ValueError:
            return
        content = doc.get("content") if isinstance(doc, dict) else None
        for block in content if isinstance(content, list) else ():
            _block_thinking(block, self._thinking, self._redacted)

    def _sent_events(self, events: Sequence[bytes]) -> None:
        """Remember the thinking blocks of an Anthropic stream: start, thinking and signature deltas."""
        open_blocks: dict[object, dict[str, Any]] = {}
        for event in events:
            if b"thinking" not in event and b"signature" not in event:
                continue
            doc = _sse_data(event)
            if not isinstance(doc, dict):
                continue
            index = doc.get("index")
            if doc.get("type") == "content_block_start" and isinstance(doc.get("content_block"), dict):
                _block_thinking(open_blocks.pop(index, None), self._thinking, self._redacted)
                open_blocks[index] = dict(doc["content_block"])
            elif doc.get("type") == "content_block_delta" and index in open_blocks:
                delta = doc.get("delta")
                if not isinstance(delta, dict):
                    delta = {}
                block = open_blocks[index]
                if delta.get("type") == "thinking_delta":
                    block["thinking"] = (block.get("thinking") or "") + str(delta.get("thinking", ""))
                elif delta.get("type") == "signature_delta":
                    block["signature"] = delta.get("signature")
        for block in open_blocks.values():
            _block_thinking(block, self._thinking, self._redacted)


def main(argv: Sequence[str] | None = None) -> None:
    """Serve the fake with default replies until SIGTERM/SIGINT (for benchmark processes; it keeps
    no request, so a long run of large bodies does not grow it)."""
    parser = argparse.ArgumentParser(prog="python -m cg.testing", description=main.__doc__)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--interface", default="127.0.0.1")
    args = parser.parse_args(argv)
    # Imported here: importing cg.testing must not install the global reactor.
    from twisted.internet import reactor

    port = FakeUpstream(record=False).listen(reactor, args.port, args.interface)
    print(f"listening {_port_number(port)}", flush=True)
    reactor.run()

