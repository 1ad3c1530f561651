"""The ledger (`cg.store.base.ILedger`) beside the SQLite store's file: used synchronously, on the
store's worker thread, over the store's own connection (`cg.store.sqlite.SQLiteDB.ledger`).

Its tables live in a file of their own beside the store's (``store.ledger.sqlite3`` for
``store.sqlite3``), attached to the store's connection as ``ledger``: the store notices another
connection's commits to its file (``PRAGMA data_version``: another `--workers` process evicted or
purged) and then forgets which originals it knew were stored; the ledger, written by every process
every second, must not make them forget.

Tables, each bounded (`trim`):

    ledger_buckets        per-minute and per-hour rollups, one row per (width, start, tenant, client,
                          model), added to by upsert; `totals` reads whole hours from the hour rows
    ledger_conversations  a summary row per (tenant, conversation), added to by upsert, with an index
                          per order of `ILedger.conversations` (and per tenant and order), and by id
                          (a viewer of every tenant opens a conversation by its id alone)
    ledger_turns          the newest turns, each one JSON text with its changes, keyed by a rowid
                          unique in the file (every process on it shares the sequence)
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
import urllib.request
from collections.abc import Sequence
from typing import Any

from cg.exchange.ledger import HOUR, MINUTE, ORDERS, Bucket, Change, Conversation, Totals, Turn
from cg.store.ledger import FLAT, Batch, Op, dump_turn, flatten, load_turn, spans, unflatten

# The column of ledger_conversations each of ORDERS sorts by.
_ORDER_COLUMNS = {"last": "last", "first": "first", "requests": "requests", "tokens_before": "tokens_before",
                  "tokens_after": "tokens_after", "cost": "cost_via_cg"}
assert tuple(_ORDER_COLUMNS) == ORDERS

_NUMBERS = ", ".join(f"{name} {'REAL' if name.startswith('cost') else 'INTEGER'} NOT NULL" for name in FLAT)
_SUMS = ", ".join(f"{name} = {name} + excluded.{name}" for name in FLAT)
_TOTALS = ", ".join(f"sum({name})" for name in FLAT)

SCHEMA = f"""
    CREATE TABLE IF NOT EXISTS ledger.ledger_buckets (
        width REAL NOT NULL, start REAL NOT NULL, tenant TEXT NOT NULL, client TEXT NOT NULL,
        model TEXT NOT NULL, {_NUMBERS}, PRIMARY KEY (width, start, tenant, client, model)) WITHOUT ROWID;
    CREATE TABLE IF NOT EXISTS ledger.ledger_conversations (
        tenant TEXT NOT NULL, id TEXT NOT NULL, client TEXT NOT NULL, model TEXT, first REAL NOT NULL,
        last REAL NOT NULL, {_NUMBERS}, cache_until REAL, kept_warm INTEGER NOT NULL,
        PRIMARY KEY (tenant, id)) WITHOUT ROWID;
    CREATE TABLE IF NOT EXISTS ledger.ledger_turns (
        id INTEGER PRIMARY KEY, time REAL NOT NULL, tenant TEXT NOT NULL, conversation TEXT NOT NULL,
        row TEXT NOT NULL);
    CREATE INDEX IF NOT EXISTS ledger.ledger_turns_by_conversation ON ledger_turns (tenant, conversation, time);
    CREATE INDEX IF NOT EXISTS ledger.ledger_turns_by_time ON ledger_turns (time);
    CREATE INDEX IF NOT EXISTS ledger.ledger_conversations_by_id ON ledger_conversations (id);
