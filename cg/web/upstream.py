"""The upstream leg: pooled, keep-alive HTTP/1.1 connections to the provider.

cg speaks HTTP/1.1 upstream itself (wire format in `cg.web.http1`), on a plain Protocol,
rather than through twisted.web.client.Agent. A proxy needs a small part of Agent: one
request at a time per connection, a body of known bytes, and a response relayed chunk by
chunk. Agent's general machinery around that (a Deferred chain per request, a line
parser and a state dispatcher per response, a Deferred per body chunk) was about a
third of cg's CPU per proxied request. treq's HTTPClient was never an option: its cookie
jar would replay one client's Set-Cookie on another's requests.

What callers see is Agent's shape, declared as `IUpstream` and `IUpstreamResponse` (the
seam `cg.testing.MemoryUpstream` also fills): `Upstream.request` fires with a response that
has `code`, `phrase`, `headers` and `deliverBody(protocol)`; the protocol's transport is the
body's push producer, and its `connectionLost` gets ResponseDone (a complete body),
PotentialDataLoss (a body delimited by a clean close) or ResponseFailed.
"""

from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from twisted.internet import defer, error, ssl
from twisted.internet.endpoints import HostnameEndpoint, wrapClientTLS
from twisted.internet.interfaces import IPushProducer, IStreamClientEndpoint, ITCPTransport
from twisted.internet.protocol import Factory, Protocol
from twisted.python.failure import Failure
from twisted.web.client import BrowserLikePolicyForHTTPS, ResponseDone, ResponseFailed
from twisted.web.http import PotentialDataLoss
from zope.interface import Attribute, Interface, implementer

from cg.web import http1


class IUpstreamResponse(IPushProducer):
    """A provider's response whose head has arrived; its body goes to one protocol.

    Agent's `IResponse` minus what a proxy never reads (`version`, `length`, `request`,
    `previousResponse`), plus what it needs: the response is also the body's push
    producer. Pausing it stops the body's bytes coming; stopping it abandons the body,
    which then ends (never from inside that call) as failed.
    """

    code = Attribute("The status code, an int.")
    phrase = Attribute("The reason phrase, bytes.")
    headers = Attribute("The response headers, a twisted.web.http_headers.Headers.")

    def deliverBody(protocol):
        """Connect `protocol` (its transport is this response) and hand it the body as it arrives.

        Its `connectionLost` gets ResponseDone (the body is complete), PotentialDataLoss (a body
        delimited by a clean close: complete too) or ResponseFailed (cut short).
        """


class IUpstream(Interface):
    """Sends one request to a provider and gets its response head; what `ProxyResource` forwards through."""

    def request(method, origin, path, headers, body):
        """Send `method` `path` to `origin` (``scheme://host[:port]``) with `headers` and `body` (bytes or None).

        Returns a Deferred firing with an `IUpstreamResponse` once the head arrived, or failing
        (HeaderTimeout, a connect failure, ConnectionDied, ResponseFailed). Cancelling it
        before then drops the request, so the provider stops.
        """

    def close():
        """Close idle connections (and any that frees up later); a Deferred that fires once they are."""


class HeaderTimeout(Exception):
    """The upstream accepted the request but sent no response headers in time."""


class ConnectionDied(Exception):
    """The connection ended before a response head arrived (the request may not have been read)."""


if TYPE_CHECKING:

    class _IConnectionTransport(ITCPTransport, IPushProducer):
        """What an upstream connection's transport is, for the type checker.

        A TCP connection (twisted.internet.tcp.Client), or for HTTPS a TLSMemoryBIOProtocol
        over one: it has its own write, loseConnection and abortConnection, and relays what
        else is asked of it (setTcpNoDelay, pauseProducing) to that connection. Both have
        `disconnecting` (0, 1 or a bool), which no Twisted interface declares.
        """

        disconnecting: int


def load_trust_root(ca_file: str):
    """A trust root holding every certificate of a PEM bundle (a private CA)."""
    with open(ca_file, "rb") as f:
        pem = f.read()
    marker = b"-----BEGIN CERTIFICATE-----"
    certs = [ssl.Certificate.loadPEM(marker + part) for part in pem.split(marker)[1:]]
    if not certs:
        raise ValueError(f"no PEM certificate in {ca_file}")
    return ssl.trustRootFromCertificates(certs)


