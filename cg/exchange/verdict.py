"""The cache verdict: why a turn wrote more to the provider's prompt cache than it read.

Pure. The request side (`cg.exchange.prepare.Preparation`) gathers `CacheFacts` as it prepares a
request; once its response is billed, `judge(facts, billed)` names one of the ledger's verdicts
(`cg.exchange.ledger.VERDICTS`) with a detail a person reads on the dashboard.

What the words mean, by the providers' rules (`cg.record.pricing.PromptCache` models them):

- A request's *prompt* is a sequence of elements in the order the provider caches it: the tools
  (one element: changing any tool invalidates everything), the system prompt (Anthropic's
  ``system``, the Responses API's ``instructions``), then each message or input item. Positions
  are counted in elements; element 0 is the tools, 1 the system prompt, 2 + i message i.
- *Wrote*: Anthropic bills cache writes (``cache_creation_input_tokens``); OpenAI caches every
  prefix of 1,024 tokens or more automatically and bills no write, so what it wrote is the prompt
  it did not read (its uncached input). *Read*: the cache reads. A turn *wrote more than it read*
  when wrote > read; only such a turn gets a verdict, but for KEPT_WARM (below).
- The *cached part* of a request: Anthropic caches the prefix up to its last ``cache_control``
  breakpoint (a top-level ``cache_control`` caches the whole prompt), so it ends with the element
  holding that breakpoint; OpenAI's is the whole prompt.
- Where a request *stops extending* its conversation's last one: the first element whose bytes
  differ (a ``cache_control`` breakpoint is not content: Claude Code moves its message breakpoint
  to the newest message every turn). A request that repeats every element of the last one and adds
  some stops at the last one's length.

The verdicts, first that applies:

- EXPECTED "first turn": cg has not seen the conversation before.
- EXPIRED: the previous request came longer ago than the cache's lifetime and nothing kept the
  cache alive since (the store's expiry, which keep-alive pings move on, had passed). A cold turn
  is where cg opens an epoch; changing the history's bytes then costs nothing more (the prompt is
  written anyway), so the verdict stays EXPIRED and the detail says so.
- CLIENT_PREFIX: the client's request stops extending its last one inside the last one's cached
  part; the detail names the element.
- CG_PREFIX: cg's forwarded body stops extending its last forwarded one inside the cached part
  though the client's does not: detail "epoch" when this turn applies another cache-aware epoch
  than the last one did (`cg.compaction.cold`: one another cg sharing the store opened while this
  cache was warm); anything else names the message, and is a bug.
- EXPECTED "new content only": the prefix held, so what was written is what this turn added (or,
  when nothing at all was read back, the provider kept nothing it could serve: detail says so).

No verdict where cg cannot tell: the conversation's last body is no longer in this cg's memo (a
restart, an evicted conversation, or another cg of a fleet served it), unless the store's expiry
alone shows the cache had expired.

KEPT_WARM: a keep-alive ping bridged a gap longer than the lifetime. Reported whether or not the
turn then wrote more than it read, so that a person sees the keep-alive pay. The store's expiry
moves with every use of the cache, an expand round's too: one late in a long turn that kept the
cache alive past the next request's arrival reads as KEPT_WARM.
"""

from __future__ import annotations

import bisect
import re

import attrs

from cg.exchange.ledger import CG_PREFIX, CLIENT_PREFIX, EXPECTED, EXPIRED, KEPT_WARM
from cg.stream.usage import Usage
from cg.wire.body import Earlier, ParsedBody
from cg.wire.cache import message_breakpoints
from cg.wire.dialect import Shape

TOOLS, SYSTEM = 0, 1  # the first two elements of a prompt; message i is element FIRST_MESSAGE + i
FIRST_MESSAGE = 2


@attrs.frozen
class CacheFacts:
    """What the request side knew of a request's prompt cache when it forwarded it."""

    now: float  # when the request arrived (Unix time)
    ttl: float  # how long the provider keeps what it caches, at the longest (cold.cache_ttl)
    explicit: bool  # Anthropic's breakpoints, writes billed; False: OpenAI's automatic prefixes
    seen: bool | None  # cg saw the conversation before (None: it cannot tell)
    last_request: float | None = None  # when its previous request arrived (None: unknown)
    expires: float | None = None  # the expiry recorded before this request: requests' and pings' (None: unknown)
    cached: int = 0  # elements of the last request's prompt in its cached part
    client_stop: int | None = None  # elements of the last request's prompt this one repeats (None: unknown)
    client_stop_at: str = ""  # the element there ("system", "messages[3]"; the first new one if it repeats all)
    cg_stop: int | None = None  # the same for the forwarded body against the last forwarded one (None: as the client's)
    cg_stop_at: str = ""
    epoch: bool = False  # this turn applies another cache-aware epoch than the last one did (cg.compaction.cold)


