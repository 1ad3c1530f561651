"""A scripted fake Anthropic/OpenAI API: a real twisted.web server for tests and benchmarks.

Like ``treq.testing`` it ships with the package, so the proxy's tests, its benchmarks and
downstream users all drive the same fake. Replies are queued in order (``FakeUpstream.enqueue``);
when the queue is empty a default reply is derived from the request. Every request is recorded
byte for byte (``FakeUpstream.received``) so tests can check what the proxy really forwarded.

Run ``python -m cg.testing --port 0`` to serve it from a separate process (it prints
``listening <port>``).

For tests without sockets, `MemoryUpstream` (cg.testing.memory) stands in for cg's upstream
client itself: each request waits for the test to answer it, on whatever clock the test runs.
"""

from __future__ import annotations

import argparse
import gzip as _gzip
import itertools
import json
import math
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, cast

import ujson
from attrs import define, field, frozen
from attrs.validators import gt, in_
from twisted.internet.address import IPv4Address, IPv6Address
from twisted.internet.defer import Deferred, gatherResults
from twisted.internet.error import ConnectionDone, ConnectionLost
from twisted.internet.interfaces import IListeningPort, IPushProducer, IReactorSSL, IReactorTCP, ITCPTransport
from twisted.internet.protocol import connectionDone
from twisted.python.failure import Failure
from twisted.web.http import HTTPChannel
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request, Site
from zope.interface import implementer

from cg.testing.memory import MemoryRequest, MemoryResponse, MemoryUpstream

__all__ = [
    "FAKE_EXPAND_CALL_ID",
    "FAKE_EXPAND_ID",
    "HELLO",
    "FakeUpstream",
    "Flood",
    "JSONReply",
    "MemoryRequest",
    "MemoryResponse",
    "MemoryUpstream",
    "Received",
    "Reset",
    "SSEReply",
    "Stall",
    "anthropic_message",
    "anthropic_stream_events",
    "anthropic_text_block",
    "anthropic_request_problems",
    "default_reply",
    "openai_completion",
    "openai_request_problems",
    "openai_stream_events",
    "responses_function_call",
    "responses_message",
    "responses_reasoning",
    "responses_request_problems",
    "responses_response",
    "responses_stream_events",
    "sse_event",
]

HELLO = "Hello from the fake upstream"
_CREATED = 1_700_000_000  # fixed OpenAI "created" so replies are byte-for-byte reproducible

HeaderPairs = Sequence[tuple[str | bytes, str | bytes]]


def _dumps(obj: object) -> bytes:
    """Compact JSON the way the providers (and Claude Code) write it: no spaces, raw UTF-8."""
    return ujson.dumps(obj, ensure_ascii=False, escape_forward_slashes=False).encode()


def _b(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


# ---------------------------------------------------------------------------------------------
# Builders


def sse_event(name: str | None, data: dict | list | str) -> bytes:
    """One framed SSE event; ``name=None`` omits the event line, as OpenAI does."""
    payload = data.encode() if isinstance(data, str) else _dumps(data)
    head = b"" if name is None else b"event: " + name.encode() + b"\n"
    return head + b"data: " + payload + b"\n\n"


def claude_code_bytes(body) -> bytes:
    """A request body serialized as Claude Code does (JSON.stringify: no spaces, non-ASCII and '/' raw)."""
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


def command_output(lines: int = 900) -> str:
    """A big Bash output cg offloads: a test log with one failure in the middle, non-ASCII included."""
    out = [f"PASS src/module_{i:04d}.test.ts (0.{i % 97:02d} s) — ✓ renders héllo/world" for i in range(lines)]
    out[lines // 2] = "FAIL src/broken.test.ts: Error: expected 3 to equal 4"
    return "\n".join(out) + "\n"


def anthropic_message(
    text: str = HELLO,
    id: str = "msg_fake",
    model: str = "claude-opus-4-8",
    stop_reason: str = "end_turn",
    usage: dict | None = None,
    content: list | None = None,
) -> dict:
    """A non-streaming Messages API response; ``content`` defaults to one text block."""
    return {
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": text}] if content is None else content,
        "stop_reason": stop_reason,
        "stop_sequence": None,
        "usage": usage
        if usage is not None
        else {
            "input_tokens": 10,
            "output_tokens": 5,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        },
    }


def anthropic_text_block(index: int, texts: Sequence[str]) -> list[bytes]:
    """The events of one streamed text block at ``index``: start, a text_delta per text, stop."""
    return [
        sse_event(
            "content_block_start",
            {
                "type": "content_block_start",
                "index": index,
                "content_block": {"type": "text", "text": ""},
            },
        ),
        *(
            sse_event(
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": index,
                    "delta": {"type": "text_delta", "text": t},
                },
            )
            for t in texts
        ),
        sse_event("content_block_stop", {"type": "content_block_stop", "index": index}),
    ]


def anthropic_block_start(index: int, block: dict) -> bytes:
    return sse_event("content_block_start", {"type": "content_block_start", "index": index, "content_block": block})


def anthropic_block_delta(index: int, delta: dict) -> bytes:
    return sse_event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})


