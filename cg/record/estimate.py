"""``cg-estimate [PATH…]``: what cg would have saved on your own Claude Code and Codex sessions.

Reads the clients' local transcripts (cg.record.transcripts), rebuilds the requests each
session sent, replays them through cg's rewrite offline and prices them direct and via cg with
the provider's prompt-cache rules (cg.record.replay, cg.record.pricing). Nothing is sent
anywhere, nothing is stored.
"""

from __future__ import annotations

import argparse
import datetime
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import attrs
import ujson

from cg.compaction import options
from cg.exchange import keepalive
from cg.record import transcripts
from cg.record.pricing import Tokens, prices
from cg.record.replay import DEFAULT_EXPAND_RATE, Forwarded, Sent, Turn, keep_warm_session, replay
from cg.record.report import progress, text_table
from cg.wire.cache import CACHE_TTLS, TTL_5M

ASSUMPTIONS = (
    "Requests are rebuilt from the transcripts: the system prompt and tools (which transcripts do not "
    "hold) are the client's envelope as recorded for one version, fitted to the size of a session's first "
    "request as its transcript recorded it; see docs/how-to/estimate-savings.md.",
    "Tokens are cg's estimate, block by block, what a conversation adds after its first request scaled to "
    "the sizes its transcript recorded (calibrated; via cg alike); cache reads, writes and lifetimes are "
    "simulated from the transcript's own timestamps; each session has a cache of its own.",
    "Output tokens are the transcript's and the same both ways: cg does not change what the model writes. "
    "Where a transcript recorded only the count a response's first block began with (no line of it stopped, "
    "at most 10 tokens, its content over four times that), its output is cg's estimate of its content, in "
    "the recorded bill too.",
    "Requests a client does not write to its transcript (Claude Code's titles, summaries, /compact's own "
    "request) are in neither the simulated nor the recorded bill.",
    "Expected expand rounds = offloads x the expand rate; each is priced as one more request via cg.",
)
KEEPALIVE_ASSUMPTION = (
    "Keep-alive: cg's own scheduler run on the transcript's timestamps, keyed as cg keys it (a session and a model: "
    "a sub-agent on the session's model shares its timer); each ping is the last request read "
    "from the cache plus one output token; pings after a session's last request run on while its rule "
    "finds them worth their price, within the idle bound and the budget."
)


class Refusal(Exception):
    """Something to say in one line instead of a report."""


def parse_since(value: str, now: float | None = None) -> float:
    """``2026-11-30`` (a UTC date or ISO time) or ``7d``/``12h``/``30m``: epoch seconds."""
    found = re.fullmatch(r"(\d+)([dhm])", value.strip())
    if found:
        seconds = int(found[1]) * {"d": 86400, "h": 3600, "m": 60}[found[2]]
        return (time.time() if now is None else now) - seconds
    when = transcripts.parse_time(value if "T" in value else value + "T00:00:00Z")
    if when is None:
        raise argparse.ArgumentTypeError(f"not a date (2026-11-30) or a duration (7d, 12h): {value!r}")
    return when


