"""Byte-preserving edits of JSON request bodies.

The provider's prompt cache is keyed on the exact bytes cg forwards, so cg never re-serializes a body.
It parses the document once with the stdlib's C scanner, walking in Python only the "spine" it may
edit (so it knows the span of every value there), and later splices new JSON strings into those
spans, encoded the way the client encoded the strings they replace.

Offsets are str offsets. A request body is parsed as its Latin-1 view (`load_bytes`): one
character per byte, so its offsets are byte offsets, no decode of the whole body is needed, and the
bytes between edits are the client's own. JSON's structure is ASCII, so only the values of
non-ASCII literals differ in that view: they are decoded again from the literal's UTF-8, which also
checks it.
"""

import json
import re
from collections.abc import Callable
from typing import Any, AnyStr, Final, TypeAlias

import attrs

EACH: Final = object()
"""Spine key standing for every item of an array."""

Span: TypeAlias = tuple[int, int]
Path: TypeAlias = tuple[str | int, ...]
"""Where a value sits: the object keys and array indices leading to it."""
Spine: TypeAlias = dict[object, "Spine"]
"""Which parts of a document to walk (see ``load``): object keys, or EACH, to the spine below."""

# The stdlib's own scanners (C when available); typeshed does not declare these attributes.
_scan_value: Callable[[str, int], tuple[object, int]] = json.decoder.JSONDecoder().scan_once  # type: ignore[attr-defined]
_scan_string: Callable[[str, int], tuple[str, int]] = json.decoder.scanstring  # type: ignore[attr-defined]
_WHITESPACE = re.compile(r"[ \t\n\r]*")


def scan(raw: bytes, span: Span) -> object:
    """The JSON value at `span` of `raw` (UTF-8), as the parse scans it: what a parse found there
    and did not keep (cg.wire.body.Messages)."""
    return _scan_value(raw[span[0]:span[1]].decode("utf-8"), 0)[0]


class _Unread:
    def __repr__(self) -> str:
        return "<unread>"


UNREAD: Final = _Unread()
"""An object, array or string an earlier parse found at a path but did not keep (cg.wire.body):
taken, it stays unread until looked at."""


@attrs.define
class Reuse:
    """An earlier parse sharing its first `limit` characters and some of its last ones with the new
    document (bytes, for `load_bytes`).

    A value the spine records without descending (a message, the tools array) that lies wholly
    inside the shared prefix at the same position, or inside the shared suffix at the same distance
    from the end, is taken from the earlier parse instead of being scanned again: an agent's history
    grows at its end, before the system prompt and tools that follow it unchanged. `taken` lists
    the paths taken so.
    """

    value: object
    spans: dict[Path, Span]
    limit: int
    tail: int  # where the shared suffix starts in the earlier document (its length if none)
    shift: int  # the new document's length less the earlier one's
    taken: list[Path] = attrs.Factory(list)

    def item(self, path: Path, pos: int) -> tuple[object, int] | None:
        """The earlier parse's value at `path` and its new end, if the same text starts at `pos`."""
        span = self.spans.get(path)
        if span is None:
            return None
        start, end = span
        in_suffix = start + self.shift == pos and start >= self.tail
        if not ((start == pos and end <= self.limit) or in_suffix):
            return None
        value: Any = self.value  # the spans say what each step of the path indexes
        for key in path:
            value = value[key]
        if end == self.limit and not in_suffix and not (value is UNREAD or isinstance(value, (dict, list, str))):
            return None  # a number may go on past the shared prefix: "1" shared, then "12"
        self.taken.append(path)
        return value, pos + end - start

    def forget(self, prefix: Path) -> None:
        """Paths at or below `prefix` were not taken after all (a duplicate key: the last one wins)."""
        self.taken[:] = [path for path in self.taken if path[:len(prefix)] != prefix]


def common_prefix(a: AnyStr, b: AnyStr, block: int = 1 << 16) -> int:
    """The length of the longest common prefix of a and b, comparing in blocks (C speed)."""
    n = min(len(a), len(b))
    pos = 0
    while pos < n and a[pos:pos + block] == b[pos:pos + block]:
        pos += block
    low, high = min(pos, n), min(pos + block, n)
    while low < high:  # the first differing character is in [low, high]
        middle = (low + high) // 2
        if a[low:middle + 1] == b[low:middle + 1]:
            low = middle + 1
        else:
            high = middle
    return low


