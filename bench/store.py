"""The store's own cost, SQLite against Redis in the same run: is one worker thread enough?

Through the IStore API on the reactor, as the proxy calls it: a put of new originals (what a
request with new tool output waits for), a get (an expand the request cannot answer itself), and
``known`` + ``touch`` (what every other request does: no I/O on its path), and the cache-aware
policy's work on every request of a conversation (``cache_until`` and the read of its next epoch,
``frozen``, at once; 100 conversations). Each is measured alone
(latency, p50/p99, from the call on the reactor to its callback) and with 32 in flight (the
throughput of the one worker thread). Starts its own redis-server on 127.0.0.1 (as Debian ships
it: persistence off here) in a temporary directory, and kills it on exit.

    python bench/store.py            # ~20 s
    python bench/store.py --quick    # < 5 s
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from twisted.internet import defer, task  # noqa: E402

from cg.store import RedisStore, SQLiteStore  # noqa: E402

SIZE = 12_000  # bytes of an offloaded tool result: ~3000 tokens, just over --offload-min-tokens


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(directory: str) -> tuple[subprocess.Popen, int]:
    port = _free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", directory], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    for _ in range(500):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.1) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return proc, port
        except OSError:
            time.sleep(0.01)
    proc.kill()
    raise SystemExit("redis-server did not start")


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def timed(make_call, n: int, in_flight: int) -> tuple[list[float], float]:
    """Latencies (ms) of ``n`` calls with ``in_flight`` at once, and calls per second."""
    latencies: list[float] = []
    counter = iter(range(n))

    async def lane():
        for i in counter:
            start = time.perf_counter()
            await make_call(i)
            latencies.append((time.perf_counter() - start) * 1000)

    start = time.perf_counter()
    await defer.gatherResults([defer.ensureDeferred(lane()) for _ in range(in_flight)])
    return latencies, n / (time.perf_counter() - start)


async def measure(name: str, store, n: int) -> list[str]:
    body = os.urandom(SIZE // 2).hex().encode()
    await store.info()  # opened
    lines = []
    run = f"{time.time_ns()}"

    def put(prefix):
        return lambda i: store.put("", {f"{run}{prefix}{i:08d}": body[:-12] + b"%012d" % i})

    def get(i):
        return store.get("", f"{run}a{i % n:08d}")

    def known(i):
        ids = [f"{run}a{j:08d}" for j in range(i % n, i % n + 20)]
        store.touch("", store.known("", ids))
        return defer.succeed(None)

    def cold(i):
        key = f"{run}c{i % 100:04d}"
        return defer.gatherResults([store.cache_until("", key, time.time() + 300),
                                    store.frozen("", f"cold:{key}:0")])

    for label, call, in_flight in (
        ("put 1 new original", put("a"), 1),
        ("put, 32 in flight", put("b"), 32),
        ("get", get, 1),
        ("get, 32 in flight", get, 32),
        ("known+touch of 20 ids", known, 1),
        ("cache_until+frozen", cold, 1),
        ("cache_until+frozen, 32", cold, 32),
    ):
        latencies, rate = await timed(call, n, in_flight)
        lines.append(
            f"{name:7} {label:24} p50 {statistics.median(latencies):7.3f} ms  p99 {pct(latencies, 0.99):7.3f} ms"
            f"  {rate:9.0f} /s"
        )
    await store.close()
    return lines


async def main(reactor, quick: bool) -> None:
    if shutil.which("redis-server") is None:
        raise SystemExit("needs redis-server (Debian: apt-get install redis-server)")
    n = 300 if quick else 3000
    with tempfile.TemporaryDirectory() as tmp:
        proc, port = start_redis(tmp)
        try:
            lines = await measure("sqlite", SQLiteStore(os.path.join(tmp, "store.sqlite3"), reactor=reactor), n)
            lines += await measure("redis", RedisStore(f"redis://127.0.0.1:{port}/0", reactor=reactor), n)
        finally:
            proc.kill()
            proc.wait()
    print(f"{n} calls each, originals of {SIZE} bytes, one worker thread per store")
    print("\n".join(lines))
    load = os.getloadavg()[0]
    print(f"load average (1 min) at the end: {load:.2f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    task.react(lambda reactor: defer.ensureDeferred(main(reactor, args.quick)))
