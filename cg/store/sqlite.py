"""The SQLite store: one file (WAL), all SQL on one worker thread (cg.worker)."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
import urllib.request
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import cast

import attrs
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.interfaces import IReactorFromThreads
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from cg.store.base import (
    DEFAULT_MAX_BYTES,
    EVICT_TO,
    IStore,
    StoreError,
    StoreInfo,
    StoreStats,
    as_store_error,
)
from cg.worker import Worker

log = Logger(namespace="cg.store")
# Seconds between flushes of batched last-use times (and checks for changes made by
# another connection, e.g. ``cg-store purge``).
FLUSH_INTERVAL = 2.0
# (tenant, id) pairs remembered as committed; ~200 bytes each.
KNOWN_MAX = 50_000
# Seconds to wait before trying again to open a store that failed to open.
REOPEN_AFTER = 30.0
# Seconds SQLite waits on a lock held by another connection before failing.
BUSY_TIMEOUT = 5.0
SCHEMA_VERSION = 1


class SQLiteDB:
    """Synchronous SQL over one connection.

    ``SQLiteStore`` uses it on its worker thread only (connections are thread-bound and
    writes must be serialized); ``cg-store`` uses it directly, with no reactor.
    ``total`` (bytes of originals and frozen texts) is kept in step with the tables so a
    put need not sum them.
    """

    def __init__(self, conn: sqlite3.Connection, max_bytes: int, clock: Callable[[], float]):
        self.conn = conn
        self.max_bytes = max_bytes
        self.clock = clock
        self.total = self._sum()
        self._data_version = self._version()

    @classmethod
    def open(
        cls,
        path: str,
        max_bytes: int = DEFAULT_MAX_BYTES,
        *,
        clock: Callable[[], float] = time.time,
        create: bool = True,
    ) -> SQLiteDB:
        """Open (with ``create``: first create, mode 0600, in a 0700 directory) the file.

        Raises StoreError. SQLite gives the -wal and -shm files the database file's mode
        (and, running as root, its owner), so they are 0600 too.
        """
        path = os.path.abspath(path)
        conn = None
        try:
            if create:
                os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
                os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
            # mode=rw: never let sqlite create the file (it would with the umask's mode).
            uri = "file:" + urllib.request.pathname2url(path) + "?mode=rw"
            conn = sqlite3.connect(uri, uri=True, timeout=BUSY_TIMEOUT, isolation_level=None)
            conn.execute("PRAGMA auto_vacuum = INCREMENTAL")  # only takes on a new file
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if mode.lower() != "wal":
                raise StoreError(f"cannot switch {path} to WAL mode (got {mode})")
            conn.execute("PRAGMA synchronous = FULL")  # a put's commit survives power loss
            conn.execute("PRAGMA journal_size_limit = 67108864")
            _migrate(conn, path)
            return cls(conn, max_bytes, clock)
        except Exception as e:
            if conn is not None:
                conn.close()
            raise StoreError(f"cannot open store {path}: {as_store_error(e)}") from e

    def close(self) -> None:
        self.conn.close()

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        total = self.total
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield
            self.conn.execute("COMMIT")
        except BaseException:
            self.total = total
            with contextlib.suppress(sqlite3.Error):
                self.conn.execute("ROLLBACK")
            raise

    def _sum(self) -> int:
        return self.conn.execute(
            "SELECT (SELECT coalesce(sum(size), 0) FROM originals)"
            " + (SELECT coalesce(sum(size), 0) FROM frozen)"
        ).fetchone()[0]

    def _version(self) -> int:
        return self.conn.execute("PRAGMA data_version").fetchone()[0]

    def changed_elsewhere(self) -> bool:
        """Whether another connection committed since the last check (our own commits
        don't count); if so, ``total`` is recounted."""
        version = self._version()
        if version == self._data_version:
            return False
        self._data_version = version
        self.total = self._sum()
        return True

    def put(self, tenant: str, originals: dict[str, bytes]) -> tuple[set[str], list, int]:
        """Write the new originals and refresh the others' last use.

        Returns (ids written, (tenant, id) of originals evicted, number of entries evicted).
        """
        now = self.clock()
        written = set()
        with self._transaction():
            for id_, body in originals.items():
                if not self.conn.execute(
                    "UPDATE originals SET last_used = ? WHERE tenant = ? AND id = ?",
                    (now, tenant, id_),
                ).rowcount:
                    self.conn.execute(
                        "INSERT INTO originals (tenant, id, size, last_used, body) VALUES (?, ?, ?, ?, ?)",
                        (tenant, id_, len(body), now, body),
                    )
                    self.total += len(body)
                    written.add(id_)
            evicted, count = self._evict(protect_originals={(tenant, i) for i in originals})
        return written, evicted, count

    def freeze(self, tenant: str, key: str, text: bytes) -> tuple[bytes, list, int]:
        """Returns (the stored text, evicted originals, number of entries evicted)."""
        now = self.clock()
        with self._transaction():
            if not self.conn.execute(
                "UPDATE frozen SET last_used = ? WHERE tenant = ? AND key = ?", (now, tenant, key)
            ).rowcount:
                self.conn.execute(
                    "INSERT INTO frozen (tenant, key, size, last_used, body) VALUES (?, ?, ?, ?, ?)",
                    (tenant, key, len(text), now, text),
                )
                self.total += len(text)
            stored = self.frozen(tenant, key)
            assert stored is not None  # written above, in this transaction
            evicted, count = self._evict(protect_frozen={(tenant, key)})
        return stored, evicted, count

    def _evict(self, protect_originals=frozenset(), protect_frozen=frozenset()) -> tuple[list, int]:
        """Least recently used originals first; frozen texts only once no original is left,
        because dropping one changes bytes a provider has cached."""
        if self.total <= self.max_bytes:
            return [], 0
        originals = self._drop("originals", "id", protect_originals)
        frozen = self._drop("frozen", "key", protect_frozen)
        return originals, len(originals) + len(frozen)

    def _drop(self, table: str, key: str, protect) -> list[tuple[str, str]]:
        target = self.max_bytes * EVICT_TO
        victims = []
        rows = self.conn.execute(
            f"SELECT rowid, tenant, {key}, size FROM {table} ORDER BY last_used, rowid"
        )
        for rowid, tenant, name, size in rows:
            if self.total <= target:
                break
            if (tenant, name) not in protect:
                victims.append((rowid, tenant, name))
                self.total -= size
        rows.close()
        self.conn.executemany(f"DELETE FROM {table} WHERE rowid = ?", [(v[0],) for v in victims])
        return [(tenant, name) for _, tenant, name in victims]

    def touch(self, keys: Iterable[tuple[str, str, str]]) -> None:
        """Set last use to now for ("originals" | "frozen", tenant, id-or-key) triples."""
        now = self.clock()
        by_table: dict[str, list] = {"originals": [], "frozen": []}
        for table, tenant, name in keys:
            by_table[table].append((now, tenant, name))
        with self._transaction():
            self.conn.executemany(
                "UPDATE originals SET last_used = ? WHERE tenant = ? AND id = ?",
                by_table["originals"],
            )
            self.conn.executemany(
                "UPDATE frozen SET last_used = ? WHERE tenant = ? AND key = ?", by_table["frozen"]
            )

    def check(self) -> None:
        """A cheap read of both tables: raises if the file or its tables are gone or damaged."""
        self.conn.execute(
            "SELECT (SELECT max(rowid) FROM originals), (SELECT max(rowid) FROM frozen)"
        ).fetchone()

    def get(self, tenant: str, id_: str) -> bytes | None:
        row = self.conn.execute(
            "SELECT body FROM originals WHERE tenant = ? AND id = ?", (tenant, id_)
        ).fetchone()
        return None if row is None else bytes(row[0])

    def frozen(self, tenant: str, key: str) -> bytes | None:
        row = self.conn.execute(
            "SELECT body FROM frozen WHERE tenant = ? AND key = ?", (tenant, key)
        ).fetchone()
        return None if row is None else bytes(row[0])

    def recent(self, limit: int) -> list[tuple[str, str]]:
        """(tenant, id) of the ``limit`` most recently used originals, oldest first."""
        rows = self.conn.execute(
            "SELECT tenant, id FROM originals ORDER BY last_used DESC, rowid DESC LIMIT ?", (limit,)
        ).fetchall()
        return rows[::-1]

    def info(self) -> StoreInfo:
        entries, size, oldest = self.conn.execute(
            "SELECT count(*), coalesce(sum(size), 0), min(last_used) FROM originals"
        ).fetchone()
        frozen_entries, frozen_size = self.conn.execute(
            "SELECT count(*), coalesce(sum(size), 0) FROM frozen"
        ).fetchone()
        return StoreInfo(entries, size, oldest, frozen_entries, frozen_size)

    def purge(self, older_than_days: float | None) -> int:
        args: tuple[float, ...]
        if older_than_days is None:
            where, args = "", ()
        else:
            where, args = " WHERE last_used < ?", (self.clock() - older_than_days * 86400,)
        with self._transaction():
            count = sum(
                self.conn.execute(f"DELETE FROM {t}{where}", args).rowcount
                for t in ("originals", "frozen")
            )
            self.total = self._sum()
        # Give the space back to the disk. executescript: execute() would free one page only.
        self.conn.executescript("PRAGMA incremental_vacuum;")
        return count


def _migrate(conn: sqlite3.Connection, path: str) -> None:
    """Create the tables in a new file, and again where someone dropped them (nothing to lose)."""
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version not in (0, SCHEMA_VERSION):
        raise StoreError(f"{path} has schema version {version}; this cg knows {SCHEMA_VERSION}")
    tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if version == SCHEMA_VERSION and {"originals", "frozen"} <= tables:
        return  # a read only: cg-store can open a store it may not write
    # body last: an eviction scan reads size and last_used without walking a blob's pages.
    conn.executescript(
        f"""
        BEGIN IMMEDIATE;
        CREATE TABLE IF NOT EXISTS originals (
            tenant TEXT NOT NULL, id TEXT NOT NULL, size INTEGER NOT NULL,
            last_used REAL NOT NULL, body BLOB NOT NULL, PRIMARY KEY (tenant, id));
        CREATE INDEX IF NOT EXISTS originals_by_use ON originals (last_used);
        CREATE TABLE IF NOT EXISTS frozen (
            tenant TEXT NOT NULL, key TEXT NOT NULL, size INTEGER NOT NULL,
            last_used REAL NOT NULL, body BLOB NOT NULL, PRIMARY KEY (tenant, key));
        CREATE INDEX IF NOT EXISTS frozen_by_use ON frozen (last_used);
        PRAGMA user_version = {SCHEMA_VERSION};
        COMMIT;
        """
    )


@attrs.define
class _Known:
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


@attrs.define
class _Connection:
    """The thread-side half of SQLiteStore: owns the connection and the pending last-use
    times. Only jobs on the store's worker thread touch it; notices go back through
    ``deliver`` (``reactor.callFromThread``).

    ``broken`` is the store's health as this thread sees it: set by a failed read (or a
    failed write after which a read fails too, a file that does not open, a file removed or
    replaced under the open connection), cleared by a put that writes and then reads back
    its originals. The reactor hears of the first through ``broke``, of the second in the
    put's result.
    """

    path: str
    max_bytes: int
    clock: Callable[[], float]
    known: _Known
    deliver: Callable[..., None]
    broke: Callable[[str], None]  # the store cannot be read; called through deliver
    report: Callable[[str], None]  # a failed background write, called through deliver
    db: SQLiteDB | None = None
    identity: tuple[int, int] | None = None  # (device, inode) of the file db has open
    open_error: str = ""
    reopen_at: float = 0.0
    broken: bool = False
    pending: set[tuple[str, str, str]] = attrs.Factory(set)

    def open(self) -> None:
        self.reopen_at = time.monotonic() + REOPEN_AFTER
        try:
            db = SQLiteDB.open(self.path, self.max_bytes, clock=self.clock)
        except StoreError as e:
            self.open_error = str(e)
            self._broke(e)
            return
        self.db, self.identity = db, _identity(self.path)
        # What is stored is known without a put: the first request after a restart
        # need not wait for the database.
        self._background(lambda: self.deliver(self.known.add, db.recent(self.known.limit)))

    def _close(self) -> None:
        db, self.db = self.db, None
        if db is not None:
            with contextlib.suppress(sqlite3.Error):
                db.close()

    def _db(self) -> SQLiteDB:
        """The open database, in step with what happened to its file meanwhile.

        After changes other connections made (``cg-store purge``, another cg on the same
        file), forget what we knew. A file removed or replaced under the connection breaks
        the store (what we knew was in the old one) and is reopened at once. A broken store
        starts over from a new connection, at most every REOPEN_AFTER seconds: that creates
        a removed file and dropped tables again.
        """
        if self.db is not None and self.identity != _identity(self.path):
            self._close()
            self.reopen_at = 0.0
            self._broke(StoreError("the file was removed or replaced while open"))
        if self.broken and self.db is not None and time.monotonic() >= self.reopen_at:
            self._close()
        if self.db is None and time.monotonic() >= self.reopen_at:
            self.open()
        if self.db is None:
            raise StoreError(self.open_error)
        if self.db.changed_elsewhere():
            self.deliver(self.known.clear)
        return self.db

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

    def put(self, tenant: str, originals: dict[str, bytes]):
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

    def freeze(self, tenant: str, key: str, text: bytes):
        self.flush()
        with self._writing():
            return self._db().freeze(tenant, key, text)

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

    def stop(self) -> None:
        self._background(self.flush)
        if self.db is not None:
            db, self.db = self.db, None
            self._background(db.close)


def _identity(path: str) -> tuple[int, int] | None:
    """(device, inode) of the file at ``path``, or None if there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


@implementer(IStore)
@attrs.define
class SQLiteStore:
    """IStore on a local SQLite file (WAL), all SQL on one worker thread.

    Construction never raises: a store that cannot open logs why and answers StoreError
    (puts) or None (gets), so cg keeps proxying without lossy compaction. It tries to open
    again at most every REOPEN_AFTER seconds.

    A store that breaks while cg runs (a read fails) is unhealthy until a put writes and
    reads back again; the transition each way is logged once.
    """

    path: str
    max_bytes: int = DEFAULT_MAX_BYTES
    reactor: IReactorFromThreads | None = None
    clock: Callable[[], float] = time.time
    flush_interval: float = FLUSH_INTERVAL
    known_max: int = KNOWN_MAX
    stats: StoreStats = attrs.field(factory=StoreStats, init=False)
    _known: _Known = attrs.field(init=False)
    _connection: _Connection = attrs.field(init=False)
    _worker: Worker = attrs.field(init=False)
    _closed: bool = attrs.field(default=False, init=False)
    _last_error: str | None = attrs.field(default=None, init=False)

    def __attrs_post_init__(self) -> None:
        if self.reactor is None:
            from twisted.internet import reactor

            self.reactor = cast(IReactorFromThreads, reactor)
        self._known = _Known(self.known_max)
        self._connection = _Connection(
            path=os.path.expanduser(self.path),
            max_bytes=self.max_bytes,
            clock=self.clock,
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

    def _submit(self, fn: Callable, *args) -> Deferred:
        if self._closed:
            return fail(StoreError("store is closed"))
        return self._worker.submit(fn, *args).addErrback(
            lambda failure: Failure(as_store_error(failure.value))
        )

    def _log(self, error: str) -> None:
        """Log each new error once, not once per request."""
        if error != self._last_error:
            self._last_error = error
            log.error("cg store {path}: {error}", path=self.path, error=error)

    def _broke(self, reason: str) -> None:
        """The store does not read (see _Connection): forget every id known, not only one read.

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
            "cg store {path} is unhealthy: {reason}; no new markers until a write and a read succeed",
            path=self.path,
            reason=reason,
        )

    def _recovered(self) -> None:
        self.stats.healthy = True
        self.stats.unhealthy_reason = self.stats.unhealthy_since = None
        log.info("cg store {path} is healthy again", path=self.path)

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

    def _wrote(self, evicted: list, count: int) -> None:
        self._last_error = None
        self._known.discard(evicted)
        self.stats.evictions += count

    def put(self, tenant: str, originals: dict[str, bytes]) -> Deferred[set[str]]:
        if not originals:
            return succeed(set())
        originals = dict(originals)  # the caller may reuse its dict before the commit

        def done(result):
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

    def touch(self, tenant: str, ids: Iterable[str]) -> None:
        if not self._closed:
            self._worker.submit_background(self._connection.note, "originals", tenant, tuple(ids))

    def get(self, tenant: str, id: str) -> Deferred[bytes | None]:
        self.stats.reads += 1

        def done(body):
            if body is None:
                self.stats.misses += 1
            else:
                self.stats.hits += 1
            return body

        def failed(failure):
            self.stats.read_errors += 1
            self._log(str(failure.value))

        return self._submit(self._connection.get, tenant, id).addCallbacks(done, failed)

    def freeze(self, tenant: str, key: str, text: bytes) -> Deferred[bytes]:
        def done(result):
            stored, evicted, count = result
            self._wrote(evicted, count)
            return stored

        return self._submit(self._connection.freeze, tenant, key, text).addCallbacks(
            done, self._write_failed
        )

    def frozen(self, tenant: str, key: str) -> Deferred[bytes | None]:
        def failed(failure):
            self.stats.read_errors += 1
            self._log(str(failure.value))
            return failure

        return self._submit(self._connection.frozen, tenant, key).addErrback(failed)

    def info(self) -> Deferred[StoreInfo]:
        return self._submit(self._connection.info)

    def purge(self, older_than_days: float | None = None) -> Deferred[int]:
        def done(count):
            self._known.clear()  # a cache: refilled by the next puts, which rewrite nothing
            return count

        return self._submit(self._connection.purge, older_than_days).addCallbacks(
            done, self._write_failed
        )

    def close(self) -> Deferred[None]:
        if not self._closed:
            self._closed = True
            self._worker.submit_background(self._connection.stop)
        return self._worker.stop()