def anthropic_block_stop(index: int) -> bytes:
    return sse_event("content_block_stop", {"type": "content_block_stop", "index": index})


def anthropic_thinking_block(
    index: int, thought: str = "I should expand the marker.", signature: str = "EqQBsig=="
) -> list[bytes]:
    """A streamed thinking block: thinking deltas, then its signature just before the stop."""
    return [
        anthropic_block_start(index, {"type": "thinking", "thinking": "", "signature": ""}),
        anthropic_block_delta(index, {"type": "thinking_delta", "thinking": thought[:5]}),
        anthropic_block_delta(index, {"type": "thinking_delta", "thinking": thought[5:]}),
        anthropic_block_delta(index, {"type": "signature_delta", "signature": signature}),
        anthropic_block_stop(index),
    ]


def anthropic_tool_block(
    index: int, name: str = "Bash", parts: Sequence[str] = ("", '{"command": ', '"ls -la"}'), id: str | None = None
) -> list[bytes]:
    """A streamed tool_use block; its input travels in input_json_delta ``parts``, as the API sends it."""
    block = {"type": "tool_use", "id": id or f"toolu_{name}_{index}", "name": name, "input": {}}
    deltas = [anthropic_block_delta(index, {"type": "input_json_delta", "partial_json": p}) for p in parts]
    return [anthropic_block_start(index, block), *deltas, anthropic_block_stop(index)]


def anthropic_expand_block(
    index: int, ref: str = "0123456789abcdef", id: str | None = None, parts: Sequence[str] | None = None
) -> list[bytes]:
    """A streamed ``context_guru_expand`` call asking for ``ref``."""
    if parts is None:
        parts = ("", '{"id": "', ref[:6], ref[6:] + '"}')
    return anthropic_tool_block(index, "context_guru_expand", parts, id or f"toolu_expand_{index}")


def anthropic_stream_events(
    texts: Sequence[str] = ("Hello", " world"),
    id: str = "msg_fake",
    model: str = "claude-opus-4-8",
    stop_reason: str = "end_turn",
    input_tokens: int = 10,
    output_tokens: int = 5,
    blocks: Sequence[Sequence[bytes]] | None = None,
) -> list[bytes]:
    """A complete Messages stream; ``blocks`` (each a block's events) replaces the one text block."""
    start = {
        "type": "message_start",
        "message": {
            "id": id,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": input_tokens,
                "output_tokens": 1,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
            },
        },
    }
    delta = {
        "type": "message_delta",
        "delta": {"stop_reason": stop_reason, "stop_sequence": None},
        "usage": {"output_tokens": output_tokens},
    }
    if blocks is None:
        blocks = [anthropic_text_block(0, texts)]
    return [
        sse_event("message_start", start),
        sse_event("ping", {"type": "ping"}),
        *itertools.chain.from_iterable(blocks),
        sse_event("message_delta", delta),
        sse_event("message_stop", {"type": "message_stop"}),
    ]


def openai_completion(
    text: str = HELLO,
    id: str = "chatcmpl-fake",
    model: str = "gpt-4.1-mini",
    finish_reason: str = "stop",
    usage: dict | None = None,
    calls: Sequence[tuple[str, str, str]] = (),
) -> dict:
    """A non-streaming chat.completion; ``calls`` are (id, name, arguments) tool calls after the text
    (the finish_reason is then ``tool_calls``)."""
    message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
    if calls:
        message["tool_calls"] = [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            for call_id, name, arguments in calls
        ]
        finish_reason = "tool_calls"
    return {
        "id": id,
        "object": "chat.completion",
        "created": _CREATED,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": finish_reason,
                "logprobs": None,
            }
        ],
        "usage": usage
        if usage is not None
        else {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
    }


