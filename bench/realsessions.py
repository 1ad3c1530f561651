"""Issue 25's statistics of human-paced sessions, for any transcripts: how often people break, how
long, and what the first request after a break costs (issue 25, "Numbers": its targets are stated
on real sessions of that pattern).

    python bench/realsessions.py PATH... [--generated N] [--json FILE]

PATH: what ``cg-estimate`` reads (a Claude Code projects directory, a Codex sessions directory, a
HOME, a file), each a column of its own; ``--generated N``: bench/sessions.py's first N
``human_sessions`` (what bench/keepalive.py prices, drawn from issue 25's figures), one more
column. Beside them, the figures issue 25 gives for its 70 sessions.

Per column: sessions (main conversations) and sub-agent conversations, requests, sessions with an
idle gap over 5 minutes (the cache's default lifetime), such gaps and how long (5-30 min, 30 min to
4 h, longer), the share of the direct bill that is the cache writes of the first request after
such a gap, and what they cost above a cache read. The bill is the one the transcripts recorded
(their usage, priced with cg's table, as ``cg-estimate``'s ``recorded`` column); generated
sessions record none, so theirs is the simulated one (``cg.record.replay``). Then how idle periods
end against issue 25's prior (``ISSUE_25_PRIOR``, keep-alive's until it was fitted to real gaps): of the idle periods still idle
at each ping's age, the share that come back before the next ping, and the share the prior expects.

Reads each transcript as cg-estimate does (``cg.record.transcripts``); sends nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import attrs

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's cg, whatever is installed

from cg.exchange.keepalive import MARGIN, Band, Forecast  # noqa: E402
from cg.record import transcripts  # noqa: E402
from cg.record.pricing import ANTHROPIC, OPENAI, Price, Tokens, prices  # noqa: E402
from cg.record.replay import Sent, replay  # noqa: E402
from cg.wire.cache import TTL_5M  # noqa: E402

SHORT, LONG = 1800.0, 4 * 3600.0  # the bands issue 25 counts breaks in (and keep-alive's prior)
PING_STEP = TTL_5M - MARGIN  # keep-alive pings this often (4.5 min)
PING_AGES = tuple(PING_STEP * k for k in range(1, 8))  # the first seven pings' ages
# Issue 25's 70 sessions: of their idle periods past 4.5 min, 118 ended in 5-30 min, 33 later, 70 never
# (one end a session, as ``Stats`` counts them): keep-alive's prior until one was fitted to real gaps.
ISSUE_25_PRIOR = Forecast(prior=(Band(118.0, 300.0, 1800.0), Band(33.0, 1800.0, 14_400.0)), prior_ends=70.0)
ISSUE_25 = {"sessions": 70, "requests": 6958, "sessions_with_breaks": 54, "breaks": 151, "breaks_5_30": 118,
            "break_writes_share": 0.145, "break_writes_above_read_share": 0.133}


@attrs.frozen
class Conversation:
    """What the statistics need of one conversation: when each request went, and what it cost."""

    times: tuple[float, ...]
    costs: tuple[float, ...]  # each request's direct bill (USD)
    write_costs: tuple[tuple[float, float], ...]  # its cache writes: their cost, and above a cache read
    sidechain: bool = False
    one_hour: bool = False  # it recorded one-hour cache writes (Claude Code asks for them on some plans)


@attrs.define
class Stats:
    """One column's figures, conversation by conversation."""

    sessions: int = 0
    sidechains: int = 0
    requests: int = 0
    with_breaks: int = 0
    one_hour: int = 0
    breaks: list[float] = attrs.Factory(list)  # every gap over the cache's lifetime (seconds)
    ends: int = 0  # idle periods that never ended: a conversation's last request
    bill: float = 0.0
    break_writes: float = 0.0
    break_writes_above_read: float = 0.0

    def add(self, conv: Conversation) -> None:
        self.sidechains += conv.sidechain
        self.sessions += not conv.sidechain
        self.requests += len(conv.times)
        self.bill += sum(conv.costs)
        gaps = [(b - a, i + 1) for i, (a, b) in enumerate(zip(conv.times, conv.times[1:]))]
        breaks = [(g, i) for g, i in gaps if g > TTL_5M]
        self.with_breaks += bool(breaks) and not conv.sidechain
        self.one_hour += conv.one_hour and not conv.sidechain
        self.ends += not conv.sidechain  # as the prior counts them: one per session
        for gap, index in breaks:
            self.breaks.append(gap)
            self.break_writes += conv.write_costs[index][0]
            self.break_writes_above_read += conv.write_costs[index][1]

    def returns(self, age: float) -> tuple[int, float | None]:
        """Idle periods still idle at ``age`` (seconds), and the share back within one ping step."""
        idle = sum(1 for gap in self.breaks if gap > age) + self.ends
        back = sum(1 for gap in self.breaks if age < gap <= age + PING_STEP)
        return idle, (back / idle if idle else None)

    def row(self) -> dict[str, object]:
        breaks = self.breaks
        return {
            "sessions": self.sessions, "sub_agent_conversations": self.sidechains, "requests": self.requests,
            "sessions_one_hour": self.one_hour, "sessions_with_breaks": self.with_breaks, "breaks": len(breaks),
            "breaks_5_30": sum(1 for g in breaks if g <= SHORT),
            "breaks_30_240": sum(1 for g in breaks if SHORT < g <= LONG),
            "breaks_over_240": sum(1 for g in breaks if g > LONG),
            "bill": round(self.bill, 2),
            "break_writes_share": round(self.break_writes / self.bill, 4) if self.bill else None,
            "break_writes_above_read_share": round(self.break_writes_above_read / self.bill, 4) if self.bill else None,
            "returns": {f"{age / 60:g}": self.returns(age)[1] for age in PING_AGES},
        }


