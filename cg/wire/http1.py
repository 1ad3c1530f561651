"""HTTP/1.1 on the upstream leg, as plain functions and objects fed bytes (RFC 9112).

cg speaks HTTP/1.1 to the provider itself (`cg.web.upstream` holds the connection); this module
holds all of it that needs no reactor: which request-targets cg forwards, the request head, the
response head, and `ResponseParser`, which turns the bytes of a connection's responses into
events (a head, body data, the body's end) whatever their split into reads.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Iterable, Sequence
from typing import TypeAlias

import attrs

__all__ = [
    "MAX_HEAD",
    "NEED_DATA",
    "BodyEnd",
    "ChunkedDecoder",
    "Event",
    "Framing",
    "NeedData",
    "ParserState",
    "ProtocolError",
    "ResponseHead",
    "ResponseParser",
    "parse_response_head",
    "request_head",
    "target_problem",
]

MAX_HEAD = 256 * 1024  # bytes of a response head; a provider's is a few KiB
_MAX_SIZE_LINE = 4096  # a chunk-size line with extensions


class ProtocolError(ValueError):
    """The upstream sent something that is not HTTP/1.1."""


# RFC 3986: a path of segments of pchar (unreserved, %-escapes, sub-delims, ":" and "@").
_PATH = re.compile(rb"(?:/(?:[A-Za-z0-9\-._~!$&'()*+,;=:@]|%[0-9A-Fa-f]{2})*)+")
_DOT_SEGMENT = re.compile(rb"/(?:\.|%2e){1,2}(?=[/;]|%3b|$)", re.IGNORECASE)  # "..;" climbs too, on some gateways
_ENCODED_UNSAFE = re.compile(rb"%(?:2f|5c|[01][0-9a-f]|7f)", re.IGNORECASE)  # / \ and controls
_QUERY = re.compile(rb"[!\"$-~]*")  # visible ASCII but "#"


def target_problem(target: bytes) -> str | None:
    """Why cg will not forward a request-target, or None for one it will.

    cg forwards only origin-form (RFC 9112 3.2.1: a path, then maybe a query), and
    only as a path under its configured upstream base: any other form (`host:port/x`,
    `http://host/x`, `*`) would name a host. `//host/x` is origin-form, a path whose
    first segment is empty: it goes to the configured upstream as that path, never to
    `host`. Refused too is what lets a path climb out of the base's path or the route
    cg chose once an upstream decodes or normalises it: a `.` or `..` segment, an
    encoded `/` or `\\`, an encoded control character. Whitespace and control bytes
    (CR, LF, NUL) are refused as any other byte a path cannot hold (twisted.web
    refuses them in the request line before cg sees it).
    """
    path, _, query = target.partition(b"?")
    if path[:1] != b"/":
        return "it does not start with / (cg takes a path, never a host or a URL)"
    if _PATH.fullmatch(path) is None:
        return "its path holds a bad %-escape or a character a URL path cannot (such as # or \\)"
    if _DOT_SEGMENT.search(path):
        return "its path has a . or .. segment"
    if _ENCODED_UNSAFE.search(path):
        return "its path has an encoded /, \\ or control character"
    if _QUERY.fullmatch(query) is None:
        return "its query holds # or a byte that is not visible ASCII"
    return None


def request_head(
    method: bytes,
    target: bytes,
    host: bytes,
    headers: Iterable[tuple[bytes, Sequence[bytes]]],
    body: bytes | None,
) -> bytes:
    """The request line and headers: the client's end-to-end headers, Host, and the body's length.

    `headers` are (name, values) pairs, as `Headers.getAllRawHeaders()` gives them. A request
    without a body (None) gets no Content-Length, as Agent sent it.
    """
    lines = [method + b" " + target + b" HTTP/1.1", b"Host: " + host]
    for name, values in headers:
        for value in values:
            lines.append(name + b": " + value)
    if body is not None:
        lines.append(b"Content-Length: %d" % len(body))
    lines.append(b"\r\n")
    return b"\r\n".join(lines)


class Framing(enum.Enum):
    """How a response's body ends."""

    NONE = "no body"  # a 1xx, 204 or 304 response, or one to HEAD
    LENGTH = "after Content-Length bytes"
    CHUNKED = "at the last chunk"
    CLOSE = "when the connection closes"


