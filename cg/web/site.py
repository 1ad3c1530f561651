"""The client leg: a twisted.web Site whose requests cap their body size and whose heads are timed.

twisted.web buffers a whole request body (spilling big ones to an unbounded
temp file on the reactor thread). cg's requests keep bodies in memory up to
the site's `max_body`, then discard the rest and mark themselves `too_large`
so the proxy answers 413 instead of forwarding a truncated body.
"""

import io
from collections.abc import Callable
from typing import Any, cast

from twisted.internet import defer, error
from twisted.internet.address import IPv4Address, IPv6Address
from twisted.internet.interfaces import IAddress, IDelayedCall
from twisted.internet.protocol import connectionDone
from twisted.logger import Logger
from twisted.protocols.policies import ProtocolWrapper, WrappingFactory
from twisted.python.failure import Failure
from twisted.web import http, server
from twisted.web.resource import IResource

log = Logger(namespace="cg.web.site")

_REQUEST_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\nconnection: close\r\ncontent-length: 0\r\n\r\n"


class CappedRequest(server.Request):
    """A request whose body is kept up to the site's `max_body`, then discarded."""

    too_large = False
    proxied = False  # set by the proxy, which then logs the request's line itself
    _received = 0
    # What Twisted's Request leaves untyped (`content = None`, a plain HTTPChannel): a ProxySite's
    # requests are made by its HeadTimedChannel, and keep their body in memory.
    channel: "HeadTimedChannel"
    content: io.BytesIO  # type: ignore[assignment]  # Twisted's Request says `content = None`

    def gotLength(self, length: int | None) -> None:
        self.content = io.BytesIO()
        if length is not None and length > self.channel.site.max_body:
            self.too_large = True

    def handleContentChunk(self, data: bytes) -> None:
        self._received += len(data)
        if self._received > self.channel.site.max_body and not self.too_large:
            self.too_large = True
        if self.too_large:
            if self.content.tell():
                self.content = io.BytesIO()
            return
        self.content.write(data)


class HeadTimedChannel(http.HTTPChannel):
    """An HTTP/1.1 channel that closes a connection whose request head does not arrive in time.

    twisted.web's idle timeout (`Site.timeOut`) restarts on every byte, so a client that
    trickles a header byte a second (slowloris) keeps its connection forever. This deadline
    runs from the connection's start and, on a kept-alive connection, from the next
    request's first byte, however slowly the rest comes. It ends with the head: request
    bodies and responses (live streams) never meet it. A kept-alive connection waiting for
    its next request is not timed by it: that wait is the idle timeout's (twisted.web's
    60 s of silence, after which the client simply reconnects).
    """

    site: "ProxySite"  # set by the site that built the channel
    _head_deadline: IDelayedCall | None = None
    _between_requests = False
    _closed_watchers: list[Callable[[bool], object]] | None = None
    _closed_by_client: bool | None = None  # once the connection is gone
    _last_response = False  # a graceful stop began: this connection closes after its response

    def last_response(self) -> None:
        """Close this connection after the response under way (`Connections.stop_reuse`), and
        after the one whose head is still arriving: its head would make the channel persistent
        again (``checkPersistence``)."""
        self._last_response = True
        self.persistent = False  # HTTPChannel.requestDone then closes it
        for request in self.requests:
            if not request.startedWriting:
                request.responseHeaders.setRawHeaders(b"connection", [b"close"])

    def checkPersistence(self, request: http.Request, version: bytes) -> bool:
        if self._last_response:
            request.responseHeaders.setRawHeaders(b"connection", [b"close"])
            return False
        return bool(super().checkPersistence(request, version))  # type: ignore[no-untyped-call]  # untyped in Twisted

    def when_closed(self, watcher: Callable[[bool], object]) -> None:
        """Call ``watcher(by_client)`` once, when this connection is gone (at once if it is).
        ``by_client``: the client closed it itself, cleanly (a FIN: it exited, or let go of the
        connection), as opposed to a reset (Claude Code's own idle timeout resets) or a close of
        cg's (its idle timeout, a ``connection: close``). cg.web.keepalive tells a client that is
        gone by it."""
        if self._closed_by_client is not None:
            watcher(self._closed_by_client)
            return
        if self._closed_watchers is None:
            self._closed_watchers = []
        self._closed_watchers.append(watcher)

    def connectionMade(self) -> None:
        super().connectionMade()  # type: ignore[no-untyped-call]  # untyped in Twisted
        self._await_head()

    def dataReceived(self, data: bytes) -> None:
        if self._between_requests and data:
            self._between_requests = False
            self._await_head()
        super().dataReceived(data)  # type: ignore[no-untyped-call]  # untyped in Twisted

    def allHeadersReceived(self) -> None:
        self._stop_head_deadline()
        super().allHeadersReceived()  # type: ignore[no-untyped-call]  # untyped in Twisted

    def requestDone(self, request: server.Request) -> None:
        self._between_requests = True  # before super(): it feeds pipelined bytes back in
        super().requestDone(request)  # type: ignore[no-untyped-call]  # untyped in Twisted

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self._stop_head_deadline()
        by_client = reason.check(error.ConnectionDone) is not None and not getattr(self.transport, "disconnecting", False)
        super().connectionLost(reason)  # type: ignore[no-untyped-call]  # untyped in Twisted
        self._closed_by_client = by_client
        watchers, self._closed_watchers = self._closed_watchers or [], None
        for watcher in watchers:
            watcher(by_client)

    def _await_head(self) -> None:
        self._head_deadline = self.callLater(self.site.request_head_timeout, self._head_timed_out)

    def _stop_head_deadline(self) -> None:
        if self._head_deadline is not None:
            if self._head_deadline.active():
                self._head_deadline.cancel()
            self._head_deadline = None

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        assert self.transport is not None  # connected: connectionLost stops the deadline
        log.info(
            "cg closed a connection from {peer}: no complete request head within {timeout:g} s",
            peer=_address(self.transport.getPeer()),
            timeout=self.site.request_head_timeout,
        )
        self.transport.write(_REQUEST_TIMEOUT)
        self.timeoutConnection()  # closes, and aborts if the client does not take the 408


