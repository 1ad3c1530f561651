"""The offload threshold and excerpt shape, measured: cg's rewrite replayed with each setting and
priced with the provider's prompt cache (issue 13, §3).

    python bench/sweep.py [--quick] [--json PATH] [--sessions N]

In-process and pure: no sockets, no store. For each ``--offload-min-tokens`` in THRESHOLDS, each
excerpt shape in SHAPES (the head and tail lines Offload keeps) and each excerpt in EXCERPTS
(``summary``: Offload as it is, with its summary of a diff's or a listing's elided part and a
test run's failures and totals; ``plain``: the same with those off, the excerpt before them:
head, tail and at most 20 error-like lines), the same sessions go through
``cg.record.replay.replay`` (what ``cg-estimate`` runs), cache-priced direct and via cg:

- generated sessions (bench/sessions.py): Claude Code's envelope (its system prompt, 24 tools,
  ``claude-opus-4-8``, priced as the table's latest ``claude-opus``), 40 to 80 requests each, every
  request the history plus one new turn from bench/rewrite.py's generators (``KINDS`` and
  ``MORE_KINDS``: listings, and test runs of pytest, jest, go and cargo with up to 20 failures),
  idle gaps between requests drawn from ``sessions.GAPS`` (75% 2-45 s, 18% 1-4.5 min, 7%
  5.5-30 min: past the 5-minute cache lifetime);
- the transcripts in ``tests/fixtures/transcripts/`` through cg-estimate's readers (one short
  Claude Code session priced as Opus, one Codex session priced as gpt-5), reported apart.

Per setting: results offloaded (for the first time), expected expand rounds, MB forwarded (the
bodies as cg would send them, summed over requests) against direct's, and the cost via cg and
its ratio to direct under two expand-rate rules (``RULES``): flat (replay's default, 0.1 per
offload whatever the setting) and grows (more expanding as the threshold falls and the excerpt
shrinks). Also the break-even rate: the expand rate at which this setting would cost what
the default does at 0.1. An expected round is priced by replay's rule (one more request at
the offload: the prompt so far read from the cache, the original as uncached input), so the
cost is linear in the rate: each setting is replayed once, at rate 1, and priced for every rule.

Neither rule sees what an excerpt shows, so each setting also counts the offloaded results whose
excerpt loses a *key fact* (``key_facts``: a test run's totals and failures, a diff's files, a
listing's main directories, an install's outcome, the exit code): the model must expand them,
or go on without. Summary against plain, at the same threshold and shape: what the summaries
cost without expand rounds, how many results they stop losing a key fact, and the expand rounds
they must avert to pay for themselves. Also the time Offload takes per MB of the results it
offloads (this machine's, in-process).
"""

from __future__ import annotations

import datetime
import json
import math
import re
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import attrs

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's cg, whatever is installed: it reads the checkout's fixtures too

from rewrite import KINDS as TURN_KINDS  # noqa: E402
from rewrite import MORE_KINDS, bench_main, machine  # noqa: E402
from sessions import GAPS, LIMIT, TURNS, generated_sessions  # noqa: E402

from cg.compaction import components  # noqa: E402
from cg.compaction.components import Context, JsonFormat, Offload, TextClean  # noqa: E402
from cg.compaction.options import rewrite_config  # noqa: E402
from cg.compaction.rewrite import RewriteConfig  # noqa: E402
from cg.record import transcripts  # noqa: E402
from cg.record.replay import DEFAULT_EXPAND_RATE, Sent, Turn, replay  # noqa: E402

TRANSCRIPTS = REPO / "tests" / "fixtures" / "transcripts" / "home"
THRESHOLDS = (500, 1000, 2000, 4000, 8000)
SHAPES = {"10/5": (10, 5), "20/10": (20, 10), "40/20": (40, 20), "80/40": (80, 40)}  # head/tail lines
EXCERPTS = ("plain", "summary")
DEFAULT = (Offload().min_tokens, f"{Offload().head_lines}/{Offload().tail_lines}", "summary")
SESSIONS = 20
MIX = {**TURN_KINDS, **MORE_KINDS}  # the generated sessions' turns


def flat(threshold: int, head: int, tail: int) -> float:
    """Replay's default: a tenth of offloaded results asked back, whatever the setting."""
    return DEFAULT_EXPAND_RATE


