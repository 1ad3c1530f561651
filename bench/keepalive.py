"""Cache keep-alive's net saving, measured: cg's rewrite replayed with and without ``--keepalive``
and priced with the provider's prompt cache (issue 13, §2; issue 25, §1: which rule pays).

    python bench/keepalive.py [--quick] [--json PATH] [--sessions N]

In-process and pure: no sockets, no store. The same sessions go through ``cg.record.replay.replay``
(what ``cg-estimate --keepalive`` runs) once per rule in RULES: the via-cg cost with keep-alive
(each ping priced as the conversation's last forwarded prompt read from the cache plus one output
token, pings after a session's last request going on as the rule lets them) against the via-cg
cost without it, from the same replay. The rules:

- bounds (cg before issue 25): ping every 4.5 min until 30 min idle or 10 pings;
- ski rental: ping until the pings spent in this idle period reach the re-write they would spare
  (1.15 / 0.1: 11 pings), with no idle bound below 4 h;
- forecast, prior only: ``cg.exchange.keepalive.Forecast`` without the conversation's own gaps;
- forecast: ``Forecast`` as cg runs it (its prior and the conversation's own long gaps);
- 1h, forecast and auto, forecast: with ``cg-estimate --cache-ttl 1h`` (every breakpoint of the
  forwarded prompt asks for an hour) and ``auto`` (an hour from the conversation's first expired
  cache on), pinged by the forecast with no idle bound below 4 h.

- generated sessions (bench/sessions.py's ``human_sessions``): Claude Code's envelope, paced as
  issue 25's 70 real sessions were (~100 requests each, breaks over 5 min in 54 of 70 sessions,
  2.8 in each of those, 118 of 151 under 30 min, the rest up to 4 h; the session ends after its
  last request);
- the transcripts in ``tests/fixtures/transcripts/`` (one headless Claude Code run of a few seconds,
  one Codex run), reported apart.

Per rule: pings sent, pings per break, wasted pings (after a session's last request, or in a gap
whose next request wrote the prefix anyway), what pings cost, breaks bridged (the next request read
the prefix), the cost via cg with keep-alive, and the net saving (what keep-alive spared minus what
its pings cost) as a share of the via-cg bill without it.
"""

from __future__ import annotations

import datetime
import sys
import time
from pathlib import Path

import attrs

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's cg, whatever is installed: it reads the checkout's fixtures too

from rewrite import bench_main, machine  # noqa: E402
from sessions import HumanPace, human_sessions  # noqa: E402

from cg.exchange.keepalive import MARGIN, Forecast, Policy  # noqa: E402
from cg.record import transcripts  # noqa: E402
from cg.record.replay import Sent, Turn, replay  # noqa: E402
from cg.wire.cache import TTL_5M  # noqa: E402