def common_suffix(a: AnyStr, b: AnyStr, most: int, block: int = 1 << 16) -> int:
    """The length of the longest common suffix of a and b, at most `most` (C speed)."""
    n = min(len(a), len(b), most)
    length = 0
    while length < n:
        step = min(length + block, n)
        if a[len(a) - step:len(a) - length] != b[len(b) - step:len(b) - length]:
            break
        length = step
    low, high = length, min(length + block, n)
    while low < high:  # the longest common suffix is in [low, high]
        middle = (low + high + 1) // 2
        if a[len(a) - middle:len(a) - low] == b[len(b) - middle:len(b) - low]:
            low = middle
        else:
            high = middle - 1
    return low


def load(doc: str, spine: Spine, reuse: Reuse | None = None) -> tuple[object, dict[Path, Span]]:
    """Parse doc like json.loads; also return the span of every value the spine reaches, by path.

    A spine is a nested dict: an object key (or EACH for array items) maps to the spine below it;
    `{}` records a value's span without descending. Raises ValueError on anything that is not one
    JSON document. `reuse` lets array items of an earlier parse stand (see Reuse).
    """
    return _load(doc, spine, reuse, _TEXT)


def load_bytes(raw: bytes, spine: Spine, reuse: Reuse | None = None) -> tuple[str, object, dict[Path, Span]]:
    """`load` of UTF-8 `raw` through its Latin-1 view, which it returns with the value and spans:
    offsets are byte offsets. ValueError also for UTF-8 that is not valid (in a literal it scans:
    what `reuse` gives was checked when it was scanned)."""
    doc = raw.decode("latin-1")
    value, spans = _load(doc, spine, reuse, _LATIN1)
    return doc, value, spans


def _load(doc: str, spine: Spine, reuse: Reuse | None, scan: "_Scanners") -> tuple[object, dict[Path, Span]]:
    spans: dict[Path, Span] = {}
    try:
        value, end = _parse(doc, _skip(doc, 0), spine, (), spans, reuse, scan)
        if _skip(doc, end) != len(doc):
            raise ValueError("trailing data after the JSON document")
    except (IndexError, StopIteration, RecursionError) as error:
        raise ValueError("not a JSON document") from error
    return value, spans


def spans_below(doc: str, start: int, spine: Spine) -> dict[Path, Span]:
    """The spans the spine reaches below the (already parsed) value at `start`, by relative path.

    Lets a caller walk only the parts of a document it is about to edit (its values are not
    returned: a Latin-1 view's do for spans).
    """
    spans: dict[Path, Span] = {}
    _parse(doc, start, spine, (), spans, None, _TEXT)
    return spans


def _skip(doc: str, pos: int) -> int:
    if doc[pos:pos + 1] in (" ", "\t", "\n", "\r"):
        match = _WHITESPACE.match(doc, pos)  # always matches: the pattern accepts ""
        return match.end() if match else pos
    return pos


@attrs.frozen
class _Scanners:
    """How a parse reads a value (from its first character) and a key (from after its quote)."""

    value: Callable[[str, int], tuple[object, int]]
    string: Callable[[str, int], tuple[str, int]]


def _latin1_value(doc: str, pos: int) -> tuple[object, int]:
    """A value of a Latin-1 view: scanned again from its UTF-8 when its literal is not ASCII."""
    value, end = _scan_value(doc, pos)
    if not doc.isascii():
        literal = doc[pos:end]
        if not literal.isascii():
            value = _scan_value(literal.encode("latin-1").decode("utf-8"), 0)[0]
    return value, end


def _latin1_string(doc: str, pos: int) -> tuple[str, int]:
    """A string of a Latin-1 view (`pos` after its opening quote), as `_latin1_value` reads it."""
    text, end = _scan_string(doc, pos)
    if not text.isascii() and not doc[pos:end].isascii():
        text = _scan_string(doc[pos:end].encode("latin-1").decode("utf-8"), 0)[0]
    return text, end


_TEXT = _Scanners(_scan_value, _scan_string)
_LATIN1 = _Scanners(_latin1_value, _latin1_string)


def _parse(doc: str, pos: int, spine: Spine, path: Path, spans: dict[Path, Span],
           reuse: Reuse | None, scan: _Scanners) -> tuple[object, int]:
    value: object
    earlier = reuse.item(path, pos) if reuse is not None and not spine else None
    if earlier is not None:
        value, end = earlier
        spans[path] = (pos, end)
        return value, end
    opener = doc[pos]
    if opener == "{" and spine:
        value, end = _parse_object(doc, pos, spine, path, spans, reuse, scan)
    elif opener == "[" and EACH in spine:
        value, end = _parse_array(doc, pos, spine[EACH], path, spans, reuse, scan)
    else:
        value, end = scan.value(doc, pos)
    spans[path] = (pos, end)
    return value, end


