"""The cache-aware policy, measured: generated sessions and the fixture transcripts replayed through
cg's rewrite with first-sight decisions only, and with the policy at each setting, priced with the
provider's prompt cache (issue 13, §2).

    python bench/cold.py [--quick] [--json PATH] [--sessions N]
    python bench/cold.py --transcripts PATH [--turns N,N] [--quick] [--json PATH]

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
for older results; ``views``: which file views are offloaded too, none, superseded ones or all of
them, cg.compaction.cold.VIEWS): cold requests, offloads
(first-sight and by an epoch), expected expand rounds, MB forwarded and the cost via cg and its
ratio to direct under the sweep's expand-rate rules (bench/sweep.py ``RULES``: *flat*, 0.1 rounds
per offload; *grows*, more as the threshold falls), each offload priced at the threshold that made
it. Replayed once at rate 1 and priced for every rule (the cost is linear in the rate).

With ``--transcripts PATH`` (a directory of Claude Code or Codex transcripts, as ``cg-estimate``
reads them), the same replay on those real sessions instead, calibrated to their recorded usage
as ``cg-estimate`` does, with a grid of the settings that decide ``views`` (first sight's
threshold). It measures the expand rate of the file views an epoch offloads rather than state it:
for each one, what the session did with that file after the cold request: nothing; read it again
showing other text (a fresh view, no expand); read it again showing the same text (dedup's pointer
to the offloaded view, or Claude Code's "File unchanged since last read" stub: an expand round);
edited or wrote it with no read in between (the model needs the old text: an expand round);
something else named it (a shell command, a search: none counted). Each epoch's offload is then
priced at the rate measured for its kind (a superseded view, another view, another result: the
rule's), beside the rules.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
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

from cg.compaction.cold import (  # noqa: E402
    FILE_TOOLS,
    VIEW_TOOLS,
    VIEWS,
    VIEWS_ALL,
    VIEWS_OFF,
    VIEWS_SUPERSEDED,
    ColdPolicy,
)
from cg.compaction.components import Offload  # noqa: E402
from cg.compaction.options import rewrite_config  # noqa: E402
from cg.compaction.repair import result_text  # noqa: E402
from cg.compaction.rewrite import RewriteConfig  # noqa: E402
from cg.record import transcripts  # noqa: E402
from cg.record.pricing import prices  # noqa: E402
from cg.record.replay import Sent, Turn, replay  # noqa: E402

RECENT = (1, 2, 4, 8)
MIN_TOKENS = (500, 1000, 2000)  # 2,000 is first sight's: only superseded views change
SESSIONS = 20
# The bound the policy must keep (stated before the run): expected expand rounds at most this much
# above first-sight's, under the *grows* rule, on both sets of generated sessions.
ROUNDS_BOUND = 0.25
SIDES = ("generated", "revisiting")

Setting = tuple[int, int, str] | None  # (recent_turns, min_tokens, views); None: first sight only


def settings(quick: bool) -> list[Setting]:
    """A lower threshold with superseded views or none; every view offloaded at first sight's own."""
    grid = [(2, 500, VIEWS_SUPERSEDED), (2, 1000, VIEWS_SUPERSEDED), (8, 1000, VIEWS_OFF),
            (2, 2000, VIEWS_ALL)] if quick else [
        (n, t, v) for n in RECENT for t in MIN_TOKENS for v in VIEWS
        if (v != VIEWS_OFF or t < 2000) and (v != VIEWS_ALL or t == 2000)]
    return [None, *grid]


def transcript_settings(quick: bool, turns: tuple[int, ...] | None = None) -> list[Setting]:
    """On real sessions, first sight's threshold (a lower one is out: above), the views it offloads,
    at these turns kept (default: 2, 4 and 8; 2 with ``quick``)."""
    recent = turns or ((2,) if quick else (2, 4, 8))
    return [None, *[(n, 2000, v) for n in recent for v in (VIEWS_SUPERSEDED, VIEWS_ALL)]]


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
        f"{policy['recent_turns']} / {policy['min_tokens']:,} / {policy['views']}")