def wrote_and_read(facts: CacheFacts, billed: Usage) -> tuple[int, int]:
    """What the turn wrote to the cache and read from it (see the module docstring)."""
    wrote = billed.cache_write_tokens if facts.explicit else billed.input_tokens
    return wrote, billed.cache_read_tokens


def judge(facts: CacheFacts | None, billed: Usage | None) -> tuple[str | None, str]:
    """The turn's verdict and its detail; (None, "") when it needs none or cg cannot say."""
    if facts is None or billed is None:
        return None, ""
    wrote, read = wrote_and_read(facts, billed)
    idle = None if facts.last_request is None else facts.now - facts.last_request
    gap = idle is not None and idle > facts.ttl
    alive = facts.expires is not None and facts.expires >= facts.now
    if wrote <= read:
        if gap and alive and facts.seen:
            return KEPT_WARM, f"idle {duration(idle or 0.0)} > {duration(facts.ttl)}, read back"
        return None, ""
    if facts.seen is None:
        return None, ""
    if not facts.seen:
        return EXPECTED, "first turn"
    expired = facts.expires is not None and facts.now > facts.expires
    if expired or (gap and facts.expires is None):
        since = idle if idle is not None else facts.now - (facts.expires or facts.now) + facts.ttl
        detail = f"idle {duration(since)} > {duration(facts.ttl)}"
        rewrote = facts.epoch and facts.cg_stop is not None  # its bytes changed too: cost nothing more
        return EXPIRED, detail + "; cg re-decided the history then (epoch)" if rewrote else detail
    if facts.client_stop is None:  # the last body is not in this cg's memo: it cannot say more
        return None, ""
    if facts.client_stop < facts.cached:
        return CLIENT_PREFIX, facts.client_stop_at
    if facts.cg_stop is not None and facts.cg_stop < facts.cached:
        return CG_PREFIX, "epoch" if facts.epoch else facts.cg_stop_at
    if gap and alive:
        return KEPT_WARM, f"idle {duration(idle or 0.0)} > {duration(facts.ttl)}, new content only"
    return EXPECTED, "new content only" if read else "new content only; nothing read back"


