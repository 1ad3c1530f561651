"""The expand loop's pure parts: which calls to answer, the continuation request, the merged response.

Transport-independent (the JSON exchange and the streaming Inspector share it) and pure: dicts and
bytes in, dicts and bytes out; no store, no Twisted. The caller looks the refs up in the store
(`refs_to_resolve`, then `resolve` for each), builds the next request with its dialect's
`ExpandLoop.continuation_body`, and when the loop ends sends the client `merge(rounds)` and counts
`billed(rounds)`. The loops of the two dialects whose answer is one message are here (`MESSAGES_LOOP`:
Anthropic Messages; `CHAT_LOOP`: OpenAI chat completions); the Responses API's is
`cg.stream.responses.RESPONSES_LOOP`.

Decisions:

- A response is answered by cg only when **all** its tool calls are `context_guru_expand`
  (`lone_expand_calls`) and, on the Messages API, it stopped to use them (`stop_reason:
  tool_use`, as the stream inspector decides; a chat turn, with a finish reason in
  `CHAT_CALL_FINISHES`, as the chat stream inspector decides); batched with a client tool it goes to the client verbatim. Server tools
  (`server_tool_use`) run at the provider and are not calls cg or the client must answer.
- Every call is answered, in order, by text: the original (UTF-8), or a final answer. A ref not
  stored is EVICTED when it has the shape of the IDs cg gives out (16 hex digits: cg most likely
  made it and the store let it go, or the model mistyped one; either way retrying cannot help) and
  UNKNOWN otherwise (cg never gave out such an ID). A call whose input has no usable `id` is
  MALFORMED. Failure answers carry no `is_error` (like a repair, which clears it): they are final
  answers, not faults, and the same text reads the same whichever path delivered it.
- The continuation appends to the request cg forwarded, never rewriting a byte of it (so each
  round reads the previous round's cache): pass the previous continuation as `forwarded` for the
  next round. New JSON is written the way the body's client writes it (`ClientStyle`). No
  `cache_control` is added. A Messages request without a `container` whose round ran code in a
  new one gets `"container":"<id>"` added last, so the turn goes on where its code ran.
"""

import abc
import enum
import json
import re
from collections.abc import Iterator
from typing import Protocol

import attrs

from cg.stream.hidden import HiddenTurn, Shown, is_blank_text, thinking_key
from cg.stream.usage import Usage, anthropic_usage, openai_usage
from cg.wire import jsonbytes
from cg.wire.body import ParsedBody
from cg.wire.markers import EXPAND_TOOL, marker, parse_marker_ref

__all__ = [
    "CHAT_CALL_FINISHES",
    "CHAT_LOOP",
    "EVICTED",
    "MALFORMED",
    "MESSAGES_LOOP",
    "UNKNOWN",
    "Answer",
    "ClientStyle",
    "ExpandCall",
    "ExpandLoop",
    "Resolution",
    "answer",
    "answers",
    "is_cg_answer",
    "merge_openai_usage",
    "merge_responses_usage",
    "refs_to_resolve",
    "resolve",
    "stream_edit",
]

# The shape of cg's marker IDs (cg.wire.markers.marker_id): an unstored ID of this shape was most likely
# cg's and evicted; any other was never cg's.
_CG_ID = re.compile(r"[0-9a-f]{16}")
_MAX_SHOWN_INPUT = 200


class Resolution(enum.Enum):
    """Why an expand call gets a final answer instead of its original."""

    UNKNOWN = "unknown"
    EVICTED = "evicted"
    MALFORMED = "malformed"


UNKNOWN = Resolution.UNKNOWN
EVICTED = Resolution.EVICTED
MALFORMED = Resolution.MALFORMED

_EVICTED_TEXT = "the original for {marker} is no longer stored; do not retry; re-run the command that produced it"
_UNKNOWN_TEXT = (
    "nothing is stored under {ref!r}: IDs come from <<cg:ID>> markers in this conversation; "
    "do not retry with this ID"
)
_MALFORMED_TEXT = (
    'context_guru_expand takes {{"id": "ID"}}, where ID is the ID in a <<cg:ID>> marker (bare, or '
    "the whole marker); it was given {given}"
)
# How each final answer starts, so a repair can tell cg's own answers from a client's error text.
_FINAL_PREFIXES = ("the original for <<cg:", "nothing is stored under ", "context_guru_expand takes {")


