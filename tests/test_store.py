"""The store: every original behind a marker must come back, across restarts and failures."""

import os
import sqlite3
import stat
import threading
import time

import pytest
import pytest_twisted
from helpers.stores import GARBAGE, FakeClock, damage, every_call, sync, wait_for
from twisted.internet import reactor
from twisted.logger import LogLevel
from zope.interface.verify import verifyObject

import cg.store.sqlite
from cg.store import (
    IStore,
    MemoryStore,
    RedisStore,
    SQLiteDB,
    SQLiteStore,
    StoreError,
    default_store_url,
    store_from_url,
)
from cg.store.base import CACHE_RECORD_DAYS
from cg.store.sqlite_ledger import ledger_path
from cg.store.threaded import TOUCH_EVERY, RecentlyTouched

DAY = 86400.0


@pytest.fixture
def db_path(tmp_path):
    return str(tmp_path / "state" / "store.sqlite3")


@pytest.fixture
def sqlite_store(db_path, closing):
    def make(path=db_path, **kwargs):
        store = SQLiteStore(path, **kwargs)
        closing(store)
        return store

    return make


@pytest.fixture(params=["sqlite", "memory", "redis"])
def make_store(request, sqlite_store, closing):
    """Every implementation must keep the same contract (Redis: a real redis-server)."""
    server = request.getfixturevalue("redis_server") if request.param == "redis" else None

    def make(max_bytes=cg.store.sqlite.DEFAULT_MAX_BYTES, clock=None):
        clock = clock or FakeClock()
        if request.param == "memory":
            return MemoryStore(max_bytes, clock=clock)
        if request.param == "redis":
            store = RedisStore(server.url, max_bytes=max_bytes, clock=clock)
            closing(store)
            return store
        return sqlite_store(max_bytes=max_bytes, clock=clock)

    return make


def rows(path, sql):
    conn = sqlite3.connect(path)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


def test_every_store_implements_the_interface(db_path, closing):
    store = SQLiteStore(db_path)
    closing(store)
    assert verifyObject(IStore, store)
    assert verifyObject(IStore, MemoryStore())
    redis = RedisStore("redis://127.0.0.1:1/0")  # nothing there: it fails open, at run time
    closing(redis)
    assert verifyObject(IStore, redis)


# The contract, on both stores


@pytest_twisted.ensureDeferred
async def test_put_writes_only_new_ids(make_store):
    store = make_store()
    assert await store.put("", {"a": b"A", "b": b"B"}) == {"a", "b"}
    assert await store.put("", {"a": b"A", "b": b"B", "c": b"C"}) == {"c"}
    assert await store.put("", {}) == set()
    assert store.stats.writes == 3
    assert store.known("", ["a", "b", "c", "d"]) == {"a", "b", "c"}
    assert (await store.info()).entries == 3


@pytest_twisted.ensureDeferred
async def test_get_returns_exact_bytes(make_store):
    store = make_store()
    body = bytes(range(256)) * 4000 + b"\r\n\x1b[0m\xff"
    await store.put("", {"x": body})
    assert await store.get("", "x") == body
    assert await store.get("", "missing") is None
    assert (store.stats.reads, store.stats.hits, store.stats.misses) == (2, 1, 1)


@pytest_twisted.ensureDeferred
async def test_tenants_do_not_see_each_other(make_store):
    store = make_store()
    await store.put("tenant-a", {"x": b"secret of a"})
    assert await store.get("tenant-b", "x") is None
    assert await store.get("", "x") is None
    assert store.known("tenant-b", ["x"]) == set()
    # The same id under another tenant is a separate entry, not a rewrite of a's.
    assert await store.put("tenant-b", {"x": b"secret of b"}) == {"x"}
    assert await store.get("tenant-a", "x") == b"secret of a"
    assert await store.get("tenant-b", "x") == b"secret of b"


