"""For the store tests: a wall clock a test moves, waits on a store's worker, a store file
damaged under a running store, and a real Redis kept busy."""

import os
import sqlite3
import time

from twisted.internet import reactor, threads
from twisted.internet.task import deferLater


class FakeClock:
    def __init__(self, now: float = 1_700_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


async def sync(store):
    """Wait until the worker has done everything submitted before."""
    await store.info()


async def wait_for(predicate, timeout=5.0):
    for _ in range(int(timeout / 0.02)):
        if predicate():
            return
        await deferLater(reactor, 0.02, lambda: None)
    raise AssertionError("condition not reached")


GARBAGE = b"this is not a database\x00" * 50_000  # 1.1 MB: more than SQLite maps of the -shm


def damage(path: str, how: str) -> None:
    """Break the store file under a running store, as another process might."""
    names = (path, path + "-wal", path + "-shm")
    if how == "garbage":
        for name in names:
            with open(name, "wb") as f:  # in place: the same files, every byte gone
                f.write(GARBAGE)
    elif how == "drop":
        conn = sqlite3.connect(path)
        conn.execute("DROP TABLE originals")
        conn.commit()
        conn.close()
    else:
        assert how == "removed"
        for name in names:
            os.unlink(name)


async def every_call(store):
    """Each of the store's methods once, a timer's flush, and close."""
    await store.put("", {"a": b"."})
    store.known("", ["a"])
    store.touch("", ["a"])
    await store.get("", "a")
    await store.freeze("", "k", b".")
    await store.frozen("", "k")
    await store.info()
    await store.purge(1)
    await deferLater(reactor, 0.05, lambda: None)  # a timer flush
    await store.close()


def debug_sleep(server, seconds: float):
    """Redis busy for ``seconds`` (``DEBUG SLEEP``): fires once it is, with [a Deferred that
    fires when it answers again]."""
    import redis

    client = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=seconds + 30)
    sleeping = threads.deferToThread(client.execute_command, "DEBUG", "SLEEP", str(seconds)).addBoth(
        lambda result: (client.close(), result)[1]
    )
    return threads.deferToThread(_wait_busy, server.port).addCallback(lambda _: [sleeping])


def _wait_busy(port: int) -> None:
    """Returns once Redis does not answer a PING at once (it is in the DEBUG SLEEP)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    for _ in range(500):
        probe = redis.Redis(host="127.0.0.1", port=port, socket_timeout=0.05, socket_connect_timeout=0.05,
                            retry=Retry(NoBackoff(), 0))  # the client's default retries until it wakes
        try:
            probe.ping()
        except redis.TimeoutError:
            return
        finally:
            probe.close()
        time.sleep(0.01)
    raise AssertionError("Redis never went to sleep")
