"""Which provider a request is for, how that provider shapes an error, and the shape of its bodies.

Routing is by path, as the SDKs build it: ANTHROPIC_BASE_URL=http://cg and
OPENAI_BASE_URL=http://cg/v1 both work unchanged. An `anthropic-version`
header wins over the path, because Anthropic serves some of the same paths
(`/v1/models`).

A body's shape (`Shape`) is the adapter every layer reaches the three APIs through: Anthropic
Messages (`MESSAGES_SHAPE`), OpenAI chat completions (`CHAT_SHAPE`) and the Responses API
(`RESPONSES_SHAPE`). It holds the facts of the wire (its name, the route it is served by, where a
body keeps its conversation), and `select` picks a layer's own per-dialect part: a layer above
this one writes one class or function per dialect and picks it once, through the shape, instead of
comparing dialect names. This module and `cg.exchange.dialects` are where dialect names are
compared (tests/test_dialect_adapters.py keeps it so).
"""

import abc
from collections.abc import Mapping, Sequence
from typing import Protocol, TypeVar, final

import ujson

ANTHROPIC = "anthropic"
OPENAI = "openai"
# A body shape, not a route: `/v1/responses` routes as OPENAI (its upstream, its /stats line), but
# its bodies carry `input` and `output` items, not chat `messages`. Its errors are OpenAI's.
RESPONSES = "responses"

T = TypeVar("T")


class Shape(abc.ABC):
    """How one API lays out a request body and its response: the adapter for a dialect.

    One instance a dialect (compared by identity). `name` is the dialect's name as /stats, the
    change log and the record write it; `route` the dialect its path routes as (its upstream, its
    errors: the Responses API routes as OPENAI); `items` the key of the body's conversation (the
    array of messages, or of input items), which repair, compaction and the cache-aware policy walk.
    """

    __slots__ = ("items", "name", "route")

    def __init__(self, name: str, route: str, items: str) -> None:
        self.name, self.route, self.items = name, route, items

    @abc.abstractmethod
    def select(self, anthropic: T, chat: T, responses: T) -> T:
        """This dialect's one of a layer's three per-dialect parts (Messages, chat, Responses)."""

    def __repr__(self) -> str:
        return f"<Shape {self.name}>"

    def __reduce__(self) -> str:  # copy and pickle: the same instance
        return _SHAPE_NAMES[self.name]


@final
class _Messages(Shape):
    __slots__ = ()

    def select(self, anthropic: T, chat: T, responses: T) -> T:
        return anthropic


@final
class _Chat(Shape):
    __slots__ = ()

    def select(self, anthropic: T, chat: T, responses: T) -> T:
        return chat


@final
class _Responses(Shape):
    __slots__ = ()

    def select(self, anthropic: T, chat: T, responses: T) -> T:
        return responses


MESSAGES_SHAPE: Shape = _Messages(ANTHROPIC, ANTHROPIC, "messages")
CHAT_SHAPE: Shape = _Chat(OPENAI, OPENAI, "messages")
RESPONSES_SHAPE: Shape = _Responses(RESPONSES, OPENAI, "input")
SHAPES: Mapping[str, Shape] = {shape.name: shape for shape in (MESSAGES_SHAPE, CHAT_SHAPE, RESPONSES_SHAPE)}
_SHAPE_NAMES = {ANTHROPIC: "MESSAGES_SHAPE", OPENAI: "CHAT_SHAPE", RESPONSES: "RESPONSES_SHAPE"}

_OPENAI_PATHS = (
    b"/v1/chat/completions",
    b"/v1/responses",
    b"/v1/completions",
    b"/v1/embeddings",
    b"/v1/models",
)
# The API paths cg knows by name (a path under one, such as /v1/models/ID, is not one of them):
# /metrics labels requests by these, and every other path as "other", so no ID becomes a label.
API_PATHS = frozenset(
    {"/v1/messages", "/v1/messages/count_tokens", "/v1/messages/batches"}
    | {path.decode("ascii") for path in _OPENAI_PATHS}
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
