"""Keep-alive on real sessions: what cg's keep-alive nets, keyed as twistd cg keys it, against the
best any ping rule could net, and a prior fitted to real gaps measured out of sample.

    python bench/realkeepalive.py SOURCE... [--pacing PATH...] [--json FILE]

SOURCE: a directory of Claude Code transcripts (what ``cg-estimate`` reads), each an independent
source: the prior fitted to real gaps is evaluated leave-one-source-out (fitted on the others'
gaps, measured on the one left out). ``--pacing PATH``: transcripts whose timing alone is used (no
Anthropic cache bill: another backend behind Claude Code), a further held-out check of the rules on
gaps alone. Prints aggregates only.

Per source, each conversation is replayed once through cg's rewrite (``cg.record.replay``, as
``cg-estimate`` does, calibrated to the recorded usage) and its session priced with keep-alive
under each rule (``keep_warm_session``: the session's conversations keyed by model, as twistd cg
keys them; "alone": every conversation on a keep-alive of its own, as cg-estimate priced it
before):

- alone: ``Forecast`` with issue 25's prior (``ISSUE_25``: cg's until this bench fitted one), every
  conversation keyed apart;
- forecast: the same rule, keyed by session and model;
- fitted: ``Forecast`` with a prior fitted (``fit``) to the other sources' idle periods;
- hindsight: ``Hindsight``, which knows when each idle period ends: the bound on any rule (no
  idle bound, no budget).

Net: what keep-alive spared minus what its pings cost, as a share of the via-cg bill without it,
over every conversation, the five-minute ones and the one-hour ones (by the lifetime their
breakpoints ask for). The gap-only check runs the scheduler on each key's request times alone and
counts, in units of a prefix, each bridged break's 1.15 spared against each ping's 0.1.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import attrs

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's cg, whatever is installed
sys.path.insert(0, str(REPO / "bench"))  # bench/ is not a package: its scripts import each other

from realsessions import ISSUE_25_PRIOR as ISSUE_25  # noqa: E402
from realsessions import PING_AGES, PING_STEP  # noqa: E402

from cg.compaction.options import rewrite_config  # noqa: E402
from cg.exchange import keepalive  # noqa: E402
from cg.exchange.keepalive import Band, Forecast, Policy  # noqa: E402
from cg.record import transcripts  # noqa: E402
from cg.record.replay import Forwarded, Hindsight, Sent, Turn, keep_warm_session, replay  # noqa: E402
from cg.wire.cache import READ_PRICE, TTL_1H, TTL_5M, WRITE_PRICE  # noqa: E402

FIRST_PING = PING_STEP  # an idle period the prior counts outlasted the first ping (4.5 min)
# The fitted prior's bands: one a ping step apart up to the 30-minute idle bound, then two wide ones.
EDGES = (*PING_AGES, 3600.0, 14_400.0, 86_400.0)
UNBOUNDED = {"max_idle": 86_400.0, "budget": 1000}
PACING_PREFIX = 20_000  # tokens a gap-only ping is taken to read (its output token's share of the price)


def rules(fitted: Forecast | None) -> dict[str, Policy]:
    out = {"forecast": Policy(forecast=ISSUE_25), "hindsight": Policy(**UNBOUNDED, forecast=Hindsight())}  # type: ignore[arg-type]
    if fitted is not None:
        out["fitted"] = Policy(forecast=fitted)
    return out


@attrs.define
class Tally:
    """One rule's figures over a set of conversations: via cg without and with keep-alive."""

    cg: float = 0.0
    kept: float = 0.0
    pings: int = 0
    ping_cost: float = 0.0
    sub_agent_pings: int = 0  # pings that re-sent a sub-agent's body

    def add(self, turns: list[Turn], sidechain: bool) -> None:
        self.cg += sum(t.cost_cg for t in turns)
        self.kept += sum(t.cost_keepalive for t in turns)
        self.pings += sum(t.pings for t in turns)
        self.ping_cost += sum(t.ping_cost for t in turns)
        self.sub_agent_pings += sum(t.pings for t in turns) if sidechain else 0

    def row(self) -> dict[str, object]:
        return {"cost_cg": round(self.cg, 2), "net": round(self.cg - self.kept, 2),
                "net_pct": round(100 * (self.cg - self.kept) / self.cg, 2) if self.cg else None,
                "pings": self.pings, "ping_cost": round(self.ping_cost, 2), "sub_agent_pings": self.sub_agent_pings}


