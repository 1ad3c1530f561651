"""Counters behind `GET /stats`. Fields are only ever added, never renamed or removed."""

import time
from collections import Counter, deque

import attrs

from cg.compaction.cold import ColdStats
from cg.compaction.pipeline import Memo, result_sizes
from cg.compaction.rewrite import Rewrite
from cg.compaction.tokens import estimate_body_tokens, estimate_tokens
from cg.exchange.record import ExchangeRecord
from cg.record.metrics import MemoTable, Metrics
from cg.stream.inspector import ReleaseReason
from cg.stream.usage import Usage, UsageTotals


@attrs.define
class LatencyWindow:
    """The most recent samples of a latency, for percentiles without unbounded memory."""

    samples: deque[float] = attrs.field(factory=lambda: deque(maxlen=4096))
    count: int = 0

    def add(self, seconds: float) -> None:
        self.samples.append(seconds)
        self.count += 1

    def summary(self) -> dict[str, float | None]:
        ordered = sorted(self.samples)
        if not ordered:
            return {"count": 0, "p50_ms": None, "p99_ms": None, "avg_ms": None, "max_ms": None}

        def pct(p: float) -> float:
            return round(ordered[min(len(ordered) - 1, int(p * len(ordered)))] * 1000, 3)

        return {
            "count": self.count,
            "p50_ms": pct(0.50),
            "p99_ms": pct(0.99),
            "avg_ms": round(sum(ordered) / len(ordered) * 1000, 3),
            "max_ms": round(ordered[-1] * 1000, 3),
        }


@attrs.define
class Stats:
    """Process-wide counters; the proxy updates them, /stats reads them."""

    started: float = attrs.field(factory=time.time)
    requests: Counter[str] = attrs.field(factory=Counter)
    statuses: Counter[int] = attrs.field(factory=Counter)
    in_flight: int = 0
    streamed: int = 0
    upstream_errors: int = 0
    upstream_retries: int = 0
    client_disconnects: int = 0
    too_large: int = 0
    bytes_from_client: int = 0
    bytes_to_upstream: int = 0
    bytes_from_upstream: int = 0
    bytes_to_client: int = 0
    added_ttfb: LatencyWindow = attrs.field(factory=LatencyWindow)
    upstream_ttfb: LatencyWindow = attrs.field(factory=LatencyWindow)
    bypassed: int = 0
    # Events a sans-io machine had no row for ("exchange", "preparation"): bugs, counted and logged.
    unexpected_events: Counter[str] = attrs.field(factory=Counter)
    compaction: "CompactionStats" = attrs.field(factory=lambda: CompactionStats())
    store: attrs.AttrsInstance | None = None  # the store's own counters (cg.store.StoreStats), when there is one
    store_info: attrs.AttrsInstance | None = None  # the store's size (cg.store.StoreInfo), refreshed off the request path
    store_info_as_of: float | None = None  # when store_info was read (Unix time)
    store_kind: str | None = None  # memory, sqlite or redis: the dashboard's health panel says which
    store_max_bytes: int | None = None  # --store-max-mb, in bytes
    usage: UsageTotals = attrs.field(factory=UsageTotals)
    expand: "ExpandStats" = attrs.field(factory=lambda: ExpandStats())
    sse: "StreamStats" = attrs.field(factory=lambda: StreamStats())
    changelog: object = None  # the change log, for its error count
    worker: dict[str, int] | None = None  # one of --workers N: its index, the count, its pid
    memo: Memo | None = None  # the rewriter's, for its hit rate
    keepalive: "KeepaliveStats" = attrs.field(factory=lambda: KeepaliveStats())
    metrics: Metrics = attrs.field(factory=Metrics)  # /metrics: from the records, and these counters

    def record_response(self, record: ExchangeRecord, tenant: str = "") -> None:
        """Once per client request, from its record (`tenant`: for --metrics-tenants)."""
        self.metrics.exchange(record, tenant)
        self.statuses[record.status or 499] += 1
        if record.t_headers is not None and record.t_sent is not None:
            self.upstream_ttfb.add(record.t_headers - record.t_sent)
        if record.added_ttfb is not None:
            self.added_ttfb.add(record.added_ttfb)
        self.streamed += record.stream
        self.upstream_errors += record.outcome in ("upstream_error", "upstream_broke")
        self.client_disconnects += record.outcome == "client_gone"
        self.expand.continuations_failed += record.continuation_failed is not None
        self.sse.record(record)
        self.sync()

    def refused_too_large(self, dialect: str, target: str, tenant: str = "") -> None:
        """A request body over --max-body: answered 413, not forwarded."""
        self.too_large += 1
        self.statuses[413] += 1
        self.metrics.refused(dialect, target, 413, tenant)

    def sync(self) -> None:
        """Bring /metrics up to these counters: at each exchange's end, every 10 s, before a scrape."""
        self.metrics.sync(self)

    def snapshot(self) -> dict[str, object]:
        return {
            "uptime_s": round(time.time() - self.started, 3),
            "requests": sum(self.requests.values()),
            "requests_by_dialect": dict(self.requests),
            "responses_by_status": {str(k): v for k, v in sorted(self.statuses.items())},
            "in_flight": self.in_flight,
            "streamed": self.streamed,
            "upstream_errors": self.upstream_errors,
            "upstream_retries": self.upstream_retries,
            "client_disconnects": self.client_disconnects,
            "too_large": self.too_large,
            "bytes_in": self.bytes_from_client,
            "bytes_out": self.bytes_to_client,
            "bytes_to_upstream": self.bytes_to_upstream,
            "bytes_from_upstream": self.bytes_from_upstream,
            "added_ttfb": self.added_ttfb.summary(),
            "upstream_ttfb": self.upstream_ttfb.summary(),
            "bypassed": self.bypassed,
            "unexpected_events": dict(self.unexpected_events),
            "compaction": {**self.compaction.snapshot(), "memo": memo_snapshot(self.memo)},
            "store": {
                **({"kind": self.store_kind, "max_bytes": self.store_max_bytes} if self.store_kind else {}),
                **(attrs.asdict(self.store) if self.store is not None else {}),
                **(attrs.asdict(self.store_info) if self.store_info is not None else {}),
                **({"size_as_of": self.store_info_as_of} if self.store_info is not None else {}),
            },
            "usage": self.usage.as_dict(),
            "expand": attrs.asdict(self.expand),
            **self.sse.snapshot(),
            "changelog_errors": getattr(self.changelog, "errors", 0),
            "keepalive": self.keepalive.snapshot(),
            **({"worker": self.worker} if self.worker is not None else {}),
        }


