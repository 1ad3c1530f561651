"""The client leg: a twisted.web Site whose requests cap their body size.

twisted.web buffers a whole request body (spilling big ones to an unbounded
temp file on the reactor thread). cg's requests keep bodies in memory up to
the site's `max_body`, then discard the rest and mark themselves `too_large`
so the proxy answers 413 instead of forwarding a truncated body.
"""

import io

from twisted.internet import defer
from twisted.protocols.policies import WrappingFactory
from twisted.web import server


class CappedRequest(server.Request):
    """A request whose body is kept up to the site's `max_body`, then discarded."""

    too_large = False
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


class ProxySite(server.Site):
    """Serves the proxy resource; logs through the proxy's own line, not an access log."""

    requestFactory = CappedRequest

    def __init__(self, resource, max_body: int, **kwargs):
        # A proxy forwards bodies; parsing form submissions (Content-Type through the
        # email module on every POST) is pure cost.
        super().__init__(resource, parsePOSTFormSubmission=False, **kwargs)
        self.max_body = max_body

    def log(self, request):
        """cg writes one line per request itself (no bodies, no credentials)."""


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
        d = defer.Deferred()
        self._emptied.append(d)
        for protocol in list(self.protocols):
            protocol.transport.loseConnection()
        return d

    def abort_all(self):
        for protocol in list(self.protocols):
            protocol.transport.abortConnection()
