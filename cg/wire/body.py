"""A request body parsed once: its JSON value, and where each message (or input item) and the tools array sit in it.

Every stage that edits a body (repair, compaction, tool injection, continuations) works from this
one parse and returns span edits, spliced in one pass: the bytes between edits reach the provider
exactly as the client sent them.
"""

from __future__ import annotations

import attrs

from cg.wire import jsonbytes
from cg.wire.jsonbytes import EACH

# Parsed in Python only as deep as each message (chat and Messages `messages`, Responses `input`
# items); the stages walk further where they need to.
_BODY_SPINE: jsonbytes.Spine = {"messages": {EACH: {}}, "input": {EACH: {}}, "tools": {}}


@attrs.frozen
class ParsedBody:
    """A request body parsed once, with the spans of its messages and its tools array.

    Every stage that edits the body (compaction, tool injection) works from this one parse
    and returns span edits; `apply` splices them all at once.
    """

    raw: bytes
    doc: str
    value: dict[str, object]
    spans: dict[jsonbytes.Path, jsonbytes.Span]

    @classmethod
    def parse(cls, raw: bytes, previous: ParsedBody | None = None) -> ParsedBody | None:
        """None for anything that is not a JSON object (it is then forwarded untouched).

        `previous`, the same conversation's last body, lets the messages it shares with this
        one stand unparsed (the values are the same objects: treat them as read-only).
        """
        if previous is not None and raw == previous.raw:
            return previous
        try:
            doc = raw.decode("utf-8")
            reuse = None
            if previous is not None:
                reuse = jsonbytes.Reuse(previous.value, previous.spans, jsonbytes.common_prefix(doc, previous.doc))
            value, spans = jsonbytes.load(doc, _BODY_SPINE, reuse)
        except ValueError:
            return None
        return cls(raw, doc, value, spans) if isinstance(value, dict) else None

    def apply(self, edits: list[tuple[jsonbytes.Span, str]]) -> bytes:
        """The body with `edits` spliced in; the very same bytes object when there are none."""
        return jsonbytes.splice(self.doc, edits).encode("utf-8") if edits else self.raw
