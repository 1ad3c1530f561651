"""HTTP/1.1 on the upstream leg, as plain functions and objects fed bytes (RFC 9112).

`cg.web.upstream` speaks HTTP/1.1 to the provider itself; this module holds the parts that
need no reactor: which request-targets cg forwards, the request head, the response head,
and the response body's framing (Content-Length, chunked, or delimited by the connection's close).
"""

import re

import attrs
from twisted.web.http_headers import Headers

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


def request_head(method: bytes, target: bytes, host: bytes, headers: Headers, body: bytes | None) -> bytes:
    """The request line and headers: the client's end-to-end headers, Host, and the body's length.

    A request without a body (None) gets no Content-Length, as Agent sent it.
    """
    lines = [method + b" " + target + b" HTTP/1.1", b"Host: " + host]
    for name, values in headers.getAllRawHeaders():
        for value in values:
            lines.append(name + b": " + value)
    if body is not None:
        lines.append(b"Content-Length: %d" % len(body))
    lines.append(b"\r\n")
    return b"\r\n".join(lines)


@attrs.define
class ResponseHead:
    """A parsed status line and header section, with how the body is framed."""

    code: int
    phrase: bytes
    headers: Headers
    length: int | None  # a Content-Length; None: chunked, or delimited by the close
    chunked: bool
    keep_alive: bool  # the connection may carry another request after this response

    @property
    def interim(self) -> bool:
        """A 1xx response: another head follows on the same connection."""
        return 100 <= self.code < 200

    def has_body(self, head_request: bool) -> bool:
        return not (head_request or self.code in (204, 304) or self.interim)


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
    headers = Headers()
    lengths: set[bytes] = set()
    codings: list[bytes] = []
    connection: list[bytes] = []
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not name or name[-1:] in b" \t" or name[:1] in b" \t":
            raise ProtocolError(f"bad header line {line[:100]!r}")  # incl. obsolete line folding
        value = value.strip(b" \t")
        headers.addRawHeader(name, value)
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

    def __init__(self):
        self._left = 0  # bytes of the current chunk's data still to come
        self._state = "size"  # size | data | crlf | trailer
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
                self._left = _chunk_size(data[pos:eol])
                pos = eol + 2
                self._state = "data" if self._left else "trailer"
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

    def _buffer(self, partial: bytes):
        if len(partial) > _MAX_SIZE_LINE:
            raise ProtocolError("chunk-size or trailer line too long")
        self._buf = partial


def _chunk_size(line: bytes) -> int:
    size = line.split(b";", 1)[0].strip(b" \t")
    if not size or len(size) > 16 or size.strip(b"0123456789abcdefABCDEF"):
        raise ProtocolError(f"bad chunk size {line[:40]!r}")
    return int(size, 16)
