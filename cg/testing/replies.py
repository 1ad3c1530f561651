"""Replies: what the fake answers a request with, and what it answers when nothing is queued.

Each reply's ``play(request, upstream)`` answers one twisted.web request: ``JSONReply`` (a whole
JSON body), ``SSEReply`` (timed events, then a close, a reset or silence), ``Reset`` (abort the
connection), ``Stall`` (never answer), ``Flood`` (ping events as fast as the client reads).
``default_reply`` derives a plausible reply from the request (``x-fake-*`` headers shape it).
"""

from __future__ import annotations

import gzip as _gzip
import math
import zlib
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal, cast

import ujson
from attrs import field, frozen
from attrs.validators import gt, in_
from twisted.internet.interfaces import IDelayedCall, IPushProducer, IReactorTime, ITCPTransport
from twisted.python.failure import Failure
from twisted.web.http import HTTPChannel
from twisted.web.server import Request
from zope.interface import implementer

from cg.testing.builders import (
    HELLO,
    _cut,
    _dumps,
    anthropic_expand_block,
    anthropic_message,
    anthropic_stream_events,
    anthropic_text_block,
    openai_completion,
    openai_stream_events,
    responses_function_call,
    responses_message,
    responses_response,
    responses_stream_events,
)

if TYPE_CHECKING:
    from cg.testing.fake import FakeUpstream, Received

HeaderPairs = Sequence[tuple[str | bytes, str | bytes]]


