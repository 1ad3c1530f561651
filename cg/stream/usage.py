"""Billed usage, read from the provider's responses, and running totals for /stats.

cg exists to make requests cheaper, and the only trustworthy measure of that is what the provider
bills. Every response reports it; this module turns the two providers' shapes into one ``Usage``:

- ``input_tokens``: prompt tokens billed at the base input price (neither read from nor written to
  the prompt cache);
- ``cache_read_tokens``: prompt tokens read from the cache (Anthropic: 0.1x the input price);
- ``cache_write_tokens``: prompt tokens written to the cache (Anthropic: 1.25x or 2x);
- ``cache_write_1h_tokens``: of those, the ones written for an hour (Anthropic's
  ``cache_creation.ephemeral_1h_input_tokens``: 2x; the rest, 5-minute writes, 1.25x);
- ``output_tokens``.

Anthropic reports them that way already (``input_tokens``, ``cache_read_input_tokens``,
``cache_creation_input_tokens``, ``output_tokens``). OpenAI's ``prompt_tokens`` *includes* the cached
ones, so ``input_tokens = prompt_tokens - prompt_tokens_details.cached_tokens``; OpenAI caches
automatically and charges nothing to write, so ``cache_write_tokens`` is always 0 there.

The cache write:read ratio is the number that tells a user whether cg saves or costs money: a proxy
that changes bytes the provider already cached turns cheap reads into expensive writes (one write
costs as much as ~12 reads). Pure code: dicts, ``cg.wire.sse.Event`` objects and (for the session
key) a ``cg.wire.body.ParsedBody`` in, no I/O. Everything
that reads a response fails open: a missing or malformed field counts as 0, never an exception.
"""

from __future__ import annotations

import hashlib
import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import cast

import attrs
import ujson

from cg.wire.body import ParsedBody
from cg.wire.dialect import Shape
from cg.wire.sse import Event, SSEParser

__all__ = [
    "SessionTotals",
    "StreamUsage",
    "Usage",
    "UsageTotals",
    "anthropic_usage",
    "json_usage",
    "openai_usage",
    "session_key",
]

_FIELDS = ("input_tokens", "cache_read_tokens", "cache_write_tokens", "output_tokens")
# Anthropic's usage keys for each Usage field.
_ANTHROPIC_KEYS = (
    ("input_tokens", "input_tokens"),
    ("cache_read_input_tokens", "cache_read_tokens"),
    ("cache_creation_input_tokens", "cache_write_tokens"),
    ("output_tokens", "output_tokens"),
)