""" + "".join(
    f"""
    CREATE INDEX IF NOT EXISTS ledger.ledger_conversations_by_{column} ON ledger_conversations ({column});
    CREATE INDEX IF NOT EXISTS ledger.ledger_conversations_by_tenant_{column} ON ledger_conversations (tenant, {column});
    """
    for column in _ORDER_COLUMNS.values()
)


def ledger_path(store_path: str) -> str:
    """The ledger's file beside the store's: ``store.ledger.sqlite3`` for ``store.sqlite3``."""
    root, ext = os.path.splitext(store_path)
    return f"{root}.ledger{ext or '.sqlite3'}"


def attach_ledger(conn: sqlite3.Connection, path: str, *, create: bool, give_up_at: float) -> str:
    """Attach the ledger's file to the store's connection as ``ledger`` (with ``create``: first
    create it, mode 0600, and its tables; without, only a file that is there: ``cg-store`` never
    makes one). WAL, like the store's; its commits are not fsynced (synchronous=NORMAL): what a
    power cut may lose is the last rows, which cost no request. A ledger that cannot be attached
    leaves the store as it is, and says why (the returned error, "" when attached): its writes
    fail, counted (StoreStats.ledger_write_errors). Other processes on the same file (``--workers``)
    opening it at once wait for each other, until ``give_up_at`` (``time.monotonic``)."""
    while True:
        try:
            if create:
                os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
            elif not os.path.exists(path):
                return ""
            conn.execute("ATTACH DATABASE ? AS ledger", ("file:" + urllib.request.pathname2url(path) + "?mode=rw",))
            conn.execute("PRAGMA ledger.auto_vacuum = INCREMENTAL")  # only takes on a new file
            conn.execute("PRAGMA ledger.journal_mode = WAL")
            conn.execute("PRAGMA ledger.synchronous = NORMAL")
            conn.execute("PRAGMA ledger.journal_size_limit = 67108864")
            _set_up(conn, create)
            return ""
        except (OSError, sqlite3.Error) as e:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            with contextlib.suppress(sqlite3.Error):
                conn.execute("DETACH DATABASE ledger")
            # Switching a new file to WAL takes a lock SQLite does not wait for (as for the store's).
            if not (locked(e) and time.monotonic() < give_up_at):
                return f"cannot attach the ledger {path}: {e}"
            time.sleep(0.01)  # the store's worker thread (or cg-store), never the reactor's


def locked(error: Exception) -> bool:
    """Whether SQLite refused for a lock another connection holds (worth trying again)."""
    return isinstance(error, sqlite3.OperationalError) and "locked" in str(error)


def _set_up(conn: sqlite3.Connection, create: bool) -> None:
    """Create the tables (with ``create``) and add the FLAT columns a file made by an older cg lacks
    (0 in its rows: it counted no pings), in one transaction holding the write lock: two processes
    opening an older file at once would otherwise both see a column missing, and the second's ALTER
    fail. A file that needs nothing is only read: cg-store may open one it cannot write."""
    if not create and not _missing(conn):
        return
    # One script: executescript commits a transaction begun before it.
    conn.executescript("BEGIN IMMEDIATE;" + (SCHEMA if create else ""))
    for table, name in _missing(conn):
        kind = "REAL" if name.startswith("cost") else "INTEGER"
        try:
            conn.execute(f"ALTER TABLE ledger.{table} ADD COLUMN {name} {kind} NOT NULL DEFAULT 0")
        except sqlite3.OperationalError as e:
            if "duplicate column name" not in str(e):
                raise
    conn.execute("COMMIT")


def _missing(conn: sqlite3.Connection) -> list[tuple[str, str]]:
    """(table, column) of each FLAT column the ledger's tables lack (none of a table not there)."""
    missing = []
    for table in ("ledger_buckets", "ledger_conversations"):
        have = {row[1] for row in conn.execute(f"PRAGMA ledger.table_info({table})")}
        missing += [(table, name) for name in FLAT if have and name not in have]
    return missing


_PLACES = ", ".join("?" * len(FLAT))
# Columns by name, never by place: a file made before one of FLAT's later fields has it at the end
# (`_migrate`).
_CONVERSATION_COLUMNS = f"tenant, id, client, model, first, last, {', '.join(FLAT)}, cache_until, kept_warm"
_ADD_BUCKET = (f"INSERT INTO ledger_buckets (width, start, tenant, client, model, {', '.join(FLAT)})"
               f" VALUES (?, ?, ?, ?, ?, {_PLACES})"
               f" ON CONFLICT (width, start, tenant, client, model) DO UPDATE SET {_SUMS}")