TRANSCRIPTS = REPO / "tests" / "fixtures" / "transcripts" / "home"
SESSIONS = 70  # as many as issue 25 measured
RULES = {  # name: (keep-alive's policy, cg-estimate's --cache-ttl)
    "bounds": (Policy(forecast=None), "keep"),
    "ski rental": (Policy(max_idle=4 * 3600.0, budget=11, forecast=None), "keep"),
    "forecast, prior only": (Policy(forecast=Forecast(learn=False)), "keep"),
    "forecast": (Policy(), "keep"),
    "1h, forecast": (Policy(max_idle=4 * 3600.0), "1h"),
    "auto, forecast": (Policy(max_idle=4 * 3600.0), "auto"),
}
# A bound on any rule choosing a lifetime per conversation: each session at the cheapest of these, in hindsight.
HINDSIGHT = ("forecast", "1h, forecast", "auto, forecast")
UNIFORM = ("bounds", "forecast")  # also run with the breaks uniform in their bands: how much the shape matters


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
    trailing_cost: float = 0.0  # what they cost
    wasted_pings: int = 0  # those, and pings in a gap whose next request wrote the prefix anyway

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
                bridged = turn.keepalive is not None and turn.keepalive.cache_write < turn.cg.cache_write
                self.bridged += bridged
                self.wasted_pings += 0 if bridged else previous.pings
        self.trailing_pings += turns[-1].pings if turns else 0
        self.trailing_cost += turns[-1].ping_cost if turns else 0.0
        self.wasted_pings += turns[-1].pings if turns else 0

    def row(self) -> dict:
        return {"sessions": self.sessions, "requests": self.requests, "cost_direct": round(self.direct, 4),
                "cost_cg": round(self.cg, 4), "cost_cg_keepalive": round(self.kept, 4), "pings": self.pings,
                "trailing_pings": self.trailing_pings, "wasted_pings": self.wasted_pings,
                "trailing_cost": round(self.trailing_cost, 4),
                "pings_per_break": round((self.pings - self.trailing_pings) / self.long_gaps, 2)
                if self.long_gaps else None,
                "ping_cost": round(self.ping_cost, 4),
                "long_gaps": self.long_gaps, "bridged": self.bridged,
                "net_saving": round(self.cg - self.kept, 4),
                "net_saving_pct": round(100 * (self.cg - self.kept) / self.cg, 2) if self.cg else None,
                "ratio_cg": round(self.cg / self.direct, 4) if self.direct else None,
                "ratio_cg_keepalive": round(self.kept / self.direct, 4) if self.direct else None}


def run(quick: bool, n_sessions: int) -> dict:
    started = time.monotonic()
    pace = HumanPace(requests=(12, 20)) if quick else HumanPace()
    generated = {rule: Tally() for rule in RULES}
    uniform = {rule: Tally() for rule in UNIFORM}
    fixtures = {rule: Tally() for rule in RULES}
    breaks = requests = 0
    hindsight = [0.0, 0.0]  # each session at its cheapest lifetime, known afterwards: without pings, with
    for session in human_sessions(n_sessions, pace=pace):
        sent = [Sent(r.time, r.path, r.body, r.output_tokens) for r in session.requests]
        requests += len(sent)
        breaks += sum(b.time - a.time > TTL_5M for a, b in zip(sent, sent[1:]))
        lifetimes: dict[str, tuple[float, float]] = {}  # this session's bill at each lifetime: (no pings, pings)
        for rule, (policy, ttl) in RULES.items():
            turns = replay(sent, conversation=session.id, keep_warm=policy, cache_ttl=ttl)
            generated[rule].add(turns)
            if rule in HINDSIGHT:
                lifetimes[rule] = (sum(t.cost_cg for t in turns), sum(t.cost_keepalive for t in turns))
        hindsight[0] += min(cost for cost, _ in lifetimes.values())
        hindsight[1] += min(kept for _, kept in lifetimes.values())
        print(f"  {session.id}: {len(sent)} requests, {time.monotonic() - started:.0f} s", file=sys.stderr)
    for session in human_sessions(n_sessions, pace=attrs.evolve(pace, log_uniform=False)):
        sent = [Sent(r.time, r.path, r.body, r.output_tokens) for r in session.requests]
        for rule in UNIFORM:
            policy, ttl = RULES[rule]
            uniform[rule].add(replay(sent, conversation=session.id, keep_warm=policy, cache_ttl=ttl))
        print(f"  {session.id}, breaks uniform: {time.monotonic() - started:.0f} s", file=sys.stderr)
    found = list(transcripts.read(transcripts.find(TRANSCRIPTS)))
    for session in found:
        sent = [Sent(r.time, r.path, r.body, r.output_tokens) for r in session.requests]
        for rule, (policy, ttl) in RULES.items():
            fixtures[rule].add(replay(sent, conversation=session.id, keep_warm=policy, cache_ttl=ttl))
    return {
        "when": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "quick": quick,
        "seconds": round(time.monotonic() - started, 1),
        "margin_s": MARGIN,
        "generated": {"sessions": n_sessions, "requests": requests, "breaks": breaks,
                      "hindsight": {"rules": list(HINDSIGHT), "cost_cg": round(hindsight[0], 4),
                                    "cost_cg_keepalive": round(hindsight[1], 4)},
                      "pace": attrs.asdict(pace),
                      "rules": {rule: tally.row() for rule, tally in generated.items()}},
        "uniform": {"rules": {rule: tally.row() for rule, tally in uniform.items()}},
        "fixtures": {"sessions": [f"{s.client} {s.id}" for s in found],
                     "rules": {rule: tally.row() for rule, tally in fixtures.items()}},
    }


