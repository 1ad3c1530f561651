"""The durable store behind ``<<cg:ID>>`` markers, and of frozen repair texts.

cg may only send a marker upstream once the original it stands for is committed here: a
marker whose original is lost is context the model can never get back. Everything that can
fail does so as ``StoreError`` (or a ``None`` read), so the proxy can fail open: forward
without lossy compaction instead of erroring to the client.

A store whose reads fail (the file damaged, replaced or its tables dropped while cg runs) is
*unhealthy*: it vouches for no original (``known`` answers nothing) until a put has written
and read back again, so cg sends no marker it might not be able to answer.
"""

from __future__ import annotations

import os

from cg.store.base import DEFAULT_MAX_BYTES, IStore, StoreError, StoreInfo, StoreStats
from cg.store.memory import MemoryStore
from cg.store.sqlite import SQLiteDB, SQLiteStore

__all__ = [
    "DEFAULT_MAX_BYTES", "IStore", "MemoryStore", "SQLiteDB", "SQLiteStore", "StoreError", "StoreInfo",
    "StoreStats", "default_store_url", "parse_store_url", "store_from_url",
]


def parse_store_url(url: str) -> tuple[str, str]:
    """``sqlite:PATH`` -> ("sqlite", PATH with ~ expanded); ``memory:`` -> ("memory", "")."""
    scheme, sep, rest = url.partition(":")
    if sep and scheme == "memory" and not rest:
        return "memory", ""
    if sep and scheme == "sqlite" and rest:
        return "sqlite", os.path.expanduser(rest)
    raise ValueError(f"unknown store URL {url!r}: use sqlite:PATH or memory:")


def store_from_url(url: str, reactor=None, max_bytes: int = DEFAULT_MAX_BYTES) -> IStore:
    """The store for ``--store URL``. Raises ValueError on a malformed URL (a usage error),
    never on a store that fails to open (that fails open, at run time)."""
    scheme, path = parse_store_url(url)
    if scheme == "memory":
        return MemoryStore(max_bytes)
    return SQLiteStore(path, max_bytes, reactor)


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
