"""Which headers cross the proxy (RFC 9110 §7.6.1): end-to-end ones, unchanged."""

from twisted.web.http_headers import Headers

_HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
# Framing and routing that the upstream client recomputes for its own leg, and
# cg's own request header (x-cg-bypass: 1 sends a request exactly as received).
_REQUEST_LOCAL = frozenset({b"host", b"content-length", b"expect", b"x-cg-bypass"})
# Framing the server recomputes for the client leg (bodies may be decoded).
_RESPONSE_LOCAL = frozenset({b"content-length"})


def _connection_tokens(headers: Headers) -> frozenset[bytes]:
    tokens: set[bytes] = set()
    for value in headers.getRawHeaders(b"connection", ()):
        tokens.update(t.strip().lower() for t in value.split(b","))
    return frozenset(tokens)


def _copy(headers: Headers, drop: frozenset[bytes]) -> Headers:
    drop = drop | _HOP_BY_HOP | _connection_tokens(headers)
    out = Headers()
    for name, values in headers.getAllRawHeaders():
        if name.lower() not in drop:
            out.setRawHeaders(name, values)
    return out


def request_headers(headers: Headers, accept_encoding: bytes | None = None) -> Headers:
    """The client's end-to-end headers for the upstream request.

    `accept_encoding`, when given, replaces the client's: on the endpoints cg
    reads, it asks only for encodings it can decode.
    """
    out = _copy(headers, _REQUEST_LOCAL)
    if accept_encoding is not None:
        out.setRawHeaders(b"accept-encoding", [accept_encoding])
    return out


def response_headers(headers: Headers, drop: frozenset[bytes] = frozenset()) -> Headers:
    """The upstream's end-to-end headers for the client response."""
    return _copy(headers, _RESPONSE_LOCAL | drop)