@pytest_twisted.ensureDeferred
async def test_eviction_is_least_recently_used(make_store):
    clock = FakeClock()
    store = make_store(max_bytes=1000, clock=clock)
    for name in "abc":
        await store.put("", {name: name.encode() * 300})
        clock.advance(1)
    store.touch("", ["a"])  # a is now the most recently used: b goes first
    clock.advance(1)
    await store.put("", {"d": b"d" * 300})  # 1200 bytes > 1000: evict down to 900
    assert await store.get("", "b") is None
    for name in "acd":
        assert await store.get("", name) == name.encode() * 300
    assert store.known("", "abcd") == {"a", "c", "d"}
    assert store.stats.evictions == 1


@pytest_twisted.ensureDeferred
async def test_a_read_counts_as_a_use(make_store):
    clock = FakeClock()
    store = make_store(max_bytes=1000, clock=clock)
    for name in "abc":
        await store.put("", {name: b"." * 300})
        clock.advance(1)
    assert await store.get("", "a") is not None
    clock.advance(1)
    await store.put("", {"d": b"." * 300})
    assert await store.get("", "b") is None
    assert await store.get("", "a") is not None


@pytest_twisted.ensureDeferred
async def test_a_put_never_evicts_its_own_originals(make_store):
    store = make_store(max_bytes=1000)
    await store.put("", {"old": b"o" * 100})
    assert await store.put("", {"huge": b"h" * 5000, "small": b"s"}) == {"huge", "small"}
    assert await store.get("", "huge") == b"h" * 5000
    assert await store.get("", "small") == b"s"
    assert await store.get("", "old") is None


@pytest_twisted.ensureDeferred
async def test_freeze_first_wins(make_store):
    store = make_store()
    assert await store.frozen("", "toolu_1") is None
    assert await store.freeze("", "toolu_1", b"the original") == b"the original"
    assert await store.freeze("", "toolu_1", b"not available") == b"the original"
    assert await store.frozen("", "toolu_1") == b"the original"
    assert await store.frozen("other", "toolu_1") is None
    assert await store.freeze("other", "toolu_1", b"other's") == b"other's"
    assert (await store.info()).frozen_entries == 2


@pytest_twisted.ensureDeferred
async def test_frozen_texts_are_evicted_after_every_original(make_store):
    clock = FakeClock()
    store = make_store(max_bytes=1000, clock=clock)
    await store.freeze("", "toolu_old", b"f" * 100)  # the least recently used entry
    clock.advance(1)
    for name in "abcd":
        await store.put("", {name: b"." * 300})
        clock.advance(1)
    assert await store.frozen("", "toolu_old") == b"f" * 100
    assert await store.get("", "a") is None
    # Only frozen texts left over budget: the least recently used of them goes.
    for key in ("toolu_1", "toolu_2", "toolu_3"):
        await store.freeze("", key, b"f" * 400)
        clock.advance(1)
    info = await store.info()
    assert info.entries == 0
    assert await store.frozen("", "toolu_old") is None
    assert await store.frozen("", "toolu_3") == b"f" * 400


@pytest_twisted.ensureDeferred
async def test_purge(make_store):
    clock = FakeClock()
    store = make_store(clock=clock)
    await store.put("", {"old": b"o"})
    await store.freeze("", "toolu_old", b"f")
    clock.advance(10 * DAY)
    await store.put("", {"new": b"n"})
    assert await store.purge(5) == 2
    assert await store.get("", "old") is None
    assert await store.frozen("", "toolu_old") is None
    assert await store.get("", "new") == b"n"
    assert "old" not in store.known("", ["old"])
    assert await store.put("", {"old": b"o"}) == {"old"}
    assert await store.purge(None) == 2
    assert (await store.info()).entries == 0


@pytest_twisted.ensureDeferred
async def test_a_frozen_text_touched_while_used_outlives_a_purge(make_store):
    """A text read from memory on every turn (--cache-ttl auto's choice) is touched instead of read:
    `cg-store purge --older-than` spares it while it is used, and takes it once it is not."""
    clock = FakeClock()
    store = make_store(clock=clock)
    await store.freeze("", "ttl:used", b"1h")
    await store.freeze("", "ttl:gone", b"1h")
    for _ in range(10):  # a conversation active for ten days
        clock.advance(DAY)
        store.touch("", [], frozen=["ttl:used"])
    assert await store.purge(5) == 1
    assert await store.frozen("", "ttl:used") == b"1h" and await store.frozen("", "ttl:gone") is None


