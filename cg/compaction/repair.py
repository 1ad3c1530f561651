"""Repair: answer, on the next request, the expand calls that reached the client.

An expand call reaches the client when it was batched with a client tool, came past the round cap,
on a stream cg does not splice, or before a continuation failed. The client cannot run it and
answers with an error (Claude Code: `is_error: true`, `<tool_use_error>Error: No such tool
available: context_guru_expand</tool_use_error>`; Codex CLI: a `function_call_output` "unsupported
call: context_guru_expand"), which stays in its history. Where cg injects the
tool (the caller's decision: this module does not look at `tools`), cg replaces that answer with
what the call asked for before compaction runs, and the model reads the original from then on.

Pure: `find_repairs` reads a `ParsedBody`; the caller builds each text (`repair_answer`, from the
store's original), freezes it per tool_use_id in the store, and splices `repair_edits`, which are
span edits over `body.doc` like `cg.compaction.pipeline.plan`'s (never overlapping them: compaction leaves the
results of expand calls alone).

What counts as an error answer (to a call of `context_guru_expand`, found by its id in an earlier
assistant message):

- Anthropic: `is_error: true`;
- otherwise (OpenAI `role: "tool"` messages and Responses `function_call_output` items have no
  flag; an Anthropic client might not set it): a text that is not one of cg's own final answers,
  is at most 2,000 characters (the originals cg offloads are far longer; clients' errors are one
  line), and is empty or reads like an error: "error", "not found / available / supported /
  allowed / recognized / defined / exist", "no such", "unknown tool", "invalid tool",
  "unavailable", "unsupported", "is not a valid". The clients' own words it catches (Claude Code's
  and Codex CLI's seen by running them; the others read in the frameworks' sources, and tested in
  tests/test_repair.py): Codex CLI's "unsupported call: NAME"; the Vercel AI SDK's (OpenCode's)
  "Model tried to call unavailable tool 'NAME'. Available tools: …"; LangChain's "NAME is not a
  valid tool, try one of […]"; Pydantic AI's "Unknown tool name: 'NAME'. Available tools: …";
  and any "Error: …".

A repaired result is content = the text, no `is_error`, every other key kept in its place
(`cache_control` stays where the client put it). It is no longer an error, so repairing a repaired
body changes nothing; and should a short original read like an error, it is found again and
replaced by the same frozen text, giving the same bytes: the same text always gives the same bytes.
"""

import re
from typing import cast

import attrs

from cg.stream import responses
from cg.stream.continuation import (
    CHAT_LOOP,
    MESSAGES_LOOP,
    Answer,
    ClientStyle,
    ExpandCall,
    answer,
    is_cg_answer,
    resolve,
)
from cg.wire import jsonbytes
from cg.wire.body import ParsedBody
from cg.wire.dialect import Shape
from cg.wire.jsonbytes import EACH
from cg.wire.markers import EXPAND_TOOL

__all__ = ["Repair", "find_repairs", "looks_like_error", "repair_answer", "repair_edits"]

_MAX_ERROR_CHARS = 2000
_ERROR_WORDS = re.compile(
    r"error|no such|not (?:found|available|supported|allowed|permitted|recogni[sz]ed|registered|defined|exist)"
    r"|(?:unknown|invalid) (?:tool|function)|does not exist|doesn't exist|unavailable|unsupported|is not a valid",
    re.IGNORECASE,
)
_BLOCKS: jsonbytes.Spine = {"content": {EACH: {}}}


@attrs.frozen
class Repair:
    """An expand call the client answered with an error, and where that answer sits."""

    tool_use_id: str
    ref: str | None  # the marker ID the call asked for; None when its input named none
    raw_input: object  # the call's input as the model gave it (for the malformed answer)
    message_index: int  # the message holding the answer
    block_index: int | None  # Anthropic: the tool_result's index in that message; OpenAI: None

    @property
    def call(self) -> ExpandCall:
        return ExpandCall(self.tool_use_id, self.raw_input, self.ref)


def looks_like_error(text: str, is_error: object = None) -> bool:
    """Whether a client's answer to an expand call is an error (see the module docstring)."""
    if is_error is True:
        return True
    if is_cg_answer(text) or len(text) > _MAX_ERROR_CHARS:
        return False
    return not text.strip() or _ERROR_WORDS.search(text) is not None


_EXPAND_TOOL_BYTES = EXPAND_TOOL.encode()
_UNNAMED = "repair: no expand tool named"  # ParsedBody.carried: the body's bytes never name it


def find_repairs(body: ParsedBody, shape: Shape) -> list[Repair]:
    """The error answers to expand calls in `body`'s messages (Responses: input items), in order.

    A body that never names the expand tool holds no call to it: one C-speed search instead of a
    walk of every message on every turn, and only past what it shares with the conversation's
    last body when that one did not name it either. (A name spelled with \\u escapes of plain
    letters would be missed; no client writes JSON so.) A body that names it is walked message by
    message, each message the last body shared answered as it was then (`ParsedBody.per_message`).
    """
    if not _names_expand(body):
        body.carried[_UNNAMED] = ()
        return []
    calls: dict[str, ExpandCall] = {}
    repairs: list[Repair] = []
    seen = body.per_message((_SEEN, shape), shape.items, shape.select(_seen_message, _seen_chat, _seen_item))
    for message_index, (made, answered) in enumerate(seen):
        calls.update((call.id, call) for call in made)
        for call_id, block_index in answered:
            call = calls.get(call_id)
            if call is not None:
                repairs.append(Repair(call.id, call.ref, call.raw_input, message_index, block_index))
    return repairs


