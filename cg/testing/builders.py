"""Builders: the bytes and documents the providers send, byte for byte as they send them.

Messages API responses and streams (``anthropic_*``), chat completions (``openai_*``), the
Responses API (``responses_*``), one framed SSE event (``sse_event``), and what a client sends
(``claude_code_bytes``, ``command_output``). Each is plain data (a dict, or a list of framed
events): queue it in a reply (cg.testing.replies) or feed it to a parser directly.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from typing import Any

import ujson

HELLO = "Hello from the fake upstream"
_CREATED = 1_700_000_000  # fixed OpenAI "created" so replies are byte-for-byte reproducible


def _dumps(obj: object) -> bytes:
    """Compact JSON the way the providers (and Claude Code) write it: no spaces, raw UTF-8."""
    return ujson.dumps(obj, ensure_ascii=False, escape_forward_slashes=False).encode()


def sse_event(name: str | None, data: dict[str, Any] | list[Any] | str) -> bytes:
    """One framed SSE event; ``name=None`` omits the event line, as OpenAI does."""
    payload = data.encode() if isinstance(data, str) else _dumps(data)
    head = b"" if name is None else b"event: " + name.encode() + b"\n"
    return head + b"data: " + payload + b"\n\n"


def claude_code_bytes(body: object) -> bytes:
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
    usage: dict[str, Any] | None = None,
    content: list[Any] | None = None,
) -> dict[str, Any]:
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


def anthropic_block_start(index: int, block: dict[str, Any]) -> bytes:
    return sse_event("content_block_start", {"type": "content_block_start", "index": index, "content_block": block})


def anthropic_block_delta(index: int, delta: dict[str, Any]) -> bytes:
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
    usage: dict[str, Any] | None = None,
) -> list[bytes]:
    """A complete Messages stream; ``blocks`` (each a block's events) replaces the one text block;
    ``usage`` replaces message_start's (its ``output_tokens`` then ends the stream)."""
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
            } if usage is None else dict(usage, output_tokens=1),
        },
    }
    delta = {
        "type": "message_delta",
        "delta": {"stop_reason": stop_reason, "stop_sequence": None},
        "usage": {"output_tokens": output_tokens if usage is None else usage.get("output_tokens", output_tokens)},
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
    usage: dict[str, Any] | None = None,
    calls: Sequence[tuple[str, str, str]] = (),
) -> dict[str, Any]:
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
    usage: dict[str, Any] | None = None,
) -> list[bytes]:
    """A chat.completion.chunk stream: role, content fragments, finish, [usage], ``[DONE]``
    (``usage``, when given, is the usage chunk's).

    ``calls`` are (id, name, argument fragments) tool calls streamed after the content, each as the
    API streams one: a chunk with its id, name and empty arguments, then a chunk per fragment (the
    finish_reason is then ``tool_calls``).
    """

    def chunk(choices: list[Any], usage: dict[str, Any] | None = None) -> bytes:
        body = {"id": id, "object": "chat.completion.chunk", "created": _CREATED, "model": model}
        body["choices"] = choices
        if include_usage:  # real OpenAI adds "usage": null to every chunk only when asked
            body["usage"] = usage
        return sse_event(None, body)

    def choice(delta: dict[str, Any], finish: str | None = None) -> list[Any]:
        return [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]

    events = [chunk(choice({"role": "assistant", "content": ""}))]
    events += [chunk(choice({"content": t})) for t in texts]
    for i, (call_id, name, parts) in enumerate(calls):
        opened = {"index": i, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}
        events.append(chunk(choice({"tool_calls": [opened]})))
        events += [chunk(choice({"tool_calls": [{"index": i, "function": {"arguments": p}}]})) for p in parts]
    events.append(chunk(choice({}, "tool_calls" if calls else finish_reason)))
    if include_usage:
        events.append(chunk([], usage or {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }))
    events.append(sse_event(None, "[DONE]"))
    return events


def responses_message(text: str = HELLO, id: str = "msg_fake") -> dict[str, Any]:
    """A finished Responses ``message`` output item holding one ``output_text`` part."""
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"id": id, "type": "message", "status": "completed", "role": "assistant", "content": [part]}


def responses_function_call(
    name: str, arguments: str, call_id: str = "call_fake", id: str = "fc_fake"
) -> dict[str, Any]:
    """A finished Responses ``function_call`` output item; ``arguments`` is the JSON text, as sent."""
    return {
        "id": id,
        "type": "function_call",
        "status": "completed",
        "arguments": arguments,
        "call_id": call_id,
        "name": name,
    }


def responses_reasoning(encrypted_content: str = "gAAAAfake==", id: str = "rs_fake") -> dict[str, Any]:
    """A Responses ``reasoning`` output item with no summary, as sent when encrypted content is included."""
    return {"id": id, "type": "reasoning", "summary": [], "encrypted_content": encrypted_content}


def responses_response(
    output: Sequence[dict[str, Any]] | None = None,
    id: str = "resp_fake",
    model: str = "gpt-5.5",
    status: str = "completed",
    input_tokens: int = 10,
    output_tokens: int = 5,
    usage: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A Responses API ``response`` object; ``output`` (finished items) defaults to one message;
    ``usage`` replaces the one made of the token counts."""
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
        "usage": usage or {
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


def _item_events(index: int, item: dict[str, Any], deltas: int) -> list[dict[str, Any]]:
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
    output: Sequence[dict[str, Any]] | None = None,
    deltas: int = 2,
    id: str = "resp_fake",
    model: str = "gpt-5.5",
    input_tokens: int = 10,
    output_tokens: int = 5,
    usage: dict[str, Any] | None = None,
) -> list[bytes]:
    """A streamed Responses API reply, as the real API frames it (``event:`` lines, a
    ``sequence_number`` on each event): created, in_progress, each item of ``output`` (default one
    message) with its text or arguments in ``deltas`` fragments, then ``response.completed``
    carrying the whole response."""
    final = responses_response(output, id, model, "completed", input_tokens, output_tokens, usage)
    pending = dict(final, status="in_progress", output=[], usage=None)
    events = [
        {"type": "response.created", "response": pending},
        {"type": "response.in_progress", "response": pending},
        *itertools.chain.from_iterable(_item_events(i, item, deltas) for i, item in enumerate(final["output"])),
        {"type": "response.completed", "response": final},
    ]
    return [sse_event(e["type"], {**e, "sequence_number": n}) for n, e in enumerate(events)]