def grows(threshold: int, head: int, tail: int) -> float:
    """0.1 at 2,000 tokens and 40/20 lines (the default this sweep first measured), times
    sqrt(2000 / threshold) (a result offloaded at a lower threshold is a smaller one, more of it
    elided relative to what the model needs: 0.2 at 500, 0.05 at 8,000), times
    sqrt(60 / (head + tail)) (a smaller excerpt shows less: x2 at 10/5, x1.41 at 20/10, x0.71 at
    80/40); at most 1. It does not see the summary: a rule, not what a model does."""
    return min(1.0, DEFAULT_EXPAND_RATE * math.sqrt(2000 / threshold) * math.sqrt(60 / (head + tail)))


RULES = {"flat": flat, "grows": grows}

# What a model needs from an offloaded result to go on without expanding it (what failed, how
# many, where, which files), line by line: a test run's totals, failures and failure locations
# (pytest, jest, go test, cargo test), an install's outcome, the exit code.
KEY_LINE = re.compile(
    r"(?m)^(?:(?:=+ )?(?:\d+ [a-z]+, )*\d+ (?:passed|failed) .*in [\d.]+s.*|FAILED \S+.*|\S+:\d+: \w*(?:Error|Exception)"
    r"|Tests: .* total|Test Suites: .* total|FAIL[ \t]\S+.*|[ \t]*\u25cf .*|--- FAIL: .*|test result: .*|test \S+ \.\.\. FAILED"
    r"|added \d+ packages.*|Successfully installed .*|Exit code \d+)$"
)
KEY_KINDS = (("install", re.compile(r"^(?:added|Successfully)")), ("exit code", re.compile(r"^Exit code ")),
             ("test run", re.compile(r"")))
DIFF_FILE = re.compile(r"(?m)^diff --git a/(\S+) b/")
LISTED = re.compile(r"(?m)^(?:\./)?([\w.@-]+)/\S*$")  # a listed path under a directory: its top one
LS_R_BLOCK = re.compile(r"(?m)^\./([^/\n]+)[^\n]*:\n((?:.+\n?)*)")  # ls -R: a directory's header and entries


def tool_results(turns: tuple[tuple[bytes, bytes], ...]) -> list[tuple[str, str]]:
    """(tool name, text as textclean and jsonformat leave it: as Offload gets it) of each tool
    result in these turns."""
    out = []
    for assistant, user in turns:
        names = {b["id"]: b["name"] for b in json.loads(assistant)["content"] if b.get("type") == "tool_use"}
        for block in json.loads(user)["content"]:
            content = block.get("content")
            text = content if isinstance(content, str) else "\n".join(
                part.get("text", "") for part in content or [] if isinstance(part, dict))
            for lossless in (TextClean(), JsonFormat()):
                rewritten = lossless.apply(text, _context(None, text))
                text = rewritten.text if rewritten else text
            out.append((names.get(block.get("tool_use_id"), "?"), text))
    return out


def _context(tool: str | None, text: str) -> Context:
    return Context(tool, 0, 0, None, text.encode(), "0123456789abcdef", frozenset())


def key_facts(text: str) -> list[tuple[str, tuple[str, ...]]]:
    """(kind, what the excerpt must show, any one of them) for each key fact of a tool result:
    its key lines (``KEY_LINE``), a diff's file names, the top directories of a listing
    (``find``, ``git ls-files``, ``ls -R``) that hold a tenth of its lines or more."""
    facts = [(next(name for name, pattern in KEY_KINDS if pattern.match(line)), (line,))
             for line in KEY_LINE.findall(text)]
    facts += [("diff", (name,)) for name in DIFF_FILE.findall(text)]
    lines = text.count("\n") + 1
    tops: Counter[str] = Counter()
    if text.startswith(".:\n"):
        for top, entries in LS_R_BLOCK.findall(text):
            tops[top] += len(entries.splitlines())
    elif text.count(" ") * 10 < lines:
        tops.update(LISTED.findall(text))
        if tops.total() * 10 < lines * 9:
            tops.clear()  # not a listing
    facts += [("listing", (f"{top}/", f"./{top}:")) for top, n in tops.items() if n * 10 >= lines]
    return facts