def _arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="cg-estimate",
        description="What cg would have saved on your own Claude Code and Codex CLI sessions: their "
        "local transcripts replayed through cg's rewrite offline and priced direct and via cg with "
        "the provider's prompt-cache rules. Nothing is sent anywhere.",
    )
    parser.add_argument("paths", nargs="*", metavar="PATH",
                        help="a transcript file, or a directory holding them (a HOME, ~/.claude/projects, "
                        "~/.codex/sessions) [default: ~/.claude/projects and ~/.codex/sessions]")
    parser.add_argument("--since", type=parse_since, metavar="WHEN",
                        help="only sessions active since WHEN: a date (2026-11-30) or a duration (7d, 12h)")
    parser.add_argument("--project", metavar="TEXT", help="only sessions whose working directory contains TEXT")
    parser.add_argument("--json", action="store_true", help="print one JSON object (stable keys)")
    parser.add_argument("--plot", metavar="FILE", help="draw cumulative cost direct vs via cg over each session's "
                        "requests to FILE (.png or .svg; needs the plot extra: pip install 'cg[plot]')")
    parser.add_argument("--expand-rate", type=float, default=DEFAULT_EXPAND_RATE, metavar="R",
                        help="expected expand rounds per offloaded result [default: %(default)s]")
    parser.add_argument("--ttl", choices=(transcripts.RECORDED, "5m", "1h"), default=transcripts.RECORDED,
                        help="the cache lifetime Claude Code's breakpoints are taken to ask for; recorded: 1h for a "
                        "session whose transcript records one-hour cache writes, else 5m [default: %(default)s]")
    name, default, text = options.EXPAND
    parser.add_argument(f"--{name}", default=default, type=_checked(options.check_expand), help=text)
    name, default, text = options.COLD_POLICY
    parser.add_argument(f"--{name}", default=options.check_on_off(name, default),
                        type=_checked(lambda value: options.check_on_off(name, value)),
                        help=f"{text} Simulated on the transcript's own timestamps. [default: {default}]")
    for spec, convert in ((options.OFFLOAD_MIN_TOKENS, options.count), (options.KEEP_TOOLS, options.keep_tools)):
        parser.add_argument(f"--{spec[0]}", type=_checked(convert), default=spec[1],
                            help=f"{spec[2]} [default: %(default)s]")
    parser.add_argument("--disable", action="append", default=[], type=_checked(options.check_disable),
                        metavar="COMPONENT", help=options.DISABLE_HELP)
    parser.add_argument("--keepalive", action="store_true",
                        help="also price twistd cg --keepalive: " + keepalive.KEEPALIVE_HELP)
    parser.add_argument(f"--{keepalive.MAX_IDLE[0]}", type=float, default=keepalive.MAX_IDLE[1], metavar="SECONDS",
                        help=f"{keepalive.MAX_IDLE[2]} [default: %(default)s]")
    parser.add_argument(f"--{keepalive.BUDGET[0]}", type=int, default=keepalive.BUDGET[1], metavar="N",
                        help=f"{keepalive.BUDGET[2]} [default: %(default)s]")
    parser.add_argument("--calibrate", choices=("on", "off"), default="on",
                        help="on: what a conversation adds after its first request is sized to the prompt sizes its "
                        "transcript recorded, and a request whose recorded usage read less of the cache than the "
                        "simulation would (the client's own cache break) reads no more, direct and via cg; off: cg's "
                        "token estimate and the simulated cache alone (the JSON has both direct bills either way) "
                        "[default: %(default)s]")
    name, default, text = options.CACHE_TTL
    parser.add_argument(f"--{name}", choices=tuple(CACHE_TTLS), default=default,
                        help=f"price twistd cg --{name}: {text} [default: %(default)s]")
    return parser.parse_args(argv)


def _checked(check: Any) -> Any:
    def convert(value: str) -> Any:
        try:
            return check(value)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from error

    return convert


def _tokens(t: Tokens) -> dict[str, int]:
    return {"input": t.input, "cache_read": t.cache_read, "cache_write_5m": t.cache_write_5m,
            "cache_write_1h": t.cache_write_1h, "output": t.output}


