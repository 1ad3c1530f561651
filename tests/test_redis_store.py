"""The Redis store on a real redis-server: URLs and passwords, keys per tenant, two cg on one Redis,
and a Redis that is down, killed, slow or answering errors (the shared contract is in test_store.py)."""

import threading
import urllib.parse

import pytest
import pytest_twisted
from helpers.stores import FakeClock, debug_sleep, every_call, sync, wait_for
from redisserver import RedisServer
from twisted.internet import threads
from twisted.logger import LogLevel
from twisted.python import usage

import cg.store.redis
from cg.store import (
    RedisAddress,
    RedisDB,
    RedisStore,
    StoreError,
    parse_store_url,
    store_label,
    store_password,
)
from cg.web.tap import Options


@pytest.fixture
def redis_store(redis_server, closing):  # noqa: F811 -- the fixture imported above
    def make(url=None, **kwargs):
        store = RedisStore(url or redis_server.url, **kwargs)
        closing(store)
        return store

    return make


# --- URLs and passwords (no server) ----------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "expected", "label"),
    [
        ("redis://10.0.0.5", dict(host="10.0.0.5", port=6379, db=0), "redis://10.0.0.5:6379/0"),
        ("redis://cg:s%40cret@redis.internal:6380/2", dict(username="cg", password="s@cret", port=6380, db=2),
         "redis://cg@redis.internal:6380/2"),
        ("redis://:secret@[::1]:7000/1?timeout=0.5", dict(host="::1", password="secret", timeout=0.5),
         "redis://[::1]:7000/1?timeout=0.5"),
        ("rediss://redis.example:6390/0?ca=/etc/cg/ca.pem", dict(scheme="rediss", ca="/etc/cg/ca.pem"),
         "rediss://redis.example:6390/0?ca=/etc/cg/ca.pem"),
        ("unix:///run/redis/redis.sock?db=3", dict(socket="/run/redis/redis.sock", db=3),
         "unix:///run/redis/redis.sock?db=3"),
        ("unix://:pw@/run/redis.sock", dict(socket="/run/redis.sock", password="pw"), "unix:///run/redis.sock"),
    ],
)
def test_redis_urls(url, expected, label):
    address = RedisAddress.parse(url)
    for name, value in expected.items():
        assert getattr(address, name) == value
    assert address.label == label == store_label(url)
    assert "secret" not in repr(address) and "s@cret" not in repr(address)
    assert parse_store_url(url) == ("redis", url)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis://", "no host"),
        ("redis://:hunter2@", "no host"),
        ("redis://h/x", "database number is not a number"),
        ("redis://h/-1", "must not be negative"),
        ("redis://h:99999", "Port out of range"),
        ("redis://h?db=1", "unknown parameter 'db'"),
        ("redis://h?ca=/x", "unknown parameter 'ca'"),
        ("redis://h?timeout=0", "timeout must be more than 0"),
        ("unix://host/socket", "write unix:///path/to/socket"),
        ("unix:///", "write unix:///path/to/socket"),
        ("unix:///s?db=x", "db is not a number"),
        ("redis://u:hunter2@h/x#frag", "no #fragment"),
    ],
)
def test_bad_redis_urls_are_refused_in_one_line_without_the_password(url, message):
    with pytest.raises(ValueError, match=message) as refused:
        parse_store_url(url)
    assert "hunter2" not in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(usage.UsageError) as refused:
        Options().parseOptions(["--store", url])
    assert str(refused.value).startswith("--store: ") and "hunter2" not in str(refused.value)


def test_password_sources(tmp_path):
    url = "redis://cg@127.0.0.1:6379/0"
    assert store_password(url, None, {}) is None
    assert store_password(url, None, {"CG_STORE_PASSWORD": "from-env"}) == "from-env"
    # The URL's own password wins over the environment's (it is the more explicit).
    assert store_password("redis://:in-url@h/0", None, {"CG_STORE_PASSWORD": "from-env"}) is None
    assert store_password("sqlite:/x", None, {"CG_STORE_PASSWORD": "from-env"}) is None
    secret = tmp_path / "password"
    secret.write_text("from-file\n")
    assert store_password(url, str(secret), {"CG_STORE_PASSWORD": "from-env"}) == "from-file"

    options = Options()
    options.parseOptions(["--store", url, "--store-password-file", str(secret)])
    assert options.config().store_password == "from-file"
    assert "from-file" not in repr(options.config())


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--store", "redis://h/0", "--store-password-file", "/nonexistent/pw"],
         "--store-password-file: cannot read /nonexistent/pw: No such file or directory"),
        (["--store", "redis://:pw@h/0", "--store-password-file", "{file}"],
         "--store-password-file: the --store URL has a password already: give it in one place"),
        (["--store", "sqlite:/tmp/s", "--store-password-file", "{file}"],
         "--store-password-file: a password file is for a Redis store (redis://, rediss:// or unix://)"),
        (["--store", "redis://h/0", "--store-password-file", "{empty}"], "--store-password-file: {empty} is empty"),
    ],
)
def test_bad_password_files_are_refused_at_start(tmp_path, argv, message):
    (tmp_path / "pw").write_text("secret\n")
    (tmp_path / "empty").write_text("\n")
    names = {"file": str(tmp_path / "pw"), "empty": str(tmp_path / "empty")}
    with pytest.raises(usage.UsageError) as refused:
        Options().parseOptions([a.format(**names) for a in argv])
    assert str(refused.value) == message.format(**names)