@attrs.frozen
class ExpandCall:
    """One `context_guru_expand` call of a response."""

    id: str  # the tool_use id (Anthropic) or tool_call id (OpenAI)
    raw_input: object  # the input dict (Anthropic) or arguments string (OpenAI), as given
    ref: str | None  # the marker ID asked for; None when the input names none (malformed)


@attrs.frozen
class Answer:
    """The text that answers one call, and which case it is (for /stats)."""

    call_id: str
    kind: str  # "resolved", or a Resolution's value
    text: str


class ExpandLoop(Protocol):
    """A dialect's expand loop over JSON: what the exchange asks of it (`cg.exchange.dialects`)."""

    def lone_expand_calls(self, response: object) -> list[ExpandCall] | None:
        """The expand calls of a response whose tool calls are all expand calls; else None.

        None when the response has no tool call, or any tool call that is not
        `context_guru_expand` (the client owns that one, so the whole response goes to it)."""
        ...

    def continuation_body(self, forwarded: bytes, assistant: dict[str, object], calls: list[ExpandCall],
                          resolutions: dict[str, bytes | Resolution], stream: bool | None = None) -> bytes:
        """The next request: `forwarded` byte for byte, then the turn and its answers."""
        ...

    def merge(self, rounds: list[dict[str, object]]) -> dict[str, object]:
        """The one response a JSON exchange of several rounds gives the client."""
        ...

    def billed(self, rounds: list[dict[str, object]]) -> list[Usage]:
        """What each round was billed, for /stats and the change log."""
        ...


_ToolCall = tuple[object, object, object, dict[str, object] | None]


class _MessageLoop(abc.ABC):
    """The expand loop of a dialect whose answer is one assistant message (Anthropic Messages, chat
    completions): its tool calls, the turn a continuation appends, the merge of its rounds."""

    def lone_expand_calls(self, message: object) -> list[ExpandCall] | None:
        """See `ExpandLoop`. `message` is the response (Anthropic message; OpenAI chat.completion,
        whose `choices[0].message` is read)."""
        calls: list[ExpandCall] = []
        for call_id, name, raw_input, arguments in self.tool_calls(message):
            if name != EXPAND_TOOL or not isinstance(call_id, str):
                return None
            calls.append(ExpandCall(call_id, raw_input, _ref(arguments)))
        return calls or None

    def expand_calls(self, message: object) -> list[ExpandCall]:
        """Every expand call of an assistant message or response, whatever else it calls."""
        return [ExpandCall(call_id, raw_input, _ref(arguments))
                for call_id, name, raw_input, arguments in self.tool_calls(message)
                if name == EXPAND_TOOL and isinstance(call_id, str)]

    @abc.abstractmethod
    def tool_calls(self, message: object) -> Iterator[_ToolCall]:
        """(id, name, input as given, input as a dict or None) of each tool call of a response."""

    def continuation_body(self, forwarded: bytes, assistant: dict[str, object], calls: list[ExpandCall],
                          resolutions: dict[str, bytes | Resolution], stream: bool | None = None) -> bytes:
        """The next request: `forwarded`, then the assistant message as returned, then the answers
        (`turn`). Every byte of `forwarded` is kept; `stream` (when not None) sets the `stream`
        key, adding it if absent. Raises ValueError when `forwarded` is not a JSON object with a
        `messages` array."""
        return self._appended(forwarded, assistant, calls, resolutions, stream)[0]

    def _appended(self, forwarded: bytes, assistant: dict[str, object], calls: list[ExpandCall],
                  resolutions: dict[str, bytes | Resolution],
                  stream: bool | None) -> tuple[bytes, "ClientStyle", list[str]]:
        """`continuation_body`, the client's style, and each message appended as it was written."""
        body = ParsedBody.load(forwarded, _CONTINUATION_SPINE)
        value, spans = body.value, body.spans
        if not isinstance(value.get("messages"), list):
            raise ValueError("not a request with a messages array")
        style = ClientStyle(body.doc)
        new = [style.dumps(message) for message in self.turn(assistant, answers(calls, resolutions))]
        end = spans[("messages",)][1] - 1  # the closing bracket
        lead = "," if value["messages"] else ""
        edits = [((end, end), lead + ",".join(new))]
        return body.apply(edits + self.round_state(body, assistant, style) + stream_edit(body, stream)), style, new

    def round_state(self, body: ParsedBody, assistant: dict[str, object],
                    style: "ClientStyle") -> list[tuple[jsonbytes.Span, str]]:
        """Edits beside the turn that keep the continuation where the round ran (none by default)."""
        return []

    @abc.abstractmethod
    def turn(self, assistant: dict[str, object], replies: list[Answer]) -> list[dict[str, object]]:
        """The messages a continuation appends: the assistant's (`assistant` is the response, or
        its message), then the answers."""

    def merge(self, rounds: list[dict[str, object]]) -> dict[str, object]:
        """The one response a JSON exchange of several rounds gives the client.

        The first round's id, model and other keys; the content of every round but the last without
        its expand calls (text and thinking stay), then the last round's whole; the last stop reason.
        Usage: the first round's (input-side counts are the live context size, which Claude Code
        watches to auto-compact) with the output counts summed over all rounds.
        """
        if not rounds:
            raise ValueError("no rounds to merge")
        return self.merged(rounds)

    @abc.abstractmethod
    def merged(self, rounds: list[dict[str, object]]) -> dict[str, object]:
        """`merge` of one or more rounds."""

    @abc.abstractmethod
    def billed(self, rounds: list[dict[str, object]]) -> list[Usage]:
        """What each round was billed, for /stats and the change log."""


