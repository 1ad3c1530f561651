"""The Redis store: originals shared by every cg that points at one Redis (or Valkey).

All Redis I/O runs on the store's worker thread (see cg.store.threaded), through the
maintained ``redis`` client (the ``redis`` extra), imported only when a Redis store is made.

Keys, under a prefix (``cg:``), one namespace per tenant::

    cg:t:TENANT:o:ID     an original (a string: its exact bytes)
    cg:t:TENANT:f:KEY    a frozen text (a repair, an epoch of the cache-aware policy)
    cg:t:TENANT:c:KEY    when conversation KEY's prompt cache expires (a number, Unix time; the
                         key expires CACHE_RECORD_DAYS later: Redis drops it, no eviction, no purge)
    cg:lru:o, cg:lru:f   sorted sets: every original's / frozen text's key, scored by last use (µs stamps that only grow)
    cg:meta              a hash: bytes_o, bytes_f (sizes kept in step) and gen (see below)

TENANT is percent-encoded, so no tenant's keys are a prefix of another's. Every write is one
Lua script, so cg instances sharing the Redis see each other's writes whole: a put stores the
new originals, refreshes the others' last use and evicts (least recently used originals first,
frozen texts only once no original is left) in one step. cg does its own eviction: it never
needs the server's ``maxmemory-policy``.

``gen`` changes whenever entries go (an eviction, a purge) or the data went away under cg (a
flushed or restarted Redis without persistence loses it): an instance that sees a ``gen`` other
than the last it knew forgets which ids it knew were stored, as SQLite's store does when
another connection wrote.
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, cast

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
from cg.store.redis_ledger import RedisLedger
from cg.store.threaded import Connection, ThreadedStore

if TYPE_CHECKING:
    import redis as redis_client

SCHEMES = ("redis", "rediss", "unix")
DEFAULT_PORT = 6379
# Seconds to wait for Redis to connect or answer a command, unless the URL says ?timeout=.
DEFAULT_TIMEOUT = 2.0
# After a command timed out, seconds during which the store fails at once instead of waiting
# for a slow Redis again (a Redis that refuses connections fails at once anyway).
RETRY_AFTER = 5.0
# The environment variable a Redis password may come from.
PASSWORD_ENV = "CG_STORE_PASSWORD"
# Entries a purge deletes per script run: a long script would stall Redis for its other clients.
PURGE_BATCH = 1000


@attrs.frozen
class RedisAddress:
    """Where a Redis is and how to reach it, from a ``--store`` URL."""

    scheme: str
    host: str | None = None
    port: int = DEFAULT_PORT
    socket: str | None = None  # unix:
    db: int = 0
    username: str | None = None
    password: str | None = attrs.field(default=None, repr=False)
    ca: str | None = None  # rediss: a CA file to verify the server with, instead of the system's
    timeout: float = DEFAULT_TIMEOUT

    @classmethod
    def parse(cls, url: str) -> RedisAddress:
        """``redis://[user:password@]host[:port][/db]``, ``rediss://`` (TLS, ``?ca=FILE``),
        ``unix:///path/to/socket[?db=N]``; each may end in ``?timeout=SECONDS``.
        Raises ValueError, in one line, on anything else."""
        shown = cls.redacted(url)
        try:
            parts = urllib.parse.urlsplit(url)
            query = urllib.parse.parse_qs(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
            port = parts.port
        except ValueError as e:
            raise ValueError(f"not a Redis URL {shown!r}: {e}") from None
        scheme = parts.scheme
        if scheme not in SCHEMES:
            raise ValueError(f"not a Redis URL {shown!r}")
        if parts.fragment:
            raise ValueError(f"a Redis URL has no #fragment: {shown!r}")
        allowed = {"timeout", "db"} if scheme == "unix" else {"timeout", "ca"} if scheme == "rediss" else {"timeout"}
        unknown = sorted(set(query) - allowed)
        if unknown:
            raise ValueError(f"{shown!r}: unknown parameter {unknown[0]!r} (allowed: {', '.join(sorted(allowed))})")
        one = {name: values[-1] for name, values in query.items()}
        username = urllib.parse.unquote(parts.username) if parts.username else None
        password = urllib.parse.unquote(parts.password) if parts.password else None
        timeout = _number(one.get("timeout", str(DEFAULT_TIMEOUT)), "timeout", url, float)
        if not timeout > 0:
            raise ValueError(f"{shown!r}: timeout must be more than 0 seconds")
        if scheme == "unix":
            if parts.hostname or port or not parts.path or parts.path == "/":
                raise ValueError(f"{shown!r}: write unix:///path/to/socket[?db=N]")
            db = _number(one.get("db", "0"), "db", url, int)
            return cls(scheme, socket=parts.path, db=db, username=username, password=password, timeout=timeout)
        if not parts.hostname:
            raise ValueError(f"{shown!r}: no host (write {scheme}://host:port/db)")
        path = parts.path.strip("/")
        db = _number(path or "0", "database number", url, int)
        ca = one.get("ca") or None
        return cls(scheme, parts.hostname, port or DEFAULT_PORT, None, db, username, password, ca, timeout)

    @property
    def label(self) -> str:
        """The URL without its password: for logs, /stats and ``cg-store``."""
        user = f"{urllib.parse.quote(self.username, safe='')}@" if self.username else ""
        query = {"timeout": f"{self.timeout:g}"} if self.timeout != DEFAULT_TIMEOUT else {}
        if self.scheme == "unix":
            query = {**({"db": str(self.db)} if self.db else {}), **query}
            where = f"unix://{user}{self.socket}"
        else:
            host = f"[{self.host}]" if self.host and ":" in self.host else self.host
            where = f"{self.scheme}://{user}{host}:{self.port}/{self.db}"
            if self.ca:
                query = {"ca": self.ca, **query}
        return where + ("?" + urllib.parse.urlencode(query, safe="/") if query else "")

    @staticmethod
    def redacted(url: str) -> str:
        """``url`` with any password in it replaced by ``***`` (for a refusal's message)."""
        scheme, sep, rest = url.partition("://")
        userinfo, at, where = rest.rpartition("@")
        if not sep or not at or ":" not in userinfo:
            return url
        return f"{scheme}://{userinfo.split(':', 1)[0]}:***@{where}"

    def client(self, password: str | None = None) -> redis_client.Redis:
        """A client (no I/O yet) that never retries on its own but to reconnect once at once
        (a connection closed while idle), and waits at most ``timeout`` for anything."""
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        kwargs: dict[str, Any] = {
            "db": self.db,
            "username": self.username,
            "password": self.password if password is None else password,
            "socket_timeout": self.timeout,
            "socket_connect_timeout": self.timeout,
            "retry": Retry(NoBackoff(), 1, (redis.ConnectionError,)),
            "client_name": "cg",
        }
        if self.scheme == "unix":
            return redis.Redis(unix_socket_path=self.socket, **kwargs)
        if self.scheme == "rediss":
            kwargs.update(ssl=True, ssl_ca_certs=self.ca)
        return redis.Redis(host=self.host or "localhost", port=self.port, **kwargs)


def _number(text: str, what: str, url: str, kind: Callable[[str], Any]) -> Any:
    try:
        value = kind(text)
    except ValueError:
        raise ValueError(f"{RedisAddress.redacted(url)!r}: {what} is not a number: {text!r}") from None
    if value < 0:
        raise ValueError(f"{RedisAddress.redacted(url)!r}: {what} must not be negative")
    return value


def store_password(url: str, password_file: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """The Redis password from ``--store-password-file``, else from $CG_STORE_PASSWORD when the
    URL has none (None: the URL's, or none). Raises ValueError, in one line, for a file that
    cannot be read or is empty, a file given for a URL that has a password already, or any
    file for a store that is not Redis."""
    env = os.environ if environ is None else environ
    redis_url = url.partition(":")[0] in SCHEMES
    if password_file is None:
        if not redis_url or RedisAddress.parse(url).password is not None:
            return None
        return env.get(PASSWORD_ENV) or None
    if not redis_url:
        raise ValueError("a password file is for a Redis store (redis://, rediss:// or unix://)")
    if RedisAddress.parse(url).password is not None:
        raise ValueError("the --store URL has a password already: give it in one place")
    try:
        with open(password_file, encoding="utf-8") as f:
            password = f.read().rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {password_file}: {getattr(e, 'strerror', None) or e}") from None
    if not password:
        raise ValueError(f"{password_file} is empty")
    return password


# Lua, run by Redis: each script is one atomic step for every cg sharing the Redis.
# KEYS[1..3] are always meta, lru:o and lru:f. Last uses are microseconds, and each use gets a
# stamp above every earlier one (meta's ``last``): least recently used means used first as
# Redis saw it, whatever the clocks of the machines cg runs on. Entries are deleted in that
# order, originals first, until the total is back under ``target``; ``protect`` keys are skipped.
# Each entry's size as counted in bytes_o/bytes_f, kept in meta ('s:' .. key), so that an entry
# gone under cg (the server's own eviction, an operator's DEL) is subtracted as it was counted.
_SIZES = """
local function sized(key, size)
  redis.call('HSET', meta, 's:' .. key, size)
end
local function forget(key)
  local size = tonumber(redis.call('HGET', meta, 's:' .. key) or redis.call('STRLEN', key))
  redis.call('HDEL', meta, 's:' .. key)
  return size
end
"""
_PRELUDE = """#!lua
local meta, lru_o, lru_f = KEYS[1], KEYS[2], KEYS[3]
local now = tonumber(ARGV[1])
local last = tonumber(redis.call('HGET', meta, 'last') or 0)
local function stamp()
  last = math.max(now, last + 1)
  return string.format('%.0f', last)
end
local function stamped()
  redis.call('HSET', meta, 'last', string.format('%.0f', last))
end
""" + _SIZES

_WRITE = _PRELUDE + """
local max, target, fresh = tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local function evict(protect_o, protect_f)
  local total = tonumber(redis.call('HGET', meta, 'bytes_o') or 0) + tonumber(redis.call('HGET', meta, 'bytes_f') or 0)
  local victims, count = {}, 0
  if total <= max then return victims, count end
  local kinds = {{lru_o, 'bytes_o', protect_o}, {lru_f, 'bytes_f', protect_f}}
  for k = 1, 2 do
    local lru, field, protect = kinds[k][1], kinds[k][2], kinds[k][3]
    local skip = 0
    while total > target do
      local batch = redis.call('ZRANGE', lru, skip, skip + 99)
      if #batch == 0 then break end
      for _, key in ipairs(batch) do
        if total <= target then break end
        if protect[key] then
          skip = skip + 1
        else
          local size = forget(key)
          count = count + redis.call('DEL', key)
          redis.call('ZREM', lru, key)
          if size > 0 then redis.call('HINCRBY', meta, field, -size) end
          total = total - size
          if k == 1 then victims[#victims + 1] = key end
        end
      end
    end
  end
  return victims, count
end
local before = redis.call('HGET', meta, 'gen')
local gen = before
if not gen then
  gen = fresh
  redis.call('HSET', meta, 'gen', gen)
end
local function evicted(count)
  stamped()
  if count > 0 then
    gen = fresh
    redis.call('HSET', meta, 'gen', gen)
  end
end
"""

# KEYS[4..]: the originals' keys; ARGV[5..]: their bodies.
# -> {gen before, gen after, keys written, keys of originals evicted, entries evicted}
_PUT = _WRITE + """
local written, protect = {}, {}
for i = 4, #KEYS do
  local key, body = KEYS[i], ARGV[i + 1]
  protect[key] = true
  if redis.call('SET', key, body, 'NX') then
    redis.call('HINCRBY', meta, 'bytes_o', #body)
    sized(key, #body)
    written[#written + 1] = key
  end
  redis.call('ZADD', lru_o, stamp(), key)
end
local victims, count = evict(protect, {})
evicted(count)
return {before, gen, written, victims, count}
"""

# KEYS[4]: the frozen text's key; ARGV[5]: the text.
# -> {gen before, gen after, the text stored, keys of originals evicted, entries evicted}
_FREEZE = _WRITE + """
local key, text = KEYS[4], ARGV[5]
if redis.call('SET', key, text, 'NX') then
  redis.call('HINCRBY', meta, 'bytes_f', #text)
  sized(key, #text)
end
redis.call('ZADD', lru_f, stamp(), key)
local stored = redis.call('GET', key)
local victims, count = evict({}, {[key] = true})
evicted(count)
return {before, gen, stored, victims, count}
"""

# ARGV[2]: how many of the keys after it are originals' (the rest are frozen texts').
# Only entries still there are stamped: a touch does not bring back an evicted one.
_TOUCH = _PRELUDE + """
local originals = tonumber(ARGV[2])
for i = 3, #ARGV do
  local lru = (i - 2 <= originals) and lru_o or lru_f
  if redis.call('ZSCORE', lru, ARGV[i]) then redis.call('ZADD', lru, stamp(), ARGV[i]) end
end
stamped()
"""

# ARGV: the cutoff ('+inf', or '(' .. microseconds: used before then), the batch size, a fresh gen.
# -> entries deleted (at most a batch of each kind: run again until it says 0)
_PURGE = """#!lua
local meta = KEYS[1]
""" + _SIZES + """
local cutoff, limit, fresh = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local count = 0
local kinds = {{KEYS[2], 'bytes_o'}, {KEYS[3], 'bytes_f'}}
for k = 1, 2 do
  local lru, field = kinds[k][1], kinds[k][2]
  local batch = redis.call('ZRANGEBYSCORE', lru, '-inf', cutoff, 'LIMIT', 0, limit)
  for _, key in ipairs(batch) do
    local size = forget(key)
    redis.call('DEL', key)
    redis.call('ZREM', lru, key)
    if size > 0 then redis.call('HINCRBY', meta, field, -size) end
  end
  count = count + #batch
  if redis.call('ZCARD', lru) == 0 then redis.call('HSET', meta, field, 0) end
end
if count > 0 then redis.call('HSET', meta, 'gen', fresh) end
return count
"""

# KEYS[1]: a conversation's cache record; ARGV: the expiry to keep if later (Unix time), and the
# record's lifetime in ms from now if it is kept. -> the expiry recorded before, or nil.
_CACHE_UNTIL = """#!lua
local before = redis.call('GET', KEYS[1])
if not before or tonumber(before) < tonumber(ARGV[1]) then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
end
return before
"""

# -> {originals, their bytes, the oldest last use or nil, frozen texts, their bytes}
_INFO = """#!lua flags=no-writes
local oldest = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
return {redis.call('ZCARD', KEYS[2]), redis.call('HGET', KEYS[1], 'bytes_o') or '0', oldest[2] or false,
        redis.call('ZCARD', KEYS[3]), redis.call('HGET', KEYS[1], 'bytes_f') or '0'}
"""


class RedisDB:
    """The store's data in one Redis, used synchronously (a Backend, see cg.store.threaded).

    RedisStore uses it on its worker thread only; ``cg-store`` uses it directly. Every failure
    is a StoreError. A command that times out makes every call fail at once for RETRY_AFTER
    seconds, so a slow Redis costs one request a timeout, not every request in the queue.
    ``on_change`` is called when ``gen`` moved under this client (see the module's doc).
    """

    def __init__(
        self,
        address: RedisAddress,
        max_bytes: int = DEFAULT_MAX_BYTES,
        *,
        password: str | None = None,
        clock: Callable[[], float] = time.time,
        prefix: str = "cg:",
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.address = address
        self.max_bytes = max_bytes
        self.clock = clock
        self.prefix = prefix
        self.on_change = on_change
        self.client = address.client(password)
        self._meta, self._lru_o, self._lru_f = prefix + "meta", prefix + "lru:o", prefix + "lru:f"
        self._put, self._freeze, self._touch, self._purge, self._info, self._cache_until = (
            self.client.register_script(source) for source in (_PUT, _FREEZE, _TOUCH, _PURGE, _INFO, _CACHE_UNTIL)
        )
        self.ledger = RedisLedger(self.client, prefix, self._talking)  # the dashboard's keys (cg.store.redis_ledger)
        self._seen: bytes | None = None
        self._down_since: float | None = None  # when a command last timed out
        self._down_reason = ""

    @contextlib.contextmanager
    def _talking(self) -> Iterator[None]:
        import redis

        if self._down_since is not None and time.monotonic() < self._down_since + RETRY_AFTER:
            raise StoreError(self._down_reason)
        try:
            yield
        except redis.TimeoutError as e:
            self._down_since = time.monotonic()
            self._down_reason = f"{self.address.label} is too slow: {as_store_error(e)}"
            raise StoreError(self._down_reason) from e
        except redis.RedisError as e:
            raise StoreError(str(as_store_error(e))) from e

    def _key(self, kind: str, tenant: str, name: str) -> str:
        return f"{self.prefix}t:{urllib.parse.quote(tenant, safe='')}:{kind}:{name}"

    def _parse(self, key: bytes) -> tuple[str, str]:
        """(tenant, id) from an original's key."""
        tenant, _kind, name = key.decode().removeprefix(self.prefix + "t:").split(":", 2)
        return urllib.parse.unquote(tenant), name

    def _saw(self, before: bytes | None, after: bytes) -> None:
        """A write read ``gen`` as ``before`` and left it ``after``."""
        if before != self._seen:
            self.on_change()
        self._seen = after

    def _now(self) -> str:
        return str(round(self.clock() * 1e6))

    def _write_args(self) -> list[str]:
        return [self._now(), str(self.max_bytes), str(self.max_bytes * EVICT_TO), secrets.token_hex(8)]

    def changed_elsewhere(self) -> bool:
        """Whether ``gen`` moved since this client last saw it (it reads it: the first I/O)."""
        with self._talking():
            gen = cast(bytes | None, self.client.hget(self._meta, "gen"))
        changed, self._seen = gen != self._seen, gen
        return changed

    def put(self, tenant: str, originals: dict[str, bytes]) -> tuple[set[str], list[tuple[str, str]], int]:
        keys = {self._key("o", tenant, id_): id_ for id_ in originals}
        with self._talking():
            before, after, written, victims, count = self._put(
                keys=[self._meta, self._lru_o, self._lru_f, *keys], args=[*self._write_args(), *originals.values()]
            )
        self._saw(before, after)
        return {keys[key.decode()] for key in written}, [self._parse(key) for key in victims], count

    def freeze(self, tenant: str, key: str, text: bytes) -> tuple[bytes, list[tuple[str, str]], int]:
        with self._talking():
            before, after, stored, victims, count = self._freeze(
                keys=[self._meta, self._lru_o, self._lru_f, self._key("f", tenant, key)],
                args=[*self._write_args(), text],
            )
        self._saw(before, after)
        return stored, [self._parse(key) for key in victims], count

    def touch(self, keys: Iterable[tuple[str, str, str]]) -> None:
        by_table: dict[str, list[str]] = {"originals": [], "frozen": []}
        for table, tenant, name in keys:
            by_table[table].append(self._key("o" if table == "originals" else "f", tenant, name))
        with self._talking():
            self._touch(
                keys=[self._meta, self._lru_o, self._lru_f],
                args=[self._now(), len(by_table["originals"]), *by_table["originals"], *by_table["frozen"]],
            )

    def cache_until(self, tenant: str, key: str, until: float) -> float | None:
        keep_ms = max(1, round((until - self.clock() + CACHE_RECORD_DAYS * 86400) * 1000))
        with self._talking():
            before = self._cache_until(keys=[self._key("c", tenant, key)], args=[repr(until), keep_ms])
        return None if before is None else float(before)

    def check(self) -> None:
        with self._talking():
            self.client.hget(self._meta, "gen")

    def get(self, tenant: str, id_: str) -> bytes | None:
        with self._talking():
            return cast(bytes | None, self.client.get(self._key("o", tenant, id_)))

    def frozen(self, tenant: str, key: str) -> bytes | None:
        with self._talking():
            return cast(bytes | None, self.client.get(self._key("f", tenant, key)))

    def recent(self, limit: int) -> list[tuple[str, str]]:
        with self._talking():
            keys = cast(list[bytes], self.client.zrevrange(self._lru_o, 0, limit - 1))
        return [self._parse(key) for key in reversed(keys)]

    def info(self) -> StoreInfo:
        with self._talking():
            entries, size, oldest, frozen_entries, frozen_size = self._info(
                keys=[self._meta, self._lru_o, self._lru_f]
            )
        oldest_use = None if oldest is None else float(oldest) / 1e6
        return StoreInfo(int(entries), int(size), oldest_use, int(frozen_entries), int(frozen_size))

    def purge(self, older_than_days: float | None) -> int:
        cutoff = "+inf" if older_than_days is None else f"({round((self.clock() - older_than_days * 86400) * 1e6)}"
        total = 0
        while True:
            with self._talking():
                count = int(
                    self._purge(
                        keys=[self._meta, self._lru_o, self._lru_f], args=[cutoff, PURGE_BATCH, secrets.token_hex(8)]
                    )
                )
            total += count
            if not count:
                return total

    def close(self) -> None:
        self.client.close()


@attrs.define(kw_only=True)
class _RedisConnection(Connection):
    """The thread side of RedisStore (see Connection).

    The client reconnects by itself, so there is nothing to reopen; opening reads ``gen`` and
    the recent ids, and is tried again by the next job until it succeeds. ``gen`` is read again
    at most every ``check_every`` seconds (the tick's flush does it), and after every write.
    """

    address: RedisAddress
    password: str | None
    max_bytes: int
    clock: Callable[[], float]
    prefix: str
    check_every: float
    loaded: bool = False
    check_at: float = 0.0

    def open(self) -> None:
        if self.db is None:
            self.db = RedisDB(
                self.address,
                self.max_bytes,
                password=self.password,
                clock=self.clock,
                prefix=self.prefix,
                on_change=lambda: self.deliver(self.known.clear),
            )
        try:
            self._load()
        except StoreError as e:
            self._broke(StoreError(f"cannot reach {self.address.label}: {e}"))

    def _load(self) -> None:
        db = cast(RedisDB, self.db)
        db.changed_elsewhere()
        self.check_at = time.monotonic() + self.check_every
        self.loaded = True
        self._remember_recent(db)

    def _db(self) -> RedisDB:
        if self.db is None:
            raise StoreError("store is closed")
        db = cast(RedisDB, self.db)
        if not self.loaded:
            self._load()
        elif time.monotonic() >= self.check_at:
            self.check_at = time.monotonic() + self.check_every
            if db.changed_elsewhere():
                self.deliver(self.known.clear)
        return db


@implementer(IStore)
@attrs.define
class RedisStore(ThreadedStore):
    """IStore on a Redis (or Valkey) shared by any number of cg instances; all Redis I/O on one
    worker thread (see ThreadedStore). ``url`` is a ``--store`` URL (see RedisAddress.parse);
    ``password``, if given, is used instead of the URL's."""

    url: str
    password: str | None = attrs.field(default=None, repr=False, kw_only=True)
    prefix: str = attrs.field(default="cg:", kw_only=True)
    address: RedisAddress = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.address = RedisAddress.parse(self.url)
        connect = functools.partial(
            _RedisConnection,
            address=self.address,
            password=self.password,
            max_bytes=self.max_bytes,
            clock=self.clock,
            prefix=self.prefix,
            check_every=self.flush_interval,
        )
        self._start(connect)

    @property
    def label(self) -> str:
        return self.address.label
