"""Runs a request's two sans-io machines on Twisted: its `cg.exchange.prepare.Preparation`, then its
`cg.exchange.Exchange`; events in from twisted.web, the store, the upstream and the reactor,
commands out onto them.

One `ExchangeDriver` per client request. It starts the preparation with what it read of the
request and carries out its store commands, feeding back their answers; on its `Ready` it feeds the
exchange the request, then the upstream's heads, bodies (gzip decoded here) and failures, the
client's disconnect, the store's answers to expand calls and the timers' firings, and carries out
each command in order. An event that comes while commands are being carried out (a Deferred that
fires at once, a body delivered synchronously) waits its turn, so neither machine sees one inside
another. An event a machine has no row for (`Unexpected`) is counted in /stats and logged, and
dropped; a bug in preparation forwards the body as received.

What the driver needs of what it runs in is `Host` (`cg.web.forwarder.Forwarder`).

The upstream body that feeds the client is paused by the client's `ClientFlow`, registered once per
exchange as the client response's producer; a client that stops reading pauses the upstream read,
and a client that leaves cancels the upstream request. Timers run on the proxy's reactor only.
"""

from __future__ import annotations

import functools
import typing
import zlib
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from twisted.internet import defer, task
from twisted.internet.interfaces import IDelayedCall, IPushProducer, ITCPTransport
from twisted.internet.protocol import Protocol, connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from zope.interface import implementer

from cg.exchange import prepare
from cg.exchange.machine import (
    Abort,
    BodyEnd,
    CancelTimer,
    Chunk,
    ClientGone,
    Cut,
    DetachBody,
    DiscardBody,
    Exchange,
    Finish,
    Head,
    KeepHidden,
    Prepared,
    ReadBody,
    Record,
    Resolve,
    Resolved,
    ResolveFailed,
    Send,
    SetHead,
    StartTimer,
    State,
    StopUpstream,
    Timer,
    TimerFired,
    Unexpected,
    UpstreamFailed,
    Write,
)
from cg.exchange.prepare import Forward, Preparation, Ready
from cg.exchange.record import ExchangeRecord
from cg.record.ledger import Sent
from cg.stream.continuation import answers, refs_to_resolve, resolve
from cg.stream.usage import Usage
from cg.web import headers
from cg.web.site import CappedRequest
from cg.web.upstream import Response, is_timeout
from cg.wire import dialect

if TYPE_CHECKING:
    from twisted.internet.interfaces import IReactorTime

    from cg.record.stats import Stats
    from cg.store.base import IStore
    from cg.web.keepalive import KeepAlive
    from cg.web.upstream import IUpstream

log = Logger(namespace="cg.web.driver")

FLUSH_TIMEOUT = 10.0  # seconds a cut client connection may take to take its last bytes
_BODYLESS = (b"GET", b"HEAD", b"DELETE", b"OPTIONS")
_FIRED = {timer: TimerFired(timer) for timer in Timer}


class _Start:
    """The driver's own event: start the preparation (it must come through the queue like any)."""


_START = _Start()
_PREPARATION_EVENTS = frozenset({_Start, prepare.Answered, prepare.Failed})
_CLIENT_GONE = ClientGone()
_CUT = Cut()
_STOP = StopUpstream()


class Host(typing.Protocol):
    """What a driver needs of what it runs in: the upstream, the store, the limits, and where it
    reports what happened (`cg.web.forwarder.Forwarder`)."""

    stats: Stats
    upstream: IUpstream
    upstreams: dict[str, tuple[bytes, bytes]]  # dialect -> (origin, base path)
    store: IStore | None
    keepalive: KeepAlive | None
    reactor: IReactorTime
    clock: Callable[[], float]
    now: Callable[[], float]  # wall-clock time
    seqs: Iterator[int]
    max_expand_rounds: int
    max_held: int
    continuation_timeout: float
    tenant_of: Callable[[Headers], str]

    def preparation(self, request: prepare.Request) -> Preparation: ...

    def prepared(self, ready: Ready) -> None: ...

    def cache_used(self, tenant: str, cache: tuple[str, float]) -> None: ...

    def keep_hidden(self, tenant: str, key: str, text: bytes) -> None: ...

    def pinged(self, sent: Sent, session: str, cache: tuple[str, float] | None, usage: Usage) -> None: ...

    def recorded(self, record: ExchangeRecord, report: prepare.Report, sent: Sent) -> None: ...

    def metrics_tenant(self, request: CappedRequest) -> str: ...

    def started(self, driver: ExchangeDriver) -> None: ...

    def ended(self, driver: ExchangeDriver) -> None: ...