def _count(value: object) -> int | None:
    """A token count, or None for anything that is not one (absent, null, a string, a bool...)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def _ratio(writes: int, reads: int) -> float | None:
    return writes / reads if reads else None


@attrs.frozen
class Usage:
    """The tokens one or more responses were billed for (see the module docstring)."""

    input_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    output_tokens: int = 0
    cache_write_1h_tokens: int = 0  # of cache_write_tokens

    @property
    def prompt_tokens(self) -> int:
        """Every prompt token, however it was billed (input + cache read + cache write)."""
        return self.input_tokens + self.cache_read_tokens + self.cache_write_tokens

    @property
    def cache_write_read_ratio(self) -> float | None:
        """Cache writes / cache reads; None when nothing was read."""
        return _ratio(self.cache_write_tokens, self.cache_read_tokens)

    def __add__(self, other: object) -> Usage:
        if not isinstance(other, Usage):
            return NotImplemented
        return Usage(
            self.input_tokens + other.input_tokens,
            self.cache_read_tokens + other.cache_read_tokens,
            self.cache_write_tokens + other.cache_write_tokens,
            self.output_tokens + other.output_tokens,
            self.cache_write_1h_tokens + other.cache_write_1h_tokens,
        )

    def __radd__(self, other: object) -> Usage:
        if other == 0:  # so that sum(usages) works
            return self
        return NotImplemented

    def as_dict(self) -> dict[str, int]:
        return {
            "input_tokens": self.input_tokens,
            "cache_read_tokens": self.cache_read_tokens,
            "cache_write_tokens": self.cache_write_tokens,
            "output_tokens": self.output_tokens,
            "cache_write_1h_tokens": self.cache_write_1h_tokens,
        }


def _anthropic_fields(usage: object) -> dict[str, int]:
    """The Usage fields present (and valid) in an Anthropic ``usage`` object."""
    if not isinstance(usage, dict):
        return {}
    found: dict[str, int] = {}
    for key, field in _ANTHROPIC_KEYS:
        value = _count(usage.get(key))
        if value is not None:
            found[field] = value
    by_lifetime = usage.get("cache_creation")
    one_hour = _count(by_lifetime.get("ephemeral_1h_input_tokens")) if isinstance(by_lifetime, dict) else None
    if one_hour is not None:
        found["cache_write_1h_tokens"] = one_hour
    return found


def anthropic_usage(message: object) -> Usage:
    """The usage of a non-streaming Messages API response (missing fields count as 0)."""
    if not isinstance(message, dict):
        return Usage()
    return Usage(**_anthropic_fields(message.get("usage")))


def _openai_fields(usage: object) -> dict[str, int] | None:
    """Usage fields from an OpenAI ``usage`` object, or None when there is none.

    chat.completions: ``prompt_tokens`` (cached included), ``prompt_tokens_details.cached_tokens``,
    ``completion_tokens``. The Responses API's ``input_tokens`` / ``input_tokens_details`` /
    ``output_tokens`` are read the same way. input = prompt - cached; no cache-write charge.
    """
    if not isinstance(usage, dict):
        return None
    if "prompt_tokens" in usage or "input_tokens" not in usage:
        prompt, details, output = "prompt_tokens", "prompt_tokens_details", "completion_tokens"
    else:
        prompt, details, output = "input_tokens", "input_tokens_details", "output_tokens"
    total = _count(usage.get(prompt)) or 0
    detail = usage.get(details)
    cached = (_count(detail.get("cached_tokens")) or 0) if isinstance(detail, dict) else 0
    cached = min(cached, total) if total else cached
    return {
        "input_tokens": max(total - cached, 0),
        "cache_read_tokens": cached,
        "output_tokens": _count(usage.get(output)) or 0,
    }


def openai_usage(doc: object) -> Usage:
    """The usage of a non-streaming chat.completion or Responses `response` (missing fields count as 0)."""
    if not isinstance(doc, dict):
        return Usage()
    return Usage(**(_openai_fields(doc.get("usage")) or {}))


def json_usage(shape: Shape) -> Callable[[object], Usage]:
    """How a non-streaming response of `shape` reports its usage: `anthropic_usage`, or
    `openai_usage` (chat completions and Responses alike)."""
    return shape.select(anthropic_usage, openai_usage, openai_usage)


_ANTHROPIC_USAGE_EVENTS = frozenset({"message_start", "message_delta", "message_stop"})


class StreamUsage:
    """The usage of one streamed response, read event by event. Never raises on stream content.

    Anthropic: ``message_start`` carries ``message.usage`` (input and cache counts, a small output
    count); each ``message_delta``'s ``usage`` holds cumulative totals for the whole message, so the
    fields it carries (non-null) **overwrite** the ones seen so far, never add — as the SDKs'
    accumulators do; absent fields keep their message_start value. A second ``message_start`` starts
    over (it would begin a new message). Events without an ``event:`` line are read by their JSON
    ``type`` (the SDKs drop them, but the provider bills them). ``complete``: ``message_stop`` seen.

    OpenAI: the chunk whose top-level ``usage`` is an object (with ``stream_options.include_usage``,
    the ``choices: []`` chunk just before ``[DONE]``); the last one wins, and a later
    ``"usage": null`` does not erase it. ``complete``: ``data: [DONE]`` seen. Without include_usage
    the stream reports no usage at all: ``has_usage`` stays False.

    Responses: the ``response`` of the terminal event (``response.completed``, ``.incomplete`` or
    ``.failed``) carries ``usage`` in Responses' shape (``input_tokens``, ``input_tokens_details``,
    ``output_tokens``); ``complete``: ``response.completed`` seen.

    A stream cut short keeps what it reported so far (Anthropic: message_start's counts) with
    ``complete`` False.
    """

    def __init__(self, shape: Shape) -> None:
        self.shape = shape
        self._read: Callable[[StreamUsage, Event], None] = shape.select(
            StreamUsage._anthropic, StreamUsage._openai, StreamUsage._responses)
        self.complete = False
        self.has_usage = False
        self._fields: dict[str, int] = {}

    @property
    def usage(self) -> Usage:
        return Usage(**self._fields)

    def observe(self, event: Event) -> None:
        try:
            self._read(self, event)
        except Exception:  # a stream we cannot read must never break the proxy
            pass

    def _anthropic(self, event: Event) -> None:
        kind = event.name
        if kind is None:
            if b'"message_' not in event.data:
                return
            doc = event.json()
            kind = doc.get("type") if isinstance(doc, dict) else None
        if kind not in _ANTHROPIC_USAGE_EVENTS:
            return
        if kind == "message_stop":
            self.complete = True
            return
        doc = event.json()
        if not isinstance(doc, dict):
            return
        if kind == "message_start":
            message = doc.get("message")
            if isinstance(message, dict) and isinstance(message.get("usage"), dict):
                self._fields = _anthropic_fields(message["usage"])
                self.has_usage = True
        elif isinstance(doc.get("usage"), dict):  # message_delta
            self._fields.update(_anthropic_fields(doc["usage"]))
            self.has_usage = True

    def _openai(self, event: Event) -> None:
        data = event.data
        if data.startswith(b"[DONE]"):
            self.complete = True
            return
        # Cheap filter: most chunks carry no usage or "usage":null. A '"usage"' byte sequence can
        # only be a key: inside a JSON string its quotes would be escaped.
        hits = data.count(b'"usage"')
        if not hits or (hits == 1 and b'"usage":null' in data):
            return
        doc = event.json()
        if not isinstance(doc, dict):
            return
        fields = _openai_fields(doc.get("usage"))
        if fields is not None:
            self._fields = fields
            self.has_usage = True


    def _responses(self, event: Event) -> None:
        kind = event.name
        if kind is None:  # data-only framing: the type is in the JSON
            if b'"response.completed"' not in event.data and b'"response.incomplete"' not in event.data \
                    and b'"response.failed"' not in event.data:
                return
            doc = event.json()
            kind = doc.get("type") if isinstance(doc, dict) else None
        if kind not in _RESPONSES_TERMINAL:
            return
        if kind == "response.completed":
            self.complete = True
        doc = event.json()
        response = doc.get("response") if isinstance(doc, dict) else None
        fields = _openai_fields(response.get("usage")) if isinstance(response, dict) else None
        if fields is not None:
            self._fields = fields
            self.has_usage = True


_RESPONSES_TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})


class ResponseUsage:
    """Reads the billed usage off a response body as it passes, never holding it up.

    Streams go through an SSEParser and a StreamUsage; a JSON body is kept (up to
    `max_json` bytes) and parsed when it ends. `usage()` is None when the response
    reported none cg could read.
    """

    def __init__(self, shape: Shape, streaming: bool, max_json: int = 16 << 20) -> None:
        self.shape = shape
        self._read: Callable[[object], Usage] = json_usage(shape)
        self._stream = StreamUsage(shape) if streaming else None
        self._parser = SSEParser() if streaming else None
        self._chunks: list[bytes] = []
        self._size = 0
        self._max_json = max_json

    def feed(self, data: bytes) -> None:
        stream, parser = self._stream, self._parser
        if stream is not None and parser is not None:
            if not parser.buffered and data.endswith(b"\n\n") and b"usage" not in data:
                return  # whole events, none about usage: nothing to parse
            for event in parser.feed(data):
                stream.observe(event)
        elif self._size <= self._max_json:
            self._chunks.append(data)
            self._size += len(data)

    def usage(self) -> Usage | None:
        if self._stream is not None:
            return self._stream.usage if self._stream.has_usage else None
        if not self._chunks or self._size > self._max_json:
            return None
        try:
            doc = ujson.loads(b"".join(self._chunks))
        except ValueError:
            return None
        if not isinstance(doc, dict) or not isinstance(doc.get("usage"), dict):
            return None
        return self._read(doc)


@attrs.define
class SessionTotals:
    """One session's share of the totals."""

    session: str
    requests: int = 0
    usage: Usage = Usage()

    def as_dict(self) -> dict[str, object]:
        return {
            "session": self.session,
            "requests": self.requests,
            **self.usage.as_dict(),
            "cache_write_read_ratio": _rounded(self.usage.cache_write_read_ratio),
        }


def _rounded(ratio: float | None) -> float | None:
    return None if ratio is None else round(ratio, 4)


@attrs.define
class UsageTotals:
    """Running billed-usage totals, overall and per session, for /stats and the change log.

    Sessions are kept least-recently-used: at most ``max_sessions`` (default 256); adding a request
    of a session not kept evicts the one that has been idle longest (``sessions_evicted`` counts
    them). LRU rather than "largest so far" because /stats is about what is running now: a session
    that ended yesterday should give way to today's, however big it was, and a new session must not
    be evicted for starting small. ``busiest(n)`` ranks the kept sessions by prompt tokens (input +
    cache read + cache write: everything the provider processed on the way in).
    """

    max_sessions: int = attrs.field(default=256, validator=attrs.validators.gt(0))
    requests: int = 0
    usage: Usage = Usage()
    sessions_evicted: int = 0
    _sessions: OrderedDict[str, SessionTotals] = attrs.field(factory=OrderedDict, init=False, repr=False)

    def add(self, usage: Usage, session: str = "-") -> None:
        """Count one request's billed usage (a request that reported none: ``Usage()``)."""
        self.requests += 1
        self.usage = self.usage + usage
        sessions = self._sessions
        entry = sessions.get(session)
        if entry is None:
            entry = sessions[session] = SessionTotals(session)
            if len(sessions) > self.max_sessions:
                sessions.popitem(last=False)
                self.sessions_evicted += 1
        else:
            sessions.move_to_end(session)
        entry.requests += 1
        entry.usage = entry.usage + usage

    @property
    def cache_write_read_ratio(self) -> float | None:
        """Cache-write tokens / cache-read tokens over every request; None when nothing was read."""
        return self.usage.cache_write_read_ratio

    def session(self, session: str) -> SessionTotals | None:
        """A kept session's totals (does not count as activity for the LRU)."""
        return self._sessions.get(session)

    def sessions(self) -> Iterable[SessionTotals]:
        """The kept sessions, least recently active first."""
        return iter(list(self._sessions.values()))

    def busiest(self, n: int = 10) -> list[SessionTotals]:
        """The ``n`` kept sessions with the most prompt tokens, busiest first."""
        return heapq.nlargest(n, self._sessions.values(), key=lambda s: (s.usage.prompt_tokens, s.requests))

    def as_dict(self, top: int = 10) -> dict[str, object]:
        """What /stats shows: totals, the ratio, and the ``top`` busiest sessions."""
        return {
            "requests": self.requests,
            **self.usage.as_dict(),
            "cache_write_read_ratio": _rounded(self.cache_write_read_ratio),
            "sessions_kept": len(self._sessions),
            "sessions_evicted": self.sessions_evicted,
            "busiest_sessions": [s.as_dict() for s in self.busiest(top)],
        }


# ---------------------------------------------------------------------------------------------
# Which session a request belongs to

_SESSION_HEADER = "x-claude-code-session-id"
_SESSION_MARK = "_session_"


def _text(value: object) -> str | None:
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    if isinstance(value, str):
        value = value.strip()
        return value or None
    return None


def _session_from_user_id(user_id: object) -> str | None:
    """Claude Code's ``metadata.user_id``: ``user_<hash>_account_<uuid>_session_<uuid>``, or (newer
    versions) a JSON object in a string with a ``session_id`` field."""
    user_id = _text(user_id)
    if user_id is None:
        return None
    if user_id.startswith("{"):
        try:
            doc = ujson.loads(user_id)
        except (ValueError, OverflowError):
            return None
        return _text(doc.get("session_id")) if isinstance(doc, dict) else None
    if _SESSION_MARK in user_id:
        return _text(user_id.rpartition(_SESSION_MARK)[2])
    return None


def _stable_content(content: object) -> object:
    """A message's content without what a client moves from turn to turn (``cache_control``)."""
    if isinstance(content, list):
        return [_stable_content(item) for item in content]
    if isinstance(content, dict):
        return {k: _stable_content(v) for k, v in content.items() if k != "cache_control"}
    return content


# ParsedBody.carried: whether each message is the user's; the first one's `_content_hash`.
_USERS = "usage: the user's messages"
_FIRST_USER = "usage: the first user message's hash"


def _first_user_content_hash(body: ParsedBody) -> str | None:
    """The first user message's `_content_hash`, looked at once per conversation: a turn whose
    first user message is the last turn's is answered as that one was (cg.wire.body.Messages)."""
    users = body.per_message(_USERS, "messages", _is_user)
    if True not in users:
        return None
    index = users.index(True)
    return body.up_to(_FIRST_USER, "messages", index,
                      lambda: _content_hash(cast("list[dict[str, object]]", body.value["messages"])[index]))


def _is_user(message: object) -> bool:
    return isinstance(message, dict) and message.get("role") == "user"


def _content_hash(message: dict[str, object]) -> str | None:
    content = message.get("content")
    if content is None or content == "" or content == []:
        return None
    try:
        canonical = ujson.dumps(_stable_content(content), sort_keys=True, ensure_ascii=False,
                                escape_forward_slashes=False)
    except (TypeError, ValueError, OverflowError):
        return None
    return "h:" + hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def session_key(headers_get: Callable[[str], str | None], body: ParsedBody | None) -> str:
    """The session a request belongs to, for per-session totals and the change log.

    In order: the ``x-claude-code-session-id`` header; the session in ``metadata.user_id``; ``h:``
    and 16 hex digits of a hash of the first user message's content (minus ``cache_control``,
    which Claude Code moves to the newest message every turn — so the key is stable across the
    turns of a conversation, and shared by conversations that open with the same message); else
    ``"-"``.
    """
    try:
        header = _text(headers_get(_SESSION_HEADER))
    except Exception:  # a header lookup that fails just means "no header"
        header = None
    if header is not None:
        return header
    if body is None:
        return "-"
    metadata = body.value.get("metadata")
    if isinstance(metadata, dict):
        found = _session_from_user_id(metadata.get("user_id"))
        if found is not None:
            return found
    return _first_user_content_hash(body) or "-"
