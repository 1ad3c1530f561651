"""The upstream leg: one pooled, keep-alive HTTP(S) client shared by every request.

Built on twisted.web.client.Agent rather than treq's HTTPClient: treq wraps every
request in a cookie jar (which would replay one client's Set-Cookie on another's
requests) and a gzip decoder that rewrites Accept-Encoding on every path, and a
transparent proxy wants neither.
"""

from twisted.internet import defer, ssl
from twisted.internet.endpoints import HostnameEndpoint, wrapClientTLS
from twisted.internet.error import TimeoutError as ConnectTimeout
from twisted.python.failure import Failure
from twisted.web.client import (
    Agent,
    BrowserLikePolicyForHTTPS,
    HTTPConnectionPool,
    RequestNotSent,
    RequestTransmissionFailed,
    ResponseNeverReceived,
    _HTTP11ClientFactory,
)
from twisted.web.iweb import IAgentEndpointFactory, IBodyProducer
from zope.interface import implementer


class HeaderTimeout(Exception):
    """The upstream accepted the request but sent no response headers in time."""


@implementer(IBodyProducer)
class BytesBody:
    """A request body that can be sent again, for the one retry on a fresh connection."""

    def __init__(self, data: bytes):
        self._data = data
        self.length = len(data)

    def startProducing(self, consumer):
        consumer.write(self._data)
        return defer.succeed(None)

    def pauseProducing(self):
        pass

    def resumeProducing(self):
        pass

    def stopProducing(self):
        pass


def load_trust_root(ca_file: str):
    """A trust root holding every certificate of a PEM bundle (a private CA)."""
    with open(ca_file, "rb") as f:
        pem = f.read()
    marker = b"-----BEGIN CERTIFICATE-----"
    certs = [ssl.Certificate.loadPEM(marker + part) for part in pem.split(marker)[1:]]
    if not certs:
        raise ValueError(f"no PEM certificate in {ca_file}")
    return ssl.trustRootFromCertificates(certs)


class _TunedEndpoint:
    """Sets TCP_NODELAY (no Nagle stalls on small SSE writes) and TCP keepalive."""

    def __init__(self, wrapped):
        self._wrapped = wrapped

    def connect(self, factory):
        def tune(protocol):
            transport = protocol.transport
            transport.setTcpNoDelay(True)
            transport.setTcpKeepAlive(True)
            return protocol

        return self._wrapped.connect(factory).addCallback(tune)


@implementer(IAgentEndpointFactory)
class _Endpoints:
    """One endpoint per upstream (scheme, host, port), built once.

    Agent asks for an endpoint on every request, even one served from the pool;
    building it (and, for HTTPS, its TLS options) each time was a measurable share
    of cg's CPU per request.
    """

    def __init__(self, reactor, connect_timeout: float, tls_policy):
        self._reactor = reactor
        self._timeout = connect_timeout
        self._tls = tls_policy
        self._built: dict[tuple, object] = {}

    def endpointForURI(self, uri):
        key = (uri.scheme, uri.host, uri.port)
        endpoint = self._built.get(key)
        if endpoint is None:
            tcp = HostnameEndpoint(self._reactor, uri.host, uri.port, timeout=self._timeout)
            endpoint = _TunedEndpoint(tcp)
            if uri.scheme == b"https":
                endpoint = wrapClientTLS(self._tls.creatorForNetloc(uri.host, uri.port), endpoint)
            self._built[key] = endpoint
        return endpoint


def _died_before_response(failure) -> bool:
    """Did the request fail because the connection was dead, not because it was cancelled?"""
    if not failure.check(RequestNotSent, RequestTransmissionFailed, ResponseNeverReceived):
        return False
    reasons = getattr(failure.value, "reasons", ())
    return not any(r.check(defer.CancelledError) for r in reasons)


class _RetryOnFreshConnection:
    """A reused pooled connection: if it turns out dead before any response byte, retry once.

    The peer may have closed it while it sat idle (a server's keep-alive limit,
    a laptop that slept). Twisted's own retry covers only idempotent methods
    without a body; every provider call is a POST, and nothing was processed.
    """

    def __init__(self, connection, new_connection, on_retry):
        self._connection = connection
        self._new_connection = new_connection
        self._on_retry = on_retry

    def request(self, request):
        def failed(failure):
            if not _died_before_response(failure):
                return failure
            self._on_retry()
            return self._new_connection().addCallback(lambda fresh: fresh.request(request))

        return self._connection.request(request).addErrback(failed)

    def __getattr__(self, name):
        return getattr(self._connection, name)


class _QuietFactory(_HTTP11ClientFactory):
    noisy = False  # no "Starting factory" log line per upstream connection


class _Pool(HTTPConnectionPool):
    retryAutomatically = False
    _factory = _QuietFactory

    def __init__(self, reactor, on_retry):
        super().__init__(reactor, persistent=True)
        self._on_retry = on_retry

    def getConnection(self, key, endpoint):
        cached = list(self._connections.get(key, ()))
        d = super().getConnection(key, endpoint)

        def wrap(connection):
            if any(connection is c for c in cached):
                return _RetryOnFreshConnection(
                    connection, lambda: self._newConnection(key, endpoint), self._on_retry
                )
            return connection

        return d.addCallback(wrap)


class Upstream:
    """Sends requests upstream over pooled connections, bounding the wait for headers."""

    def __init__(
        self,
        reactor,
        *,
        connect_timeout: float = 10.0,
        header_timeout: float = 600.0,
        idle_timeout: float = 60.0,
        max_idle_per_host: int = 256,
        trust_root=None,
        on_retry=lambda: None,
    ):
        self._reactor = reactor
        self._header_timeout = header_timeout
        self.pool = _Pool(reactor, on_retry)
        self.pool.cachedConnectionTimeout = idle_timeout
        self.pool.maxPersistentPerHost = max_idle_per_host
        endpoints = _Endpoints(reactor, connect_timeout, BrowserLikePolicyForHTTPS(trust_root))
        self._agent = Agent.usingEndpointFactory(reactor, endpoints, pool=self.pool)

    def request(self, method: bytes, url: bytes, headers, body: bytes | None):
        """Fires with the IResponse once its headers arrived.

        Fails with HeaderTimeout when they take longer than the header timeout,
        or with the transport's failure (connect refused/timed out, reset).
        """
        producer = BytesBody(body) if body is not None else None
        d = self._agent.request(method, url, headers, producer)
        timed_out = []

        def expire():
            timed_out.append(True)
            d.cancel()

        timer = self._reactor.callLater(self._header_timeout, expire)

        def done(result):
            if timer.active():
                timer.cancel()
            if timed_out and isinstance(result, Failure):
                return Failure(HeaderTimeout())
            return result

        return d.addBoth(done)

    def close(self):
        return self.pool.closeCachedConnections()


def is_timeout(failure) -> bool:
    """A connect or header timeout: answered 504 rather than 502."""
    return bool(failure.check(HeaderTimeout, ConnectTimeout))
