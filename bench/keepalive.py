"""Cache keep-alive's net saving, measured: cg's rewrite replayed with and without ``--keepalive``
and priced with the provider's prompt cache (issue 13, §2).

    python bench/keepalive.py [--quick] [--json PATH] [--sessions N]

In-process and pure: no sockets, no store. The same sessions go through ``cg.record.replay.replay``
(what ``cg-estimate --keepalive`` runs) once per ``--keepalive-max-idle`` in MAX_IDLE (the budget at
its default): the via-cg cost with keep-alive (each ping priced as the conversation's last
forwarded prompt read from the cache plus one output token, pings after a session's last request
going on to the idle bound) against the via-cg cost without it, from the same replay.

- generated sessions (bench/sessions.py): Claude Code's envelope, 40 to 80 requests each, idle gaps
  drawn from ``sessions.GAPS`` (75% 2-45 s, 18% 1-4.5 min, 7% 5.5-30 min: past the 5-minute cache
  lifetime); each session is one conversation, and its end is the user leaving for good. The
  generator draws no break longer than 30 minutes, which no bound of 30 minutes or more can miss:
  the same sessions are also run with their long breaks spread to 2 hours (``LONG_TAIL``: 7% of gaps
  5.5 min-2 h), where most breaks outlast the bound and their pings are spent for nothing;
- the transcripts in ``tests/fixtures/transcripts/`` (one headless Claude Code run of a few seconds,
  one Codex run), reported apart.

Per setting: pings sent, what they cost, gaps over the lifetime that keep-alive bridged (the next
request read the prefix), the cost via cg with keep-alive, and the net saving (what keep-alive
spared minus what its pings cost) as a share of the via-cg bill without it.
"""

from __future__ import annotations

import datetime
import sys
import time
from pathlib import Path

import attrs

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's cg, whatever is installed: it reads the checkout's fixtures too

import sessions  # noqa: E402
from rewrite import bench_main, machine  # noqa: E402
from sessions import GAPS, TURNS, generated_sessions  # noqa: E402

from cg.exchange.keepalive import DEFAULT_BUDGET, DEFAULT_MAX_IDLE, MARGIN, Policy  # noqa: E402
from cg.record import transcripts  # noqa: E402
from cg.record.replay import Sent, Turn, replay  # noqa: E402
from cg.wire.cache import TTL_5M  # noqa: E402

TRANSCRIPTS = REPO / "tests" / "fixtures" / "transcripts" / "home"
MAX_IDLE = (900.0, DEFAULT_MAX_IDLE, 3600.0)
SESSIONS = 40
LONG_TAIL = (*GAPS[:-1], (GAPS[-1][0], GAPS[-1][1], 7200.0))
DISTRIBUTIONS = {"generated": GAPS, "breaks to 2 h": LONG_TAIL}


@attrs.define
class Tally:
    """One setting's figures over a set of sessions."""

    sessions: int = 0
    requests: int = 0
    direct: float = 0.0
    cg: float = 0.0  # via cg, without keep-alive
    kept: float = 0.0  # via cg, with keep-alive (pings included)
    pings: int = 0
    ping_cost: float = 0.0
    long_gaps: int = 0  # gaps longer than the cache's lifetime
    bridged: int = 0  # of those, the ones whose next request read the prefix thanks to the pings
    trailing_pings: int = 0  # pings after a session's last request

    def add(self, turns: list[Turn]) -> None:
        self.sessions += 1
        for previous, turn in zip([None, *turns], turns):
            self.requests += 1
            self.direct += turn.cost_direct
            self.cg += turn.cost_cg
            self.kept += turn.cost_keepalive
            self.pings += turn.pings
            self.ping_cost += turn.ping_cost
            if previous is not None and turn.time - previous.time > TTL_5M:
                self.long_gaps += 1
                self.bridged += turn.keepalive is not None and turn.keepalive.cache_write < turn.cg.cache_write
        self.trailing_pings += turns[-1].pings if turns else 0

    def row(self) -> dict:
        return {"sessions": self.sessions, "requests": self.requests, "cost_direct": round(self.direct, 4),
                "cost_cg": round(self.cg, 4), "cost_cg_keepalive": round(self.kept, 4), "pings": self.pings,
                "trailing_pings": self.trailing_pings, "ping_cost": round(self.ping_cost, 4),
                "long_gaps": self.long_gaps, "bridged": self.bridged,
                "net_saving": round(self.cg - self.kept, 4),
                "net_saving_pct": round(100 * (self.cg - self.kept) / self.cg, 2) if self.cg else None,
                "ratio_cg": round(self.cg / self.direct, 4) if self.direct else None,
                "ratio_cg_keepalive": round(self.kept / self.direct, 4) if self.direct else None}