def summarize(session: transcripts.Session, turns: list[Turn], keep_warm: bool = False) -> dict[str, Any]:
    direct = sum((t.direct for t in turns), Tokens())
    via = sum((t.cg for t in turns), Tokens())
    cost_direct = sum(t.cost_direct for t in turns)
    cost_cg = sum(t.cost_cg for t in turns)
    billed = [r.billed for r in session.requests if r.billed is not None]
    # replay prices a Turn per request (it drops only a body that does not parse, which a reader never builds)
    recorded = [(t, r.billed) for t, r in zip(turns, session.requests) if r.billed is not None]
    return {
        "client": session.client,
        "session": session.id,
        "file": session.file,
        "project": session.project,
        "started": session.started,
        "ended": session.ended,
        "requests": len(turns),
        "models": sorted({t.price.key for t in turns}),
        "input_tokens_direct": direct.prompt,
        "input_tokens_cg": via.prompt,
        "output_tokens": direct.output,
        "tokens_direct": _tokens(direct),
        "tokens_cg": _tokens(via),
        "cost_direct": round(cost_direct, 6),
        "cost_cg": round(cost_cg, 6),
        "ratio": round(cost_cg / cost_direct, 4) if cost_direct else None,
        "offloads": sum(t.offloads for t in turns),
        "cold_requests": sum(t.cold for t in turns),
        "cold_offloads": sum(t.cold_offloads for t in turns),
        "expand_rounds": round(sum(t.expand_rounds for t in turns), 2),
        "expand_cost": round(sum(t.expand_cost for t in turns), 6),
        "billed_by_transcript": _tokens(sum(billed, Tokens())) if billed else None,
        **_recorded(sum(t.cost_direct for t, _ in recorded), sum(t.price.cost(b) for t, b in recorded), len(recorded),
                    sum(t.cost_direct_raw for t, _ in recorded)),
        "prompt_tokens_recorded": sum(b.prompt for _, b in recorded),
        "prompt_tokens_simulated": sum(t.direct.prompt for t, _ in recorded),  # of those same requests
        "prompt_tokens_simulated_raw": sum(t.direct_raw.prompt for t, _ in recorded),
        "calibration": turns[0].scale,  # what the conversation's later segments were scaled by (1.0: not)
        "client_breaks": sum(t.client_break for t in turns),  # requests whose reads were capped at the recorded
        "shared_reads": sum(t.shared_read for t in turns),  # requests that read a prefix another conversation cached
        "unseen_tokens": session.requests[0].unseen,  # the envelope's size fitted to the recorded prompt
        "output_estimated": _output_estimated([r for r in session.requests if r.output_recorded is not None]),
        "sidechain": session.sidechain,
        "keepalive": _keepalive(turns, cost_cg, cost_direct) if keep_warm else None,
        "cumulative_direct": _cumulative(t.cost_direct for t in turns),
        "cumulative_cg": _cumulative(t.cost_cg for t in turns),
        "notes": list(session.notes),
    }


def _output_estimated(requests: list[transcripts.Request]) -> dict[str, int]:
    """The requests whose response's output is cg's estimate of its content (the recorded count was
    not final): how many, their output so estimated, and what their transcript recorded."""
    return {"requests": len(requests), "tokens": sum(r.output_tokens for r in requests),
            "recorded": sum(r.output_recorded or 0 for r in requests)}


def _recorded(simulated: float, recorded: float, requests: int, raw: float) -> dict[str, Any]:
    """The direct bill the transcripts recorded (their usage, priced with the same table) beside the
    simulated one, over the requests that recorded it: how far to trust the estimate; and the
    simulated one sized by cg's estimate alone (``raw``: before calibration)."""
    return {
        "recorded_requests": requests,
        "cost_direct_recorded": round(recorded, 6),
        "cost_direct_simulated": round(simulated, 6),  # of those same requests
        "simulated_vs_recorded": round(simulated / recorded, 4) if recorded else None,
        "cost_direct_simulated_raw": round(raw, 6),
        "simulated_vs_recorded_raw": round(raw / recorded, 4) if recorded else None,
    }


def _keepalive(turns: list[Turn], cost_cg: float, cost_direct: float) -> dict[str, Any]:
    """What keep-alive would have cost and saved on these requests (``Turn.cost_keepalive``), and
    where its pings went: after the last request (nobody came back), in the breaks over 5 minutes,
    and how many of those breaks they bridged (the next request read the prefix)."""
    cost = sum(t.cost_keepalive for t in turns)
    breaks = [(before, after) for before, after in zip(turns, turns[1:]) if after.time - before.time > TTL_5M]
    return {**_saving(sum(t.pings for t in turns), sum(t.ping_cost for t in turns), cost, cost_cg, cost_direct),
            "pings_after_end": turns[-1].pings if turns else 0,
            "ping_cost_after_end": round(turns[-1].ping_cost, 6) if turns else 0.0,
            "breaks": len(breaks), "pings_in_breaks": sum(before.pings for before, _ in breaks),
            "breaks_bridged": sum(after.keepalive is not None and after.keepalive.cache_write < after.cg.cache_write
                                  for _, after in breaks)}


