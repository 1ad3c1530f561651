"""The cache-aware policy, measured: generated sessions and the fixture transcripts replayed through
cg's rewrite with first-sight decisions only, and with the policy at each setting, priced with the
provider's prompt cache (issue 13, §2).

    python bench/cold.py [--quick] [--json PATH] [--sessions N]

In-process and pure: no sockets, no store. ``cg.record.replay.replay`` (what ``cg-estimate`` runs)
simulates the policy on the requests' own times: a request that comes more than the cache lifetime
plus the policy's margin after the previous one is cold and makes an epoch, and every later request
applies it (cg.compaction.cold). The sessions:

- generated (bench/sessions.py, as bench/sweep.py runs them): Claude Code's envelope, 40 to 80
  requests each, idle gaps drawn from ``sessions.GAPS`` (7% past the 5-minute cache lifetime);
- the same sessions *revisiting* files: with ``sessions.REVISIT``, a Read or an Edit picks a file
  the session read before (as a coding session reads a file, edits it, reads it again), so a
  file view is superseded by a later call on the same file;
- the transcripts in ``tests/fixtures/transcripts/`` (one Claude Code, one Codex session), apart.

Per setting (``recent_turns``: model turns kept at first sight; ``min_tokens``: the offload threshold
for older results; ``views``: superseded file views offloaded too): cold requests, offloads
(first-sight and by an epoch), expected expand rounds, MB forwarded and the cost via cg and its
ratio to direct under the sweep's expand-rate rules (bench/sweep.py ``RULES``: *flat*, 0.1 rounds
per offload; *grows*, more as the threshold falls), each offload priced at the threshold that made
it. Replayed once at rate 1 and priced for every rule (the cost is linear in the rate).
"""

from __future__ import annotations

import datetime
import subprocess
import sys
import time
from pathlib import Path

import attrs

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rewrite import bench_main, machine  # noqa: E402
from sessions import GAPS, TURNS, generated_sessions  # noqa: E402
from sweep import RULES, TRANSCRIPTS  # noqa: E402

from cg.compaction.cold import ColdPolicy  # noqa: E402
from cg.compaction.components import Offload  # noqa: E402
from cg.compaction.options import rewrite_config  # noqa: E402
from cg.compaction.rewrite import RewriteConfig  # noqa: E402
from cg.record import transcripts  # noqa: E402
from cg.record.replay import Sent, Turn, replay  # noqa: E402

RECENT = (1, 2, 4, 8)
MIN_TOKENS = (500, 1000, 2000)  # 2,000 is first sight's: only superseded views change
SESSIONS = 20
# The bound the policy must keep (stated before the run): expected expand rounds at most this much
# above first-sight's, under the *grows* rule, on both sets of generated sessions.
ROUNDS_BOUND = 0.25
SIDES = ("generated", "revisiting")

Setting = tuple[int, int, bool] | None  # (recent_turns, min_tokens, views); None: first sight only


def settings(quick: bool) -> list[Setting]:
    grid = [(2, 500, True), (2, 1000, True), (8, 1000, False)] if quick else [
        (n, t, v) for n in RECENT for t in MIN_TOKENS for v in (False, True) if v or t < 2000]
    return [None, *grid]


def config(setting: Setting) -> RewriteConfig:
    base = rewrite_config(cold=False)
    if setting is None:
        return base
    recent, min_tokens, views = setting
    return attrs.evolve(base, cold=ColdPolicy(recent_turns=recent, offload_min_tokens=min_tokens, views=views))