@pytest_twisted.ensureDeferred
async def test_info(make_store):
    clock = FakeClock()
    store = make_store(clock=clock)
    empty = await store.info()
    assert (empty.entries, empty.bytes, empty.oldest_use, empty.frozen_entries) == (0, 0, None, 0)
    first_use = clock.now
    await store.put("", {"a": b"12345"})
    clock.advance(5)
    await store.put("t", {"b": b"123"})
    await store.freeze("", "toolu_1", b"xy")
    info = await store.info()
    assert (info.entries, info.bytes, info.oldest_use) == (2, 8, first_use)
    assert (info.frozen_entries, info.frozen_bytes) == (1, 2)


@pytest_twisted.ensureDeferred
async def test_cache_until_keeps_the_later_expiry_and_says_the_one_before(make_store):
    clock = FakeClock()
    store = make_store(clock=clock)
    now = clock.now
    assert await store.cache_until("t", "conv", now + 300) is None
    assert await store.cache_until("t", "conv", now + 400.25) == now + 300
    assert await store.cache_until("t", "conv", now + 100) == now + 400.25  # an earlier one: the later stays
    assert await store.cache_until("t", "conv", now + 500) == now + 400.25
    assert await store.cache_until("u", "conv", now) is None  # another tenant's
    assert await store.cache_until("t", "other", now) is None
    # Records hold no content: not counted, and purges leave them.
    await store.put("t", {"a": b"x"})
    assert await store.purge(None) == 1
    info = await store.info()
    assert (info.entries, info.bytes, info.frozen_entries, info.frozen_bytes) == (0, 0, 0, 0)
    assert await store.cache_until("t", "conv", now + 500) == now + 500


