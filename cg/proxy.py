"""The proxy resource: route a request, forward it, relay the response as it arrives.

One `_Exchange` per client request. Bytes flow through untouched; the upstream
socket is the registered producer of the client response, so a client that
stops reading pauses the upstream read, and a client that leaves cancels the
upstream request.
"""

import itertools
import time
import zlib
from urllib.parse import unquote

import ujson
from twisted.internet import defer
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.web import resource, server
from twisted.web.client import ResponseDone
from twisted.web.http import PotentialDataLoss

from cg import dialect, headers
from cg.changelog import NullChangeLog, compaction_record, usage_record
from cg.markers import parse_marker_ref
from cg.upstream import is_timeout
from cg.usage import ResponseUsage, session_key

log = Logger(namespace="cg.proxy")


class ProxyResource(resource.Resource):
    """Answers cg's own endpoints and forwards everything else to the provider."""

    isLeaf = True

    def __init__(
        self,
        upstream,
        stats,
        upstreams: dict[str, bytes],
        *,
        rewriter=None,
        store=None,
        tenant_of=None,
        observe: bool = False,
        changelog=None,
        clock=time.perf_counter,
    ):
        super().__init__()
        self.upstream = upstream
        self.stats = stats
        self.upstreams = upstreams
        self.rewriter = rewriter
        self.store = store
        self.tenant_of = tenant_of
        self.observe = observe
        self.changelog = changelog if changelog is not None else NullChangeLog()
        self.clock = clock
        # Request numbers for the change log, unique across restarts of this process.
        self._seq = itertools.count(int(time.time()) * 1_000_000)
        self._in_flight: set = set()
        self._drain_waiters: list[defer.Deferred] = []

    def render(self, request):
        request.responseHeaders.removeHeader(b"server")  # cg adds no headers of its own
        path = dialect.split_path(request.uri)
        if path == b"/" and request.method == b"HEAD":
            return b""  # Claude Code warms its connection with HEAD /
        if path == b"/healthz" and request.method in (b"GET", b"HEAD"):
            request.setHeader(b"content-type", b"text/plain")
            return b"ok\n"
        if path == b"/stats" and request.method == b"GET":
            request.setHeader(b"content-type", b"application/json")
            return ujson.dumps(self.stats.snapshot(), indent=2).encode() + b"\n"
        if path.startswith(b"/cg/expand/") and request.method == b"GET":
            return self._show_original(request, path[len(b"/cg/expand/") :].decode("latin-1"))
        which = dialect.route(request.uri, request.requestHeaders.hasHeader(b"anthropic-version"))
        if which is None:
            return _error(request, None, 404, "cg does not proxy this path")
        if request.too_large:
            self.stats.too_large += 1
            self.stats.statuses[413] += 1
            return _error(request, which, 413, "request body is larger than cg's --max-body")
        _Exchange(self, request, which).start()
        return server.NOT_DONE_YET

    def _show_original(self, request, ref: str):
        """GET /cg/expand/ID: an original, to whoever may read it under --tenant (else 404)."""
        ident = parse_marker_ref(unquote(ref))
        if ident is None or self.store is None:
            return _error(request, None, 404, "no such original")
        tenant = self.tenant_of(request.requestHeaders)

        def found(original):
            if original is None:
                request.write(_error(request, None, 404, "no such original (unknown, evicted, or another tenant's)"))
            else:
                request.setHeader(b"content-type", b"text/plain; charset=utf-8")
                request.setHeader(b"content-length", b"%d" % len(original))
                request.write(original)
            request.finish()

        self.store.get(tenant, ident).addCallback(found).addErrback(
            lambda failure: log.failure("reading an original failed", failure)
        )
        return server.NOT_DONE_YET

    def prepare(self, exchange, body: bytes) -> defer.Deferred:
        """The body to forward: rewritten, with every new original stored first.

        Fails open: a body cg cannot parse goes as it came, and when the store
        cannot keep an original the request goes without lossy compaction.
        """
        request = exchange.request
        exchange.seq = next(self._seq)
        if request.requestHeaders.getRawHeaders(b"x-cg-bypass") == [b"1"]:
            self.stats.bypassed += 1
            return defer.succeed(body)
        rewrite = self.rewriter.rewrite(body, request.uri) if self.rewriter else None
        exchange.session = session_key(_header_getter(request), rewrite.parsed if rewrite else None)
        if rewrite is None:
            return defer.succeed(body)
        if self.observe or not rewrite.originals:
            return defer.succeed(self._chosen(exchange, body, rewrite))
        tenant = self.tenant_of(request.requestHeaders)
        known = self.store.known(tenant, rewrite.originals)
        if known:
            self.store.touch(tenant, known)
        new = {i: original for i, original in rewrite.originals.items() if i not in known}
        if not new:
            return defer.succeed(self._chosen(exchange, body, rewrite))

        def unstored(failure):
            self.stats.compaction.store_fail_open += 1
            log.warn("store failed ({why}): forwarding without lossy compaction", why=failure.getErrorMessage())
            return self._chosen(exchange, body, self.rewriter.rewrite(body, request.uri, lossy=False))

        stored = self.store.put(tenant, new)
        return stored.addCallbacks(lambda _: self._chosen(exchange, body, rewrite), unstored)

    def _chosen(self, exchange, body: bytes, rewrite) -> bytes:
        self.stats.compaction.record(rewrite)
        now = time.time()
        for change in rewrite.changes:
            self.changelog.write(
                compaction_record(
                    time=now, session=exchange.session, seq=exchange.seq,
                    message=change.message_index, block=change.block_index, tool=change.tool_name,
                    component=change.component, lossy=change.lossy, marker=change.marker_id,
                    tokens_before=change.tokens_before, tokens_after=change.tokens_after,
                    content_hash=change.content_id,
                )
            )
        return body if self.observe else rewrite.body

    def billed(self, exchange, usage) -> None:
        """A response's billed usage: into /stats and the change log."""
        self.stats.usage.add(usage, exchange.session)
        self.changelog.write(
            usage_record(
                time=time.time(), session=exchange.session, seq=exchange.seq, dialect=exchange.which,
                path=dialect.split_path(exchange.request.uri).decode("latin-1"),
                input_tokens=usage.input_tokens, cache_read_tokens=usage.cache_read_tokens,
                cache_write_tokens=usage.cache_write_tokens, output_tokens=usage.output_tokens,
            )
        )

    def started(self, exchange):
        self._in_flight.add(exchange)
        self.stats.in_flight = len(self._in_flight)

    def ended(self, exchange):
        self._in_flight.discard(exchange)
        self.stats.in_flight = len(self._in_flight)
        if not self._in_flight:
            waiters, self._drain_waiters = self._drain_waiters, []
            for d in waiters:
                d.callback(None)

    def drained(self) -> defer.Deferred:
        """Fires once no request is in flight (for a graceful stop)."""
        if not self._in_flight:
            return defer.succeed(None)
        d = defer.Deferred()
        self._drain_waiters.append(d)
        return d

    def abort_all(self):
        """Cut every exchange still in flight (the drain timeout ran out)."""
        for exchange in list(self._in_flight):
            exchange.abort_client()