@attrs.frozen
class Conversation:
    sidechain: bool
    turns: list[Turn]
    forwarded: list[Forwarded]

    @property
    def one_hour(self) -> bool:
        return any(f.lifetime == TTL_1H for f in self.forwarded)


def sessions(path: Path) -> Iterator[list[Conversation]]:
    """Each session under ``path``: its conversations replayed as cg-estimate replays them (the
    session's sub-agents' files read before it is yielded: every file is read first, bodies dropped)."""
    files = transcripts.find(path)
    config = rewrite_config()  # cg-estimate's defaults (the cold policy on)
    grouped: dict[str, list[Conversation]] = {}
    for session in transcripts.read(files, transcripts.RECORDED):
        forwarded: list[Forwarded] = []
        turns = replay([Sent(r.time, r.path, r.body, r.output_tokens, r.billed) for r in session.requests],
                       config, conversation=session.id, forwarded=forwarded)
        if turns:
            grouped.setdefault(session.session_id or session.id, []).append(
                Conversation(session.sidechain, turns, forwarded))
    yield from grouped.values()


def streams(session: list[Conversation]) -> Iterator[tuple[list[float], list[bool]]]:
    """Per model (a key of the session's keep-alive): its requests' times, and which were a sub-agent's."""
    by_model: dict[str | None, list[tuple[float, bool]]] = {}
    for conv in session:
        for f in conv.forwarded:
            by_model.setdefault(f.model, []).append((f.time, conv.sidechain))
    for requests in by_model.values():
        requests.sort()
        yield [t for t, _ in requests], [s for _, s in requests]


def idle_periods(times: Iterable[list[float]]) -> tuple[list[float], int]:
    """The idle periods that outlasted the first ping, and the ends (a key's last request)."""
    gaps, ends = [], 0
    for stream in times:
        gaps += [b - a for a, b in zip(stream, stream[1:]) if b - a > FIRST_PING]
        ends += 1
    return gaps, ends


def fit(gaps: list[float], ends: int) -> Forecast:
    """A prior from real idle periods: how many ended in each band of ``EDGES`` (log-uniform within),
    and the ends; counted as ``ISSUE_25`` is (worth ``PRIOR_WEIGHT`` idle periods)."""
    bands = tuple(Band(float(sum(1 for g in gaps if low < g <= high)), low, high)
                  for low, high in zip(EDGES, EDGES[1:]))
    longer = sum(1 for g in gaps if g > EDGES[-1])
    return Forecast(prior=tuple(b for b in bands if b.weight), prior_ends=float(ends + longer))


def gap_only(times: list[list[float]], rule: Policy) -> tuple[int, int]:
    """Pings sent and breaks bridged by ``rule`` on request times alone (a five-minute lifetime)."""
    pings = bridged = 0
    for stream in times:
        scheduler: keepalive.Scheduler[None] = keepalive.Scheduler(rule)
        hindsight = rule.forecast if isinstance(rule.forecast, Hindsight) else None
        for now, after in zip(stream, [*stream[1:], math.inf]):
            if hindsight is not None:
                hindsight.gap = after - now
            generation, commands = scheduler.sent("key", now, TTL_5M, None)
            assert generation is not None
            commands = scheduler.answered("key", generation, True)
            sent = now  # the last request, real or ping
            while commands and isinstance(commands[0], keepalive.Arm) and commands[0].at < after:
                sent = commands[0].at
                ping = scheduler.due("key", sent)
                if not ping or not isinstance(ping[0], keepalive.Ping):
                    break
                pings += 1
                commands = scheduler.pinged("key", ping[0].generation, True, PACING_PREFIX)
            bridged += after != math.inf and after - now > TTL_5M and after - sent <= TTL_5M
    return pings, bridged