@pytest_twisted.ensureDeferred
async def test_a_cache_record_waits_for_another_processs_write_and_reads_what_it_wrote(sqlite_store, db_path):
    """cache_until reads before it writes. A transaction that read first could not take the write
    lock once another process committed (SQLite fails that at once, busy_timeout or not): the
    store takes the lock first, waits for the other writer, then reads what it committed."""
    store = sqlite_store()
    now = time.time()
    assert await store.cache_until("t", "conv", now + 100) is None
    other = sqlite3.connect(db_path, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")  # another process holds the store file's write lock
    other.execute("UPDATE caches SET until = ? WHERE tenant = 't' AND key = 'conv'", (now + 500,))
    committing = threading.Timer(0.3, other.execute, ("COMMIT",))
    committing.start()
    try:
        assert await store.cache_until("t", "conv", now + 200) == now + 500
    finally:
        committing.join()
        other.close()
    assert store.stats.write_errors == 0
    assert await store.cache_until("t", "conv", now + 300) == now + 500  # the later one kept, not ours


@pytest.mark.parametrize("backend", ["sqlite", "memory"])
@pytest_twisted.ensureDeferred
async def test_a_cache_record_goes_days_after_it_expired(sqlite_store, backend):
    clock = FakeClock()
    store = sqlite_store(clock=clock) if backend == "sqlite" else MemoryStore(clock=clock)
    await store.cache_until("t", "old", clock.now + 300)
    clock.advance(CACHE_RECORD_DAYS * DAY)
    await store.cache_until("t", "recent", clock.now)
    assert await store.cache_until("t", "old", 0.0) == clock.now - CACHE_RECORD_DAYS * DAY + 300  # a read
    clock.advance(3600)
    await store.cache_until("t", "recent", clock.now)  # records drop the stale ones (memory: once an hour)
    assert await store.cache_until("t", "old", clock.now) is None


@pytest_twisted.ensureDeferred
async def test_redis_lets_a_cache_record_expire_days_after_its_end(redis_server, closing):
    clock = FakeClock()
    store = RedisStore(redis_server.url, clock=clock)
    closing(store)
    await store.cache_until("t", "conv", clock.now + 300)
    ttl = redis_server.admin.pttl("cg:t:t:c:conv")
    assert (CACHE_RECORD_DAYS * DAY + 299) * 1000 < ttl <= (CACHE_RECORD_DAYS * DAY + 300) * 1000
    await store.cache_until("t", "conv", clock.now + 100)  # not later: the record and its life stay
    assert redis_server.admin.pttl("cg:t:t:c:conv") <= ttl


# SQLite only


@pytest_twisted.ensureDeferred
async def test_cache_records_survive_a_restart_and_are_shared_by_connections(db_path, sqlite_store):
    first, second = sqlite_store(), sqlite_store()
    now = time.time()
    assert await first.cache_until("t", "conv", now + 0.5) is None
    assert await second.cache_until("t", "conv", now + 300) == now + 0.5  # another cg on the same file
    await first.close()
    await second.close()
    assert await sqlite_store().cache_until("t", "conv", 0.0) == now + 300


@pytest_twisted.ensureDeferred
async def test_a_store_made_before_cache_records_gets_their_table(db_path, sqlite_store):
    os.makedirs(os.path.dirname(db_path))
    conn = sqlite3.connect(db_path)
    conn.executescript(
        """
        CREATE TABLE originals (tenant TEXT NOT NULL, id TEXT NOT NULL, size INTEGER NOT NULL,
            last_used REAL NOT NULL, body BLOB NOT NULL, PRIMARY KEY (tenant, id));
        CREATE TABLE frozen (tenant TEXT NOT NULL, key TEXT NOT NULL, size INTEGER NOT NULL,
            last_used REAL NOT NULL, body BLOB NOT NULL, PRIMARY KEY (tenant, key));
        INSERT INTO originals VALUES ('t', 'x', 1, 0, x'41');
        PRAGMA user_version = 1;
        """
    )
    conn.close()
    store = sqlite_store()
    now = time.time()
    assert await store.cache_until("t", "conv", now) is None
    assert await store.cache_until("t", "conv", now + 300) == now
    assert await store.get("t", "x") == b"A"
    # cg-store on a file it may only read still opens it (it does not need the table).
    await store.close()
    conn = sqlite3.connect(db_path)
    conn.execute("DROP TABLE caches")
    conn.commit()
    conn.close()
    read_only = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, isolation_level=None)
    try:
        cg.store.sqlite._migrate(read_only, db_path)
        assert read_only.execute("SELECT count(*) FROM originals").fetchone() == (1,)
        assert not read_only.in_transaction
    finally:
        read_only.close()


@pytest_twisted.ensureDeferred
async def test_originals_survive_a_restart(db_path, sqlite_store):
    first = sqlite_store()
    body = os.urandom(300_000)
    await first.put("t", {"x": body})
    await first.freeze("t", "toolu_1", b"repair")
    await first.close()

    second = sqlite_store()
    assert await second.get("t", "x") == body
    assert await second.frozen("t", "toolu_1") == b"repair"
    # What was stored before is known without a put, and a put rewrites nothing.
    assert second.known("t", ["x"]) == {"x"}
    assert await second.put("t", {"x": body}) == set()
    assert second.stats.writes == 0


@pytest_twisted.ensureDeferred
async def test_known_is_bounded(db_path, sqlite_store):
    clock = FakeClock()
    store = sqlite_store(known_max=3, clock=clock)
    for name in "abcde":
        await store.put("", {name: b"."})
        clock.advance(1)
    assert store.known("", "abcde") == {"c", "d", "e"}
    await store.close()
    # Rebuilt at open from the most recently used entries, within the bound.
    reopened = sqlite_store(known_max=2)
    await sync(reopened)
    assert reopened.known("", "abcde") == {"d", "e"}
    assert await reopened.put("", {"a": b"."}) == set()  # still stored: not rewritten