def run(quick: bool, n_sessions: int) -> dict:
    started = time.monotonic()
    turns_range = (12, 20) if quick else TURNS
    generated = {name: {idle: Tally() for idle in MAX_IDLE} for name in DISTRIBUTIONS}
    fixtures = {idle: Tally() for idle in MAX_IDLE}
    for name, gaps in DISTRIBUTIONS.items():
        sessions.GAPS = gaps  # sessions.gap draws from it
        for session in generated_sessions(n_sessions, turns_range):
            sent = [Sent(r.time, r.path, r.body, r.output_tokens) for r in session.requests]
            for idle in MAX_IDLE:
                generated[name][idle].add(replay(sent, conversation=session.id, keep_warm=Policy(max_idle=idle)))
            print(f"  {name} {session.id}: {len(sent)} requests, {time.monotonic() - started:.0f} s", file=sys.stderr)
    sessions.GAPS = GAPS
    found = list(transcripts.read(transcripts.find(TRANSCRIPTS)))
    for session in found:
        sent = [Sent(r.time, r.path, r.body, r.output_tokens) for r in session.requests]
        for idle in MAX_IDLE:
            fixtures[idle].add(replay(sent, conversation=session.id, keep_warm=Policy(max_idle=idle)))
    return {
        "when": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "quick": quick,
        "seconds": round(time.monotonic() - started, 1),
        "budget": DEFAULT_BUDGET,
        "margin_s": MARGIN,
        "generated": {"sessions": n_sessions, "turns": list(turns_range),
                      "distributions": {name: {"gaps": [list(g) for g in DISTRIBUTIONS[name]],
                                               "settings": {f"{idle:g}": tally.row() for idle, tally in by_idle.items()}}
                                        for name, by_idle in generated.items()}},
        "fixtures": {"sessions": [f"{s.client} {s.id}" for s in found],
                     "settings": {f"{idle:g}": fixtures[idle].row() for idle in MAX_IDLE}},
    }


def _usd(x: float) -> str:
    return f"{'-' if x < 0 else ''}${abs(x):,.2f}"


def report(r: dict) -> str:
    g = r["generated"]
    out = [f"{r['when']}, {r['machine']['cpu']} ({r['machine']['nproc']} cores), Python {r['machine']['python']}, "
           f"{r['seconds']} s" + (" (--quick)" if r["quick"] else "")]
    for name, distribution in g["distributions"].items():
        first = next(iter(distribution["settings"].values()))
        out.append(f"{name}: {g['sessions']} sessions, {first['requests']} requests ({g['turns'][0]}-{g['turns'][1]} "
                   f"a session), {first['long_gaps']} gaps over 5 min (7% of gaps {distribution['gaps'][-1][1] / 60:g}-"
                   f"{distribution['gaps'][-1][2] / 60:g} min); direct ${first['cost_direct']:,.2f}, via cg "
                   f"${first['cost_cg']:,.2f} ({first['ratio_cg']:.3f} of direct)")
    out += [f"fixtures: {', '.join(r['fixtures']['sessions'])}", ""]
    head = ("", "max idle", "pings", "after the end", "ping cost", "gaps bridged", "via cg + keep-alive",
            "of direct", "net saving", "of via cg")
    rows = [head]
    tables = [*g["distributions"].items(), ("fixtures", r["fixtures"])]
    for where, table in tables:
        for idle, s in table["settings"].items():
            rows.append((where, f"{float(idle) / 60:g} min", f"{s['pings']:,}", f"{s['trailing_pings']:,}",
                         f"${s['ping_cost']:,.2f}", f"{s['bridged']}/{s['long_gaps']}",
                         f"${s['cost_cg_keepalive']:,.2f}", f"{s['ratio_cg_keepalive']:.3f}",
                         _usd(s["net_saving"]), f"{s['net_saving_pct']:+.1f}%"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    for row in rows:
        out.append("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
    out += ["", f"budget {r['budget']} pings per idle period; a ping {r['margin_s']:g} s before the 5-minute lifetime "
            "ends. after the end: pings after a session's last request (the user gone). gaps bridged: gaps over "
            "5 min whose next request read the prefix instead of writing it. net saving: via cg without "
            "keep-alive minus via cg with it (pings included)."]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, __doc__, run, report, "3 short sessions: a smoke run (< 10 s)", sessions=SESSIONS)


if __name__ == "__main__":
    sys.exit(main())
