"""What every store with blocking I/O shares (SQLite, Redis): one worker thread, and health.

A backend (``Backend``) is synchronous: it reads and writes its database and raises when it
cannot. ``Connection`` runs it on the store's worker thread and keeps the store's health as that
thread sees it; ``ThreadedStore`` is the reactor's side, the ``IStore`` itself: it submits jobs,
counts, logs and answers ``known`` from memory. Only how a backend is opened, and how it notices
that what it holds changed under it, differs between backends.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol, TypeVar, cast

import attrs
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorFromThreads, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from cg.exchange.ledger import DEFAULT_DAYS, DEFAULT_MAX_TURNS, Bucket, Change, Conversation, Totals, Turn
from cg.store.base import (
    DEFAULT_MAX_BYTES,
    ILedger,
    StoreError,
    StoreInfo,
    StoreStats,
    as_store_error,
    no_room,
)
from cg.store.ledger import Op
from cg.worker import Worker

log = Logger(namespace="cg.store")

_T = TypeVar("_T")

# Seconds between flushes of batched last-use times (and checks for changes made by
# another connection, e.g. ``cg-store purge`` or another cg).
FLUSH_INTERVAL = 2.0
# (tenant, id) pairs remembered as committed; ~200 bytes each.
KNOWN_MAX = 50_000
# An original's last use is recorded at most this often: a re-sent history names every original
# it holds on every turn, and eviction needs the order only to the minute, not a write per turn.
TOUCH_EVERY = 60.0

# (tenant, id) of originals a write evicted, and how many entries it evicted in all.
Evicted = tuple[list[tuple[str, str]], int]
# Seconds ledger rows wait on the reactor thread before they go to the worker as one batch (a query
# or close() sends them at once): one transaction a second, however many requests.
LEDGER_BATCH_DELAY = 1.0
# Ledger rows held on the reactor while the store has no room for them (a full disk, Redis at its
# maxmemory), written with the next batch once it has: ~300 bytes each. Past it, the oldest are lost.
LEDGER_HELD_MAX = 20_000
# Seconds, at most, between tries to write held rows: the wait doubles from LEDGER_BATCH_DELAY with
# each try that fails for want of room, and starts over once a write succeeds.
LEDGER_RETRY_MAX = 60.0
# Rows of each table one batch of a ledger trim deletes: each batch is its own job on the worker, so
# the store's other jobs (a request's offload) wait for one batch, not for a long downtime's trim.
TRIM_BATCH = 1000


class LedgerBackend(Protocol):
    """A backend's ledger (cg.store.sqlite_ledger, cg.store.redis_ledger), used synchronously on the
    store's thread: the queries of `ILedger`, one batch write, and a trim."""

    def write(self, ops: Sequence[Op], max_turns: int) -> None: ...

    def totals(self, tenant: str | None, since: float | None) -> Totals: ...

    def buckets(self, tenant: str | None, since: float, width: float) -> list[Bucket]: ...

    def conversations(self, tenant: str | None, offset: int, limit: int,
                      order: str) -> tuple[list[Conversation], int]: ...

    def conversation(self, tenant: str | None, id_: str) -> tuple[Conversation, list[Turn], list[Change]] | None: ...

    def turns(self) -> list[tuple[Turn, Sequence[Change]]]: ...

    def trim(self, now: float, days: float, limit: int) -> int:
        """Delete at most `limit` rows of each kind past retention: how many went."""


