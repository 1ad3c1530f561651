"""A spliced response's hidden turns, put back where a continuation's thinking was written after them.

Anthropic's preserved thinking: "If the prefix differs from what you sent when the block was
produced, that block and every later thinking block are invalid, and the API rejects the request
with a 400 error or drops the invalid blocks" (platform.claude.com/docs/build-with-claude/
preserved-thinking); a block's prefix is `system`, `tools` and everything before it. A thinking
block an expand continuation writes follows the expand call cg hid from the client and its answer;
the client, which never saw them, sends the block back after round 1's blocks alone.

So when a spliced Messages response's continuation wrote a thinking (or redacted_thinking) block,
cg freezes a record of its hidden turns in the store, keyed by that block's signature (its data),
before the response ends (`record`). A later request that carries the block gets them back in place
(`anchors`, then `restore`): after each round's shown blocks its expand calls, their answers as a
user turn, then the next round's blocks in an assistant turn of their own, in the bytes the
continuation sent, on every later turn and after a restart. The record is the store's, first writer
wins (`IStore.freeze`). A record that is gone, or a message that is not the one it describes (the
client changed its blocks), leaves the message as the client sent it: the provider then drops those
thinking blocks or refuses the request, as it would have without the record.

Pure: dicts and bytes in, span edits out.
"""

import hashlib
import json
from collections import OrderedDict
from collections.abc import Sequence
from typing import Final

import attrs

from cg.wire import jsonbytes
from cg.wire.body import ParsedBody

__all__ = ["MISSING", "HiddenTurn", "Record", "Seen", "Shown", "anchors", "is_blank_text", "parse", "record", "record_key",
           "restore", "thinking_key"]


@attrs.frozen
class HiddenTurn:
    """One expand round's turn the client never saw, as the continuation wrote it."""

    calls: str  # the round's expand tool_use blocks, comma-joined
    answers: str  # the user message of their tool_result blocks
    # The round's whitespace-only text blocks (by place among the blocks it showed), as written:
    # a client may drop those (Claude Code does), and they are in the thinking's prefix too.
    blanks: tuple[tuple[int, str], ...] = ()


@attrs.frozen
class Shown:
    """What the client was shown of a spliced response."""

    types: tuple[str, ...]  # each block's type, in order
    starts: tuple[int, ...]  # where each continuation round's blocks begin among them
    thinking: tuple[int, str] | None  # a continuation's first thinking block: its place, its key


def thinking_key(block: object) -> str | None:
    """A thinking block's signature, a redacted_thinking block's data: what names it (None for another)."""
    if not isinstance(block, dict):
        return None
    kind = block.get("type")
    key = block.get("signature") if kind == "thinking" else block.get("data") if kind == "redacted_thinking" else None
    return key if isinstance(key, str) and key else None


def record_key(thinking: str) -> str:
    """The store's key (a frozen text's) for the record of the block named `thinking`."""
    return "hidden-turns:" + hashlib.sha256(thinking.encode("utf-8")).hexdigest()[:32]


def record(shown: Shown, turns: Sequence[HiddenTurn | None]) -> tuple[str, bytes] | None:
    """(store key, record) for a spliced response whose continuation wrote thinking; None when it
    wrote none, or a round's turn cannot be put back (`turns` has a None)."""
    if shown.thinking is None or not turns or len(turns) != len(shown.starts):
        return None
    hidden = [[turn.calls, turn.answers, [list(blank) for blank in turn.blanks]] for turn in turns if turn is not None]
    if len(hidden) != len(turns):
        return None
    at, key = shown.thinking
    doc = {"types": list(shown.types), "starts": list(shown.starts), "at": at, "hidden": hidden}
    return record_key(key), json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def anchors(message: object) -> tuple[tuple[int, str], ...]:
    """(block index, record key) of each thinking block of an assistant message: where a record may
    put hidden turns back."""
    if not isinstance(message, dict) or message.get("role") != "assistant":
        return ()
    content = message.get("content")
    if not isinstance(content, list):
        return ()
    return tuple((index, record_key(key)) for index, key in enumerate(map(thinking_key, content)) if key is not None)


_MESSAGE_SPINE: jsonbytes.Spine = {"role": {}, "content": {jsonbytes.EACH: {}}}
_REOPEN: Final = ',{"role":"assistant","content":['


@attrs.frozen
class Record:
    """A record as `record` wrote it, read (`parse`): what `restore` puts back."""

    types: list[str]
    starts: list[int]
    at: int
    hidden: list[tuple[str, str, list[tuple[int, str]]]]  # each round's calls, answers, blanks
    size: int  # of its text, which `Seen` counts


def parse(text: bytes) -> Record | None:
    """The record `text` holds; None for one that is not a record."""
    try:
        doc = json.loads(text)
        return Record([str(kind) for kind in doc["types"]], [int(begins) for begins in doc["starts"]], int(doc["at"]),
                      [(str(calls), str(answers), [(int(place), str(written)) for place, written in blanks])
                       for calls, answers, blanks in doc["hidden"]], len(text))
    except (ValueError, TypeError, KeyError):
        return None