# ParsedBody.carried: what each message holds for repairs (`_seen`).
_SEEN = "repair: expand calls made and error answers given"
_Seen = tuple[tuple[ExpandCall, ...], tuple[tuple[str, "int | None"], ...]]
_NOTHING: _Seen = ((), ())


# A message's expand calls, and its answers that read like errors (call ID, block index; None for a
# whole message or item), whatever they answer: which call they answer is the walk's to say. One
# reader a dialect: Anthropic messages, chat messages, Responses input items.


def _seen_message(message: object) -> _Seen:
    """Anthropic: an assistant's `tool_use` blocks; a user's `tool_result` blocks."""
    if not isinstance(message, dict):
        return _NOTHING
    role = message.get("role")
    if role == "assistant":
        return tuple(MESSAGES_LOOP.expand_calls(message)), ()
    if role == "user" and isinstance(message.get("content"), list):
        return (), tuple((block["tool_use_id"], index) for index, block in enumerate(message["content"])
                         if isinstance(block, dict) and block.get("type") == "tool_result"
                         and _is_error_answer(block.get("tool_use_id"), block))
    return _NOTHING


def _seen_chat(message: object) -> _Seen:
    """Chat completions: an assistant's `tool_calls`; a `role: "tool"` message."""
    if not isinstance(message, dict):
        return _NOTHING
    role = message.get("role")
    if role == "assistant":
        return tuple(CHAT_LOOP.expand_calls(message)), ()
    return _error_answer(message, "tool_call_id") if role == "tool" else _NOTHING


def _seen_item(item: object) -> _Seen:
    """The Responses API: a `function_call` item; a `function_call_output` item."""
    if not isinstance(item, dict):
        return _NOTHING
    kind = item.get("type")
    if kind == "function_call":
        return tuple(responses.expand_calls([item])), ()
    return _error_answer(item, "call_id") if kind == "function_call_output" else _NOTHING


def _error_answer(answered: dict[str, object], call_id_key: str) -> _Seen:
    """A whole message or item answering the call its `call_id_key` names, when it reads like an error."""
    call_id = answered.get(call_id_key)
    return ((), ((call_id, None),)) if isinstance(call_id, str) and _is_error_answer(call_id, answered) else _NOTHING


def _is_error_answer(call_id: object, answered: dict[str, object]) -> bool:
    content = answered.get("output") if "output" in answered else answered.get("content")
    return isinstance(call_id, str) and looks_like_error(result_text(content), answered.get("is_error"))


def result_text(content: object) -> str:
    """The text of a result's content: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part["text"] for part in content
                       if isinstance(part, dict) and isinstance(part.get("text"), str))
    return ""


def repair_answer(repair: Repair, original: bytes | None) -> Answer:
    """The answer a repair puts in place: the original, or cg's final "not available" text."""
    if repair.ref is None:
        return answer(repair.call, None)
    return answer(repair.call, resolve(repair.ref, original))


def repair_edits(body: ParsedBody, repairs: list[Repair],
                 texts: dict[str, str]) -> list[tuple[jsonbytes.Span, str]]:
    """Span edits over `body.doc` putting `texts[tool_use_id]` in place of each error answer.

    Anthropic: the whole tool_result block is rewritten with content = the text, without
    `is_error`, its other keys in their order. OpenAI: the tool message's content; Responses: the
    function_call_output's output. A repair with no
    text in `texts` is left out. The JSON is written in the style the body shows before the edit
    (`ClientStyle`): the history before it does not change between turns, so neither do the bytes.
    """
    doc = body.doc
    edits: list[tuple[jsonbytes.Span, str]] = []
    below: dict[int, dict[jsonbytes.Path, jsonbytes.Span]] = {}
    key, field = ("messages", "content") if "messages" in body.value else ("input", "output")
    for repair in repairs:
        text = texts.get(repair.tool_use_id)
        if text is None:
            continue
        message_start = body.spans[(key, repair.message_index)][0]  # find_repairs found it on this path
        span: jsonbytes.Span | None
        value: object
        if repair.block_index is not None:
            if repair.message_index not in below:
                below[repair.message_index] = jsonbytes.spans_below(doc, message_start, _BLOCKS)
            span = below[repair.message_index][("content", repair.block_index)]
            value = _repaired_block(cast("dict[str, object]", jsonbytes.scan(body.raw, span)), text)
        else:
            span = jsonbytes.spans_below(doc, message_start, {field: {}}).get((field,))
            if span is None:
                continue
            value = _repaired_content(jsonbytes.scan(body.raw, span), text)
        edits.append((span, ClientStyle(doc[:span[0]]).dumps(value)))
    return edits


def _repaired_block(block: dict[str, object], text: str) -> dict[str, object]:
    repaired = {key: _repaired_content(value, text) if key == "content" else value
                for key, value in block.items() if key != "is_error"}
    repaired.setdefault("content", text)
    return repaired


def _repaired_content(content: object, text: str) -> object:
    """The text; as a one-part list where the client's parts carried a cache_control (kept)."""
    if isinstance(content, list):
        marks = [part["cache_control"] for part in content if isinstance(part, dict) and "cache_control" in part]
        if marks:
            return [{"type": "text", "text": text, "cache_control": marks[-1]}]
    return text


def _names_expand(body: ParsedBody) -> bool:
    """Whether the body's bytes name the expand tool (one byte a character, where the text may
    take two); a shared prefix the last body did not name it in is not searched again."""
    start = 0
    shared = body.shared if _UNNAMED in body.earlier_carried else None
    if shared is not None:
        start = max(0, shared - len(_EXPAND_TOOL_BYTES) + 1)  # a name across the prefix's end
    return body.raw.find(_EXPAND_TOOL_BYTES, start) >= 0
