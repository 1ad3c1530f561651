"""What an Anthropic Messages request asks of the provider's prompt cache, and the smallest request
that reads back what it cached.

Anthropic caches a prompt only at its ``cache_control`` breakpoints, for 5 minutes unless a
breakpoint asks for ``"ttl": "1h"``, and refreshes an entry each time a request reads it. Claude
Code puts a breakpoint on its system prompt and one on the newest message. cg's keep-alive
(cg.exchange.keepalive) and cg-estimate's pricing (cg.record.replay) read breakpoints the same way
through this module.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

from cg.wire import jsonbytes
from cg.wire.body import ParsedBody

TTL_5M, TTL_1H = 300.0, 3600.0
"""The two lifetimes Anthropic's cache offers (seconds)."""

CACHE_TTLS: Mapping[str, float | None] = {"keep": None, "5m": TTL_5M, "1h": TTL_1H, "auto": None}
"""``--cache-ttl``'s values: the lifetime cg's breakpoints ask for (None: the client's; ``auto``:
the client's until the conversation's cache first expires, then an hour)."""

READ_PRICE = 0.1
WRITE_PRICE = {TTL_5M: 1.25, TTL_1H: 2.0}
OUTPUT_PRICE = 5.0
"""What a cache read, a cache write for each lifetime, and an output token cost as multiples of
the input price (Anthropic's, for every current model)."""

_PING_SPINE: jsonbytes.Spine = {"max_tokens": {}, "stream": {}}


def breakpoint_ttl(block: object) -> float | None:
    """The lifetime a block's ``cache_control`` breakpoint asks for; None when it has none."""
    if not isinstance(block, dict):
        return None
    control = block.get("cache_control")
    if not isinstance(control, dict):
        return None
    return TTL_1H if control.get("ttl") == "1h" else TTL_5M


def cache_lifetime(body: ParsedBody) -> float | None:
    """How long what this request caches lives unread; None when it has no breakpoint.

    The shortest lifetime among its breakpoints: 1-hour entries must come before 5-minute ones, so
    a 5-minute breakpoint closes the longest cached prefix, the one the next turn reads.
    """
    messages = message_breakpoints(body)
    return _shortest([*(breakpoint_ttl(block) for blocks in _request_lists(body.value) for block in blocks),
                      *(ttl for message in messages for ttl in message)])


def asks_for_an_hour(body: ParsedBody) -> bool:
    """Whether any breakpoint asks for the 1-hour lifetime (what the cache may keep at the longest).

    Walked in the parse (a few hundred blocks), not searched for in the bytes: one pass over a
    400 KB body is ~0.2 ms, and its quotes defeat the byte search's skips. The messages a body
    shares with its conversation's last one are answered as they were then (carried), so a turn
    walks only the blocks of its new messages.
    """
    messages = message_breakpoints(body)
    return (any(breakpoint_ttl(block) == TTL_1H for blocks in _request_lists(body.value) for block in blocks)
            or any(TTL_1H in message for message in messages))


# ParsedBody.carried: each message's breakpoint lifetimes.
_BREAKPOINTS = "cache: the lifetimes a message's breakpoints ask for"
_NONE: frozenset[float] = frozenset()


def message_breakpoints(body: ParsedBody) -> list[frozenset[float]]:
    """The lifetimes each message's breakpoints ask for (`ParsedBody.per_message`: a turn looks
    only at its new messages). Asked on every turn, whatever else the request holds, so that the
    next turn finds every answer carried."""
    return body.per_message(_BREAKPOINTS, "messages", lambda message: frozenset(
        ttl for blocks in _message_lists(message) for block in blocks
        if (ttl := breakpoint_ttl(block)) is not None) or _NONE)


def _shortest(ttls: Iterable[float | None]) -> float | None:
    return min((ttl for ttl in ttls if ttl is not None), default=None)


def _request_lists(body: Mapping[str, object]) -> list[list[object]]:
    """The request itself (automatic caching: a top-level ``cache_control``), tools and system."""
    lists: list[list[object]] = [[body]]
    for key in ("tools", "system"):
        value = body.get(key)
        if isinstance(value, list):
            lists.append(value)
    return lists


