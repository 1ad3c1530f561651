"""The ledger at scale: how big it gets and how fast it answers with 1 M requests in it, SQLite
against Redis in the same run, and what `record()` costs the reactor thread.

Fills each store's ledger with `--turns` requests (default 1 M) spread over 30 days up to now: 3,000
conversations (30 at a time, ~333 turns each, one of them given 500 turns among the newest), 4
tenants, 3 clients, 4 models, 0-5 changes a turn (2.5 on average). The fill goes straight to the
store's ledger backend in batches of 2,000 (what the worker thread does with the batches
`record()` makes, faster). Then times every query the dashboard's API makes, as the worker thread
runs it (median of `--runs`): `totals` for 1 h, 24 h, 7 d and all (every tenant, and one), `buckets`
for 6 h of minutes and 7 d of hours, `conversations` page 0 and the last page (50 rows) for every
order, and `conversation` of the one with 500 turns. Reports the size of SQLite's ledger file and Redis'
`used_memory` (less what it used before the fill).

Then, on the reactor thread of this process, `record()` on a SQLite store's ledger against a no-op
call of the same arguments, in CPU time of that thread (`time.thread_time`) per call; and the
reactor's side of sending one batch (`flush()`).

Starts its own redis-server on 127.0.0.1 (persistence off) in a temporary directory.

    python bench/ledger_scale.py              # 1 M turns: ~10 min on a shared 2-core machine
    python bench/ledger_scale.py --quick      # 50,000 turns, < 1 min
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from twisted.internet import defer, task  # noqa: E402

from bench.store import start_redis  # noqa: E402
from cg.exchange.ledger import DEFAULT_MAX_TURNS, HOUR, MINUTE, ORDERS, Change, Turn  # noqa: E402
from cg.store import RedisDB, SQLiteDB, SQLiteStore  # noqa: E402
from cg.store.redis import RedisAddress  # noqa: E402
from cg.store.sqlite_ledger import ledger_path  # noqa: E402
from cg.stream.usage import Usage  # noqa: E402

DAYS = 30
CONVERSATIONS = 3000
AT_ONCE = 30
TENANTS = ("", "team-a", "team-b", "team-c")
CLIENTS = ("claude-code", "codex", "sdk")
MODELS = ("claude-sonnet-4-5", "claude-opus-4-1", "gpt-5.5", None)
BIG = "big-conversation"
BIG_TURNS = 500
BATCH = 2000
PAGE = 50


def turns(count: int, now: float):
    """(Turn, changes) in the order they arrive: `count` of them over DAYS days up to `now`."""
    rng = random.Random(23)
    step = DAYS * 86400.0 / count
    per = max(1, count // CONVERSATIONS)
    big_every = max(1, min(count, DEFAULT_MAX_TURNS) // BIG_TURNS)
    big_from = count - big_every * BIG_TURNS
    for k in range(count):
        at = now - DAYS * 86400.0 + k * step
        if k >= big_from and (k - big_from) % big_every == 0:
            conversation = BIG
        else:
            conversation = f"conv-{(k // (per * AT_ONCE)) * AT_ONCE + k % AT_ONCE:05d}"
        n = zlib.crc32(conversation.encode())  # the same tenant, client and model in every run
        tenant, client, model = TENANTS[n % 4], CLIENTS[n % 3], MODELS[(n // 7) % 4]
        before = rng.randrange(20_000, 200_000)
        after = before - rng.randrange(0, before // 2)
        changes = [Change(k, m, 0, "Bash", "offload", True, f"{k:08x}{m:08x}", 4000, 600)
                   for m in range(rng.randrange(0, 6))]
        billed = Usage(rng.randrange(0, 50), rng.randrange(0, after), rng.randrange(0, 5000), rng.randrange(50, 2000))
        yield Turn(time=at, seq=k, tenant=tenant, conversation=conversation, client=client, model=model,
                   dialect="anthropic", path="/v1/messages", status=200, outcome="ok", tokens_before=before,
                   tokens_after=after, results_before=before // 2, results_after=after // 3, billed=billed,
                   cost_via_cg=after * 3e-7, cost_direct=before * 3e-7, expand_rounds=k % 50 == 0,
                   verdict="expected" if k % 9 == 0 else None, cache_until=at + 300), tuple(changes)


def fill(ledger, count: int, now: float) -> float:
    """Seconds to write `count` turns through the backend's batch write."""
    start = time.perf_counter()
    batch = []
    for pair in turns(count, now):
        batch.append(pair)
        if len(batch) == BATCH:
            ledger.write(batch, DEFAULT_MAX_TURNS)
            batch = []
    if batch:
        ledger.write(batch, DEFAULT_MAX_TURNS)
    return time.perf_counter() - start


def median_ms(runs: int, call: Callable[..., Any], *args: object) -> tuple[float, Any]:
    times, result = [], None
    for _ in range(runs):
        start = time.perf_counter()
        result = call(*args)
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times), result