# --- on a real redis-server ------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_each_tenant_has_its_own_key_prefix(redis_server, redis_store):
    store = redis_store()
    tenants = ["", "tenant-a", "a:o:b", "a", "h/é"]  # "a:o:b" must not reach into a's keys
    for tenant in tenants:
        await store.put(tenant, {"0123456789abcdef": f"secret of {tenant}".encode()})
        await store.freeze(tenant, "toolu_1", f"repair of {tenant}".encode())
    for tenant in tenants:
        assert await store.get(tenant, "0123456789abcdef") == f"secret of {tenant}".encode()
        assert await store.frozen(tenant, "toolu_1") == f"repair of {tenant}".encode()
    keys = {key.decode() for key in redis_server.admin.keys("cg:t:*")}
    for tenant in tenants:
        prefix = f"cg:t:{urllib.parse.quote(tenant, safe='')}:"
        assert {prefix + "o:0123456789abcdef", prefix + "f:toolu_1"} <= keys
    assert len(keys) == 2 * len(tenants)
    assert redis_server.admin.get("cg:t:a:o:0123456789abcdef") == b"secret of a"


@pytest.mark.parametrize("where", ["url", "password", "unix"])
@pytest_twisted.ensureDeferred
async def test_a_password_protected_redis(redis_server, redis_store, store_log, where):
    redis_server.admin.execute_command("ACL", "SETUSER", "cg", "on", ">s3cret", "~*", "&*", "+@all")
    if where == "url":
        url = f"redis://cg:s3cret@127.0.0.1:{redis_server.port}/0"
        store, password = redis_store(url), None
    elif where == "password":
        url = f"redis://cg@127.0.0.1:{redis_server.port}/0"
        store, password = redis_store(url, password="s3cret"), "s3cret"
    else:
        url = f"unix://cg@{redis_server.socket_path}?db=3"
        store, password = redis_store(url, password="s3cret"), "s3cret"
    assert await store.put("", {"a": b"A"}) == {"a"}
    assert store.stats.healthy
    db = 3 if where == "unix" else 0
    import redis

    admin = redis.Redis(unix_socket_path=redis_server.socket_path, db=db)
    assert admin.get("cg:t::o:a") == b"A"
    admin.close()

    wrong = redis_store(url.replace("s3cret", "wrong"), password=password and "wrong")
    with pytest.raises(StoreError, match="WRONGPASS|invalid username-password"):
        await wrong.put("", {"b": b"B"})
    assert not wrong.stats.healthy
    assert "s3cret" not in " ".join(store_log.texts()) and "wrong" not in " ".join(store_log.texts())


@pytest_twisted.ensureDeferred
async def test_originals_survive_a_restart_of_cg(redis_store):
    first = redis_store()
    await first.put("t", {"x": b"X" * 100_000})
    await first.freeze("t", "toolu_1", b"repair")
    await first.close()
    second = redis_store()
    await sync(second)
    assert second.known("t", ["x"]) == {"x"}  # the most recently used are known at start
    assert await second.put("t", {"x": b"X" * 100_000}) == set()
    assert await second.get("t", "x") == b"X" * 100_000
    assert await second.frozen("t", "toolu_1") == b"repair"


@pytest_twisted.ensureDeferred
async def test_two_stores_on_one_redis_share_everything(redis_store):
    one, two = redis_store(), redis_store()
    assert await one.put("", {"a": b"A"}) == {"a"}
    assert await two.get("", "a") == b"A"
    assert await two.put("", {"a": b"A", "b": b"B"}) == {"b"}  # a is not written again
    assert await one.get("", "b") == b"B"
    assert await one.freeze("", "toolu_1", b"first") == b"first"
    assert await two.freeze("", "toolu_1", b"second") == b"first"  # first wins, everywhere
    assert (await two.info()).entries == 2