def _usd(x: float) -> str:
    return f"{'-' if x < 0 else ''}${abs(x):,.2f}"


def report(r: dict) -> str:
    g = r["generated"]
    first = next(iter(g["rules"].values()))
    out = [f"{r['when']}, {r['machine']['cpu']} ({r['machine']['nproc']} cores), Python {r['machine']['python']}, "
           f"{r['seconds']} s" + (" (--quick)" if r["quick"] else ""),
           f"human-paced: {g['sessions']} sessions, {g['requests']:,} requests, {g['breaks']} breaks over 5 min; "
           f"direct ${first['cost_direct']:,.2f}, via cg ${first['cost_cg']:,.2f} ({first['ratio_cg']:.3f} of direct)",
           f"each session at its cheapest lifetime (keep, 1h, auto), in hindsight: via cg "
           f"${g['hindsight']['cost_cg']:,.2f} ({g['hindsight']['cost_cg'] / first['cost_direct']:.3f} of direct), "
           f"with the forecast's pings ${g['hindsight']['cost_cg_keepalive']:,.2f} "
           f"({g['hindsight']['cost_cg_keepalive'] / first['cost_direct']:.3f})",
           f"fixtures: {', '.join(r['fixtures']['sessions'])}", ""]
    head = ("", "rule", "via cg", "pings", "a break", "wasted", "after the end", "their cost", "ping cost",
            "breaks bridged",
            "via cg + keep-alive", "of direct", "net saving", "of via cg")
    rows = [head]
    for where, table in (("human-paced", g), ("breaks uniform", r["uniform"]), ("fixtures", r["fixtures"])):
        for rule, s in table["rules"].items():
            rows.append((where, rule, f"{s['ratio_cg']:.3f}", f"{s['pings']:,}", "-" if s["pings_per_break"] is None else f"{s['pings_per_break']:.1f}",
                         f"{s['wasted_pings']:,}", f"{s['trailing_pings']:,}", f"${s['trailing_cost']:,.2f}",
                         f"${s['ping_cost']:,.2f}",
                         f"{s['bridged']}/{s['long_gaps']}", f"${s['cost_cg_keepalive']:,.2f}",
                         f"{s['ratio_cg_keepalive']:.3f}", _usd(s["net_saving"]), f"{s['net_saving_pct']:+.1f}%"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    for row in rows:
        out.append("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
    out += ["", "via cg: of direct, without keep-alive, the breakpoints at the rule's lifetime (keep: the client's; "
            "1h: every breakpoint an hour; auto: an hour from the conversation's first expired cache on). "
            f"a ping {r['margin_s']:g} s before the lifetime ends. a break: pings per gap over 5 min (but those "
            "after the end). breaks uniform: the same sessions, their breaks uniform in 5-30 min and 30 min-4 h. "
            "wasted: pings after a session's last request (after the end) or in a gap whose next request "
            "wrote the prefix anyway. breaks bridged: gaps over 5 min whose next request read the prefix "
            "instead of writing it. net saving: via cg without keep-alive minus via cg with it (pings included)."]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, __doc__, run, report, "3 short sessions: a smoke run (< 10 s)", sessions=SESSIONS)


if __name__ == "__main__":
    sys.exit(main())
