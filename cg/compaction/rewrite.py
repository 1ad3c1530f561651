"""The request side of cg: one parse of the body, then repair, compact and inject, then one splice.

Pure: bytes in, bytes out. Lossy compaction runs exactly where the expand tool is
injected (the model can ask for the original back); elsewhere only the reformat
components run. Anything unexpected forwards the client's bytes unchanged.
"""

import hashlib
import json
import re
from collections.abc import Mapping

import attrs

from cg.compaction import expand
from cg.compaction.cold import ColdPolicy
from cg.compaction.pipeline import Change, CompactConfig, Memo, Older, forwarded, plan
from cg.compaction.repair import Repair, find_repairs, repair_edits
from cg.wire import jsonbytes
from cg.wire.body import Earlier, ParsedBody
from cg.wire.cache import lifetime_edits
from cg.wire.dialect import CHAT_SHAPE, MESSAGES_SHAPE, RESPONSES_SHAPE, Shape, split_path

# Paths whose bodies cg rewrites, their body shape, and whether what it stashes there matters
# (count_tokens is read-only: it sizes the request cg would send, nothing more). The shape is not
# the route: /v1/responses routes as OPENAI (cg.wire.dialect) but carries `input` items.
_PATHS = {
    b"/v1/messages": (MESSAGES_SHAPE, True),
    b"/v1/messages/count_tokens": (MESSAGES_SHAPE, False),
    b"/v1/chat/completions": (CHAT_SHAPE, True),
    b"/v1/responses": (RESPONSES_SHAPE, True),
}


# A request's model, as clients put it: near the start of the body.
_MODEL = re.compile(rb'"model"\s*:\s*"([^"\\]{1,200})"')
_MODEL_WITHIN = 4096

# A conversation without a session header (an SDK client's) goes by how its messages open: an
# agent's history grows at its end, so these bytes stay the same from turn to turn.
_MESSAGES_OPEN = re.compile(rb'"(?:messages|input)"\s*:\s*\[')
_OPENING_BYTES = 512
_OPENING_WINDOW = 1 << 16
_INSTRUCTIONS = ("system", "developer")  # roles of the messages an app's chats all open with
_ITEM_GAP = re.compile(r"\s*,?\s*")

# What a streamed chat request without stream_options gets, so the inspector can sum the rounds'
# usage: the same bytes at the same place (the body's end) on every turn.
_USAGE_OPTION = '"stream_options":{"include_usage":true}'


@attrs.frozen
class RewriteConfig:
    compact: CompactConfig = attrs.Factory(CompactConfig)
    expand: bool = True
    cold: ColdPolicy | None = None  # the cache-aware policy (cg.compaction.cold); None: first sight only


@attrs.frozen
class Rewrite:
    """What to forward. `originals` must be stored before `body` is sent."""

    body: bytes
    originals: Mapping[str, bytes]
    changes: list[Change]
    injected: bool
    stash: bool
    parsed: dict[str, object]  # the body as parsed (session keys, later stages)
    runs: dict[str, int] = attrs.Factory(dict)  # component -> tool results it ran on
    reverted: dict[str, int] = attrs.Factory(dict)  # component -> rewrites the contract undid
    repaired: int = 0  # client answers to expand calls replaced by what cg would have answered
    dialect: Shape = MESSAGES_SHAPE  # the body's shape (the path's), which the response shares
    usage_added: bool = False  # cg set stream_options.include_usage: the client did not ask for usage
    moved: int | None = None  # the first message shared with the last body whose edits changed (Plan.moved)
    lifetime: float | None = None  # what every breakpoint asks for now (--cache-ttl); None: the client's


@attrs.frozen
class Incoming:
    """A request body parsed, with what the rewrite needs to know before it can finish.

    `repairs` are expand calls the client answered with an error; their texts come from the
    store (frozen per tool_use_id), so the caller looks them up and passes them to `finish`.
    `previous` is the conversation's last body, which this one was parsed against (None: none
    kept), for the cache verdict's facts (cg.exchange.verdict).
    """

    body: ParsedBody
    dialect: Shape  # the body's shape: the adapter to its dialect
    stash: bool
    injection: list[tuple[jsonbytes.Span, str]] | None
    repairs: list[Repair]
    usage_added: bool = False  # the injection also sets stream_options.include_usage
    previous: Earlier | None = attrs.field(default=None, eq=False, repr=False)


