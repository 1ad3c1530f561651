"""`GET /metrics`, and the store's calls timed on the IStore surface (any backend)."""

import os
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.multiprocess import MultiProcessCollector
from twisted.internet.defer import Deferred
from twisted.python.failure import Failure
from zope.interface import implementer

from cg.record.stats import Stats
from cg.store.base import ILedger, IStore, StoreInfo, StoreStats

_T = TypeVar("_T")


def render(stats: Stats, accept: str) -> tuple[bytes, str]:
    """The scrape: (body, content type), in the format `accept` asks for (Prometheus text by default).

    Under prometheus-client's multiprocess mode (PROMETHEUS_MULTIPROC_DIR set before cg starts),
    every worker's metrics, summed from their files; otherwise this process's registry.
    """
    stats.sync()
    registry = stats.metrics.registry
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if directory:
        registry = CollectorRegistry()
        MultiProcessCollector(registry, directory)  # type: ignore[no-untyped-call]  # untyped in prometheus_client
    encoder, content_type = choose_encoder(accept)
    return encoder(registry), content_type


@implementer(IStore)
class MeteredStore:
    """A store whose calls are timed into cg_store_operation_seconds (not purge: `cg-store purge`
    runs in its own process).

    Only the time: what the calls did (writes, hits, errors, health) the store counts itself
    (StoreStats), and /metrics mirrors those counters.
    """

    def __init__(self, store: IStore, observe: Callable[[str, float], None],
                 clock: Callable[[], float] = time.perf_counter):
        self._store = store
        self._observe = observe
        self._clock = clock

    @property
    def stats(self) -> StoreStats:
        stats: StoreStats = self._store.stats  # an Attribute of IStore: untyped
        return stats

    @property
    def ledger(self) -> ILedger:
        """The store's own, untimed: its writes never wait on the store (ILedger.record)."""
        ledger: ILedger = self._store.ledger  # an Attribute of IStore: untyped
        return ledger

    def _timed(self, operation: str, call: Callable[[], Deferred[_T]]) -> Deferred[_T]:
        start = self._clock()
        answer = call()

        def observed(result: _T | Failure) -> _T | Failure:
            self._observe(operation, self._clock() - start)
            return result

        return answer.addBoth(observed)

    def put(self, tenant: str, originals: dict[str, bytes]) -> Deferred[set[str]]:
        return self._timed("put", lambda: self._store.put(tenant, originals))

    def known(self, tenant: str, ids: Iterable[str]) -> set[str]:
        return self._store.known(tenant, ids)

    def touch(self, tenant: str, ids: Iterable[str], frozen: Iterable[str] = ()) -> None:
        self._store.touch(tenant, ids, frozen)

    def get(self, tenant: str, id: str) -> Deferred[bytes | None]:
        return self._timed("get", lambda: self._store.get(tenant, id))

    def freeze(self, tenant: str, key: str, text: bytes) -> Deferred[bytes]:
        return self._timed("freeze", lambda: self._store.freeze(tenant, key, text))

    def frozen(self, tenant: str, key: str) -> Deferred[bytes | None]:
        return self._timed("frozen", lambda: self._store.frozen(tenant, key))

    def cache_until(self, tenant: str, key: str, until: float) -> Deferred[float | None]:
        return self._timed("cache_until", lambda: self._store.cache_until(tenant, key, until))

    def info(self) -> "Deferred[StoreInfo]":
        return self._timed("info", self._store.info)

    def purge(self, older_than_days: float | None) -> Deferred[int]:
        return self._store.purge(older_than_days)

    def close(self) -> Deferred[None]:
        return self._store.close()