@pytest.mark.parametrize("backend", ["sqlite", "redis"])
@pytest_twisted.ensureDeferred
async def test_touch_is_batched_off_the_request_path(request, db_path, sqlite_store, closing, backend):
    clock = FakeClock()
    if backend == "sqlite":
        store = sqlite_store(clock=clock, flush_interval=3600)

        def last_use():
            return rows(db_path, "SELECT last_used FROM originals")[0][0]
    else:
        server = request.getfixturevalue("redis_server")
        store = RedisStore(server.url, clock=clock, flush_interval=3600)
        closing(store)

        def last_use():  # microseconds, in the sorted set of last uses
            return server.admin.zscore("cg:lru:o", "cg:t::o:a") / 1e6
    await store.put("", {"a": b"."})
    put_time = clock.now
    clock.advance(60)
    store.touch("", ["a"])
    await sync(store)
    assert last_use() == put_time
    await store.close()  # pending uses are flushed on close
    assert last_use() == put_time + 60


@pytest_twisted.ensureDeferred
async def test_touch_is_flushed_by_the_timer(db_path, sqlite_store):
    clock = FakeClock()
    store = sqlite_store(clock=clock, flush_interval=0.05)
    await store.put("", {"a": b"."})
    clock.advance(60)
    store.touch("", ["a"])
    await wait_for(lambda: rows(db_path, "SELECT last_used FROM originals") == [(clock.now,)])


@pytest_twisted.ensureDeferred
async def test_a_touch_that_fails_on_the_worker_does_not_stop_the_store(db_path, store_log):
    # not the closing fixture: a dead worker would hang its close
    store = SQLiteStore(db_path, flush_interval=0.05)
    await store.put("", {"a": b"."})
    store.touch("", [("not", "bindable")])  # its flush fails on the worker thread (SQLite binds no tuple)
    await wait_for(lambda: store.stats.write_errors == 1)
    assert await store.get("", "a").addTimeout(5, reactor) == b"."
    assert store_log.levels() == [LogLevel.error]
    await store.close()


@pytest_twisted.ensureDeferred
async def test_a_purge_from_elsewhere_is_noticed(db_path, sqlite_store):
    store = sqlite_store(flush_interval=0.05)
    await store.put("", {"a": b"."})
    assert store.known("", ["a"]) == {"a"}
    other = SQLiteDB.open(db_path, create=False)  # as cg-store purge does
    assert other.purge(None) == 1
    other.close()
    await wait_for(lambda: not store.known("", ["a"]))
    assert await store.put("", {"a": b"."}) == {"a"}
    assert await store.get("", "a") == b"."


@pytest_twisted.ensureDeferred
async def test_files_are_private(tmp_path, sqlite_store):
    path = tmp_path / "new" / "dir" / "store.sqlite3"
    old_umask = os.umask(0)  # without explicit modes everything would be world-readable
    try:
        store = sqlite_store(str(path))
        await store.put("", {"a": b"secret"})
        modes = {
            name: stat.S_IMODE(os.stat(path.parent / name).st_mode)
            for name in os.listdir(path.parent)
        }
    finally:
        os.umask(old_umask)
    assert modes == {
        "store.sqlite3": 0o600,
        "store.sqlite3-wal": 0o600,
        "store.sqlite3-shm": 0o600,
        "store.ledger.sqlite3": 0o600,  # the dashboard's history (cg.store.sqlite_ledger)
        "store.ledger.sqlite3-wal": 0o600,
        "store.ledger.sqlite3-shm": 0o600,
    }
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700


@pytest_twisted.ensureDeferred
async def test_all_sqlite_work_runs_on_one_worker_thread(db_path, monkeypatch, sqlite_store):
    threads = set()
    real_connect = sqlite3.connect

    def connect(*args, **kwargs):
        conn = real_connect(*args, **kwargs)
        conn.set_trace_callback(lambda sql: threads.add(threading.get_ident()))
        return conn

    monkeypatch.setattr(sqlite3, "connect", connect)
    await every_call(sqlite_store(flush_interval=0.01))
    assert len(threads) == 1
    assert threading.get_ident() not in threads