def pacing_net(times: list[list[float]], rule: Policy) -> dict[str, object]:
    pings, bridged = gap_only(times, rule)
    spared = WRITE_PRICE[TTL_5M] - READ_PRICE
    return {"pings": pings, "bridged": bridged, "net_prefixes": round(bridged * spared - pings * READ_PRICE, 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sources", nargs="+", type=Path, metavar="SOURCE")
    parser.add_argument("--pacing", nargs="*", type=Path, default=[], metavar="PATH")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    for path in [*args.sources, *args.pacing]:
        if not path.is_dir():
            parser.error(f"not a directory: {path}")
    replayed = {path.name: list(sessions(path)) for path in args.sources}
    times = {name: [s for session in found for s, _ in streams(session)] for name, found in replayed.items()}
    out: dict[str, object] = {}
    totals: dict[str, dict[str, Tally]] = {}
    for name, found in replayed.items():
        others = [s for other, streams_ in times.items() if other != name for s in streams_]
        fitted = fit(*idle_periods(others)) if others else None
        policies = rules(fitted)
        tallies: dict[str, dict[str, Tally]] = {}
        breaks = sub_agent_breaks = ends = sub_agent_ends = 0
        for session in found:
            for stream, sidechain in streams(session):
                for (a, b), side in zip(zip(stream, stream[1:]), sidechain):
                    if b - a > FIRST_PING:
                        breaks += 1
                        sub_agent_breaks += side
                ends += 1
                sub_agent_ends += sidechain[-1]
            priced = {rule: keep_warm_session([(c.turns, c.forwarded) for c in session], policy)
                      for rule, policy in policies.items()}
            priced["alone"] = [keep_warm_session([(c.turns, c.forwarded)], Policy(forecast=ISSUE_25))[0] for c in session]
            for rule, turns_of in priced.items():
                for conv, turns in zip(session, turns_of):
                    kind = "one-hour" if conv.one_hour else "five-minute"
                    for group in ("all", kind):
                        tallies.setdefault(rule, {}).setdefault(group, Tally()).add(turns, conv.sidechain)
                        totals.setdefault(f"{rule}, {group}", {}).setdefault("t", Tally()).add(turns, conv.sidechain)
        out[name] = {
            "sessions": len(found), "keys": len(times[name]),
            "breaks_over_first_ping": breaks, "of_them_after_a_sub_agent": sub_agent_breaks,
            "key_ends": ends, "of_them_a_sub_agent": sub_agent_ends,
            "fitted_prior": None if fitted is None else {"bands": [[b.weight, b.low, b.high] for b in fitted.prior],
                                                         "ends": fitted.prior_ends},
            **{rule: {group: t.row() for group, t in groups.items()} for rule, groups in tallies.items()},
            "gap_only": {rule: pacing_net(times[name], policy) for rule, policy in policies.items()},
        }
    out["all sources"] = {key: t["t"].row() for key, t in totals.items()}
    every = [s for streams_ in times.values() for s in streams_]
    fitted_all = fit(*idle_periods(every))
    out["fitted on all sources"] = {"bands": [[b.weight, b.low, b.high] for b in fitted_all.prior],
                                    "ends": fitted_all.prior_ends}
    for path in args.pacing:
        paced = []
        for session in transcripts.read(transcripts.find(path)):
            paced.append((session.session_id or session.id, session))
        by_key: dict[tuple[str, str | None], list[float]] = {}
        for key, session in paced:
            for r in session.requests:
                by_key.setdefault((key, r.model), []).append(r.time)
        stream_times = [sorted(t) for t in by_key.values()]
        out[f"pacing {path.name}"] = {"keys": len(stream_times), **{
            rule: pacing_net(stream_times, policy) for rule, policy in rules(fitted_all).items()}}
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