def openai_stream_events(
    texts: Sequence[str] = ("Hello", " world"),
    id: str = "chatcmpl-fake",
    model: str = "gpt-4.1-mini",
    finish_reason: str = "stop",
    include_usage: bool = True,
    prompt_tokens: int = 10,
    completion_tokens: int = 5,
    calls: Sequence[tuple[str, str, Sequence[str]]] = (),
) -> list[bytes]:
    """A chat.completion.chunk stream: role, content fragments, finish, [usage], ``[DONE]``.

    ``calls`` are (id, name, argument fragments) tool calls streamed after the content, each as the
    API streams one: a chunk with its id, name and empty arguments, then a chunk per fragment (the
    finish_reason is then ``tool_calls``).
    """

    def chunk(choices: list, usage: dict | None = None) -> bytes:
        body = {"id": id, "object": "chat.completion.chunk", "created": _CREATED, "model": model}
        body["choices"] = choices
        if include_usage:  # real OpenAI adds "usage": null to every chunk only when asked
            body["usage"] = usage
        return sse_event(None, body)

    def choice(delta: dict, finish: str | None = None) -> list:
        return [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]

    events = [chunk(choice({"role": "assistant", "content": ""}))]
    events += [chunk(choice({"content": t})) for t in texts]
    for i, (call_id, name, parts) in enumerate(calls):
        opened = {"index": i, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}
        events.append(chunk(choice({"tool_calls": [opened]})))
        events += [chunk(choice({"tool_calls": [{"index": i, "function": {"arguments": p}}]})) for p in parts]
    events.append(chunk(choice({}, "tool_calls" if calls else finish_reason)))
    if include_usage:
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        events.append(chunk([], usage))
    events.append(sse_event(None, "[DONE]"))
    return events


def responses_message(text: str = HELLO, id: str = "msg_fake") -> dict:
    """A finished Responses ``message`` output item holding one ``output_text`` part."""
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"id": id, "type": "message", "status": "completed", "role": "assistant", "content": [part]}


def responses_function_call(
    name: str, arguments: str, call_id: str = "call_fake", id: str = "fc_fake"
) -> dict:
    """A finished Responses ``function_call`` output item; ``arguments`` is the JSON text, as sent."""
    return {
        "id": id,
        "type": "function_call",
        "status": "completed",
        "arguments": arguments,
        "call_id": call_id,
        "name": name,
    }


def responses_reasoning(encrypted_content: str = "gAAAAfake==", id: str = "rs_fake") -> dict:
    """A Responses ``reasoning`` output item with no summary, as sent when encrypted content is included."""
    return {"id": id, "type": "reasoning", "summary": [], "encrypted_content": encrypted_content}


def responses_response(
    output: Sequence[dict] | None = None,
    id: str = "resp_fake",
    model: str = "gpt-5.5",
    status: str = "completed",
    input_tokens: int = 10,
    output_tokens: int = 5,
) -> dict:
    """A Responses API ``response`` object; ``output`` (finished items) defaults to one message."""
    return {
        "id": id,
        "object": "response",
        "created_at": _CREATED,
        "status": status,
        "error": None,
        "incomplete_details": None,
        "instructions": None,
        "model": model,
        "output": [responses_message()] if output is None else list(output),
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "usage": {
            "input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens,
        },
    }