def report(r: dict) -> str:
    g = r["generated"]
    out = [_when(r),
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


def _when(r: dict) -> str:
    """A run's first line: when, where, how long."""
    return (f"{r['when']}, {r['machine']['cpu']} ({r['machine']['nproc']} cores), Python {r['machine']['python']}, "
            f"{r['seconds']} s" + (" (--quick)" if r["quick"] else ""))


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


# What a session did with a file after an epoch offloaded a view of it (the module docstring), and
# whether that costs an expand round.
FOLLOW_UPS = {"nothing": False, "fresh read": False, "same read": True, "edit": True, "other": False}
UNCHANGED = "File unchanged since last read"  # Claude Code's answer to a read of a file it showed unchanged
KINDS = ("superseded view", "other view", "other result")


@attrs.define
class Calls:
    """A session's tool calls in the order its requests first hold them, and their results."""

    order: list[tuple[int, str, str, dict]] = attrs.Factory(list)  # (first request holding it, id, tool, input)
    by_id: dict[str, tuple[str, dict]] = attrs.Factory(dict)  # id -> (tool, input)
    results: dict[str, object] = attrs.Factory(dict)  # id -> its result's content, as first held

    def add(self, index: int, body: dict) -> None:
        for message in body.get("messages") or []:
            content = message.get("content") if isinstance(message, dict) else None
            for block in content if isinstance(content, list) else []:
                if not isinstance(block, dict):
                    continue
                if block.get("type") == "tool_use" and isinstance(block.get("id"), str) and block["id"] not in self.by_id:
                    tool_input = block.get("input") if isinstance(block.get("input"), dict) else {}
                    self.by_id[block["id"]] = (str(block.get("name")), tool_input)
                    self.order.append((index, block["id"], str(block.get("name")), tool_input))
                elif block.get("type") == "tool_result" and isinstance(block.get("tool_use_id"), str):
                    self.results.setdefault(block["tool_use_id"], block.get("content"))

    def follow_up(self, after: int, path: str, shown: object) -> str:
        """What the session did with ``path`` after request ``after`` (``shown``: the view offloaded)."""
        mentioned = False
        for index, call_id, tool, tool_input in self.order:
            if index <= after:
                continue
            if tool in FILE_TOOLS and tool_input.get("file_path") == path:
                if tool not in VIEW_TOOLS:
                    return "edit"
                result = self.results.get(call_id)
                return "same read" if result == shown or result_text(result).startswith(UNCHANGED) else "fresh read"
            mentioned = mentioned or path in json.dumps(tool_input, ensure_ascii=False)
        return "other" if mentioned else "nothing"


@attrs.define
class RealTally:
    """One setting's figures over real sessions; each epoch offload kept with its kind, what the
    session did next (views) and its expand cost at one round, so a measured rate prices it."""

    tally: Tally = attrs.Factory(Tally)
    offloads: list[tuple[int, str, str, float]] = attrs.Factory(list)  # (session, kind, follow-up, USD at rate 1)

    def measured(self) -> dict[str, float | None]:
        """Expand rounds per offload of each kind: the share that needed the old text (views); the
        flat rule's for other results."""
        rates: dict[str, float | None] = {}
        for kind in KINDS:
            found = [f for _, k, f, _ in self.offloads if k == kind]
            rates[kind] = (RULES["flat"](2000, 0, 0) if kind == "other result" else
                           sum(FOLLOW_UPS[f] for f in found) / len(found) if found else None)
        return rates

    def cost(self, rates: dict[str, float | None], first: float) -> float:
        return self.tally.cg + first * self.tally.first_expand + sum(
            (rates[kind] or 0.0) * usd for _, kind, _, usd in self.offloads)

    def rounds(self, rates: dict[str, float | None], first: float) -> float:
        return first * self.tally.first_offloads + sum((rates[kind] or 0.0) for _, kind, _, _ in self.offloads)


def run_transcripts(root: Path, quick: bool, turns: tuple[int, ...] | None = None) -> dict:
    """The grid on real sessions (``--transcripts``), with the measured expand rates."""
    grid = transcript_settings(quick, turns)
    configs = [config(s) for s in grid]
    tallies = [RealTally() for _ in grid]
    table = prices()
    started = time.monotonic()
    files = transcripts.find(root)
    n_sessions = unaligned = 0
    counted = transcripts.Tally()  # shared, as cg-estimate's: a response in more than one file counts once
    for client, path in files:
        for session in transcripts.read([(client, path)], transcripts.RECORDED, counted):
            sent = [Sent(r.time, r.path, r.body, r.output_tokens, r.billed) for r in session.requests]
            if not sent:
                continue
            index = n_sessions
            n_sessions += 1
            calls: Calls | None = None
            superseded: dict[int, set[str]] = {}  # recent_turns -> ids of the views its superseded epochs offloaded
            for setting, rewrite, real in zip(grid, configs, tallies):
                turns = replay(sent, rewrite, table, expand_rate=1.0, conversation=session.id)
                real.tally.add(turns)
                if setting is None or not any(t.cold_results for t in turns):
                    continue
                if len(turns) != len(sent):  # a request replay left out: the offloads cannot be placed
                    unaligned += 1
                    real.offloads += [(index, "other result", "", usd) for t in turns for _, _, usd in t.cold_results]
                    continue
                if calls is None:
                    calls = Calls()
                    for i, request in enumerate(sent):
                        calls.add(i, json.loads(request.body))
                for i, turn in enumerate(turns):
                    if not turn.cold_results:
                        continue
                    messages = json.loads(sent[i].body).get("messages") or []
                    for message_index, block_index, usd in turn.cold_results:
                        block = messages[message_index].get("content")[block_index] if block_index is not None else {}
                        call_id = block.get("tool_use_id") if isinstance(block, dict) else None
                        tool, tool_input = calls.by_id.get(call_id, ("", {})) if isinstance(call_id, str) else ("", {})
                        file_path = tool_input.get("file_path")
                        if tool not in VIEW_TOOLS or not isinstance(file_path, str):
                            real.offloads.append((index, "other result", "", usd))
                            continue
                        if setting[2] == VIEWS_SUPERSEDED:
                            superseded.setdefault(setting[0], set()).add(call_id)
                        kind = "superseded view" if call_id in superseded.get(setting[0], ()) else "other view"
                        real.offloads.append((index, kind, calls.follow_up(i, file_path, block.get("content")), usd))
            print(f"  {session.id[:8]}: {len(sent)} requests, {time.monotonic() - started:.0f} s", file=sys.stderr)
    first = RULES["flat"](2000, 0, 0)
    base = tallies[0]
    rows = []
    for setting, real in zip(grid, tallies):
        t, rates = real.tally, real.measured()
        rounds, cost = real.rounds(rates, first), real.cost(rates, first)
        rows.append({
            "policy": "off" if setting is None else dict(zip(("recent_turns", "min_tokens", "views"), setting)),
            "requests": t.requests, "cold_requests": t.cold, "cost_direct": round(t.direct, 2),
            "first_offloads": t.first_offloads, "cold_offloads": t.cold_offloads,
            "by_kind": {kind: sum(k == kind for _, k, _, _ in real.offloads) for kind in KINDS},
            "follow_ups": _follow_ups(real), "measured_rates": {k: None if r is None else round(r, 4)
                                                                for k, r in rates.items()},
            "rule": {"cost_cg": round(t.cg + first * (t.first_expand + t.cold_expand), 2),
                     "ratio": round((t.cg + first * (t.first_expand + t.cold_expand)) / t.direct, 4),
                     "expand_rounds": round(first * (t.first_offloads + t.cold_offloads), 1)},
            "measured": {"cost_cg": round(cost, 2), "ratio": round(cost / t.direct, 4),
                         "expand_rounds": round(rounds, 1),
                         "rounds_vs_off": round(rounds / base.rounds(base.measured(), first) - 1, 4),
                         "saving_vs_off": round(1 - cost / base.cost(base.measured(), first), 4)},
            "bytes_direct": t.bytes_direct, "bytes_cg": t.bytes_cg,
        })
        rule_off = rows[0]["rule"]["cost_cg"]
        rows[-1]["rule"]["saving_vs_off"] = round(1 - rows[-1]["rule"]["cost_cg"] / rule_off, 4)
    fit = [r for r in rows[1:] if r["measured"]["rounds_vs_off"] <= ROUNDS_BOUND
           and r["measured"]["saving_vs_off"] >= 0 and r["rule"]["saving_vs_off"] >= 0]
    return {
        "when": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": _commit(), "machine": machine(), "quick": quick,
        "seconds": round(time.monotonic() - started, 1),
        "transcripts": {"files": len(files), "conversations": n_sessions, "unaligned": unaligned},
        "rounds_bound": ROUNDS_BOUND, "settings": rows,
        "cheapest_within_bound": min(fit, key=lambda r: r["measured"]["cost_cg"])["policy"] if fit else None,
    }


def _follow_ups(real: RealTally) -> dict:
    """Per kind of view: what the sessions did next, and the share needing an expand round by
    session (sessions with at least one such offload): median and quartiles."""
    out: dict = {}
    for kind in KINDS[:2]:
        mine = [(session, f) for session, k, f, _ in real.offloads if k == kind]
        per: dict[int, list[bool]] = {}
        for session, f in mine:
            per.setdefault(session, []).append(FOLLOW_UPS[f])
        shares = sorted(sum(v) / len(v) for v in per.values())
        out[kind] = {"count": len(mine), **{f: sum(g == f for _, g in mine) for f in FOLLOW_UPS},
                     "sessions": len(shares),
                     "by_session": None if len(shares) < 2 else {
                         "p25": round(statistics.quantiles(shares, n=4)[0], 3),
                         "median": round(statistics.median(shares), 3),
                         "p75": round(statistics.quantiles(shares, n=4)[2], 3), "max": round(shares[-1], 3)}}
    return out


def report_transcripts(r: dict) -> str:
    t = r["transcripts"]
    off = r["settings"][0]
    out = [_when(r),
           f"real sessions: {t['files']} files, {t['conversations']} conversations, {off['requests']} requests; "
           f"direct ${off['cost_direct']:,.2f}", ""]
    head = ("recent / min tokens / views", "cold", "epoch offloads", "ratio", "rounds", "ratio", "rounds",
            "vs off", "saving")
    rows = [head, ("", "requests", "sup+view+other", "rule", "rule", "measured", "measured", "measured",
                   "measured")]
    for s in r["settings"]:
        k, m = s["by_kind"], s["measured"]
        rows.append((_name(s["policy"]), f"{s['cold_requests']}",
                     f"{k['superseded view']}+{k['other view']}+{k['other result']}", f"{s['rule']['ratio']:.4f}",
                     f"{s['rule']['expand_rounds']:.1f}", f"{m['ratio']:.4f}", f"{m['expand_rounds']:.1f}",
                     _pct(m["rounds_vs_off"]), _pct(m["saving_vs_off"])))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    out += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
            for row in rows]
    out.append("")
    for s in r["settings"][1:]:
        for kind, f in s["follow_ups"].items():
            if not f["count"]:
                continue
            spread = f["by_session"]
            out.append(f"{_name(s['policy'])}, {kind}: {f['count']} offloads in {f['sessions']} conversations; "
                       + ", ".join(f"{name} {f[name]}" for name in FOLLOW_UPS)
                       + f"; expand rate {s['measured_rates'][kind]:.3f}"
                       + ("" if spread is None else f" (by conversation: p25 {spread['p25']:.2f}, median "
                          f"{spread['median']:.2f}, p75 {spread['p75']:.2f}, max {spread['max']:.2f})"))
    out.append("")
    out.append(f"rule: 0.1 rounds per offload (flat and grows agree at 2,000 tokens); measured: each epoch's view "
               f"offload at its kind's measured rate (the bound: +{r['rounds_bound']:.0%} rounds against off).")
    out.append("cheapest measured, within the bound and no dearer than off either way: "
               + ("none" if r["cheapest_within_bound"] is None else _name(r["cheapest_within_bound"])))
    return "\n".join(out)


def _turns(text: str) -> tuple[int, ...]:
    try:
        turns = tuple(int(n) for n in text.split(","))
    except ValueError:
        turns = ()
    if not turns or min(turns) < 1:
        raise argparse.ArgumentTypeError(f"not turns to keep, such as 2,4,8: {text!r}")
    return turns


def main(argv: list[str] | None = None) -> int:
    """The generated sessions; or, with ``--transcripts PATH``, real ones."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--transcripts", type=Path, metavar="PATH")
    parser.add_argument("--turns", type=_turns, metavar="N,N", help="--transcripts: the turns kept to try")
    known, rest = parser.parse_known_args(argv)
    if known.transcripts is None:
        return bench_main(rest, __doc__, run, report, "3 short sessions, 5 settings: a smoke run", sessions=SESSIONS)
    if not known.transcripts.is_dir():
        print(f"--transcripts: not a directory: {known.transcripts}", file=sys.stderr)
        return 2
    return bench_main(rest, __doc__, lambda quick: run_transcripts(known.transcripts, quick, known.turns),
                      report_transcripts,
                      "2 turns kept only: 3 settings")


if __name__ == "__main__":
    sys.exit(main())
