"""The forwarder: what every exchange shares, and the host its driver talks to (`cg.web.driver.Host`).

It holds the upstream, the store, the rewriter and what the cache-aware policy learned, builds each
request's `Preparation`, counts and logs what the request side did and what the provider billed, and
keeps the set of exchanges in flight for a graceful stop. `cg.web.proxy.ProxyResource` routes a
request here (`forward`) once it is one to forward.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Iterator

import attrs
from twisted.internet import defer
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.web.http_headers import Headers

from cg.compaction import cold
from cg.compaction.rewrite import Rewriter
from cg.exchange.prepare import Preparation, Ready, Report
from cg.exchange.prepare import Request as PrepareRequest
from cg.exchange.record import ExchangeRecord
from cg.record.changelog import ChangeLog, NullChangeLog, compaction_record, ping_record, usage_record
from cg.record.ledger import Book, Sent
from cg.record.pricing import ANTHROPIC
from cg.record.stats import Stats
from cg.store.base import ILedger, IStore
from cg.stream import hidden
from cg.stream.usage import Usage
from cg.web.driver import ExchangeDriver
from cg.web.keepalive import KeepAlive
from cg.web.site import CappedRequest as Request
from cg.web.upstream import IUpstream
from cg.wire import dialect

log = Logger(namespace="cg.web.forwarder")


class _Index:
    """The store's synchronous part, as `cg.exchange.prepare.StoreIndex` reads it."""

    def __init__(self, store: IStore):
        self._store = store

    def known(self, tenant: str, ids: Iterable[str]) -> set[str]:
        known: set[str] = self._store.known(tenant, ids)
        return known

    @property
    def healthy(self) -> bool:
        return bool(self._store.stats.healthy)


