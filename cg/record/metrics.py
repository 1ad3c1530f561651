"""cg's Prometheus metrics (`GET /metrics`): prometheus-client's metric objects in a registry each
running cg owns.

Two ways in, and no third bookkeeping:

- from the `ExchangeRecord` at an exchange's end (`Metrics.exchange`): what /stats does not
  split by dialect, path and status, and the latency histograms;
- mirrored from the plain ints /stats already keeps (`Metrics.sync`): the /stats counter is
  the fact and its metric follows it by difference, at each exchange's end, on the store's
  10 s tick and before each scrape. The store's counters (`StoreStats`, any backend), the
  memo's (pure, plain ints) and the change log's come in this way.

Both write library metric objects, so prometheus-client's multiprocess mode
(`PROMETHEUS_MULTIPROC_DIR`) can sum workers in one scrape (docs/design.md, Metrics).
Label sets are bounded: dialects, known API paths (else "other"), HTTP statuses, components,
release reasons, store operations; a tenant only with `--metrics-tenants`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from cg import __version__
from cg.exchange.record import ExchangeRecord
from cg.wire.dialect import API_PATHS

if TYPE_CHECKING:
    from cg.record.stats import Stats

# cg's own share of a client's wait: a few ms when all is well.
_ADDED_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# A provider's: from tens of ms to minutes for a long non-streaming generation.
_UPSTREAM_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_STORE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)

STORE_OPERATIONS = ("put", "get", "freeze", "frozen", "cache_until", "info")
COLD_EVENTS = ("checked", "cold", "epochs", "applied", "unknown", "known_warm")  # cg.compaction.cold.ColdStats
USAGE_KINDS = ("input", "cache_read", "cache_write", "output")
EXPAND_OUTCOMES = ("resolved", "unknown", "evicted", "malformed")
MEMO_TABLES = ("decisions", "bodies")


# How a gauge sums over worker processes in multiprocess mode.
_Mode = Literal["livesum", "livemin", "max", "livemostrecent"]


class MemoTable(Protocol):
    """A table of the compaction memo, as /stats and /metrics read it."""

    hits: int
    misses: int

    @property
    def chars(self) -> int: ...

    def __len__(self) -> int: ...


def path_label(target: str) -> str:
    """A request-target's path when it is a known API path, else "other": never an ID."""
    path = target.split("?", 1)[0]
    return path if path in API_PATHS else "other"


class _Mirror:
    """A counter that follows a plain int kept elsewhere, by difference (a drop: the int restarted)."""

    __slots__ = ("_inc", "_last")

    def __init__(self, counter: Counter) -> None:
        self._inc = counter.inc
        self._last = 0

    def follow(self, value: int) -> None:
        if value != self._last:
            self._inc(value - self._last if value > self._last else value)
            self._last = value


class _Dialect:
    """The series every request of one dialect updates, looked up once."""

    def __init__(self, metrics: Metrics, dialect: str) -> None:
        self.client_received = metrics.client_received.labels(dialect)
        self.client_sent = metrics.client_sent.labels(dialect)
        self.duration = metrics.duration.labels(dialect)
        self.prepare = metrics.prepare.labels(dialect)
        self.upstream_ttfb = metrics.upstream_ttfb.labels(dialect)
        self.added_ttfb = metrics.added_ttfb.labels(dialect)
        self.streamed = metrics.streamed.labels(dialect)
        self.inspected = metrics.inspected.labels(dialect)


