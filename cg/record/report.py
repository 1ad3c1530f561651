"""``cg-report CHANGELOG… [--json]``: what cg saved, from its change logs (cg/changelog.py), or from
the ledger of its store (``--store URL``: cg.web.report reads it, `Tally.add_turn` counts its rows
as the change log's lines for the same requests).

The cumulative figure sums every compaction line, and a decision is logged again on every
turn that re-sends it: it counts re-sends (an earlier proxy found such a figure overstated savings 8-21x).
The unique figure counts each compaction once: lossy ones by (marker id, component), reformat
ones by (content hash, component). That one is the honest measure of what cg kept out.

A line is one component's step; a tool result two components rewrote has two lines in a
request. The ``results_*`` figures count each result once per request: its size as the client
sent it (step 0's ``tokens_before``) and as cg forwarded it (its last step's ``tokens_after``).
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import math
import sys
from collections.abc import Iterator, Sequence
from typing import Any, BinaryIO, TextIO, TypeVar, overload

import attrs
import ujson
from tqdm import tqdm

from cg.exchange.ledger import PING, Change, Turn
from cg.record.pricing import OPENAI, Tokens, prices
from cg.wire.dialect import SHAPES

NOTE = (
    "Cumulative counts a compaction again on every turn that re-sends it, so it grows with the "
    "length of a conversation; unique counts each compaction once: use unique."
)

_USAGE_FIELDS = ("input_tokens", "cache_read_tokens", "cache_write_tokens", "output_tokens", "expand_rounds",
                 "cache_write_1h_tokens")
_PING_FIELDS = ("input_tokens", "cache_read_tokens", "cache_write_tokens", "cache_write_1h_tokens", "output_tokens")


class BadRecord(ValueError):
    pass


def _int(record: dict[str, object], key: str, default: int | None = None) -> int:
    value = record.get(key, default)
    if value is None and default is not None:
        return default
    if type(value) is float and math.isfinite(value):
        return round(value)  # a writer that counted in floats: still a count
    if type(value) is not int:  # bool is not a count
        raise BadRecord(key)
    return value


@overload
def _str(record: dict[str, object], key: str) -> str: ...


@overload
def _str(record: dict[str, object], key: str, optional: bool) -> str | None: ...


def _str(record: dict[str, object], key: str, optional: bool = False) -> str | None:
    value = record.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise BadRecord(key)
    return value


def _time(record: dict[str, object]) -> float | None:
    value = record.get("time")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


_Key = tuple[str, str]  # (marker id or content hash, component)
_Location = tuple[str, int, object, object, object]  # (session, seq, message, block, part)


@attrs.define
class _Component:
    lossy: bool = False
    acted: int = 0
    cumulative: int = 0
    unique: dict[_Key, int] = attrs.Factory(dict)  # key -> tokens deleted


@attrs.define
class Tally:
    """Everything the report shows, accumulated one record at a time."""

    files: int = 0
    lines: int = 0
    # Read from a store's ledger instead (cg-report --store): which, the rows read, and how many
    # requests its rollups count (more when it keeps rows for fewer requests than it counted).
    store: str | None = None
    rows: int = 0
    rows_counted: int | None = None
    bad_lines: int = 0
    other_lines: int = 0
    unreadable_files: list[str] = attrs.Factory(list)
    first_time: float | None = None
    last_time: float | None = None
    compactions: int = 0
    cumulative: int = 0
    cumulative_marker: int = 0
    # (marker id or content hash, component) -> tokens deleted; the larger on a conflict
    # (a configuration change between runs), so the result does not depend on file order.
    unique_marker: dict[_Key, int] = attrs.Factory(dict)
    unique_no_marker: dict[_Key, int] = attrs.Factory(dict)
    markers: set[str] = attrs.Factory(set)
    sessions: set[str] = attrs.Factory(set)
    usage_requests: set[tuple[str, int]] = attrs.Factory(set)
    compaction_requests: set[tuple[str, int]] = attrs.Factory(set)
    usage_lines: int = 0
    usage: dict[str, int] = attrs.Factory(lambda: dict.fromkeys(_USAGE_FIELDS, 0))
    # (model, provider) -> billed tokens, for the cost (cg.record.pricing, as cg-estimate prices)
    billed: dict[tuple[str | None, str], Tokens] = attrs.Factory(dict)
    components: dict[str, _Component] = attrs.Factory(dict)
    results: int = 0
    results_tokens_before: int = 0
    results_tokens_after: int = 0
    # Keep-alive pings (--keepalive): cg's own spending, apart from the requests' usage and cost.
    pings: int = 0
    pings_usage: dict[str, int] = attrs.Factory(lambda: dict.fromkeys(_PING_FIELDS, 0))
    pings_usd: float = 0.0
    # The last compaction line's (session, seq, message, block, part) and size after it: a line
    # from a cg that wrote no ``step`` continues that result when it starts from that size.
    _previous: tuple[_Location, int] | None = None

    def add_line(self, line: bytes) -> None:
        line = line.strip()
        if not line:
            return  # cg leaves an empty line after a failed write
        self.lines += 1
        try:
            record = ujson.loads(line)
            if not isinstance(record, dict):
                raise BadRecord("not an object")
            kind = record.get("kind")
            if kind == "compaction":
                self._compaction(record)
            elif kind == "usage":
                self._usage(record)
            elif kind == "ping":
                cost = record.get("cost_usd")
                if not isinstance(cost, (int, float)) or isinstance(cost, bool):
                    raise BadRecord("no cost_usd")
                self._count_ping({key: _int(record, key, default=0) for key in _PING_FIELDS}, float(cost))
            else:
                self.other_lines += 1  # a kind added after this cg-report
                return
        except (ValueError, TypeError, OverflowError):
            self.bad_lines += 1
            return
        self._seen(_time(record))

    def add_turn(self, turn: Turn, changes: Sequence[Change]) -> None:
        """A ledger's row (cg.exchange.ledger), counted as the change log's lines for the same
        request are: a compaction line per change, and a usage line if its usage was read; a keep-alive
        ping's row as its ping line."""
        if turn.kind == PING:  # not a request: `rows` counts those
            self._count_ping(turn.billed.as_dict() if turn.billed is not None else {}, turn.cost_via_cg or 0.0)
            self._seen(turn.time)
            return
        self.rows += 1
        for change in changes:
            key = change.marker or change.content_id
            if key is None:  # a change a ledger kept without its content ID: it cannot be counted once
                self.bad_lines += 1
                continue
            self._count_compaction(turn.conversation, turn.seq, change.component, change.marker, key,
                                   change.tokens_before - change.tokens_after, change.tokens_before, change.step,
                                   change.lossy, (turn.conversation, turn.seq, change.message, change.block,
                                                  change.part))
        if turn.billed is not None:
            self._count_usage(turn.conversation, turn.seq, dict(turn.billed.as_dict(), expand_rounds=turn.expand_rounds),
                              turn.model, turn.dialect)
        self._seen(turn.time)

    def _seen(self, when: float | None) -> None:
        if when is not None:
            self.first_time = when if self.first_time is None else min(self.first_time, when)
            self.last_time = when if self.last_time is None else max(self.last_time, when)

    def _compaction(self, record: dict[str, object]) -> None:
        # Check every field before counting any of them.
        session, seq = _str(record, "session"), _int(record, "seq")
        component, marker = _str(record, "component"), _str(record, "marker", optional=True)
        content_hash = _str(record, "hash", optional=True)
        deleted = _int(record, "tokens_deleted")
        before = None if record.get("tokens_before") is None else _int(record, "tokens_before")
        step = None if record.get("step") is None else _int(record, "step")
        key = marker if marker is not None else content_hash
        if key is None:
            raise BadRecord("neither marker nor hash")
        self._count_compaction(session, seq, component, marker, key, deleted, before, step,
                               record.get("lossy") is True,
                               (session, seq, record.get("message"), record.get("block"), record.get("part")))

    def _count_compaction(self, session: str, seq: int, component: str, marker: str | None, key_id: str,
                          deleted: int, before: int | None, step: int | None, lossy: bool,
                          location: _Location) -> None:
        """One component's step on one result; ``key_id`` is its marker id, else its content hash."""
        key = (key_id, component)
        self.compactions += 1
        self.cumulative += deleted
        self.sessions.add(session)
        self.compaction_requests.add((session, seq))
        stats = self.components.setdefault(component, _Component())
        stats.lossy = stats.lossy or lossy
        stats.acted += 1
        stats.cumulative += deleted
        if marker is not None:
            self.cumulative_marker += deleted
            self.markers.add(marker)
            unique = self.unique_marker
        else:
            unique = self.unique_no_marker
        best = max(deleted, unique.get(key, deleted))
        unique[key] = best
        stats.unique[key] = best
        self._result_step(location, step, before, deleted)

    def _result_step(self, location: _Location, step: int | None, before: int | None, deleted: int) -> None:
        """Per result: a step 0 starts one, every step takes its deletion off what was forwarded."""
        if before is None:  # a line without its size: it cannot say what the result was
            self._previous = None
            return
        starts = step == 0 if step is not None else self._previous != (location, before)
        self._previous = (location, before - deleted)
        if starts:
            self.results += 1
            self.results_tokens_before += before
            self.results_tokens_after += before
        self.results_tokens_after -= deleted

    def _usage(self, record: dict[str, object]) -> None:
        session, seq = _str(record, "session"), _int(record, "seq")
        counts = {key: _int(record, key, default=0) for key in _USAGE_FIELDS}
        model = record.get("model")
        self._count_usage(session, seq, counts, model if isinstance(model, str) else None, str(record.get("dialect")))

    def _count_usage(self, session: str, seq: int, counts: dict[str, int], model: str | None, dialect: str) -> None:
        """One request's billed usage (``counts`` by _USAGE_FIELDS), priced by its model and dialect."""
        # Lines written before cg split cache writes by lifetime have none written for an hour.
        tokens = Tokens.billed(counts["input_tokens"], counts["cache_read_tokens"], counts["cache_write_tokens"],
                               counts["cache_write_1h_tokens"], counts["output_tokens"])
        counts["cache_write_1h_tokens"] = tokens.cache_write_1h
        self.usage_lines += 1
        self.sessions.add(session)
        self.usage_requests.add((session, seq))
        for key, value in counts.items():
            self.usage[key] += value
        # The provider is the route of the line's dialect (cg.record.pricing keys its providers by
        # the route's name); a line of no dialect cg knows is priced as OpenAI's, as it always was.
        shape = SHAPES.get(dialect)
        provider = shape.route if shape is not None else OPENAI
        priced_by = (model, provider)
        self.billed[priced_by] = self.billed.get(priced_by, Tokens()) + tokens

    def _count_ping(self, counts: dict[str, int], usd: float) -> None:
        self.pings += 1
        self.pings_usd += usd
        for key, value in counts.items():
            self.pings_usage[key] += value

    def cost(self) -> dict[str, Any]:
        """The billed usage at list prices (cg/record/prices.json), by model."""
        table = prices()
        by_model: list[dict[str, Any]] = []
        notes: set[str] = set()
        for (model, provider), tokens in sorted(self.billed.items(), key=lambda kv: (kv[0][0] or "", kv[0][1])):
            price = table.price(model, provider)
            if price.note:
                notes.add(price.note)
            by_model.append({"model": model, "priced_as": price.key, "input_tokens": tokens.input,
                             "cache_read_tokens": tokens.cache_read, "cache_write_tokens": tokens.cache_write,
                             "output_tokens": tokens.output, "usd": round(price.cost(tokens), 6)})
        return {"usd": round(sum(float(m["usd"]) for m in by_model), 6), "by_model": by_model, "notes": sorted(notes),
                "sources": table.sources()}

    def summary(self) -> dict[str, Any]:
        """The report as one JSON-ready object. Keys are only ever added."""
        unique_marker = sum(self.unique_marker.values())
        unique_no_marker = sum(self.unique_no_marker.values())
        unique = unique_marker + unique_no_marker
        requests_from = (
            "usage" if self.usage_requests else "compactions" if self.compaction_requests else None
        )
        requests = self.usage_requests if self.usage_requests else self.compaction_requests
        read, write = self.usage["cache_read_tokens"], self.usage["cache_write_tokens"]
        return {
            "files": self.files,
            "lines": self.lines,
            "bad_lines": self.bad_lines,
            "other_lines": self.other_lines,
            "unreadable_files": list(self.unreadable_files),
            "first_time": self.first_time,
            "last_time": self.last_time,
            "compactions": self.compactions,
            "compactions_unique": len(self.unique_marker) + len(self.unique_no_marker),
            "cumulative_deleted_tokens": self.cumulative,
            "cumulative_deleted_marker": self.cumulative_marker,
            "cumulative_deleted_no_marker": self.cumulative - self.cumulative_marker,
            "unique_deleted_tokens": unique,
            "unique_deleted_marker": unique_marker,
            "unique_deleted_no_marker": unique_no_marker,
            "cumulative_over_unique": round(self.cumulative / unique, 2) if unique else None,
            "distinct_markers": len(self.markers),
            "requests": len(requests),
            "requests_from": requests_from,
            "sessions": len(self.sessions),
            "results": self.results,
            "results_tokens_before": self.results_tokens_before,
            "results_tokens_after": self.results_tokens_after,
            "results_savings_pct": (
                round(100 * (self.results_tokens_before - self.results_tokens_after) / self.results_tokens_before, 2)
                if self.results_tokens_before else None
            ),
            "components": {
                name: {
                    "lossy": stats.lossy,
                    "acted": stats.acted,
                    "acted_unique": len(stats.unique),
                    "cumulative_deleted_tokens": stats.cumulative,
                    "unique_deleted_tokens": sum(stats.unique.values()),
                }
                for name, stats in sorted(self.components.items())
            },
            "usage": {
                "requests": self.usage_lines,
                **self.usage,
                "cache_write_read_ratio": round(write / read, 4) if read else None,
            },
            "note": NOTE,
            "cost": self.cost(),
            "store": self.store,
            "rows": self.rows,
            "rows_counted": self.rows_counted,
            "pings": {"count": self.pings, **self.pings_usage, "cost_usd": round(self.pings_usd, 6)},
        }


