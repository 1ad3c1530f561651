"""Markers: the name under which the model can get elided content back.

A marker is `<<cg:ID>>`. The ID is derived from the original content alone, so the same content gets
the same marker in every request and every process: a re-sent history keeps its exact bytes.
"""

import hashlib
import re

from cg.wire import jsonbytes

EXPAND_TOOL = "context_guru_expand"

_ID = "[A-Za-z0-9_-]{1,64}"
_ID_OR_MARKER = re.compile(rf"\s*(?:<<cg:({_ID})>>|({_ID}))\s*")

# Raw-body scanning: "cg:ID>>" is found with a fast literal-prefix search, then the two bytes before
# it are checked. Either angle bracket may be JSON-escaped (Go escapes "<" and ">" as \u003c/\u003e).
_RAW_TAIL = re.compile(rb"cg:[A-Za-z0-9_-]{1,64}(?:>|\\u003[eE])(?:>|\\u003[eE])")
_RAW_HEAD = re.compile(rb"(?:<|\\u003[cC])(?:<|\\u003[cC])\Z")
_RAW_HEAD_MAX = len(b"\\u003c") * 2
_COUNTED_FIELDS = ("messages", "system")
_COUNTED_SPINE: jsonbytes.Spine = {field: {} for field in _COUNTED_FIELDS}


def marker_id(original: bytes) -> str:
    """The ID of an original: the first 16 hex digits of its SHA-256."""
    return id_of(hashlib.sha256(original).digest())


def id_of(digest: bytes) -> str:
    """The marker ID of the original whose SHA-256 is `digest` (a memo keyed by the whole digest
    computes it once for both)."""
    return digest[:8].hex()


def marker(ident: str) -> str:
    """The marker text for an ID."""
    if not re.fullmatch(_ID, ident):
        raise ValueError(f"not a marker id: {ident!r}")
    return f"<<cg:{ident}>>"


def parse_marker_ref(text: str) -> str | None:
    """The ID in an expand call's argument: a bare ID or a whole marker; None if it is neither."""
    match = _ID_OR_MARKER.fullmatch(text)
    return match and (match[1] or match[2])


def body_has_marker(body: bytes) -> bool:
    """Whether a request body carries a marker in `messages` or `system` (never counting `tools`).

    Scans the raw bytes, so a marker is found however the client escaped it. Only when one is
    found does it parse the body to learn where `messages` and `system` lie; a body that does not
    parse counts every marker, since a missed marker is a lost expand.
    """
    starts = [
        match.start()
        for match in _RAW_TAIL.finditer(body)
        if _RAW_HEAD.search(body, max(0, match.start() - _RAW_HEAD_MAX), match.start())
    ]
    if not starts:
        return False
    try:
        # Latin-1 maps byte n to character n, so str offsets are byte offsets (and it costs nothing).
        _, spans = jsonbytes.load(body.decode("latin-1"), _COUNTED_SPINE)
    except ValueError:
        return True
    counted = [spans[(field,)] for field in _COUNTED_FIELDS if (field,) in spans]
    return any(begin <= start < end for start in starts for begin, end in counted)