class Metrics:
    """Every metric of one running cg, in its own registry (tests run several cg in one process)."""

    def __init__(self, tenants: bool = False, registry: CollectorRegistry | None = None) -> None:
        self.tenants = tenants
        self.registry = registry if registry is not None else CollectorRegistry()
        reg = self.registry

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, labels, registry=reg)

        def gauge(name: str, doc: str, mode: _Mode, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, doc, labels, registry=reg, multiprocess_mode=mode)

        def histogram(name: str, doc: str, buckets: tuple[float, ...], labels: tuple[str, ...]) -> Histogram:
            return Histogram(name, doc, labels, registry=reg, buckets=buckets)

        tenant = ("tenant",) if tenants else ()
        gauge("cg_build_info", "cg's version (always 1).", "max", ("version",)).labels(__version__).set(1)

        # From each exchange's record.
        self.requests = counter(
            "cg_requests", "Client requests cg forwarded (and 413s for bodies over --max-body), counted at their "
            "end, by the status the client got (499: no response head). Paths other than the known API paths "
            "are 'other'.", ("dialect", "path", "status", *tenant))
        self.added_ttfb = histogram(
            "cg_added_ttfb_seconds", "cg's own share of a client's time to first byte: preparing the request, "
            "and from the upstream's first body byte to cg's first write.", _ADDED_BUCKETS, ("dialect",))
        self.prepare = histogram(
            "cg_prepare_seconds", "From a request's arrival to its sending upstream: repair, compaction, tool "
            "injection and storing new originals first.", _ADDED_BUCKETS, ("dialect",))
        self.upstream_ttfb = histogram(
            "cg_upstream_ttfb_seconds", "From sending a request upstream to the upstream's response head.",
            _UPSTREAM_BUCKETS, ("dialect",))
        self.duration = histogram(
            "cg_request_duration_seconds", "From a request's arrival to its response's end.",
            _UPSTREAM_BUCKETS, ("dialect",))
        self.streamed = counter("cg_streamed_responses", "Responses that were event streams.", ("dialect",))
        self.inspected = counter(
            "cg_inspected_streams", "Streams the inspector read (expand was injected).", ("dialect",))
        self.spliced = counter(
            "cg_spliced_streams", "Streams into which cg spliced a continuation after an expand call.",
            ("dialect",))
        self.held_events = counter(
            "cg_held_events", "Stream events cg held back while deciding on an expand call.", ("dialect",))
        self.released = counter(
            "cg_stream_releases", "Holds released to the client as they came, by why.", ("dialect", "reason"))
        self.upstream_errors = counter(
            "cg_upstream_errors", "Requests whose upstream failed: upstream_error (no response: refused, "
            "timed out, not HTTP) or upstream_broke (the body broke off).", ("dialect", "outcome"))
        self.client_disconnects = counter(
            "cg_client_disconnects", "Requests whose client went away before the response ended.", ("dialect",))
        self.expand_rounds = counter(
            "cg_expand_rounds", "Continuation rounds cg ran upstream for expand calls.", ("dialect",))
        self.continuations_failed = counter(
            "cg_expand_continuations_failed", "Responses whose expand loop gave up: the client got the rounds "
            "so far.", ("dialect",))
        self.billed = counter(
            "cg_billed_tokens", "Tokens the provider billed, over every round, by kind.",
            ("dialect", "kind", *tenant))
        self.client_received = counter(
            "cg_client_received_bytes", "Request bodies as clients sent them.", ("dialect",))
        self.client_sent = counter("cg_client_sent_bytes", "Response bodies as cg wrote them.", ("dialect",))
        # Store calls, timed on the IStore surface (cg.web.metrics.MeteredStore): any backend.
        self.store_seconds = histogram(
            "cg_store_operation_seconds", "Store calls from the request path (and the size read every 10 s), "
            "from call to answer (queueing included), by operation; the count is the number of calls.", _STORE_BUCKETS, ("operation",))
        self._store_operations = {op: self.store_seconds.labels(op) for op in STORE_OPERATIONS}

        # Mirrored from /stats' plain ints.
        self.in_flight = gauge("cg_requests_in_flight", "Client requests being forwarded now.", "livesum")
        self.store_healthy = gauge(
            "cg_store_healthy", "1 while the store reads and writes, 0 while it fails (cg then fails open: "
            "no lossy offload).", "livemin")
        self.store_size = {
            field: gauge(name, doc, "livemostrecent") for field, name, doc in (
                ("entries", "cg_store_entries", "Originals in the store (read every 10 s)."),
                ("bytes", "cg_store_size_bytes", "Bytes of originals in the store (read every 10 s)."),
                ("frozen_entries", "cg_store_frozen_entries", "Frozen repair texts in the store."),
                ("frozen_bytes", "cg_store_frozen_size_bytes", "Bytes of frozen repair texts in the store."),
            )
        }
        self.memo_entries = gauge("cg_memo_entries", "Entries in the compaction memo, by table.", "livesum",
                                  ("table",))
        self.keepalive_conversations = gauge(
            "cg_keepalive_conversations", "Conversations whose prompt cache --keepalive keeps warm now.", "livesum")
        self.memo_chars = gauge("cg_memo_characters", "What the compaction memo's budget counts, by table: characters (bytes "
                                "for bodies), each decision 512 besides its text.",
                                "livesum", ("table",))
        self._requests: dict[tuple[str, ...], Counter] = {}
        self._dialects: dict[str, _Dialect] = {}
        self._mirrors: dict[tuple[str, ...], _Mirror] = {}
        self._counters: dict[str, Counter] = {}
        for name, doc, labels in _MIRRORED:
            self._counters[name] = counter(name.removesuffix("_total"), doc, labels)

        if registry is None:
            ProcessCollector(registry=reg)  # process_cpu_seconds_total, process_resident_memory_bytes, ...

    # ---------------------------------------------------------------------------------------------
    # From the record

    def exchange(self, record: ExchangeRecord, tenant: str = "") -> None:
        """One client request, at its end (its labelled series looked up once, then cached)."""
        dialect = record.dialect
        status = str(record.status or 499)
        key = (dialect, path_label(record.target), status, *((tenant,) if self.tenants else ()))
        requests = self._requests.get(key)
        if requests is None:
            requests = self._requests[key] = self.requests.labels(*key)
        requests.inc()
        d = self._dialects.get(dialect)
        if d is None:
            d = self._dialects[dialect] = _Dialect(self, dialect)
        d.client_received.inc(record.bytes_in)
        d.client_sent.inc(record.bytes_out)
        d.duration.observe(record.t_ended - record.t_received)
        if record.t_sent is not None:
            d.prepare.observe(record.t_sent - record.t_received)
            if record.t_headers is not None:
                d.upstream_ttfb.observe(record.t_headers - record.t_sent)
        if record.added_ttfb is not None:
            d.added_ttfb.observe(record.added_ttfb)
        if record.outcome in ("upstream_error", "upstream_broke"):
            self.upstream_errors.labels(dialect, record.outcome).inc()
        elif record.outcome == "client_gone":
            self.client_disconnects.labels(dialect).inc()
        if record.expand_rounds:
            self.expand_rounds.labels(dialect).inc(record.expand_rounds)
        if record.continuation_failed is not None:
            self.continuations_failed.labels(dialect).inc()
        if record.stream and record.t_headers is not None:
            d.streamed.inc()
            inspected = record.inspected
            if inspected is not None:
                d.inspected.inc()
                if inspected.spliced:
                    self.spliced.labels(dialect).inc()
                if inspected.held_events:
                    self.held_events.labels(dialect).inc(inspected.held_events)
                if inspected.released:
                    self.released.labels(dialect, inspected.released).inc()
        usage = record.usage
        if usage is not None:
            for kind, tokens in zip(USAGE_KINDS, (usage.input_tokens, usage.cache_read_tokens,
                                                  usage.cache_write_tokens, usage.output_tokens)):
                if tokens:
                    labels = (dialect, kind, tenant) if self.tenants else (dialect, kind)
                    self.billed.labels(*labels).inc(tokens)

    def refused(self, dialect: str, target: str, status: int, tenant: str = "") -> None:
        """A request cg answered itself instead of forwarding it (a 413)."""
        labels = (dialect, path_label(target), str(status))
        self.requests.labels(*labels, *((tenant,) if self.tenants else ())).inc()

    def store_operation(self, operation: str, seconds: float) -> None:
        self._store_operations[operation].observe(seconds)

    # ---------------------------------------------------------------------------------------------
    # Mirrored

    def _follow(self, name: str, value: int, *labels: str) -> None:
        key = (name, *labels)
        mirror = self._mirrors.get(key)
        if mirror is None:
            counter = self._counters[name]
            mirror = self._mirrors[key] = _Mirror(counter.labels(*labels) if labels else counter)
        mirror.follow(value)

    def sync(self, stats: Stats) -> None:
        """Bring the mirrored metrics up to /stats' ints (cheap: a comparison each)."""
        follow = self._follow
        follow("cg_upstream_retries_total", stats.upstream_retries)
        follow("cg_bypassed_requests_total", stats.bypassed)
        follow("cg_upstream_sent_bytes_total", stats.bytes_to_upstream)
        follow("cg_upstream_received_bytes_total", stats.bytes_from_upstream)
        self.in_flight.set(stats.in_flight)
        compaction = stats.compaction
        follow("cg_compaction_requests_rewritten_total", compaction.requests_rewritten)
        follow("cg_compaction_requests_injected_total", compaction.requests_injected)
        follow("cg_compaction_tokens_before_total", compaction.tokens_before)
        follow("cg_compaction_tokens_after_total", compaction.tokens_before - compaction.saved)
        follow("cg_compaction_unique_saved_tokens_total", compaction.saved_unique)
        follow("cg_compaction_input_requests_total", compaction.input_requests)
        follow("cg_compaction_input_client_bytes_total", compaction.input_bytes_client)
        follow("cg_compaction_input_forwarded_bytes_total", compaction.input_bytes_forwarded)
        follow("cg_store_fail_open_total", compaction.store_fail_open)
        for event in COLD_EVENTS:
            follow("cg_cold_policy_total", getattr(compaction.cold, event), event)
        for name, component in compaction.components.items():
            follow("cg_compaction_component_runs_total", component.runs, name)
            follow("cg_compaction_component_acted_total", component.acted, name)
            follow("cg_compaction_component_reverted_total", component.reverted, name)
            follow("cg_compaction_component_saved_tokens_total", component.saved_tokens, name)
        expand = stats.expand
        for outcome in EXPAND_OUTCOMES:
            follow("cg_expand_calls_total", getattr(expand, outcome), outcome)
        follow("cg_expand_original_tokens_total", expand.wasted_tokens)
        follow("cg_expand_repairs_total", expand.repairs)
        follow("cg_expand_hidden_turns_total", expand.hidden_kept, "kept")
        follow("cg_expand_hidden_turns_total", expand.hidden_restored, "restored")
        follow("cg_changelog_errors_total", getattr(stats.changelog, "errors", 0))
        store = stats.store
        if store is not None:
            # StoreStats (cg.store.base, which this layer does not import): every backend's counters.
            follow("cg_store_writes_total", getattr(store, "writes", 0))
            follow("cg_store_errors_total", getattr(store, "write_errors", 0), "write")
            follow("cg_store_errors_total", getattr(store, "read_errors", 0), "read")
            follow("cg_store_reads_total", getattr(store, "hits", 0), "hit")
            follow("cg_store_reads_total", getattr(store, "misses", 0), "miss")
            follow("cg_store_evictions_total", getattr(store, "evictions", 0))
            self.store_healthy.set(1 if getattr(store, "healthy", True) else 0)
        info = stats.store_info
        if info is not None:
            for field, gauge in self.store_size.items():
                gauge.set(getattr(info, field))
        keepalive = stats.keepalive
        follow("cg_keepalive_pings_total", keepalive.pings)
        follow("cg_keepalive_ping_failures_total", keepalive.pings_failed)
        ping_usage = keepalive.usage
        for kind, tokens in zip(USAGE_KINDS, (ping_usage.input_tokens, ping_usage.cache_read_tokens,
                                              ping_usage.cache_write_tokens, ping_usage.output_tokens)):
            follow("cg_keepalive_billed_tokens_total", tokens, kind)
        for why, ended in keepalive.ended.items():
            follow("cg_keepalive_ended_total", ended, why)
        self.keepalive_conversations.set(keepalive.conversations)
        memo = stats.memo
        if memo is not None:
            tables: tuple[MemoTable, ...] = (memo.decisions, memo.bodies)
            for table, bounded in zip(MEMO_TABLES, tables):
                follow("cg_memo_hits_total", bounded.hits, table)
                follow("cg_memo_misses_total", bounded.misses, table)
                self.memo_entries.labels(table).set(len(bounded))
                self.memo_chars.labels(table).set(bounded.chars)


