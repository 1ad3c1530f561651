"""``cg-report``: what cg saved, from its change logs or from the ledger of its store (``--store URL``).

The report itself (the tally, the table, the JSON) is cg.record.report's, which imports no Twisted;
a store's ledger answers with Deferreds (cg.store.base.ILedger), so reading one runs a reactor, here.
Its turns are counted as the change log's lines for the same requests would be, so the two agree.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import TextIO

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorFromThreads

from cg.record import report
from cg.store.base import ILedger


def main(argv: Sequence[str] | None = None, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    """The console script. With --store it runs a reactor until the ledger is read, and exits."""
    stdout, stderr = stdout or sys.stdout, stderr or sys.stderr
    args = report.arguments(argv)
    if args.store is None:
        return report.report_changelogs(args, stdout, stderr)
    # The stores' modules (SQLite, Redis) and the reactor load only for --store.
    from cg.store import store_label, store_password, usable_store_url
    from cg.store.sqlite_ledger import ledger_path

    try:
        scheme, path = usable_store_url(args.store)
        password = store_password(args.store, args.store_password_file)
    except ValueError as error:
        print(f"cg-report: {error}", file=stderr)
        return 2
    if scheme == "memory":
        print("cg-report: a memory: store dies with its cg: give sqlite:PATH or a Redis URL", file=stderr)
        return 2
    # Never create one: an empty file named like cg's store would be a report of nothing.
    if scheme == "sqlite" and not os.path.isfile(path):
        print(f"cg-report: no store at {path}", file=stderr)
        return 1
    # Nor its ledger: opening the store would create one (owned by whoever runs cg-report).
    if scheme == "sqlite" and not os.path.isfile(ledger_path(path)):
        print(f"cg-report: {path} has no ledger ({ledger_path(path)}): no cg has recorded a request there", file=stderr)
        return 1
    from twisted.internet import task

    task.react(_exit_with, (args, store_label(args.store), password, stdout, stderr))


async def _exit_with(reactor: IReactorFromThreads, args: argparse.Namespace, label: str, password: str | None,
                     stdout: TextIO, stderr: TextIO) -> None:
    """react exits 0 whatever its coroutine returns: the status goes out as SystemExit's."""
    raise SystemExit(await _report_store(reactor, args, label, password, stdout, stderr))


async def _report_store(reactor: IReactorFromThreads, args: argparse.Namespace, label: str, password: str | None,
                        stdout: TextIO, stderr: TextIO) -> int:
    from cg.store import StoreError, store_from_url

    store = store_from_url(args.store, reactor, password=password)
    try:
        summary = (await tally_ledger(store.ledger, label, stderr, args.json)).summary()
    except StoreError as error:
        print(f"cg-report: {label}: {error}", file=stderr)
        return 1
    finally:
        await store.close()
    if not summary["rows"]:
        # A table of zeros would read as "cg saved nothing".
        print(f"cg-report: the ledger of {label} holds no request (is it the store cg runs with?)", file=stderr)
        return 1
    report.show(summary, args.json, stdout)
    return 0


def tally_ledger(ledger: ILedger, label: str, stderr: TextIO | None = None, quiet: bool = False) -> Deferred[report.Tally]:
    """The report's `Tally` of every turn ``ledger`` keeps, of every tenant (with a progress bar
    on ``stderr`` if it is a terminal and not ``quiet``), and how many requests its rollups count."""
    tally = report.Tally(store=label)

    async def read() -> report.Tally:
        rows = await ledger.turns()
        for turn, changes in report.progress(rows, "request", stderr or sys.stderr, quiet):
            tally.add_turn(turn, changes)
        tally.rows_counted = (await ledger.totals(None, None)).requests
        return tally

    return Deferred.fromCoroutine(read())


if __name__ == "__main__":
    sys.exit(main())
