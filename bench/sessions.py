"""Claude Code-shaped conversations, generated: shared by bench/gateway.py and bench/sweep.py.

- ``Content``: conversation ``index``'s turns (an assistant message with its tool_use blocks and
  the user message with their results), from bench/rewrite.py's generators (Read results, pytest
  logs, git diffs, JSON, npm and pip logs, Grep, Edit, ...; with ``kinds``, rewrite.MORE_KINDS's
  listings and jest, go and cargo test runs too), serialized as Claude Code does.
- ``Template``: Claude Code's request around its ``messages`` list
  (``tests/fixtures/claude-code/p_second_request_tool_result.json``: its system prompt, its 24
  tools, its headers, its model), and ``marked``: a user message with the ``cache_control`` mark
  Claude Code puts on the newest block.
- ``generated_sessions``: whole sessions as a client sends them over time, each request the
  history so far plus one new turn, with idle gaps between requests (``GAPS``): the input of
  ``cg.record.replay.replay`` (bench/sweep.py, and bench/cold.py for issue 13's cache-aware
  policy, §2). With ``revisit``, Read and Edit turns often pick a file the session read before.
- ``human_sessions``: the same sessions paced as people use Claude Code (``HumanPace``), their
  breaks following issue 25's statistics of 70 real sessions: the input of bench/keepalive.py
  (keep-alive and ``--cache-ttl``).

Deterministic: the same arguments give the same bytes and the same times.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator

import attrs
from rewrite import FIXTURE, KINDS, Gen, calls_of, serialize, turn

LIMIT = 565_000  # a session's history stops growing before this many bytes
MARK = b',"cache_control":{"type":"ephemeral"}'
_DROP = {"host", "content-length", "connection", "accept-encoding", "x-claude-code-session-id"}
PATH = "/v1/messages"
START = 1_796_115_600.0  # 2026-12-01T09:00:00Z: the first request of session 0


# With ``revisit``: the share of Read and Edit turns that pick a file the session read before (a
# coding session reads a file, edits it, reads it again), rather than a new one.
REVISIT = 0.5


class Content:
    """Conversation ``index``'s turns, generated on first use and shared by every side: each turn
    (assistant message, user message) serialized as Claude Code serializes them.

    ``kinds``: the mix of turns (rewrite.KINDS; bench/sweep.py adds rewrite.MORE_KINDS).
    ``revisit``: Read and Edit turns pick, at ``REVISIT``, a file read earlier (an Edit changes its
    lines, and a later Read shows them). Without it, every file is new: the turns are those
    bench/sweep.py and bench/gateway.py measured, the same random draws.
    """

    def __init__(self, index: int, kinds: dict[str, int] = KINDS, revisit: bool = False):
        self.gen = Gen(1000 + index)
        self.turns: list[tuple[bytes, bytes]] = []
        self.kinds = list(kinds)
        self.weights = list(kinds.values())
        self.revisit = revisit
        self.files: dict[str, list[str]] = {}  # with revisit: path -> its lines, as last read or edited

    def turn(self, j: int) -> tuple[bytes, bytes]:
        while len(self.turns) <= j:
            kind = self.gen.rng.choices(self.kinds, weights=self.weights)[0]
            if self.revisit and kind in ("read", "edit") and self.files and self.gen.rng.random() < REVISIT:
                calls = self._again(kind, self.gen.rng.choice(sorted(self.files)))
            else:
                calls = calls_of(self.gen, kind, self.files if self.revisit else {})
            assistant, user = turn(self.gen, calls)
            self.turns.append((serialize(assistant), serialize(user)))
        return self.turns[j]

    def _again(self, kind: str, path: str) -> list[tuple[str, dict, object, bool]]:
        """A Read of a file read before, or an Edit of it (which replaces a few of its lines)."""
        gen, lines = self.gen, self.files[path]
        file_path = f"/home/dev/proj/{path}"
        if kind == "read":
            return [("Read", {"file_path": file_path}, gen.read_result(0, lines), False)]
        start = gen.rng.randrange(len(lines))
        old, new = lines[start:start + gen.rng.randint(1, 8)], gen.code_lines(gen.rng.randint(7, 18))[6:]
        self.files[path] = lines[:start] + new + lines[start + len(old):]
        return [("Edit", {"file_path": file_path, "old_string": "\n".join(old), "new_string": "\n".join(new)},
                 gen.edit_result(path), False)]


def marked(user: bytes) -> bytes:
    """The user message with ``cache_control`` on its last block (serialized, the key last)."""
    assert user.endswith(b"}]}")
    return user[:-3] + MARK + b"}]}"


class Template:
    """The fixture's request: the body around its ``messages`` list, and Claude Code's headers."""

    def __init__(self):
        doc = json.loads(FIXTURE.read_text())
        body = doc["body"]
        for message in body["messages"]:  # Claude Code marks only the newest message
            for block in message["content"] if isinstance(message["content"], list) else ():
                block.pop("cache_control", None)
        messages = body["messages"]
        body["messages"] = []
        head, tail = serialize(body).split(b'"messages":[]', 1)
        self.head = head + b'"messages":['
        self.tail = b"]" + tail
        self.base = serialize(messages)[1:-1]  # the fixture's own first turns, no brackets
        self.headers = "".join(f"{k}: {v}\r\n" for k, v in doc["headers"].items() if k.lower() not in _DROP)
        self.bytes = len(self.head) + len(self.base) + len(self.tail)
        self.model = str(doc["body"].get("model"))


# ---------------------------------------------------------------------------------------------
# Whole sessions, over time

# The idle gap before each request after a session's first: (share, low s, high s), uniform within
# a band. Most requests follow the previous response within seconds (the model's next step, a tool
# run); some after a minute or a few (a long test run, the user reading, typing the next prompt),
# still inside Anthropic's 5-minute cache lifetime; a few after a break longer than it (a meeting,
# lunch, a review), when the provider's cache has expired and the next request is written anew.
GAPS = ((0.75, 2.0, 45.0), (0.18, 60.0, 270.0), (0.07, 330.0, 1800.0))
TURNS = (40, 80)  # a session's requests, uniform in this range


# Human-paced sessions (issue 25: 70 real Claude Code sessions, 6,958 requests). How each figure
# maps to ``HumanPace``:
# - ~100 requests a session (6,958 / 70 = 99.4): ``requests`` uniform in 60-140, mean 100;
# - 54 of 70 sessions have at least one idle gap over 5 minutes: a session has breaks with
#   probability ``with_breaks`` = 54/70, and none otherwise;
# - 151 such gaps in those 54 sessions (2.8 each): a session with breaks has 1 + Poisson(151/54 - 1)
#   of them (mean 151/54), each before a request drawn at random among the session's (no two alike);
# - 118 of the 151 between 5 and 30 minutes, the rest longer: a break is 5-30 min with probability
#   118/151, log-uniform (a short break is likelier than a long one: the issue gives only the band),
#   else 30 min - 4 h, log-uniform (the issue does not bound it: an afternoon is the longest break
#   a session that goes on afterwards is given here);
# - every other gap is agent-paced or a prompt typed: ``GAPS``'s first two bands, rescaled (80%
#   2-45 s, 20% 1-4.5 min), all inside the 5-minute lifetime;
# - sessions end: after a session's last request there is none (what keep-alive spends then is lost).
HUMAN_REQUESTS = (60, 140)
WITH_BREAKS = 54 / 70
BREAKS_PER_SESSION = 151 / 54
SHORT_BREAKS = 118 / 151
SHORT_BREAK = (300.0, 1800.0)
LONG_BREAK = (1800.0, 4 * 3600.0)


@attrs.frozen
class HumanPace:
    """Idle gaps of a human-paced session, drawn from issue 25's statistics (see above)."""

    requests: tuple[int, int] = HUMAN_REQUESTS
    with_breaks: float = WITH_BREAKS
    breaks_per_session: float = BREAKS_PER_SESSION
    short_breaks: float = SHORT_BREAKS
    log_uniform: bool = True  # False: breaks uniform within their band (as many long ones as short)

    def gaps(self, rng: random.Random) -> list[float]:
        """The gaps before each request after the first (seconds): as many as requests, less one."""
        count = rng.randint(*self.requests)
        breaks = 0
        if rng.random() < self.with_breaks:
            breaks = min(count - 1, 1 + _poisson(rng, self.breaks_per_session - 1))
        where = set(rng.sample(range(count - 1), breaks))
        return [self._break(rng) if i in where else _agent_gap(rng) for i in range(count - 1)]

    def _break(self, rng: random.Random) -> float:
        low, high = SHORT_BREAK if rng.random() < self.short_breaks else LONG_BREAK
        return _log_uniform(rng, low, high) if self.log_uniform else rng.uniform(low, high)