def memo_snapshot(memo: Memo | None) -> dict[str, object]:
    """The memo's decisions table (its hit rate: how often a re-sent result cost a lookup), and
    below it its bodies table (each conversation's last body: a hit is a request parsed against
    its previous turn; `chars` are bytes there). `chars` is what the table's budget counts: a
    decision counts 512 besides its rewritten text."""

    def table(bounded: MemoTable) -> dict[str, object]:
        lookups = bounded.hits + bounded.misses
        return {
            "hits": bounded.hits,
            "misses": bounded.misses,
            "hit_rate": round(bounded.hits / lookups, 4) if lookups else None,
            "entries": len(bounded),
            "chars": bounded.chars,
        }

    if memo is None:
        return {}
    return {**table(memo.decisions), "bodies": table(memo.bodies)}


@attrs.define
class ComponentStats:
    runs: int = 0  # tool results it ran on (a re-sent result counts again)
    acted: int = 0
    reverted: int = 0  # rewrites undone: raised, broke the contract, or did not save tokens
    saved_tokens: int = 0


@attrs.define
class CompactionStats:
    """What compaction did to forwarded requests (or, in observe mode, would have done).

    `tokens_before` and `tokens_after` count each rewritten tool result once, however many
    components rewrote it: its size as the client sent it, and as cg forwarded it. Per component,
    `saved_tokens` is that component's own step (from the text the previous one left); the steps
    of a result add up to its saving, so the components' figures add up to the total.

    The `input_*` figures cover whole request bodies: every request whose body cg parsed to
    rewrite (a JSON object on /v1/messages, /v1/messages/count_tokens or /v1/chat/completions),
    whether it changed anything or not. Bodies sent with `x-cg-bypass`, bodies that are not a
    JSON object and bodies whose rewrite failed are forwarded as received and not counted, nor
    are the continuation rounds of the expand loop. Their tokens are estimated from byte length
    (cg.compaction.tokens.estimate_body_tokens): the estimator would cost ~26 ms per MB per request. So
    `input_savings_pct` is the share of bytes cg kept out.
    """

    requests_rewritten: int = 0
    requests_injected: int = 0
    tokens_before: int = 0
    saved: int = 0
    saved_unique: int = 0
    store_fail_open: int = 0
    input_requests: int = 0
    input_bytes_client: int = 0
    input_bytes_forwarded: int = 0
    components: dict[str, ComponentStats] = attrs.field(factory=dict)
    cold: ColdStats = attrs.field(factory=ColdStats)
    _seen: set[tuple[str, str]] = attrs.field(factory=set)
    _seen_max: int = 200_000

    def _component(self, name: str) -> "ComponentStats":
        return self.components.setdefault(name, ComponentStats())

    def record(self, rewrite: Rewrite, client_bytes: int) -> None:
        """One request's rewrite; `client_bytes`: the length of its body as the client sent it."""
        changes = rewrite.changes
        self.requests_injected += rewrite.injected
        self.input_requests += 1
        self.input_bytes_client += client_bytes
        self.input_bytes_forwarded += len(rewrite.body)
        for name, n in rewrite.runs.items():
            self._component(name).runs += n
        for name, n in rewrite.reverted.items():
            self._component(name).reverted += n
        if not changes:
            return
        self.requests_rewritten += 1
        before, after = result_sizes(changes)
        self.tokens_before += before
        self.saved += before - after
        for change in changes:
            saved = change.tokens_before - change.tokens_after
            component = self._component(change.component)
            component.acted += 1
            component.saved_tokens += saved
            # Each step once: a result's steps add up to its saving, so this counts it once too.
            key = (change.component, change.content_id)
            if key not in self._seen:
                if len(self._seen) >= self._seen_max:  # bounded: the figure becomes a lower bound
                    self._seen.clear()
                self._seen.add(key)
                self.saved_unique += saved

    def snapshot(self) -> dict[str, object]:
        return {
            "requests_rewritten": self.requests_rewritten,
            "requests_injected": self.requests_injected,
            "tokens_before": self.tokens_before,
            "tokens_after": self.tokens_before - self.saved,
            "saved_tokens": self.saved,
            "saved_tokens_unique": self.saved_unique,
            "savings_pct": round(100 * self.saved / self.tokens_before, 2) if self.tokens_before else 0.0,
            "input_requests": self.input_requests,
            "input_tokens_client": estimate_body_tokens(self.input_bytes_client),
            "input_tokens_forwarded": estimate_body_tokens(self.input_bytes_forwarded),
            "input_savings_pct": (
                round(100 * (self.input_bytes_client - self.input_bytes_forwarded) / self.input_bytes_client, 2)
                if self.input_bytes_client else 0.0
            ),
            "store_fail_open": self.store_fail_open,
            "components": {name: attrs.asdict(c) for name, c in sorted(self.components.items())},
            "cold": attrs.asdict(self.cold),
        }