class _AnthropicLoop(_MessageLoop):
    """Anthropic Messages: `tool_use` blocks in the content; a continuation appends
    `{"role":"assistant","content":<content as returned>}` and one user message of `tool_result`
    blocks."""

    def lone_expand_calls(self, message: object) -> list[ExpandCall] | None:
        """See `ExpandLoop`; only for a turn that stopped to use its tools, as the stream inspector
        decides: a refusal, a full context window, ``max_tokens`` (its last input may be cut) or a
        paused turn is the client's, as the provider sent it."""
        if isinstance(message, dict) and message.get("stop_reason", "tool_use") != "tool_use":
            return None
        return super().lone_expand_calls(message)

    def tool_calls(self, message: object) -> Iterator[_ToolCall]:
        content = message.get("content") if isinstance(message, dict) else None
        for block in content if isinstance(content, list) else ():
            if isinstance(block, dict) and block.get("type") == "tool_use":
                raw = block.get("input")
                yield block.get("id"), block.get("name"), raw, raw if isinstance(raw, dict) else None

    def round_state(self, body: ParsedBody, assistant: dict[str, object],
                    style: "ClientStyle") -> list[tuple[jsonbytes.Span, str]]:
        """``"container":"<id>"`` added to a request without one whose round ran code in a container
        (the response's ``container``): the API gave that request a new container, and the turn
        must go on in it, as a pause_turn's continuation does (docs, code execution tool >
        containers), or it loses what the code wrote. A request naming its container keeps it."""
        container = assistant.get("container")
        ident = container.get("id") if isinstance(container, dict) else None
        if not isinstance(ident, str) or "container" in body.value:
            return []
        return [body.added_last('"container":' + style.dumps(ident))]

    def turn(self, assistant: dict[str, object], replies: list[Answer]) -> list[dict[str, object]]:
        return [
            {"role": "assistant", "content": assistant.get("content")},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": reply.call_id, "content": reply.text}
                for reply in replies
            ]},
        ]

    def merged(self, rounds: list[dict[str, object]]) -> dict[str, object]:
        return _merge_anthropic(rounds)

    def continuation(self, forwarded: bytes, assistant: dict[str, object], calls: list[ExpandCall],
                     resolutions: dict[str, bytes | Resolution],
                     stream: bool | None = None) -> tuple[bytes, HiddenTurn | None]:
        """`continuation_body`, and the turn it appends that the client never sees
        (`cg.stream.hidden`): the round's expand calls and their answers, in the same bytes (the
        answers' message is the one the body got, not serialized again). None when an expand call
        comes before a block the client is shown: put back after them, it would not be where it was."""
        body, style, (_, answered) = self._appended(forwarded, assistant, calls, resolutions, stream)
        content = assistant.get("content")
        if not isinstance(content, list):
            return body, None
        expands = [block for block in content if _is_expand_use(block)]
        if not expands or not all(map(_is_expand_use, content[len(content) - len(expands):])):
            return body, None
        blanks = tuple((place, style.dumps(block)) for place, block in enumerate(content[:len(content) - len(expands)])
                       if is_blank_text(block))
        return body, HiddenTurn(",".join(map(style.dumps, expands)), answered, blanks)

    def shown(self, rounds: list[dict[str, object]]) -> Shown:
        """What `merge(rounds)` shows the client (`cg.stream.hidden`)."""
        types: list[str] = []
        starts: list[int] = []
        thinking: tuple[int, str] | None = None
        for number, response in enumerate(rounds):
            if number:
                starts.append(len(types))
            last = number == len(rounds) - 1
            for block in _list(response.get("content")):
                if _is_expand_use(block) and not last:
                    continue
                key = thinking_key(block)
                if number and key is not None and thinking is None:
                    thinking = (len(types), key)
                types.append(str(_dict(block).get("type")))
        return Shown(tuple(types), tuple(starts), thinking)

    def billed(self, rounds: list[dict[str, object]]) -> list[Usage]:
        return [anthropic_usage(response) for response in rounds]