class Forwarder:
    """Forwards requests, one `ExchangeDriver` each, and is their `Host`."""

    def __init__(
        self,
        upstream: IUpstream,
        stats: Stats,
        upstreams: dict[str, tuple[bytes, bytes]],  # dialect -> (origin, base path): `split_base`
        *,
        rewriter: Rewriter | None = None,
        store: IStore | None = None,
        ledger: ILedger | None = None,
        tenant_of: Callable[[Headers], str],
        observe: bool = False,
        changelog: ChangeLog | NullChangeLog | None = None,
        max_expand_rounds: int = 3,
        max_held: int = 16 << 20,
        continuation_timeout: float = 600.0,
        clock: Callable[[], float] = time.perf_counter,
        now: Callable[[], float] = time.time,
        reactor: IReactorTime | None = None,
        keepalive: KeepAlive | None = None,
        cache_ttl: str = "keep",
        shared_store: bool = False,
    ):
        self.upstream = upstream
        self.stats = stats
        self.upstreams = upstreams
        self.rewriter = rewriter
        self.store = store
        self.tenant_of = tenant_of
        self.observe = observe
        self.changelog: ChangeLog | NullChangeLog = changelog if changelog is not None else NullChangeLog()
        self.max_expand_rounds = max_expand_rounds
        self.max_held = max_held
        self.continuation_timeout = continuation_timeout
        self.keepalive = keepalive  # with --keepalive
        self.cache_ttl = cache_ttl  # --cache-ttl
        if reactor is None:
            from twisted.internet import reactor as default_reactor

            reactor = default_reactor
        self.reactor: IReactorTime = reactor
        self.clock = clock
        self.now = now  # wall-clock time: when a conversation's prompt cache expires (cg.compaction.cold)
        # What the cache-aware policy learned from the store, per (tenant, conversation key).
        self.known = cold.Known()
        # The records of hidden turns this process read or wrote (cg.stream.hidden).
        self.hidden = hidden.Seen(shared=shared_store)
        self._index = None if store is None else _Index(store)
        self.ledger = ledger  # the dashboard's rows (cg.exchange.ledger), in the store
        self.book = Book()
        # Request numbers for the change log, unique across restarts of this process.
        self.seqs: Iterator[int] = itertools.count(int(time.time()) * 1_000_000)
        self._in_flight: set[ExchangeDriver] = set()
        self._drain_waiters: list[defer.Deferred[None]] = []

    def forward(self, request: Request, which: str) -> None:
        """Forward `request` (to the `which` dialect's upstream) and relay its response."""
        ExchangeDriver(self, request, which).start()

    # -----------------------------------------------------------------------------------------
    # The driver's host

    def preparation(self, request: PrepareRequest) -> Preparation:
        return Preparation(request, rewriter=self.rewriter, known=self.known, index=self._index,
                           observe=self.observe, keepalive=self.keepalive is not None, now=self.now(),
                           hidden=self.hidden, cache_ttl=self.cache_ttl)

    def keep_hidden(self, tenant: str, key: str, text: bytes) -> None:
        """A spliced response's hidden turns: known here at once (the client's next request may come
        before the store commits them), and frozen in the store for every other cg and a restart."""
        self.hidden.put(tenant, key, text)
        self.stats.expand.hidden_kept += 1
        if self.store is not None:
            self.store.freeze(tenant, key, text).addErrback(
                lambda failure: log.warn("keeping a response's hidden turns failed: {why}",
                                         why=failure.getErrorMessage()))

    def prepared(self, ready: Ready) -> None:
        """Counts and logs what the request side did."""
        report, forward = ready.report, ready.forward
        stats = self.stats
        stats.bypassed += report.bypassed
        stats.compaction.cold.add(report.cold)
        stats.compaction.store_fail_open += report.store_fail_open
        stats.expand.hidden_restored += report.hidden_restored
        rewrite = report.rewrite
        if rewrite is None:
            return
        stats.compaction.record(rewrite, report.client_bytes)
        stats.expand.repairs += rewrite.repaired
        now = time.time()
        for change in rewrite.changes:
            self.changelog.write(
                compaction_record(
                    time=now, session=forward.session, seq=forward.seq,
                    message=change.message_index, block=change.block_index, tool=change.tool_name,
                    component=change.component, lossy=change.lossy, marker=change.marker_id,
                    tokens_before=change.tokens_before, tokens_after=change.tokens_after,
                    content_hash=change.content_id, part=change.part_index, step=change.step,
                )
            )

    def cache_used(self, tenant: str, cache: tuple[str, float]) -> None:
        """A request sent the conversation's prompt to the provider again (an expand round, a
        keep-alive ping): its cache lives on. The store keeps the later expiry (cg.store)."""
        if self.store is None:
            return
        key, ttl = cache
        until = self.now() + ttl

        def recorded(before: float | None) -> None:
            self.known.stored(tenant, key, until)

        self.store.cache_until(tenant, key, until).addCallbacks(recorded, lambda failure: None)

    def pinged(self, sent: Sent, session: str, cache: tuple[str, float] | None, usage: Usage) -> None:
        """A keep-alive ping of ``session`` (``sent``: its last request) was answered: the conversation's
        prompt cache lives on, for the cache-aware policy (`cache_used`); the ping and its bill at list
        price go into /stats, the ledger (a row of kind PING, with the cache's new expiry) and the
        change log, each apart from the clients' requests."""
        now = self.now()
        cost = self.book.cost(sent.model, ANTHROPIC, usage)  # pings are Anthropic's
        self.stats.keepalive.cost_usd += cost
        if cache is not None:
            self.cache_used(sent.tenant, cache)
        seq = next(self.seqs)
        if self.ledger is not None:
            self.ledger.record(self.book.ping(attrs.evolve(sent, time=now), session, seq, usage), [])
        self.changelog.write(
            ping_record(
                time=now, session=session, seq=seq, model=sent.model, input_tokens=usage.input_tokens,
                cache_read_tokens=usage.cache_read_tokens, cache_write_tokens=usage.cache_write_tokens,
                output_tokens=usage.output_tokens, cache_write_1h_tokens=usage.cache_write_1h_tokens, cost_usd=cost,
            )
        )

    def recorded(self, record: ExchangeRecord, report: Report, sent: Sent) -> None:
        """An exchange ended: its row into the ledger, its billed usage (every round of it) into
        /stats and the change log."""
        if self.ledger is not None:
            try:
                turn, changes = self.book.turn(sent, report, record)
                self.ledger.record(turn, changes)
            except Exception:  # a bug: it loses the row, never the exchange's end (nor /stats)
                log.failure("the ledger's row for {path} was lost", path=record.target)
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
                expand_rounds=record.expand_rounds, model=sent.model, cache_write_1h_tokens=usage.cache_write_1h_tokens,
            )
        )

    def metrics_tenant(self, request: Request) -> str:
        """The request's tenant, for the labels --metrics-tenants adds ("" without it)."""
        return self.tenant_of(request.requestHeaders) if self.stats.metrics.tenants else ""

    def started(self, driver: ExchangeDriver) -> None:
        self._in_flight.add(driver)
        self.stats.in_flight = len(self._in_flight)

    def ended(self, driver: ExchangeDriver) -> None:
        self._in_flight.discard(driver)
        self.stats.in_flight = len(self._in_flight)
        if not self._in_flight:
            waiters, self._drain_waiters = self._drain_waiters, []
            for d in waiters:
                d.callback(None)

    # -----------------------------------------------------------------------------------------
    # A graceful stop

    def drained(self) -> defer.Deferred[None]:
        """Fires once no request is in flight."""
        if not self._in_flight:
            return defer.succeed(None)
        d: defer.Deferred[None] = defer.Deferred()
        self._drain_waiters.append(d)
        return d

    def abort_all(self) -> None:
        """Cut every exchange still in flight (the drain timeout ran out)."""
        for driver in list(self._in_flight):
            driver.cut()