@attrs.define
class Tally:
    """One setting's figures over a set of sessions; expand costs at one round per offload, split
    by the threshold that made the offload, so any rule prices them."""

    requests: int = 0
    cold: int = 0  # requests found cold that made an epoch
    direct: float = 0.0
    cg: float = 0.0  # via cg without expand rounds
    first_offloads: int = 0
    cold_offloads: int = 0
    first_expand: float = 0.0  # USD at rate 1
    cold_expand: float = 0.0
    bytes_direct: int = 0
    bytes_cg: int = 0

    def add(self, turns: list[Turn]) -> None:
        for t in turns:
            self.requests += 1
            self.cold += t.cold
            self.direct += t.cost_direct
            self.cg += t.price.cost(t.cg)
            self.first_offloads += t.offloads - t.cold_offloads
            self.cold_offloads += t.cold_offloads
            self.first_expand += t.expand_cost - t.cold_expand_cost
            self.cold_expand += t.cold_expand_cost
            self.bytes_direct += t.bytes_direct
            self.bytes_cg += t.bytes_cg

    def rates(self, rule: str, setting: Setting) -> tuple[float, float]:
        """(rate of first-sight offloads, rate of the epochs' offloads) under ``rule``."""
        offload = Offload()
        fn = RULES[rule]
        first = fn(offload.min_tokens, offload.head_lines, offload.tail_lines)
        if setting is None:
            return first, first
        return first, fn(min(setting[1], offload.min_tokens), offload.head_lines, offload.tail_lines)

    def rounds(self, rule: str, setting: Setting) -> float:
        first, later = self.rates(rule, setting)
        return first * self.first_offloads + later * self.cold_offloads

    def cost(self, rule: str, setting: Setting) -> float:
        first, later = self.rates(rule, setting)
        return self.cg + first * self.first_expand + later * self.cold_expand


def _sent(requests) -> list[Sent]:
    return [Sent(r.time, r.path, r.body, r.output_tokens) for r in requests]


def run(quick: bool, n_sessions: int) -> dict:
    grid = settings(quick)
    configs = [config(s) for s in grid]
    sides = {"generated": [Tally() for _ in grid], "revisiting": [Tally() for _ in grid],
             "fixtures": [Tally() for _ in grid]}
    started = time.monotonic()
    turns_range = (12, 20) if quick else TURNS
    gaps: list[float] = []
    n_requests = 0
    for side, revisit in (("generated", False), ("revisiting", True)):
        for session in generated_sessions(n_sessions, turns_range, revisit=revisit):
            sent = _sent(session.requests)
            if side == "generated":
                gaps += [b.time - a.time for a, b in zip(sent, sent[1:])]
                n_requests += len(sent)
            for tally, rewrite in zip(sides[side], configs):
                tally.add(replay(sent, rewrite, expand_rate=1.0, conversation=session.id))
            print(f"  {side} {session.id}: {len(sent)} requests, {time.monotonic() - started:.0f} s", file=sys.stderr)
    found = list(transcripts.read(transcripts.find(TRANSCRIPTS)))
    for session in found:
        for tally, rewrite in zip(sides["fixtures"], configs):
            tally.add(replay(_sent(session.requests), rewrite, expand_rate=1.0, conversation=session.id))
    rows = [_row(s, {side: tallies[i] for side, tallies in sides.items()}, {side: tallies[0] for side, tallies
                                                                              in sides.items()})
            for i, s in enumerate(grid)]
    return {
        "when": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": _commit(),
        "machine": machine(),
        "quick": quick,
        "seconds": round(time.monotonic() - started, 1),
        "generated": {"sessions": n_sessions, "requests": n_requests, "turns": list(turns_range),
                      "gaps": [list(g) for g in GAPS], "gaps_over_5m": sum(g > 300 for g in gaps)},
        "fixtures": [f"{s.client} {s.id}" for s in found],
        "rounds_bound": ROUNDS_BOUND,
        "settings": rows,
        "cheapest_within_bound": _cheapest(rows),
    }


def _commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def _cheapest(rows: list[dict]) -> dict | None:
    """The candidate for the default: within the bound on both sets of generated sessions, no
    dearer than first sight on either under either rule, and the cheapest under *grows* on the
    sessions that revisit files (None: no setting qualifies, and the policy stays off)."""
    fit = [r for r in rows[1:] if all(
        r[side]["grows"]["rounds_vs_off"] <= ROUNDS_BOUND and all(r[side][rule]["saving_vs_off"] >= 0
                                                                  for rule in RULES) for side in SIDES)]
    return min(fit, key=lambda r: r["revisiting"]["grows"]["cost_cg"])["policy"] if fit else None