# The finish reasons of a chat turn of tool calls that cg answers, streamed or not: ``tool_calls``, and
# ``stop``, which some OpenAI-compatible servers send for one. Not ``length`` (the last arguments may be
# cut) nor ``content_filter``: those turns are the client's, as the provider sent them.
CHAT_CALL_FINISHES = frozenset({"tool_calls", "stop"})


class _ChatLoop(_MessageLoop):
    """OpenAI chat completions: `tool_calls` of `choices[0].message`; a continuation appends the
    returned message object and one `role: "tool"` message per call."""

    def lone_expand_calls(self, message: object) -> list[ExpandCall] | None:
        """See `ExpandLoop`; only for a turn that finished with a reason in `CHAT_CALL_FINISHES`, as
        the chat stream inspector decides."""
        choices = _list(message.get("choices")) if isinstance(message, dict) else []
        if not choices or _dict(choices[0]).get("finish_reason") not in CHAT_CALL_FINISHES:
            return None
        return super().lone_expand_calls(message)

    def tool_calls(self, message: object) -> Iterator[_ToolCall]:
        for call in map(_dict, _list(_openai_message(message).get("tool_calls"))):
            function = call.get("function")
            if not isinstance(function, dict):
                yield None, None, None, None  # unreadable: not ours to answer
                continue
            raw = function.get("arguments")
            try:
                arguments = json.loads(raw) if isinstance(raw, str) else None
            except ValueError:
                arguments = None
            yield call.get("id"), function.get("name"), raw, arguments if isinstance(arguments, dict) else None

    def turn(self, assistant: dict[str, object], replies: list[Answer]) -> list[dict[str, object]]:
        return [_openai_message(assistant)] + [
            {"role": "tool", "tool_call_id": reply.call_id, "content": reply.text} for reply in replies
        ]

    def merged(self, rounds: list[dict[str, object]]) -> dict[str, object]:
        return _merge_openai(rounds)

    def billed(self, rounds: list[dict[str, object]]) -> list[Usage]:
        return [openai_usage(response) for response in rounds]


MESSAGES_LOOP = _AnthropicLoop()
CHAT_LOOP = _ChatLoop()


def _openai_message(doc: object) -> dict[str, object]:
    """The assistant message of a chat.completion (or `doc` itself when it is already one)."""
    if not isinstance(doc, dict):
        return {}
    choices = doc.get("choices")
    if choices is None:
        return doc
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        message = choices[0].get("message")
        return message if isinstance(message, dict) else {}
    return {}


def _ref(arguments: dict[str, object] | None) -> str | None:
    ident = arguments.get("id") if arguments is not None else None
    return parse_marker_ref(ident) if isinstance(ident, str) else None


def refs_to_resolve(calls: list[ExpandCall]) -> list[str]:
    """The refs to look up, each once, in call order (malformed calls need no lookup)."""
    return list(dict.fromkeys(call.ref for call in calls if call.ref is not None))


