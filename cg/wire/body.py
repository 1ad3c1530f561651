"""A request body parsed once: its JSON value, and where each message (or input item) and the tools array sit in it.

Every stage that edits a body (repair, compaction, tool injection, continuations) works from this
one parse and returns span edits, spliced in one pass: the bytes between edits reach the provider
exactly as the client sent them.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any, TypeVar, cast

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

# The lists of messages a body's value holds (read lazily: `Messages`).
_LISTS = ("messages", "input")

_Answer = TypeVar("_Answer")

UNREAD = jsonbytes.UNREAD


class Messages(list[object]):
    """A body's messages (or Responses input items), each read from the body's bytes the first
    time it is looked at when the conversation's last body had it: an `Earlier`, the memo's entry
    for a conversation, keeps no message values, most of its memory. Every way of looking reads
    first (indexing, slicing, iterating, comparing, copying); nothing in cg hands the list to C code
    that would look past it (ujson's encoder, `*` and `<`; the standard library's json reads it
    right). Read-only: a change of its length would move an unread message off its span. A walk of
    every message on each turn would read the history again: carry its answers
    (`ParsedBody.per_message`, `ParsedBody.up_to`)."""

    __slots__ = ("_raw", "_spans", "_key")

    def __init__(self, items: list[object], raw: bytes, spans: dict[jsonbytes.Path, jsonbytes.Span], key: str):
        super().__init__(items)
        self._raw, self._spans, self._key = raw, spans, key

    def _read(self, index: int) -> object:
        value = list.__getitem__(self, index)
        if value is UNREAD:
            value = jsonbytes.scan(self._raw, self._spans[(self._key, index if index >= 0 else index + len(self))])
            list.__setitem__(self, index, value)
        return value

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self._read(i) for i in range(*index.indices(len(self)))]
        return self._read(index)

    def __iter__(self) -> Iterator[object]:
        return (self._read(i) for i in range(len(self)))

    def __reversed__(self) -> Iterator[object]:
        return (self._read(i) for i in reversed(range(len(self))))

    def __contains__(self, item: object) -> bool:
        return any(value is item or value == item for value in self)

    def __eq__(self, other: object) -> bool:
        return list(self) == (list(other) if isinstance(other, list) else other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = None  # a list's: none

    def __add__(self, other: Any) -> Any:
        return [*self, *other]

    def __radd__(self, other: Any) -> Any:
        return [*other, *self]

    def copy(self) -> list[object]:
        return list(self)

    def index(self, *args: Any) -> int:
        return list(self).index(*args)

    def count(self, item: object) -> int:
        return list(self).count(item)

    def __repr__(self) -> str:
        return repr(list(self))

    def __reduce_ex__(self, protocol: Any) -> Any:  # copy, deepcopy and pickle: a plain list, read
        return list, (list(self),)

    def _read_only(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("a parsed body's messages are read-only")  # an unread one would move off its span

    __setitem__ = __delitem__ = __iadd__ = __imul__ = _read_only
    append = extend = insert = pop = remove = clear = sort = reverse = _read_only


def _lazy(value: dict[str, object], raw: bytes, spans: dict[jsonbytes.Path, jsonbytes.Span]) -> dict[str, object]:
    """`value` with its message lists read lazily from `raw`."""
    for key in _LISTS:
        items = value.get(key)
        if type(items) is list:
            value[key] = Messages(items, raw, spans, key)
    return value


def _unread(value: dict[str, object]) -> dict[str, object]:
    """`value` keeping no message (object, array or string; a number stays: it may go on past
    what the next body shares): what an `Earlier` holds."""
    slim = dict(value)
    for key in _LISTS:
        items = value.get(key)
        if isinstance(items, list):
            slim[key] = [UNREAD if item is UNREAD or isinstance(item, (dict, list, str)) else item
                         for item in list.__iter__(items)]
    return slim


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
    body's `carried` for the next turn. `suffix` is how many bytes at its end it shares with that
    body (an agent's system prompt and tools, after the messages that grow).
    """

    raw: bytes
    doc: str
    value: dict[str, object]
    spans: dict[jsonbytes.Path, jsonbytes.Span]
    inner: InnerSpans = attrs.Factory(dict)
    shared: int = 0
    earlier_carried: Mapping[Hashable, Sequence[object]] = attrs.Factory(dict)
    carried: dict[Hashable, Sequence[object]] = attrs.Factory(dict)
    suffix: int = 0

    @classmethod
    def parse(cls, raw: bytes, previous: Earlier | None = None) -> ParsedBody | None:
        """None for anything that is not a JSON object in UTF-8 (it is then forwarded untouched).

        `previous`, the same conversation's last body, lets the messages it shares with this
        one (and the system prompt and tools after them) stand unparsed: the values are the
        same objects, so treat them as read-only.
        """
        if previous is not None and raw == previous.raw:
            return cls(raw, raw.decode("latin-1"), _lazy(dict(previous.value), raw, previous.spans), previous.spans,
                       previous.inner, len(raw), previous.carried, suffix=len(raw))
        reuse = previous.reuse(raw) if previous is not None else None
        try:
            body = cls.load(raw, _BODY_SPINE, reuse)
        except ValueError:
            return None
        _lazy(body.value, raw, body.spans)
        if reuse is None or previous is None:
            return body
        inner = {path: previous.inner[path] for path in reuse.taken if path in previous.inner}
        return attrs.evolve(body, inner=inner, shared=reuse.limit, earlier_carried=previous.carried,
                            suffix=len(previous.raw) - reuse.tail)

    @classmethod
    def load(cls, raw: bytes, spine: jsonbytes.Spine, reuse: jsonbytes.Reuse | None = None) -> ParsedBody:
        """`raw` parsed along `spine` (spans of what it reaches); ValueError when it is not a JSON
        object in UTF-8."""
        doc, value, spans = jsonbytes.load_bytes(raw, spine, reuse)
        if not isinstance(value, dict):
            raise ValueError("not a JSON object")
        return cls(raw, doc, value, spans)

    def per_message(self, tag: Hashable, key: str, answer: Callable[[object], _Answer]) -> list[_Answer]:
        """`answer(message)` for each message of `value[key]` (none when it is not a list), in order.

        A message the conversation's last body answered under `tag` (the same bytes at the same
        place, within `shared`) is answered as it was then and not looked at, so it is never read
        (`Messages`): a turn reads only its new messages. `answer` must depend on the message alone.
        Carried under `tag` for the next turn; asked again for this body, answered as it was.
        """
        messages = self.value.get(key)
        if not isinstance(messages, list):
            return []
        done = cast("Sequence[tuple[jsonbytes.Span, _Answer]] | None", self.carried.get(tag))
        if done is not None:
            return [answered for _, answered in done]
        last = cast("Sequence[tuple[jsonbytes.Span, _Answer]]", self.earlier_carried.get(tag, ()))
        answers: list[tuple[jsonbytes.Span, _Answer]] = []
        for index in range(len(messages)):
            span = self.spans[(key, index)]
            if index < len(last) and span[1] <= self.shared and last[index][0] == span:
                answers.append(last[index])
            else:
                answers.append((span, answer(messages[index])))
        self.carried[tag] = answers
        return [answered for _, answered in answers]

    def up_to(self, tag: Hashable, key: str, index: int, answer: Callable[[], _Answer]) -> _Answer:
        """`answer()`, which depends on messages `0..index` of `value[key]` alone (and on what the
        caller keys `tag` with); the conversation's last body's answer under `tag` when it had
        message `index` at the same place, within `shared` (so the same messages up to it).
        Carried under `tag` for the next turn.
        """
        span = self.spans.get((key, index))
        last = self.earlier_carried.get(tag)
        if last is not None and span is not None and last[0] == span and span[1] <= self.shared:
            answered = cast("_Answer", last[1])
        else:
            answered = answer()
        self.carried[tag] = (span, answered)
        return answered

    def earlier(self) -> Earlier:
        """What the conversation's next body is parsed against."""
        return Earlier(self.raw, _unread(self.value), self.spans, self.inner, self.carried)

    def added_last(self, member: str) -> tuple[jsonbytes.Span, str]:
        """The edit that adds `member` (``"key":value``, as written) last to the body's object, which
        has a member already: after the others, before the closing brace."""
        close = len(self.doc.rstrip()) - 1
        return (close, close), "," + member

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