def is_timeout(failure) -> bool:
    """A connect or header timeout: answered 504 rather than 502."""
    return bool(failure.check(HeaderTimeout, error.TimeoutError))


@implementer(IUpstreamResponse)
class Response:
    """An upstream response whose head has arrived; its body goes to one protocol.

    It is also that protocol's transport, the body's push producer: pausing it pauses
    the upstream socket, stopping it abandons the body and drops the connection. Once
    the body has ended those are no-ops, so a stale reference cannot touch the
    connection's next request.
    """

    def __init__(self, head: http1.ResponseHead, connection: "_Connection"):
        self.code = head.code
        self.phrase = head.phrase
        self.headers = head.headers
        self._connection: _Connection | None = connection  # until the body ends
        self._protocol = None
        self._early: list[bytes] = []  # body bytes that came before deliverBody
        self._end: Failure | None = None  # the body's end, when it came before deliverBody
        self._held = False  # paused until someone takes the body
        self._consumer_paused = False

    def deliverBody(self, protocol):
        self._protocol = protocol
        protocol.makeConnection(self)
        early, self._early = self._early, []
        for data in early:
            protocol.dataReceived(data)
        if self._end is not None:
            protocol.connectionLost(self._end)
        elif self._held:
            self._held = False
            if self._connection is not None and not self._consumer_paused:
                self._connection.resume()

    def pauseProducing(self):
        self._consumer_paused = True
        if self._connection is not None:
            self._connection.pause()

    def resumeProducing(self):
        self._consumer_paused = False
        if self._connection is not None and not self._held:
            self._connection.resume()

    def stopProducing(self):
        if self._connection is not None:
            self._connection.abandon()

    def _received(self, data: bytes):
        if self._protocol is not None:
            self._protocol.dataReceived(data)
        else:
            self._early.append(data)
            self._held = True
            assert self._connection is not None  # bytes come only before the body's end
            self._connection.pause()  # holds at most a read until someone takes the body

    def _ended(self, reason: Failure):
        self._connection = None
        if self._protocol is not None:
            self._protocol.connectionLost(reason)
        else:
            self._end = reason