@attrs.define
class Excerpts:
    """What the model sees of the results that hold key facts (``key_facts``), under one setting:
    how many there are, how many are offloaded, and how many of those lose a key fact (their
    excerpt lacks one: the model must expand, or go on without it), by the kind of fact lost. Also
    the time Offload takes on the results it offloads, and their size."""

    with_keys: int = 0
    offloaded: int = 0
    losing: int = 0
    lost_by_kind: dict[str, int] = attrs.Factory(dict)
    offload_seconds: float = 0.0
    offloaded_bytes: int = 0

    def add(self, results: list[tuple[str, str]], offload: Offload) -> None:
        for tool, text in results:
            started = time.perf_counter()
            outcome = offload.apply(text, _context(tool, text))
            if outcome is not None:
                self.offload_seconds += time.perf_counter() - started
                self.offloaded_bytes += len(text.encode())
            facts = key_facts(text)
            if not facts:
                continue
            self.with_keys += 1
            if outcome is None:
                continue
            self.offloaded += 1
            lost = {kind for kind, shown in facts
                    if not any(needle[: offload.max_line_chars] in outcome.text for needle in shown)}
            self.losing += bool(lost)
            for kind in lost:
                self.lost_by_kind[kind] = self.lost_by_kind.get(kind, 0) + 1


@contextmanager
def excerpt(kind: str) -> Iterator[None]:
    """Offload's excerpt as ``kind`` says: "summary" as it is, "plain" with no summary of a diff
    or a listing and no test-result lines (the excerpt before them), for the ``with`` block."""
    if kind == "summary":
        yield
        return
    with mock.patch.multiple(components, _diff_summary=lambda *args: None, _listing_summary=lambda *args: None,
                             _test_lines=lambda *args: ([], 0)):
        yield


def config(threshold: int, head: int, tail: int) -> RewriteConfig:
    """cg's rewrite as ``twistd cg --offload-min-tokens threshold`` runs it, with this excerpt."""
    base = rewrite_config(offload_min_tokens=threshold)
    return attrs.evolve(base, compact=attrs.evolve(base.compact, offload_head_lines=head, offload_tail_lines=tail))


def _offload(rewrite: RewriteConfig) -> Offload:
    (offload,) = (c for c in rewrite.compact.configured if isinstance(c, Offload))
    return offload


@attrs.define
class Tally:
    """One setting's figures over a set of sessions; the cost via cg split so any rate prices it."""

    requests: int = 0
    direct: float = 0.0  # USD, direct
    cg: float = 0.0  # USD via cg without expand rounds
    expand_at_1: float = 0.0  # USD the expand rounds cost at one round per offload
    offloads: int = 0
    bytes_direct: int = 0
    bytes_cg: int = 0
    input_direct: int = 0
    input_cg: int = 0

    def add(self, turns: list[Turn]) -> None:
        for t in turns:
            self.requests += 1
            self.direct += t.cost_direct
            self.cg += t.price.cost(t.cg)
            self.expand_at_1 += t.expand_cost
            self.offloads += t.offloads
            self.bytes_direct += t.bytes_direct
            self.bytes_cg += t.bytes_cg
            self.input_direct += t.direct.prompt
            self.input_cg += t.cg.prompt

    def cost(self, rate: float) -> float:
        return self.cg + rate * self.expand_at_1

    def ratio(self, rate: float) -> float:
        return self.cost(rate) / self.direct if self.direct else float("nan")


Key = tuple[int, str, str]  # (min tokens, head/tail shape, excerpt)


def settings(quick: bool) -> list[Key]:
    if quick:
        return [(t, s, e) for t in (1000, 2000, 4000) for s in ("20/10", "40/20") for e in EXCERPTS]
    return [(t, s, e) for t in THRESHOLDS for s in SHAPES for e in EXCERPTS]