class Backend(Protocol):
    """A store's database, used synchronously on one thread (or by ``cg-store``)."""

    def put(self, tenant: str, originals: dict[str, bytes]) -> tuple[set[str], list[tuple[str, str]], int]:
        """Write the new originals and refresh the others' last use: (ids written, evicted...)."""

    def freeze(self, tenant: str, key: str, text: bytes) -> tuple[bytes, list[tuple[str, str]], int]:
        """Keep ``text`` unless something is there: (what is stored, evicted...)."""

    def touch(self, keys: Iterable[tuple[str, str, str]]) -> None:
        """Last use to now for ("originals" | "frozen", tenant, id-or-key) triples."""

    def cache_until(self, tenant: str, key: str, until: float) -> float | None:
        """Keep the later expiry of a conversation's cache; the one recorded before."""

    def check(self) -> None:
        """A cheap read: raises if the store cannot be read."""

    def get(self, tenant: str, id_: str) -> bytes | None: ...

    def frozen(self, tenant: str, key: str) -> bytes | None: ...

    def recent(self, limit: int) -> list[tuple[str, str]]:
        """(tenant, id) of the ``limit`` most recently used originals, oldest first."""

    def info(self) -> StoreInfo: ...

    def purge(self, older_than_days: float | None) -> int: ...

    def close(self) -> None: ...

    @property
    def ledger(self) -> LedgerBackend: ...


@attrs.define
class Known:
    """Bounded LRU set of (tenant, id) known to be committed. Reactor thread only."""

    limit: int
    _keys: OrderedDict[tuple[str, str], None] = attrs.Factory(OrderedDict)

    def check(self, tenant: str, ids: Iterable[str]) -> set[str]:
        found = set()
        for id_ in ids:
            if (tenant, id_) in self._keys:
                self._keys.move_to_end((tenant, id_))
                found.add(id_)
        return found

    def add(self, keys: Iterable[tuple[str, str]]) -> None:
        for key in keys:
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.limit:
            self._keys.popitem(last=False)

    def discard(self, keys: Iterable[tuple[str, str]]) -> None:
        for key in keys:
            self._keys.pop(key, None)

    def clear(self) -> None:
        self._keys.clear()


class RecentlyTouched:
    """Which (table, tenant, id) had their last use recorded within the last ``TOUCH_EVERY`` seconds
    (to twice that): two generations of sets, the older dropped as a whole, so it stays bounded
    by the ids used in two minutes. Reactor thread only."""

    def __init__(self, clock: Callable[[], float]):
        self._clock = clock
        self._current: set[tuple[str, str, str]] = set()
        self._previous: set[tuple[str, str, str]] = set()
        self._since = clock()

    def fresh(self, tenant: str, ids: Iterable[str], table: str = "originals") -> tuple[str, ...]:
        """The ids (of originals, or keys of "frozen" texts) not touched lately, now counted as touched."""
        now = self._clock()
        if now - self._since >= TOUCH_EVERY:
            self._previous, self._current, self._since = self._current, set(), now
        fresh = []
        for id_ in ids:
            key = (table, tenant, id_)
            if key not in self._current and key not in self._previous:
                self._current.add(key)
                fresh.append(id_)
        return tuple(fresh)


