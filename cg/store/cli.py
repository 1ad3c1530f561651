"""``cg-store``: look into cg's store of originals, or empty it.

Works on the SQLite file, or the Redis, directly and synchronously (no reactor): both let
it run beside a live cg, which notices a purge within a few seconds.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sqlite3
import sys
import time

from cg.store import (
    PASSWORD_ENV,
    RedisAddress,
    RedisDB,
    SQLiteDB,
    StoreError,
    StoreInfo,
    default_store_url,
    store_password,
    usable_store_url,
)


def _days(text: str) -> float:
    try:
        days = float(text)
    except ValueError:
        days = -1.0
    if not days >= 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"not a number of days: {text!r}")
    return days


def _size(n: int) -> str:
    value, units = float(n), ["KiB", "MiB", "GiB"]
    unit = "bytes"
    while value >= 1024 and units:
        value, unit = value / 1024, units.pop(0)
    return f"{n} bytes" if unit == "bytes" else f"{n} bytes, {value:.1f} {unit}"


def _when(ts: float | None, now: float) -> str:
    if ts is None:
        return "-"
    stamp = datetime.datetime.fromtimestamp(ts).astimezone().isoformat(timespec="seconds")
    return f"{stamp} ({(now - ts) / 86400:.1f} days ago)"


def _print_info(path: str, info: StoreInfo) -> None:
    print(f"store:   {path}")
    print(f"entries: {info.entries} ({_size(info.bytes)})")
    print(f"oldest:  {_when(info.oldest_use, time.time())}")
    print(f"frozen:  {info.frozen_entries} ({_size(info.frozen_bytes)})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="cg-store", description="Show or purge cg's store of elided originals."
    )
    store_help = (
        f"sqlite:PATH or a Redis URL (redis://, rediss://, unix://), as for cg itself "
        f"(default: {default_store_url()})"
    )
    password_help = f"a Redis store's password, from this file (else ${PASSWORD_ENV}, when the URL has none)"
    parser.add_argument("--store", metavar="URL", help=store_help)
    parser.add_argument("--store-password-file", metavar="FILE", help=password_help)
    # --store may also follow the command (cg-store info --store X): SUPPRESS keeps the
    # subcommand's unset default from hiding a --store given before it.
    after = argparse.ArgumentParser(add_help=False)
    after.add_argument("--store", metavar="URL", default=argparse.SUPPRESS, help=store_help)
    after.add_argument("--store-password-file", metavar="FILE", default=argparse.SUPPRESS, help=password_help)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("info", parents=[after], help="entries, bytes and the oldest last use")
    purge = commands.add_parser(
        "purge",
        parents=[after],
        help="delete originals and frozen repairs (all, or those unused for DAYS)",
    )
    purge.add_argument("--older-than", metavar="DAYS", type=_days)
    args = parser.parse_args(argv)

    url = args.store or default_store_url()
    try:
        scheme, path = usable_store_url(url)
        password = store_password(url, args.store_password_file)
    except ValueError as e:
        parser.error(str(e))
    if scheme == "redis":
        return _redis(args, RedisAddress.parse(url), password)
    if scheme != "sqlite":
        parser.error("only a sqlite: or a Redis store outlives the process that made it")
    # Never create one: run as root, it would be a file the cg service cannot open.
    if not os.path.isfile(path):
        print(f"cg-store: no store at {path}", file=sys.stderr)
        return 1
    try:
        db = SQLiteDB.open(path, create=False)
        try:
            if args.command == "info":
                _print_info(path, db.info())
            else:
                count = db.purge(args.older_than)
                print(f"purged {count} entries from {path}")
        finally:
            db.close()
    except (StoreError, sqlite3.Error) as e:
        print(f"cg-store: {e}", file=sys.stderr)
        return 1
    return 0


def _redis(args: argparse.Namespace, address: RedisAddress, password: str | None) -> int:
    """Redis needs no "no store there": an empty one says 0 entries."""
    db = RedisDB(address, password=password)
    try:
        if args.command == "info":
            _print_info(address.label, db.info())
        else:
            count = db.purge(args.older_than)
            print(f"purged {count} entries from {address.label}")
    except StoreError as e:
        print(f"cg-store: {address.label}: {e}", file=sys.stderr)
        return 1
    finally:
        db.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