def _address(address: IAddress) -> str:
    host = getattr(address, "host", None)
    return str(address) if host is None else f"{host}:{cast('IPv4Address | IPv6Address', address).port}"


class ProxySite(server.Site):
    """Serves the proxy resource; logs cg's own line per request, not an access log."""

    requestFactory = CappedRequest
    protocol = HeadTimedChannel  # type: ignore[assignment]  # HTTP/1.1 only: cg's client leg never negotiates HTTP/2

    def __init__(self, resource: IResource, max_body: int, request_head_timeout: float = 30.0, **kwargs: Any) -> None:
        # A proxy forwards bodies; parsing form submissions (Content-Type through the
        # email module on every POST) is pure cost.
        super().__init__(  # type: ignore[no-untyped-call]  # untyped in Twisted
            resource, parsePOSTFormSubmission=False, **kwargs)
        self.max_body = max_body
        self.request_head_timeout = request_head_timeout

    def log(self, request: CappedRequest) -> None:  # type: ignore[override]  # its requestFactory makes them
        """One line for a request cg answered itself (/healthz, /stats, a 404, a 413).

        The proxy logs the requests it forwards (cg.web.driver, at the exchange's end); no bodies,
        no credentials either way.
        """
        if request.proxied:
            return
        status = request.code
        log.info(
            "{method} {path} {status} {outcome} in={bytes_in} out={bytes_out}",
            method=request.method.decode("latin-1"),
            path=request.uri.decode("latin-1"),
            status=status,
            outcome="ok" if status < 400 else "refused" if status < 500 else "error",
            bytes_in=request._received,
            bytes_out=request.sentLength,
        )


class Connections(WrappingFactory):
    """The site's open client connections, so a graceful stop can close them cleanly.

    Closing with loseConnection() flushes what the last responses wrote; stopping
    the reactor straight after the drain would drop those bytes.
    """

    def __init__(self, site: ProxySite) -> None:
        super().__init__(site)  # type: ignore[no-untyped-call]  # untyped in Twisted
        self._emptied: list[defer.Deferred[None]] = []

    def unregisterProtocol(self, protocol: ProtocolWrapper) -> None:
        super().unregisterProtocol(protocol)  # type: ignore[no-untyped-call]  # untyped in Twisted
        if not self.protocols:
            waiters, self._emptied = self._emptied, []
            for d in waiters:
                d.callback(None)

    def stop_reuse(self) -> None:
        """A graceful stop began: close idle connections now, and each busy one after its response.

        Otherwise a client keeps sending on a kept-alive connection, each new request joins the
        drain, and under steady traffic the drain never empties before ``--drain-timeout`` cuts it.
        """
        for protocol in list(self.protocols):
            channel = cast(HeadTimedChannel, protocol.wrappedProtocol)
            if not channel.requests:
                protocol.loseConnection()  # through the wrapper: a close of cg's, not the client's leaving
                continue
            channel.last_response()

    def close_all(self) -> defer.Deferred[None]:
        """Close every connection once its pending bytes are written; fires when all are gone."""
        if not self.protocols:
            return defer.succeed(None)
        d: defer.Deferred[None] = defer.Deferred()
        self._emptied.append(d)
        for protocol in list(self.protocols):
            protocol.transport.loseConnection()
        return d

    def abort_all(self) -> None:
        for protocol in list(self.protocols):
            protocol.transport.abortConnection()