def resolve(ref: str, original: bytes | None) -> bytes | Resolution:
    """What a lookup of `ref` gave: the original, or EVICTED / UNKNOWN (see the module docstring)."""
    if original is not None:
        return original
    return EVICTED if _CG_ID.fullmatch(ref) else UNKNOWN


def answer(call: ExpandCall, resolution: bytes | Resolution | None) -> Answer:
    """The answer to one call. A missing resolution (None) counts as "not stored"."""
    if call.ref is None:
        return Answer(call.id, MALFORMED.value, _MALFORMED_TEXT.format(given=_shown(call.raw_input)))
    if resolution is None:
        resolution = resolve(call.ref, None)
    if isinstance(resolution, bytes):
        return Answer(call.id, "resolved", resolution.decode("utf-8", errors="replace"))
    if resolution is EVICTED:
        return Answer(call.id, EVICTED.value, _EVICTED_TEXT.format(marker=marker(call.ref)))
    if resolution is UNKNOWN:
        return Answer(call.id, UNKNOWN.value, _UNKNOWN_TEXT.format(ref=call.ref))
    # MALFORMED given for a call that does name a ref: answer as the caller says.
    return Answer(call.id, MALFORMED.value, _MALFORMED_TEXT.format(given=_shown(call.raw_input)))


def answers(calls: list[ExpandCall], resolutions: dict[str, bytes | Resolution]) -> list[Answer]:
    """The answer to every call, in order (the same ref answered the same way each time)."""
    return [answer(call, resolutions.get(call.ref) if call.ref is not None else None) for call in calls]


def is_cg_answer(text: str) -> bool:
    """Whether `text` is one of cg's final answers (not an original: those are not recognisable)."""
    return text.startswith(_FINAL_PREFIXES)


def _shown(raw_input: object) -> str:
    text = raw_input if isinstance(raw_input, str) else json.dumps(raw_input, ensure_ascii=False)
    return text if len(text) <= _MAX_SHOWN_INPUT else text[:_MAX_SHOWN_INPUT] + "…"


# ---------------------------------------------------------------------------------------------
# The continuation request


@attrs.frozen
class ClientStyle:
    """How the client that wrote a document serializes JSON, for the values cg adds to it.

    Always compact (Claude Code and the SDKs send compact JSON; in a spaced body it is still valid).
    The escaping is read from `evidence` (the document, or the part of it before the edit), and
    without evidence a character goes raw, as JSON.stringify writes it: non-ASCII is escaped only in
    an all-ASCII document showing a \\uXXXX escape of a non-ASCII character (Python's default);
    "/" only when the document's first "/" is escaped (PHP); <, > and & only when the document has
    none of them raw but shows one escaped (Go). Only its ASCII is read, and whether it has any
    other character: a body's Latin-1 view (`ParsedBody.doc`) serves.
    """

    evidence: str

    def dumps(self, value: object) -> str:
        evidence = self.evidence
        ascii_only = evidence.isascii() and _shows(_NON_ASCII_ESCAPE, evidence)
        raw = json.dumps(value, separators=(",", ":"), ensure_ascii=ascii_only)
        if not ascii_only and not _utf8(raw):  # a lone surrogate can only travel escaped
            raw = json.dumps(value, separators=(",", ":"))
        # Outside strings JSON has no "/": replacing it edits strings only.
        slash = evidence.find("/")
        if slash > 0 and jsonbytes.escaped(evidence, slash):
            raw = raw.replace("/", "\\/")
        if not any(char in evidence for char in "<>&") and _shows(_HTML_ESCAPE, evidence):
            raw = jsonbytes.html_escaped(raw)
        return raw


# Literal-prefixed patterns (the regex engine scans for "\\u" at C speed); `_shows` then checks that
# the backslash is not itself escaped.
_NON_ASCII_ESCAPE = re.compile(r"\\u(?!00[0-7])[0-9a-fA-F]{4}")
_HTML_ESCAPE = re.compile(r"\\u00(?:3[cCeE]|26)")


def _shows(escape: re.Pattern[str], evidence: str) -> bool:
    """Whether `evidence` holds a real `escape` (not an escaped backslash followed by text)."""
    return any(not jsonbytes.escaped(evidence, match.start()) for match in escape.finditer(evidence))


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


