"""The proxy resource: route a request, rewrite it, forward it, relay the response as it arrives.

cg's own endpoints are answered here. Every other request is one exchange (`cg.exchange`, run on
Twisted by `cg.web.driver`); its request body is rewritten here by `cg.compaction.rewrite` (with
new originals stored first) before the exchange forwards it.
"""

import itertools
import time
from collections.abc import Mapping
from urllib.parse import unquote

import attrs
import ujson
from twisted.internet import defer
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web import resource, server

from cg.compaction import cold
from cg.compaction.repair import repair_answer
from cg.exchange import keepalive
from cg.exchange.record import ExchangeRecord
from cg.record.changelog import NullChangeLog, compaction_record, usage_record
from cg.stream.usage import session_key
from cg.web import http1, metrics
from cg.web.driver import ExchangeDriver, Forward
from cg.wire import dialect
from cg.wire.markers import parse_marker_ref

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
        now=time.time,
        reactor=None,
        keepalive=None,
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
        self.keepalive = keepalive  # cg.web.keepalive.KeepAlive, with --keepalive
        if reactor is None:
            from twisted.internet import reactor
        self.reactor = reactor
        self.clock = clock
        self.now = now  # wall-clock time: when a conversation's prompt cache expires (cg.compaction.cold)
        # What the cache-aware policy learned from the store, per (tenant, conversation key).
        self._known = cold.Known()
        # Request numbers for the change log, unique across restarts of this process.
        self.seqs = itertools.count(int(time.time()) * 1_000_000)
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
        if path == b"/metrics" and request.method == b"GET":
            body, content_type = metrics.render(self.stats, (request.getHeader(b"accept") or b"").decode("latin-1"))
            request.setHeader(b"content-type", content_type.encode("latin-1"))
            return body
        if path.startswith(b"/cg/expand/") and request.method == b"GET":
            return self._show_original(request, path[len(b"/cg/expand/") :].decode("latin-1"))
        which = dialect.route(request.uri, request.requestHeaders.hasHeader(b"anthropic-version"))
        if which is None:
            message = dialect.not_proxied(path, _url_of_cg(request))
            return _error(request, dialect.spoken_by(request.requestHeaders), 404, message)
        if request.too_large:
            self.stats.refused_too_large(which, request.uri.decode("latin-1"), self.metrics_tenant(request))
            return _error(request, which, 413, "request body is larger than cg's --max-body")
        ExchangeDriver(self, request, which).start()
        return server.NOT_DONE_YET

    def _show_original(self, request, ref: str):
        """GET /cg/expand/ID: an original, to whoever may read it under --tenant (else 404)."""
        ident = parse_marker_ref(unquote(ref))
        if ident is None or self.store is None:
            return _error(request, None, 404, "no such original")
        tenant = self.tenant_of(request.requestHeaders)

        gone: list[Failure] = []
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

    def prepare(self, request, body: bytes, seq: int) -> defer.Deferred[Forward]:
        """What to forward: the body repaired, compacted and injected, with new originals stored first.

        Fails open: a body cg cannot parse goes as it came (as does any body when
        the rewrite raises: `ExchangeDriver._unprepared`), and when the store cannot
        keep a new original, that original goes unreplaced.
        """
        if request.requestHeaders.getRawHeaders(b"x-cg-bypass") == [b"1"]:
            self.stats.bypassed += 1
            return defer.succeed(Forward(body, seq))
        # Whose last body this one most likely extends: Claude Code's and Codex CLI's session headers.
        headers = request.requestHeaders
        conversation = (headers.getRawHeaders(b"x-claude-code-session-id") or headers.getRawHeaders(b"session-id")
                        or [b""])[0]
        incoming = self.rewriter.parse(body, request.uri, conversation.decode("latin-1")) if self.rewriter else None
        session = session_key(_header_getter(request), incoming.body if incoming else None)
        if incoming is None:
            return defer.succeed(Forward(body, seq, session))
        model = incoming.body.value.get("model")
        model = model if isinstance(model, str) else None
        tenant = self.tenant_of(request.requestHeaders)
        warm = None
        path = dialect.split_path(request.uri).decode("latin-1")
        if self.keepalive is not None and conversation and keepalive.concerns(path, body):
            # One keep-alive per model: a provider caches per model, and Claude Code's side requests go to another.
            warm = ((tenant, conversation, model), keepalive.lifetime(incoming.body))
        unchanged = Forward(body, seq, session, tenant, model=model, keepalive=warm)
        texts = self._repair_texts(incoming, unchanged.tenant) if incoming.repairs else defer.succeed({})
        older = self._cold(incoming, unchanged, conversation.decode("latin-1"))
        both = defer.gatherResults([texts, older], consumeErrors=True)
        return both.addCallback(lambda results: self._finish(unchanged, incoming, *results))

    def _cold(self, incoming, unchanged: Forward, conversation: str) -> defer.Deferred:
        """The cache-aware policy's part (--cold-policy, cg.compaction.cold): fires with (the
        stronger config for older messages or None, (conversation key, cache lifetime) or None).

        Each request records, in the store, how long its conversation's prompt cache lives (but
        for one this cg surely knows to be warm, which asks the store nothing: cold.Known); one
        that comes after it expired is cold, and re-decides the older history as an epoch, frozen
        in the store (first writer wins) before anything is forwarded. Every request applies the
        latest epoch its history matches. Never fails: a store that cannot say when the cache
        expires leaves the request warm; one that cannot read the epochs leaves those this cg
        read before, and makes none (after a restart: first-sight decisions, so a marker an
        epoch sent before goes whole, one cache write and nothing lost). count_tokens applies
        epochs, and records and makes none.
        """
        policy = self.rewriter.config.cold
        if policy is None or not conversation or incoming.injection is None or self.store is None:
            return defer.succeed((None, None))
        stats = self.stats.compaction.cold
        stats.checked += 1
        tenant, body, shape = unchanged.tenant, incoming.body, incoming.dialect
        key = cold.conversation_key(conversation, unchanged.model)
        now, ttl = self.now(), cold.cache_ttl(body, shape)

        def applied(epoch):
            stats.applied += epoch is not None
            return cold.older(epoch, body, shape, self.rewriter.config.compact), (key, ttl) if incoming.stash else None

        if self._known.warm(tenant, key, now, now + ttl if incoming.stash else None, policy.margin):
            stats.known_warm += 1
            return defer.succeed(applied(cold.latest(self._known.epochs(tenant, key), body, shape)))
        if incoming.stash:
            expired = self._record_cache(tenant, key, now + ttl).addErrback(lambda failure: None)
        else:
            expired = defer.succeed(None)

        def decided(results):
            expired, (known, complete) = results
            if not complete:
                stats.unknown += 1
            current = cold.latest(known, body, shape)
            if not (complete and incoming.stash and policy.is_cold(expired, now)) or len(known) >= cold.MAX_EPOCHS:
                return current
            stats.cold += 1
            made = policy.epoch(body, shape, current)
            if made is None:
                return current
            return self._freeze_epoch(tenant, key, known, made).addCallback(lambda known: cold.latest(known, body, shape))

        gathered = defer.gatherResults([expired, self._read_epochs(tenant, key)], consumeErrors=True)
        return gathered.addCallback(decided).addCallback(applied)

    def _read_epochs(self, tenant: str, key: str) -> defer.Deferred:
        """(a conversation's epochs, whether that is all of them): those read before, then any
        another cg (or this one, before a restart) froze since. A store that cannot read them
        leaves those read before (not all: no new one is made then)."""
        found = self._known.epochs(tenant, key)

        def read(_=None):
            if len(found) >= cold.MAX_EPOCHS:
                return self._known.set_epochs(tenant, key, found), True
            return self.store.frozen(tenant, cold.epoch_key(key, len(found))).addCallback(got)

        def got(text):
            if text is None:
                return self._known.set_epochs(tenant, key, found), True
            found.append(cold.Epoch.loads(text))
            return read()

        def unread(failure):
            self._known.doubt(tenant, key)
            return self._known.epochs(tenant, key), False

        return read().addErrback(unread)

    def _freeze_epoch(self, tenant: str, key: str, known: list, made: cold.Epoch) -> defer.Deferred:
        """`known` with `made` frozen after them, or with what another cg froze there first; as it
        was if the store cannot freeze (the request is cold: its bytes cost nothing extra)."""

        def frozen(text: bytes):
            stored = cold.Epoch.loads(text)
            self.stats.compaction.cold.epochs += stored == made
            return self._known.set_epochs(tenant, key, [*known, stored])

        def unfrozen(failure):
            self._known.doubt(tenant, key)  # another cg's may be there: read them again next time
            return known

        return self.store.freeze(tenant, cold.epoch_key(key, len(known)), made.dumps()).addCallbacks(
            frozen, unfrozen
        )

    def _record_cache(self, tenant: str, key: str, until: float) -> defer.Deferred:
        """The store's "keep the later expiry" (cg.store), remembered: fires with the previous one."""

        def recorded(before):
            self._known.stored(tenant, key, until)
            return before

        return self.store.cache_until(tenant, key, until).addCallback(recorded)

    def cache_used(self, tenant: str, cache: tuple[str, float]) -> None:
        """An expand round sent the conversation's prompt to the provider again: its cache lives on."""
        key, ttl = cache
        self._record_cache(tenant, key, self.now() + ttl).addErrback(lambda failure: None)

    def _repair_texts(self, incoming, tenant: str) -> defer.Deferred:
        """The answer for each expand call the client answered with an error, frozen per tool_use_id.

        The first repair of a call stores its text; every later turn replays exactly those bytes,
        even after the original was evicted, so a repair never changes what the provider cached.
        The original comes from this very body when it still holds it, else from the store. A
        store that cannot say whether a text is frozen, or cannot read the original (it is
        unhealthy), leaves that answer as the client sent it: freezing "no longer stored" then
        would replay a loss that lasted seconds on every later turn.
        """
        in_body = self.rewriter.originals(incoming)

        def one(repair):
            def answered(original):
                if original is None and not self.store.stats.healthy:
                    return None  # the store could not say: the client's answer stays, nothing frozen
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

    def _finish(self, unchanged: Forward, incoming, texts: dict, cold_part=(None, None)) -> defer.Deferred[Forward] | Forward:
        older, cache = cold_part
        unchanged = attrs.evolve(unchanged, cache=cache)
        rewrite = self.rewriter.finish(incoming, texts, older=older)
        if self.observe or not rewrite.originals:
            return self._chosen(unchanged, rewrite, {})
        return self._vouched(unchanged, incoming, texts, rewrite, again=True, older=older)

    def _vouched(self, unchanged: Forward, incoming, texts: dict, rewrite, again: bool,
                 older=None) -> defer.Deferred[Forward] | Forward:
        """Markers only for originals the store vouches for: it first stores those it does not know.

        A store that forgot some while storing the others (it broke and came back, or another
        process wrote) is given them once more. A store that cannot keep them vouches for what
        it still knows (nothing, once it is unhealthy): the rest go whole, and reformat still
        runs. The exchange keeps the originals behind the markers it sends, for expand calls.
        """
        tenant = unchanged.tenant
        known = self.store.known(tenant, rewrite.originals)
        if known:
            self.store.touch(tenant, known)
        new = {i: rewrite.originals[i] for i in rewrite.originals if i not in known}  # only these encoded
        if not new:
            return self._chosen(unchanged, rewrite, rewrite.originals)

        def stored(_):
            if again and len(self.store.known(tenant, rewrite.originals)) < len(rewrite.originals):
                return self._vouched(unchanged, incoming, texts, rewrite, again=False, older=older)
            return self._chosen(unchanged, rewrite, rewrite.originals)

        def unstored(failure):
            # Offloads sent on earlier turns stay while the store still vouches for them, so the
            # bytes the provider has cached do not change. The store logs the failure, once.
            self.stats.compaction.store_fail_open += 1
            vouched = self.rewriter.finish(incoming, texts, lossy=frozenset(self.store.known(tenant, known)),
                                           older=older)
            return self._chosen(unchanged, vouched, vouched.originals)

        return self.store.put(tenant, new).addCallbacks(stored, unstored)

    def _chosen(self, unchanged: Forward, rewrite, originals: Mapping[str, bytes]) -> Forward:
        """Counts and logs what the rewrite did; forwards it (in observe mode, the body as it came)."""
        self.stats.compaction.record(rewrite, len(unchanged.body))
        self.stats.expand.repairs += rewrite.repaired
        now = time.time()
        for change in rewrite.changes:
            self.changelog.write(
                compaction_record(
                    time=now, session=unchanged.session, seq=unchanged.seq,
                    message=change.message_index, block=change.block_index, tool=change.tool_name,
                    component=change.component, lossy=change.lossy, marker=change.marker_id,
                    tokens_before=change.tokens_before, tokens_after=change.tokens_after,
                    content_hash=change.content_id, part=change.part_index, step=change.step,
                )
            )
        if self.observe:
            return unchanged
        # Kept for the response's life: what it decides by (not the parse), and the originals
        # behind its markers, which answer expand calls even if the store breaks meanwhile.
        return attrs.evolve(unchanged, body=rewrite.body, rewrite=attrs.evolve(rewrite, originals={}, parsed={}),
                            originals=originals)

    def billed(self, record: ExchangeRecord, model: str | None = None) -> None:
        """A response's billed usage (every round of it): into /stats and the change log."""
        usage = record.usage
        if usage is None:  # nothing billed, or nothing cg could read
            return
        self.stats.usage.add(usage, record.session)
        self.changelog.write(
            usage_record(
                time=time.time(), session=record.session, seq=record.seq, dialect=record.dialect,
                path=dialect.split_path(record.target.encode("latin-1")).decode("latin-1"),
                input_tokens=usage.input_tokens, cache_read_tokens=usage.cache_read_tokens,
                cache_write_tokens=usage.cache_write_tokens, output_tokens=usage.output_tokens,
                expand_rounds=record.expand_rounds, model=model, cache_write_1h_tokens=usage.cache_write_1h_tokens,
            )
        )

    def metrics_tenant(self, request) -> str:
        """The request's tenant, for the labels --metrics-tenants adds ("" without it)."""
        return self.tenant_of(request.requestHeaders) if self.stats.metrics.tenants else ""

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
        d: defer.Deferred[None] = defer.Deferred()
        self._drain_waiters.append(d)
        return d

    def abort_all(self):
        """Cut every exchange still in flight (the drain timeout ran out)."""
        for exchange in list(self._in_flight):
            exchange.cut()


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


_UNKNOWABLE = object()  # the store could not say whether a repair text is frozen
