"""What an Anthropic Messages request asks of the provider's prompt cache, and the smallest request
that reads back what it cached.

Anthropic caches a prompt only at its ``cache_control`` breakpoints, for 5 minutes unless a
breakpoint asks for ``"ttl": "1h"``, and refreshes an entry each time a request reads it. Claude
Code puts a breakpoint on its system prompt and one on the newest message. cg's keep-alive
(cg.exchange.keepalive) and cg-estimate's pricing (cg.record.replay) read breakpoints the same way
through this module.
"""

from __future__ import annotations

from collections.abc import Mapping

from cg.wire import jsonbytes
from cg.wire.body import ParsedBody

TTL_5M, TTL_1H = 300.0, 3600.0
"""The two lifetimes Anthropic's cache offers (seconds)."""

_PING_SPINE: jsonbytes.Spine = {"max_tokens": {}, "stream": {}}


def breakpoint_ttl(block: object) -> float | None:
    """The lifetime a block's ``cache_control`` breakpoint asks for; None when it has none."""
    if not isinstance(block, dict):
        return None
    control = block.get("cache_control")
    if not isinstance(control, dict):
        return None
    return TTL_1H if control.get("ttl") == "1h" else TTL_5M


def cache_lifetime(body: Mapping[str, object]) -> float | None:
    """How long what this request caches lives unread; None when it has no breakpoint.

    The shortest lifetime among its breakpoints: 1-hour entries must come before 5-minute ones, so
    a 5-minute breakpoint closes the longest cached prefix, the one the next turn reads.
    """
    shortest: float | None = None
    for blocks in _cacheable(body):
        for block in blocks:
            ttl = breakpoint_ttl(block)
            if ttl is not None and (shortest is None or ttl < shortest):
                shortest = ttl
                if ttl == TTL_5M:
                    return ttl
    return shortest


def asks_for_an_hour(body: Mapping[str, object]) -> bool:
    """Whether any breakpoint asks for the 1-hour lifetime (what the cache may keep at the longest).

    Walked in the parse (a few hundred blocks), not searched for in the bytes: one pass over a
    400 KB body is ~0.2 ms, and its quotes defeat the byte search's skips.
    """
    return any(breakpoint_ttl(block) == TTL_1H for blocks in _cacheable(body) for block in blocks)


def _cacheable(body: Mapping[str, object]) -> list[list[object]]:
    """The lists whose blocks may carry a breakpoint: the request itself (automatic caching: a
    top-level ``cache_control``), tools, system, each message's content, and the content of a
    tool result in it."""
    lists: list[list[object]] = [[body]]
    for key in ("tools", "system"):
        value = body.get(key)
        if isinstance(value, list):
            lists.append(value)
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            lists.append(content)
            lists += (block["content"] for block in content
                      if isinstance(block, dict) and isinstance(block.get("content"), list))
    return lists


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