@attrs.define(kw_only=True)
class Connection:
    """The thread-side half of a ThreadedStore: owns the backend and the pending last-use
    times. Only jobs on the store's worker thread touch it; notices go back through
    ``deliver`` (``reactor.callFromThread``).

    ``broken`` is the store's health as this thread sees it: set by a failed read (or a
    failed write after which a read fails too, a backend that does not open, or one whose
    data was replaced under it), cleared by a put that writes and then reads back its
    originals. The reactor hears of the first through ``broke``, of the second in the put's
    result.

    A subclass opens the backend (``open``) and hands it out in step with what happened to
    it meanwhile (``_db``), raising StoreError when there is none.
    """

    known: Known
    deliver: Callable[..., None]
    broke: Callable[[str], None]  # the store cannot be read; called through deliver
    report: Callable[[str], None]  # a failed background write, called through deliver
    db: Backend | None = None
    broken: bool = False
    pending: set[tuple[str, str, str]] = attrs.Factory(set)

    def open(self) -> None:
        raise NotImplementedError

    def _db(self) -> Backend:
        raise NotImplementedError

    def _remember_recent(self, db: Backend) -> None:
        """What is stored is known without a put: the first request after a restart need not
        wait for the database."""
        self._background(lambda: self.deliver(self.known.add, db.recent(self.known.limit)))

    def _broke(self, error: Exception) -> None:
        self.broken = True
        self.deliver(self.broke, str(as_store_error(error)))

    @contextlib.contextmanager
    def _reading(self) -> Iterator[None]:
        """A read that fails breaks the store: nothing it holds can be vouched for."""
        try:
            yield
        except Exception as e:
            self._broke(e)
            raise

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """A write that fails breaks the store only if a read fails too: a store that is
        locked or full still has everything it had."""
        try:
            yield
        except Exception as e:
            if not self._readable():
                self._broke(e)
            raise

    def _readable(self) -> bool:
        if self.db is None:
            return False
        try:
            self.db.check()
        except Exception:  # noqa: BLE001 -- whatever the cause, it does not read
            return False
        return True

    def flush(self) -> None:
        """Write the batched last-use times: the worker's tick, and before each write."""
        if self.db is None or self.broken:
            self.pending.clear()  # touches are best effort; the failure is reported already
            return
        with self._writing():
            db = self._db()
            if self.pending:
                keys, self.pending = self.pending, set()
                db.touch(keys)

    def _background(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 -- fail open, whatever the cause
            self.deliver(self.report, str(as_store_error(e)))

    # Jobs: run on the worker thread, in the order the reactor submitted them.

    def note(self, table: str, tenant: str, ids: tuple[str, ...]) -> None:
        self.pending.update((table, tenant, id_) for id_ in ids)

    def put(self, tenant: str, originals: dict[str, bytes]) -> tuple[set[str], list[tuple[str, str]], int, bool]:
        """(ids written, evicted, number evicted, whether this put made the store healthy)."""
        self.flush()  # so eviction sees the last uses the proxy reported before this put
        with self._writing():
            db = self._db()
            written, evicted, count = db.put(tenant, originals)
        if not self.broken:
            return written, evicted, count, False
        with self._reading():
            for id_, body in originals.items():
                if db.get(tenant, id_) != body:
                    raise StoreError(f"{id_} does not read back as written")
        self.broken = False
        return written, evicted, count, True

    def freeze(self, tenant: str, key: str, text: bytes) -> tuple[bytes, list[tuple[str, str]], int]:
        self.flush()
        with self._writing():
            return self._db().freeze(tenant, key, text)

    def cache_until(self, tenant: str, key: str, until: float) -> float | None:
        with self._writing():
            return self._db().cache_until(tenant, key, until)

    def get(self, tenant: str, id_: str) -> bytes | None:
        with self._reading():
            body = self._db().get(tenant, id_)
        if body is not None:
            self.pending.add(("originals", tenant, id_))
        return body

    def frozen(self, tenant: str, key: str) -> bytes | None:
        with self._reading():
            text = self._db().frozen(tenant, key)
        if text is not None:
            self.pending.add(("frozen", tenant, key))
        return text

    def info(self) -> StoreInfo:
        with self._reading():
            return self._db().info()

    def purge(self, older_than_days: float | None) -> int:
        self.flush()
        with self._writing():
            return self._db().purge(older_than_days)

    def ledger_write(self, ops: Sequence[Op], max_turns: int) -> None:
        self._db().ledger.write(ops, max_turns)

    def ledger_read(self, query: str, *args: object) -> Any:
        """One of LedgerBackend's queries (or its trim), by name."""
        return getattr(self._db().ledger, query)(*args)

    def stop(self) -> None:
        self._background(self.flush)
        if self.db is not None:
            db, self.db = self.db, None
            self._background(db.close)


@attrs.define(kw_only=True)
class ThreadedStore:
    """The reactor's side of a store whose backend runs on one worker thread: the IStore.

    Construction never raises: a store that cannot open logs why and answers StoreError
    (puts) or None (gets), so cg keeps proxying without lossy compaction.

    A store that breaks while cg runs (a read fails) is unhealthy until a put writes and
    reads back again; the transition each way is logged once. A subclass (an attrs class,
    whose own fields come first) calls ``_start`` from its ``__attrs_post_init__`` and names
    itself in the log (``label``).
    """

    max_bytes: int = DEFAULT_MAX_BYTES
    reactor: IReactorFromThreads | None = None
    clock: Callable[[], float] = time.time
    flush_interval: float = FLUSH_INTERVAL
    known_max: int = KNOWN_MAX
    stats: StoreStats = attrs.field(factory=StoreStats, init=False)
    _known: Known = attrs.field(init=False)
    _connection: Connection = attrs.field(init=False)
    _worker: Worker = attrs.field(init=False)
    _closed: bool = attrs.field(default=False, init=False)
    _last_error: str | None = attrs.field(default=None, init=False)
    _touched: RecentlyTouched = attrs.field(init=False)
    ledger_days: float = DEFAULT_DAYS
    ledger_max_turns: int = DEFAULT_MAX_TURNS
    ledger: ThreadedLedger = attrs.field(init=False)

    @property
    def label(self) -> str:
        raise NotImplementedError

    def _start(self, connect: Callable[..., Connection]) -> None:
        """``connect(known=, deliver=, broke=, report=)`` makes the thread side; it is opened
        on the worker thread, never here."""
        if self.reactor is None:
            from twisted.internet import reactor

            self.reactor = cast(IReactorFromThreads, reactor)
        self._known = Known(self.known_max)
        self._touched = RecentlyTouched(self.clock)
        self._connection = connect(
            known=self._known,
            deliver=self.reactor.callFromThread,
            broke=self._broke,
            report=self._background_error,
        )
        self._worker = Worker(
            "cg-store",
            self.reactor,
            on_error=self._job_failed,
            tick=self._connection.flush,
            interval=self.flush_interval,
        )
        self._worker.submit_background(self._connection.open)
        self.ledger = ThreadedLedger(self._submit, self._connection, cast(IReactorTime, self.reactor),
                                     self._ledger_write_failed, self.ledger_days, self.ledger_max_turns)

    def _ledger_write_failed(self, failure: Failure, lost: int) -> None:
        self.stats.ledger_write_errors += 1
        self.stats.ledger_rows_lost += lost
        if lost:
            self._log(f"ledger rows lost ({lost}): {failure.value}")
        else:
            self._log(f"ledger rows held until the store has room: {failure.value}")

    def _submit(self, fn: Callable[..., _T], *args: object) -> Deferred[_T]:
        if self._closed:
            return fail(StoreError("store is closed"))
        return self._worker.submit(fn, *args).addErrback(
            lambda failure: Failure(as_store_error(failure.value))
        )

    def _log(self, error: str) -> None:
        """Log each new error once, not once per request."""
        if error != self._last_error:
            self._last_error = error
            log.error("cg store {store}: {error}", store=self.label, error=error)

    def _broke(self, reason: str) -> None:
        """The store does not read (see Connection): forget every id known, not only one read.

        Which entries a failed read affects cannot be told without reading them all, and a
        known id that is not there becomes a marker nobody can answer. Forgetting costs
        little: the next request holds its originals again, and its put rewrites only those
        really missing.
        """
        self._known.clear()
        self.stats.unhealthy_reason = reason
        if not self.stats.healthy:
            self._log(reason)
            return
        self.stats.healthy = False
        self.stats.unhealthy_since = self.clock()
        self._last_error = reason
        log.error(
            "cg store {store} is unhealthy: {reason}; no new markers until a write and a read succeed",
            store=self.label,
            reason=reason,
        )

    def _recovered(self) -> None:
        self.stats.healthy = True
        self.stats.unhealthy_reason = self.stats.unhealthy_since = None
        log.info("cg store {store} is healthy again", store=self.label)

    def _background_error(self, error: str) -> None:
        self.stats.write_errors += 1
        self._log(error)

    def _job_failed(self, failure: Failure) -> None:
        """A job nobody waits for (a touch, the tick's flush) raised."""
        self._background_error(str(as_store_error(failure.value)))

    def _write_failed(self, failure: Failure) -> Failure:
        self.stats.write_errors += 1
        self._log(str(failure.value))
        return failure

    def _wrote(self, evicted: list[tuple[str, str]], count: int) -> None:
        self._last_error = None
        self._known.discard(evicted)
        self.stats.evictions += count

    def put(self, tenant: str, originals: dict[str, bytes]) -> Deferred[set[str]]:
        if not originals:
            return succeed(set())
        originals = dict(originals)  # the caller may reuse its dict before the commit

        def done(result: tuple[set[str], list[tuple[str, str]], int, bool]) -> set[str]:
            written, evicted, count, recovered = result
            self._wrote(evicted, count)
            if recovered:
                self._recovered()
            self._known.add((tenant, id_) for id_ in originals)
            self.stats.writes += len(written)
            return written

        return self._submit(self._connection.put, tenant, originals).addCallbacks(
            done, self._write_failed
        )

    def known(self, tenant: str, ids: Iterable[str]) -> set[str]:
        # Unhealthy, it vouches for nothing, even for ids a reopen found stored.
        return self._known.check(tenant, ids) if self.stats.healthy else set()

    def touch(self, tenant: str, ids: Iterable[str], frozen: Iterable[str] = ()) -> None:
        if self._closed:
            return
        for table, names in (("originals", ids), ("frozen", frozen)):
            fresh = self._touched.fresh(tenant, names, table)
            if fresh:
                self._worker.submit_background(self._connection.note, table, tenant, fresh)

    def get(self, tenant: str, id: str) -> Deferred[bytes | None]:
        self.stats.reads += 1

        def done(body: bytes | None) -> bytes | None:
            if body is None:
                self.stats.misses += 1
            else:
                self.stats.hits += 1
            return body

        def failed(failure: Failure) -> None:
            self.stats.read_errors += 1
            self._log(str(failure.value))

        return self._submit(self._connection.get, tenant, id).addCallbacks(done, failed)

    def freeze(self, tenant: str, key: str, text: bytes) -> Deferred[bytes]:
        def done(result: tuple[bytes, list[tuple[str, str]], int]) -> bytes:
            stored, evicted, count = result
            self._wrote(evicted, count)
            return stored

        return self._submit(self._connection.freeze, tenant, key, text).addCallbacks(
            done, self._write_failed
        )

    def frozen(self, tenant: str, key: str) -> Deferred[bytes | None]:
        def failed(failure: Failure) -> Failure:
            self.stats.read_errors += 1
            self._log(str(failure.value))
            return failure

        return self._submit(self._connection.frozen, tenant, key).addErrback(failed)

    def cache_until(self, tenant: str, key: str, until: float) -> Deferred[float | None]:
        return self._submit(self._connection.cache_until, tenant, key, until).addErrback(self._write_failed)

    def info(self) -> Deferred[StoreInfo]:
        return self._submit(self._connection.info)

    def purge(self, older_than_days: float | None = None) -> Deferred[int]:
        def done(count: int) -> int:
            self._known.clear()  # a cache: refilled by the next puts, which rewrite nothing
            return count

        return self._submit(self._connection.purge, older_than_days).addCallbacks(
            done, self._write_failed
        )

    def close(self) -> Deferred[None]:
        if not self._closed:
            self.ledger.close()
            self._closed = True
            self._worker.submit_background(self._connection.stop)
        return self._worker.stop()


@implementer(ILedger)
@attrs.define
class ThreadedLedger:
    """The reactor's side of a threaded store's ledger: `record` appends to a batch (all
    they cost the request), which goes to the worker as one write LEDGER_BATCH_DELAY seconds after
    its first row, before any query (so a query sees every row recorded before it), and on close.

    A write that fails for want of room (`no_room`: a full disk, Redis out of memory) puts its rows
    back, up to LEDGER_HELD_MAX, for the next batch: a disk full for a minute costs the dashboard no
    row. That batch waits twice as long as the last (to LEDGER_RETRY_MAX), so a disk full for a day
    is not tried every second; a query still sends them at once. Any other failure loses its batch.
    Either way it is counted (StoreStats) and logged, never raised to a caller."""

    submit: Callable[..., Deferred[Any]]  # ThreadedStore._submit: a Connection job on the worker
    connection: Connection
    clock: IReactorTime
    failed: Callable[[Failure, int], None]  # a write failed: its failure, and how many of its rows are lost
    days: float = DEFAULT_DAYS
    max_turns: int = DEFAULT_MAX_TURNS
    _pending: list[Op] = attrs.field(factory=list, init=False)
    _timer: IDelayedCall | None = attrs.field(default=None, init=False)
    _closed: bool = attrs.field(default=False, init=False)
    _delay: float = attrs.field(default=LEDGER_BATCH_DELAY, init=False)  # before the next batch goes

    def record(self, turn: Turn, changes: Sequence[Change]) -> None:
        self._add((turn, tuple(changes)))

    def _add(self, op: Op) -> None:
        if self._closed:
            return
        self._pending.append(op)
        if self._timer is None:
            self._timer = self.clock.callLater(self._delay, self.flush)

    def flush(self) -> None:
        """Send the pending rows to the worker now, as one batch."""
        if self._timer is not None:
            if self._timer.active():
                self._timer.cancel()
            self._timer = None
        if self._pending:
            ops, self._pending = self._pending, []
            self.submit(self.connection.ledger_write, ops, self.max_turns).addCallbacks(
                self._wrote, self._write_failed, errbackArgs=(ops,))

    def _wrote(self, _: object) -> None:
        self._pace_back()

    def _pace_back(self) -> None:
        """A batch a second again: the store took a write, or failed one for a reason other than
        want of room (its rows are lost, not held, so nothing is left to back off for)."""
        if self._delay == LEDGER_BATCH_DELAY:
            return
        self._delay = LEDGER_BATCH_DELAY
        if self._timer is not None and self._timer.active():  # rows recorded while it was written
            self._timer.reset(LEDGER_BATCH_DELAY)

    def _write_failed(self, failure: Failure, ops: list[Op]) -> None:
        if self._closed or not no_room(failure.value):
            self._pace_back()
            self.failed(failure, len(ops))
            return
        held = ops + self._pending
        lost = max(0, len(held) - LEDGER_HELD_MAX)
        self._pending = held[lost:]
        self._delay = min(self._delay * 2, LEDGER_RETRY_MAX)
        if self._timer is not None and self._timer.active():  # set by a record() since, at the old pace
            self._timer.cancel()
        self._timer = self.clock.callLater(self._delay, self.flush)
        self.failed(failure, lost)

    def close(self) -> None:
        self._closed = True  # first: a write that fails now loses its rows, none waits for a timer
        self.flush()

    def _read(self, query: str, *args: object) -> Deferred[Any]:
        """A query sends the pending rows first (it sees them), but not held ones backing off: the
        dashboard polls every 2 s and would try a full store that often."""
        if self._delay == LEDGER_BATCH_DELAY:
            self.flush()
        return self.submit(self.connection.ledger_read, query, *args)

    def totals(self, tenant: str | None, since: float | None) -> Deferred[Totals]:
        return self._read("totals", tenant, since)

    def buckets(self, tenant: str | None, since: float, width: float) -> Deferred[list[Bucket]]:
        return self._read("buckets", tenant, since, width)

    def conversations(self, tenant: str | None, offset: int, limit: int,
                      order: str = "last") -> Deferred[tuple[list[Conversation], int]]:
        return self._read("conversations", tenant, offset, limit, order)

    def conversation(self, tenant: str | None, id: str) -> Deferred[tuple[Conversation, list[Turn], list[Change]] | None]:
        return self._read("conversation", tenant, id)

    def turns(self) -> Deferred[list[tuple[Turn, Sequence[Change]]]]:
        return self._read("turns")

    def trim(self, now: float) -> Deferred[int]:
        """Batches of TRIM_BATCH, each a job of its own, until one deletes nothing: the sum."""
        total = 0

        def batch(count: int) -> Deferred[int] | int:
            nonlocal total
            total += count
            if count == 0:
                return total
            return self._read("trim", now, self.days, TRIM_BATCH).addCallback(batch)

        return self._read("trim", now, self.days, TRIM_BATCH).addCallback(batch)
