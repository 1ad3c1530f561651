"""The SQLite store: one file (WAL), all SQL on one worker thread (cg.worker)."""

from __future__ import annotations

import contextlib
import functools
import os
import sqlite3
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Set
from typing import cast

import attrs
from zope.interface import implementer

from cg.store.base import (
    CACHE_RECORD_DAYS,
    DEFAULT_MAX_BYTES,
    EVICT_TO,
    IStore,
    StoreError,
    StoreInfo,
    as_store_error,
)
from cg.store.sqlite_ledger import SQLiteLedger, attach_ledger, ledger_path, locked
from cg.store.threaded import Connection, ThreadedStore

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
        self.ledger = SQLiteLedger(conn)  # the dashboard's tables, in a file of their own (cg.store.sqlite_ledger)
        self.ledger_error = ""  # why the ledger's file could not be attached, if it could not

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
        give_up_at = time.monotonic() + BUSY_TIMEOUT
        while True:
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
                ledger_error = attach_ledger(conn, ledger_path(path), create=create, give_up_at=give_up_at)
                db = cls(conn, max_bytes, clock)
                db.ledger_error = ledger_error
                return db
            except Exception as e:
                if conn is not None:
                    conn.close()
                if locked(e) and time.monotonic() < give_up_at:
                    # Another process setting up the same new file (workers starting at once):
                    # switching a file to WAL takes a lock SQLite does not wait for. This is the
                    # store's thread (or cg-store), never the reactor's.
                    time.sleep(0.01)
                    continue
                raise StoreError(f"cannot open store {path}: {as_store_error(e)}") from e

    def close(self) -> None:
        self.conn.close()

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """A write transaction on the store's file only. BEGIN IMMEDIATE would lock every attached
        file, the ledger's too: a request's put would wait on another process's dashboard writes
        (and, past BUSY_TIMEOUT, go whole). A write first takes the one lock (waiting as BEGIN
        IMMEDIATE would, busy_timeout) before anything is read."""
        total = self.total
        self.conn.execute("BEGIN")
        try:
            self.conn.execute(_LOCK_STORE)
            yield
            self.conn.execute("COMMIT")
        except BaseException:
            self.total = total
            with contextlib.suppress(sqlite3.Error):
                self.conn.execute("ROLLBACK")
            raise

    def _sum(self) -> int:
        total: int = self.conn.execute(
            "SELECT (SELECT coalesce(sum(size), 0) FROM originals)"
            " + (SELECT coalesce(sum(size), 0) FROM frozen)"
        ).fetchone()[0]
        return total

    def _version(self) -> int:
        version: int = self.conn.execute("PRAGMA data_version").fetchone()[0]
        return version

    def changed_elsewhere(self) -> bool:
        """Whether another connection committed since the last check (our own commits
        don't count); if so, ``total`` is recounted."""
        version = self._version()
        if version == self._data_version:
            return False
        self._data_version = version
        self.total = self._sum()
        return True

    def put(self, tenant: str, originals: dict[str, bytes]) -> tuple[set[str], list[tuple[str, str]], int]:
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

    def freeze(self, tenant: str, key: str, text: bytes) -> tuple[bytes, list[tuple[str, str]], int]:
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

    def cache_until(self, tenant: str, key: str, until: float) -> float | None:
        """Keep the later of ``until`` and the recorded expiry of conversation ``key``'s cache;
        the recorded one (None: none). Records expired CACHE_RECORD_DAYS ago go.

        Committed without an fsync (synchronous=NORMAL, for this transaction only): one runs per
        request, and what a power cut may lose is the latest few records, which then read as an
        earlier request's (at worst one conversation re-decided while its cache was warm).
        """
        self.conn.execute("PRAGMA synchronous = NORMAL")
        try:
            with self._transaction():
                row = self.conn.execute(
                    "SELECT until FROM caches WHERE tenant = ? AND key = ?", (tenant, key)
                ).fetchone()
                before = None if row is None else float(row[0])
                if before is None or before < until:
                    self.conn.execute(
                        "INSERT INTO caches (tenant, key, until) VALUES (?, ?, ?)"
                        " ON CONFLICT (tenant, key) DO UPDATE SET until = excluded.until",
                        (tenant, key, until),
                    )
                self.conn.execute(
                    "DELETE FROM caches WHERE until < ?", (self.clock() - CACHE_RECORD_DAYS * 86400,)
                )
        finally:
            self.conn.execute("PRAGMA synchronous = FULL")
        return before

    def _evict(
        self,
        protect_originals: Set[tuple[str, str]] = frozenset(),
        protect_frozen: Set[tuple[str, str]] = frozenset(),
    ) -> tuple[list[tuple[str, str]], int]:
        """Least recently used originals first; frozen texts only once no original is left,
        because dropping one changes bytes a provider has cached."""
        if self.total <= self.max_bytes:
            return [], 0
        originals = self._drop("originals", "id", protect_originals)
        frozen = self._drop("frozen", "key", protect_frozen)
        return originals, len(originals) + len(frozen)

    def _drop(self, table: str, key: str, protect: Set[tuple[str, str]]) -> list[tuple[str, str]]:
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
        by_table: dict[str, list[tuple[float, str, str]]] = {"originals": [], "frozen": []}
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