# Counters that follow /stats' ints: (name as exposed, help, labels).
_MIRRORED: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("cg_upstream_retries_total", "Upstream requests retried on a fresh connection (a pooled one was "
     "closed under them).", ()),
    ("cg_bypassed_requests_total", "Requests sent with x-cg-bypass: 1, forwarded as received.", ()),
    ("cg_upstream_sent_bytes_total", "Request bodies cg sent upstream, every round.", ()),
    ("cg_upstream_received_bytes_total", "Response bodies cg read from upstreams, as received.", ()),
    ("cg_compaction_requests_rewritten_total", "Requests whose tool results compaction changed.", ()),
    ("cg_compaction_requests_injected_total", "Requests cg added the expand tool to.", ()),
    ("cg_compaction_tokens_before_total", "Estimated tokens of the tool results cg rewrote, as the client "
     "sent them (each result once per request).", ()),
    ("cg_compaction_tokens_after_total", "Estimated tokens of the same tool results as cg forwarded them.",
     ()),
    ("cg_compaction_unique_saved_tokens_total", "Estimated tokens saved, each component and content counted "
     "once per process (a lower bound after 200,000 of them).", ()),
    ("cg_compaction_input_requests_total", "Request bodies cg parsed to rewrite, changed or not.", ()),
    ("cg_compaction_input_client_bytes_total", "Those bodies as the client sent them.", ()),
    ("cg_compaction_input_forwarded_bytes_total", "Those bodies as cg forwarded them.", ()),
    ("cg_store_fail_open_total", "Requests whose new originals went whole (lossy offload skipped) because "
     "the store could not keep them.", ()),
    ("cg_cold_policy_total", "The cache-aware policy's requests, by event: checked, cold (the conversation's "
     "cache had expired), epochs (re-decisions frozen), applied (decided under one), unknown (the store could "
     "not say), known_warm (surely warm: the store not asked).", ("event",)),
    ("cg_compaction_component_runs_total", "Tool results a component ran on (a re-sent result counts again).",
     ("component",)),
    ("cg_compaction_component_acted_total", "Tool results a component rewrote.", ("component",)),
    ("cg_compaction_component_reverted_total", "Rewrites undone: the component raised, broke the contract "
     "or saved nothing.", ("component",)),
    ("cg_compaction_component_saved_tokens_total", "Estimated tokens a component's own step saved.",
     ("component",)),
    ("cg_expand_calls_total", "Originals the model asked for with the expand tool, by outcome.", ("outcome",)),
    ("cg_expand_original_tokens_total", "Estimated tokens of originals sent back to the model.", ()),
    ("cg_expand_repairs_total", "Client answers to expand calls replaced by the original.", ()),
    ("cg_expand_hidden_turns_total", "Hidden expand turns a continuation's thinking follows: kept (responses), "
     "restored (request messages).", ("event",)),
    ("cg_changelog_errors_total", "Change-log records lost (the file could not be written).", ()),
    ("cg_store_writes_total", "Originals written to the store.", ()),
    ("cg_store_errors_total", "Store reads and writes that failed, by operation.", ("operation",)),
    ("cg_store_reads_total", "Originals looked up in the store, by result (hit or miss).", ("result",)),
    ("cg_store_evictions_total", "Originals evicted from the store (least recently used first).", ()),
    ("cg_keepalive_pings_total", "Keep-alive pings sent to the provider (--keepalive).", ()),
    ("cg_keepalive_ping_failures_total", "Keep-alive pings answered non-2xx or not at all; each ends its "
     "conversation's keep-alive.", ()),
    ("cg_keepalive_billed_tokens_total", "Tokens the provider billed for keep-alive pings, by kind (mostly "
     "cache_read).", ("kind",)),
    ("cg_keepalive_ended_total", "Conversations whose keep-alive ended, by why (idle, budget, forecast, failed, "
     "missed, refused, ineligible, evicted, stopped, gone).", ("reason",)),
    ("cg_memo_hits_total", "Compaction memo lookups that found an entry, by table.", ("table",)),
    ("cg_memo_misses_total", "Compaction memo lookups that did not, by table.", ("table",)),
)
