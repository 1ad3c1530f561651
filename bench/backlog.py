"""Listen backlog: a burst of new connections to a --listen without backlog=, against Twisted's 50.

    python bench/backlog.py [--quick] [--json PATH] [--keep-logs] [--rounds N]

A user's ``--listen tcp:9000`` used to get Twisted's default backlog, 50; cg now fills in its own,
1024 (cg.web.config.with_backlog). One cg process listens on two ports: the one overhead.py's
``start_cg`` gives it (``tcp:PORT:interface=127.0.0.1``, no backlog named: cg's 1024 now) and a
second with ``backlog=50`` (what that listen had before); a second cg does the same with
``--workers 2``. Each round sends a burst of concurrent new connections (400 to the one process,
200 to the workers, as in issue 24) to each port of the same process, in alternating order, each
connection a ``GET /healthz`` with ``Connection: close``, and counts what became of them: answered,
reset, refused, timed out (10 s), and answered only after a second or more (a SYN or handshake
retransmitted: the kernel dropped it while the queue was full). The fake provider is there only as
cg's upstream; nothing reaches it. All on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead  # noqa: E402  # bench/'s process helpers

OLD_BACKLOG = 50  # Twisted's default: what a --listen without backlog= had before
TIMEOUT = 10.0
SLOW = 1.0  # the first SYN retransmit comes after 1 s


async def _one(port: int) -> tuple[str, float]:
    start = time.monotonic()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(overhead.HOST, port), TIMEOUT)
        writer.write(f"GET /healthz HTTP/1.1\r\nHost: {overhead.HOST}\r\nConnection: close\r\n\r\n".encode())
        response = await asyncio.wait_for(reader.read(), TIMEOUT)
        writer.close()
    except ConnectionResetError:
        return "reset", time.monotonic() - start
    except ConnectionRefusedError:
        return "refused", time.monotonic() - start
    except (asyncio.TimeoutError, TimeoutError):
        return "timeout", time.monotonic() - start
    except OSError as error:
        return f"error {error.errno}", time.monotonic() - start
    elapsed = time.monotonic() - start
    if not response.startswith(b"HTTP/1.1 200"):
        return "reset" if not response else "bad answer", elapsed
    return "ok" if elapsed < SLOW else "ok after >= 1 s", elapsed


async def burst(port: int, connections: int) -> dict[str, int]:
    """`connections` new connections at once; what became of them."""
    outcomes = await asyncio.gather(*(_one(port) for _ in range(connections)))
    return dict(Counter(outcome for outcome, _elapsed in outcomes))


def _side(tmp: Path, env: dict, fake_port: int, workers: int) -> tuple[int, int]:
    """A cg (with `workers`): its default-backlog port and its backlog=50 port."""
    old = overhead._free_port()
    _proc, port = overhead.start_cg(
        tmp, env, fake_port,
        extra=("--listen", f"tcp:{old}:interface={overhead.HOST}:backlog={OLD_BACKLOG}",
               "--store", f"sqlite:{tmp / f'store-{workers}.sqlite3'}", "--workers", str(workers)),
        log_name=f"cg-{workers}.log",
    )
    return port, old


def main(argv: list[str] | None = None) -> int:
    args = overhead.parse_args(argv, __doc__.splitlines()[0], "3 rounds instead of 10", "keep cg's logs",
                               lambda p: p.add_argument("--rounds", type=int, default=None))
    rounds = args.rounds or (3 if args.quick else 10)
    results: dict[str, dict[str, Counter[str]]] = {}
    with overhead.run_dir("cg-backlog-", args.keep_logs) as tmp:
        env = overhead._child_env()
        _fake, fake_port = overhead.start_fake(tmp, env)
        for workers, connections in ((1, 400), (2, 200)):
            port, old = _side(tmp, env, fake_port, workers)
            sides = {f"backlog={OLD_BACKLOG} (before)": old, "no backlog= (cg's 1024 now)": port}
            totals: dict[str, Counter[str]] = {name: Counter() for name in sides}
            for round_ in range(rounds):
                order = list(sides.items())
                for name, listening in order if round_ % 2 == 0 else reversed(order):
                    totals[name].update(asyncio.run(burst(listening, connections)))
                    time.sleep(0.5)  # the last burst's connections closed, the queue empty again
            results[f"--workers {workers}, {connections} at once x {rounds}"] = totals
    for title, totals in results.items():
        print(title)
        for name, counts in totals.items():
            failed = sum(n for outcome, n in counts.items() if not outcome.startswith("ok"))
            total = sum(counts.values())
            print(f"  {name:28} failed {failed:5} of {total} ({100 * failed / total:.1f} %)  {dict(sorted(counts.items()))}")
    if args.json:
        Path(args.json).write_text(json.dumps({t: {n: dict(c) for n, c in s.items()} for t, s in results.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