@pytest.mark.parametrize("broken", ["garbage", "under_a_file"])
@pytest_twisted.ensureDeferred
async def test_a_broken_store_fails_open(tmp_path, sqlite_store, store_log, broken):
    if broken == "garbage":
        path = tmp_path / "store.sqlite3"
        garbage = b"this is not a database\x00" * 1000
        path.write_bytes(garbage)
    else:  # root ignores permission bits: a regular file where a directory should be
        (tmp_path / "blocker").write_bytes(b"")
        path = tmp_path / "blocker" / "store.sqlite3"
    store = sqlite_store(str(path))  # does not raise

    for _ in range(2):
        with pytest.raises(StoreError):
            await store.put("", {"a": b"."})
        assert await store.get("", "a") is None
    assert store.known("", ["a"]) == set()
    assert not store.stats.healthy and "cannot open store" in store.stats.unhealthy_reason
    store.touch("", ["a"])
    for call in (store.freeze("", "k", b"."), store.frozen("", "k"), store.info(), store.purge(1)):
        with pytest.raises(StoreError):
            await call
    assert store.stats.write_errors == 4  # two puts, a freeze, a purge
    assert store.stats.read_errors == 3  # two gets, a frozen
    assert store.stats.writes == 0
    assert store_log.levels() == [LogLevel.error]  # logged once, not once per request
    await store.close()
    if broken == "garbage":
        assert path.read_bytes() == garbage  # failing open destroys nothing


@pytest_twisted.ensureDeferred
async def test_a_store_that_failed_to_open_recovers(tmp_path, monkeypatch, sqlite_store):
    monkeypatch.setattr(cg.store.sqlite, "REOPEN_AFTER", 0.0)
    blocker = tmp_path / "blocker"
    blocker.write_bytes(b"")
    store = sqlite_store(str(blocker / "store.sqlite3"))
    with pytest.raises(StoreError):
        await store.put("", {"a": b"."})
    blocker.unlink()
    assert await store.put("", {"a": b"."}) == {"a"}
    assert await store.get("", "a") == b"."


@pytest_twisted.ensureDeferred
async def test_a_locked_store_fails_the_put(db_path, monkeypatch, sqlite_store):
    monkeypatch.setattr(cg.store.sqlite, "BUSY_TIMEOUT", 0.1)
    store = sqlite_store()
    await store.put("", {"a": b"."})
    lock = sqlite3.connect(db_path, timeout=0)
    lock.execute("BEGIN EXCLUSIVE")  # another writer holds the lock past the busy timeout
    try:
        with pytest.raises(StoreError, match="locked"):
            await store.put("", {"b": b"."})
    finally:
        lock.rollback()
        lock.close()
    assert store.known("", ["a", "b"]) == {"a"}
    assert store.stats.write_errors == 1
    assert store.stats.healthy  # a locked store still reads: what it knew is still there
    assert await store.put("", {"b": b"."}) == {"b"}


@pytest_twisted.ensureDeferred
async def test_a_write_of_the_ledger_elsewhere_holds_up_no_store_write(db_path, monkeypatch, sqlite_store):
    """Another process's ledger transaction (a worker's dashboard rows, its trim) locks the ledger's
    file only: a request's put, a freeze and a cache record go on (they once took every attached
    file's lock, so a put waited for it and, past the busy timeout, sent its original whole)."""
    monkeypatch.setattr(cg.store.sqlite, "BUSY_TIMEOUT", 0.1)
    store = sqlite_store()
    await store.put("", {"a": b"."})
    lock = sqlite3.connect(ledger_path(db_path), timeout=0, isolation_level=None)
    lock.execute("BEGIN")
    lock.execute("DELETE FROM ledger_turns WHERE 0")  # holds the ledger's write lock, as a trim does
    try:
        assert await store.put("", {"b": b"."}) == {"b"}
        assert await store.freeze("", "k", b"text") == b"text"
        assert await store.cache_until("", "c", 10.0) is None
        store.touch("", ["a"])
        assert await store.purge(1.0) == 0
    finally:
        lock.execute("ROLLBACK")
        lock.close()
    assert store.stats.write_errors == 0 and await store.get("", "b") == b"."