def _message_lists(message: object) -> list[list[object]]:
    """A message's content, and the content of each tool result in it."""
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, list):
        return []
    return [content, *(block["content"] for block in content
                       if isinstance(block, dict) and isinstance(block.get("content"), list))]


_TTL_NAMES = {TTL_5M: "5m", TTL_1H: "1h"}
_CONTROL_SPINE: jsonbytes.Spine = {"cache_control": {"ttl": {}}}
_LIST_SPINE: jsonbytes.Spine = {jsonbytes.EACH: _CONTROL_SPINE}
_MESSAGE_SPINE: jsonbytes.Spine = {"content": {jsonbytes.EACH: {**_CONTROL_SPINE, "content": {
    jsonbytes.EACH: _CONTROL_SPINE}}}}


def lifetime_edits(body: ParsedBody, ttl: float) -> list[tuple[jsonbytes.Span, str]]:
    """The edits that make every ``cache_control`` breakpoint of a Messages request (the request's
    own, tools, system, messages and their tool results) ask for `ttl`: none for a breakpoint that
    already does, so a request asking for `ttl` throughout goes byte for byte.

    One lifetime for all keeps Anthropic's rules (at most four breakpoints: cg adds none; longer
    lifetimes before shorter ones). Only the ``ttl`` member is written (or added last): every other
    byte stays the client's.
    """
    edits: list[tuple[jsonbytes.Span, str]] = []

    def edit(block: object, spans: Mapping[jsonbytes.Path, jsonbytes.Span], path: jsonbytes.Path) -> None:
        asked = breakpoint_ttl(block)
        if asked is None or asked == ttl or path not in spans or not isinstance(block, dict):
            return
        name = json.dumps(_TTL_NAMES[ttl])
        ttl_path = path + ("ttl",)
        if ttl_path in spans:
            edits.append((spans[ttl_path], name))
        else:
            close = spans[path][1] - 1  # before the breakpoint's closing brace
            edits.append(((close, close), ("," if block["cache_control"] else "") + '"ttl":' + name))

    value = body.value
    if breakpoint_ttl(value) not in (None, ttl):  # automatic caching: rare, and a walk of the whole body
        edit(value, jsonbytes.spans_below(body.doc, 0, _CONTROL_SPINE), ("cache_control",))
    for key in ("tools", "system"):  # walked only where a block's breakpoint changes
        blocks = value.get(key)
        if (key,) in body.spans and isinstance(blocks, list) and any(
                breakpoint_ttl(block) not in (None, ttl) for block in blocks):
            spans = jsonbytes.spans_below(body.doc, body.spans[(key,)][0], _LIST_SPINE)
            for index, block in enumerate(blocks):
                edit(block, spans, (index, "cache_control"))
    messages = value.get("messages")
    for index, asked in enumerate(message_breakpoints(body)):
        if not asked or asked == {ttl} or not isinstance(messages, list):
            continue
        message = messages[index]
        content = message.get("content") if isinstance(message, dict) else None
        spans = jsonbytes.spans_below(body.doc, body.spans[("messages", index)][0], _MESSAGE_SPINE)
        for place, block in enumerate(content if isinstance(content, list) else []):
            edit(block, spans, ("content", place, "cache_control"))
            inner = block.get("content") if isinstance(block, dict) else None
            for part, nested in enumerate(inner if isinstance(inner, list) else []):
                edit(nested, spans, ("content", place, "content", part, "cache_control"))
    return edits


def ping_body(raw: bytes) -> bytes | None:
    """``raw`` with ``max_tokens`` 1 and ``stream`` false, every other byte as it was.

    Tools, system and messages (the cached prefix) are left byte for byte, so the request reads
    the cache its original wrote. None when ``raw`` is not a JSON object with a ``max_tokens``.
    """
    try:
        body = ParsedBody.load(raw, _PING_SPINE)
    except ValueError:
        return None
    if ("max_tokens",) not in body.spans:
        return None
    edits = [(body.spans[("max_tokens",)], "1")]
    if ("stream",) in body.spans:
        edits.append((body.spans[("stream",)], "false"))
    return body.apply(edits)