def _lines(stream: BinaryIO) -> Iterator[bytes]:
    """Lines of a plain or gzip stream (told apart by the magic number, not the name)."""
    head = stream.peek(2)[:2] if hasattr(stream, "peek") else b""
    yield from gzip.GzipFile(fileobj=stream) if head == b"\x1f\x8b" else stream


_Item = TypeVar("_Item")


def progress(items: Sequence[_Item], unit: str, stream: TextIO, quiet: bool = False) -> tqdm[_Item]:
    """``items`` with a progress bar on ``stream`` while a command reads them (cg-report's change
    logs, cg-estimate's transcripts): only when ``stream`` is a terminal and not ``quiet``, and
    erased when done, so that what stays on the screen is the report."""
    return tqdm(items, unit=unit, file=stream, disable=True if quiet else None, leave=False, dynamic_ncols=True)


def tally(paths: Sequence[str], stdin: BinaryIO | None = None, stderr: TextIO | None = None,
          quiet: bool = False) -> Tally:
    """Read change logs (``-`` is standard input), with a progress bar on ``stderr`` if it is a
    terminal and not ``quiet``. A file that cannot be read, or a gzip file cut short (rotation
    still compressing it), is noted and the rest still counts."""
    result = Tally()
    bar = progress(paths, "file", stderr or sys.stderr, quiet)
    for path in bar:
        bar.set_postfix_str(str(path), refresh=False)
        result.files += 1
        try:
            if path == "-":
                stream = stdin if stdin is not None else sys.stdin.buffer
                for line in _lines(stream):
                    result.add_line(line)
            else:
                with open(path, "rb") as stream:
                    for line in _lines(stream):
                        result.add_line(line)
        except (OSError, EOFError) as e:
            result.unreadable_files.append(f"{path}: {e}")
    return result


