"""The proxy resource: route a request, rewrite it, forward it, relay the response as it arrives.

One `_Exchange` per client request. The request body is rewritten by `cg.compaction.rewrite`
(with new originals stored first); the response is passed through, inspected, or
answered by the expand loop (see `_Exchange`). The upstream socket is the
registered producer of the client response, so a client that stops reading
pauses the upstream read, and a client that leaves cancels the upstream request.
"""

import itertools
import time
import zlib
from urllib.parse import unquote

import attrs
import ujson
from twisted.internet import defer, task
from twisted.internet.interfaces import IPushProducer
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web import resource, server
from twisted.web.client import ResponseDone
from twisted.web.http import PotentialDataLoss
from zope.interface import implementer

from cg.compaction.pipeline import result_sizes
from cg.compaction.repair import repair_answer
from cg.record.changelog import NullChangeLog, compaction_record, usage_record
from cg.stream.continuation import (
    answers,
    billed,
    continuation_body,
    lone_expand_calls,
    merge,
    refs_to_resolve,
    resolve,
)
from cg.stream.inspector import ABORT, DONE, EXPAND, PING, Inspector
from cg.stream.usage import ResponseUsage, session_key
from cg.web import headers, http1
from cg.web.upstream import is_timeout
from cg.wire import dialect
from cg.wire.markers import parse_marker_ref
from cg.wire.sse import SSEParser

log = Logger(namespace="cg.web.proxy")