_CONTINUATION_SPINE: jsonbytes.Spine = {"messages": {}, "stream": {}}


def stream_edit(body: ParsedBody, stream: bool | None) -> list[tuple[jsonbytes.Span, str]]:
    """The edit that sets `body`'s ``stream`` key to `stream` (added last if absent); none for None
    or a body that says so already. `body` must have been parsed with the ``stream`` key's span."""
    if stream is None or body.value.get("stream") is stream:
        return []
    literal = "true" if stream else "false"
    if ("stream",) in body.spans:
        return [(body.spans[("stream",)], literal)]
    return [body.added_last('"stream":' + literal)]


# ---------------------------------------------------------------------------------------------
# The response the client receives


_ANTHROPIC_FINAL_KEYS = ("stop_reason", "stop_sequence", "stop_details", "container", "context_management")


def _is_expand_use(block: object) -> bool:
    return isinstance(block, dict) and block.get("type") == "tool_use" and block.get("name") == EXPAND_TOOL


def _merge_anthropic(rounds: list[dict[str, object]]) -> dict[str, object]:
    first, final = rounds[0], rounds[-1]
    content = [block for response in rounds[:-1] for block in _list(response.get("content"))
               if not _is_expand_use(block)]
    merged = dict(first)
    merged["content"] = content + _list(final.get("content"))
    for key in _ANTHROPIC_FINAL_KEYS:
        if key in final:
            merged[key] = final[key]
    first_usage = first.get("usage")
    if isinstance(first_usage, dict):
        usage = merged["usage"] = dict(first_usage)
        usage["output_tokens"] = sum(_count(_dict(r.get("usage")).get("output_tokens")) for r in rounds)
    return merged


def _merge_openai(rounds: list[dict[str, object]]) -> dict[str, object]:
    first, final = rounds[0], rounds[-1]
    final_choice = _dict(_list(final.get("choices"))[0]) if _list(final.get("choices")) else {}
    final_message = _openai_message(final)
    texts = [text for text in (_openai_message(r).get("content") for r in rounds) if isinstance(text, str) and text]
    message = dict(final_message)
    message["content"] = "\n\n".join(texts) if texts else final_message.get("content")
    merged = dict(first)
    merged["choices"] = [{**final_choice, "index": 0, "message": message}]
    usage = merge_openai_usage([r.get("usage") for r in rounds])
    if usage is not None:
        merged["usage"] = usage
    return merged


def merge_openai_usage(usages: list[object]) -> dict[str, object] | None:
    """The usage of several chat rounds as one: the first's (its prompt side is the live context),
    ``completion_tokens`` (and its details) summed, ``total_tokens`` recomputed; None without a first."""
    return _merged_usage(usages, "prompt_tokens", "completion_tokens")


def merge_responses_usage(usages: list[object]) -> dict[str, object] | None:
    """`merge_openai_usage` for Responses rounds: ``input_tokens`` from the first, ``output_tokens``
    (and its details) summed, ``total_tokens`` recomputed."""
    return _merged_usage(usages, "input_tokens", "output_tokens")


def _merged_usage(usages: list[object], prompt: str, output: str) -> dict[str, object] | None:
    usage = usages[0] if usages else None
    if not isinstance(usage, dict):
        return None
    merged_usage = dict(usage)
    produced = sum(_count(_dict(u).get(output)) for u in usages)
    merged_usage[output] = produced
    details = output + "_details"
    if isinstance(usage.get(details), dict):
        found = [d for d in (_dict(u).get(details) for u in usages) if isinstance(d, dict)]
        merged_usage[details] = _sum_counts(found)
    merged_usage["total_tokens"] = _count(usage.get(prompt)) + produced
    return merged_usage


def _sum_counts(dicts: list[dict[str, object]]) -> dict[str, object]:
    """Key-wise sum of the counts in `dicts` (the first's keys and order; non-counts kept as is)."""
    total = dict(dicts[0])
    for key, value in total.items():
        if isinstance(value, int) and not isinstance(value, bool):
            total[key] = sum(_count(d.get(key)) for d in dicts)
    return total


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _list(value: object) -> list[object]:
    return value if isinstance(value, list) else []


def _dict(value: object) -> dict[str, object]:
    return value if isinstance(value, dict) else {}