_WHERE_PINGS_WENT = ("pings_after_end", "ping_cost_after_end", "breaks", "pings_in_breaks", "breaks_bridged")


def _saving(pings: int, ping_cost: float, cost: float, cost_cg: float, cost_direct: float) -> dict[str, Any]:
    return {
        "pings": pings,
        "ping_cost": round(ping_cost, 6),
        "cost_cg": round(cost, 6),  # via cg with keep-alive, pings included
        "net_saving": round(cost_cg - cost, 6),  # against via cg without keep-alive
        "net_saving_pct": round(100 * (cost_cg - cost) / cost_cg, 2) if cost_cg else None,
        "ratio": round(cost / cost_direct, 4) if cost_direct else None,
    }


def _cumulative(costs: Any) -> list[float]:
    out, total = [], 0.0
    for cost in costs:
        total += cost
        out.append(round(total, 6))
    return out


def estimate(args: argparse.Namespace, stderr: TextIO) -> dict[str, Any]:
    roots = [Path(p).expanduser() for p in args.paths] or [p for p in transcripts.default_dirs().values() if p.is_dir()]
    if not roots:
        dirs = " or ".join(str(p) for p in transcripts.default_dirs().values())
        raise Refusal(f"no transcripts: neither {dirs} exists (give a PATH)")
    files: list[tuple[str, Path]] = []
    for root in roots:
        if not root.exists():
            raise Refusal(f"no such file or directory: {root}")
        files += transcripts.find(root)
    config = options.rewrite_config(args.expand, args.offload_min_tokens, args.keep_tools, args.disable,
                                    args.cold_policy)
    keep_warm = keepalive.Policy(args.keepalive_max_idle, args.keepalive_budget) if args.keepalive else None
    table = prices()
    sessions: list[dict[str, Any]] = []
    notes: set[str] = set()
    unreadable: list[str] = []
    tally = transcripts.Tally()
    # With --keepalive, a session's conversations and what they forwarded: cg keys keep-alive by session
    by_session: dict[str, list[tuple[transcripts.Session, list[Turn], list[Forwarded]]]] = {}
    bar = progress(files, "transcript", stderr, quiet=args.json)
    for client, path in bar:
        bar.set_postfix_str(path.name, refresh=False)
        try:
            found = list(transcripts.read([(client, path)], None if args.ttl == "5m" else args.ttl, tally))
        except OSError as error:
            unreadable.append(f"{path}: {error.strerror or error}")
            continue
        for session in found:
            if args.project and args.project not in session.project:
                continue
            if args.since is not None and (session.ended or 0) < args.since:
                continue
            forwarded: list[Forwarded] | None = [] if keep_warm is not None else None
            turns = replay([Sent(r.time, r.path, r.body, r.output_tokens, r.billed)
                            for r in session.requests], config, table, args.expand_rate, session.id, None,
                           args.cache_ttl, args.calibrate == "on", forwarded)
            if not turns:
                continue
            notes.update(t.price.note for t in turns if t.price.note)
            if forwarded is None:
                sessions.append(summarize(session, turns))
            else:  # priced once every conversation of its session is read (sub-agents come in files of their own):
                # held till then without its bodies (each request's is the whole history so far)
                held = attrs.evolve(session, requests=tuple(attrs.evolve(r, body=b"") for r in session.requests))
                by_session.setdefault(session.session_id or session.id, []).append((held, turns, forwarded))
    if keep_warm is not None:
        for conversations in by_session.values():
            priced = keep_warm_session([(turns, forwarded) for _, turns, forwarded in conversations], keep_warm)
            sessions += [summarize(session, turns, True) for (session, _, _), turns in zip(conversations, priced)]
    if not sessions:
        where = ", ".join(str(r) for r in roots)
        what = "matching --since/--project " if args.since is not None or args.project else ""
        raise Refusal(f"no Claude Code or Codex session {what}with a request could be read under {where}")
    sessions.sort(key=lambda s: s["started"] or 0)
    cost_direct = sum(s["cost_direct"] for s in sessions)
    cost_cg = sum(s["cost_cg"] for s in sessions)
    total = {
        "sessions": len(sessions),
        "requests": sum(s["requests"] for s in sessions),
        "input_tokens_direct": sum(s["input_tokens_direct"] for s in sessions),
        "input_tokens_cg": sum(s["input_tokens_cg"] for s in sessions),
        "output_tokens": sum(s["output_tokens"] for s in sessions),
        "cost_direct": round(cost_direct, 6),
        "cost_cg": round(cost_cg, 6),
        "ratio": round(cost_cg / cost_direct, 4) if cost_direct else None,
        "offloads": sum(s["offloads"] for s in sessions),
        "cold_requests": sum(s["cold_requests"] for s in sessions),
        "cold_offloads": sum(s["cold_offloads"] for s in sessions),
        "expand_rounds": round(sum(s["expand_rounds"] for s in sessions), 2),
        **_recorded(sum(s["cost_direct_simulated"] for s in sessions), sum(s["cost_direct_recorded"] for s in sessions),
                    sum(s["recorded_requests"] for s in sessions), sum(s["cost_direct_simulated_raw"] for s in sessions)),
        "prompt_tokens_recorded": sum(s["prompt_tokens_recorded"] for s in sessions),
        "prompt_tokens_simulated": sum(s["prompt_tokens_simulated"] for s in sessions),
        "prompt_tokens_simulated_raw": sum(s["prompt_tokens_simulated_raw"] for s in sessions),
        "calibrated": sum(s["calibration"] != 1.0 for s in sessions),
        "client_breaks": sum(s["client_breaks"] for s in sessions),
        "shared_reads": sum(s["shared_reads"] for s in sessions),
        "envelopes_padded": sum(s["unseen_tokens"] > 0 for s in sessions),
        "envelopes_trimmed": sum(s["unseen_tokens"] < 0 for s in sessions),
        "sidechains": sum(s["sidechain"] for s in sessions),
        "output_estimated": {key: sum(s["output_estimated"][key] for s in sessions)
                             for key in ("requests", "tokens", "recorded")},
        "counted_once": tally.copies,  # responses met again in a later file (a resumed session's copy)
        "left_out": tally.untimed,  # responses with no timestamp to place them
        "keepalive": None,
    }
    if args.keepalive:
        kept = [s["keepalive"] for s in sessions]
        total["keepalive"] = {**_saving(sum(k["pings"] for k in kept), sum(k["ping_cost"] for k in kept),
                                        sum(k["cost_cg"] for k in kept), cost_cg, cost_direct),
                              **{key: sum(k[key] for k in kept) for key in _WHERE_PINGS_WENT},
                              "behind": sum(k["net_saving"] < 0 for k in kept)}  # sessions keep-alive cost more
        total["keepalive"]["ping_cost_after_end"] = round(total["keepalive"]["ping_cost_after_end"], 6)
    return {
        "sessions": sessions,
        "total": total,
        "config": {"expand": args.expand, "cold_policy": args.cold_policy, "offload_min_tokens": args.offload_min_tokens,
                   "keep_tools": list(args.keep_tools), "disable": list(args.disable),
                   "expand_rate": args.expand_rate, "ttl": args.ttl, "cache_ttl": args.cache_ttl,
                   "calibrate": args.calibrate,
                   "keepalive": {"max_idle": args.keepalive_max_idle, "budget": args.keepalive_budget}
                   if args.keepalive else None},
        "prices": {"sources": table.sources(), "notes": sorted(notes)},
        "unreadable": unreadable,
        "assumptions": [*ASSUMPTIONS, *((KEEPALIVE_ASSUMPTION,) if args.keepalive else ())],
    }


