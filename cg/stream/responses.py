"""The Responses API's expand loop, pure: which calls cg answers, the continuation, the merged response.

The Responses twin of `cg.stream.continuation` (whose answers, `ClientStyle` and usage merge it
shares). A Responses answer is a list of output items, not a message:

- A response is cg's to answer (`lone_expand_calls`) when it finished (``status: "completed"``),
  holds at least one ``function_call`` named ``context_guru_expand`` and nothing the client must
  run: every other item is a ``message``, a ``reasoning`` item, a ``compaction`` item (the
  provider compacted the context, ``context_management``) or a call the provider ran itself
  (web or file search, code interpreter, image generation, MCP). Any other item, known or not, is
  taken for the client's: the whole response goes to it, and repair answers the expand call
  next turn.
- The continuation (`continuation_body`) appends to the ``input`` cg forwarded, never rewriting a
  byte of it: every output item of the decided round as returned (reasoning with its
  ``encrypted_content``, the calls), then one ``function_call_output`` per call. This holds with
  ``previous_response_id`` too: the provider's stored history comes first, then ``input``.
- The client gets one response (`merge`): the first round's id and head, the items of every round
  but the last without their expand calls, then the last round's, and its status; usage: the
  first round's input side (the live context size) with the output tokens summed.
"""

from __future__ import annotations

import json

from cg.stream.continuation import (
    ClientStyle,
    ExpandCall,
    ExpandLoop,
    Resolution,
    answers,
    merge_responses_usage,
    stream_edit,
)
from cg.stream.usage import Usage, openai_usage
from cg.wire import jsonbytes
from cg.wire.body import ParsedBody
from cg.wire.markers import EXPAND_TOOL, parse_marker_ref

__all__ = [
    "NOT_CALLS",
    "RESPONSES_LOOP",
    "SERVER_CALLS",
    "continuation_body",
    "expand_call",
    "expand_calls",
    "is_expand_call",
    "lone_expand_calls",
    "merge",
    "billed",
]

# Output items the provider ran itself: nothing for the client (or cg) to answer.
SERVER_CALLS = frozenset({
    "web_search_call", "file_search_call", "code_interpreter_call", "image_generation_call",
    "mcp_call", "mcp_list_tools",
})
# Output items that ask the client for nothing: what the model said or thought, what the provider
# compacted, what it ran itself.
NOT_CALLS = frozenset({"message", "reasoning", "compaction"}) | SERVER_CALLS
_SPINE: jsonbytes.Spine = {"input": {}, "stream": {}}


def is_expand_call(item: object) -> bool:
    """An output (or input) item that calls cg's expand tool."""
    return isinstance(item, dict) and item.get("type") == "function_call" and item.get("name") == EXPAND_TOOL


def expand_call(item: dict[str, object]) -> ExpandCall | None:
    """The call an expand item makes (its ``call_id``, arguments as given, the ref they name);
    None without a string ``call_id``."""
    call_id, arguments = item.get("call_id"), item.get("arguments")
    if not isinstance(call_id, str):
        return None
    return ExpandCall(call_id, arguments, _ref(arguments))


def _ref(arguments: object) -> str | None:
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else None
    except ValueError:
        return None
    ident = parsed.get("id") if isinstance(parsed, dict) else None
    return parse_marker_ref(ident) if isinstance(ident, str) else None


def _output(response: object) -> list[object]:
    output = response.get("output") if isinstance(response, dict) else None
    return output if isinstance(output, list) else []


def lone_expand_calls(response: object) -> list[ExpandCall] | None:
    """The expand calls of a finished response that asks the client for nothing else; else None."""
    if not isinstance(response, dict) or response.get("status") != "completed":
        return None
    calls: list[ExpandCall] = []
    for item in _output(response):
        if is_expand_call(item):
            call = expand_call(item)  # type: ignore[arg-type]  # is_expand_call: a dict
            if call is None:
                return None
            calls.append(call)
        elif not isinstance(item, dict) or item.get("type") not in NOT_CALLS:
            return None
    return calls or None


def expand_calls(items: list[object]) -> list[ExpandCall]:
    """Every expand call among `items` (a request's ``input``), whatever else they call."""
    found = (expand_call(item) for item in items if is_expand_call(item))  # type: ignore[arg-type]
    return [call for call in found if call is not None]


def continuation_body(forwarded: bytes, response: dict[str, object], calls: list[ExpandCall],
                      resolutions: dict[str, bytes | Resolution], stream: bool | None = None) -> bytes:
    """The next request: `forwarded`, its ``input`` extended by the round's items and the answers.

    `response` is the decided round (its ``output`` items as returned). A string ``input`` becomes
    a one-message list first. `stream` (when not None) sets the ``stream`` key, adding it if
    absent. Raises ValueError when `forwarded` is not a JSON object with an ``input``.
    """
    body = ParsedBody.load(forwarded, _SPINE)
    value, spans = body.value, body.spans
    if not isinstance(value.get("input"), (list, str)) or ("input",) not in spans:
        raise ValueError("not a Responses request with an input")
    style = ClientStyle(body.doc)
    new: list[object] = list(_output(response))
    new += [{"type": "function_call_output", "call_id": reply.call_id, "output": reply.text}
            for reply in answers(calls, resolutions)]
    start, end = spans[("input",)]
    given = value["input"]
    edits: list[tuple[jsonbytes.Span, str]]
    if isinstance(given, str):
        items = [{"type": "message", "role": "user", "content": given}, *new]
        edits = [((start, end), "[" + ",".join(style.dumps(item) for item in items) + "]")]
    else:
        lead = "," if given else ""
        edits = [((end - 1, end - 1), lead + ",".join(style.dumps(item) for item in new))]
    return body.apply(edits + stream_edit(body, stream))


def merge(rounds: list[dict[str, object]]) -> dict[str, object]:
    """The one response a JSON exchange of several rounds gives the client (module docstring)."""
    if not rounds:
        raise ValueError("no rounds to merge")
    first, final = rounds[0], rounds[-1]
    merged = dict(first)
    merged["output"] = [item for response in rounds[:-1] for item in _output(response)
                        if not is_expand_call(item)] + _output(final)
    for key in ("status", "error", "incomplete_details"):
        if key in final:
            merged[key] = final[key]
    usage = merge_responses_usage([response.get("usage") for response in rounds])
    if usage is not None:
        merged["usage"] = usage
    return merged


def billed(rounds: list[dict[str, object]]) -> list[Usage]:
    """What each round was billed."""
    return [openai_usage(response) for response in rounds]


class _ResponsesLoop:
    """The Responses API's `ExpandLoop`: this module's functions."""

    lone_expand_calls = staticmethod(lone_expand_calls)
    continuation_body = staticmethod(continuation_body)
    merge = staticmethod(merge)
    billed = staticmethod(billed)


RESPONSES_LOOP: ExpandLoop = _ResponsesLoop()