@pytest_twisted.ensureDeferred
async def test_an_eviction_by_another_cg_is_noticed(redis_store):
    clock = FakeClock()
    one = redis_store(max_bytes=1000, clock=clock, flush_interval=0.05)
    two = redis_store(max_bytes=1000, clock=clock)
    for name in "abc":
        await one.put("", {name: b"." * 300})
        clock.advance(1)
    assert one.known("", "abc") == set("abc")
    assert await two.put("", {"d": b"." * 300}) == {"d"}  # over the cap: a, the least recently used, goes
    assert two.stats.evictions == 1
    await wait_for(lambda: not one.known("", "abc"))  # one saw gen move: it forgets what it knew
    assert await one.get("", "a") is None
    assert await one.put("", {"b": b"." * 300, "c": b"." * 300}) == set()  # still there: not rewritten
    assert one.known("", "bc") == {"b", "c"}


@pytest_twisted.ensureDeferred
async def test_a_purge_from_elsewhere_is_noticed(redis_server, redis_store):
    store = redis_store(flush_interval=0.05)
    await store.put("", {"a": b"."})
    other = RedisDB(RedisAddress.parse(redis_server.url))  # as cg-store purge does
    assert other.purge(None) == 1
    other.close()
    await wait_for(lambda: not store.known("", ["a"]))
    assert await store.put("", {"a": b"."}) == {"a"}


@pytest_twisted.ensureDeferred
async def test_data_lost_under_cg_is_noticed_and_stored_again(redis_server, redis_store, store_log):
    """A Redis restarted without persistence (or flushed) has lost what cg knew it held."""
    store = redis_store(flush_interval=0.05)
    await store.put("", {"a": b"A"})
    redis_server.admin.flushdb()
    await wait_for(lambda: not store.known("", ["a"]))
    assert await store.get("", "a") is None
    assert await store.put("", {"a": b"A"}) == {"a"}
    assert await store.get("", "a") == b"A"
    assert store.stats.healthy and store_log.levels() == []


@pytest_twisted.ensureDeferred
async def test_an_original_the_server_dropped_answers_as_evicted(redis_server, redis_store):
    """Under maxmemory-policy allkeys-lru Redis may drop any key: a miss, never a crash."""
    clock = FakeClock()
    store = redis_store(max_bytes=1000, clock=clock)
    for name in "abc":
        await store.put("", {name: b"." * 300})
        clock.advance(1)
    redis_server.admin.delete("cg:t::o:a", "cg:lru:f")
    assert await store.get("", "a") is None
    assert (store.stats.misses, store.stats.healthy) == (1, True)
    assert await store.put("", {"d": b"." * 300}) == {"d"}  # evicting a key already gone is fine
    info = await store.info()  # a's 300 bytes left the count: b, c and d fit under the cap
    assert (info.entries, info.bytes) == (3, 900)
    assert await store.get("", "d") == b"." * 300


@pytest_twisted.ensureDeferred
async def test_entries_the_server_dropped_do_not_shrink_the_store(redis_server, redis_store):
    """Their sizes leave the count as they were counted (not as STRLEN of nothing): the store
    keeps filling to its cap instead of evicting everything on every put."""
    clock = FakeClock()
    store = redis_store(max_bytes=10_000, clock=clock)
    names = [f"k{n}" for n in range(10)]
    for name in names:
        await store.put("", {name: b"." * 900})
        clock.advance(1)
    redis_server.admin.delete(*(f"cg:t::o:{name}" for name in names[:9]))
    for name in ("x1", "x2", "x3", "x4", "x5"):
        await store.put("", {name: b"." * 900})
        clock.advance(1)
    kept = [name for name in (names[9], "x1", "x2", "x3", "x4", "x5") if await store.get("", name) is not None]
    assert kept == [names[9], "x1", "x2", "x3", "x4", "x5"]


@pytest_twisted.ensureDeferred
async def test_all_redis_io_runs_on_one_worker_thread(redis_store, monkeypatch):
    import redis.connection

    threads_seen = set()
    real_send = redis.connection.AbstractConnection.send_packed_command

    def send(self, *args, **kwargs):
        threads_seen.add(threading.get_ident())
        return real_send(self, *args, **kwargs)

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", send)
    await every_call(redis_store(flush_interval=0.01))
    assert len(threads_seen) == 1
    assert threading.get_ident() not in threads_seen


# --- faults ----------------------------------------------------------------------------------

B = b"B" * 1000