@attrs.define
class ExpandStats:
    """The expand loop and repairs: how often the model asked for an original, and what it got."""

    bounces: int = 0  # continuation rounds cg ran upstream
    wasted_tokens: int = 0  # estimated tokens of originals sent back to the model
    resolved: int = 0
    unknown: int = 0
    evicted: int = 0
    malformed: int = 0
    repairs: int = 0  # client answers to expand calls replaced by the original
    continuations_failed: int = 0
    hidden_kept: int = 0  # spliced responses whose continuation thought: their hidden turns kept (cg.stream.hidden)
    hidden_restored: int = 0  # messages of requests that got those turns back

    def count(self, kind: str, text: str) -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        if kind == "resolved":
            self.wasted_tokens += estimate_tokens(text)


@attrs.define
class StreamStats:
    """SSE responses, one sample per client request whatever its exit path.

    `sse_buffered` counts streams the client got only at the end (read whole first):
    with the incremental inspector it stays 0. `sse_ttfb_ms_avg_buffered` is then
    the time to the last byte, by construction.
    """

    streamed: int = 0
    buffered: int = 0
    inspected: int = 0
    spliced: int = 0
    held_events: int = 0
    expand_rounds: int = 0
    released: Counter[ReleaseReason] = attrs.field(factory=Counter)
    _ttfb_streamed: float = 0.0
    _ttfb_buffered: float = 0.0

    def record(self, record: ExchangeRecord) -> None:
        if record.t_headers is None or not record.stream:
            return
        ttfb = (record.t_client_first or record.t_ended) - record.t_received
        self.streamed += 1
        self._ttfb_streamed += ttfb
        inspected = record.inspected
        if inspected is None:
            return
        self.inspected += 1
        self.spliced += inspected.spliced
        self.held_events += inspected.held_events
        self.expand_rounds += record.expand_rounds
        if inspected.released:
            self.released[inspected.released] += 1

    def snapshot(self) -> dict[str, object]:
        total = self.streamed + self.buffered
        return {
            "sse_streamed": self.streamed,
            "sse_buffered": self.buffered,
            "sse_buffered_pct": round(100 * self.buffered / total, 2) if total else 0.0,
            "sse_ttfb_ms_avg": round(1000 * self._ttfb_streamed / self.streamed, 3) if self.streamed else None,
            "sse_ttfb_ms_avg_buffered": (
                round(1000 * self._ttfb_buffered / self.buffered, 3) if self.buffered else None
            ),
            "sse_inspected": self.inspected,
            "sse_spliced": self.spliced,
            "sse_released": dict(self.released),
            "sse_held_events": self.held_events,
            "expand_rounds": self.expand_rounds,
        }


@attrs.define
class KeepaliveStats:
    """--keepalive: the pings cg sent to keep conversations' prompt caches warm, and their bill.

    Apart from `usage` (/stats' top level), which is what the clients' own requests were billed, so
    that what keep-alive costs (mostly `cache_read_tokens`) can be set against the cache writes it
    spares. `ended` counts keep-alives by why they ended (cg.exchange.keepalive.End).
    """

    enabled: bool = False
    conversations: int = 0  # kept warm now
    pings: int = 0  # sent
    pings_failed: int = 0  # answered non-2xx, or not at all
    usage: Usage = attrs.field(factory=Usage)  # billed for the pings
    cost_usd: float = 0.0  # that bill at list price (cg.record.pricing), by each ping's model
    ended: Counter[str] = attrs.field(factory=Counter)

    def snapshot(self) -> dict[str, object]:
        return {
            "enabled": self.enabled,
            "conversations": self.conversations,
            "pings": self.pings,
            "pings_failed": self.pings_failed,
            "usage": self.usage.as_dict(),
            "cost_usd": self.cost_usd,
            "ended": dict(sorted(self.ended.items())),
        }
