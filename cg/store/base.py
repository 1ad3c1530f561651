"""What every store is: the interface, its errors and counters (no backend here)."""

from __future__ import annotations

import errno
import sqlite3
from collections.abc import Iterable, Sequence

import attrs
from twisted.internet.defer import Deferred
from zope.interface import Attribute, Interface

from cg.exchange.ledger import Bucket, Change, Conversation, Totals, Turn

DEFAULT_MAX_BYTES = 1024 * 1024 * 1024
# Evict down to this share of max_bytes, so a full store does not evict on every put.
EVICT_TO = 0.9
# Seconds a conversation's cache record (``cache_until``) is kept past its expiry, then dropped: a
# conversation resumed later than that counts as unknown (first-sight decisions only).
CACHE_RECORD_DAYS = 7


class StoreError(Exception):
    """The store could not do what was asked; the caller fails open."""


@attrs.define
class StoreStats:
    """What /stats shows of the store. ``writes`` counts originals written, not calls.

    ``healthy`` is False from a failed read until a write and a read succeed again, with the
    latest error (``unhealthy_reason``) and the Unix time it became unhealthy.
    """

    writes: int = 0
    write_errors: int = 0
    reads: int = 0
    hits: int = 0
    misses: int = 0
    read_errors: int = 0
    evictions: int = 0
    ledger_write_errors: int = 0  # ledger writes that failed (cg.store.base.ILedger; cg.store.threaded.ThreadedLedger)
    ledger_rows_lost: int = 0  # rows those failures lost (a store with no room holds them for the next batch)
    healthy: bool = True
    unhealthy_reason: str | None = None
    unhealthy_since: float | None = None


@attrs.frozen
class StoreInfo:
    """What ``cg-store info`` and /stats show. ``oldest_use`` is a Unix time, or None if empty."""

    entries: int
    bytes: int
    oldest_use: float | None
    frozen_entries: int
    frozen_bytes: int


class IStore(Interface):
    """Originals by (tenant, id), frozen texts (repairs, the cache-aware policy's epochs) by
    (tenant, key), and when each conversation's prompt cache expires.

    The seam for other backends: every method but ``known`` and ``touch`` returns a
    Deferred, and none blocks the reactor thread. Ids stored under one tenant are
    invisible under every other.

    A store that cannot read what it holds is unhealthy (``stats.healthy`` False): it
    forgets every id it knew, ``known`` answers nothing, and only a ``put`` that writes and
    reads back makes it healthy again.
    """

    stats = Attribute("A StoreStats, updated on the reactor thread.")
    ledger = Attribute("The dashboard's history in this store: an ILedger (below).")

    def put(tenant: str, originals: dict[str, bytes]) -> Deferred[set[str]]:
        """Store originals (id -> exact bytes); fire once committed, with the ids that were
        written (ids already stored are not rewritten). Errback with StoreError if not
        committed. On an unhealthy store, fire only once they also read back."""

    def known(tenant: str, ids: Iterable[str]) -> set[str]:
        """Synchronously: which of ``ids`` are known to be committed (none while the store
        is unhealthy). Only ids outside this set need a ``put``."""

    def touch(tenant: str, ids: Iterable[str], frozen: Iterable[str] = ()) -> None:
        """Record that originals ``ids`` and the frozen texts under ``frozen`` were used (for LRU and
        ``purge``), off the request path."""

    def get(tenant: str, id: str) -> Deferred[bytes | None]:
        """The original, or None if unknown, evicted, or the store is broken."""

    def freeze(tenant: str, key: str, text: bytes) -> Deferred[bytes]:
        """Keep ``text`` under ``key`` unless something is there already; fire with what is
        stored, so every replay is identical. Errback with StoreError."""

    def frozen(tenant: str, key: str) -> Deferred[bytes | None]:
        """The text frozen under ``key``, or None. Errback with StoreError if the store
        cannot tell (so the caller does not mistake a broken store for "never frozen")."""

    def cache_until(tenant: str, key: str, until: float) -> Deferred[float | None]:
        """Record that the provider's prompt cache for conversation ``key`` lives at least until
        ``until`` (Unix time), keeping the later of that and what is recorded; fire with what was
        recorded before (None: nothing). One atomic step, so that of several cg sharing the store
        each sees the others' requests. A record is dropped CACHE_RECORD_DAYS after it expires;
        purges leave records alone (they hold no content). Errback with StoreError."""

    def info() -> Deferred[StoreInfo]:
        """Sizes and ages."""

    def purge(older_than_days: float | None) -> Deferred[int]:
        """Delete originals and frozen texts unused for that long (all if None); fire with
        how many were deleted."""

    def close() -> Deferred[None]:
        """Flush pending last-use times and release the store."""