def _parse_object(doc: str, pos: int, spine: Spine, path: Path, spans: dict[Path, Span],
                  reuse: Reuse | None, scan: _Scanners) -> tuple[dict[str, object], int]:
    members: dict[str, object] = {}
    pos = _skip(doc, pos + 1)
    if doc[pos] == "}":
        return members, pos + 1
    while True:
        if doc[pos] != '"':
            raise ValueError(f"expected a key at {pos}")
        key, pos = scan.string(doc, pos + 1)
        pos = _skip(doc, pos)
        if doc[pos] != ":":
            raise ValueError(f"expected ':' at {pos}")
        pos = _skip(doc, pos + 1)
        below = spine.get(key)
        if below is None:
            members[key], pos = scan.value(doc, pos)
        else:
            if key in members:  # a duplicate key: the last one wins, so only its spans may stand
                _forget(path + (key,), spans, reuse)
            members[key], pos = _parse(doc, pos, below, path + (key,), spans, reuse, scan)
        pos = _skip(doc, pos)
        if doc[pos] == "}":
            return members, pos + 1
        if doc[pos] != ",":
            raise ValueError(f"expected ',' or '}}' at {pos}")
        pos = _skip(doc, pos + 1)


def _forget(prefix: Path, spans: dict[Path, Span], reuse: Reuse | None) -> None:
    """Drop the spans recorded at or below `prefix` (and what `reuse` took there)."""
    for path in [path for path in spans if path[:len(prefix)] == prefix]:
        del spans[path]
    if reuse is not None:
        reuse.forget(prefix)


def _parse_array(doc: str, pos: int, spine: Spine, path: Path, spans: dict[Path, Span],
                 reuse: Reuse | None, scan: _Scanners) -> tuple[list[object], int]:
    items: list[object] = []
    pos = _skip(doc, pos + 1)
    if doc[pos] == "]":
        return items, pos + 1
    while True:
        value, pos = _parse(doc, pos, spine, path + (len(items),), spans, reuse, scan)
        items.append(value)
        pos = _skip(doc, pos)
        if doc[pos] == "]":
            return items, pos + 1
        if doc[pos] != ",":
            raise ValueError(f"expected ',' or ']' at {pos}")
        pos = _skip(doc, pos + 1)


_HTML_ESCAPES = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def html_escaped(literal: str) -> str:
    """JSON text with <, >, & (and U+2028/9) escaped as Go's encoder writes them.

    Outside strings JSON has none of these characters, so this edits strings only.
    """
    return re.sub("[<>&\u2028\u2029]", lambda match: _HTML_ESCAPES[match[0]], literal)


@attrs.frozen
class StringStyle:
    """How a client spells JSON strings, so a spliced string looks like its neighbours.

    JavaScript's JSON.stringify and Python's json.dumps(ensure_ascii=False) agree byte for byte;
    Python's default escapes non-ASCII, PHP escapes "/", Go escapes <, > and & (and U+2028/9).
    """

    ascii_only: bool = False
    escape_slash: bool = False
    escape_html: bool = False

    @classmethod
    def of(cls, literal: str, text: str) -> "StringStyle":
        """The style of `literal`, the client's spelling of `text` (quotes included).

        A literal shows only what its text contains: one without a slash says nothing about
        slashes, but a replacement made from that text has none either. (The markers cg adds bring
        "<" and ">": with no evidence they go raw, the same JSON, found either way.) A few C-speed
        scans only, since literals can be megabytes long.
        """
        slash = literal.find("/")
        return cls(
            ascii_only=literal.isascii() and not text.isascii(),
            escape_slash=slash > 0 and escaped(literal, slash),
            escape_html=any(char in text and char not in literal for char in "<>&"),
        )

    def encode(self, text: str) -> str:
        """text as a JSON string literal in this style (always valid UTF-8 once encoded)."""
        literal = json.dumps(text, ensure_ascii=self.ascii_only)
        if not literal.isascii():
            try:
                literal.encode("utf-8")
            except UnicodeEncodeError:  # a lone surrogate can only travel escaped
                literal = json.dumps(text)
        if self.escape_slash:
            literal = literal.replace("/", "\\/")
        if self.escape_html:
            literal = html_escaped(literal)
        return literal


def escaped(text: str, index: int) -> bool:
    """Whether the character at index follows an escaping backslash (an odd run of them)."""
    start = index
    while start > 0 and text[start - 1] == "\\":
        start -= 1
    return (index - start) % 2 == 1