def run(quick: bool, n_sessions: int) -> dict:
    grid = settings(quick)
    configs = {key: config(key[0], *SHAPES[key[1]]) for key in grid}
    generated = {key: Tally() for key in grid}
    fixtures = {key: Tally() for key in grid}
    excerpts = {key: Excerpts() for key in grid}
    started = time.monotonic()
    turns_range = (12, 20) if quick else TURNS
    gaps = []
    compactions = 0
    n_requests = 0
    for session in generated_sessions(n_sessions, turns_range, kinds=MIX):
        sent = [Sent(r.time, r.path, r.body, r.output_tokens) for r in session.requests]
        gaps += [b.time - a.time for a, b in zip(sent, sent[1:])]
        compactions += session.compactions
        n_requests += len(sent)
        results = tool_results(session.turns)
        for key in grid:
            with excerpt(key[2]):
                generated[key].add(replay(sent, configs[key], expand_rate=1.0, conversation=session.id))
                excerpts[key].add(results, _offload(configs[key]))
        print(f"  {session.id}: {len(sent)} requests, {time.monotonic() - started:.0f} s", file=sys.stderr)
    found = list(transcripts.read(transcripts.find(TRANSCRIPTS)))
    for session in found:
        sent = [Sent(r.time, r.path, r.body, r.output_tokens) for r in session.requests]
        for key in grid:
            with excerpt(key[2]):
                fixtures[key].add(replay(sent, configs[key], expand_rate=1.0, conversation=session.id))
    elapsed = time.monotonic() - started
    gaps.sort()
    base = generated.get(DEFAULT)
    return {
        "when": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "quick": quick,
        "seconds": round(elapsed, 1),
        "generated": {"sessions": n_sessions, "requests": n_requests, "turns": list(turns_range),
                      "gaps": [list(g) for g in GAPS], "history_limit_bytes": LIMIT, "compactions": compactions,
                      "gap_median_s": round(gaps[len(gaps) // 2], 1) if gaps else None,
                      "gaps_over_5m": sum(g > 300 for g in gaps), "mix": MIX},
        "fixtures": {"sessions": [f"{s.client} {s.id}" for s in found]},
        "default": list(DEFAULT),
        "rules": {name: {f"{t}|{s}": rule(t, *SHAPES[s]) for t, s, _ in grid} for name, rule in RULES.items()},
        "settings": [_row(key, generated[key], fixtures[key], excerpts[key], base) for key in grid],
    }


def _row(key: Key, g: Tally, f: Tally, e: Excerpts, base: Tally | None) -> dict:
    threshold, shape, kind = key
    row: dict = {"offload_min_tokens": threshold, "shape": shape, "excerpt": kind, "requests": g.requests,
                 "cost_direct": round(g.direct, 4), "cost_cg_no_expand": round(g.cg, 4),
                 "expand_cost_per_unit_rate": round(g.expand_at_1, 4), "offloads": g.offloads,
                 "bytes_direct": g.bytes_direct, "bytes_cg": g.bytes_cg,
                 "input_tokens_direct": g.input_direct, "input_tokens_cg": g.input_cg}
    for name, rule in RULES.items():
        rate = rule(threshold, *SHAPES[shape])
        row[name] = {"rate": round(rate, 4), "expand_rounds": round(rate * g.offloads, 1),
                     "cost_cg": round(g.cost(rate), 4), "ratio": round(g.ratio(rate), 4),
                     "fixtures_ratio": round(f.ratio(rate), 4)}
    if base is not None and g.expand_at_1:
        # the rate at which this setting costs what the default does at replay's default rate
        row["break_even_rate"] = round((base.cost(DEFAULT_EXPAND_RATE) - g.cg) / g.expand_at_1, 3)
    row["fixtures"] = {"cost_direct": round(f.direct, 4), "offloads": f.offloads}
    row["excerpts"] = attrs.asdict(e)
    return row


def _key(s: dict) -> Key:
    return (s["offload_min_tokens"], s["shape"], s["excerpt"])


def _rate(rate: float | None) -> str:
    if rate is None:
        return "-"
    return "never" if rate < 0 else f"{rate:.2f}"


def _kept(e: dict) -> str:
    """Offloaded results that lose a key fact, of those offloaded that hold some."""
    if not e["offloaded"]:
        return "-"
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(e["lost_by_kind"].items()))
    return f"{e['losing']}/{e['offloaded']}" + (f" ({kinds})" if kinds else "")


def _ms_per_mb(e: dict) -> float:
    return 1000 * e["offload_seconds"] / (e["offloaded_bytes"] / 1e6) if e["offloaded_bytes"] else float("nan")


def _table(rows: list[tuple[str, ...]], left: int) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
            for row in rows]


def comparison(r: dict) -> list[dict]:
    """Per threshold and shape, the summary excerpt against the plain one."""
    by_key = {_key(s): s for s in r["settings"]}
    out = []
    for (threshold, shape, kind), s in by_key.items():
        plain = by_key.get((threshold, shape, "plain"))
        if kind != "summary" or plain is None:
            continue
        extra = s["cost_cg_no_expand"] - plain["cost_cg_no_expand"]
        per_round = plain["expand_cost_per_unit_rate"] / plain["offloads"] if plain["offloads"] else float("nan")
        out.append({"offload_min_tokens": threshold, "shape": shape, "extra_cost_no_expand": round(extra, 4),
                    "extra_points_of_direct": round(100 * extra / s["cost_direct"], 3),
                    "offloads": [plain["offloads"], s["offloads"]],
                    "losing": [plain["excerpts"]["losing"], s["excerpts"]["losing"]],
                    "offloaded_with_keys": [plain["excerpts"]["offloaded"], s["excerpts"]["offloaded"]],
                    "rounds_to_avert": round(extra / per_round, 2),
                    "ms_per_mb": [round(_ms_per_mb(plain["excerpts"]), 1), round(_ms_per_mb(s["excerpts"]), 1)]})
    return out


