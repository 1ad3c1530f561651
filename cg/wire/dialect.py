"""Which provider a request is for, and how that provider shapes an error.

Routing is by path, as the SDKs build it: ANTHROPIC_BASE_URL=http://cg and
OPENAI_BASE_URL=http://cg/v1 both work unchanged. An `anthropic-version`
header wins over the path, because Anthropic serves some of the same paths
(`/v1/models`).
"""

from collections.abc import Sequence
from typing import Protocol

import ujson

ANTHROPIC = "anthropic"
OPENAI = "openai"
# A body shape, not a route: `/v1/responses` routes as OPENAI (its upstream, its /stats line), but
# its bodies carry `input` and `output` items, not chat `messages`. Its errors are OpenAI's.
RESPONSES = "responses"

_OPENAI_PATHS = (
    b"/v1/chat/completions",
    b"/v1/responses",
    b"/v1/completions",
    b"/v1/embeddings",
    b"/v1/models",
)
# The endpoints whose responses cg reads (and so must be able to decode), and their shape.
_RESPONSE_SHAPES = {b"/v1/messages": ANTHROPIC, b"/v1/chat/completions": OPENAI, b"/v1/responses": RESPONSES}


def split_path(uri: bytes) -> bytes:
    """The path of a request-target, without its query."""
    return uri.split(b"?", 1)[0]


def _under(path: bytes, prefix: bytes) -> bool:
    return path == prefix or path.startswith(prefix + b"/")


def route(uri: bytes, anthropic_version: bool) -> str | None:
    """The dialect of a request to `uri`, or None when cg does not proxy it."""
    path = split_path(uri)
    if anthropic_version or _under(path, b"/v1/messages"):
        return ANTHROPIC
    if any(_under(path, p) for p in _OPENAI_PATHS):
        return OPENAI
    return None


class Headers(Protocol):
    """What `spoken_by` reads of request headers: Twisted's Headers, which this pure layer does not import."""

    def hasHeader(self, name: bytes) -> bool: ...

    def getRawHeaders(self, name: bytes, default: list[bytes]) -> Sequence[bytes]: ...


def spoken_by(headers: Headers) -> str:
    """The dialect a client speaks, by how it authenticates: for the errors cg answers itself.

    A bare `Authorization: Bearer` token is OpenAI's. `anthropic-version` or `x-api-key`
    is Anthropic's (Claude Code sends a Bearer token with `anthropic-version`), and so
    is anything else, as cg has always answered.
    """
    if headers.hasHeader(b"anthropic-version") or headers.hasHeader(b"x-api-key"):
        return ANTHROPIC
    authorization = headers.getRawHeaders(b"authorization", [b""])[0]
    return OPENAI if authorization[:7].lower() == b"bearer " else ANTHROPIC


def not_proxied(path: bytes, cg_url: str) -> str:
    """Why cg answers 404 for `path`, with the fix when it is an OpenAI path without `/v1`.

    The OpenAI SDKs append `/chat/completions` to the base URL as given, so a base URL
    set to cg without `/v1` is the usual way to get here.
    """
    message = f"cg does not proxy {path.decode('latin-1')}"
    if any(_under(b"/v1" + path, p) for p in _OPENAI_PATHS):
        message += f": set the OpenAI base URL to {cg_url}/v1"
    return message


def response_shape(uri: bytes) -> str | None:
    """The shape of the responses cg parses (usage, tool calls) at `uri`; None where it reads none."""
    return _RESPONSE_SHAPES.get(split_path(uri))


_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    413: "request_too_large",
    502: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}
_OPENAI_TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    502: "server_error",
    503: "server_error",
    504: "timeout",
}


def error_body(dialect: str | None, status: int, message: str) -> bytes:
    """An error body in the provider's own shape, so its SDK raises cleanly."""
    doc: dict[str, object]
    if dialect in (OPENAI, RESPONSES):
        kind = _OPENAI_TYPES.get(status, "server_error")
        doc = {"error": {"message": message, "type": kind, "param": None, "code": None}}
    else:
        kind = _ANTHROPIC_TYPES.get(status, "api_error")
        doc = {"type": "error", "error": {"type": kind, "message": message}}
    return ujson.dumps(doc, escape_forward_slashes=False).encode()
