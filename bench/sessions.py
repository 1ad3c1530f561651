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

Deterministic: the same arguments give the same bytes and the same times.
"""

from __future__ import annotations

import json
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
                      seed: int = 13, kinds: dict[str, int] = KINDS, revisit: bool = False) -> Session:
    """Session ``index``: between ``turns[0]`` and ``turns[1]`` requests, each the history so far plus
    one new turn (``Content(index)``'s), ``cache_control`` on the newest block as Claude Code puts
    it, sent after an idle gap drawn from ``GAPS``. When the next turn would take the history past
    ``LIMIT`` bytes, the history starts again from the template's first turns (as a compaction or
    a new task would; the system prompt and tools stay, and so does their cached prefix). ``kinds``:
    the mix of turns (rewrite.KINDS; bench/sweep.py adds rewrite.MORE_KINDS). ``revisit``: see
    ``Content``."""
    template = template or Template()
    content = Content(index, kinds, revisit)
    rng = random.Random(seed * 1_000_003 + index)
    count = rng.randint(*turns)
    now = START + index * 86_400.0
    prefix, size, compactions = template.base, template.bytes, 0
    requests = []
    for j in range(count):
        if j:
            now += gap(rng)
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