def _usd(x: float) -> str:
    return f"${x:,.2f}" if x >= 1 else f"${x:,.4f}"


def _kept(k: dict[str, Any]) -> tuple[str, str, str]:
    """Pings, their cost, and the net saving (negative: keep-alive cost more than it spared)."""
    net = k["net_saving"]
    pct = "" if k["net_saving_pct"] is None else f" ({k['net_saving_pct']:+.1f}%)"
    return f"{k['pings']:,}", _usd(k["ping_cost"]), ("-" if net < 0 else "") + _usd(abs(net)) + pct


def _shown(text: str) -> str:
    """A transcript's own text (an id, a directory's name) with what a terminal would act on escaped."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def _short(session: str) -> str:
    """A session's id, short: a side chain keeps what tells it from its session (``~2``, ``agent-``)."""
    head, sep, tail = session.partition("~")
    return head[:14] if head.startswith("agent-") else head[:8] + sep + tail


def _against(s: dict[str, Any]) -> tuple[str, str]:
    """The recorded direct bill and the simulated one's ratio to it (over the requests that recorded one)."""
    if not s["recorded_requests"]:
        return "-", "-"
    ratio = s["simulated_vs_recorded"]
    return _usd(s["cost_direct_recorded"]), "-" if ratio is None else f"{ratio:.3f}"


