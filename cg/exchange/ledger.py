"""The ledger's rows: what cg keeps of every request it forwarded, for the dashboard (`GET /cg/`),
its API (`/cg/api/…`) and `cg-report --store`, in the store it already has.

Pure data, written once per request when its exchange ends (a `Turn`, and a `Change` per tool
result compaction rewrote), and the rollups and summaries a store keeps from them
(`cg.store.base.ILedger`).

Figures are the ones cg can back: billed tokens as the provider reported them, costs at list price
(`cg.record.pricing`), sizes as cg's token estimator counts them. A figure cg could not measure is
None (or 0 for counts), never a guess.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from cg.stream.usage import Usage

# Who sent a request, by its user-agent.
CLIENTS = ("claude-code", "codex", "sdk", "other")

# What a turn was (`Turn.kind`): a request a client sent, or a keep-alive ping cg sent on its own
# (cg.web.keepalive), billed like any request but counted apart: it is cg's spending, not the client's.
REQUEST = "request"
PING = "ping"

# Why a turn wrote more to the provider's prompt cache than it read (`Turn.verdict`):
EXPECTED = "expected"  # the conversation's first turn, or only new content was written
EXPIRED = "expired"  # the previous request came longer ago than the cache's lifetime
CLIENT_PREFIX = "client_prefix"  # the client's body stops extending the last one inside the cached part
CG_PREFIX = "cg_prefix"  # cg's forwarded body does, though the client's does not (an epoch; else a bug)
KEPT_WARM = "kept_warm"  # a keep-alive ping bridged the gap (the turn read what the ping kept)
VERDICTS = (EXPECTED, EXPIRED, CLIENT_PREFIX, CG_PREFIX, KEPT_WARM)

MINUTE = 60.0
HOUR = 3600.0
DEFAULT_DAYS = 30  # --ledger-days: how long rollups and conversation summaries are kept
DEFAULT_MAX_TURNS = 100_000  # per-request rows kept, newest first

# How `ILedger.conversations` may order its rows (always descending: newest, biggest first).
ORDERS = ("last", "first", "requests", "tokens_before", "tokens_after", "cost")


@attrs.frozen
class Turn:
    """One request cg forwarded (a row of the ledger), as it ended."""

    time: float  # Unix time the request arrived
    seq: int  # its number in the change log (unique per process start)
    tenant: str  # "" without --tenant
    conversation: str  # the session key (cg.stream.usage.session_key): "-" when none
    client: str  # one of CLIENTS
    model: str | None
    dialect: str  # anthropic, openai, responses
    path: str
    status: int | None
    outcome: str  # ExchangeRecord.outcome
    tokens_before: int  # the whole request as the client sent it (estimated)
    tokens_after: int  # as cg forwarded it
    results_before: int  # the tool results compaction rewrote, as sent
    results_after: int  # and as forwarded
    billed: Usage | None  # over every round; None when the response's usage could not be read
    cost_via_cg: float | None  # USD at list price, of what was billed; None when not billed
    cost_direct: float | None  # USD the same turn would have cost as the client sent it (estimated)
    expand_rounds: int = 0
    repairs: int = 0
    epoch: bool = False  # decided under a cache-aware epoch
    verdict: str | None = None  # one of VERDICTS, for a turn that wrote more than it read
    verdict_detail: str = ""  # "idle 7m12s", "messages[3].content[0]", "epoch 2", …
    added_ms: float | None = None  # cg's own share of the client's time to first byte
    cache_until: float | None = None  # when the conversation's prompt cache expires after this turn
    kind: str = REQUEST  # REQUEST or PING; last, so that rows written before it read back as requests


@attrs.frozen
class Change:
    """One tool result compaction rewrote in a request (the change log's compaction line)."""

    seq: int
    message: int
    block: int | None
    tool: str | None
    component: str
    lossy: bool
    marker: str | None  # the marker ID behind which the original is stored, for a lossy one
    tokens_before: int
    tokens_after: int
    # What cg-report needs to count as it does from the change log (cg.compaction.pipeline.Change):
    # the result's content ID (a reformat is counted once by it), the text part's index, and the
    # step among the components that rewrote the result (step 0's tokens_before is its size as sent).
    content_id: str | None = None
    part: int | None = None
    step: int | None = None


@attrs.frozen
class Totals:
    """A sum of turns: what the overview and the API's summary show. Keep-alive pings are counted in
    ``pings`` and ``cost_pings`` only: every other figure is the clients' requests'."""

    requests: int = 0
    tokens_before: int = 0
    tokens_after: int = 0
    results_before: int = 0
    results_after: int = 0
    billed: Usage = Usage()
    cost_via_cg: float = 0.0
    cost_direct: float = 0.0
    expand_rounds: int = 0
    repairs: int = 0
    pings: int = 0
    cost_pings: float = 0.0  # USD at list price of what the pings were billed

    def __add__(self, other: Totals) -> Totals:
        return Totals(self.requests + other.requests, self.tokens_before + other.tokens_before,
                      self.tokens_after + other.tokens_after, self.results_before + other.results_before,
                      self.results_after + other.results_after, self.billed + other.billed,
                      self.cost_via_cg + other.cost_via_cg, self.cost_direct + other.cost_direct,
                      self.expand_rounds + other.expand_rounds, self.repairs + other.repairs,
                      self.pings + other.pings, self.cost_pings + other.cost_pings)

    def add(self, turn: Turn) -> Totals:
        """These totals and `turn`'s (field by field: a store adds three a request, on its worker)."""
        if turn.kind == PING:
            return attrs.evolve(self, pings=self.pings + 1, cost_pings=self.cost_pings + (turn.cost_via_cg or 0.0))
        return Totals(self.requests + 1, self.tokens_before + turn.tokens_before,
                      self.tokens_after + turn.tokens_after, self.results_before + turn.results_before,
                      self.results_after + turn.results_after,
                      self.billed if turn.billed is None else self.billed + turn.billed,
                      self.cost_via_cg + (turn.cost_via_cg or 0.0), self.cost_direct + (turn.cost_direct or 0.0),
                      self.expand_rounds + turn.expand_rounds, self.repairs + turn.repairs,
                      self.pings, self.cost_pings)


@attrs.frozen
class Bucket:
    """Totals of the turns that arrived in [start, start + width) (width MINUTE or HOUR), for one
    (tenant, client, model): the rollups a time chart and a breakdown read."""

    start: float
    width: float
    tenant: str
    client: str
    model: str | None
    totals: Totals


@attrs.frozen
class Conversation:
    """A conversation's summary row: its turns summed, and its cache's state as cg last knew it."""

    id: str
    tenant: str
    client: str
    model: str | None
    first: float
    last: float
    totals: Totals
    cache_until: float | None = None  # when its prompt cache expires: the latest of its turns' and pings'
    kept_warm: bool = False  # a keep-alive ping extended it since its last request


def order_key(order: str) -> Callable[[Conversation], float]:
    """How `ILedger.conversations` sorts for `order` (one of ORDERS), descending."""
    return _ORDER_KEYS[order]


_ORDER_KEYS: dict[str, Callable[[Conversation], float]] = {
    "last": lambda c: c.last,
    "first": lambda c: c.first,
    "requests": lambda c: c.totals.requests,
    "tokens_before": lambda c: c.totals.tokens_before,
    "tokens_after": lambda c: c.totals.tokens_after,
    "cost": lambda c: c.totals.cost_via_cg,
}
assert tuple(_ORDER_KEYS) == ORDERS


def bucket_start(time: float, width: float) -> float:
    """The start of the bucket of `width` seconds that `time` falls in."""
    return time - time % width
