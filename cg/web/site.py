"""The client leg: a twisted.web Site whose requests cap their body size and whose heads are timed.

twisted.web buffers a whole request body (spilling big ones to an unbounded
temp file on the reactor thread). cg's requests keep bodies in memory up to
the site's `max_body`, then discard the rest and mark themselves `too_large`
so the proxy answers 413 instead of forwarding a truncated body.
"""

import io

from twisted.internet import defer
from twisted.logger import Logger
from twisted.protocols.policies import WrappingFactory
from twisted.web import http, server

log = Logger(namespace="cg.web.site")

_REQUEST_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\nconnection: close\r\ncontent-length: 0\r\n\r\n"


class CappedRequest(server.Request):
    """A request whose body is kept up to the site's `max_body`, then discarded."""

    too_large = False
    proxied = False  # set by the proxy, which then logs the request's line itself
    _received = 0

    def gotLength(self, length):
        self.content = io.BytesIO()
        if length is not None and length > self.channel.site.max_body:
            self.too_large = True

    def handleContentChunk(self, data):
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

    _head_deadline = None
    _between_requests = False

    def connectionMade(self):
        super().connectionMade()
        self._await_head()

    def dataReceived(self, data):
        if self._between_requests and data:
            self._between_requests = False
            self._await_head()
        super().dataReceived(data)

    def allHeadersReceived(self):
        self._stop_head_deadline()
        super().allHeadersReceived()

    def requestDone(self, request):
        self._between_requests = True  # before super(): it feeds pipelined bytes back in
        super().requestDone(request)

    def connectionLost(self, reason):
        self._stop_head_deadline()
        super().connectionLost(reason)

    def _await_head(self):
        self._head_deadline = self.callLater(self.site.request_head_timeout, self._head_timed_out)

    def _stop_head_deadline(self):
        if self._head_deadline is not None:
            if self._head_deadline.active():
                self._head_deadline.cancel()
            self._head_deadline = None

    def _head_timed_out(self):
        self._head_deadline = None
        log.info(
            "cg closed a connection from {peer}: no complete request head within {timeout:g} s",
            peer=_address(self.transport.getPeer()),
            timeout=self.site.request_head_timeout,
        )
        self.transport.write(_REQUEST_TIMEOUT)
        self.timeoutConnection()  # closes, and aborts if the client does not take the 408


def _address(address) -> str:
    host = getattr(address, "host", None)
    return str(address) if host is None else f"{host}:{address.port}"


class ProxySite(server.Site):
    """Serves the proxy resource; logs cg's own line per request, not an access log."""

    requestFactory = CappedRequest
    protocol = HeadTimedChannel  # type: ignore[assignment]  # HTTP/1.1 only: cg's client leg never negotiates HTTP/2

    def __init__(self, resource, max_body: int, request_head_timeout: float = 30.0, **kwargs):
        # A proxy forwards bodies; parsing form submissions (Content-Type through the
        # email module on every POST) is pure cost.
        super().__init__(resource, parsePOSTFormSubmission=False, **kwargs)
        self.max_body = max_body
        self.request_head_timeout = request_head_timeout

    def log(self, request):
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

    def __init__(self, site):
        super().__init__(site)
        self._emptied: list[defer.Deferred] = []

    def unregisterProtocol(self, protocol):
        super().unregisterProtocol(protocol)
        if not self.protocols:
            waiters, self._emptied = self._emptied, []
            for d in waiters:
                d.callback(None)

    def close_all(self) -> defer.Deferred:
        """Close every connection once its pending bytes are written; fires when all are gone."""
        if not self.protocols:
            return defer.succeed(None)
        d: defer.Deferred[None] = defer.Deferred()
        self._emptied.append(d)
        for protocol in list(self.protocols):
            protocol.transport.loseConnection()
        return d

    def abort_all(self):
        for protocol in list(self.protocols):
            protocol.transport.abortConnection()
