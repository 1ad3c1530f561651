"""The upstream leg: pooled, keep-alive HTTP/1.1 connections to the provider.

cg speaks HTTP/1.1 upstream itself (wire format in `cg.wire.http1`), on a plain Protocol,
rather than through twisted.web.client.Agent. A proxy needs a small part of Agent: one
request at a time per connection, a body of known bytes, and a response relayed chunk by
chunk. Agent's general machinery around that (a Deferred chain per request, a line
parser and a state dispatcher per response, a Deferred per body chunk) was about a
third of cg's CPU per proxied request. treq's HTTPClient was never an option: its cookie
jar would replay one client's Set-Cookie on another's requests.

As in Twisted's own client (`twisted.web._newclient`), parsing is apart from the transport:
`cg.wire.http1.ResponseParser` turns a connection's bytes into events (sans-io), and
`_Connection`, the protocol on the transport, is a state machine over those events (its table
is in its docstring).

What callers see is Agent's shape, declared as `IUpstream` and `IUpstreamResponse` (the
seam `cg.testing.MemoryUpstream` also fills): `Upstream.request` fires with a response that
has `code`, `phrase`, `headers` and `deliverBody(protocol)`; the protocol's transport is the
body's push producer, and its `connectionLost` gets ResponseDone (a complete body),
PotentialDataLoss (a body delimited by a clean close) or ResponseFailed.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from OpenSSL import crypto
from twisted.internet import defer, error, ssl
from twisted.internet.endpoints import HostnameEndpoint, wrapClientTLS
from twisted.internet.interfaces import (
    IAddress,
    IDelayedCall,
    IProtocol,
    IPushProducer,
    IReactorTime,
    IStreamClientEndpoint,
    ITCPTransport,
)
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.python.failure import Failure
from twisted.web.client import BrowserLikePolicyForHTTPS, ResponseDone, ResponseFailed
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from zope.interface import Attribute, Interface, implementer

from cg.wire import http1
from cg.wire.http1 import NEED_DATA

_Key = tuple[bytes, bytes, int]  # an upstream's (scheme, host, port): its pool of connections


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

    def deliverBody(protocol: IProtocol) -> None:
        """Connect `protocol` (its transport is this response) and hand it the body as it arrives.

        Its `connectionLost` gets ResponseDone (the body is complete), PotentialDataLoss (a body
        delimited by a clean close: complete too) or ResponseFailed (cut short).
        """


class IUpstream(Interface):
    """Sends one request to a provider and gets its response head; what `ProxyResource` forwards through."""

    def request(
        method: bytes, origin: bytes, path: bytes, headers: Headers, body: bytes | None
    ) -> defer.Deferred[Any]:
        """Send `method` `path` to `origin` (``scheme://host[:port]``) with `headers` and `body` (bytes or None).

        Returns a Deferred firing with an `IUpstreamResponse` once the head arrived, or failing
        (HeaderTimeout, a connect failure, ConnectionDied, ResponseFailed). Cancelling it
        before then drops the request, so the provider stops.
        """

    def close() -> defer.Deferred[Any]:
        """Close idle connections (and any that frees up later); a Deferred that fires once they are."""


class HeaderTimeout(Exception):
    """The upstream accepted the request but sent no response headers in time."""


class ConnectionDied(Exception):
    """The connection ended before a response head arrived (the request may not have been read)."""


if TYPE_CHECKING:
    from twisted.internet._sslverify import IOpenSSLTrustRoot  # exported nowhere public

    class _IConnectionTransport(ITCPTransport, IPushProducer):
        """What an upstream connection's transport is, for the type checker.

        A TCP connection (twisted.internet.tcp.Client), or for HTTPS a TLSMemoryBIOProtocol
        over one: it has its own write, loseConnection and abortConnection, and relays what
        else is asked of it (setTcpNoDelay, pauseProducing) to that connection. Both have
        `disconnecting` (0, 1 or a bool), which no Twisted interface declares.
        """

        disconnecting: int


def load_trust_root(ca_file: str) -> IOpenSSLTrustRoot:
    """A trust root holding every certificate of a PEM bundle (a private CA). Raises ValueError, in one
    line, for a bundle it cannot read."""
    try:
        with open(ca_file, "rb") as f:
            pem = f.read()
    except OSError as error:
        raise ValueError(f"cannot read {ca_file}: {error.strerror}") from error
    marker = b"-----BEGIN CERTIFICATE-----"
    try:
        certs = [ssl.Certificate.loadPEM(marker + part) for part in pem.split(marker)[1:]]
    except crypto.Error as error:
        raise ValueError(f"a certificate in {ca_file} is not PEM: {error}") from error
    if not certs:
        raise ValueError(f"no PEM certificate in {ca_file}")
    root: IOpenSSLTrustRoot = ssl.trustRootFromCertificates(certs)
    return root


def is_timeout(failure: Failure) -> bool:
    """A connect or header timeout: answered 504 rather than 502."""
    return bool(failure.check(HeaderTimeout, error.TimeoutError))


def _failed(reason: Failure) -> Failure:
    """The end of a response cut short by `reason`, as Agent says it."""
    return Failure(ResponseFailed([reason]))


@implementer(IUpstreamResponse)
class Response:
    """An upstream response whose head has arrived; its body goes to one protocol.

    It is also that protocol's transport, the body's push producer: pausing it pauses
    the upstream socket, stopping it abandons the body and drops the connection. Once
    the body has ended those are no-ops, so a stale reference cannot touch the
    connection's next request.
    """

    def __init__(self, head: http1.ResponseHead, connection: _Connection):
        self.code = head.code
        self.phrase = head.phrase
        self.headers = headers = Headers()
        for name, value in head.headers:
            headers.addRawHeader(name, value)
        self._connection: _Connection | None = connection  # until the body ends
        self._protocol: IProtocol | None = None
        self._early: list[bytes] = []  # body bytes that came before deliverBody
        self._end: Failure | None = None  # the body's end, when it came before deliverBody
        self._held = False  # paused until someone takes the body
        self._consumer_paused = False

    def deliverBody(self, protocol: IProtocol) -> None:
        self._protocol = protocol
        # The body's transport is this producer, as Agent's is a producer proxy: no ITransport.
        protocol.makeConnection(self)  # type: ignore[arg-type]
        early, self._early = self._early, []
        for data in early:
            protocol.dataReceived(data)
        if self._end is not None:
            protocol.connectionLost(self._end)
        elif self._held:
            self._held = False
            if self._connection is not None and not self._consumer_paused:
                self._connection.resume()

    def pauseProducing(self) -> None:
        self._consumer_paused = True
        if self._connection is not None:
            self._connection.pause()

    def resumeProducing(self) -> None:
        self._consumer_paused = False
        if self._connection is not None and not self._held:
            self._connection.resume()

    def stopProducing(self) -> None:
        if self._connection is not None:
            self._connection.abandon()

    def _received(self, data: bytes) -> None:
        if self._protocol is not None:
            self._protocol.dataReceived(data)
        else:
            self._early.append(data)
            self._held = True
            assert self._connection is not None  # bytes come only before the body's end
            self._connection.pause()  # holds at most a read until someone takes the body

    def _ended(self, reason: Failure) -> None:
        self._connection = None
        if self._protocol is not None:
            self._protocol.connectionLost(reason)
        else:
            self._end = reason


class _State(enum.Enum):
    """Where an upstream connection is (see `_Connection`'s table)."""

    IDLE = "no request: new, or in the pool"
    AWAITING_HEAD = "a request sent, its response head not in yet"
    READING_BODY = "a response's body being read"
    ABANDONED = "dropped by cg, waiting for the transport's end"
    CLOSED = "ended"


# The code names the states through module globals: a global costs 9-16 ns, an enum member's
# lookup 21-86 ns (timeit, CPython 3.10-3.13, 2026-12-06), a price paid per read or per request.
_IDLE, _AWAITING_HEAD, _READING_BODY = _State.IDLE, _State.AWAITING_HEAD, _State.READING_BODY
_ABANDONED, _CLOSED = _State.ABANDONED, _State.CLOSED


class _Connection(Protocol):
    """One upstream connection: one request at a time, back to the pool after a whole response.

    The bytes are `cg.wire.http1.ResponseParser`'s to parse; this holds what the parser
    does not: the transport, the request's Deferred, the Response, the pool.

    =============  ==========================================  ======================================
    state          event                                       action → next state
    =============  ==========================================  ======================================
    IDLE           `send` (a request)                          write it → AWAITING_HEAD
    IDLE           Bytes (a response nobody asked for)         abort → ABANDONED
    IDLE           Lost (closed by the pool, or the server)    → CLOSED
    AWAITING_HEAD  The head (1xx heads skipped)                fire the request's Deferred with the
                                                               Response → READING_BODY
    AWAITING_HEAD  Bytes that are not HTTP/1.1                 abort; the Deferred fails with
                                                               ResponseFailed → CLOSED
    AWAITING_HEAD  Deferred cancelled (header timeout,         abort → ABANDONED
                   client gone)
    AWAITING_HEAD  Lost before any byte of a response          the Deferred fails with ConnectionDied
                                                               (`_Call` retries a reused one) → CLOSED
    AWAITING_HEAD  Lost after some                             the Deferred fails with ResponseFailed
                                                               → CLOSED
    READING_BODY   Body bytes                                  to the Response (its protocol, or held
                                                               until `deliverBody`) → READING_BODY
    READING_BODY   The body's end                              pool the connection (keep-alive and
                                                               nothing after the body) or close it;
                                                               the body ends with ResponseDone → IDLE
    READING_BODY   Bad chunked framing                         abort; the body ends with
                                                               ResponseFailed → CLOSED
    READING_BODY   `Response.stopProducing`                    abort → ABANDONED
    READING_BODY   Lost: a close-delimited body, cleanly       the body ends with PotentialDataLoss
                                                               → CLOSED
    READING_BODY   Lost otherwise                              the body ends with ResponseFailed
                                                               → CLOSED
    ABANDONED      Bytes                                       ignored (not parsed: a body cut
                                                               mid-read never looks complete)
                                                               → ABANDONED
    ABANDONED      Lost                                        the body (if any) ends with
                                                               ResponseFailed → CLOSED
    CLOSED         Anything                                    nothing → CLOSED
    =============  ==========================================  ======================================

    Whatever the state, a lost connection leaves the pool; the Response pauses and resumes
    the transport (`pause`, `resume`) until CLOSED, and a paused connection is resumed when
    its body ends, so it can be pooled.
    """

    # Set by makeConnection before any method here runs, and never unset.
    transport: _IConnectionTransport

    def __init__(self, pool: _Pool):
        self._pool = pool
        self.key: _Key | None = None  # its target's, set once connected (before any request)
        self.served = 0  # requests sent on this connection
        self._state = _IDLE
        self._parser = http1.ResponseParser()
        self._waiting: defer.Deferred[Response] | None = None  # fires with the Response
        self._got_bytes = False  # some byte of the awaited response arrived
        self._response: Response | None = None
        self._paused = False
        self.idle_since = 0.0  # when it last went back to the pool

    @property
    def usable(self) -> bool:
        return self._state is _IDLE and not self.transport.disconnecting

    def connectionMade(self) -> None:
        self.transport.setTcpNoDelay(True)  # no Nagle stall on small requests
        self.transport.setTcpKeepAlive(True)

    def send(self, head: bytes, body: bytes | None, head_request: bool) -> defer.Deferred[Response]:
        """Write a request; fires with its Response once the response head has arrived."""
        self.served += 1
        self._state = _AWAITING_HEAD
        self._parser.start(head_request)
        self._got_bytes = False
        waiting: defer.Deferred[Response] = defer.Deferred(self._cancel_wait)
        self._waiting = waiting
        if body:
            self.transport.writeSequence([head, body])
        else:
            self.transport.write(head)
        return waiting

    def _cancel_wait(self, _d: defer.Deferred[Response]) -> None:
        self._waiting = None
        self.abandon()

    def pause(self) -> None:
        if not self._paused and self._state is not _CLOSED:
            self._paused = True
            self.transport.pauseProducing()

    def resume(self) -> None:
        if self._paused and self._state is not _CLOSED:
            self._paused = False
            self.transport.resumeProducing()

    def abandon(self) -> None:
        """Nobody wants the rest of this response: drop the connection at once.

        Final: bytes already read are not parsed, so a body being read ends (when the
        connection does, never from inside this call) as failed, never as complete,
        even when the rest of this read held its end.
        """
        if self._state is not _CLOSED:
            self._state = _ABANDONED  # from here on the connection's end ends the body, as failed
            self.transport.abortConnection()

    def dataReceived(self, data: bytes) -> None:
        state = self._state
        if state is _READING_BODY:
            self._read(data)
        elif state is _AWAITING_HEAD:
            self._got_bytes = True
            self._read(data)
        elif state is _IDLE:  # a response nobody asked for: not handed out again before its end comes
            self.abandon()

    def _read(self, data: bytes) -> None:
        """Hand a read to the parser and act on its events, until it needs more or the response is not wanted."""
        parser = self._parser
        parser.receive(data)
        while True:
            try:
                event = parser.next_event()
            except http1.ProtocolError as e:
                self._broken(e)
                return
            if type(event) is bytes:
                assert self._response is not None  # body data comes while a body is read
                self._response._received(event)
            elif event is NEED_DATA:
                return
            elif isinstance(event, http1.BodyEnd):
                self._complete(event.reusable)
                return
            elif isinstance(event, http1.ResponseHead):
                self._headed(event)
            if self._state is not _READING_BODY:
                return  # abandoned by whoever handled the event

    def _headed(self, head: http1.ResponseHead) -> None:
        self._state = _READING_BODY
        self._response = response = Response(head, self)
        waiting, self._waiting = self._waiting, None
        assert waiting is not None  # a head is read only while its request waits (AWAITING_HEAD)
        waiting.callback(response)

    def _complete(self, reusable: bool) -> None:
        """The whole response is in: pool the connection (when it can serve another), then say so."""
        response, self._response = self._response, None
        assert response is not None  # set while a response is read
        self._state = _IDLE
        if self._paused:
            self._paused = False
            self.transport.resumeProducing()
        if reusable:
            self._pool.put(self)
        else:
            self.transport.loseConnection()
        response._ended(Failure(ResponseDone()))

    def _broken(self, reason: Exception) -> None:
        """Not HTTP: end whatever waits with `reason` and drop the connection."""
        self.transport.abortConnection()
        self._fail(_failed(Failure(reason)))

    def _fail(self, reason: Failure) -> None:
        self._state = _CLOSED
        if self._waiting is not None:
            waiting, self._waiting = self._waiting, None
            waiting.errback(reason)
        elif self._response is not None:
            response, self._response = self._response, None
            response._ended(reason)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self._pool.discard(self)
        state = self._state
        if state is _AWAITING_HEAD and not self._got_bytes:
            reason = Failure(ConnectionDied(f"the upstream connection closed before a response: {reason.value}"))
        elif state is _READING_BODY and self._parser.ends_at_close:
            # A body delimited by the close: complete if the close was clean (ours would be ABANDONED).
            if reason.check(error.ConnectionDone):
                reason = Failure(PotentialDataLoss())
            else:
                reason = _failed(reason)
        elif state in (_AWAITING_HEAD, _READING_BODY, _ABANDONED):
            reason = _failed(reason)
        self._fail(reason)


class _Pool:
    """Idle keep-alive connections per upstream, newest first, each closed after a bounded idle time.

    One sweep timer for the whole pool, not one per idle connection: a connection
    goes back to the pool after every response, and a timer each time was a
    measurable share of cg's CPU per request. A connection idle longer than the
    timeout is closed by the next sweep, at most half a timeout later.
    """

    def __init__(self, reactor: IReactorTime, idle_timeout: float, max_idle_per_host: int):
        self._reactor = reactor
        self._idle_timeout = idle_timeout
        self._max_idle = max_idle_per_host
        self._idle: dict[_Key, list[_Connection]] = {}
        self._sweep: IDelayedCall | None = None
        self._closing: dict[_Connection, list[defer.Deferred[None]]] = {}  # who waits for each close
        self._closed = False

    def take(self, key: _Key) -> _Connection | None:
        idle = self._idle.get(key)
        while idle:
            connection = idle.pop()
            if connection.usable:
                return connection
        return None

    def put(self, connection: _Connection) -> None:
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

    def _close_stale(self) -> None:
        self._sweep = None
        oldest_allowed = self._reactor.seconds() - self._idle_timeout
        for idle in self._idle.values():
            # Oldest first: stop at the first connection young enough to keep.
            while idle and idle[0].idle_since <= oldest_allowed:
                idle.pop(0).transport.loseConnection()
        if any(self._idle.values()):
            self._sweep = self._reactor.callLater(self._idle_timeout / 2, self._close_stale)

    def discard(self, connection: _Connection) -> None:
        key = connection.key  # None for one that never reached _Call._connected: never pooled
        idle = self._idle.get(key) if key is not None else None
        if idle and connection in idle:
            idle.remove(connection)
        for waiter in self._closing.pop(connection, ()):
            waiter.callback(None)

    def close(self) -> defer.Deferred[list[None]]:
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
        waits: list[defer.Deferred[None]] = []
        for waiters in self._closing.values():
            waiters.append(defer.Deferred())
            waits.append(waiters[-1])
        return defer.gatherResults(waits)


class _ConnectionFactory(Factory):
    noisy = False  # no "Starting factory" log line per upstream connection

    def __init__(self, pool: _Pool):
        self._pool = pool

    def buildProtocol(self, addr: IAddress | None) -> _Connection:
        return _Connection(self._pool)


class _Target:
    """Where an upstream origin is: the pool key, its endpoint (built once), and Host."""

    __slots__ = ("key", "endpoint", "host")

    def __init__(self, key: _Key, endpoint: IStreamClientEndpoint, host: bytes):
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

    def __init__(self, upstream: Upstream, target: _Target, head: bytes, body: bytes | None, head_request: bool):
        self._upstream = upstream
        self._target = target
        self._request = (head, body, head_request)
        self._attempt: defer.Deferred[Any] | None = None  # the connect's, then the send's
        self._timed_out = False
        self.result: defer.Deferred[Response] = defer.Deferred(self._cancel)
        self._timer = upstream.reactor.callLater(upstream.header_timeout, self._expire)
        connection = upstream.pool.take(target.key)
        if connection is not None:
            self._send(connection)
        else:
            self._connect()

    def _connect(self) -> None:
        self._attempt = self._target.endpoint.connect(self._upstream.factory)
        self._attempt.addCallbacks(self._connected, self._failed)

    def _connected(self, connection: _Connection) -> None:
        connection.key = self._target.key
        self._send(connection)

    def _send(self, connection: _Connection) -> None:
        reused = connection.served > 0
        self._attempt = connection.send(*self._request)
        self._attempt.addCallbacks(self._responded, self._send_failed, errbackArgs=(reused,))

    def _send_failed(self, failure: Failure, reused: bool) -> None:
        if reused and failure.check(ConnectionDied) and not self._timed_out:
            self._upstream.on_retry()
            self._connect()
        else:
            self._failed(failure)

    def _responded(self, response: Response) -> None:
        self._stop_timer()
        self.result.callback(response)

    def _failed(self, failure: Failure) -> None:
        self._stop_timer()
        if self._timed_out:
            failure = Failure(HeaderTimeout())
        if not self.result.called:
            self.result.errback(failure)

    def _stop_timer(self) -> None:
        if self._timer.active():
            self._timer.cancel()

    def _expire(self) -> None:
        self._timed_out = True
        assert self._attempt is not None  # set in __init__, before the timer can fire
        self._attempt.cancel()

    def _cancel(self, _d: defer.Deferred[Response]) -> None:
        assert self._attempt is not None  # set in __init__, before anyone holds the result
        self._attempt.cancel()


@implementer(IUpstream)
class Upstream:
    """Sends requests upstream over pooled connections, bounding the wait for headers."""

    def __init__(
        self,
        reactor: Any,  # IReactorTime and IReactorTCP (with TLS: IReactorSSL's machinery through endpoints)
        *,
        connect_timeout: float = 10.0,
        header_timeout: float = 600.0,
        idle_timeout: float = 60.0,
        max_idle_per_host: int = 256,
        trust_root: IOpenSSLTrustRoot | None = None,
        on_retry: Callable[[], object] = lambda: None,
    ):
        self.reactor = reactor
        self.header_timeout = header_timeout
        self.on_retry = on_retry
        self.pool = _Pool(reactor, idle_timeout, max_idle_per_host)
        self.factory = _ConnectionFactory(self.pool)
        self._connect_timeout = connect_timeout
        self._tls = BrowserLikePolicyForHTTPS(trust_root)
        self._targets: dict[bytes, _Target] = {}

    def request(
        self, method: bytes, origin: bytes, path: bytes, headers: Headers, body: bytes | None
    ) -> defer.Deferred[Response]:
        """Sends a request for `path` to `origin` (``scheme://host[:port]``, from `split_base`).

        Fires with the Response once its head arrived. Fails with HeaderTimeout when
        that takes longer than the header timeout, or with the transport's failure
        (connect refused or timed out, reset). Cancelling it before then drops the
        connection, so the provider stops.
        """
        target = self._targets.get(origin)
        if target is None:
            target = self._targets[origin] = self._target(origin)
        head = http1.request_head(method, path, target.host, headers.getAllRawHeaders(), body)
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

    def close(self) -> defer.Deferred[list[None]]:
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