# The code below names enum members through module globals: a global costs 9-16 ns, an enum
# member's lookup 21-86 ns (timeit, CPython 3.10-3.13, 2026-12-06), a price paid per read or per response.
_NO_BODY, _LENGTH, _CHUNKED, _CLOSE = Framing.NONE, Framing.LENGTH, Framing.CHUNKED, Framing.CLOSE


@attrs.define
class ResponseHead:
    """A parsed status line and header section, with how the body is framed."""

    code: int
    phrase: bytes
    headers: list[tuple[bytes, bytes]]  # (name, value) as received, in order
    length: int | None  # a Content-Length; None: chunked, or delimited by the close
    chunked: bool
    keep_alive: bool  # the connection may carry another request after this response

    @property
    def interim(self) -> bool:
        """A 1xx response: another head follows on the same connection."""
        return 100 <= self.code < 200

    def has_body(self, head_request: bool) -> bool:
        return not (head_request or self.code in (204, 304) or self.interim)

    def framing(self, head_request: bool) -> Framing:
        if not self.has_body(head_request):
            return _NO_BODY
        if self.chunked:
            return _CHUNKED
        return _CLOSE if self.length is None else _LENGTH


def parse_response_head(head: bytes) -> ResponseHead:
    """Parse a head (without its final blank line); ProtocolError when it is not HTTP/1.x."""
    crlf = head.count(b"\r\n")
    if head.count(b"\n") != crlf or head.count(b"\r") != crlf:
        raise ProtocolError("bare CR or LF in the response head")  # lines would frame differently
    lines = head.split(b"\r\n")
    version, _, rest = lines[0].partition(b" ")
    status, _, phrase = rest.partition(b" ")
    if version not in (b"HTTP/1.1", b"HTTP/1.0") or len(status) != 3 or not status.isdigit():
        raise ProtocolError(f"bad status line {lines[0][:100]!r}")
    headers: list[tuple[bytes, bytes]] = []
    lengths: set[bytes] = set()
    codings: list[bytes] = []
    connection: list[bytes] = []
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not name or name[-1:] in b" \t" or name[:1] in b" \t":
            raise ProtocolError(f"bad header line {line[:100]!r}")  # incl. obsolete line folding
        value = value.strip(b" \t")
        headers.append((name, value))
        lower = name.lower()
        if lower == b"content-length":
            lengths.update(v.strip() for v in value.split(b","))
        elif lower == b"transfer-encoding":
            codings += [c.strip().lower() for c in value.split(b",")]
        elif lower == b"connection":
            connection += [c.strip().lower() for c in value.split(b",")]
    keep_alive = version == b"HTTP/1.1" and b"close" not in connection
    chunked = bool(codings) and codings[-1] == b"chunked"
    length = None
    if codings:
        # Transfer-Encoding overrides Content-Length; anything but a final chunked ends by close.
        keep_alive = keep_alive and chunked and not lengths
    elif lengths:
        if len(lengths) != 1 or not next(iter(lengths)).isdigit():
            raise ProtocolError(f"bad Content-Length {sorted(lengths)!r}")
        length = int(next(iter(lengths)))
    return ResponseHead(int(status), phrase, headers, length, chunked, keep_alive)


class ChunkedDecoder:
    """Turns a chunked body into its payload, whatever the bytes' split into reads.

    `feed` returns the payload bytes found in one read; once the last chunk and its
    trailer section have arrived, `done` is true and `extra` holds any bytes after them.
    """

    def __init__(self) -> None:
        self._left = 0  # bytes of the current chunk's data still to come
        # size | data | crlf | trailer: strings, compared per chunk (an enum member's lookup costs more than a global's)
        self._state = "size"
        self._buf = b""
        self.done = False
        self.extra = b""

    def feed(self, data: bytes) -> bytes:
        if self._buf:
            data, self._buf = self._buf + data, b""
        out = []
        pos, n = 0, len(data)
        while pos < n and not self.done:
            state = self._state
            if state == "data":
                take = min(self._left, n - pos)
                out.append(data[pos : pos + take] if take != n else data)
                pos += take
                self._left -= take
                if not self._left:
                    self._state = "crlf"
            elif state == "crlf":
                if n - pos < 2:
                    self._buf = data[pos:]
                    break
                if data[pos : pos + 2] != b"\r\n":
                    raise ProtocolError("chunk data not followed by CRLF")
                pos += 2
                self._state = "size"
            elif state == "size":
                eol = data.find(b"\r\n", pos)
                if eol < 0:
                    self._buffer(data[pos:])
                    break
                size = _chunk_size(data[pos:eol])
                pos = eol + 2
                end = pos + size
                if size and end + 2 <= n:  # the whole chunk and its CRLF are in this read, as in most streams
                    if data[end : end + 2] != b"\r\n":
                        raise ProtocolError("chunk data not followed by CRLF")
                    out.append(data[pos:end])
                    pos = end + 2
                    continue
                self._left = size
                self._state = "data" if size else "trailer"
            else:  # the trailer section: field lines up to an empty line
                eol = data.find(b"\r\n", pos)
                if eol < 0:
                    self._buffer(data[pos:])
                    break
                if eol == pos:
                    self.done = True
                pos = eol + 2
        if self.done:
            self.extra = data[pos:]
        return out[0] if len(out) == 1 else b"".join(out)

    def _buffer(self, partial: bytes) -> None:
        if len(partial) > _MAX_SIZE_LINE:
            raise ProtocolError("chunk-size or trailer line too long")
        self._buf = partial


