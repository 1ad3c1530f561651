"""The ledger in process memory (`MemoryLedger`): the reference every backend's ledger is tested
against, and the memory store's own. Nothing survives; every Deferred has fired."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence

import attrs
from twisted.internet.defer import Deferred, succeed
from zope.interface import implementer

from cg.exchange.ledger import (
    DEFAULT_DAYS,
    DEFAULT_MAX_TURNS,
    HOUR,
    MINUTE,
    Bucket,
    Change,
    Conversation,
    Totals,
    Turn,
    bucket_start,
    order_key,
)
from cg.store.base import ILedger

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
        if known is None:
            known = Conversation(turn.conversation, turn.tenant, turn.client, turn.model, turn.time, turn.time,
                                 Totals())
        self._conversations[ckey] = attrs.evolve(
            known, model=turn.model or known.model, first=min(known.first, turn.time), last=max(known.last, turn.time),
            totals=known.totals.add(turn), cache_until=_later(known.cache_until, turn.cache_until), kept_warm=False)

    def warmed(self, tenant: str, conversation: str, until: float) -> None:
        known = self._conversations.get((tenant, conversation))
        if known is not None:
            self._conversations[(tenant, conversation)] = attrs.evolve(
                known, cache_until=_later(known.cache_until, until), kept_warm=True)

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