def _header_getter(request):
    def get(name: str) -> str | None:
        values = request.requestHeaders.getRawHeaders(name.encode("latin-1"))
        return values[0].decode("latin-1") if values else None

    return get


def _error(request, which, status: int, message: str) -> bytes:
    body = dialect.error_body(which, status, message)
    request.setResponseCode(status)
    request.setHeader(b"content-type", b"application/json")
    request.setHeader(b"content-length", b"%d" % len(body))
    return body


class _Exchange:
    """One client request and its upstream counterpart."""

    def __init__(self, proxy: ProxyResource, request, which: str):
        self.proxy = proxy
        self.request = request
        self.which = which
        self.stats = proxy.stats
        self.clock = proxy.clock
        self.pending = None  # the upstream request, until its headers arrive
        self.relay = None  # the upstream body, once it flows
        self.status = None
        self.outcome = "ok"
        self.ended = False
        self.t_received = self.clock()
        self.t_sent = self.t_headers = self.t_upstream_first = self.t_client_first = None
        self.bytes_in = self.bytes_out = 0
        self.session = "-"
        self.seq = 0
        self.meter = None  # reads billed usage off the response

    def start(self):
        request = self.request
        self.proxy.started(self)
        self.stats.requests[self.which] += 1
        body = request.content.getvalue()
        self.bytes_in = len(body)
        self.stats.bytes_from_client += len(body)
        self.decode = dialect.reads_response(request.uri)
        upstream_headers = headers.request_headers(
            request.requestHeaders, accept_encoding=b"gzip" if self.decode else None
        )
        request.notifyFinish().addErrback(self._client_gone)
        prepared = self.proxy.prepare(self, body)
        prepared.addCallback(self._forward, upstream_headers)
        prepared.addErrback(self._bug)

    def _forward(self, body: bytes, upstream_headers):
        if self.ended:  # the client left while cg was storing originals
            return
        request = self.request
        if not body and request.method in (b"GET", b"HEAD", b"DELETE", b"OPTIONS"):
            body = None
        url = self.proxy.upstreams[self.which] + request.uri
        self.t_sent = self.clock()
        self.pending = self.proxy.upstream.request(request.method, url, upstream_headers, body)
        self.stats.bytes_to_upstream += len(body or b"")
        self.pending.addCallbacks(self._respond, self._upstream_failed)
        self.pending.addErrback(self._bug)

    def _respond(self, response):
        self.pending = None
        self.t_headers = self.clock()
        self.stats.upstream_ttfb.add(self.t_headers - self.t_sent)
        decoder = None
        drop = frozenset()
        if self.decode and response.headers.getRawHeaders(b"content-encoding") == [b"gzip"]:
            decoder = zlib.decompressobj(wbits=31)
            drop = frozenset({b"content-encoding"})
        self.status = response.code
        request = self.request
        request.setResponseCode(response.code, response.phrase)
        request.responseHeaders = headers.response_headers(response.headers, drop)
        content_type = response.headers.getRawHeaders(b"content-type", [b""])[0]
        streaming = content_type.startswith(b"text/event-stream")
        if streaming:
            self.stats.streamed += 1
        if self.decode and 200 <= response.code < 300:
            self.meter = ResponseUsage(self.which, streaming)
        response.deliverBody(_Relay(self, decoder))

    def _upstream_failed(self, failure):
        self.pending = None
        if self.ended:
            return
        self.stats.upstream_errors += 1
        status = 504 if is_timeout(failure) else 502
        reason = failure.getErrorMessage() or failure.type.__name__
        what = "timed out waiting for" if status == 504 else "could not get a response from"
        self.outcome = "upstream_error"
        body = _error(self.request, self.which, status, f"cg {what} the upstream: {reason}")
        self.status = status
        self.write(body)
        self.request.finish()
        self._end()

    def _bug(self, failure):
        log.failure("proxying {path} failed", failure, path=self.request.uri)
        self.abort_client()

    def write(self, data: bytes):
        if self.t_client_first is None:
            self.t_client_first = self.clock()
            before = self.t_sent - self.t_received
            after = self.t_client_first - (self.t_upstream_first or self.t_client_first)
            self.stats.added_ttfb.add(before + after)
        self.bytes_out += len(data)
        self.stats.bytes_to_client += len(data)
        self.request.write(data)

    def upstream_data(self, size: int):
        if self.t_upstream_first is None:
            self.t_upstream_first = self.clock()
        self.stats.bytes_from_upstream += size

    def upstream_ended(self, complete: bool):
        """The upstream body ended; a client response must never look complete if it was cut."""
        if self.ended:
            return
        self.request.unregisterProducer()
        if not complete:
            self.stats.upstream_errors += 1
            self.abort_client("upstream_broke")
            return
        if self.t_client_first is None:
            self.write(b"")
        self.request.finish()
        self._end()

    def abort_client(self, outcome: str = "aborted"):
        """Cut the client's connection, so a truncated response cannot look complete."""
        if self.ended:
            return
        self.ended = True
        self.outcome = outcome
        self._stop_upstream()
        self.request.channel.transport.abortConnection()
        self._end()

    def _client_gone(self, failure):
        if self.ended:
            return
        self.ended = True
        self.stats.client_disconnects += 1
        self.outcome = "client_gone"
        self._stop_upstream()
        self._end()

    def _stop_upstream(self):
        if self.pending is not None:
            self.pending.cancel()
        elif self.relay is not None:
            self.relay.transport.stopProducing()

    def _end(self):
        self.ended = True
        usage = self.meter.usage() if self.meter is not None else None
        if usage is not None:
            self.proxy.billed(self, usage)
        self.stats.statuses[self.status or 499] += 1
        self.proxy.ended(self)
        ms = _ms
        log.info(
            "{method} {path} {status} {outcome} upstream_ms={upstream_ms} ttfb_ms={ttfb_ms} "
            "in={bytes_in} out={bytes_out}",
            method=self.request.method.decode("latin-1"),
            path=self.request.uri.decode("latin-1"),
            status=self.status or "-",
            outcome=self.outcome,
            upstream_ms=ms(self.t_sent, self.t_headers),
            ttfb_ms=ms(self.t_received, self.t_client_first),
            bytes_in=self.bytes_in,
            bytes_out=self.bytes_out,
        )


def _ms(start, end):
    return "-" if start is None or end is None else f"{(end - start) * 1000:.1f}"


class _Relay(Protocol):
    """Hands each upstream body chunk to the client as it arrives."""

    def __init__(self, exchange: _Exchange, decoder):
        self.exchange = exchange
        self.decoder = decoder

    def connectionMade(self):
        exchange = self.exchange
        if exchange.ended:
            self.transport.stopProducing()
            return
        exchange.relay = self
        exchange.request.registerProducer(self.transport, True)

    def dataReceived(self, data):
        exchange = self.exchange
        exchange.upstream_data(len(data))
        if exchange.ended:
            return
        if self.decoder is not None:
            try:
                data = self.decoder.decompress(data)
            except zlib.error:
                self.decoder = None
                self.transport.stopProducing()
                return
        if data:
            if exchange.meter is not None:
                exchange.meter.feed(data)
            exchange.write(data)

    def connectionLost(self, reason=None):
        complete = bool(reason.check(ResponseDone, PotentialDataLoss))
        if self.decoder is not None:
            complete = complete and self.decoder.eof
        self.exchange.upstream_ended(complete)