def queries(ledger, now: float, runs: int) -> list[tuple[str, float, str]]:
    """(what, median ms, what it answered) for every query the dashboard's API makes."""
    rows = []
    for window, since in (("1h", now - HOUR), ("24h", now - 86400), ("7d", now - 7 * 86400), ("all", None)):
        for tenant in (None, "team-a"):
            ms, totals = median_ms(runs, ledger.totals, tenant, since)
            rows.append((f"totals {window} {'every tenant' if tenant is None else 'one tenant'}", ms,
                         f"{totals.requests} requests"))
    for label, since, width in (("6 h of minutes", now - 6 * HOUR, MINUTE), ("7 d of hours", now - 7 * 86400, HOUR)):
        ms, buckets = median_ms(runs, ledger.buckets, None, since, width)
        rows.append((f"buckets {label}", ms, f"{len(buckets)} buckets"))
    total = ledger.conversations(None, 0, 1, "last")[1]
    theirs = ledger.conversations("team-a", 0, 1, "last")[1]
    for order in ORDERS:
        for label, tenant, offset in (("page 0", None, 0), ("last page", None, max(0, total - PAGE)),
                                      ("one tenant's last page", "team-a", max(0, theirs - PAGE))):
            ms, (page, count) = median_ms(runs, ledger.conversations, tenant, offset, PAGE, order)
            rows.append((f"conversations by {order}, {label}", ms, f"{len(page)} of {count}"))
    ms, found = median_ms(runs, ledger.conversation, None, BIG)
    rows.append(("conversation with 500 turns", ms, f"{len(found[1])} turns, {len(found[2])} changes"))
    return rows


async def reactor_cost(reactor, directory: str, calls: int) -> list[str]:
    """CPU of the reactor thread per record() and per flush(), against a no-op call."""
    store = SQLiteStore(os.path.join(directory, "cost.sqlite3"), reactor=reactor)
    await store.info()
    sample = list(turns(calls, time.time()))

    def nothing(turn, changes):
        pass

    def per_call(call) -> float:
        start = time.thread_time()
        for turn, changes in sample:
            call(turn, changes)
        return (time.thread_time() - start) / calls * 1e6

    lines = []
    baselines, records, flushes = [], [], []
    for _ in range(5):
        baselines.append(per_call(nothing))
        records.append(per_call(store.ledger.record))
        start = time.thread_time()
        store.ledger.flush()
        flushes.append((time.thread_time() - start) * 1e6)
        await store.ledger.totals(None, None)  # the worker wrote that batch
    base, record = statistics.median(baselines), statistics.median(records)
    lines.append(f"reactor thread CPU per call, median of 5 x {calls}: record() {record:.2f} us, "
                 f"a no-op call {base:.2f} us: record() adds {record - base:.2f} us")
    lines.append(f"reactor thread CPU to send one batch of {calls} rows (flush()): {statistics.median(flushes):.0f} us")
    await store.close()
    return lines


async def main(reactor, count: int, runs: int) -> None:
    if shutil.which("redis-server") is None:
        raise SystemExit("needs redis-server (Debian: apt-get install redis-server)")
    now = time.time()
    out = [f"{count} turns over {DAYS} days, {CONVERSATIONS} conversations, newest {DEFAULT_MAX_TURNS} kept whole;"
           f" queries: median of {runs}"]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "store.sqlite3")
        sqlite = SQLiteDB.open(path)
        seconds = fill(sqlite.ledger, count, now)
        sqlite.conn.execute("PRAGMA ledger.wal_checkpoint(TRUNCATE)")
        ledger = ledger_path(path)
        size = sum(os.path.getsize(ledger + s) for s in ("", "-wal") if os.path.exists(ledger + s))
        out.append(f"sqlite: filled in {seconds:.0f} s; the ledger's file {size / 1e6:.1f} MB")
        results = {"sqlite": queries(sqlite.ledger, now, runs)}
        sqlite.close()
        proc, port = start_redis(tmp)
        try:
            redis = RedisDB(RedisAddress.parse(f"redis://127.0.0.1:{port}/0?timeout=60"))
            before = int(redis.client.info("memory")["used_memory"])
            seconds = fill(redis.ledger, count, now)
            used = int(redis.client.info("memory")["used_memory"]) - before
            keys = redis.client.dbsize()
            out.append(f"redis: filled in {seconds:.0f} s; used_memory +{used / 1e6:.1f} MB, {keys} keys")
            results["redis"] = queries(redis.ledger, now, runs)
            redis.close()
        finally:
            proc.kill()
            proc.wait()
        out.append(f"{'query':52} {'sqlite ms':>10} {'redis ms':>10}  answer")
        for (what, sqlite_ms, answer), (_, redis_ms, _) in zip(results["sqlite"], results["redis"]):
            out.append(f"{what:52} {sqlite_ms:10.1f} {redis_ms:10.1f}  {answer}")
        out += await reactor_cost(reactor, tmp, 10_000)
    print("\n".join(out))
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="50,000 turns")
    parser.add_argument("--turns", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    count = 50_000 if args.quick else args.turns
    task.react(lambda reactor: defer.ensureDeferred(main(reactor, count, args.runs)))