def duration(seconds: float) -> str:
    """``7m12s``, ``45s``, ``1h02m``, ``5m``: how long, as a person reads it on the dashboard."""
    whole = max(0, round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m" if minutes else f"{hours}h"
    if minutes:
        return f"{minutes}m{secs:02d}s" if secs else f"{minutes}m"
    return f"{secs}s"


# ---------------------------------------------------------------------------------------------
# The facts a body gives: where it stops extending the conversation's last one, its cached part

# A breakpoint (not content: see above), found by its key and matched from there.
_CONTROL = b'"cache_control"'
_BREAKPOINT = re.compile(rb'"cache_control"\s*:\s*\{[^{}]*\}')
_SPACE = b" \t\r\n"


def element_name(ordinal: int, shape: Shape) -> str:
    """The element at `ordinal` of a prompt, as the request names it: "tools", "system", "messages[3]"."""
    if ordinal == TOOLS:
        return "tools"
    if ordinal == SYSTEM:
        return shape.select("system", "system", "instructions")
    return f"{shape.items}[{ordinal - FIRST_MESSAGE}]"


def stops_at(body: ParsedBody, previous: Earlier, shape: Shape) -> int:
    """How many elements of `previous`'s prompt `body` repeats before it first differs.

    O(what changed): the messages within the bytes both bodies share from their start
    (`ParsedBody.shared`) are the same, found by a binary search on their spans; only the tools,
    the system prompt and the messages past that prefix are compared (as bytes, at C speed).
    """
    for ordinal, key in ((TOOLS, "tools"), (SYSTEM, shape.select("system", "system", "instructions"))):
        if not _same(body, previous, (key,)):
            return ordinal
    key = shape.items
    new, old = _count(body.value.get(key)), _count(previous.value.get(key))
    spans = body.spans
    index = bisect.bisect_right(range(min(new, old)), body.shared, key=lambda i: spans[(key, i)][1])
    if index and previous.spans.get((key, index - 1)) != spans[(key, index - 1)]:
        index = 0  # another array made the earlier body's messages (a duplicate key): compare them all
    while index < min(new, old) and _same(body, previous, (key, index)):
        index += 1
    return FIRST_MESSAGE + index


def cached_part(body: ParsedBody, shape: Shape) -> int:
    """How many elements of `body`'s prompt the provider caches (see the module docstring)."""
    items = FIRST_MESSAGE + _count(body.value.get(shape.items))
    if not shape.select(True, False, False) or isinstance(body.value.get("cache_control"), dict):
        return items
    marks = message_breakpoints(body)
    for index in range(len(marks) - 1, -1, -1):
        if marks[index]:
            return FIRST_MESSAGE + index + 1
    for ordinal, key in ((SYSTEM, "system"), (TOOLS, "tools")):
        blocks = body.value.get(key)
        if isinstance(blocks, list) and any(isinstance(b, dict) and "cache_control" in b for b in blocks):
            return ordinal + 1
    return 0


# ParsedBody.carried: (when the request arrived, its cached part), for the conversation's next one.
_LAST = "verdict: the last request"


def remember(body: ParsedBody, now: float, shape: Shape, epoch: object) -> None:
    """`body` was forwarded at `now` under `epoch` (the cache-aware one it applied, or None): what
    its conversation's next request is judged against."""
    body.carried[_LAST] = (now, cached_part(body, shape), epoch, None)


def pass_on(body: ParsedBody, stop: int) -> None:
    """`body` was not a turn (count_tokens) and repeats `stop` elements of the body before it: the
    next request is judged against the last turn, so what it repeats of that one is carried on."""
    last = last_turn(body)
    if last is not None:
        arrived, cached, epoch, repeats = last
        body.carried[_LAST] = (arrived, cached, epoch, stop if repeats is None else min(stop, repeats))


def last_turn(body: ParsedBody) -> tuple[float, int, object, int | None] | None:
    """When the conversation's last turn arrived, its cached part, the epoch it applied, and how
    many of its elements the requests since repeat (None: there were none), if cg still holds its
    body."""
    last = body.earlier_carried.get(_LAST)
    if last is None:
        return None
    arrived, cached, epoch, repeats = last
    assert isinstance(arrived, float | int) and isinstance(cached, int) and isinstance(repeats, int | None)
    return float(arrived), cached, epoch, repeats


def _count(items: object) -> int:
    return len(items) if isinstance(items, list) else 0


def _same(body: ParsedBody, previous: Earlier, path: tuple[str | int, ...]) -> bool:
    """Whether the element at `path` has the same bytes in both bodies, but for breakpoints: within
    the bytes they share from their start or to their end at once; the message Claude Code moved its
    breakpoint off by what follows the breakpoint; else byte for byte."""
    new, old = body.spans.get(path), previous.spans.get(path)
    if new is None or old is None:
        return new is None and old is None
    if new == old and new[1] <= body.shared:
        return True
    shift = len(body.raw) - len(previous.raw)
    if new[0] >= len(body.raw) - body.suffix and old == (new[0] - shift, new[1] - shift):
        return True
    if new[0] == old[0] and _breakpoint_dropped(body, previous, new, old):
        return True
    mine, theirs = body.raw[new[0]:new[1]], previous.raw[old[0]:old[1]]
    if mine == theirs:
        return True
    return (_CONTROL in mine or _CONTROL in theirs) and _without_breakpoints(mine) == _without_breakpoints(theirs)


# Where the shared prefix of a block that lost its breakpoint ends: before the comma that joined
# it to the block's earlier keys, or (its first key) inside its name.
_DROPPED = re.compile(rb',\s*"cache_control"\s*:\s*\{[^{}]*\}|cache_control"\s*:\s*\{[^{}]*\}\s*,\s*"')


def _breakpoint_dropped(body: ParsedBody, previous: Earlier, new: tuple[int, int], old: tuple[int, int]) -> bool:
    """Whether the old element is the new one with one breakpoint more: the bytes both bodies
    share from their start reach a breakpoint there, and the rest after it is the same (a few
    bytes: the breakpoint closes the message's last block). No copy of the message itself."""
    at = body.shared
    if not new[0] <= at < new[1]:
        return False
    match = _DROPPED.match(previous.raw, at, old[1])
    if match is None:
        return False
    return previous.raw[match.end():old[1]] == body.raw[at:new[1]]


def _without_breakpoints(raw: bytes) -> bytes:
    """`raw` (JSON) without its ``cache_control`` keys, each with the comma that joins it to the
    other keys of its object: a search for the key (C speed), then a match at each one found."""
    pieces: list[bytes] = []
    position = 0
    at = raw.find(_CONTROL)
    while at >= 0:
        match = _BREAKPOINT.match(raw, at)
        if match is None:  # the key's name inside a string: content
            at = raw.find(_CONTROL, at + 1)
            continue
        start, end = at, match.end()
        before = start
        while before > position and raw[before - 1] in _SPACE:
            before -= 1
        if raw[before - 1:before] == b",":  # a later key: the comma before it goes
            start = before - 1
        else:  # the first key: the comma after it goes
            after = end
            while after < len(raw) and raw[after] in _SPACE:
                after += 1
            if raw[after:after + 1] == b",":
                end = after + 1
        pieces.append(raw[position:start])
        position = end
        at = raw.find(_CONTROL, end)
    pieces.append(raw[position:])
    return b"".join(pieces)