# A write that changes nothing: it takes the store file's write lock, and no other file's.
_LOCK_STORE = "DELETE FROM main.originals WHERE 0"


# When each conversation's prompt cache expires (IStore.cache_until): no content, not counted in
# the store's size, never evicted; dropped CACHE_RECORD_DAYS after expiring.
_CACHES = """
    CREATE TABLE IF NOT EXISTS caches (
        tenant TEXT NOT NULL, key TEXT NOT NULL, until REAL NOT NULL, PRIMARY KEY (tenant, key));
    CREATE INDEX IF NOT EXISTS caches_by_until ON caches (until);
"""


def _migrate(conn: sqlite3.Connection, path: str) -> None:
    """Create the tables in a new file, and again where someone dropped them (nothing to lose)."""
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version not in (0, SCHEMA_VERSION):
        raise StoreError(f"{path} has schema version {version}; this cg knows {SCHEMA_VERSION}")
    tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if version == SCHEMA_VERSION and {"originals", "frozen"} <= tables:
        if "caches" not in tables:  # a store made before cache records: add their table
            try:
                conn.executescript(f"BEGIN IMMEDIATE; {_CACHES} COMMIT;")
            except sqlite3.OperationalError:  # cg-store, on a file it may not write
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
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
        {_CACHES}
        PRAGMA user_version = {SCHEMA_VERSION};
        COMMIT;
        """
    )


@attrs.define(kw_only=True)
class _Connection(Connection):
    """The thread side of SQLiteStore (see Connection), on a file that may be removed,
    replaced or changed by another connection while cg runs."""

    path: str
    max_bytes: int
    clock: Callable[[], float]
    identity: tuple[int, int] | None = None  # (device, inode) of the file db has open
    open_error: str = ""
    reopen_at: float = 0.0

    def open(self) -> None:
        self.reopen_at = time.monotonic() + REOPEN_AFTER
        try:
            db = SQLiteDB.open(self.path, self.max_bytes, clock=self.clock)
        except StoreError as e:
            self.open_error = str(e)
            self._broke(e)
            return
        self.db, self.identity = db, _identity(self.path)
        if db.ledger_error:  # the store works on, without the dashboard's rows
            self.deliver(self.report, db.ledger_error)
        self._remember_recent(db)

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
        db = cast(SQLiteDB, self.db)
        if db.changed_elsewhere():
            self.deliver(self.known.clear)
        return db


def _identity(path: str) -> tuple[int, int] | None:
    """(device, inode) of the file at ``path``, or None if there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


@implementer(IStore)
@attrs.define
class SQLiteStore(ThreadedStore):
    """IStore on a local SQLite file (WAL), all SQL on one worker thread (see ThreadedStore).

    A store that cannot open tries to open again at most every REOPEN_AFTER seconds.
    """

    path: str

    def __attrs_post_init__(self) -> None:
        path = os.path.expanduser(self.path)
        self._start(functools.partial(_Connection, path=path, max_bytes=self.max_bytes, clock=self.clock))

    @property
    def label(self) -> str:
        return self.path