def _n(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def text_table(rows: list[tuple[str, ...]], align: str) -> list[str]:
    """Rows of cells as text columns; ``align`` is one of "<" or ">" per column."""
    cells = [[str(cell) for cell in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(align))]
    return ["  ".join(f"{cell:{a}{w}}" for cell, a, w in zip(row, align, widths)).rstrip() for row in cells]


def render(s: dict[str, Any]) -> str:
    """The summary as a plain text table."""
    span = f"from {_when(s['first_time'])} to {_when(s['last_time'])}"
    if s["store"] is None:
        out = [f"{s['files']} file(s), {s['lines']:,} lines {span}"]
    else:
        out = [f"{s['store']}: the ledger's {s['rows']:,} request(s) {span}"]
        if s["rows_counted"] is not None and s["rows_counted"] > s["rows"]:
            out.append(f"(its rollups count {s['rows_counted']:,} requests; it keeps the rows of the newest "
                       f"{s['rows']:,}, and these figures are theirs)")
    if s["bad_lines"]:
        what = "line(s)" if s["store"] is None else "change(s) kept without a marker or content id"
        out.append(f"skipped {s['bad_lines']:,} unreadable {what}")
    for problem in s["unreadable_files"]:
        out.append(f"could not read {problem}")
    out.append("")
    ratio = s["cumulative_over_unique"]
    out += text_table(
        [
            ("Deleted tokens", "cumulative", "unique"),
            ("  total", _n(s["cumulative_deleted_tokens"]), _n(s["unique_deleted_tokens"])),
            ("  behind a marker (lossy)", _n(s["cumulative_deleted_marker"]), _n(s["unique_deleted_marker"])),
            (
                "  no marker (reformat)",
                _n(s["cumulative_deleted_no_marker"]),
                _n(s["unique_deleted_no_marker"]),
            ),
            ("Compactions", _n(s["compactions"]), _n(s["compactions_unique"])),
        ],
        "<>>",
    )
    pct = s["results_savings_pct"]
    out += [""] + text_table(
        [
            ("Tool results rewritten", _n(s["results"]), "(in each request: a re-sent one counts again)"),
            ("  tokens as sent", _n(s["results_tokens_before"]), ""),
            ("  tokens as forwarded", _n(s["results_tokens_after"]), "" if pct is None else f"({pct:.1f}% less)"),
        ],
        "<><",
    )
    requests = _n(s["requests"])
    if s["requests_from"] == "compactions":
        requests += " (no usage lines: requests that had a compaction)"
    out += [""] + text_table(
        [
            ("Cumulative / unique", "-" if ratio is None else f"{ratio:.1f}x"),
            ("Distinct marker ids", _n(s["distinct_markers"])),
            ("Requests", requests),
            ("Sessions", _n(s["sessions"])),
        ],
        "<<",
    )
    out.append("")
    if s["components"]:
        rows: list[tuple[str, ...]] = [("Component", "kind", "acted", "unique", "deleted cumulative", "deleted unique")]
        for name, c in s["components"].items():
            rows.append(
                (
                    name,
                    "lossy" if c["lossy"] else "reformat",
                    _n(c["acted"]),
                    _n(c["acted_unique"]),
                    _n(c["cumulative_deleted_tokens"]),
                    _n(c["unique_deleted_tokens"]),
                )
            )
        out += text_table(rows, "<<>>>>")
        out.append("(components that ran and changed nothing leave no line: /stats counts their runs)")
        out.append("")
    u = s["usage"]
    if u["requests"]:
        per = u["requests"]
        rows = [("Billed usage", "tokens", "per request")]
        for label, key in (
            ("input (uncached)", "input_tokens"),
            ("cache read", "cache_read_tokens"),
            ("cache write", "cache_write_tokens"),
            ("  of which for 1 hour", "cache_write_1h_tokens"),
            ("output", "output_tokens"),
        ):
            rows.append((f"  {label}", _n(u[key]), f"{u[key] / per:,.0f}"))
        read, write = u["cache_read_tokens"], u["cache_write_tokens"]
        if not read:
            ratio = "- (nothing read from the cache)"
        elif not write:
            ratio = "0 (nothing written to the cache)"
        else:
            ratio = f"1:{read / write:,.1f} ({u['cache_write_read_ratio']})"
        out += text_table(rows, "<>>")
        out.append(f"Cache write:read  {ratio}")
        if u["expand_rounds"]:
            out.append(f"expand calls cg answered: {u['expand_rounds']:,}")
        cost = s["cost"]
        out.append(f"Cost at list prices: ${cost['usd']:,.4f} (cg/record/prices.json)")
        out += [f"  note: {note}" for note in cost["notes"]]
    else:
        out.append("Billed usage: no usage lines")
    pings = s["pings"]
    if pings["count"]:
        out.append(f"Keep-alive pings: {pings['count']:,}, ${pings['cost_usd']:,.4f} at list prices "
                   f"(cache read {_n(pings['cache_read_tokens'])} tokens); not in the figures above")
    out += ["", NOTE]
    return "\n".join(out) + "\n"


def arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    """cg-report's command line (run by cg.web.report, which can open a store)."""
    parser = argparse.ArgumentParser(
        prog="cg-report",
        description="What cg saved, from its change logs (--changelog) or from the ledger of its store "
        "(--store). Reads plain or gzip files (rotated ones too); - reads standard input.",
    )
    parser.add_argument("changelogs", nargs="*", metavar="CHANGELOG")
    parser.add_argument("--store", metavar="URL",
                        help="read the ledger of the store at URL instead: sqlite:PATH or a Redis URL, as twistd "
                        "cg --store takes it")
    parser.add_argument("--store-password-file", metavar="FILE",
                        help="a Redis store's password, from this file (else $CG_STORE_PASSWORD, when the URL "
                        "has none)")
    parser.add_argument("--json", action="store_true", help="print one JSON object (stable keys)")
    args = parser.parse_args(argv)
    if bool(args.changelogs) == (args.store is not None):
        parser.error("give CHANGELOG files or --store URL" if not args.changelogs
                     else "give CHANGELOG files or --store URL, not both")
    return args


def report_changelogs(args: argparse.Namespace, stdout: TextIO, stderr: TextIO) -> int:
    """The report of the change logs ``args`` names."""
    summary = tally(args.changelogs, stderr=stderr, quiet=args.json).summary()
    if len(summary["unreadable_files"]) == len(args.changelogs) and not summary["lines"]:
        # Nothing was read: a table of zeros would read as "cg saved nothing".
        for problem in summary["unreadable_files"]:
            print(f"cg-report: could not read {problem}", file=stderr)
        return 1
    show(summary, args.json, stdout)
    for problem in summary["unreadable_files"]:
        print(f"cg-report: could not read {problem}", file=stderr)
    return 1 if summary["unreadable_files"] else 0


def show(summary: dict[str, Any], as_json: bool, stdout: TextIO) -> None:
    if as_json:
        stdout.write(ujson.dumps(summary, ensure_ascii=False, escape_forward_slashes=False, indent=2) + "\n")
    else:
        stdout.write(render(summary))