class ProxyResource(resource.Resource):
    """Answers cg's own endpoints and forwards everything else to the provider."""

    isLeaf = True

    def __init__(
        self,
        upstream,
        stats,
        upstreams: dict[str, tuple[bytes, bytes]],  # dialect -> (origin, base path): `split_base`
        *,
        rewriter=None,
        store=None,
        tenant_of=None,
        observe: bool = False,
        changelog=None,
        max_expand_rounds: int = 3,
        max_held: int = 16 << 20,
        continuation_timeout: float = 600.0,
        clock=time.perf_counter,
        reactor=None,
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
        self.max_expand_rounds = max_expand_rounds
        self.max_held = max_held
        self.continuation_timeout = continuation_timeout
        if reactor is None:
            from twisted.internet import reactor
        self.reactor = reactor
        self.clock = clock
        # Request numbers for the change log, unique across restarts of this process.
        self._seq = itertools.count(int(time.time()) * 1_000_000)
        self._in_flight: set = set()
        self._drain_waiters: list[defer.Deferred] = []

    def render(self, request):
        request.responseHeaders.removeHeader(b"server")  # cg adds no headers of its own
        problem = http1.target_problem(request.uri)
        if problem is not None:
            message = f"cg does not forward this request-target: {problem}"
            return _error(request, dialect.spoken_by(request.requestHeaders), 400, message)
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
            message = dialect.not_proxied(path, _url_of_cg(request))
            return _error(request, dialect.spoken_by(request.requestHeaders), 404, message)
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

        gone = []
        request.notifyFinish().addErrback(gone.append)

        def found(original):
            if gone:
                return
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
        """The body to forward: repaired, compacted and injected, with new originals stored first.

        Fails open: a body cg cannot parse goes as it came (as does any body when
        the rewrite raises: `_Exchange._unprepared`), and when the store cannot
        keep a new original, that original goes unreplaced.
        """
        request = exchange.request
        exchange.seq = next(self._seq)
        if request.requestHeaders.getRawHeaders(b"x-cg-bypass") == [b"1"]:
            self.stats.bypassed += 1
            return defer.succeed(body)
        conversation = (request.requestHeaders.getRawHeaders(b"x-claude-code-session-id") or [b""])[0]
        incoming = self.rewriter.parse(body, request.uri, conversation.decode("latin-1")) if self.rewriter else None
        exchange.session = session_key(_header_getter(request), incoming.body.value if incoming else None)
        if incoming is None:
            return defer.succeed(body)
        exchange.tenant = self.tenant_of(request.requestHeaders)
        texts = self._repair_texts(incoming, exchange.tenant) if incoming.repairs else defer.succeed({})
        return texts.addCallback(lambda texts: self._finish(exchange, body, incoming, texts))

    def _repair_texts(self, incoming, tenant: str) -> defer.Deferred:
        """The answer for each expand call the client answered with an error, frozen per tool_use_id.

        The first repair of a call stores its text; every later turn replays exactly those bytes,
        even after the original was evicted, so a repair never changes what the provider cached.
        The original comes from this very body when it still holds it, else from the store. A
        store that cannot say whether a text is frozen leaves that answer as the client sent it.
        """
        in_body = self.rewriter.originals(incoming)

        def one(repair):
            def answered(original):
                text = repair_answer(repair, original).text
                if not incoming.stash:  # count_tokens reads, never writes
                    return text
                return self.store.freeze(tenant, repair.tool_use_id, text.encode("utf-8")).addCallbacks(
                    lambda frozen: frozen.decode("utf-8"), lambda failure: None
                )

            def lookup(frozen):
                if frozen is _UNKNOWABLE:
                    return None
                if frozen is not None:
                    return frozen.decode("utf-8")
                if repair.ref in in_body:
                    return answered(in_body[repair.ref])
                original = self.store.get(tenant, repair.ref) if repair.ref else defer.succeed(None)
                return original.addCallback(answered)

            frozen = self.store.frozen(tenant, repair.tool_use_id).addErrback(lambda failure: _UNKNOWABLE)
            return frozen.addCallback(lookup).addCallback(lambda text: (repair.tool_use_id, text))

        pairs = defer.gatherResults([one(r) for r in incoming.repairs], consumeErrors=True)
        return pairs.addCallback(lambda pairs: {key: text for key, text in pairs if text is not None})

    def _finish(self, exchange, body: bytes, incoming, texts: dict) -> defer.Deferred | bytes:
        rewrite = self.rewriter.finish(incoming, texts)
        if self.observe or not rewrite.originals:
            return self._chosen(exchange, body, rewrite)
        return self._vouched(exchange, body, incoming, texts, rewrite, again=True)

    def _vouched(self, exchange, body: bytes, incoming, texts: dict, rewrite, again: bool) -> defer.Deferred | bytes:
        """Markers only for originals the store vouches for: it first stores those it does not know.

        A store that forgot some while storing the others (it broke and came back, or another
        process wrote) is given them once more. A store that cannot keep them vouches for what
        it still knows (nothing, once it is unhealthy): the rest go whole, and reformat still
        runs. The exchange keeps the originals behind the markers it sends, for expand calls.
        """
        tenant = exchange.tenant
        known = self.store.known(tenant, rewrite.originals)
        if known:
            self.store.touch(tenant, known)
        new = {i: original for i, original in rewrite.originals.items() if i not in known}

        def chosen(rewrite):
            exchange.originals = rewrite.originals
            return self._chosen(exchange, body, rewrite)

        if not new:
            return chosen(rewrite)

        def stored(_):
            if again and len(self.store.known(tenant, rewrite.originals)) < len(rewrite.originals):
                return self._vouched(exchange, body, incoming, texts, rewrite, again=False)
            return chosen(rewrite)

        def unstored(failure):
            # Offloads sent on earlier turns stay while the store still vouches for them, so the
            # bytes the provider has cached do not change. The store logs the failure, once.
            self.stats.compaction.store_fail_open += 1
            vouched = self.store.known(tenant, known)
            return chosen(self.rewriter.finish(incoming, texts, lossy=frozenset(vouched)))

        return self.store.put(tenant, new).addCallbacks(stored, unstored)

    def _chosen(self, exchange, body: bytes, rewrite) -> bytes:
        self.stats.compaction.record(rewrite, len(body))
        self.stats.expand.repairs += rewrite.repaired
        if not self.observe:
            # Kept for the response's life: what it decides by, not the originals (stored) or the parse.
            exchange.rewrite = attrs.evolve(rewrite, originals={}, parsed={})
        now = time.time()
        for change in rewrite.changes:
            self.changelog.write(
                compaction_record(
                    time=now, session=exchange.session, seq=exchange.seq,
                    message=change.message_index, block=change.block_index, tool=change.tool_name,
                    component=change.component, lossy=change.lossy, marker=change.marker_id,
                    tokens_before=change.tokens_before, tokens_after=change.tokens_after,
                    content_hash=change.content_id, part=change.part_index, step=change.step,
                )
            )
        return body if self.observe else rewrite.body

    def billed(self, exchange, usage, expand_rounds: int = 0) -> None:
        """A response's billed usage (every round of it): into /stats and the change log."""
        self.stats.usage.add(usage, exchange.session)
        self.changelog.write(
            usage_record(
                time=time.time(), session=exchange.session, seq=exchange.seq, dialect=exchange.which,
                path=dialect.split_path(exchange.request.uri).decode("latin-1"),
                input_tokens=usage.input_tokens, cache_read_tokens=usage.cache_read_tokens,
                cache_write_tokens=usage.cache_write_tokens, output_tokens=usage.output_tokens,
                expand_rounds=expand_rounds,
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


def _url_of_cg(request) -> str:
    """The base URL this client reached cg at, as its Host header says."""
    host = (request.getHeader(b"host") or b"HOST:PORT").decode("latin-1")
    return f"{'https' if request.isSecure() else 'http'}://{host}"


def _error(request, which, status: int, message: str) -> bytes:
    body = dialect.error_body(which, status, message)
    request.setResponseCode(status)
    request.setHeader(b"content-type", b"application/json")
    request.setHeader(b"content-length", b"%d" % len(body))
    return body


class _Exchange:
    """One client request and its upstream counterpart(s).

    The response takes one of three paths, chosen when its headers arrive:
    pass-through (`_PassThrough`), the incremental inspector for an Anthropic stream
    where cg injected the expand tool (`_Inspected`), or the expand loop for a JSON
    response there (`_Collected`). Every path ends in `_end`, exactly once.
    """

    def __init__(self, proxy: ProxyResource, request, which: str):
        self.proxy = proxy
        self.request = request
        request.proxied = True  # its line is written by _end, not by the site
        self.which = which
        self.stats = proxy.stats
        self.clock = proxy.clock
        self.pending = None  # an upstream request, until its headers arrive
        self.relay = None  # an upstream body, while it flows
        self.flow = None  # the client response's producer, once a body flows
        self.status = None
        self.outcome = "ok"
        self.ended = False
        self.t_received = self.clock()
        self.t_sent = self.t_headers = self.t_upstream_first = self.t_client_first = None
        self.bytes_in = self.bytes_out = 0
        self.session = "-"
        self.seq = 0
        self.tenant = ""
        self.rewrite = None  # what cg did to the request body, when it did anything
        self.originals = {}  # marker ID -> original, for the markers in the body cg forwarded
        self.forwarded = None  # the body sent upstream last (a continuation extends it)
        self.meter = None  # reads billed usage off a passed-through response
        self.inspector = None
        self.rounds: list[dict] = []  # the JSON responses of the expand loop
        self._first_body = None
        self.pinger = None
        self.stalled = None  # the deadline for a continuation to commit
        self.streaming = False
        self.decode = dialect.reads_response(request.uri)

    def start(self):
        request = self.request
        self.proxy.started(self)
        self.stats.requests[self.which] += 1
        body = request.content.getvalue()
        self.bytes_in = len(body)
        self.stats.bytes_from_client += len(body)
        self.upstream_headers = headers.request_headers(
            request.requestHeaders, accept_encoding=b"gzip" if self.decode else None
        )
        request.notifyFinish().addErrback(self._client_gone)
        prepared = defer.maybeDeferred(self.proxy.prepare, self, body)
        prepared.addErrback(self._unprepared, body)
        prepared.addCallback(self._forward)
        prepared.addErrback(self._bug)

    def _unprepared(self, failure, body: bytes) -> bytes:
        """A bug on the request side costs its saving, never the request: forward what came."""
        log.failure("rewriting {path} failed; forwarding it as received", failure, path=self.request.uri)
        self.rewrite = None
        return body

    def _forward(self, body: bytes):
        if self.ended:  # the client left while cg was storing originals
            return
        request = self.request
        if not body and request.method in (b"GET", b"HEAD", b"DELETE", b"OPTIONS"):
            body = None
        self.t_sent = self.clock()
        self.forwarded = body
        self._send(body, self._respond, self._upstream_failed)

    def _send(self, body, on_response, on_failure):
        origin, base_path = self.proxy.upstreams[self.which]
        self.pending = self.proxy.upstream.request(
            self.request.method, origin, base_path + self.request.uri, self.upstream_headers, body
        )
        self.stats.bytes_to_upstream += len(body or b"")

        def responded(response):
            self.pending = None
            try:
                return on_response(response)
            except Exception:
                response.stopProducing()  # nobody will read this body: drop its connection
                raise

        def failed(failure):
            self.pending = None
            if not self.ended:
                return on_failure(failure)

        self.pending.addCallbacks(responded, failed).addErrback(self._bug)

    def _respond(self, response):
        self.t_headers = self.clock()
        self.stats.upstream_ttfb.add(self.t_headers - self.t_sent)
        decoder, drop = self._decoder(response)
        relay_decoder = None if decoder is _UNDECODABLE else decoder  # passed through, encoded
        self.status = response.code
        request = self.request
        request.setResponseCode(response.code, response.phrase)
        request.responseHeaders = headers.response_headers(response.headers, drop)
        streaming = self.streaming = _is_stream(response)
        if streaming:
            self.stats.streamed += 1
        expanding = self.rewrite is not None and self.rewrite.injected and self.rewrite.stash
        if expanding and 200 <= response.code < 300 and decoder is not _UNDECODABLE:
            if streaming and self.rewrite.dialect == dialect.ANTHROPIC:
                self.inspector = Inspector(max_held=self.proxy.max_held, max_rounds=self.proxy.max_expand_rounds)
                sink = _Inspected(self)
            elif not streaming:
                sink = _Collected(self._json_round)
            else:
                sink = _PassThrough(self)
        else:
            sink = _PassThrough(self)
        if isinstance(sink, _PassThrough) and self.decode and 200 <= response.code < 300 and relay_decoder is decoder:
            self.meter = ResponseUsage(self.which, streaming)
        response.deliverBody(_Relay(self, relay_decoder, sink))

    def _decoder(self, response):
        """A gzip decoder for a body cg reads; _UNDECODABLE for an encoding it asked not to get."""
        if not self.decode:
            return None, frozenset()
        encodings = [e.strip().lower() for v in response.headers.getRawHeaders(b"content-encoding", ())
                     for e in v.split(b",") if e.strip()]
        if not encodings or encodings == [b"identity"]:
            return None, frozenset()
        if encodings == [b"gzip"]:
            return zlib.decompressobj(wbits=31), frozenset({b"content-encoding"})
        return _UNDECODABLE, frozenset()

    def _upstream_failed(self, failure):
        self.stats.upstream_errors += 1
        status = 504 if is_timeout(failure) else 502
        reason = failure.getErrorMessage() or failure.type.__name__
        what = "timed out waiting for" if status == 504 else "could not get a response from"
        self.outcome = "upstream_error"
        body = _error(self.request, self.which, status, f"cg {what} the upstream: {reason}")
        self.status = status
        self.write(body)
        self.finish()

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

    def finish(self):
        """The client's response is complete (an upstream body still flowing is dropped)."""
        if self.ended:
            return
        if self.relay is not None:
            relay, self.relay = self.relay, None
            self.flow.detach()
            relay.transport.stopProducing()
        if self.flow is not None:
            self.request.unregisterProducer()  # before finish(): after a disconnect it raises
            self.flow = None
        if self.t_client_first is None:
            self.write(b"")
        self.request.finish()
        self._end()

    def upstream_broke(self):
        """A response cut short upstream must never look complete to the client."""
        self.stats.upstream_errors += 1
        self.abort_client("upstream_broke")

    def abort_client(self, outcome: str = "aborted"):
        """Cut the client's connection, so a truncated response cannot look complete.

        A chunked response is closed once what cg already wrote is flushed: without its
        last chunk it cannot look complete, and the client gets every byte upstream sent.
        Any other framing ends by close, so there the connection is aborted outright.
        """
        if self.ended:
            return
        self.ended = True
        self.outcome = outcome
        self._stop_upstream()
        channel = self.request.channel
        transport = channel.transport
        if self.request.clientproto == b"HTTP/1.1" and not self.request.responseHeaders.hasHeader(b"content-length"):
            # Through the channel: it unregisters itself from the transport first, else a
            # drained buffer resumes the channel instead of closing (until FLUSH_TIMEOUT).
            channel.loseConnection()
            # A client that stopped reading would keep the flush waiting: cut it after a while.
            self.proxy.reactor.callLater(FLUSH_TIMEOUT, _abort_if_open, transport)
        else:
            transport.abortConnection()
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
        self._stop_pinging()
        if self.pending is not None:
            self.pending.cancel()
        elif self.relay is not None:
            self.relay.transport.stopProducing()

    # The expand loop, shared by both paths: resolve the calls, send the continuation.

    def _continue(self, calls, assistant: dict, stream: bool, on_response, on_failure):
        self.stats.expand.bounces += 1

        def send(resolutions):
            if self.ended:
                return
            body = continuation_body(self.forwarded, assistant, calls, resolutions, self.rewrite.dialect,
                                     stream=True if stream else None)
            self.forwarded = body
            self._send(body, on_response, on_failure)

        self._resolve(calls).addCallback(send).addErrback(self._continue_failed, on_failure)

    def _continue_failed(self, failure, on_failure):
        log.failure("building the expand continuation failed", failure)
        if not self.ended:
            on_failure(failure)

    def _resolve(self, calls) -> defer.Deferred:
        """The originals the calls ask for: those behind this request's own markers, else from
        the store under this request's tenant."""
        refs = refs_to_resolve(calls)
        lookups = [defer.succeed(self.originals[ref]) if ref in self.originals else self.proxy.store.get(self.tenant, ref)
                   for ref in refs]

        def resolved(originals):
            resolutions = {ref: resolve(ref, original) for ref, original in zip(refs, originals)}
            for reply in answers(calls, resolutions):
                self.stats.expand.count(reply.kind, reply.text)
            return resolutions

        return defer.gatherResults(lookups, consumeErrors=True).addCallback(resolved)

    def _continuation_failed(self, why: str):
        self.stats.expand.continuations_failed += 1
        log.warn("expand continuation failed ({why}): the client gets the rounds so far", why=why)

    # JSON responses where cg injected the tool: collect, maybe continue, answer once.

    def _json_round(self, complete: bool, body: bytes):
        if self.ended:
            return
        first = not self.rounds
        if not complete:
            if first:
                return self.upstream_broke()
            self._continuation_failed("the continuation broke")
            return self._answer_json()
        try:
            doc = ujson.loads(body)
        except ValueError:
            doc = None
        if not isinstance(doc, dict):
            if first:
                self.write(body)  # not what cg can read: as it came
                return self.finish()
            self._continuation_failed("the continuation is not JSON")
            return self._answer_json()
        self.rounds.append(doc)
        if first:
            self._first_body = body
        calls = lone_expand_calls(doc, self.rewrite.dialect)
        if calls is None or len(self.rounds) > self.proxy.max_expand_rounds:
            return self._answer_json()
        self._continue(calls, doc, False, self._json_continues, self._json_continuation_refused)

    def _json_continues(self, response):
        decoder, _ = self._decoder(response)
        if not 200 <= response.code < 300 or decoder is _UNDECODABLE:
            response.deliverBody(_Discard())
            return self._json_continuation_refused(None, f"HTTP {response.code}")
        response.deliverBody(_Relay(self, decoder, _Collected(self._json_round)))

    def _json_continuation_refused(self, failure, why: str | None = None):
        self._continuation_failed(why or failure.getErrorMessage())
        self._answer_json()

    def _answer_json(self):
        """One response for the client: the first as it came, or every round merged."""
        rounds = self.rounds
        if len(rounds) == 1:
            self.write(self._first_body)
        else:
            self.write(ujson.dumps(merge(rounds, self.rewrite.dialect), ensure_ascii=False,
                                   escape_forward_slashes=False).encode("utf-8"))
        self.finish()

    # Anthropic streams where cg injected the tool: the inspector.

    def stream_expands(self):
        """The inspector held a lone expand turn: continue upstream, pinging the client meanwhile.

        The pings go on until the continuation's first event reaches the client.
        """
        self._stop_pinging()
        self.pinger = task.LoopingCall(self.write, PING)
        self.pinger.clock = self.proxy.reactor
        self.pinger.start(PING_INTERVAL, now=False)
        inspector = self.inspector
        self._continue(inspector.calls, inspector.assistant_message(), True,
                       self._stream_continues, self._stream_continuation_refused)

    def _stream_continues(self, response):
        decoder, _ = self._decoder(response)
        if not 200 <= response.code < 300 or not _is_stream(response) or decoder is _UNDECODABLE:
            response.deliverBody(_Discard())
            return self._stream_continuation_refused(None, f"HTTP {response.code}")
        self.inspector.begin_continuation()
        # Headers came; the continuation must also commit (send content) in time. A client
        # that reads nothing keeps it paused, and past this it gets the verbatim release.
        self.stalled = self.proxy.reactor.callLater(self.proxy.continuation_timeout, self._stream_stalled)
        response.deliverBody(_Relay(self, decoder, _Inspected(self)))

    def _stream_stalled(self):
        """A continuation that answered headers but no content: give the client what upstream sent."""
        if self.ended or self.inspector.committed:
            return
        self._stop_upstream()
        self._stream_continuation_refused(None, "no content in time")

    def _stream_continuation_refused(self, failure, why: str | None = None):
        """Nothing of the continuation reached the client: it gets what upstream sent, verbatim."""
        self._stop_pinging()
        self._continuation_failed(why or failure.getErrorMessage())
        self.write(self.inspector.release())
        self.finish()

    def _stop_pinging(self):
        if self.pinger is not None and self.pinger.running:
            self.pinger.stop()
        if self.stalled is not None and self.stalled.active():
            self.stalled.cancel()

    def _billed(self):
        """(usage of every round, continuation rounds) for this request, or (None, 0)."""
        if self.rounds:
            return sum(billed(self.rounds, self.rewrite.dialect)), len(self.rounds) - 1
        if self.inspector is not None:
            return (sum(self.inspector.billed) if self.inspector.billed else None), self.inspector.rounds
        return (self.meter.usage() if self.meter is not None else None), 0

    def _end(self):
        self.ended = True
        self._stop_pinging()
        usage, rounds = self._billed()
        if usage is not None:
            self.proxy.billed(self, usage, rounds)
        self.stats.record_response(self)
        self.proxy.ended(self)
        ms = _ms
        outcome = self.outcome
        if outcome == "ok" and self.status is not None and self.status >= 400:
            outcome = "upstream_error_status"  # relayed as it came, but no success
        before, after, markers = _compacted(self.rewrite)
        log.info(
            "{method} {path} {status} {outcome} upstream_ms={upstream_ms} ttfb_ms={ttfb_ms} "
            "in={bytes_in} out={bytes_out} tokens={tokens} markers={markers} expand_rounds={rounds}",
            method=self.request.method.decode("latin-1"),
            path=self.request.uri.decode("latin-1"),
            status=self.status or "-",
            outcome=outcome,
            upstream_ms=ms(self.t_sent, self.t_headers),
            ttfb_ms=ms(self.t_received, self.t_client_first),
            bytes_in=self.bytes_in,
            bytes_out=self.bytes_out,
            tokens="-" if before is None else f"{before}->{after}",
            markers=markers,
            rounds=rounds,
        )


PING_INTERVAL = 5.0  # seconds; Claude Code gives up on a silent stream after ~180 s
_UNDECODABLE = object()  # a response encoding cg did not ask for on a path it reads
_UNKNOWABLE = object()  # the store could not say whether a repair text is frozen
FLUSH_TIMEOUT = 10.0  # seconds a cut client connection may take to take its last bytes


def _abort_if_open(transport):
    if not transport.disconnected:
        transport.abortConnection()


def _is_stream(response) -> bool:
    return response.headers.getRawHeaders(b"content-type", [b""])[0].startswith(b"text/event-stream")


def _ms(start, end):
    return "-" if start is None or end is None else f"{(end - start) * 1000:.1f}"


def _compacted(rewrite) -> tuple[int | None, int | None, int]:
    """(estimated tokens of the tool results cg changed, before and after; markers in the body sent)."""
    if rewrite is None or not rewrite.changes:
        return None, None, 0
    before, after = result_sizes(rewrite.changes)
    return before, after, len({c.marker_id for c in rewrite.changes if c.marker_id})


class _Relay(Protocol):
    """Hands an upstream body, decoded, to a sink chunk by chunk as it arrives.

    The body attaches to the exchange's `ClientFlow`, the client response's producer,
    so a client that stops reading pauses the upstream read. A sink that raises ends
    the exchange through `_bug` (the client's stream is cut, never left hanging).
    """

    def __init__(self, exchange: _Exchange, decoder, sink):
        self.exchange = exchange
        self.decoder = decoder
        self.sink = sink

    def connectionMade(self):
        exchange = self.exchange
        if exchange.ended:
            self.transport.stopProducing()
            return
        exchange.relay = self
        if exchange.flow is None:
            exchange.flow = ClientFlow()
            exchange.request.registerProducer(exchange.flow, True)
        exchange.flow.attach(self.transport)

    def detach(self):
        """This body no longer feeds the client (its round is over): let it drain unseen."""
        if self.exchange.relay is self:
            self.exchange.relay = None
            self.exchange.flow.detach()

    def dataReceived(self, data):
        exchange = self.exchange
        exchange.upstream_data(len(data))
        if exchange.ended or exchange.relay is not self:
            return
        if self.decoder is not None:
            try:
                data = self.decoder.decompress(data)
            except zlib.error:
                self.transport.stopProducing()  # ends this body as failed: the client's is cut
                return
        if data:
            try:
                self.sink.received(data)
            except Exception:
                exchange._bug(Failure())

    def connectionLost(self, reason=None):
        exchange = self.exchange
        if exchange.relay is not self:
            return  # the exchange ended, or moved on to another round
        exchange.relay = None
        exchange.flow.detach()
        if exchange.ended:
            return
        complete = bool(reason.check(ResponseDone, PotentialDataLoss))
        if self.decoder is not None:
            complete = complete and self.decoder.eof
        try:
            self.sink.finished(complete)
        except Exception:
            exchange._bug(Failure())


@implementer(IPushProducer)
class ClientFlow:
    """The client response's producer for an exchange's whole life; upstream bodies come and go.

    The client's channel pauses and resumes whichever producer is registered. A
    round's body unregistered while paused would never be resumed (so never drain),
    and an expand round's body registered while the client is paused would read on
    until cg's next write to the client. Registered once, this keeps the client's
    state and hands it to each body.
    """

    def __init__(self):
        self.paused = False
        self._body = None  # the upstream body's producer now feeding the client

    def attach(self, body):
        self._body = body
        if self.paused:
            body.pauseProducing()

    def detach(self):
        """The body feeds the client no more: it must not stay paused on the client's account."""
        body, self._body = self._body, None
        if body is not None and self.paused:
            body.resumeProducing()

    def pauseProducing(self):
        self.paused = True
        if self._body is not None:
            self._body.pauseProducing()

    def resumeProducing(self):
        self.paused = False
        if self._body is not None:
            self._body.resumeProducing()

    def stopProducing(self):
        if self._body is not None:
            self._body.stopProducing()


class _PassThrough:
    """Every byte to the client as it arrives (usage read on the way)."""

    def __init__(self, exchange: _Exchange):
        self.exchange = exchange

    def received(self, data: bytes):
        if self.exchange.meter is not None:
            self.exchange.meter.feed(data)
        self.exchange.write(data)

    def finished(self, complete: bool):
        if complete:
            self.exchange.finish()
        else:
            self.exchange.upstream_broke()


class _Inspected:
    """One round of an Anthropic stream through the exchange's inspector."""

    def __init__(self, exchange: _Exchange):
        self.exchange = exchange
        self.parser = SSEParser()
        self.expanded = False

    def received(self, data: bytes):
        for event in self.parser.feed(data):
            if self.expanded or self.exchange.ended:
                return
            self._step(self.exchange.inspector.feed(event))

    def finished(self, complete: bool):
        exchange = self.exchange
        for event in self.parser.flush():
            if self.expanded or exchange.ended:
                return
            self._step(exchange.inspector.feed(event))
        if not (self.expanded or exchange.ended):
            self._step(exchange.inspector.end(complete, self.parser.close()))

    def _step(self, step):
        exchange = self.exchange
        if step.send:
            if exchange.inspector.committed:
                exchange._stop_pinging()
            exchange.write(step.send)
        if step.action == EXPAND:
            # The round is decided at its message_stop: continue now, whatever the old body
            # still does (a gateway may keep it open); it drains unseen.
            self.expanded = True
            if exchange.relay is not None:
                exchange.relay.detach()
            exchange.stream_expands()
        elif step.action == DONE:
            exchange.finish()
        elif step.action == ABORT:
            exchange.upstream_broke()


class _Collected:
    """A JSON body, whole, for the expand loop (the client waits for a JSON answer anyway)."""

    def __init__(self, done):
        self.chunks: list[bytes] = []
        self.done = done

    def received(self, data: bytes):
        self.chunks.append(data)

    def finished(self, complete: bool):
        self.done(complete, b"".join(self.chunks))


class _Discard(Protocol):
    """Reads and drops a body cg will not use, so its connection goes back to the pool."""