def as_store_error(error: BaseException) -> StoreError:
    """`error` as a StoreError, the backend's own as its cause (`no_room` reads it)."""
    if isinstance(error, StoreError):
        return error
    wrapped = StoreError(f"{type(error).__name__}: {error}")
    wrapped.__cause__ = error
    return wrapped


_SQLITE_FULL = 13  # sqlite3.SQLITE_FULL, which Python names from 3.11 on


def no_room(error: BaseException) -> bool:
    """Whether `error` (or the backend's error it wraps) says the store has no room now: a disk
    full (ENOSPC, EDQUOT; SQLite's SQLITE_FULL) or Redis at its maxmemory (an OOM reply). Room
    comes back (a file deleted, keys expired), so what failed for it may be tried again."""
    error = error.__cause__ or error
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if isinstance(error, sqlite3.OperationalError):
        return getattr(error, "sqlite_errorcode", None) == _SQLITE_FULL or "disk is full" in str(error)
    return type(error).__name__ == "OutOfMemoryError" or str(error).startswith("OOM ")


class ILedger(Interface):
    """The ledger (`cg.exchange.ledger`): every forwarded request's `Turn` and its `Change`s, their
    per-minute and per-hour rollups (`Bucket`) and conversation summaries (`Conversation`), as a
    store's ``ledger`` attribute. `cg.store.ledger.MemoryLedger` is the reference every backend is
    tested against; a backend with blocking I/O writes on its worker thread.

    Bounded: rollups and summaries kept ``days``, turns the newest ``max_turns``. A write never
    fails the caller: a failed write costs rows (held for a store with no room), never a request. Every query's Deferred fires with what the store holds (tenant None: every
    tenant's; a tenant: only its own).
    """

    def record(turn: Turn, changes: Sequence[Change]) -> None:
        """Keep a `Turn` and its `Change`s (a sequence), and add it to its rollups and its
        conversation's summary. A keep-alive ping's turn (``kind`` PING) adds to a summary that
        exists only: its ``cache_until`` moves on (if later) and ``kept_warm`` holds until the next
        request; ``first`` and ``last`` stay the requests'. Returns at once; the write happens on
        the store's thread."""

    def totals(tenant: str | None, since: float | None) -> Deferred[Totals]:
        """`Totals` of the turns in the minutes that end after `since` (Unix time; None: all the
        ledger keeps)."""

    def buckets(tenant: str | None, since: float, width: float) -> Deferred[list[Bucket]]:
        """The `Bucket`s of `width` (MINUTE or HOUR) that end after `since` (one that holds `since`
        counts whole), oldest first."""

    def conversations(tenant: str | None, offset: int, limit: int,
                      order: str = "last") -> Deferred[tuple[list[Conversation], int]]:
        """(`limit` `Conversation` summaries after `offset`, sorted descending by `order` (one of
        `cg.exchange.ledger.ORDERS`: "last" is the most recently active first), and how many there
        are in all)."""

    def conversation(tenant: str | None, id: str) -> Deferred[tuple[Conversation, list[Turn], list[Change]] | None]:
        """(`Conversation`, its `Turn`s oldest first, their `Change`s), or None when unknown. With
        tenant None and the same id under several tenants: the most recently active one."""

    def turns() -> Deferred[list[tuple[Turn, Sequence[Change]]]]:
        """Every `Turn` kept, of every tenant, oldest first, each with its `Change`s: what
        `cg-report --store` counts. Turns without a conversation are here too."""

    def trim(now: float) -> Deferred[int]:
        """Drop what is past its retention; fire with how many rows went."""
