"""The durable store behind ``<<cg:ID>>`` markers, and of frozen repair texts.

cg may only send a marker upstream once the original it stands for is committed here: a
marker whose original is lost is context the model can never get back. Everything that can
fail does so as ``StoreError`` (or a ``None`` read), so the proxy can fail open: forward
without lossy compaction instead of erroring to the client.

A store whose reads fail (the file damaged, replaced or its tables dropped while cg runs) is
*unhealthy*: it vouches for no original (``known`` answers nothing) until a put has written
and read back again, so cg sends no marker it might not be able to answer.

``sqlite:PATH`` keeps them in one machine's file; ``redis://`` (``rediss://``, ``unix://``) in a
Redis that several cg instances share (cg.store.redis, with the ``redis`` extra installed).
"""

from __future__ import annotations

import os

from twisted.internet.interfaces import IReactorFromThreads

from cg.exchange.ledger import DEFAULT_DAYS, DEFAULT_MAX_TURNS
from cg.store.base import DEFAULT_MAX_BYTES, IStore, StoreError, StoreInfo, StoreStats
from cg.store.ledger import MemoryLedger
from cg.store.memory import MemoryStore
from cg.store.redis import PASSWORD_ENV, RedisAddress, RedisDB, RedisStore, store_password
from cg.store.sqlite import SQLiteDB, SQLiteStore

__all__ = [
    "DEFAULT_MAX_BYTES", "PASSWORD_ENV", "IStore", "MemoryStore", "RedisAddress", "RedisDB", "RedisStore",
    "SQLiteDB", "SQLiteStore", "StoreError", "StoreInfo", "StoreStats", "default_store_url", "parse_store_url",
    "store_from_url", "store_label", "store_password", "usable_store_url",
]

_USE = "use sqlite:PATH, redis://[user:password@]host:port/db, rediss://..., unix:///path/to/socket or memory:"


def parse_store_url(url: str) -> tuple[str, str]:
    """``sqlite:PATH`` -> ("sqlite", PATH with ~ expanded); ``memory:`` -> ("memory", "");
    a Redis URL -> ("redis", the URL). Raises ValueError, in one line, naming what is wrong."""
    scheme, sep, rest = url.partition(":")
    if sep and scheme == "memory" and not rest:
        return "memory", ""
    if sep and scheme == "sqlite" and rest:
        return "sqlite", os.path.expanduser(rest)
    if sep and scheme in ("redis", "rediss", "unix"):
        RedisAddress.parse(url)
        return "redis", url
    raise ValueError(f"unknown store URL {RedisAddress.redacted(url)!r}: {_USE}")


def usable_store_url(url: str) -> tuple[str, str]:
    """``parse_store_url``, and a Redis URL also needs the redis package: without it, a ValueError in one
    line naming the extra to install (else cg would start, and run without its store for good)."""
    scheme, where = parse_store_url(url)
    if scheme == "redis":
        try:
            import redis  # noqa: F401  # only whether it imports
        except ImportError as error:
            raise ValueError(f"a Redis store needs the redis extra: pip install 'cg[redis]' ({error})") from error
    return scheme, where


def store_label(url: str) -> str:
    """What logs and ``cg-store`` call the store: its URL, ~ expanded, without a password."""
    scheme, where = parse_store_url(url)
    return RedisAddress.parse(where).label if scheme == "redis" else f"{scheme}:{where}"


def store_from_url(
    url: str,
    reactor: IReactorFromThreads | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    password: str | None = None,
    ledger_days: float = DEFAULT_DAYS,
    ledger_max_turns: int = DEFAULT_MAX_TURNS,
) -> IStore:
    """The store for ``--store URL``. Raises ValueError on a malformed URL (a usage error),
    never on a store that fails to open (that fails open, at run time). ``password`` (see
    ``store_password``) is a Redis store's, in place of the URL's. Its ``ledger`` keeps rollups and
    conversation summaries ``ledger_days``, and the newest ``ledger_max_turns`` turns."""
    scheme, path = parse_store_url(url)
    if scheme == "memory":
        return MemoryStore(max_bytes, ledger=MemoryLedger(ledger_days, ledger_max_turns))
    if scheme == "redis":
        return RedisStore(path, max_bytes=max_bytes, reactor=reactor, password=password, ledger_days=ledger_days,
                          ledger_max_turns=ledger_max_turns)
    return SQLiteStore(path, max_bytes=max_bytes, reactor=reactor, ledger_days=ledger_days,
                       ledger_max_turns=ledger_max_turns)


def default_store_url(environ: dict[str, str] | None = None) -> str:
    """systemd's StateDirectory= (the first, if several), else the XDG per-user state dir."""
    env = os.environ if environ is None else environ
    state = env.get("STATE_DIRECTORY", "").split(":")[0]
    if state:
        return "sqlite:" + os.path.join(state, "store.sqlite3")
    xdg = env.get("XDG_STATE_HOME", "")
    if not os.path.isabs(xdg):  # the XDG spec says to ignore relative paths
        xdg = os.path.join(os.path.expanduser("~"), ".local", "state")
    return "sqlite:" + os.path.join(xdg, "cg", "store.sqlite3")