@pytest_twisted.ensureDeferred
async def test_redis_down_at_start_fails_open_and_recovers(tmp_path, redis_store, store_log):
    server = RedisServer(tmp_path)  # not started
    store = redis_store(f"redis://127.0.0.1:{server.port}/0")
    for _ in range(2):
        with pytest.raises(StoreError, match="Connection refused|Error 111"):
            await store.put("", {"a": b"A"})
        assert await store.get("", "a") is None
    assert store.known("", ["a"]) == set()
    assert not store.stats.healthy and "Connection refused" in store.stats.unhealthy_reason
    [unhealthy] = [text for text in store_log.texts(LogLevel.error) if "unhealthy" in text]
    assert f"unhealthy: cannot reach redis://127.0.0.1:{server.port}/0" in unhealthy
    await threads.deferToThread(server.start)
    try:
        assert await store.put("", {"a": b"A"}) == {"a"}  # no restart of cg
        assert store.stats.healthy and store.known("", ["a"]) == {"a"}
        assert store_log.texts(LogLevel.info) == [f"cg store {store.label} is healthy again"]
    finally:
        server.kill()


@pytest_twisted.ensureDeferred
async def test_redis_killed_mid_run_fails_open_and_recovers(redis_server, redis_store):
    store = redis_store()
    await store.put("", {"a": b"A"})
    redis_server.kill()
    assert await store.get("", "a") is None
    assert not store.stats.healthy and store.known("", ["a"]) == set()
    with pytest.raises(StoreError):
        await store.put("", {"a": b"A"})
    await threads.deferToThread(redis_server.start)  # back, empty (no persistence)
    assert await store.put("", {"a": b"A"}) == {"a"}  # written again: the old one is gone
    assert store.stats.healthy
    assert await store.get("", "a") == b"A"


@pytest_twisted.ensureDeferred
async def test_a_slow_redis_costs_one_timeout_then_fails_at_once(redis_server, redis_store, monkeypatch):
    store = redis_store(redis_server.url + "?timeout=0.2")
    await store.put("", {"a": b"A"})
    [sleeping] = await debug_sleep(redis_server, 3)
    try:
        with pytest.raises(StoreError, match="too slow"):
            await store.put("", {"b": B})
        assert not store.stats.healthy  # a timeout: nothing it holds can be vouched for now
        # Within RETRY_AFTER every call fails at once, without waiting for Redis again.
        for _ in range(5):
            with pytest.raises(StoreError, match="too slow"):
                await store.put("", {"b": B})
            assert await store.get("", "a") is None
        assert not sleeping.called  # all that while, Redis was still asleep
    finally:
        await sleeping
    monkeypatch.setattr(cg.store.redis, "RETRY_AFTER", 0.0)
    await store.put("", {"a": b"A", "b": B})  # b may be there already: Redis ran the timed-out put on waking
    assert store.stats.healthy and store.known("", ["a", "b"]) == {"a", "b"}
    assert await store.get("", "b") == B


@pytest_twisted.ensureDeferred
async def test_a_full_redis_fails_writes_but_stays_healthy(redis_server, redis_store):
    store = redis_store()
    await store.put("", {"a": b"A"})
    redis_server.admin.config_set("maxmemory", "1")  # noeviction (the default): writes answer OOM
    try:
        with pytest.raises(StoreError, match="OutOfMemoryError"):
            await store.put("", {"b": B})
        assert store.stats.write_errors == 1
        assert store.stats.healthy  # it still reads: what it knew is still there
        assert store.known("", ["a", "b"]) == {"a"}
        assert await store.get("", "a") == b"A"
    finally:
        redis_server.admin.config_set("maxmemory", "0")
    assert await store.put("", {"b": B}) == {"b"}


@pytest_twisted.ensureDeferred
async def test_reads_answering_errors_make_the_store_unhealthy_until_a_put(redis_server, redis_store, store_log):
    admin = redis_server.admin
    admin.execute_command("ACL", "SETUSER", "cg", "on", ">pw", "~*", "&*", "+@all")
    store = redis_store(f"redis://cg:pw@127.0.0.1:{redis_server.port}/0")
    await store.put("", {"a": b"A"})
    admin.execute_command("ACL", "SETUSER", "cg", "-get")
    assert await store.get("", "a") is None
    assert not store.stats.healthy and "NOPERM" in store.stats.unhealthy_reason.upper()
    assert store.known("", ["a"]) == set()
    with pytest.raises(StoreError):
        await store.put("", {"a": b"A"})  # written, but it does not read back
    admin.execute_command("ACL", "SETUSER", "cg", "+get")
    assert await store.put("", {"a": b"A"}) == set()
    assert store.stats.healthy and store.known("", ["a"]) == {"a"}


    assert len([text for text in store_log.texts(LogLevel.error) if "is unhealthy" in text]) == 1