def _agent_gap(rng: random.Random) -> float:
    """A gap inside the cache's lifetime: ``GAPS``'s first two bands, in their proportions."""
    (agent, low, high), (typed, typed_low, typed_high) = GAPS[:2]
    if rng.random() < agent / (agent + typed):
        return rng.uniform(low, high)
    return rng.uniform(typed_low, typed_high)


def _log_uniform(rng: random.Random, low: float, high: float) -> float:
    return math.exp(rng.uniform(math.log(low), math.log(high)))


def _poisson(rng: random.Random, mean: float) -> int:
    """A Poisson draw (Knuth's: the means here are small)."""
    limit, k, product = math.exp(-mean), 0, rng.random()
    while product > limit:
        k += 1
        product *= rng.random()
    return k


@attrs.frozen
class Request:
    """One request of a generated session (the fields of ``cg.record.replay.Sent``)."""

    time: float
    path: str
    body: bytes
    output_tokens: int


@attrs.frozen
class Session:
    id: str
    requests: tuple[Request, ...]
    compactions: int  # times the history passed LIMIT and started again from the template's
    turns: tuple[tuple[bytes, bytes], ...] = ()  # each request's new turn: (assistant, user) serialized


def gap(rng: random.Random) -> float:
    """One idle gap (seconds) drawn from ``GAPS``."""
    roll = rng.random()
    for share, low, high in GAPS:
        if roll < share:
            return rng.uniform(low, high)
        roll -= share
    return rng.uniform(GAPS[-1][1], GAPS[-1][2])