# The later of two expiries, either of which may be NULL.
_LATER = "max(coalesce(cache_until, excluded.cache_until), coalesce(excluded.cache_until, cache_until))"
_ADD_CONVERSATION = (
    f"INSERT INTO ledger_conversations ({_CONVERSATION_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, {_PLACES}, ?, ?)"
    f" ON CONFLICT (tenant, id) DO UPDATE SET model = coalesce(excluded.model, model),"
    f" first = min(first, excluded.first), last = max(last, excluded.last), {_SUMS},"
    f" cache_until = {_LATER}, kept_warm = excluded.kept_warm"
)
# A batch's pings of a conversation it holds no request of: added to its row, if there is one.
_PINGED = ("UPDATE ledger_conversations SET kept_warm = 1, cache_until = max(coalesce(cache_until, :until), :until),"
           " pings = pings + :pings, cost_pings = cost_pings + :cost WHERE tenant = :tenant AND id = :id")


class SQLiteLedger:
    """The ledger's tables on one connection (see the module's doc); every method is one statement or
    one transaction."""

    def __init__(self, conn: sqlite3.Connection):
        self.conn = conn

    def write(self, ops: Sequence[Op], max_turns: int) -> None:
        """One batch of `record`s, in one transaction, then the turns past `max_turns`
        (the oldest written) go. BEGIN, not BEGIN IMMEDIATE: that would lock the store's file too."""
        batch = Batch.of(ops)
        self.conn.execute("BEGIN")
        try:
            self.conn.executemany(_ADD_BUCKET, [
                (width, start, tenant, client, model or "", *flatten(totals))
                for (start, width, tenant, client, model), totals in batch.buckets.items()])
            self.conn.executemany(_ADD_CONVERSATION, [
                (s.tenant, s.id, s.client, s.model, s.first, s.last, *flatten(s.totals), s.cache_until,
                 int(s.kept_warm))
                for s in batch.conversations.values() if s.client is not None])
            self.conn.executemany(_PINGED, [  # named: sqlite3 refuses numbered ?N with a sequence from 3.14
                {"until": s.cache_until, "tenant": s.tenant, "id": s.id, "pings": s.totals.pings,
                 "cost": s.totals.cost_pings}
                for s in batch.conversations.values() if s.client is None])
            self.conn.executemany(
                "INSERT INTO ledger_turns (time, tenant, conversation, row) VALUES (?, ?, ?, ?)",
                [(turn.time, turn.tenant, turn.conversation, dump_turn(turn, changes)) for turn, changes in batch.turns])
            self.conn.execute("DELETE FROM ledger_turns WHERE id <= (SELECT max(id) FROM ledger_turns) - ?",
                              (max_turns,))
            self.conn.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                self.conn.execute("ROLLBACK")
            raise

    def totals(self, tenant: str | None, since: float | None) -> Totals:
        minutes_from, hours_from = spans(since)
        where, args = _tenant(tenant)
        select = f"SELECT {_TOTALS} FROM ledger_buckets WHERE width = ? AND start >= ?"
        sql, params = select + where, [HOUR, hours_from, *args]
        if minutes_from is not None:
            sql += f" UNION ALL {select} AND start < ?{where}"
            params += [MINUTE, minutes_from, hours_from, *args]
        return sum((unflatten([v or 0 for v in row]) for row in self.conn.execute(sql, params)), Totals())

    def buckets(self, tenant: str | None, since: float, width: float) -> list[Bucket]:
        where, args = _tenant(tenant)
        rows = self.conn.execute(
            f"SELECT start, width, tenant, client, model, {', '.join(FLAT)} FROM ledger_buckets"
            f" WHERE width = ? AND start > ?{where} ORDER BY start, tenant, client, model",
            (width, since - width, *args))
        return [Bucket(start, w, t, client, model or None, unflatten(numbers))
                for start, w, t, client, model, *numbers in rows]

    def conversations(self, tenant: str | None, offset: int, limit: int,
                      order: str) -> tuple[list[Conversation], int]:
        where, args = _tenant(tenant)
        where = where.replace(" AND", " WHERE", 1)
        rows = self.conn.execute(
            f"SELECT {_CONVERSATION_COLUMNS} FROM ledger_conversations{where} ORDER BY {_ORDER_COLUMNS[order]} DESC LIMIT ? OFFSET ?",
            (*args, limit, offset)).fetchall()
        (count,) = self.conn.execute(f"SELECT count(*) FROM ledger_conversations{where}", args).fetchone()
        return [_conversation(row) for row in rows], count

    def conversation(self, tenant: str | None, id_: str) -> tuple[Conversation, list[Turn], list[Change]] | None:
        row = self.conn.execute(*find_conversation(tenant, id_)).fetchone()
        if row is None:
            return None
        summary = _conversation(row)
        turns = [load_turn(text) for (text,) in self.conn.execute(
            "SELECT row FROM ledger_turns WHERE tenant = ? AND conversation = ?", (summary.tenant, id_))]
        turns.sort(key=lambda pair: (pair[0].time, pair[0].seq))
        return summary, [turn for turn, _ in turns], [c for _, changes in turns for c in changes]

    def turns(self) -> list[tuple[Turn, Sequence[Change]]]:
        rows: list[tuple[Turn, Sequence[Change]]] = [load_turn(text) for (text,) in self.conn.execute(
            "SELECT row FROM ledger_turns")]
        rows.sort(key=lambda pair: (pair[0].time, pair[0].seq))
        return rows

    def trim(self, now: float, days: float, limit: int) -> int:
        """Delete at most `limit` rows of each table past retention, in one transaction: one batch
        of a trim (`cg.store.threaded.ThreadedLedger.trim` runs them until one deletes nothing)."""
        horizon = now - days * 86400.0
        bucket = "SELECT width, start, tenant, client, model FROM ledger_buckets WHERE width = ? AND start <= ? LIMIT ?"
        self.conn.execute("BEGIN")
        try:
            count = sum(self.conn.execute(sql, args).rowcount for sql, args in (
                (f"DELETE FROM ledger_buckets WHERE (width, start, tenant, client, model) IN ({bucket})",
                 (MINUTE, horizon - MINUTE, limit)),
                (f"DELETE FROM ledger_buckets WHERE (width, start, tenant, client, model) IN ({bucket})",
                 (HOUR, horizon - HOUR, limit)),
                ("DELETE FROM ledger_conversations WHERE (tenant, id) IN"
                 " (SELECT tenant, id FROM ledger_conversations WHERE last < ? LIMIT ?)", (horizon, limit)),
                ("DELETE FROM ledger_turns WHERE id IN (SELECT id FROM ledger_turns WHERE time < ? LIMIT ?)",
                 (horizon, limit)),
            ))
            self.conn.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                self.conn.execute("ROLLBACK")
            raise
        return count


def find_conversation(tenant: str | None, id_: str) -> tuple[str, tuple[str, ...]]:
    """The query for a conversation's summary row (tenant None: the most recently active of its
    id's): a search of an index either way, not a scan of every conversation."""
    where, args = _tenant(tenant)
    return (f"SELECT {_CONVERSATION_COLUMNS} FROM ledger_conversations WHERE id = ?{where} ORDER BY last DESC"
            " LIMIT 1", (id_, *args))


def _tenant(tenant: str | None) -> tuple[str, tuple[str, ...]]:
    return ("", ()) if tenant is None else (" AND tenant = ?", (tenant,))


def _conversation(row: Sequence[Any]) -> Conversation:
    tenant, id_, client, model, first, last, *rest = row
    numbers, (cache_until, kept_warm) = rest[:len(FLAT)], rest[len(FLAT):]
    return Conversation(id_, tenant, client, model, first, last, unflatten(numbers), cache_until, bool(kept_warm))