@pytest.mark.parametrize("how", ["garbage", "drop", "removed"])
@pytest_twisted.ensureDeferred
async def test_a_failed_read_makes_the_store_forget_everything(db_path, sqlite_store, store_log, how):
    clock = FakeClock()
    store = sqlite_store(clock=clock)
    await store.put("", {"a": b"A"})
    await store.freeze("", "toolu_1", b"F")
    damage(db_path, how)
    clock.advance(60)
    # Read fails (or, the file removed, finds a new one): nothing it knew can be vouched for.
    assert await store.get("", "a") is None
    assert store.known("", ["a"]) == set()
    assert (store.stats.healthy, store.stats.unhealthy_since) == (False, clock.now)
    reason = store.stats.unhealthy_reason
    assert {"garbage": "not a database", "drop": "no such table", "removed": "removed or replaced"}[how] in reason
    for _ in range(3):
        assert await store.get("", "a") is None
        assert store.known("", ["a"]) == set()
    assert store.stats.unhealthy_since == clock.now  # since the first failure
    errors = store_log.texts(LogLevel.error)
    assert len(errors) == 1 and "is unhealthy" in errors[0] and reason in errors[0]
    assert store.stats.read_errors == (0 if how == "removed" else 4)


@pytest.mark.parametrize("how", ["drop", "removed"])
@pytest_twisted.ensureDeferred
async def test_a_broken_store_is_made_again_by_the_next_put(db_path, monkeypatch, sqlite_store, store_log, how):
    monkeypatch.setattr(cg.store.sqlite, "REOPEN_AFTER", 0.0)
    store = sqlite_store()
    await store.put("", {"a": b"A"})
    damage(db_path, how)
    assert await store.get("", "a") is None
    assert not store.stats.healthy
    # The next request holds its originals again: writing and reading them back heals the store.
    assert await store.put("", {"a": b"A", "b": b"B"}) == {"a", "b"}
    assert (store.stats.healthy, store.stats.unhealthy_reason, store.stats.unhealthy_since) == (True, None, None)
    assert store.known("", ["a", "b"]) == {"a", "b"}
    assert await store.get("", "a") == b"A"
    assert rows(db_path, "SELECT id FROM originals ORDER BY id") == [("a",), ("b",)]
    infos = store_log.texts(LogLevel.info)
    assert len(infos) == 1 and "healthy again" in infos[0]


@pytest_twisted.ensureDeferred
async def test_a_file_put_in_the_stores_place_is_vouched_for_only_after_a_put(db_path, tmp_path, sqlite_store):
    store = sqlite_store()
    await store.put("", {"a": b"A"})
    backup = SQLiteDB.open(str(tmp_path / "backup.sqlite3"))
    backup.put("", {"a": b"A", "b": b"B"})
    backup.close()
    damage(db_path, "removed")  # then a backup restored in its place, while cg runs
    os.replace(tmp_path / "backup.sqlite3", db_path)
    assert await store.get("", "b") == b"B"  # read from the file now in place
    assert not store.stats.healthy and "removed or replaced" in store.stats.unhealthy_reason
    assert store.known("", ["a", "b"]) == set()  # what a reopen finds is not vouched for yet
    assert await store.put("", {"a": b"A"}) == set()  # there already: written over, read back
    assert store.stats.healthy
    assert store.known("", ["a", "b"]) == {"a", "b"}