def _row(setting: Setting, tallies: dict[str, Tally], first: dict[str, Tally]) -> dict:
    row: dict = {"policy": "off" if setting is None else dict(zip(("recent_turns", "min_tokens", "views"), setting))}
    for side, t in tallies.items():
        entry: dict = {"requests": t.requests, "cold_requests": t.cold, "cost_direct": round(t.direct, 4),
                       "cost_cg_no_expand": round(t.cg, 4), "first_offloads": t.first_offloads,
                       "cold_offloads": t.cold_offloads, "bytes_direct": t.bytes_direct, "bytes_cg": t.bytes_cg}
        for rule in RULES:
            rounds, base = t.rounds(rule, setting), first[side].rounds(rule, None)
            cost = t.cost(rule, setting)
            entry[rule] = {"expand_rounds": round(rounds, 2), "rounds_vs_off": round(rounds / base - 1, 4) if base else None,
                           "cost_cg": round(cost, 4), "ratio": round(cost / t.direct, 4) if t.direct else None,
                           "saving_vs_off": round(1 - cost / first[side].cost(rule, None), 4)}
        row[side] = entry
    return row


def _name(policy) -> str:
    return "off (first sight)" if policy == "off" else (
        f"{policy['recent_turns']} / {policy['min_tokens']:,} / {'yes' if policy['views'] else 'no'}")


def report(r: dict) -> str:
    g = r["generated"]
    out = [f"{r['when']}, {r['machine']['cpu']} ({r['machine']['nproc']} cores), Python {r['machine']['python']}, "
           f"{r['seconds']} s" + (" (--quick)" if r["quick"] else ""),
           f"generated: {g['sessions']} sessions ({g['turns'][0]}-{g['turns'][1]} requests each), {g['requests']} "
           f"requests, {g['gaps_over_5m']} gaps over 5 min; the same sessions revisiting files; fixtures: "
           + ", ".join(r["fixtures"]), ""]
    for side in ("generated", "revisiting", "fixtures"):
        off = r["settings"][0][side]
        out.append(f"{side}: direct ${off['cost_direct']:,.2f}, {off['bytes_direct'] / 1e6:,.1f} MB sent")
        head = ("recent / min tokens / views", "cold", "offloads", "MB fwd", "rounds", "ratio", "rounds", "vs off",
                "ratio", "saving")
        rows = [head, ("", "requests", "first+epochs", "", "flat", "flat", "grows", "grows", "grows", "grows")]
        for s in r["settings"]:
            e = s[side]
            fl, gr = e["flat"], e["grows"]
            rows.append((_name(s["policy"]), f"{e['cold_requests']}", f"{e['first_offloads']}+{e['cold_offloads']}",
                         f"{e['bytes_cg'] / 1e6:,.1f}", f"{fl['expand_rounds']:.1f}", f"{fl['ratio']:.4f}",
                         f"{gr['expand_rounds']:.1f}", _pct(gr["rounds_vs_off"]), f"{gr['ratio']:.4f}",
                         _pct(gr["saving_vs_off"])))
        widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
        out += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
                for row in rows]
        out.append("")
    out.append(f"rounds vs off: expected expand rounds against first-sight's (the bound: +{r['rounds_bound']:.0%}); "
               "saving: the cost via cg below first-sight's; ratio: cost via cg / direct.")
    out.append("cheapest under grows revisiting files, within the bound on both generated sets and no dearer than "
               "off under either rule: " + ("none" if r["cheapest_within_bound"] is None
                                             else _name(r["cheapest_within_bound"])))
    return "\n".join(out)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, __doc__, run, report, "3 short sessions, 3 settings: a smoke run", sessions=SESSIONS)


if __name__ == "__main__":
    sys.exit(main())