def _counted(t: dict[str, Any], sessions: list[dict[str, Any]]) -> list[str]:
    """What the table counts beyond the plain sessions, and what it still leaves out."""
    out = [f"recorded: the direct bill the transcripts' own usage records, priced alike; sim/rec: the simulated "
           f"direct bill over it ({t['recorded_requests']:,} of {t['requests']:,} request(s) recorded one)"]
    if t["recorded_requests"]:
        scales = sorted(s["calibration"] for s in sessions if s["calibration"] != 1.0)
        how = f", what {t['calibrated']} conversation(s) added scaled by x{scales[0]:.2f} to x{scales[-1]:.2f}" \
            if scales else ", none"
        raw = t["simulated_vs_recorded_raw"]
        out.append(f"calibrated: to the prompt sizes the transcripts recorded{how}; sim/rec by cg's token estimate "
                   f"alone: {'-' if raw is None else f'{raw:.3f}'}")
    if t["client_breaks"]:
        out.append(f"client cache breaks: {t['client_breaks']:,} request(s) whose recorded usage read less of the cache "
                   f"than the simulation would (a system prompt that changed, a cache lost): both sides read what "
                   f"the transcript records, the rest written")
    if t["shared_reads"]:
        out.append(f"shared cache: {t['shared_reads']:,} request(s) whose recorded usage read more of the cache than "
                   f"the simulation would (a prefix another conversation had cached: the envelope, a parent's prompt): "
                   f"both sides read what the transcript records")
    if t["envelopes_padded"] or t["envelopes_trimmed"]:
        out.append(f"fitted: the envelope to the first request's recorded prompt, {t['envelopes_padded']} session(s) "
                   f"padded (a CLAUDE.md, MCP tools, another version), {t['envelopes_trimmed']} with fewer tools")
    if t["sidechains"]:
        out.append(f"included: {t['sidechains']} sub-agent conversation(s) (side chains, agent-*.jsonl)")
    guessed = t["output_estimated"]
    if guessed["requests"]:
        out.append(f"output estimated: {guessed['requests']:,} response(s) whose transcript recorded only the count "
                   f"their first block began with ({guessed['recorded']:,} token(s) in all), priced at cg's estimate "
                   f"of their content, {guessed['tokens']:,} token(s), in every bill")
    if t["counted_once"]:
        out.append(f"counted once: {t['counted_once']:,} response(s) a resumed session's file copied from another")
    if t["left_out"]:
        out.append(f"left out: {t['left_out']:,} response(s) without a timestamp")
    k = t["keepalive"]
    if k is not None and k["pings"]:
        out.append(f"pings: {k['pings_after_end']:,} after a session's last request ({_usd(k['ping_cost_after_end'])}), "
                   f"{k['pings_in_breaks']:,} in {k['breaks']:,} break(s) over 5 min, {k['breaks_bridged']:,} of them "
                   f"bridged; {k['behind']} of {len(sessions)} session(s) cost more with keep-alive")
    return out


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")