@pytest_twisted.ensureDeferred
async def test_a_store_that_cannot_be_read_stays_unhealthy_until_its_file_is_moved_aside(
    db_path, monkeypatch, sqlite_store, store_log
):
    monkeypatch.setattr(cg.store.sqlite, "REOPEN_AFTER", 0.0)
    store = sqlite_store()
    await store.put("", {"a": b"A"})
    damage(db_path, "garbage")
    # A failed write whose read fails too breaks it as well.
    with pytest.raises(StoreError):
        await store.put("", {"b": b"B"})
    assert not store.stats.healthy
    for _ in range(2):
        with pytest.raises(StoreError, match="not a database"):
            await store.put("", {"a": b"A", "b": b"B"})
        assert store.known("", ["a", "b"]) == set()
    assert open(db_path, "rb").read() == GARBAGE  # failing open destroys nothing
    os.replace(db_path, db_path + ".broken")  # SQLite removed the -wal and -shm it could not use
    assert await store.put("", {"a": b"A", "b": b"B"}) == {"a", "b"}
    assert store.stats.healthy
    assert await store.get("", "b") == b"B"
    assert store_log.levels().count(LogLevel.error) == 2  # unhealthy; cannot open
    assert store_log.texts(LogLevel.info) == [
        f"cg store {db_path} is healthy again"
    ]


@pytest_twisted.ensureDeferred
async def test_a_closed_store_refuses_work(sqlite_store):
    store = sqlite_store()
    await store.close()
    await store.close()  # twice is fine
    with pytest.raises(StoreError):
        await store.put("", {"a": b"."})
    store.touch("", ["a"])


# URLs


def test_store_from_url(tmp_path, closing):
    assert isinstance(store_from_url("memory:", reactor), MemoryStore)
    store = store_from_url(f"sqlite:{tmp_path}/s.sqlite3", reactor, max_bytes=5)
    closing(store)
    assert isinstance(store, SQLiteStore)
    assert (store.path, store.max_bytes) == (f"{tmp_path}/s.sqlite3", 5)
    for bad in ("", "sqlite:", "memory:x", "redis://", "redis://host/x", "postgres://db/cg", str(tmp_path)):
        with pytest.raises(ValueError):
            store_from_url(bad, reactor)


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"STATE_DIRECTORY": "/var/lib/cg", "XDG_STATE_HOME": "/x"}, "/var/lib/cg/store.sqlite3"),
        ({"STATE_DIRECTORY": "/var/lib/cg:/var/lib/other"}, "/var/lib/cg/store.sqlite3"),
        ({"XDG_STATE_HOME": "/home/u/.state"}, "/home/u/.state/cg/store.sqlite3"),
        ({"XDG_STATE_HOME": "relative"}, "~/.local/state/cg/store.sqlite3"),
        ({}, "~/.local/state/cg/store.sqlite3"),
    ],
)
def test_default_store_url(environ, expected):
    assert default_store_url(environ) == "sqlite:" + os.path.expanduser(expected)


def test_a_last_use_is_recorded_at_most_once_a_minute_per_original():
    now = [0.0]
    touched = RecentlyTouched(lambda: now[0])
    assert touched.fresh("", ["a", "b"]) == ("a", "b")
    assert touched.fresh("", ["a", "c"]) == ("c",)
    assert touched.fresh("other tenant", ["a"]) == ("a",)
    now[0] = TOUCH_EVERY - 1
    assert touched.fresh("", ["a"]) == ()
    now[0] = TOUCH_EVERY  # a new generation: the last one still counts
    assert touched.fresh("", ["a"]) == ()
    now[0] = 2 * TOUCH_EVERY
    assert touched.fresh("", ["a", "b"]) == ("a", "b")


def test_stores_opening_a_new_file_at_once_all_open(tmp_path):
    """Workers (or two cg) starting on one new SQLite file race to set it up; none may lose (a
    store that cannot open serves no offload until it retries)."""
    failures = []

    def open_it(path, barrier):
        barrier.wait()
        try:
            SQLiteDB.open(str(path)).close()
        except StoreError as e:
            failures.append(str(e))

    for n in range(200):
        barrier = threading.Barrier(4)
        threads = [threading.Thread(target=open_it, args=(tmp_path / f"{n}.sqlite3", barrier)) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert failures == []
