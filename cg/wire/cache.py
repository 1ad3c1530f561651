"""What an Anthropic Messages request asks of the provider's prompt cache, and the smallest request
that reads back what it cached.

Anthropic caches a prompt only at its ``cache_control`` breakpoints, for 5 minutes unless a
breakpoint asks for ``"ttl": "1h"``, and refreshes an entry each time a request reads it. Claude
Code puts a breakpoint on its system prompt and one on the newest message. cg's keep-alive
(cg.exchange.keepalive) and cg-estimate's pricing (cg.record.replay) read breakpoints the same way
through this module.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from cg.wire import jsonbytes
from cg.wire.body import ParsedBody

TTL_5M, TTL_1H = 300.0, 3600.0
"""The two lifetimes Anthropic's cache offers (seconds)."""

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