def render(report: dict[str, Any]) -> str:
    kept = report["total"]["keepalive"] is not None
    rows: list[tuple[str, ...]] = [("client", "session", "started (UTC)", "project", "requests", "input tokens",
                                    "cost direct", "recorded", "sim/rec", "cost via cg", "ratio", "offloads",
                                    "expand rounds",
                                    *(("pings", "ping cost", "keep-alive net") if kept else ()))]
    for s in report["sessions"]:
        rows.append((s["client"], _shown(_short(s["session"])), _when(s["started"]), _shown(Path(s["project"]).name) or "-",
                     f"{s['requests']:,}", f"{s['input_tokens_direct']:,}", _usd(s["cost_direct"]), *_against(s),
                     _usd(s["cost_cg"]),
                     "-" if s["ratio"] is None else f"{s['ratio']:.3f}", f"{s['offloads']:,}",
                     f"{s['expand_rounds']:.1f}", *(_kept(s["keepalive"]) if kept else ())))
    t = report["total"]
    rows.append(("total", f"{t['sessions']} session(s)", "", "", f"{t['requests']:,}", f"{t['input_tokens_direct']:,}",
                 _usd(t["cost_direct"]), *_against(t), _usd(t["cost_cg"]),
                 "-" if t["ratio"] is None else f"{t['ratio']:.3f}",
                 f"{t['offloads']:,}", f"{t['expand_rounds']:.1f}", *(_kept(t["keepalive"]) if kept else ())))
    out = text_table(rows, "<<<<>>>>>>>>>" + (">>>" if kept else ""))
    out.insert(-1, "")
    out.append("")
    out += _counted(t, report["sessions"])
    for note in report["prices"]["notes"]:
        out.append(f"note: {_shown(note)}")
    for problem in report["unreadable"]:
        out.append(f"could not read {_shown(problem)}")
    out.append("prices: " + "; ".join(f"{k} {v}" for k, v in report["prices"]["sources"].items())
               + " (cg/record/prices.json)")
    out += [f"- {a}" for a in report["assumptions"]]
    return "\n".join(out) + "\n"


def entry() -> int:
    """The console script: exit quietly when the reader of a pipe goes away."""
    try:
        return main()
    except BrokenPipeError:
        return 1


def main(argv: Sequence[str] | None = None, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    args = _arguments(argv)
    try:
        keepalive.check_policy(args.keepalive_max_idle, args.keepalive_budget)
    except ValueError as error:
        print(f"cg-estimate: {error}", file=stderr)
        return 2
    if args.plot:
        from cg.record import plot

        if not plot.available():
            print(f"cg-estimate: --plot needs matplotlib: pip install 'cg[plot]' ({plot.HOW})", file=stderr)
            return 2
    try:
        report = estimate(args, stderr)
    except Refusal as refusal:
        print(f"cg-estimate: {refusal}", file=stderr)
        return 1
    if args.json:
        stdout.write(ujson.dumps(report, ensure_ascii=False, escape_forward_slashes=False, indent=2) + "\n")
    else:
        stdout.write(render(report))
    if args.plot:
        from cg.record import plot

        try:
            plot.draw(report, args.plot)
        except (OSError, ValueError) as error:
            print(f"cg-estimate: could not draw {args.plot}: {error}", file=stderr)
            return 1
        print(f"cg-estimate: drew {args.plot}", file=stderr)
    return 0