def restore(body: ParsedBody, message: int, block: int, found: Record) -> list[tuple[jsonbytes.Span, str]]:
    """The edits that put a record's hidden turns back into `body`'s message `message`, whose block
    `block` is the record's thinking block: none when the message is not the one it describes.

    The message's blocks are matched to the record's by type, back from the thinking block and on
    after it; a whitespace-only text block the client dropped is put back as it was written."""
    types, starts, at, hidden = found.types, found.starts, found.at, found.hidden
    messages = body.value.get("messages")
    content = messages[message].get("content") if isinstance(messages, list) else None
    if not isinstance(content, list) or len(hidden) != len(starts) or not 0 <= at < len(types):
        return []
    blanks = {begins + place: written for (_, _, round_blanks), begins in zip(hidden, [0, *starts])
              for place, written in round_blanks}
    places = _places(types, blanks, at, content, block)
    if places is None:
        return []
    start = body.spans[("messages", message)][0]
    inner = jsonbytes.spans_below(body.doc, start, _MESSAGE_SPINE)
    role = inner.get(("role",))
    if role is None or role[0] > inner[("content",)][0]:
        return []  # the turn is cut after its content: its role must come before
    turns: dict[int, str] = {}
    for (calls, answers, _), begins in zip(hidden, starts):
        turns[begins] = turns.get(begins, "") + calls + "]}," + answers + _REOPEN
    edits: list[tuple[jsonbytes.Span, str]] = []
    pending = ""
    for index, place in enumerate(places):
        pending += turns.get(index, "")
        if place is None:
            pending += blanks[index] + ","
        elif pending:
            offset = inner[("content", place)][0]
            edits.append(((offset, offset), pending))
            pending = ""
    return edits  # what is still pending has no block after it: a round that showed nothing more


def _places(types: list[str], blanks: dict[int, str], at: int, content: list[object],
            block: int) -> list[int | None] | None:
    """Where each of the record's blocks is in `content` (None: a blank the client dropped), from
    the first to as far after the thinking block as they match; None unless all before it do."""
    if not 0 <= block < len(content) or _type(content[block]) != types[at]:
        return None
    before: list[int | None] = []
    place = block - 1
    for index in range(at - 1, -1, -1):
        if index in blanks and not (place >= 0 and is_blank_text(content[place])):
            before.append(None)
        elif place >= 0 and _type(content[place]) == types[index]:
            before.append(place)
            place -= 1
        else:
            return None
    after: list[int | None] = [block]
    place = block + 1
    for index in range(at + 1, len(types)):
        if index in blanks and not (place < len(content) and is_blank_text(content[place])):
            after.append(None)
        elif place < len(content) and _type(content[place]) == types[index]:
            after.append(place)
            place += 1
        else:
            break
    return before[::-1] + after


def is_blank_text(block: object) -> bool:
    """A whitespace-only text block."""
    text = block.get("text") if isinstance(block, dict) and block.get("type") == "text" else None
    return isinstance(text, str) and not text.strip()


def _type(block: object) -> object:
    return block.get("type") if isinstance(block, dict) else None


MISSING: Final = object()


class Seen:
    """The records this process read or wrote (an LRU of `max_bytes`), and the keys it found none
    under (the last `limit`): a request asks the store only about thinking blocks it has not seen. A
    key is a new signature's, which no request carried before the response that wrote it ended, so
    "none" stays true but for the moment between that response's end and its record's commit: the
    process that wrote a record knows it at once. With a `shared` store (`--workers`, Redis: another
    process may be that writer), "none" is kept only for a block older than the request's latest
    assistant message (`cg.exchange.prepare`); alone on its store, this process keeps every "none".
    """

    def __init__(self, limit: int = 50_000, max_bytes: int = 32 << 20, shared: bool = False) -> None:
        self.shared = shared
        self._limit = limit
        self._max_bytes = max_bytes
        self._bytes = 0
        self._records: OrderedDict[tuple[str, str], Record] = OrderedDict()  # parsed once
        self._none: dict[tuple[str, str], None] = {}  # in the order they were found: the oldest go first

    def get(self, tenant: str, key: str) -> object:
        """The record, None (there is none), or `MISSING` (not asked yet, or forgotten)."""
        entry = (tenant, key)
        if entry in self._none:
            return None
        found = self._records.get(entry)
        if found is None:
            return MISSING
        self._records.move_to_end(entry)
        return found

    def put(self, tenant: str, key: str, text: bytes | None) -> Record | None:
        """The record stored under `key` (None: there is none; a text that is no record counts as
        none), returned parsed."""
        entry = (tenant, key)
        records, none = self._records, self._none
        dropped = records.pop(entry, None)
        self._bytes -= 0 if dropped is None else dropped.size
        none.pop(entry, None)
        found = None if text is None else parse(text)
        if found is None:
            none[entry] = None
            if len(none) > self._limit:
                del none[next(iter(none))]
            return None
        records[entry] = found
        self._bytes += found.size
        while self._bytes > self._max_bytes:
            self._bytes -= records.popitem(last=False)[1].size
        return found