def _write_costs(price: Price, tokens: Tokens) -> tuple[float, float]:
    writes = Tokens(cache_write_5m=tokens.cache_write_5m, cache_write_1h=tokens.cache_write_1h)
    as_reads = Tokens(cache_read=tokens.cache_write)
    return price.cost(writes), price.cost(writes) - price.cost(as_reads)


def recorded(paths: Iterable[Path]) -> Iterator[Conversation]:
    """Each conversation of the transcripts under ``paths``, billed as they recorded it (requests
    that recorded no usage are left out)."""
    table = prices()
    files = [found for path in paths for found in transcripts.find(path)]
    for session in transcripts.read(files, transcripts.RECORDED):
        billed = [(r, r.billed) for r in session.requests if r.billed is not None]
        if not billed:
            continue
        price = [table.price(r.model, ANTHROPIC if r.path == transcripts.MESSAGES else OPENAI) for r, _ in billed]
        yield Conversation(tuple(r.time for r, _ in billed), tuple(p.cost(t) for p, (_, t) in zip(price, billed)),
                           tuple(_write_costs(p, t) for p, (_, t) in zip(price, billed)), session.sidechain,
                           any(t.cache_write_1h for _, t in billed))


def generated(count: int) -> Iterator[Conversation]:
    """bench/sessions.py's human-paced sessions, billed as cg.record.replay simulates them direct."""
    sys.path.insert(0, str(REPO / "bench"))
    from sessions import human_sessions  # bench/ is not a package: imported as bench/keepalive.py does

    for session in human_sessions(count):
        turns = replay([Sent(r.time, r.path, r.body, r.output_tokens) for r in session.requests])
        yield Conversation(tuple(t.time for t in turns), tuple(t.cost_direct for t in turns),
                           tuple(_write_costs(t.price, t.direct) for t in turns))


def prior_returns(age: float) -> float:
    """The share of idle periods still idle at ``age`` that issue 25's prior expects back within one step
    (counted as ``Stats`` counts them; the prior fitted per keep-alive key is bench/realkeepalive.py's)."""
    forecast = ISSUE_25_PRIOR
    idle = forecast.idle_at(age, ())
    return (idle - forecast.idle_at(age + PING_STEP, ())) / idle


def table(columns: dict[str, dict[str, object]]) -> str:
    names = list(columns)
    rows = [("sessions (main conversations)", "sessions"), ("sub-agent conversations", "sub_agent_conversations"),
            ("requests", "requests"), ("sessions recording one-hour cache writes", "sessions_one_hour"),
            ("sessions with a gap over 5 min", "sessions_with_breaks"),
            ("gaps over 5 min", "breaks"), ("  of them 5-30 min", "breaks_5_30"),
            ("  30 min - 4 h", "breaks_30_240"), ("  over 4 h", "breaks_over_240"), ("direct bill (USD)", "bill"),
            ("cache writes after a gap, of the bill", "break_writes_share"),
            ("  above a cache read, of the bill", "break_writes_above_read_share")]
    columns = {**columns, "issue 25": ISSUE_25}
    out = [" | ".join(["", *columns]), "|".join(["---"] * (len(columns) + 1))]
    for label, key in rows:
        cells = [_cell(c.get(key)) for c in columns.values()]
        out.append(" | ".join([label, *cells]))
    out.append("")
    out.append("back within the next 4.5 min, of a session's idle periods still idle at each ping's age (its end never comes back):")
    out.append(" | ".join(["idle for", *names, "issue 25's prior"]))
    out.append("|".join(["---"] * (len(names) + 2)))
    for age in PING_AGES:
        key = f"{age / 60:g}"
        cells = [_cell(columns[n]["returns"][key]) for n in names]  # type: ignore[index]
        out.append(" | ".join([f"{key} min", *cells, _cell(round(prior_returns(age), 4))]))
    return "\n".join(f"| {line} |" if line and "|" in line else line for line in out)


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and value < 1:
        return f"{100 * value:.1f}%"
    return f"{value:,}" if isinstance(value, (int, float)) else str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", type=Path, metavar="PATH", help="transcripts, as cg-estimate reads them")
    parser.add_argument("--generated", type=int, default=0, metavar="N",
                        help="also bench/sessions.py's first N human-paced sessions")
    parser.add_argument("--json", metavar="FILE", help="also write the figures to FILE")
    args = parser.parse_args(argv)
    for path in args.paths:
        if not path.exists():
            parser.error(f"no such file or directory: {path}")
    if not args.paths and not args.generated:
        parser.error("give a PATH or --generated N")
    columns: dict[str, dict[str, object]] = {}
    every = Stats()
    for path in args.paths:
        stats = Stats()
        for conv in recorded([path]):
            stats.add(conv)
            every.add(conv)
        columns[path.name or str(path)] = stats.row()
    if args.generated:
        stats = Stats()
        for conv in generated(args.generated):
            stats.add(conv)
        columns[f"generated ({args.generated})"] = stats.row()
    if len(args.paths) > 1:
        columns["all paths"] = every.row()
    print(table(columns))
    if args.json:
        Path(args.json).write_text(json.dumps(columns, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