def _chunk_size(line: bytes) -> int:
    size = line.split(b";", 1)[0].strip(b" \t")
    if not size or len(size) > 16 or size.strip(b"0123456789abcdefABCDEF"):
        raise ProtocolError(f"bad chunk size {line[:40]!r}")
    return int(size, 16)


class NeedData(enum.Enum):
    """`ResponseParser.next_event` has nothing more until the next read."""

    NEED_DATA = "need data"


NEED_DATA = NeedData.NEED_DATA


@attrs.frozen
class BodyEnd:
    """The response's body is complete (a close-delimited body never ends this way: see `ends_at_close`)."""

    # The connection may carry the next request: the head allowed keep-alive and no byte
    # came after the body in the read that ended it (a server sending more is not trusted).
    reusable: bool


# What `ResponseParser.next_event` returns: the final head of a response (1xx heads are
# skipped), body data (bytes, never empty), the body's end, or NEED_DATA. Body data is
# plain bytes rather than an object around them: that is the one event of every read.
Event: TypeAlias = ResponseHead | bytes | BodyEnd | NeedData


class ParserState(enum.Enum):
    """Where a `ResponseParser` is in a connection's exchange of requests and responses."""

    IDLE = "no response expected"
    HEAD = "reading a response head"
    BODY = "reading a response body"
    BROKEN = "the bytes were not HTTP/1.1"


# Module globals, as _LENGTH and its kin are.
_IDLE, _HEAD, _BODY, _BROKEN = ParserState.IDLE, ParserState.HEAD, ParserState.BODY, ParserState.BROKEN