class _Connection(Protocol):
    """One upstream connection: one request at a time, back to the pool after a whole response."""

    # Set by makeConnection before any method here runs, and never unset.
    transport: "_IConnectionTransport"

    def __init__(self, pool: "_Pool"):
        self._pool = pool
        self.key: tuple | None = None  # its target's, set once connected (before any request)
        self.served = 0  # requests sent on this connection
        self._state = "idle"  # idle | head | body | abandoned | closed
        self._waiting: defer.Deferred | None = None  # fires with the Response
        self._head_request = False
        self._got_bytes = False
        self._buf = b""
        self._response: Response | None = None
        self._head: http1.ResponseHead | None = None
        self._left = 0  # bytes of a Content-Length body still to come
        self._chunks: http1.ChunkedDecoder | None = None
        self._paused = False
        self.idle_since = 0.0  # when it last went back to the pool

    @property
    def usable(self) -> bool:
        return self._state == "idle" and not self.transport.disconnecting

    def connectionMade(self):
        self.transport.setTcpNoDelay(True)  # no Nagle stall on small requests
        self.transport.setTcpKeepAlive(True)

    def send(self, head: bytes, body: bytes | None, head_request: bool) -> defer.Deferred:
        """Write a request; fires with its Response once the response head has arrived."""
        self.served += 1
        self._state = "head"
        self._head_request = head_request
        self._got_bytes = False
        self._waiting = defer.Deferred(self._cancel_wait)
        if body:
            self.transport.writeSequence([head, body])
        else:
            self.transport.write(head)
        return self._waiting

    def _cancel_wait(self, _d):
        self._waiting = None
        self.abandon()

    def pause(self):
        if not self._paused and self._state != "closed":
            self._paused = True
            self.transport.pauseProducing()

    def resume(self):
        if self._paused and self._state != "closed":
            self._paused = False
            self.transport.resumeProducing()

    def abandon(self):
        """Nobody wants the rest of this response: drop the connection at once.

        Final: bytes already read are not parsed, so a body being read ends (when the
        connection does, never from inside this call) as failed, never as complete,
        even when the rest of this read held its end.
        """
        if self._state != "closed":
            self._state = "abandoned"  # from here on the connection's end ends the body, as failed
            self.transport.abortConnection()

    def dataReceived(self, data: bytes):
        state = self._state
        if state == "body":
            self._body(data)
        elif state == "head":
            self._got_bytes = True
            self._head_data(data)
        elif state == "idle":  # a response nobody asked for
            self.transport.abortConnection()

    def _head_data(self, data: bytes):
        if self._buf:
            data, self._buf = self._buf + data, b""
        while True:
            end = data.find(b"\r\n\r\n")
            if end < 0:
                if len(data) > http1.MAX_HEAD or b"\n\n" in data:
                    return self._broken(http1.ProtocolError("not an HTTP/1.1 response head"))
                self._buf = data
                return
            try:
                head = http1.parse_response_head(data[:end])
            except http1.ProtocolError as e:
                return self._broken(e)
            data = data[end + 4 :]
            if not head.interim:  # a 1xx head: the real one follows
                break
        self._head = head
        self._left = head.length or 0
        self._chunks = http1.ChunkedDecoder() if head.chunked else None
        self._state = "body"
        self._response = Response(head, self)
        waiting, self._waiting = self._waiting, None
        assert waiting is not None  # a head is read only while its request waits (state "head")
        waiting.callback(self._response)
        if self._state != "body":
            return  # the body was abandoned in the callback
        if not head.has_body(self._head_request):
            self._complete(data)
        elif data or head.length == 0:
            self._body(data)

    def _body(self, data: bytes):
        head = self._head
        assert head is not None and self._response is not None  # both set while a body is read
        try:
            if self._chunks is not None:
                payload = self._chunks.feed(data)
                done, extra = self._chunks.done, self._chunks.extra
            elif head.length is not None:
                take = min(self._left, len(data))
                payload = data if take == len(data) else data[:take]
                self._left -= take
                done, extra = not self._left, data[take:]
            else:
                payload, done, extra = data, False, b""
        except http1.ProtocolError as e:
            return self._broken(e)
        if payload:
            self._response._received(payload)
            if self._state != "body":
                return  # abandoned while handling the data
        if done:
            self._complete(extra)

    def _complete(self, extra: bytes):
        """The whole response is in: pool the connection (when it can serve another), then say so."""
        response, self._response = self._response, None
        assert response is not None and self._head is not None  # both set while a response is read
        reusable = self._head.keep_alive and not extra
        self._head = self._chunks = None
        self._state = "idle"
        if self._paused:
            self._paused = False
            self.transport.resumeProducing()
        if reusable:
            self._pool.put(self)
        else:
            self.transport.loseConnection()
        response._ended(Failure(ResponseDone()))

    def _broken(self, reason: Exception):
        """Not HTTP: end whatever waits with `reason` and drop the connection."""
        self.transport.abortConnection()
        self._fail(Failure(ResponseFailed([Failure(reason)])))

    def _fail(self, reason: Failure):
        self._state = "closed"
        if self._waiting is not None:
            waiting, self._waiting = self._waiting, None
            waiting.errback(reason)
        elif self._response is not None:
            response, self._response = self._response, None
            response._ended(reason)

    def connectionLost(self, reason=None):
        self._pool.discard(self)
        if self._state == "head" and not self._got_bytes:
            reason = Failure(ConnectionDied(f"the upstream connection closed before a response: {reason.value}"))
        elif self._state == "body" and self._head.length is None and not self._head.chunked:
            # A body delimited by the close: complete if the close was clean (ours would be "abandoned").
            if reason.check(error.ConnectionDone):
                reason = Failure(PotentialDataLoss())
            else:
                reason = Failure(ResponseFailed([reason]))
        elif self._state in ("head", "body", "abandoned"):
            reason = Failure(ResponseFailed([reason]))
        self._fail(reason)