class ExchangeDriver:
    """One client request: its `Exchange`, and the Twisted objects the exchange's commands act on."""

    def __init__(self, host: Host, request: CappedRequest, which: str):
        self.host = host
        self.request = request
        request.proxied = True  # its line is written at the exchange's end, not by the site
        self.which = which
        self.stats = host.stats
        self.seq = next(host.seqs)
        self.arrived = host.now()  # wall-clock time, for the ledger
        self.tenant = ""  # whose originals expand calls may read
        self.session = "-"  # the conversation's key (cg.stream.usage.session_key)
        self.model: str | None = None
        self.originals: Mapping[str, bytes] = {}  # behind the markers forwarded: marker ID -> original
        self.warm: tuple[tuple[str, bytes, str | None], float | None] | None = None  # Forward.keepalive
        self.warm_generation: int | None = None  # of round 0 in the keep-alive, once sent
        self.cache: tuple[str, float] | None = None  # Forward.cache
        reads = self.reads = dialect.response_shape(request.uri)
        self.decode = reads is not None
        assert request.content is not None  # twisted.web reads every body into content
        body: bytes = request.content.getvalue()
        self._body: bytes | None = body
        self.exchange: Exchange = Exchange(
            request.method.decode("latin-1"), request.uri.decode("latin-1"), reads or which,
            bytes_in=len(body), reads=reads, http11=request.clientproto == b"HTTP/1.1",
            clock=host.clock, max_expand_rounds=host.max_expand_rounds, max_held=host.max_held,
            continuation_timeout=host.continuation_timeout,
        )
        self.ended: bool = False
        self.round: int = 0  # of the request sent last
        self.pending: defer.Deferred[Response] | None = None  # an upstream request, until its head arrives
        self.response: Response | None = None  # a response whose head was fed, until its body is taken
        self.decoder: zlib._Decompress | None = None  # that response's
        self.relay: _Relay | None = None  # the upstream body feeding the exchange
        self.flow: ClientFlow | None = None  # the client response's producer, once a body flows
        self.timers: dict[Timer, IDelayedCall | task.LoopingCall] = {}
        self.detached: set[_Relay] = set()  # earlier rounds' bodies, draining unseen
        self.preparation: Preparation | None = None  # until it is Ready (or a bug ends it)
        self._busy: bool = False
        self._queue: deque[object] = deque()

    def start(self) -> None:
        request = self.request
        body = self._body
        assert body is not None  # start() runs once
        self.host.started(self)
        self.stats.requests[self.reads or self.which] += 1  # chat and Responses apart, as in the record
        self.stats.bytes_from_client += len(body)
        self.upstream_headers = headers.request_headers(
            request.requestHeaders, accept_encoding=b"gzip" if self.decode else None
        )
        request.notifyFinish().addErrback(lambda _: self.feed(_CLIENT_GONE))
        received = request.requestHeaders
        # Whose last body this one most likely extends: Claude Code's and Codex CLI's session headers.
        conversation = (received.getRawHeaders(b"x-claude-code-session-id") or received.getRawHeaders(b"session-id")
                        or [b""])[0]
        try:
            self.preparation = self.host.preparation(prepare.Request(
                body, request.uri, self.seq, self.host.tenant_of(received), conversation, _header_getter(received),
                bypass=received.getRawHeaders(b"x-cg-bypass") == [b"1"],
            ))
        except Exception:
            self._unprepared()
            return
        self.feed(_START)

    def cut(self) -> None:
        """Cut the client off (a graceful stop ran out of time)."""
        self.feed(_CUT)

    def feed(self, event: object) -> None:
        """Give its machine an event and carry out its commands (after those under way)."""
        if self._busy:
            self._queue.append(event)
            return
        self._busy = True
        try:
            while True:
                try:
                    if type(event) in _PREPARATION_EVENTS:
                        self._prepare(event)
                    else:
                        for command in self.exchange.feed(event):  # type: ignore[arg-type]
                            _DO[type(command)](self, command)
                except Unexpected as unexpected:
                    self._unexpected("exchange", unexpected)
                except Exception:
                    log.failure("proxying {path} failed", path=self.request.uri)
                    if self.exchange.state is State.ENDED:
                        self._closed_by_a_bug()  # its commands are lost, and it takes no more
                    else:
                        self._queue.appendleft(_CUT)
                if not self._queue:
                    return
                event = self._queue.popleft()
        finally:
            self._busy = False

    def _unexpected(self, machine: str, unexpected: Unexpected) -> None:
        """A machine was fed an event it has no row for: a bug in this driver. Counted and logged
        (the tests fail on the log line); the event is dropped and the machine goes on as it was."""
        self.stats.unexpected_events[machine] += 1
        log.error("{machine} got an unexpected event: {what} ({path})", machine=machine, what=str(unexpected),
                  path=self.request.uri, cg_unexpected=True)

    # -----------------------------------------------------------------------------------------
    # Preparation: the store commands of `cg.exchange.prepare`, then the exchange's Prepared

    def _prepare(self, event: object) -> None:
        preparation = self.preparation
        if preparation is None:
            return  # a late answer to a preparation a bug ended: it was forwarded as received
        try:
            commands = preparation.start() if event is _START else preparation.feed(event)  # type: ignore[arg-type]
        except Unexpected as unexpected:
            self._unexpected("preparation", unexpected)
            return
        except Exception:
            self._unprepared()
            return
        try:
            for command in commands:
                _DO[type(command)](self, command)
        except Exception:
            if self.preparation is None:
                raise  # Ready was carried out: what failed is the exchange's
            self._unprepared()

    def _unprepared(self) -> None:
        """A bug on the request side costs its saving, never the request: forward what came."""
        log.failure("rewriting {path} failed; forwarding it as received", path=self.request.uri)
        tenant = self.host.tenant_of(self.request.requestHeaders)  # its ledger row is its tenant's
        self._ready(Ready(Forward(self._body or b"", self.seq, tenant=tenant), prepare.Report(0)), count=False)

    def _ready(self, command: Ready, count: bool = True) -> None:
        if count:
            try:
                self.host.prepared(command)
            except Exception:
                self._unprepared()
                return
        self.preparation = None
        self._body = None  # the exchange keeps what it forwards
        forward = command.forward
        self.tenant, self.originals, self.model = forward.tenant, forward.originals, forward.model
        self.session = forward.session
        self.warm = forward.keepalive
        self.cache = forward.cache
        body = None if not forward.body and self.request.method in _BODYLESS else forward.body
        self.feed(Prepared(body, forward.rewrite, forward.session, forward.seq, command.report))

    def _store_call(self, command: prepare.StoreCommand) -> defer.Deferred[typing.Any]:
        store = self.host.store
        assert store is not None  # a preparation without a store's index sends no store command
        if isinstance(command, prepare.ReadFrozen):
            return store.frozen(command.tenant, command.key)
        if isinstance(command, prepare.ReadOriginal):
            return store.get(command.tenant, command.ref)
        if isinstance(command, prepare.Freeze):
            return store.freeze(command.tenant, command.key, command.text)
        if isinstance(command, prepare.RecordCache):
            return store.cache_until(command.tenant, command.key, command.until)
        return store.put(command.tenant, command.originals)

    def _ask_store(self, command: prepare.StoreCommand) -> None:
        """Carry out a store command; its answer (or failure) is fed back as an event."""

        def answered(value: object) -> None:
            self.feed(prepare.Answered(command, value))

        def failed(failure: Failure) -> None:
            self.feed(prepare.Failed(command, failure.getErrorMessage() or failure.type.__name__))

        defer.maybeDeferred(self._store_call, command).addCallbacks(answered, failed).addErrback(self._bug)

    def _touch(self, command: prepare.Touch) -> None:
        store = self.host.store
        assert store is not None
        store.touch(command.tenant, command.ids, command.frozen)

    def _keep_hidden(self, command: KeepHidden) -> None:
        self.host.keep_hidden(self.tenant, command.key, command.text)

    def _user_agent(self) -> str | None:
        agent = self.request.requestHeaders.getRawHeaders(b"user-agent")
        return agent[0].decode("latin-1") if agent else None

    def _bug(self, failure: Failure) -> None:
        log.failure("proxying {path} failed", failure, path=self.request.uri)
        self.feed(_CUT)

    # -----------------------------------------------------------------------------------------
    # The upstream

    def _send(self, command: Send) -> None:
        origin, base_path = self.host.upstreams[self.which]
        body = command.body
        self.round = command.round
        if command.round == 0 and self.warm is not None:
            key, lifetime = self.warm
            # A ping refreshes the prompt cache: the cache-aware policy must count it as a use.
            sent = Sent(self.arrived, self.tenant, self.model, self._user_agent(), lifetime)
            refreshed = functools.partial(self.host.pinged, sent, self.session, self.cache)
            assert self.host.keepalive is not None and body is not None  # Forward.keepalive is set only with it
            self.warm_generation = self.host.keepalive.sent(key, lifetime, body, self.request.uri,
                                                             self.upstream_headers, refreshed, self.request.channel)
        if command.round and self.cache is not None:
            self.host.cache_used(self.tenant, self.cache)  # an expand round: the cache lives on
        self.stats.bytes_to_upstream += len(body or b"")
        pending = self.pending = self.host.upstream.request(
            self.request.method, origin, base_path + self.request.uri, self.upstream_headers, body
        )
        pending.addCallbacks(self._responded, self._failed).addErrback(self._bug)

    def _responded(self, response: Response) -> None:
        self.pending = None
        if self.ended:
            response.deliverBody(_Discard())
            return
        decodable, self.decoder = self._decoder(response)  # undecodable: passed through, encoded
        self.response = response
        if self.round:  # the client has its head
            head = Head(response.code, response.phrase, None, False, _is_stream(response), decodable)
        else:
            drop = frozenset({b"content-encoding"}) if self.decoder is not None else frozenset()
            relayed = headers.response_headers(response.headers, drop)
            head = Head(response.code, response.phrase, relayed, relayed.hasHeader(b"content-length"),
                        _is_stream(response), decodable)
        self.feed(head)

    def _failed(self, failure: Failure) -> None:
        self.pending = None
        if not self.ended:
            self.feed(UpstreamFailed(is_timeout(failure), failure.getErrorMessage() or failure.type.__name__))

    def _decoder(self, response: Response) -> tuple[bool, zlib._Decompress | None]:
        """(whether the exchange can read the body, the gzip decoder of a body cg reads: None when
        it is not encoded). An encoding cg asked not to get is not readable."""
        if not self.decode:
            return True, None
        encodings = [e.strip().lower() for v in response.headers.getRawHeaders(b"content-encoding", ())
                     for e in v.split(b",") if e.strip()]
        if not encodings or encodings == [b"identity"]:
            return True, None
        if encodings == [b"gzip"]:
            return True, zlib.decompressobj(wbits=31)
        return False, None

    def _read_body(self, command: ReadBody) -> None:
        response, self.response = self.response, None
        assert response is not None  # the exchange reads the body of the head it was fed
        response.deliverBody(_Relay(self, self.decoder))

    def _discard_body(self, command: DiscardBody) -> None:
        response, self.response = self.response, None
        assert response is not None
        response.deliverBody(_Discard())

    def _detach_body(self, command: DetachBody) -> None:
        if self.relay is not None:
            self.detached.add(self.relay)  # it drains unseen, or is stopped at the end
            self.relay = None
            assert self.flow is not None  # a relay feeds the client through it
            self.flow.detach()
        # What it delivered at once, still queued (a body read whole when its head came), is its too.
        if self._queue:
            self._queue = deque(e for e in self._queue if type(e) not in (Chunk, BodyEnd))

    def _stop_upstream(self, command: StopUpstream) -> None:
        if self.pending is not None:
            self.pending.cancel()
        elif self.relay is not None:
            self.relay.stop()

    # -----------------------------------------------------------------------------------------
    # Expand calls

    def _resolve(self, command: Resolve) -> None:
        """The originals the calls ask for: those behind this request's own markers, else from the
        store under this request's tenant."""
        self.stats.expand.bounces += 1
        calls = command.calls
        refs = refs_to_resolve(calls)
        store = self.host.store
        assert store is not None  # a request with markers had a store to keep their originals
        lookups: list[defer.Deferred[bytes | None]] = [
            defer.succeed(self.originals[ref]) if ref in self.originals
            else store.get(self.tenant, ref) for ref in refs]

        def resolved(originals: list[bytes | None]) -> None:
            resolutions = {ref: resolve(ref, original) for ref, original in zip(refs, originals)}
            for reply in answers(calls, resolutions):
                self.stats.expand.count(reply.kind, reply.text)
            self.feed(Resolved(resolutions))

        def failed(failure: Failure) -> None:
            log.failure("looking up the originals of expand calls failed", failure)
            self.feed(ResolveFailed(failure.getErrorMessage()))

        defer.gatherResults(lookups, consumeErrors=True).addCallbacks(resolved, failed).addErrback(self._bug)

    # -----------------------------------------------------------------------------------------
    # The client

    def _set_head(self, command: SetHead) -> None:
        request = self.request
        request.setResponseCode(command.status, command.phrase)
        if command.headers is not None:
            closing = request.responseHeaders.getRawHeaders(b"connection")  # set by a graceful stop, or the client
            request.responseHeaders = typing.cast(Headers, command.headers)
            if closing is not None:
                request.responseHeaders.setRawHeaders(b"connection", closing)
        for name, value in command.fields:
            request.setHeader(name, value)

    def _write(self, command: Write) -> None:
        self.stats.bytes_to_client += len(command.data)
        self.request.write(command.data)

    def _finish(self, command: Finish) -> None:
        if self.relay is not None:
            relay, self.relay = self.relay, None
            assert self.flow is not None  # a relay feeds the client through it
            self.flow.detach()
            relay.stop()
        if self.flow is not None:
            self.request.unregisterProducer()  # before finish(): after a disconnect it raises
            self.flow = None
        self.request.finish()

    def _abort(self, command: Abort) -> None:
        channel = self.request.channel
        transport = channel.transport
        if command.flush:
            # Through the channel: it unregisters itself from the transport first, else a
            # drained buffer resumes the channel instead of closing (until FLUSH_TIMEOUT).
            channel.loseConnection()
            # A client that stopped reading would keep the flush waiting: cut it after a while.
            self.host.reactor.callLater(FLUSH_TIMEOUT, _abort_if_open, transport)
        else:
            typing.cast(ITCPTransport, transport).abortConnection()

    # -----------------------------------------------------------------------------------------
    # Timers and the end

    def _start_timer(self, command: StartTimer) -> None:
        fired = _FIRED[command.timer]
        call: IDelayedCall | task.LoopingCall
        if command.repeat:
            call = task.LoopingCall(self.feed, fired)
            call.clock = self.host.reactor
            call.start(command.delay, now=False)
        else:
            call = self.host.reactor.callLater(command.delay, self.feed, fired)
        self.timers[command.timer] = call

    def _cancel_timer(self, command: CancelTimer) -> None:
        call = self.timers.pop(command.timer, None)
        if isinstance(call, task.LoopingCall):
            if call.running:
                call.stop()
        elif call is not None and call.active():
            call.cancel()

    def _record(self, command: Record) -> None:
        self.ended = True
        self._stop_detached()
        record = command.record
        self.stats.record_response(record, self.host.metrics_tenant(self.request))
        if record.continuation_failed is not None:
            log.warn("expand continuation failed ({why}): the client gets the rounds so far",
                     why=record.continuation_failed)
        lifetime = self.cache[1] if self.cache is not None else self.warm[1] if self.warm is not None else None
        report, tenant = command.report, self.tenant
        if report is None:  # the client left before its preparation finished: a row all the same, as
            # /stats counted the request (what is known: its tenant; no rewrite, nothing billed)
            report, tenant = prepare.Report(0), self.host.tenant_of(self.request.requestHeaders)
        self.host.recorded(record, report, Sent(self.arrived, tenant, self.model, self._user_agent(), lifetime))
        self._answered(record.status)
        self.host.ended(self)
        self.originals = {}  # as the exchange keeps no body (Exchange._end): the cycles it is in free late
        compacted = record.compacted
        log.info(
            "{method} {path} {status} {outcome} upstream_ms={upstream_ms} ttfb_ms={ttfb_ms} "
            "in={bytes_in} out={bytes_out} tokens={tokens} markers={markers} expand_rounds={rounds}",
            method=record.method,
            path=record.target,
            status=record.status or "-",
            outcome=record.outcome,
            upstream_ms=_ms(record.t_sent, record.t_headers),
            ttfb_ms=_ms(record.t_received, record.t_client_first),
            bytes_in=record.bytes_in,
            bytes_out=record.bytes_out,
            tokens="-" if compacted is None else f"{compacted.tokens_before}->{compacted.tokens_after}",
            markers=0 if compacted is None else compacted.markers,
            rounds=record.expand_rounds,
        )

    def _answered(self, status: int | None) -> None:
        """Tell the keep-alive how round 0 was answered (what the client got), so it arms or ends."""
        if self.warm is not None and self.warm_generation is not None:
            generation, self.warm_generation = self.warm_generation, None
            assert self.host.keepalive is not None
            self.host.keepalive.answered(self.warm[0], generation, status)

    def _stop_detached(self) -> None:
        """Bodies of earlier rounds still open (a gateway may keep one open past its end): stop them."""
        for relay in list(self.detached):
            relay.stop()
        self.detached.clear()

    def _closed_by_a_bug(self) -> None:
        """The exchange ended, but a bug lost the commands that close it: close everything here.

        The client's connection is aborted (what it got, if anything, cannot look complete), the
        upstream stopped, the timers cancelled, and the request leaves the in-flight set, so a
        graceful stop does not wait for it.
        """
        if self.ended:
            return
        self.ended = True
        for timer in list(self.timers):
            self._cancel_timer(CancelTimer(timer))
        self._stop_upstream(_STOP)
        self._stop_detached()
        self._answered(None)
        transport = typing.cast(_Connection | None, self.request.channel.transport)
        if transport is not None and not transport.disconnected:
            transport.abortConnection()
        self.host.ended(self)
        self.originals = {}