class ResponseParser:
    """One connection's responses, from bytes to events: sans-io, whatever the split into reads.

    The connection says a request went out (`start`), hands over each read (`receive`),
    then pulls events (`next_event`) until NEED_DATA. It stops pulling when it no longer
    cares, so bytes that came after that point are never parsed (nor refused).

    =======  ========================================  ======================================  =======
    state    event                                     `next_event` gives                      next
    =======  ========================================  ======================================  =======
    IDLE     `start` (a request went out)              (nothing to give)                       HEAD
    IDLE     Bytes                                     NEED_DATA (`start` drops them)          IDLE
    HEAD     Part of a head, or 1xx heads              NEED_DATA (1xx heads are skipped)       HEAD
    HEAD     The final head                            its `ResponseHead`                      BODY
    HEAD     Not a head, or one over MAX_HEAD          ProtocolError                           BROKEN
    BODY     Body bytes                                the read's payload (bytes, never        BODY
                                                       empty), else NEED_DATA
    BODY     The body's end (at once for no body,      the read's last payload if any, then    IDLE
             and for Content-Length: 0)                `BodyEnd`; reusable only if nothing
                                                       followed in that read (it is dropped)
    BODY     Bad chunked framing                       ProtocolError (none of that read's      BROKEN
                                                       payload)
    BROKEN   Anything                                  ProtocolError                           BROKEN
    =======  ========================================  ======================================  =======

    A close-delimited body (Framing.CLOSE) has no `BodyEnd`: the connection's clean
    close completes it (`ends_at_close`). Cost per read in a body: the framing's work
    on that read, no re-joining of earlier reads (a partial head or chunk-size line is
    re-joined, bounded by MAX_HEAD and 4 KiB). The state's work is a bound method chosen
    at each transition (`_step`), not a comparison of enum members per read: those
    cost 21-86 ns each on CPython 3.10-3.13.
    """

    def __init__(self) -> None:
        self.state = _IDLE
        self.framing = _NO_BODY  # the current response's, once its head is in
        self._step: Callable[[], Event] = self._idle  # the state's work
        self._head_request = False
        self._buf = b""  # received, not yet parsed
        self._scanned = 0  # bytes of _buf searched for a head's end already
        self._left = 0  # bytes of a Content-Length body still to come
        self._chunks = ChunkedDecoder()
        self._keep_alive = False
        self._end: BodyEnd | None = None  # found in the last read, given after its payload

    @property
    def ends_at_close(self) -> bool:
        """A body is being read that only the connection's close ends."""
        return self.state is _BODY and self.framing is _CLOSE

    def start(self, head_request: bool) -> None:
        """A request went out: what comes next is its response (to HEAD: a head without a body)."""
        if self.state is not _IDLE:
            raise RuntimeError(f"a request sent while {self.state.value}")
        self.state, self._step = _HEAD, self._head
        self._head_request = head_request
        self._buf = b""
        self._scanned = 0

    def receive(self, data: bytes) -> None:
        """A read from the connection, parsed by the next `next_event` calls."""
        self._buf = self._buf + data if self._buf else data

    def next_event(self) -> Event:
        """The next event from what was received; ProtocolError when it is not HTTP/1.1."""
        try:
            return self._step()
        except ProtocolError:
            self.state, self._step = _BROKEN, self._broken
            self._buf = b""
            raise

    def _idle(self) -> Event:
        return NEED_DATA

    def _broken(self) -> Event:
        raise ProtocolError("the response was not HTTP/1.1")

    def _head(self) -> Event:
        data = self._buf
        while True:
            start = max(self._scanned - 3, 0)  # a blank line may straddle the previous read
            end = data.find(b"\r\n\r\n", start)
            if end < 0:
                if len(data) > MAX_HEAD or data.find(b"\n\n", start) >= 0:
                    raise ProtocolError("not an HTTP/1.1 response head")
                self._buf = data
                self._scanned = len(data)
                return NEED_DATA
            if end > MAX_HEAD:
                raise ProtocolError("not an HTTP/1.1 response head")
            head = parse_response_head(data[:end])
            data = data[end + 4 :]
            self._scanned = 0
            if not head.interim:  # a 1xx head: the real one follows
                break
        self._buf = data
        self._keep_alive = head.keep_alive
        self.framing = framing = head.framing(self._head_request)
        if framing is _CHUNKED:
            self._chunks = ChunkedDecoder()
            self._step = self._chunked_body
        elif framing is _LENGTH:
            assert head.length is not None  # what LENGTH says
            self._left = head.length
            self._step = self._length_body
        elif framing is _CLOSE:
            self._step = self._close_body
        else:
            self._step = self._no_body
        self.state = _BODY
        return head

    def _length_body(self) -> Event:
        data, self._buf = self._buf, b""
        left = self._left
        if len(data) < left:
            self._left = left - len(data)
            return data if data else NEED_DATA
        # Content-Length: 0 ends here at once, with no data.
        self._left = 0
        return self._ended(data[:left] if left != len(data) else data, data[left:])

    def _chunked_body(self) -> Event:
        data, self._buf = self._buf, b""
        if not data:
            return NEED_DATA
        chunks = self._chunks
        payload = chunks.feed(data)
        if chunks.done:
            return self._ended(payload, chunks.extra)
        return payload if payload else NEED_DATA

    def _close_body(self) -> Event:
        data, self._buf = self._buf, b""
        return data if data else NEED_DATA

    def _no_body(self) -> Event:
        data, self._buf = self._buf, b""  # no part of this response
        return self._ended(b"", data)

    def _ended(self, payload: bytes, extra: bytes) -> Event:
        """The body is complete: its last payload (if any) now, its end at the next call."""
        end = BodyEnd(self._keep_alive and not extra)
        if payload:
            self._end = end
            self._step = self._pending_end
            return payload
        self.state, self._step = _IDLE, self._idle
        return end

    def _pending_end(self) -> Event:
        end = self._end
        assert end is not None  # set with this step
        self._end = None
        self.state, self._step = _IDLE, self._idle
        return end