def _cut(text: str, n: int) -> list[str]:
    """``text`` in ``n`` consecutive pieces of near-equal length, the empty ones dropped."""
    return [p for p in (text[len(text) * i // n : len(text) * (i + 1) // n] for i in range(n)) if p]


def _item_events(index: int, item: dict, deltas: int) -> list[dict]:
    """The events of one output item at ``index``, without ``sequence_number``: added, the
    message's parts or the call's argument deltas, done."""
    at = {"item_id": item["id"], "output_index": index}
    if item["type"] == "message":
        started = dict(item, status="in_progress", content=[])
    elif item["type"] == "function_call":
        started = dict(item, status="in_progress", arguments="")
    else:
        started = dict(item, summary=[]) if item["type"] == "reasoning" else item
    events = [{"type": "response.output_item.added", "output_index": index, "item": started}]
    if item["type"] == "message":
        for c, part in enumerate(item["content"]):  # output_text parts
            text = {**at, "content_index": c}
            events.append({"type": "response.content_part.added", **text, "part": dict(part, text="")})
            events += [
                {"type": "response.output_text.delta", **text, "delta": d, "logprobs": []}
                for d in _cut(part["text"], deltas)
            ]
            events.append({"type": "response.output_text.done", **text, "text": part["text"], "logprobs": []})
            events.append({"type": "response.content_part.done", **text, "part": part})
    elif item["type"] == "function_call":
        events += [
            {"type": "response.function_call_arguments.delta", **at, "delta": d}
            for d in _cut(item["arguments"], deltas)
        ]
        events.append({"type": "response.function_call_arguments.done", **at, "arguments": item["arguments"]})
    events.append({"type": "response.output_item.done", "output_index": index, "item": item})
    return events


def responses_stream_events(
    output: Sequence[dict] | None = None,
    deltas: int = 2,
    id: str = "resp_fake",
    model: str = "gpt-5.5",
    input_tokens: int = 10,
    output_tokens: int = 5,
) -> list[bytes]:
    """A streamed Responses API reply, as the real API frames it (``event:`` lines, a
    ``sequence_number`` on each event): created, in_progress, each item of ``output`` (default one
    message) with its text or arguments in ``deltas`` fragments, then ``response.completed``
    carrying the whole response."""
    final = responses_response(output, id, model, "completed", input_tokens, output_tokens)
    pending = dict(final, status="in_progress", output=[], usage=None)
    events = [
        {"type": "response.created", "response": pending},
        {"type": "response.in_progress", "response": pending},
        *itertools.chain.from_iterable(_item_events(i, item, deltas) for i, item in enumerate(final["output"])),
        {"type": "response.completed", "response": final},
    ]
    return [sse_event(e["type"], {**e, "sequence_number": n}) for n, e in enumerate(events)]


# ---------------------------------------------------------------------------------------------
# Requests as received


def _client_left(failure):
    """The client went away: "lost". Anything else (a test's timeout cancelling the wait) stays a failure."""
    failure.trap(ConnectionDone, ConnectionLost)
    return "lost"


@define
class Received:
    """One request as the fake saw it, for asserting what a proxy really forwarded."""

    method: bytes
    path: bytes  # with the query string, exactly as on the request line
    headers: list[tuple[bytes, bytes]]  # in arrival order, names lower-cased, values as sent
    body: bytes
    connection: int  # serial number of the TCP connection, from 1
    nth_on_connection: int  # 1 for the first request on its connection
    finished: Deferred = field(eq=False, repr=False)  # fires "done" or "lost"

    def header(self, name: bytes) -> bytes | None:
        """The first value of header ``name`` (case-insensitive), or None."""
        name = name.lower()
        return next((v for n, v in self.headers if n == name), None)

    def json(self) -> object:
        """The body parsed as JSON."""
        return ujson.loads(self.body)


# ---------------------------------------------------------------------------------------------
# Replies. Each one's play(request, upstream) answers a twisted.web request.


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

    body: dict | list | bytes
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
        _SSEPlayback(self, request, upstream.reactor).start()


class _SSEPlayback:
    """Writes one SSEReply's events on reactor timers; stops if the client goes away."""

    def __init__(self, reply: SSEReply, request: Request, reactor) -> None:
        self._reply = reply
        self._request = request
        self._reactor = reactor
        self._next = 0
        self._call = None
        # wbits=31: gzip framing, as Content-Encoding: gzip requires.
        self._zip = zlib.compressobj(wbits=31) if reply.gzip else None

    def start(self) -> None:
        self._request.notifyFinish().addErrback(self._lost)
        self._call = self._reactor.callLater(self._reply.first_delay, self._step)

    def _lost(self, _reason) -> None:
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


def _answers_fake_expand(body: dict) -> bool:
    """Whether the last user message of ``body`` holds a tool_result for the ``x-fake-expand`` call."""
    messages = body.get("messages")
    users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"] if isinstance(messages, list) else []
    content = users[-1].get("content") if users else None
    return isinstance(content, list) and any(
        isinstance(block, dict) and block.get("type") == "tool_result" and block.get("tool_use_id") == FAKE_EXPAND_ID
        for block in content
    )


FAKE_EXPAND_CALL_ID = "call_fake_expand"  # the call_id (Responses) or tool call id (chat) of ``x-fake-expand``'s call


def _answers_fake_expand_call(body: dict) -> bool:
    """Whether the Responses ``input`` of ``body`` holds a function_call_output for the ``x-fake-expand`` call."""
    items = body.get("input")
    return isinstance(items, list) and any(
        isinstance(item, dict) and item.get("type") == "function_call_output" and item.get("call_id") == FAKE_EXPAND_CALL_ID
        for item in items
    )


def _answers_fake_expand_tool_call(body: dict) -> bool:
    """Whether the chat ``messages`` of ``body`` hold a ``tool`` message for the ``x-fake-expand`` call."""
    messages = body.get("messages")
    return isinstance(messages, list) and any(
        isinstance(m, dict) and m.get("role") == "tool" and m.get("tool_call_id") == FAKE_EXPAND_CALL_ID
        for m in messages
    )


def _responses_reply(received: Received, body: dict, model_kw: dict[str, Any]) -> Reply:
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


# ---------------------------------------------------------------------------------------------
# Strict mode: check requests as the real APIs do


def _cache_marks(body: dict) -> int:
    """How many blocks carry ``cache_control``: tools, system blocks, message blocks and their parts."""
    def marked(items: object) -> list[dict]:
        return [item for item in items if isinstance(item, dict)] if isinstance(items, list) else []

    blocks = marked(body.get("tools")) + marked(body.get("system"))
    for message in marked(body.get("messages")):
        for block in marked(message.get("content")):
            blocks += [block, *marked(block.get("content"))]
    return sum(block.get("cache_control") is not None for block in blocks)


def anthropic_request_problems(
    body: object, thinking: dict[str, object] | None = None, redacted: set[str] | frozenset = frozenset()
) -> list[str]:
    """Why the Messages API would reject ``body`` (empty if it would not), for what cg can break.

    Each assistant message's ``tool_use`` ids must be answered, in order, by the ``tool_result``
    blocks of the next message (a user message; ``role: "system"`` entries are skipped), and a
    ``tool_result`` must answer the message before; at most 4 ``cache_control`` blocks; a thinking
    block must carry a signature in ``thinking`` (signature -> text, what the fake sent) with its
    text unaltered, a redacted_thinking block ``data`` in ``redacted``.
    """
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
        return ["messages: Field required"]
    thinking = thinking or {}
    problems = []
    expected: list = []  # the tool_use ids the next message must answer
    previous = None
    for i, message in enumerate(body["messages"]):
        if not isinstance(message, dict) or message.get("role") == "system":
            continue
        role = message.get("role")
        content = message.get("content")
        blocks = [b for b in content if isinstance(b, dict)] if isinstance(content, list) else []
        results = [b.get("tool_use_id") for b in blocks if b.get("type") == "tool_result"]
        if results != expected:
            problems.append(
                f"messages.{i}: tool_result ids {results} do not answer the tool_use ids {expected} "
                f"of messages.{previous}, in order: each `tool_use` block must have a corresponding "
                "`tool_result` block in the next message"
            )
        expected = [b.get("id") for b in blocks if b.get("type") == "tool_use"] if role == "assistant" else []
        previous = i
        for j, block in enumerate(blocks if role == "assistant" else ()):
            where = f"messages.{i}.content.{j}"
            if block.get("type") == "thinking":
                signature = block.get("signature")
                if signature not in thinking:
                    problems.append(f"{where}: Invalid `signature` in `thinking` block")
                elif thinking[signature] != block.get("thinking"):
                    problems.append(f"{where}: `thinking` block altered since the model produced it")
            elif block.get("type") == "redacted_thinking" and block.get("data") not in redacted:
                problems.append(f"{where}: Invalid `data` in `redacted_thinking` block")
    if expected:
        problems.append(
            f"messages.{previous}: `tool_use` ids were found without `tool_result` blocks "
            f"immediately after: {', '.join(map(str, expected))}"
        )
    marks = _cache_marks(body)
    if marks > 4:
        problems.append(f"A maximum of 4 blocks with cache_control may be provided. Found {marks}.")
    return problems


def openai_request_problems(body: object) -> list[str]:
    """Why chat.completions would reject ``body``: every assistant ``tool_calls`` id answered by a
    ``role: "tool"`` message before the next other message, and no tool message answering none."""
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
        return ["messages: Field required"]
    problems = []
    pending: list = []
    previous = None
    for i, message in enumerate(body["messages"]):
        if not isinstance(message, dict):
            continue
        if message.get("role") == "tool":
            if message.get("tool_call_id") in pending:
                pending.remove(message.get("tool_call_id"))
            else:
                problems.append(
                    f"messages.{i}: messages with role 'tool' must be a response to a preceding "
                    f"message with 'tool_calls' ({message.get('tool_call_id')!r} is not pending)"
                )
            continue
        if pending:
            problems.append(
                f"messages.{previous}: an assistant message with 'tool_calls' must be followed by tool "
                f"messages responding to each 'tool_call_id'; missing before messages.{i}: {pending}"
            )
        calls = message.get("tool_calls") if message.get("role") == "assistant" else None
        pending = [c.get("id") for c in calls if isinstance(c, dict)] if isinstance(calls, list) else []
        previous = i
    if pending:
        problems.append(
            f"messages.{previous}: an assistant message with 'tool_calls' must be followed by tool "
            f"messages responding to each 'tool_call_id'; missing: {pending}"
        )
    return problems


_CALLS = {"function_call_output": "function_call", "custom_tool_call_output": "custom_tool_call"}


def responses_request_problems(body: object) -> list[str]:
    """Why the Responses API would reject ``body`` (empty if it would not), for what cg can break:
    ``input`` a string or a list of objects; each call output answering a call earlier in ``input``
    and each call answered (the API's own messages for function calls); ``tools`` a list of objects
    with a ``type``, function tools named."""
    if not isinstance(body, dict) or not isinstance(body.get("input"), (str, list)):
        return ["input: a string or a list of items is required"]
    problems = []
    calls: dict[object, str] = {}  # call_id -> the call's type, for those not answered yet
    for i, item in enumerate(body["input"] if isinstance(body["input"], list) else ()):
        if not isinstance(item, dict):
            problems.append(f"input[{i}]: an item must be an object")
        elif item.get("type") in _CALLS.values():
            calls[item.get("call_id")] = item["type"]
        elif item.get("type") in _CALLS and calls.pop(item.get("call_id"), None) != _CALLS[item["type"]]:
            kind = item["type"].replace("_", " ")
            problems.append(f"input[{i}]: No tool call found for {kind} with call_id {item.get('call_id')}.")
    problems += [f"No tool output found for {kind.replace('_', ' ')} {call_id}." for call_id, kind in calls.items()]
    tools = body.get("tools", [])
    if not isinstance(tools, list):
        return [*problems, "tools: must be a list"]
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
            problems.append(f"Missing required parameter: 'tools[{i}].type'.")
        elif tool["type"] == "function" and not isinstance(tool.get("name"), str):
            problems.append(f"Missing required parameter: 'tools[{i}].name'.")
    return problems

def _sse_data(event: bytes) -> object:
    """The JSON of one framed event's data lines, or None."""
    lines = [line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
    try:
        return ujson.loads(b"\n".join(lines)) if lines else None
    except ValueError:
        return None


def _block_thinking(block: object, thinking: dict[str, object], redacted: set[str]) -> None:
    if not isinstance(block, dict):
        return
    if block.get("type") == "thinking" and block.get("signature"):
        thinking[block["signature"]] = block.get("thinking")
    elif block.get("type") == "redacted_thinking" and isinstance(block.get("data"), str):
        redacted.add(block["data"])


# ---------------------------------------------------------------------------------------------
# The server


def _transport(channel: HTTPChannel) -> ITCPTransport:
    """The channel's connection, TCP or TLS over TCP: both abort."""
    return cast(ITCPTransport, channel.transport)


def _port_number(port: IListeningPort) -> int:
    address = port.getHost()
    assert isinstance(address, (IPv4Address, IPv6Address))  # the fake listens on TCP
    return address.port


class _Request(Request):
    """Keeps the header lines as they arrived (twisted.web's Headers merge and reorder them)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.raw_headers: list[tuple[bytes, bytes]] = []


class _Channel(HTTPChannel):
    """An HTTP/1.1 connection that the fake numbers, counts requests on and can abort.

    HTTPChannel.connectionMade already sets TCP_NODELAY, so each SSE write leaves at once.
    """

    def connectionMade(self) -> None:
        super().connectionMade()
        self.upstream: FakeUpstream = self.factory.upstream
        self.serial = self.upstream._connected(self)
        self.requests_seen = 0
        self.closed: Deferred[None] = Deferred()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.upstream._channels.discard(self)
        super().connectionLost(reason)
        self.closed.callback(None)

    def headerReceived(self, line: bytes) -> bool:
        ok = super().headerReceived(line)
        if ok:
            name, value = line.split(b":", 1)
            self.requests[-1].raw_headers.append((name.lower(), value.strip(b" \t")))
        return ok


class _Root(Resource):
    isLeaf = True

    def __init__(self, upstream: FakeUpstream) -> None:
        super().__init__()
        self._upstream = upstream

    def render(self, request: _Request):
        self._upstream._handle(request)
        return NOT_DONE_YET


class _Site(Site):
    # Plain HTTP/1.1, no h2 negotiation wrapper: we need the channel itself (which the
    # annotation of Site.protocol, the wrapper's factory, does not foresee).
    protocol = _Channel  # type: ignore[assignment]

    def __init__(self, upstream: FakeUpstream, reactor) -> None:
        super().__init__(_Root(upstream), requestFactory=_Request, reactor=reactor)
        self.upstream = upstream


@define(eq=False)
class FakeUpstream:
    """A fake provider API on a real TCP port, answering from a FIFO of scripted replies.

    ``reset_reused_connections`` is a budget: while positive, a request that is not the first on
    its connection gets the connection aborted (as a server closing an idle keep-alive
    connection would) and the budget drops by one. Such requests are recorded but use no reply.

    ``strict`` (off by default) checks each /v1/messages, /v1/chat/completions and /v1/responses
    request as the real API does (``anthropic_request_problems``, ``openai_request_problems``,
    ``responses_request_problems``; thinking blocks are checked against every one the fake has
    sent, JSON or SSE). A request that fails is recorded, its reasons appended to ``rejections``,
    and answered 400 in the provider's error shape without using a queued reply.

    ``record`` (on by default) keeps every request in ``received``; off, nothing is kept, as in a
    benchmark's fake process that nobody reads and that would otherwise hold every body it was sent.
    """

    default_reply: Callable[[Received], Reply] = default_reply
    reset_reused_connections: int = 0
    strict: bool = False
    record: bool = True
    rejections: list[str] = field(factory=list, init=False)
    _thinking: dict[str, object] = field(factory=dict, init=False)  # signature -> text, as sent
    _redacted: set[str] = field(factory=set, init=False)  # redacted_thinking data, as sent
    received: list[Received] = field(factory=list, init=False)
    flood_bytes_written: int = field(default=0, init=False)  # by Flood replies, cumulative
    reactor: IReactorTCP | None = field(default=None, init=False)
    url: str | None = field(default=None, init=False)
    _queue: deque[Reply] = field(factory=deque, init=False)
    _port: IListeningPort | None = field(default=None, init=False)
    _channels: set[_Channel] = field(factory=set, init=False)
    _serials: itertools.count = field(factory=lambda: itertools.count(1), init=False)

    def listen(
        self, reactor: IReactorTCP, port: int = 0, interface: str = "127.0.0.1", tls=None
    ) -> IListeningPort:
        """Start serving; returns the IListeningPort and sets ``url``.

        ``tls``, a TLS context factory (e.g. ``ssl.CertificateOptions``), serves HTTPS.
        """
        self.reactor = reactor
        site = _Site(self, reactor)
        if tls is None:
            # Twisted's annotations: a Site is a ServerFactory of the h2 wrapper, which its
            # _ProtoWithFactory bound does not admit.
            self._port = reactor.listenTCP(port, site, interface=interface)  # type: ignore[arg-type]
        else:
            self._port = cast(IReactorSSL, reactor).listenSSL(port, site, tls, interface=interface)
        host = f"[{interface}]" if ":" in interface else interface
        scheme = "http" if tls is None else "https"
        self.url = f"{scheme}://{host}:{_port_number(self._port)}"
        return self._port

    def enqueue(self, *replies: Reply) -> None:
        """Script the replies of the next requests, in order, whatever their path."""
        self._queue.extend(replies)

    def stop(self) -> Deferred[None]:
        """Stop listening and abort every open connection; fires once all are closed."""
        waits: list[Deferred[None]] = []
        if self._port is not None:
            stopped = self._port.stopListening()  # "may return a Deferred"
            if stopped is not None:
                waits.append(stopped)
            self._port = None
        for channel in list(self._channels):
            _transport(channel).abortConnection()
            waits.append(channel.closed)
        return gatherResults(waits).addCallback(lambda _: None)

    def _connected(self, channel: _Channel) -> int:
        self._channels.add(channel)
        return next(self._serials)

    def _handle(self, request: _Request) -> None:
        channel = cast(_Channel, request.channel)  # _Site.protocol
        channel.requests_seen += 1
        assert request.content is not None  # set before the request is handled
        received = Received(
            method=request.method,
            path=request.uri,
            headers=request.raw_headers,
            body=request.content.read(),
            connection=channel.serial,
            nth_on_connection=channel.requests_seen,
            finished=request.notifyFinish().addCallbacks(lambda _: "done", _client_left),
        )
        if self.record:
            self.received.append(received)
        if received.nth_on_connection >= 2 and self.reset_reused_connections > 0:
            self.reset_reused_connections -= 1
            Reset().play(request, self)
            return
        if self.strict and self._reject(received, request):
            return
        reply = self._queue.popleft() if self._queue else self.default_reply(received)
        reply.play(request, self)


    def _reject(self, received: Received, request: Request) -> bool:
        """In strict mode: answer 400 if the API would reject the request."""
        path = received.path.split(b"?", 1)[0]
        if path not in (b"/v1/messages", b"/v1/chat/completions", b"/v1/responses"):
            return False
        try:
            body = ujson.loads(received.body)
        except ValueError:
            body = None
        if path == b"/v1/messages":
            problems = anthropic_request_problems(body, self._thinking, self._redacted)
        elif path == b"/v1/responses":
            problems = responses_request_problems(body)
        else:
            problems = openai_request_problems(body)
        if not problems:
            return False
        self.rejections += problems
        message = "; ".join(problems)
        if path == b"/v1/messages":
            error = {"type": "error", "error": {"type": "invalid_request_error", "message": message}}
        else:
            error = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}
        JSONReply(error, status=400).play(request, self)
        return True

    def _sent_json(self, body: bytes) -> None:
        """Remember the thinking blocks of a JSON reply (cheaply skipped when it has none)."""
        if b"thinking" not in body:
            return
        try:
            doc = ujson.loads(body)
        except ValueError:
            return
        content = doc.get("content") if isinstance(doc, dict) else None
        for block in content if isinstance(content, list) else ():
            _block_thinking(block, self._thinking, self._redacted)

    def _sent_events(self, events: Sequence[bytes]) -> None:
        """Remember the thinking blocks of an Anthropic stream: start, thinking and signature deltas."""
        open_blocks: dict[object, dict] = {}
        for event in events:
            if b"thinking" not in event and b"signature" not in event:
                continue
            doc = _sse_data(event)
            if not isinstance(doc, dict):
                continue
            index = doc.get("index")
            if doc.get("type") == "content_block_start" and isinstance(doc.get("content_block"), dict):
                _block_thinking(open_blocks.pop(index, None), self._thinking, self._redacted)
                open_blocks[index] = dict(doc["content_block"])
            elif doc.get("type") == "content_block_delta" and index in open_blocks:
                delta = doc.get("delta")
                if not isinstance(delta, dict):
                    delta = {}
                block = open_blocks[index]
                if delta.get("type") == "thinking_delta":
                    block["thinking"] = (block.get("thinking") or "") + str(delta.get("thinking", ""))
                elif delta.get("type") == "signature_delta":
                    block["signature"] = delta.get("signature")
        for block in open_blocks.values():
            _block_thinking(block, self._thinking, self._redacted)


def main(argv: Sequence[str] | None = None) -> None:
    """Serve the fake with default replies until SIGTERM/SIGINT (for benchmark processes; it keeps
    no request, so a long run of large bodies does not grow it)."""
    parser = argparse.ArgumentParser(prog="python -m cg.testing", description=main.__doc__)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--interface", default="127.0.0.1")
    args = parser.parse_args(argv)
    # Imported here: importing cg.testing must not install the global reactor.
    from twisted.internet import reactor

    port = FakeUpstream(record=False).listen(reactor, args.port, args.interface)
    print(f"listening {_port_number(port)}", flush=True)
    reactor.run()