_DO: dict[type, Callable[[ExchangeDriver, typing.Any], None]] = {
    prepare.ReadFrozen: ExchangeDriver._ask_store,
    prepare.ReadOriginal: ExchangeDriver._ask_store,
    prepare.Freeze: ExchangeDriver._ask_store,
    prepare.RecordCache: ExchangeDriver._ask_store,
    prepare.PutOriginals: ExchangeDriver._ask_store,
    prepare.Touch: ExchangeDriver._touch,
    Ready: ExchangeDriver._ready,
    SetHead: ExchangeDriver._set_head,
    Write: ExchangeDriver._write,
    Finish: ExchangeDriver._finish,
    Abort: ExchangeDriver._abort,
    Send: ExchangeDriver._send,
    ReadBody: ExchangeDriver._read_body,
    DiscardBody: ExchangeDriver._discard_body,
    DetachBody: ExchangeDriver._detach_body,
    StopUpstream: ExchangeDriver._stop_upstream,
    Resolve: ExchangeDriver._resolve,
    KeepHidden: ExchangeDriver._keep_hidden,
    StartTimer: ExchangeDriver._start_timer,
    CancelTimer: ExchangeDriver._cancel_timer,
    Record: ExchangeDriver._record,
}


def _header_getter(headers: Headers) -> Callable[[str], str | None]:
    def get(name: str) -> str | None:
        values = headers.getRawHeaders(name.encode("latin-1"))
        return values[0].decode("latin-1") if values else None

    return get


