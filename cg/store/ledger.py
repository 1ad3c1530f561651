"""The ledger in process memory (`MemoryLedger`): the reference every backend's ledger is tested
against, and the memory store's own. Nothing survives; every Deferred has fired."""

from __future__ import annotations

import json
import operator
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import ujson
from twisted.internet.defer import Deferred, succeed
from zope.interface import implementer

from cg.exchange.ledger import (
    DEFAULT_DAYS,
    DEFAULT_MAX_TURNS,
    HOUR,
    MINUTE,
    PING,
    Bucket,
    Change,
    Conversation,
    Totals,
    Turn,
    bucket_start,
    order_key,
)
from cg.store.base import ILedger
from cg.stream.usage import Usage

_BucketKey = tuple[float, float, str, str, "str | None"]  # (start, width, tenant, client, model)


@implementer(ILedger)
@attrs.define
class MemoryLedger:
    """`ILedger` in memory. A turn's conversation summary and rollups are kept as long as the
    rollups (`days`); the turns themselves, the newest `max_turns`."""

    days: float = DEFAULT_DAYS
    max_turns: int = DEFAULT_MAX_TURNS
    clock: Callable[[], float] = time.time
    _turns: deque[tuple[Turn, tuple[Change, ...]]] = attrs.field(factory=deque, init=False)
    _buckets: dict[_BucketKey, Totals] = attrs.field(factory=dict, init=False)
    _conversations: dict[tuple[str, str], Conversation] = attrs.field(factory=dict, init=False)  # (tenant, id) ->

    def record(self, turn: Turn, changes: Sequence[Change]) -> None:
        self._turns.append((turn, tuple(changes)))
        while len(self._turns) > self.max_turns:
            self._turns.popleft()
        for width in (MINUTE, HOUR):
            key = (bucket_start(turn.time, width), width, turn.tenant, turn.client, turn.model)
            self._buckets[key] = self._buckets.get(key, Totals()).add(turn)
        if turn.conversation == "-":
            return
        ckey = (turn.tenant, turn.conversation)
        known = self._conversations.get(ckey)
        if turn.kind == PING:  # counted on its conversation's row, which it neither makes nor makes active
            if known is not None:
                self._conversations[ckey] = attrs.evolve(
                    known, totals=known.totals.add(turn), cache_until=_later(known.cache_until, turn.cache_until),
                    kept_warm=True)
            return
        if known is None:
            known = Conversation(turn.conversation, turn.tenant, turn.client, turn.model, turn.time, turn.time,
                                 Totals())
        self._conversations[ckey] = attrs.evolve(
            known, model=turn.model or known.model, first=min(known.first, turn.time), last=max(known.last, turn.time),
            totals=known.totals.add(turn), cache_until=_later(known.cache_until, turn.cache_until), kept_warm=False)

    def totals(self, tenant: str | None, since: float | None) -> Deferred[Totals]:
        total = Totals()
        for bucket in self._selected(tenant, MINUTE if since is not None else HOUR, since):
            total = total + bucket.totals
        return succeed(total)

    def buckets(self, tenant: str | None, since: float, width: float) -> Deferred[list[Bucket]]:
        return succeed(sorted(self._selected(tenant, width, since), key=lambda b: (b.start, b.tenant, b.client,
                                                                                  b.model or "")))

    def conversations(self, tenant: str | None, offset: int, limit: int,
                      order: str = "last") -> Deferred[tuple[list[Conversation], int]]:
        rows = sorted((c for (t, _), c in self._conversations.items() if tenant is None or t == tenant),
                      key=order_key(order), reverse=True)
        return succeed((rows[offset:offset + limit], len(rows)))

    def conversation(self, tenant: str | None, id: str) -> Deferred[tuple[Conversation, list[Turn], list[Change]] | None]:
        found = [c for (t, i), c in self._conversations.items() if i == id and (tenant is None or t == tenant)]
        if not found:
            return succeed(None)
        summary = max(found, key=lambda c: c.last)
        turns = [(turn, changes) for turn, changes in self._turns
                 if turn.conversation == id and turn.tenant == summary.tenant]
        turns.sort(key=lambda pair: (pair[0].time, pair[0].seq))
        return succeed((summary, [turn for turn, _ in turns], [c for _, changes in turns for c in changes]))

    def turns(self) -> Deferred[list[tuple[Turn, Sequence[Change]]]]:
        rows: list[tuple[Turn, Sequence[Change]]] = list(self._turns)
        rows.sort(key=lambda pair: (pair[0].time, pair[0].seq))
        return succeed(rows)

    def trim(self, now: float) -> Deferred[int]:
        horizon = now - self.days * 86400.0
        gone = [key for key in self._buckets if key[0] + key[1] <= horizon]
        for key in gone:
            del self._buckets[key]
        old = [ckey for ckey, c in self._conversations.items() if c.last < horizon]
        for ckey in old:
            del self._conversations[ckey]
        before = len(self._turns)
        while self._turns and self._turns[0][0].time < horizon:
            self._turns.popleft()
        return succeed(len(gone) + len(old) + before - len(self._turns))

    def _selected(self, tenant: str | None, width: float, since: float | None) -> list[Bucket]:
        """The buckets of `width` from `since` on. A minute bucket straddling `since` counts whole."""
        return [Bucket(start, w, t, client, model, totals)
                for (start, w, t, client, model), totals in self._buckets.items()
                if w == width and (tenant is None or t == tenant) and (since is None or start + w > since)]



def _later(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)