class _Pool:
    """Idle keep-alive connections per upstream, newest first, each closed after a bounded idle time.

    One sweep timer for the whole pool, not one per idle connection: a connection
    goes back to the pool after every response, and a timer each time was a
    measurable share of cg's CPU per request. A connection idle longer than the
    timeout is closed by the next sweep, at most half a timeout later.
    """

    def __init__(self, reactor, idle_timeout: float, max_idle_per_host: int):
        self._reactor = reactor
        self._idle_timeout = idle_timeout
        self._max_idle = max_idle_per_host
        self._idle: dict[tuple, list[_Connection]] = {}
        self._sweep = None
        self._closing: dict[_Connection, list[defer.Deferred]] = {}  # who waits for each close
        self._closed = False

    def take(self, key) -> _Connection | None:
        idle = self._idle.get(key)
        while idle:
            connection = idle.pop()
            if connection.usable:
                return connection
        return None

    def put(self, connection: _Connection):
        if self._closed:
            connection.transport.loseConnection()
            return
        connection.idle_since = self._reactor.seconds()
        assert connection.key is not None  # it served a request, so it was keyed
        idle = self._idle.setdefault(connection.key, [])
        idle.append(connection)
        if len(idle) > self._max_idle:
            idle.pop(0).transport.loseConnection()
        if self._sweep is None:
            self._sweep = self._reactor.callLater(self._idle_timeout / 2, self._close_stale)

    def _close_stale(self):
        self._sweep = None
        oldest_allowed = self._reactor.seconds() - self._idle_timeout
        for idle in self._idle.values():
            # Oldest first: stop at the first connection young enough to keep.
            while idle and idle[0].idle_since <= oldest_allowed:
                idle.pop(0).transport.loseConnection()
        if any(self._idle.values()):
            self._sweep = self._reactor.callLater(self._idle_timeout / 2, self._close_stale)

    def discard(self, connection: _Connection):
        key = connection.key  # None for one that never reached _Call._connected: never pooled
        idle = self._idle.get(key) if key is not None else None
        if idle and connection in idle:
            idle.remove(connection)
        for waiter in self._closing.pop(connection, ()):
            waiter.callback(None)

    def close(self) -> defer.Deferred:
        """Close every idle connection, and any that comes back later; fires once the idle ones are closed."""
        self._closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        idle, self._idle = self._idle, {}
        for connections in idle.values():
            for connection in connections:
                self._closing[connection] = []
                connection.transport.loseConnection()
        waits = []
        for waiters in self._closing.values():
            waiters.append(defer.Deferred())
            waits.append(waiters[-1])
        return defer.gatherResults(waits)


class _ConnectionFactory(Factory):
    noisy = False  # no "Starting factory" log line per upstream connection

    def __init__(self, pool: _Pool):
        self._pool = pool

    def buildProtocol(self, addr):
        return _Connection(self._pool)


class _Target:
    """Where an upstream origin is: the pool key, its endpoint (built once), and Host."""

    __slots__ = ("key", "endpoint", "host")

    def __init__(self, key, endpoint, host: bytes):
        self.key = key
        self.endpoint = endpoint
        self.host = host


class _Call:
    """One request upstream: a pooled connection (or a new one), a bounded wait for the head.

    A reused connection that dies before any response byte (the peer closed it while
    it sat idle: a server's keep-alive limit, a laptop that slept) gets one retry on a
    fresh connection; nothing else is retried. Every provider call is a POST, and
    such a request was never processed.
    """

    def __init__(self, upstream: "Upstream", target: _Target, head: bytes, body, head_request: bool):
        self._upstream = upstream
        self._target = target
        self._request = (head, body, head_request)
        self._attempt: defer.Deferred | None = None
        self._timed_out = False
        self.result: defer.Deferred[Response] = defer.Deferred(self._cancel)
        self._timer = upstream.reactor.callLater(upstream.header_timeout, self._expire)
        connection = upstream.pool.take(target.key)
        if connection is not None:
            self._send(connection)
        else:
            self._connect()

    def _connect(self):
        self._attempt = self._target.endpoint.connect(self._upstream.factory)
        self._attempt.addCallbacks(self._connected, self._failed)

    def _connected(self, connection: _Connection):
        connection.key = self._target.key
        self._send(connection)

    def _send(self, connection: _Connection):
        reused = connection.served > 0
        self._attempt = connection.send(*self._request)
        self._attempt.addCallbacks(self._responded, self._send_failed, errbackArgs=(reused,))

    def _send_failed(self, failure, reused: bool):
        if reused and failure.check(ConnectionDied) and not self._timed_out:
            self._upstream.on_retry()
            self._connect()
        else:
            self._failed(failure)

    def _responded(self, response: Response):
        self._stop_timer()
        self.result.callback(response)

    def _failed(self, failure):
        self._stop_timer()
        if self._timed_out:
            failure = Failure(HeaderTimeout())
        if not self.result.called:
            self.result.errback(failure)

    def _stop_timer(self):
        if self._timer.active():
            self._timer.cancel()

    def _expire(self):
        self._timed_out = True
        self._attempt.cancel()

    def _cancel(self, _d):
        self._attempt.cancel()


