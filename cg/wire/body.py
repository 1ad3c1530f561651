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

    `doc` is the body's Latin-1 view (one character per byte: offsets are byte offsets, and no
    decode of the whole body is needed); `value` has the strings as the client meant them
    (jsonbytes.load_bytes). Every stage that edits the body (compaction, tool injection) works from
    this one parse and returns span edits; `apply` splices them all at once into the client's
    bytes. `inner` caches, per message path, the spans the pipeline walked inside it; a message
    taken from the conversation's last parse brings its entry along.

    `shared` is how many bytes from the start this body shares with the conversation's last one,
    whose `carried` is `earlier_carried`: what the stages above cached about its messages, each
    under its own key, valid here for the messages that end within `shared`. They fill this
    body's `carried` for the next turn.
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
        """None for anything that is not a JSON object in UTF-8 (it is then forwarded untouched).

        `previous`, the same conversation's last body, lets the messages it shares with this
        one (and the system prompt and tools after them) stand unparsed: the values are the
        same objects, so treat them as read-only.
        """
        if previous is not None and raw == previous.raw:
            return cls(raw, raw.decode("latin-1"), previous.value, previous.spans, previous.inner, len(raw),
                       previous.carried)
        reuse = previous.reuse(raw) if previous is not None else None
        try:
            body = cls.load(raw, _BODY_SPINE, reuse)
        except ValueError:
            return None
        if reuse is None or previous is None:
            return body
        inner = {path: previous.inner[path] for path in reuse.taken if path in previous.inner}
        return attrs.evolve(body, inner=inner, shared=reuse.limit, earlier_carried=previous.carried)

    @classmethod
    def load(cls, raw: bytes, spine: jsonbytes.Spine, reuse: jsonbytes.Reuse | None = None) -> ParsedBody:
        """`raw` parsed along `spine` (spans of what it reaches); ValueError when it is not a JSON
        object in UTF-8."""
        doc, value, spans = jsonbytes.load_bytes(raw, spine, reuse)
        if not isinstance(value, dict):
            raise ValueError("not a JSON object")
        return cls(raw, doc, value, spans)

    def earlier(self) -> Earlier:
        """What the conversation's next body is parsed against."""
        return Earlier(self.raw, self.value, self.spans, self.inner, self.carried)

    def apply(self, edits: list[tuple[jsonbytes.Span, str]]) -> bytes:
        """The body with `edits` spliced in; the very same bytes object when there are none."""
        if not edits:
            return self.raw
        pieces: list[bytes] = []
        position = 0
        for (start, end), text in sorted(edits, key=lambda edit: edit[0]):
            pieces += (self.raw[position:start], text.encode("utf-8"))
            position = end
        pieces.append(self.raw[position:])
        return b"".join(pieces)


@attrs.frozen
class Earlier:
    """A conversation's last body, kept to parse its next one against: its bytes, value and spans
    (not its Latin-1 view, a copy of the bytes that costs nothing to make again)."""

    raw: bytes
    value: dict[str, object]
    spans: dict[jsonbytes.Path, jsonbytes.Span]
    inner: InnerSpans
    carried: dict[Hashable, Sequence[object]]

    def reuse(self, raw: bytes) -> jsonbytes.Reuse:
        """What `raw` shares with this body: its prefix and suffix, compared as bytes (C speed)."""
        prefix = jsonbytes.common_prefix(raw, self.raw)
        suffix = jsonbytes.common_suffix(raw, self.raw, min(len(raw), len(self.raw)) - prefix)
        return jsonbytes.Reuse(self.value, self.spans, limit=prefix, tail=len(self.raw) - suffix,
                               shift=len(raw) - len(self.raw))
