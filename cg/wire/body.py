"""A request body parsed once: its JSON value, and where each message (or input item) and the tools array sit in it.

Every stage that edits a body (repair, compaction, tool injection, continuations) works from this
one parse and returns span edits, spliced in one pass: the bytes between edits reach the provider
exactly as the client sent them.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

import attrs

from cg.wire import jsonbytes
from cg.wire.jsonbytes import EACH

# Parsed in Python only as deep as each message (chat and Messages `messages`, Responses `input`
# items); the stages walk further where they need to. `system` and `instructions` are recorded so
# that the next turn of the conversation can take them from this parse (jsonbytes.Reuse).
_BODY_SPINE: jsonbytes.Spine = {
    "messages": {EACH: {}}, "input": {EACH: {}}, "tools": {}, "system": {}, "instructions": {},
}

# Where each message keeps the strings the stages edit, relative to the message: by its path.
InnerSpans = dict[jsonbytes.Path, dict[jsonbytes.Path, jsonbytes.Span]]


@attrs.frozen
class ParsedBody:
    """A request body parsed once, with the spans of its messages and its tools array.

    Every stage that edits the body (compaction, tool injection) works from this one parse
    and returns span edits; `apply` splices them all at once. `inner` caches, per message
    path, the spans the pipeline walked inside it; a message taken from the conversation's
    last parse brings its entry along.

    `shared` is how many characters from the start this body shares with the conversation's
    last one, whose `carried` is `earlier_carried`: what the stages above cached about its
    messages, each under its own key, valid here for the messages that end within `shared`.
    They fill this body's `carried` for the next turn.
    """

    raw: bytes
    doc: str
    value: dict[str, object]
    spans: dict[jsonbytes.Path, jsonbytes.Span]
    inner: InnerSpans = attrs.Factory(dict)
    shared: int = 0
    earlier_carried: Mapping[Hashable, Sequence[object]] = attrs.Factory(dict)
    carried: dict[Hashable, Sequence[object]] = attrs.Factory(dict)

    @classmethod
    def parse(cls, raw: bytes, previous: Earlier | None = None) -> ParsedBody | None:
        """None for anything that is not a JSON object (it is then forwarded untouched).

        `previous`, the same conversation's last body, lets the messages it shares with this
        one (and the system prompt and tools after them) stand unparsed: the values are the
        same objects, so treat them as read-only.
        """
        try:
            doc = raw.decode("utf-8")
            if previous is not None and raw == previous.raw:
                return cls(raw, doc, previous.value, previous.spans, previous.inner, len(doc), previous.carried)
            reuse = previous.reuse(raw, doc) if previous is not None else None
            value, spans = jsonbytes.load(doc, _BODY_SPINE, reuse)
        except ValueError:
            return None
        if not isinstance(value, dict):
            return None
        if reuse is None or previous is None:
            return cls(raw, doc, value, spans)
        inner = {path: previous.inner[path] for path in reuse.taken if path in previous.inner}
        return cls(raw, doc, value, spans, inner, reuse.limit, previous.carried)

    def earlier(self) -> Earlier:
        """What the conversation's next body is parsed against."""
        return Earlier(self.raw, len(self.doc), self.value, self.spans, self.inner, self.carried)

    def apply(self, edits: list[tuple[jsonbytes.Span, str]]) -> bytes:
        """The body with `edits` spliced in; the very same bytes object when there are none."""
        return jsonbytes.splice(self.doc, edits).encode("utf-8") if edits else self.raw


@attrs.frozen
class Earlier:
    """A conversation's last body, kept to parse its next one against: its bytes, value and spans,
    but not its decoded text, which would double what it holds (a str with one character past
    Latin-1 stores every character in 2 or 4 bytes)."""

    raw: bytes
    chars: int  # the length of its decoded text
    value: dict[str, object]
    spans: dict[jsonbytes.Path, jsonbytes.Span]
    inner: InnerSpans
    carried: dict[Hashable, Sequence[object]]

    def reuse(self, raw: bytes, doc: str) -> jsonbytes.Reuse:
        """What `doc` (`raw` decoded) shares with this body, in characters: its prefix and suffix.

        Compared as bytes, each cut at a character boundary, and counted in characters from the
        part that differs (the new turn, usually a few KB): no second decode of the whole body.
        """
        prefix = jsonbytes.common_prefix(raw, self.raw)
        while 0 < prefix < len(raw) and _continues(raw[prefix]):
            prefix -= 1
        suffix = jsonbytes.common_suffix(raw, self.raw, min(len(raw), len(self.raw)) - prefix)
        while suffix and _continues(raw[len(raw) - suffix]):
            suffix -= 1
        middle = len(raw[prefix:len(raw) - suffix].decode("utf-8"))
        suffix_chars = _chars(raw[len(raw) - suffix:])
        prefix_chars = len(doc) - middle - suffix_chars
        return jsonbytes.Reuse(self.value, self.spans, limit=prefix_chars, tail=self.chars - suffix_chars,
                               shift=len(doc) - self.chars)


def _continues(byte: int) -> bool:
    """Whether a UTF-8 byte continues a character (10xxxxxx) rather than starting one."""
    return byte & 0xC0 == 0x80


def _chars(utf8: bytes) -> int:
    """How many characters valid UTF-8 decodes to (a system prompt and tools are often ASCII)."""
    return len(utf8) if utf8.isascii() else len(utf8.decode("utf-8"))