@implementer(IUpstream)
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
        self.reactor = reactor
        self.header_timeout = header_timeout
        self.on_retry = on_retry
        self.pool = _Pool(reactor, idle_timeout, max_idle_per_host)
        self.factory = _ConnectionFactory(self.pool)
        self._connect_timeout = connect_timeout
        self._tls = BrowserLikePolicyForHTTPS(trust_root)
        self._targets: dict[bytes, _Target] = {}

    def request(self, method: bytes, origin: bytes, path: bytes, headers, body: bytes | None) -> defer.Deferred:
        """Sends a request for `path` to `origin` (``scheme://host[:port]``, from `split_base`).

        Fires with the Response once its head arrived. Fails with HeaderTimeout when
        that takes longer than the header timeout, or with the transport's failure
        (connect refused or timed out, reset). Cancelling it before then drops the
        connection, so the provider stops.
        """
        target = self._targets.get(origin)
        if target is None:
            target = self._targets[origin] = self._target(origin)
        head = http1.request_head(method, path, target.host, headers, body)
        return _Call(self, target, head, body, method == b"HEAD").result

    def _target(self, origin: bytes) -> _Target:
        """The endpoint for scheme://host[:port], built once: for HTTPS that includes its TLS options."""
        scheme, _, host = origin.partition(b"://")
        if scheme not in (b"http", b"https"):
            raise ValueError(f"unsupported upstream scheme {scheme!r}")
        default = 443 if scheme == b"https" else 80
        name, port = host, default
        if host.rpartition(b":")[2].isdigit() and not host.endswith(b"]"):
            name, _, digits = host.rpartition(b":")
            port = int(digits)
            if port == default:
                host = name  # Host without the default port, as browsers and Agent send it
        name_text = name.strip(b"[]").decode("idna")
        endpoint: IStreamClientEndpoint
        endpoint = HostnameEndpoint(self.reactor, name_text, port, timeout=self._connect_timeout)
        if scheme == b"https":
            endpoint = wrapClientTLS(self._tls.creatorForNetloc(name.strip(b"[]"), port), endpoint)
        return _Target((scheme, name, port), endpoint, host)

    def close(self) -> defer.Deferred:
        return self.pool.close()


def split_base(url: str) -> tuple[bytes, bytes]:
    """An upstream base URL as its origin (``scheme://host[:port]``) and its path (no final ``/``).

    Split once, from the configuration: a request goes to that origin with the base's
    path followed by the client's, so nothing a client sends can name another scheme,
    host or port. ValueError for anything else than http(s)://host[:port][/path], which
    would fail every request at run time instead (``127.0.0.1:18901``).
    """
    parts = urlsplit(url)
    try:
        port = parts.port  # raises on a port that is no number, or out of range
    except ValueError as error:
        raise ValueError(f"{error}: {url!r}") from error
    path = parts.path.rstrip("/")
    if not (
        parts.scheme in ("http", "https")
        and parts.hostname
        and port != 0
        and not parts.netloc.endswith(":")  # an empty port
        and url.isascii()
        and "@" not in parts.netloc  # no user name
        and not any(c in url for c in "?#")  # no query or fragment
        and not (path and http1.target_problem(path.encode()))
    ):
        raise ValueError(f"not an absolute http(s)://host[:port][/path] URL: {url!r}")
    return f"{parts.scheme}://{parts.netloc}".encode(), path.encode()