class _Connection(typing.Protocol):
    """What cg does with a client's connection when it must cut it (twisted's TCP and TLS transports)."""

    disconnected: bool

    def abortConnection(self) -> None: ...


def _abort_if_open(transport: _Connection) -> None:
    if not transport.disconnected:
        transport.abortConnection()


def _is_stream(response: Response) -> bool:
    return response.headers.getRawHeaders(b"content-type", [b""])[0].startswith(b"text/event-stream")


def _ms(start: float | None, end: float | None) -> str:
    return "-" if start is None or end is None else f"{(end - start) * 1000:.1f}"


class _Relay(Protocol):
    """Feeds an upstream body to the exchange, decoded, chunk by chunk as it arrives.

    The body attaches to the exchange's `ClientFlow`, the client response's producer,
    so a client that stops reading pauses the upstream read.
    """

    def __init__(self, driver: ExchangeDriver, decoder: zlib._Decompress | None):
        self.driver = driver
        self.decoder = decoder

    def stop(self) -> None:
        """Stop reading this body (its transport is the upstream response's producer)."""
        typing.cast(IPushProducer, self.transport).stopProducing()

    def connectionMade(self) -> None:
        driver = self.driver
        if driver.ended:
            self.stop()
            return
        driver.relay = self
        if driver.flow is None:
            driver.flow = ClientFlow()
            driver.request.registerProducer(driver.flow, True)
        driver.flow.attach(typing.cast(IPushProducer, self.transport))

    def dataReceived(self, data: bytes) -> None:
        driver = self.driver
        driver.stats.bytes_from_upstream += len(data)
        if driver.ended or driver.relay is not self:
            return
        if self.decoder is not None:
            try:
                data = self.decoder.decompress(data)
            except zlib.error:
                self.stop()  # ends this body as failed: the client's is cut
                return
        driver.feed(Chunk(data))

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        driver = self.driver
        driver.detached.discard(self)
        if driver.relay is not self:
            return  # the exchange ended, or moved on to another round
        driver.relay = None
        assert driver.flow is not None
        driver.flow.detach()
        if driver.ended:
            return
        complete = bool(reason.check(ResponseDone, PotentialDataLoss))
        if self.decoder is not None:
            complete = complete and self.decoder.eof
        driver.feed(BodyEnd(complete))


@implementer(IPushProducer)
class ClientFlow:
    """The client response's producer for an exchange's whole life; upstream bodies come and go.

    The client's channel pauses and resumes whichever producer is registered. A
    round's body unregistered while paused would never be resumed (so never drain),
    and an expand round's body registered while the client is paused would read on
    until cg's next write to the client. Registered once, this keeps the client's
    state and hands it to each body.
    """

    def __init__(self) -> None:
        self.paused = False
        self._body: IPushProducer | None = None  # the upstream body's producer now feeding the client

    def attach(self, body: IPushProducer) -> None:
        self._body = body
        if self.paused:
            body.pauseProducing()

    def detach(self) -> None:
        """The body feeds the client no more: it must not stay paused on the client's account."""
        body, self._body = self._body, None
        if body is not None and self.paused:
            body.resumeProducing()

    def pauseProducing(self) -> None:
        self.paused = True
        if self._body is not None:
            self._body.pauseProducing()

    def resumeProducing(self) -> None:
        self.paused = False
        if self._body is not None:
            self._body.resumeProducing()

    def stopProducing(self) -> None:
        if self._body is not None:
            self._body.stopProducing()


class _Discard(Protocol):
    """Reads and drops a body cg will not use, so its connection goes back to the pool."""