def report(r: dict) -> str:
    g = r["generated"]
    first = r["settings"][0]
    out = [f"{r['when']}, {r['machine']['cpu']} ({r['machine']['nproc']} cores), Python {r['machine']['python']}, "
           f"{r['seconds']} s" + (" (--quick)" if r["quick"] else ""),
           f"generated: {g['sessions']} sessions, {g['requests']} requests ({g['turns'][0]}-{g['turns'][1]} a session), "
           f"median gap {g['gap_median_s']} s, {g['gaps_over_5m']} gaps over 5 min, {g['compactions']} histories "
           f"restarted at {g['history_limit_bytes']:,} bytes",
           f"fixtures: {', '.join(r['fixtures']['sessions'])}",
           f"direct: ${first['cost_direct']:,.2f} generated, ${first['fixtures']['cost_direct']:.4f} "
           f"fixtures; MB sent {first['bytes_direct'] / 1e6:,.1f}", ""]
    rows = [("min tokens", "head/tail", "excerpt", "offloads", "MB fwd", "rounds", "via cg", "ratio", "rate", "rounds",
             "via cg", "ratio", "break-even", "fixtures", "excerpts losing"),
            ("", "", "", "", "", "flat", "flat", "flat", "grows", "grows", "grows", "grows", "rate",
             "ratio flat/grows", "a key fact")]
    ranked = {name: sorted(r["settings"], key=lambda s, n=name: s[n]["cost_cg"]) for name in RULES}
    for s in r["settings"]:
        mark = " *" if list(_key(s)) == r["default"] else ""
        fl, gr = s["flat"], s["grows"]
        rows.append((f"{s['offload_min_tokens']:,}{mark}", s["shape"], s["excerpt"], f"{s['offloads']:,}",
                     f"{s['bytes_cg'] / 1e6:,.1f}", f"{fl['expand_rounds']:.1f}", f"${fl['cost_cg']:,.2f}",
                     f"{fl['ratio']:.3f} #{ranked['flat'].index(s) + 1}", f"{gr['rate']:.3f}",
                     f"{gr['expand_rounds']:.1f}", f"${gr['cost_cg']:,.2f}",
                     f"{gr['ratio']:.3f} #{ranked['grows'].index(s) + 1}",
                     _rate(s.get("break_even_rate")),
                     f"{fl['fixtures_ratio']:.3f}/{gr['fixtures_ratio']:.3f}", _kept(s["excerpts"])))
    out += _table(rows, 3)
    out += ["", "* the default. #n: the rank by cost via cg under that rule. flat: 0.1 expand rounds per offload; "
            "grows: 0.1 x sqrt(2000/min tokens) x sqrt(60/(head+tail)), at most 1. break-even rate: the expand rate "
            "at which the setting costs what the default does at 0.1 (never: dearer even with no expand round). "
            "excerpt: summary (a diff's files, a listing's directories, a test run's failures and totals) or plain "
            "(without them). excerpts losing a key fact: of the offloaded results that hold key facts (a test "
            "run's totals, failures and failure locations, a diff's files, a listing's main directories, an "
            "install's outcome, the exit code), those whose excerpt lacks one, by the kind of fact lost.", ""]
    rows = [("min tokens", "head/tail", "extra cost", "points", "offloads", "losing a key fact", "rounds to avert",
             "Offload ms/MB")]
    for c in comparison(r):
        rows.append((f"{c['offload_min_tokens']:,}", c["shape"], f"${c['extra_cost_no_expand']:,.3f}",
                     f"{c['extra_points_of_direct']:+.2f}", "{} -> {}".format(*c["offloads"]),
                     "{}/{} -> {}/{}".format(c["losing"][0], c["offloaded_with_keys"][0], c["losing"][1],
                                             c["offloaded_with_keys"][1]),
                     "none" if c["rounds_to_avert"] <= 0 else f"{c['rounds_to_avert']:.1f}",
                     "{} -> {}".format(*c["ms_per_mb"])))
    out += ["summary against plain excerpts, same threshold and shape:"] + _table(rows, 2)
    out += ["", "extra cost: what the summaries add via cg with no expand round (points: of the direct bill). "
            "rounds to avert: the expand rounds they must save to pay for that, at the plain excerpt's mean cost "
            "of a round (none: they cost less even if they save none). Offload ms/MB: Offload.apply's time per MB of the results it offloads (in-process)."]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, __doc__, run, report, "3 short sessions, 12 settings: a smoke run (< 1 min)", sessions=SESSIONS)


if __name__ == "__main__":
    sys.exit(main())