def _b(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


def _transport(channel: HTTPChannel) -> ITCPTransport:
    """The channel's connection, TCP or TLS over TCP: both abort."""
    return cast(ITCPTransport, channel.transport)


def _start_response(
    request: Request, status: int, defaults: HeaderPairs, headers: HeaderPairs
) -> None:
    """Set status and headers; a name given in ``headers`` replaces that default entirely."""
    request.setResponseCode(status)
    given = {_b(name).lower() for name, _ in headers}
    for name, value in defaults:
        if _b(name) not in given:
            request.responseHeaders.setRawHeaders(_b(name), [_b(value)])
    for name, value in headers:
        request.responseHeaders.addRawHeader(_b(name), _b(value))


@frozen
class JSONReply:
    """A complete JSON response (dict/list serialized compactly, bytes sent as is)."""

    body: dict[str, Any] | list[Any] | bytes
    status: int = 200
    headers: HeaderPairs = field(default=(), converter=tuple)
    gzip: bool = False

    def play(self, request: Request, upstream: FakeUpstream) -> None:
        body = self.body if isinstance(self.body, bytes) else _dumps(self.body)
        upstream._sent_json(body)
        defaults = [(b"content-type", b"application/json")]
        if self.gzip:
            body = _gzip.compress(body, mtime=0)
            defaults.append((b"content-encoding", b"gzip"))
        defaults.append((b"content-length", b"%d" % len(body)))
        _start_response(request, self.status, defaults, self.headers)
        request.write(body)
        request.finish()


def _events(events: Iterable[bytes]) -> tuple[bytes, ...]:
    """``tuple``, typed: mypy's attrs plugin cannot read the generic ``tuple`` as a converter."""
    return tuple(events)


@frozen
class SSEReply:
    """A timed event stream; ``end`` says how it stops: finish, TCP reset, or silence forever."""

    events: Sequence[bytes] = field(converter=_events)
    delay: float = 0.0
    first_delay: float = 0.0
    status: int = 200
    headers: HeaderPairs = field(default=(), converter=tuple)
    gzip: bool = False
    end: Literal["close", "reset", "stall"] = field(
        default="close", validator=in_(("close", "reset", "stall"))
    )

    def play(self, request: Request, upstream: FakeUpstream) -> None:
        defaults = [(b"content-type", b"text/event-stream")]
        if self.gzip:
            defaults.append((b"content-encoding", b"gzip"))
        _start_response(request, self.status, defaults, self.headers)
        upstream._sent_events(self.events)
        request.write(b"")  # headers go out now, as a provider's do, before the first event
        # The reactor the fake listens on (`FakeUpstream.listen`): its clock too.
        _SSEPlayback(self, request, cast(IReactorTime, upstream.reactor)).start()


class _SSEPlayback:
    """Writes one SSEReply's events on reactor timers; stops if the client goes away."""

    def __init__(self, reply: SSEReply, request: Request, reactor: IReactorTime) -> None:
        self._reply = reply
        self._request = request
        self._reactor = reactor
        self._next = 0
        self._call: IDelayedCall | None = None
        # wbits=31: gzip framing, as Content-Encoding: gzip requires.
        self._zip = zlib.compressobj(wbits=31) if reply.gzip else None

    def start(self) -> None:
        self._request.notifyFinish().addErrback(self._lost)
        self._call = self._reactor.callLater(self._reply.first_delay, self._step)

    def _lost(self, _reason: Failure) -> None:
        if self._call is not None and self._call.active():
            self._call.cancel()

    def _step(self) -> None:
        events = self._reply.events
        if self._next < len(events):
            event = events[self._next]
            self._next += 1
            if self._zip is not None:
                # A sync flush makes each event decodable on arrival instead of at the end.
                event = self._zip.compress(event) + self._zip.flush(zlib.Z_SYNC_FLUSH)
            self._request.write(event)
        if self._next < len(events):
            self._call = self._reactor.callLater(self._reply.delay, self._step)
            return
        self._call = None
        if self._reply.end == "close":
            if self._zip is not None:
                self._request.write(self._zip.flush())
            self._request.finish()
        elif self._reply.end == "reset":
            # On the next reactor turn, once the last event has left Twisted's write buffer
            # (abortConnection drops whatever is still in it).
            self._call = self._reactor.callLater(0, _transport(self._request.channel).abortConnection)
        # "stall": leave the response open and silent.


@frozen
class Reset:
    """Abort the TCP connection as soon as the request arrives: no response byte at all."""

    def play(self, request: Request, upstream: FakeUpstream) -> None:
        _transport(request.channel).abortConnection()


@frozen
class Stall:
    """Never answer; the connection stays open until the client or ``stop()`` closes it."""

    def play(self, request: Request, upstream: FakeUpstream) -> None:
        pass


@frozen
class Flood:
    """``total_bytes`` of valid SSE ping events, written only as fast as the client reads."""

    total_bytes: int
    chunk_size: int = field(default=65536, validator=gt(0))

    def play(self, request: Request, upstream: FakeUpstream) -> None:
        _start_response(request, 200, [(b"content-type", b"text/event-stream")], ())
        _FloodProducer(self, request, upstream).start()


_PING = b'event: ping\ndata: {"type":"ping"}\n'


def _flood_chunk(size: int) -> bytes:
    """``size`` bytes of SSE: ``:`` comment lines, then a ping event (if it fits) and a blank line.

    The padding goes first: before a field line, even a 1-byte piece (a bare newline) only
    ends an empty event, so every chunk stays valid SSE whatever its size.
    """
    event = _PING if size > len(_PING) else b""
    pad = size - len(event) - 1
    lines = []
    while pad > 0:
        n = min(pad, 1024)
        lines.append(b":" + b"." * (n - 2) + b"\n" if n >= 2 else b"\n")
        pad -= n
    return b"".join(lines) + event + b"\n"


@implementer(IPushProducer)
class _FloodProducer:
    """Push producer for one Flood: the transport pauses it when its buffer is full."""

    def __init__(self, reply: Flood, request: Request, upstream: FakeUpstream) -> None:
        self._request = request
        self._upstream = upstream
        self._left = reply.total_bytes
        self._chunk = _flood_chunk(reply.chunk_size)
        self._paused = False
        self._stopped = False

    def start(self) -> None:
        self._request.notifyFinish().addErrback(lambda _: self.stopProducing())
        self._request.registerProducer(self, True)
        self._pump()

    def _pump(self) -> None:
        while self._left and not self._paused and not self._stopped:
            chunk = self._chunk if self._left >= len(self._chunk) else _flood_chunk(self._left)
            self._left -= len(chunk)
            self._upstream.flood_bytes_written += len(chunk)
            self._request.write(chunk)  # may call pauseProducing() before it returns
        if not self._left and not self._stopped:
            self._stopped = True
            self._request.unregisterProducer()
            self._request.finish()

    def pauseProducing(self) -> None:
        self._paused = True

    def resumeProducing(self) -> None:
        self._paused = False
        self._pump()

    def stopProducing(self) -> None:
        self._stopped = True


Reply = JSONReply | SSEReply | Reset | Stall | Flood


# ---------------------------------------------------------------------------------------------
# Default replies


def _fake_texts(n: int) -> list[str]:
    """``n`` non-empty fragments of HELLO (repeated when ``n`` exceeds its length)."""
    return _cut(" ".join([HELLO] * max(1, math.ceil(n / len(HELLO)))), n)


FAKE_EXPAND_ID = "toolu_fake_expand"  # the tool_use id of the expand call ``x-fake-expand`` plays


def _answers_fake_expand(body: dict[str, Any]) -> bool:
    """Whether the last user message of ``body`` holds a tool_result for the ``x-fake-expand`` call."""
    messages = body.get("messages")
    users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"] if isinstance(messages, list) else []
    content = users[-1].get("content") if users else None
    return isinstance(content, list) and any(
        isinstance(block, dict) and block.get("type") == "tool_result" and block.get("tool_use_id") == FAKE_EXPAND_ID
        for block in content
    )


FAKE_EXPAND_CALL_ID = "call_fake_expand"  # the call_id (Responses) or tool call id (chat) of ``x-fake-expand``'s call


def _answers_fake_expand_call(body: dict[str, Any]) -> bool:
    """Whether the Responses ``input`` of ``body`` holds a function_call_output for the ``x-fake-expand`` call."""
    items = body.get("input")
    return isinstance(items, list) and any(
        isinstance(item, dict) and item.get("type") == "function_call_output" and item.get("call_id") == FAKE_EXPAND_CALL_ID
        for item in items
    )


def _answers_fake_expand_tool_call(body: dict[str, Any]) -> bool:
    """Whether the chat ``messages`` of ``body`` hold a ``tool`` message for the ``x-fake-expand`` call."""
    messages = body.get("messages")
    return isinstance(messages, list) and any(
        isinstance(m, dict) and m.get("role") == "tool" and m.get("tool_call_id") == FAKE_EXPAND_CALL_ID
        for m in messages
    )


def _responses_reply(received: Received, body: dict[str, Any], model_kw: dict[str, Any]) -> Reply:
    """The default /v1/responses reply: a message, then (for ``x-fake-expand: REF``, until the input
    answers it) a ``context_guru_expand`` function_call asking for REF; streamed if the body asks."""
    n = int(received.header(b"x-fake-events") or 3)
    answered = _answers_fake_expand_call(body)
    # Each response's items have ids of their own, as the API gives them (the SDK checks).
    output = [responses_message("".join(_fake_texts(n)), "msg_fake_after_expand" if answered else "msg_fake")]
    asked = received.header(b"x-fake-expand")
    if asked and not answered:
        arguments = _dumps({"id": asked.decode("utf-8", "replace")}).decode()
        output.append(responses_function_call("context_guru_expand", arguments, FAKE_EXPAND_CALL_ID, "fc_fake_expand"))
    if body.get("stream") is not True:
        return JSONReply(responses_response(output, **model_kw))
    return SSEReply(
        responses_stream_events(output, deltas=n, **model_kw),
        delay=float(received.header(b"x-fake-delay-ms") or 0) / 1000,
        first_delay=float(received.header(b"x-fake-first-delay-ms") or 0) / 1000,
    )


def default_reply(received: Received) -> Reply:
    """What the fake answers when nothing is queued: a plausible reply for the path and body.

    Streams can be shaped per request (for benchmarks) with ``x-fake-events``,
    ``x-fake-delay-ms`` and ``x-fake-first-delay-ms``. ``x-fake-expand: REF`` plays a model that
    asks for an original. On /v1/messages the reply is a text block, then a ``context_guru_expand``
    call (id ``FAKE_EXPAND_ID``) asking for REF, ``stop_reason: "tool_use"``; a request whose last
    user message holds a ``tool_result`` for that call gets the normal reply. On /v1/responses the
    message is followed by a ``context_guru_expand`` function_call (call_id ``FAKE_EXPAND_CALL_ID``),
    until the request's ``input`` holds a ``function_call_output`` for it. On /v1/chat/completions
    the text is followed by a ``context_guru_expand`` tool call (id ``FAKE_EXPAND_CALL_ID``),
    ``finish_reason: "tool_calls"``, until the request's ``messages`` hold a ``tool`` message for it.
    """
    try:
        body = ujson.loads(received.body)
    except ValueError:
        body = None
    if not isinstance(body, dict):
        body = {}
    model = body.get("model")
    model_kw: dict[str, Any] = {"model": model} if isinstance(model, str) else {}
    if received.usage is not None:  # the fake's prompt cache billed it
        model_kw["usage"] = received.usage
    path = received.path.split(b"?", 1)[0]
    if path == b"/v1/messages/count_tokens":
        return JSONReply({"input_tokens": 10})
    if path == b"/v1/responses":
        return _responses_reply(received, body, model_kw)
    anthropic = path == b"/v1/messages" or path.startswith(b"/v1/messages/")
    openai = path == b"/v1/chat/completions"
    asked = received.header(b"x-fake-expand") if path == b"/v1/messages" or openai else None
    answered = _answers_fake_expand_tool_call(body) if openai else _answers_fake_expand(body)
    expand = asked.decode("utf-8", "replace") if asked and not answered else None
    call = _dumps({"id": expand}).decode() if expand else ""
    if body.get("stream") is True and (anthropic or openai):
        texts = _fake_texts(int(received.header(b"x-fake-events") or 3))
        if anthropic and expand:
            parts = ("", call[:8], call[8:])  # cut mid-string, as the API's input_json_delta may be
            blocks = [anthropic_text_block(0, texts), anthropic_expand_block(1, expand, FAKE_EXPAND_ID, parts)]
            events = anthropic_stream_events(blocks=blocks, stop_reason="tool_use", **model_kw)
        elif anthropic:
            events = anthropic_stream_events(texts, **model_kw)
        else:
            options = body.get("stream_options")
            include_usage = isinstance(options, dict) and options.get("include_usage") is True
            calls = [(FAKE_EXPAND_CALL_ID, "context_guru_expand", (call[:8], call[8:]))] if expand else []
            events = openai_stream_events(texts, include_usage=include_usage, calls=calls, **model_kw)
        return SSEReply(
            events,
            delay=float(received.header(b"x-fake-delay-ms") or 0) / 1000,
            first_delay=float(received.header(b"x-fake-first-delay-ms") or 0) / 1000,
        )
    if anthropic and expand:
        content = [
            {"type": "text", "text": HELLO},
            {"type": "tool_use", "id": FAKE_EXPAND_ID, "name": "context_guru_expand", "input": {"id": expand}},
        ]
        return JSONReply(anthropic_message(content=content, stop_reason="tool_use", **model_kw))
    if anthropic:
        return JSONReply(anthropic_message(**model_kw))
    if openai:
        made = [(FAKE_EXPAND_CALL_ID, "context_guru_expand", call)] if expand else []
        return JSONReply(openai_completion(calls=made, **model_kw))
    return JSONReply({"ok": True})

