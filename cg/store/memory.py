"""The in-memory store, for tests: nothing survives, every Deferred has fired."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

import attrs
from twisted.internet.defer import Deferred, succeed
from zope.interface import implementer

from cg.store.base import CACHE_RECORD_DAYS, DEFAULT_MAX_BYTES, EVICT_TO, IStore, StoreInfo, StoreStats
from cg.store.ledger import MemoryLedger

# Seconds between sweeps of expired cache records: days old when they go, they need no hurry.
_SWEEP_EVERY = 3600.0


@implementer(IStore)
@attrs.define
class MemoryStore:
    """IStore in process memory, for tests: nothing survives, every Deferred has fired, and
    it is always healthy."""

    max_bytes: int = DEFAULT_MAX_BYTES
    clock: Callable[[], float] = time.time
    stats: StoreStats = attrs.field(factory=StoreStats, init=False)
    ledger: MemoryLedger = attrs.field(factory=MemoryLedger)  # the dashboard's rows (cg.exchange.ledger)
    # Both least recently used first; values are (body, last use).
    _originals: OrderedDict[tuple[str, str], tuple[bytes, float]] = attrs.field(
        factory=OrderedDict, init=False
    )
    _frozen: OrderedDict[tuple[str, str], tuple[bytes, float]] = attrs.field(
        factory=OrderedDict, init=False
    )
    _total: int = attrs.field(default=0, init=False)
    _caches: dict[tuple[str, str], float] = attrs.field(factory=dict, init=False)
    _caches_swept: float = attrs.field(default=float("-inf"), init=False)

    def _use(self, table: OrderedDict[tuple[str, str], tuple[bytes, float]], key: tuple[str, str]) -> None:
        table[key] = (table[key][0], self.clock())
        table.move_to_end(key)

    def _evict(self, protect: set[tuple[str, str]]) -> None:
        """Same policy as SQLiteDB._evict: originals by LRU, frozen texts last."""
        if self._total <= self.max_bytes:
            return
        for table in (self._originals, self._frozen):
            for key in list(table):
                if self._total <= self.max_bytes * EVICT_TO:
                    return
                if key not in protect:
                    self._total -= len(table.pop(key)[0])
                    self.stats.evictions += 1

    def put(self, tenant: str, originals: dict[str, bytes]) -> Deferred[set[str]]:
        written = set()
        for id_, body in originals.items():
            key = (tenant, id_)
            if key in self._originals:
                self._use(self._originals, key)
            else:
                self._originals[key] = (bytes(body), self.clock())
                self._total += len(body)
                written.add(id_)
        self._evict({(tenant, id_) for id_ in originals})
        self.stats.writes += len(written)
        return succeed(written)

    def known(self, tenant: str, ids: Iterable[str]) -> set[str]:
        return {id_ for id_ in ids if (tenant, id_) in self._originals}

    def touch(self, tenant: str, ids: Iterable[str], frozen: Iterable[str] = ()) -> None:
        for table, names in ((self._originals, ids), (self._frozen, frozen)):
            for name in names:
                if (tenant, name) in table:
                    self._use(table, (tenant, name))

    def get(self, tenant: str, id: str) -> Deferred[bytes | None]:
        self.stats.reads += 1
        if (tenant, id) not in self._originals:
            self.stats.misses += 1
            return succeed(None)
        self.stats.hits += 1
        self._use(self._originals, (tenant, id))
        return succeed(self._originals[tenant, id][0])

    def freeze(self, tenant: str, key: str, text: bytes) -> Deferred[bytes]:
        if (tenant, key) in self._frozen:
            self._use(self._frozen, (tenant, key))
        else:
            self._frozen[tenant, key] = (bytes(text), self.clock())
            self._total += len(text)
            self._evict({(tenant, key)})
        return succeed(self._frozen[tenant, key][0])

    def frozen(self, tenant: str, key: str) -> Deferred[bytes | None]:
        if (tenant, key) not in self._frozen:
            return succeed(None)
        self._use(self._frozen, (tenant, key))
        return succeed(self._frozen[tenant, key][0])

    def cache_until(self, tenant: str, key: str, until: float) -> Deferred[float | None]:
        now = self.clock()
        if now - self._caches_swept >= _SWEEP_EVERY:  # a scan of every record: not on every request
            self._caches_swept = now
            stale = now - CACHE_RECORD_DAYS * 86400
            for old in [k for k, recorded in self._caches.items() if recorded < stale]:
                del self._caches[old]
        before = self._caches.get((tenant, key))
        if before is None or before < until:
            self._caches[tenant, key] = until
        return succeed(before)

    def info(self) -> Deferred[StoreInfo]:
        uses = [used for _, used in self._originals.values()]
        return succeed(
            StoreInfo(
                entries=len(self._originals),
                bytes=sum(len(body) for body, _ in self._originals.values()),
                oldest_use=min(uses, default=None),
                frozen_entries=len(self._frozen),
                frozen_bytes=sum(len(body) for body, _ in self._frozen.values()),
            )
        )

    def purge(self, older_than_days: float | None = None) -> Deferred[int]:
        cutoff = None if older_than_days is None else self.clock() - older_than_days * 86400
        count = 0
        for table in (self._originals, self._frozen):
            for key, (body, used) in list(table.items()):
                if cutoff is None or used < cutoff:
                    del table[key]
                    self._total -= len(body)
                    count += 1
        return succeed(count)

    def close(self) -> Deferred[None]:
        return succeed(None)