class Rewriter:
    """Rewrites request bodies with a memo shared across requests (a re-sent history is cheap)."""

    def __init__(self, config: RewriteConfig, memo: Memo | None = None):
        self.config = config
        self.memo = memo if memo is not None else Memo()

    def parse(self, raw: bytes, uri: bytes, conversation: str = "") -> Incoming | None:
        """The parsed request to `uri`, or None where cg leaves the body alone.

        `conversation` (e.g. Claude Code's session id) names whose last body this one
        most likely extends; without one, how its messages open does. Only messages they share
        byte for byte are reused.
        """
        route = _PATHS.get(split_path(uri))
        if route is None or not raw:
            return None
        shape, stash = route
        # The conversation's last body to this model: the next one repeats most of it (memo.bodies).
        # Claude Code's side requests to a small model share the session id; keyed apart, they do
        # not push the main thread's body out. A hint only: reuse is decided by the bytes.
        model = _MODEL.search(raw, 0, _MODEL_WITHIN)
        key = f"{conversation or _opening(raw)}\0{model[1].decode('latin-1') if model else ''}"
        previous = self.memo.bodies.take(key)
        body = ParsedBody.parse(raw, previous)
        if body is None:
            return None
        self.memo.bodies.put(key, body.earlier(), len(raw))
        injection = self._injection(body, shape)
        # Exactly where cg manages expand does it repair the client's answers to expand calls.
        repairs = find_repairs(body, shape) if injection is not None else []
        usage_added = injection is not None and body.added_last(_USAGE_OPTION) in injection
        return Incoming(body, shape, stash, injection, repairs, usage_added, previous)

    def finish(self, incoming: Incoming, repair_texts: dict[str, str] | None = None,
               lossy: bool | frozenset[str] = True, older: Older | None = None,
               restored: list[tuple[jsonbytes.Span, str]] | None = None,
               lifetime: float | None = None) -> Rewrite:
        """Repair, compact and inject in one splice; with `restored`, the hidden turns a spliced
        response's continuation wrote its thinking after (cg.stream.hidden), put back; with
        `lifetime`, every breakpoint of a Messages request asks for it (--cache-ttl,
        cg.wire.cache.lifetime_edits): all of them or, where another edit replaces one's block,
        none, so that the request never mixes lifetimes out of the order the provider requires.

        `lossy=False` forbids lossy compaction; a set of marker IDs allows it only for those
        originals (the store could not keep the others). `older`: the cache-aware policy's
        stronger config for older messages (cg.compaction.cold), where an epoch applies.
        """
        body, shape = incoming.body, incoming.dialect
        injected = incoming.injection is not None
        compaction = plan(body, shape, self.config.compact, lossy if injected else False, self.memo, older)
        repairs = repair_edits(body, incoming.repairs, repair_texts) if repair_texts else []
        edits = repairs + compaction.edits + (incoming.injection or []) + (restored or [])
        asked = None
        if lifetime is not None and shape.select(True, False, False):
            wanted = lifetime_edits(body, lifetime)
            kept = _outside(wanted, edits)
            asked = lifetime if len(kept) == len(wanted) else None
            edits += kept
        forwarded(body, compaction)
        return Rewrite(
            body=body.apply(edits),
            originals=compaction.originals if incoming.stash else {},
            changes=compaction.changes,
            injected=injected,
            stash=incoming.stash,
            parsed=body.value,
            runs=compaction.runs,
            reverted=compaction.reverted,
            repaired=len(repairs),
            dialect=shape,
            usage_added=incoming.usage_added,
            moved=compaction.moved,
            lifetime=asked,
        )

    def originals(self, incoming: Incoming) -> Mapping[str, bytes]:
        """The originals this body itself holds (by marker ID), as lossy compaction would stash them."""
        return plan(incoming.body, incoming.dialect, self.config.compact, True, self.memo).originals

    def rewrite(self, raw: bytes, uri: bytes, lossy: bool = True) -> Rewrite | None:
        """`parse` then `finish`, for a request that needs no repair texts."""
        incoming = self.parse(raw, uri)
        return None if incoming is None else self.finish(incoming, lossy=lossy)

    def _injection(self, body: ParsedBody, shape: Shape) -> list[tuple[jsonbytes.Span, str]] | None:
        if not self.config.expand:
            return None
        edits = expand.injection(body, shape)
        if edits is None:
            return None
        return shape.select(_as_is, _with_stream_usage, _as_is)(body, edits)


_Edits = list[tuple[jsonbytes.Span, str]]


def _as_is(body: ParsedBody, edits: _Edits) -> _Edits | None:
    return edits


def _with_stream_usage(body: ParsedBody, edits: _Edits) -> _Edits | None:
    """A chat completions stream's injection: with `stream_options.include_usage` set, so that the
    inspector can sum the rounds' usage."""
    value = body.value
    if value.get("stream") is not True:
        return edits
    n = value.get("n")
    if isinstance(n, int) and n > 1:
        return None  # the stream inspector reads one choice: n > 1 streams pass through
    if "stream_options" in value:
        return edits  # the client's own options, byte for byte (with or without usage)
    return [*edits, body.added_last(_USAGE_OPTION)]


def _opening(raw: bytes) -> str:
    """A name for a session-less conversation: a digest of its first message (or input item) after
    any system or developer ones (an app's chats all open with the same instructions), or of its
    first 512 bytes when it does not end within the first 64 KB. Conversations that open alike
    share it, and reuse only what they share; what follows changes as the history grows."""
    for name in (b'"messages"', b'"input"'):
        at = raw.find(name)
        found = _MESSAGES_OPEN.match(raw, at) if at >= 0 else None
        if found is not None:
            # A character the window cuts lies past what is named.
            window = raw[found.end():found.end() + _OPENING_WINDOW].decode("utf-8", "ignore")
            start = len(window) - len(window.lstrip())
            while True:
                try:
                    item, end = _FIRST_ITEM.raw_decode(window, start)
                except ValueError:  # longer than the window (or no item): named by how it starts
                    opening = window[start:start + _OPENING_BYTES]
                    break
                opening = window[start:end]
                if not (isinstance(item, dict) and item.get("role") in _INSTRUCTIONS):
                    break
                gap = _ITEM_GAP.match(window, end)  # always matches: it accepts ""
                start = gap.end() if gap else end
            return "opening:" + hashlib.blake2b(opening.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()
    return ""


_FIRST_ITEM = json.JSONDecoder()


def _outside(edits: list[tuple[jsonbytes.Span, str]],
             others: list[tuple[jsonbytes.Span, str]]) -> list[tuple[jsonbytes.Span, str]]:
    """`edits`, or none if any of them falls within one of `others`' spans."""
    inside = any(start <= begin and end <= stop for (begin, end), _ in edits for (start, stop), _ in others
                 if start < stop)
    return [] if inside else edits