def _output_tokens(assistant: bytes) -> int:
    """What the response that wrote ``assistant`` billed as output, roughly: its JSON's size / 4."""
    return max(1, len(assistant) // 4)


def generated_session(index: int, template: Template | None = None, turns: tuple[int, int] = TURNS,
                      seed: int = 13, kinds: dict[str, int] = KINDS, revisit: bool = False,
                      pace: HumanPace | None = None) -> Session:
    """Session ``index``: between ``turns[0]`` and ``turns[1]`` requests, each the history so far plus
    one new turn (``Content(index)``'s), ``cache_control`` on the newest block as Claude Code puts
    it, sent after an idle gap drawn from ``GAPS``. When the next turn would take the history past
    ``LIMIT`` bytes, the history starts again from the template's first turns (as a compaction or
    a new task would; the system prompt and tools stay, and so does their cached prefix). ``kinds``:
    the mix of turns (rewrite.KINDS; bench/sweep.py adds rewrite.MORE_KINDS). ``revisit``: see
    ``Content``. With ``pace``, the number of requests and the gaps are ``pace``'s (``turns`` and
    ``GAPS`` unused)."""
    template = template or Template()
    content = Content(index, kinds, revisit)
    rng = random.Random(seed * 1_000_003 + index)
    paced = pace.gaps(rng) if pace is not None else None
    count = len(paced) + 1 if paced is not None else rng.randint(*turns)
    now = START + index * 86_400.0
    prefix, size, compactions = template.base, template.bytes, 0
    requests = []
    for j in range(count):
        if j:
            now += paced[j - 1] if paced is not None else gap(rng)
        a, u = content.turn(j)
        added = len(a) + len(u) + 2
        if size + added > LIMIT and prefix != template.base:
            prefix, size, compactions = template.base, template.bytes, compactions + 1
        body = b"".join((template.head, prefix, b",", a, b",", marked(u), template.tail))
        # The response to this request is the next turn's assistant message.
        requests.append(Request(now, PATH, body, _output_tokens(content.turn(j + 1)[0])))
        prefix = b",".join((prefix, a, u))
        size += added
    return Session(f"generated-{index:03d}", tuple(requests), compactions, tuple(content.turns[:count]))


def generated_sessions(count: int, turns: tuple[int, int] = TURNS, seed: int = 13,
                       kinds: dict[str, int] = KINDS, revisit: bool = False) -> Iterator[Session]:
    """Sessions 0 to ``count - 1`` (``generated_session``), one at a time: a session's bodies
    add up to tens of MB."""
    template = Template()
    for index in range(count):
        yield generated_session(index, template, turns, seed, kinds, revisit)


def human_sessions(count: int, seed: int = 13, pace: HumanPace = HumanPace()) -> Iterator[Session]:
    """Sessions 0 to ``count - 1`` paced as people use Claude Code (``HumanPace``), one at a time."""
    template = Template()
    for index in range(count):
        yield generated_session(index, template, seed=seed, pace=pace)