# What a backend keeps of a `Totals`, in this order: flat numbers, so that a row (SQLite) or a packed
# string (Redis) adds up field by field.
# Fields are only appended (a row or a packed string written before one was added reads it as 0).
FLAT = ("requests", "tokens_before", "tokens_after", "results_before", "results_after", "input", "cache_read",
        "cache_write", "cache_write_1h", "output", "cost_via_cg", "cost_direct", "expand_rounds", "repairs",
        "pings", "cost_pings")


def flatten(totals: Totals) -> tuple[float, ...]:
    """`totals` as FLAT's numbers, in that order."""
    billed = totals.billed
    return (totals.requests, totals.tokens_before, totals.tokens_after, totals.results_before, totals.results_after,
            billed.input_tokens, billed.cache_read_tokens, billed.cache_write_tokens, billed.cache_write_1h_tokens,
            billed.output_tokens, totals.cost_via_cg, totals.cost_direct, totals.expand_rounds, totals.repairs,
            totals.pings, totals.cost_pings)


def unflatten(n: Sequence[Any]) -> Totals:
    """The `Totals` of `flatten`'s numbers, read back (counts as ints, costs as floats; FLAT's later
    fields 0 when `n` was written before them)."""
    n = [*n, *(0,) * (len(FLAT) - len(n))]
    return Totals(n[0], n[1], n[2], n[3], n[4], Usage(n[5], n[6], n[7], n[9], n[8]), n[10], n[11], n[12], n[13],
                  n[14], n[15])


def unpack(packed: bytes) -> Totals:
    """The `Totals` of `flatten`'s numbers as text, comma-separated (a Redis rollup's)."""
    n = packed.split(b",")
    try:
        return unflatten([float(v) if i in _COSTS else int(v) for i, v in enumerate(n)])
    except ValueError:  # a count written with an exponent (past 1e14)
        return unflatten([float(v) if i in _COSTS else int(float(v)) for i, v in enumerate(n)])


_COSTS = (FLAT.index("cost_via_cg"), FLAT.index("cost_direct"), FLAT.index("cost_pings"))
assert _COSTS == (10, 11, 15)


def dump_turn(turn: Turn, changes: Sequence[Change]) -> str:
    """A turn and its changes as one JSON text (a backend's turn row). Written for every request on
    the store's worker: fields read by `operator.attrgetter`, at a tenth of `attrs.astuple`'s cost."""
    return ujson.dumps([_turn_values(turn), [_CHANGE_VALUES(c) for c in changes]])


def _turn_values(turn: Turn) -> list[object]:
    values = list(_TURN_VALUES(turn))
    values[_BILLED] = None if turn.billed is None else _USAGE_VALUES(turn.billed)
    return values


_TURN_VALUES = operator.attrgetter(*(f.name for f in attrs.fields(Turn)))
_CHANGE_VALUES = operator.attrgetter(*(f.name for f in attrs.fields(Change)))
_USAGE_VALUES = operator.attrgetter(*(f.name for f in attrs.fields(Usage)))


def load_turn(text: str | bytes) -> tuple[Turn, list[Change]]:
    values, changes = json.loads(text)
    billed = values[_BILLED]
    values[_BILLED] = None if billed is None else Usage(*billed)
    return Turn(*values), [Change(*c) for c in changes]


_BILLED = [f.name for f in attrs.fields(Turn)].index("billed")


def spans(since: float | None) -> tuple[float | None, float]:
    """How `ILedger.totals` reads the rollups cheaply: (the minute buckets from this start up to the
    second value, None: none), then the hour buckets from the second value on. The minutes that end
    after `since` are the minute buckets up to the next whole hour, and whole hours after it."""
    if since is None:
        return None, float("-inf")
    first = bucket_start(since, MINUTE)
    hour = bucket_start(first, HOUR)
    return first, hour if hour == first else hour + HOUR


Op = tuple[Turn, tuple[Change, ...]]  # a record(), as it came


@attrs.define
class Summary:
    """What one batch adds to a conversation's summary row."""

    tenant: str
    id: str
    client: str | None = None  # None: the batch holds no request of it, only pings (they add to a known row)
    model: str | None = None
    first: float = float("inf")
    last: float = float("-inf")
    totals: Totals = Totals()
    cache_until: float | None = None
    kept_warm: bool = False  # a ping came after its last turn in the batch


@attrs.define
class Batch:
    """`record`s summed the way a backend writes them: turn rows, rollup increments per
    (start, width, tenant, client, model), and one `Summary` per conversation, in the order they came."""

    turns: list[tuple[Turn, tuple[Change, ...]]] = attrs.Factory(list)
    buckets: dict[_BucketKey, Totals] = attrs.Factory(dict)
    conversations: dict[tuple[str, str], Summary] = attrs.Factory(dict)

    @classmethod
    def of(cls, ops: Sequence[Op]) -> Batch:
        batch = cls()
        for turn, changes in ops:
            batch.add(turn, changes)
        return batch

    def add(self, turn: Turn, changes: tuple[Change, ...]) -> None:
        self.turns.append((turn, changes))
        for width in (MINUTE, HOUR):
            key = (bucket_start(turn.time, width), width, turn.tenant, turn.client, turn.model)
            self.buckets[key] = self.buckets.get(key, Totals()).add(turn)
        if turn.conversation == "-":
            return
        summary = self.conversations.setdefault((turn.tenant, turn.conversation),
                                                Summary(turn.tenant, turn.conversation))
        summary.totals = summary.totals.add(turn)
        summary.cache_until = _later(summary.cache_until, turn.cache_until)
        if turn.kind == PING:  # as MemoryLedger.record: no new row, no activity
            summary.kept_warm = True
            return
        summary.client = summary.client or turn.client
        summary.model = turn.model or summary.model
        summary.first, summary.last = min(summary.first, turn.time), max(summary.last, turn.time)
        summary.kept_warm = False
