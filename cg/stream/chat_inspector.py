"""The incremental inspector for OpenAI chat completion streams (``chat.completion.chunk`` events).

The chat twin of ``cg.stream.inspector.Inspector`` (same ``Step``/``Action`` contract, same states,
same release reasons): one ``ChatInspector`` serves one client response stream, every round of it,
fed the events of ``cg.wire.sse.SSEParser`` one at a time. Pure code: no Twisted, no I/O.

Round 1 is forwarded **byte for byte**, each chunk the moment it is complete, except from the chunk
that starts a ``context_guru_expand`` tool call (``delta.tool_calls[k].function.name``, with no
client-owned call before it in the response): that chunk and every later one are held.

==========  ======================================================  ===================================
state       chunk                                                   action
==========  ======================================================  ===================================
WATCH       an expand call's start, in a *pure* chunk (below)       hold it → HOLD
WATCH       another call's start; a chunk of choice index ≠ 0 (n>1)  forward → THROUGH
WATCH       anything else                                           forward (text is recorded)
HOLD        pure: fragments of held calls, new expand starts,       hold
            ``finish_reason`` null; the usage chunk; a comment
HOLD        pure with ``finish_reason`` ``tool_calls`` or           hold, mark *decided*
            ``stop`` (``CHAT_CALL_FINISHES``, as JSON), every held
            call's id a string and arguments a JSON object with a
            string ``id``
HOLD        the same with a call that does not parse                release "bad_input" + fwd → THROUGH
HOLD        another ``finish_reason``                               release "stop_reason" + forward
HOLD        another call's start                                    release "client_tool" + forward
HOLD        any other content (text, role, refusal, logprobs, a     release "other_block" + forward
            fragment of a call not held, n>1, not JSON)
HOLD        ``data: [DONE]`` when decided                           hold → AWAIT, return EXPAND
HOLD        ``data: [DONE]`` not decided                            release "stop_reason" + forward
HOLD        an ``error`` chunk                                      release "error" + forward
HOLD        held bytes > ``max_held``                               release "max_held" → THROUGH
HOLD        ``end()``                                               release "ended" → ABORT / DONE
THROUGH     anything                                                forward
AWAIT       ``begin_continuation()`` / ``release()``                as ``Inspector``
==========  ======================================================  ===================================

A *pure* chunk carries nothing but held-call material: one choice, index 0, whose ``delta`` has
``tool_calls`` (every entry an expand start or a fragment of a held call), perhaps ``role:
"assistant"`` (OpenAI opens a turn that starts with a call with role, ``content: null`` and the
call's first fragment in one chunk), and otherwise only null or empty values, ``logprobs`` null. A chunk that mixes a held call's fragment with anything else is
never split nor re-serialized: round 1's bytes reach the client as the upstream wrote them or not at
all, and splitting would hand the client a chunk the provider never sent. So a mixed chunk is not
holdable: in WATCH the call it starts goes to the client (repaired next turn, as an expand call
batched with a client tool), in HOLD it releases. OpenAI writes one call fragment per chunk, text
in its own chunks and ``finish_reason`` in an empty-delta chunk, so this costs nothing on its
streams.

Continuation rounds are re-serialized (``data: <json>``): ``id``, ``created`` and ``model`` are
round 1's, the ``role`` delta is dropped when the client had one (kept when round 1's came with
a held call, so the client gets exactly one), the usage chunk carries the sum (the
first round's prompt side, completion tokens summed: ``merge_openai_usage``). Tool-call indices are
dense by construction: a round only expands when all its calls were held, so the client has seen no
call before the continuation's first, and the continuation's indices start at 0 as the provider's.
Round 1's finish chunk, usage chunk and ``[DONE]`` are held, so the client gets one of each.

``hide_usage`` (cg added ``stream_options.include_usage`` to a request without it): every round's
usage chunk (``choices: []``) is swallowed; the ``"usage": null`` the provider then writes in every
chunk stays (round 1 is byte for byte; the SDKs read it as no usage).

Ends: a round is complete only with ``data: [DONE]`` (or an ``error`` chunk); a stream that ends
without it ends the client's response with ABORT, so it never looks complete. Failures before a
continuation commits release the previous round verbatim, as ``Inspector`` does. A continuation
commits with its first chunk that carries more than a role: OpenAI sends the role chunk before the
model writes anything (as Anthropic's ``message_start``), so it is kept back until then, and a
continuation that only opened can still stall into the release.

Cost: one JSON parse per chunk, O(1) amortised bookkeeping (arguments kept as fragment lists).
"""

from __future__ import annotations

from typing import cast

import ujson

from cg.stream.continuation import CHAT_CALL_FINISHES, ExpandCall, merge_openai_usage
from cg.stream.inspector import (
    ABORT,
    DONE,
    EXPAND,
    NOTHING,
    ReleaseReason,
    RoundInspector,
    State,
    Step,
    json_object,
)
from cg.stream.usage import StreamUsage
from cg.wire.dialect import CHAT_SHAPE
from cg.wire.markers import EXPAND_TOOL, parse_marker_ref
from cg.wire.sse import Event

__all__ = ["ChatInspector"]

_WATCH = State.WATCH
_HOLD = State.HOLD
_THROUGH = State.THROUGH
_AWAIT = State.AWAIT
_DONE = State.DONE
_MANY = object()  # a chunk of n > 1 choices
_HEAD = ("id", "created", "model")


# A round's reasoning as OpenAI-compatible thinking servers stream it beside ``content``: text
# (DeepSeek's and Kimi's ``reasoning_content``, OpenRouter's and vLLM's ``reasoning``), and
# OpenRouter's ``reasoning_details``, entries streamed in fragments and told apart by ``index``.
_REASONING_TEXTS = ("reasoning_content", "reasoning")
_DETAIL_TEXTS = frozenset({"text", "summary", "data"})  # a detail's fragments, joined


class _Reasoning:
    """The reasoning of a round, for its continuation: a server that thinks answers a tool-call turn
    sent back without it with a 400 (DeepSeek's "Missing `reasoning_content` field"), or loses the
    thinking's signature (OpenRouter in front of Claude)."""

    __slots__ = ("texts", "details", "detail_texts")

    def __init__(self) -> None:
        self.texts: dict[str, list[str]] = {}
        self.details: dict[object, dict[str, object]] = {}  # by index
        # Each entry's text fields' fragments, joined once in `fields` (a fragment a token: O(1) each)
        self.detail_texts: dict[object, dict[str, list[str]]] = {}

    def add(self, delta: dict[str, object]) -> None:
        for key in _REASONING_TEXTS:
            text = delta.get(key)
            if isinstance(text, str):
                self.texts.setdefault(key, []).append(text)
        details = delta.get("reasoning_details")
        for detail in details if isinstance(details, list) else ():
            if isinstance(detail, dict):
                self._add_detail(detail)

    def _add_detail(self, detail: dict[str, object]) -> None:
        """A fragment of one entry: its texts appended, any other field given (a signature, which
        comes in a fragment of its own) set; an entry without an index is one of its own."""
        index = detail.get("index")
        key = index if isinstance(index, int) else ("unindexed", len(self.details))
        entry = self.details.get(key)
        if entry is None:
            entry = self.details[key] = {}
            self.detail_texts[key] = {}
        texts = self.detail_texts[key]
        for field, value in detail.items():
            if field in _DETAIL_TEXTS and isinstance(value, str):
                entry.setdefault(field, "")  # its place among the fields; its text is joined in `fields`
                texts.setdefault(field, []).append(value)
            elif field not in entry or (value is not None and value != ""):
                entry[field] = value

    def fields(self) -> dict[str, object]:
        """The assistant message's reasoning fields, none for a round without reasoning."""
        fields: dict[str, object] = {key: "".join(parts) for key, parts in self.texts.items()}
        if self.details:
            fields["reasoning_details"] = [
                {**entry, **{field: "".join(parts) for field, parts in self.detail_texts[key].items()}}
                for key, entry in self.details.items()]
        return fields


class _Call:
    """A held expand call: its id and its arguments' fragments."""

    __slots__ = ("id", "parts")

    def __init__(self, call_id: object) -> None:
        self.id = call_id
        self.parts: list[str] = []


def _choice(doc: dict[str, object]) -> object:
    """The chunk's only choice (a dict), None for a chunk without choices, ``_MANY`` for n > 1."""
    choices = doc.get("choices")
    if not isinstance(choices, list) or not choices:
        return None
    first = choices[0]
    if len(choices) != 1 or not isinstance(first, dict) or first.get("index", 0) != 0:
        return _MANY
    return first


def _delta(choice: dict[str, object]) -> dict[str, object]:
    delta = choice.get("delta")
    return delta if isinstance(delta, dict) else {}


def _tool_calls(delta: dict[str, object]) -> list[dict[str, object]]:
    calls = delta.get("tool_calls")
    return [call for call in calls if isinstance(call, dict)] if isinstance(calls, list) else []


def _name(call: dict[str, object]) -> object:
    function = call.get("function")
    return function.get("name") if isinstance(function, dict) else None


def _arguments(call: dict[str, object]) -> str:
    function = call.get("function")
    value = function.get("arguments") if isinstance(function, dict) else None
    return value if isinstance(value, str) else ""


def _pure(choice: dict[str, object]) -> bool:
    """Only tool-call material and the role: no other delta value, no logprobs (see the module docstring).

    An empty value is none: null, ``""``, and ``[]`` or ``{}`` (OpenRouter writes
    ``"reasoning_details":[]`` in every delta)."""
    if choice.get("logprobs") is not None:
        return False
    return all(key == "tool_calls" or value is None or value in _EMPTY or (key, value) == ("role", "assistant")
               for key, value in _delta(choice).items())


_EMPTY: tuple[object, ...] = ("", [], {})


def _opening(doc: dict[str, object]) -> bool:
    """A chunk with no content, at most the role: how a round opens before the model writes (no commit)."""
    choice = _choice(doc)
    return (isinstance(choice, dict) and choice.get("finish_reason") is None and _pure(choice)
            and not _tool_calls(_delta(choice)) and not isinstance(doc.get("usage"), dict))


def _has_role(doc: dict[str, object] | None) -> bool:
    choice = _choice(doc) if doc is not None else None
    return isinstance(choice, dict) and "role" in _delta(choice)


def _data(doc: dict[str, object]) -> bytes:
    try:
        text = ujson.dumps(doc, ensure_ascii=False, escape_forward_slashes=False).encode()
    except UnicodeEncodeError:  # a lone surrogate from a \\ud800 escape: keep it escaped
        text = ujson.dumps(doc, escape_forward_slashes=False).encode()
    return b"data: " + text + b"\n\n"


class ChatInspector(RoundInspector):
    """Inspects one chat completion stream across all its rounds. See the module docstring."""

    def __init__(self, max_held: int = 16 << 20, max_rounds: int = 3, hide_usage: bool = False) -> None:
        super().__init__(max_held, max_rounds)
        self.hide_usage = hide_usage
        self._head: dict[str, object] = {}  # round 1's id, created, model
        self._usages: list[object] = []  # the usage objects of finished rounds
        self._role_shown = False  # the client got a role delta
        self._new_round(_WATCH if max_rounds > 0 else _THROUGH)

    def _new_round(self, state: State) -> None:
        self._state = state
        self._held = []
        self._held_bytes = 0
        self._expands: dict[object, _Call] = {}  # by tool-call index
        self._text: list[str] = []
        self._reasoning = _Reasoning()
        self._decided = False
        self._saw_end = False  # [DONE] or an error chunk
        self._committed = self._round == 0
        self._opening = b""  # a continuation's chunks before its first content, sent when it comes
        self._usage = StreamUsage(CHAT_SHAPE)
        self._usage_doc: object = None

    # -----------------------------------------------------------------------------------------
    # Public API (``cg.exchange.dialects.StreamInspector``; the rest is RoundInspector's)

    def assistant_message(self) -> dict[str, object]:
        """The decided round's assistant message, for the continuation request.

        With the round's reasoning when it had any (``_Reasoning``), as the JSON loop sends the
        message it got (``cg.stream.continuation``)."""
        message: dict[str, object] = {"role": "assistant", "content": "".join(self._text) or None}
        message.update(self._reasoning.fields())
        message["tool_calls"] = [{"id": call.id, "type": "function",
                                  "function": {"name": EXPAND_TOOL, "arguments": cast(str, call.raw_input)}}
                                 for call in self.calls]
        return message

    def feed(self, event: Event) -> Step:
        state = self._state
        if state is _AWAIT or state is _DONE:
            return self._closed()
        self._usage.observe(event)
        if event.data.startswith(b"[DONE]"):
            self._saw_end = True
            if state is _HOLD:
                if not self._decided:
                    return self._release_with("stop_reason", event, None)
                step = self._hold(event)
                return step if step is not NOTHING else self._expand()
            return Step(self._out(event, None))
        doc = json_object(event)
        if doc is not None:
            if "error" in doc and "choices" not in doc:
                if not self._committed and self._fallback is not None:
                    return Step(self._fail(), DONE)
                self._saw_end = True
                if state is _HOLD:
                    return self._release_with("error", event, doc)
                return Step(self._out(event, doc))
            if self._round == 0 and not self._head:
                self._head = {key: doc[key] for key in _HEAD if key in doc}
            if isinstance(doc.get("usage"), dict):
                self._usage_doc = doc["usage"]
        if state is _HOLD:
            return self._holding(event, doc)
        if state is _WATCH and doc is not None:
            choice = _choice(doc)
            if choice is _MANY:
                self._state = _THROUGH
            elif isinstance(choice, dict):
                delta = _delta(choice)
                content = delta.get("content")
                if isinstance(content, str):
                    self._text.append(content)
                self._reasoning.add(delta)
                starts = [call for call in _tool_calls(delta) if _name(call) is not None]
                if starts:
                    if _pure(choice) and all(_name(call) == EXPAND_TOOL for call in starts):
                        self._state = _HOLD
                        return self._holding(event, doc)
                    self._state = _THROUGH  # the client owns a call in this turn
        return Step(self._out(event, doc))

    def end(self, complete: bool, tail: bytes = b"") -> Step:
        """End of the upstream body: DONE only for a complete round that said ``[DONE]`` (or erred)."""
        step = self._ended_already()
        if step is not None:
            return step
        send = self._release("ended") if self._state is _HOLD else b""
        if self._round == 0:
            send += tail
        self._state = _DONE
        return Step(send, DONE if complete and self._saw_end else ABORT)

    def begin_continuation(self) -> None:
        if self._state is not _AWAIT:
            raise RuntimeError("begin_continuation() without an EXPAND")
        shown = self._role_shown
        self._fallback = self._render(self._held)  # the release this round would give, not sent yet
        self._role_shown = shown
        self._usages.append(self._usage_doc)
        self._next_round()

    # -----------------------------------------------------------------------------------------
    # Holding

    def _holding(self, event: Event, doc: dict[str, object] | None) -> Step:
        if doc is None:
            if event.data:  # data that is not a JSON object
                return self._release_with("other_block", event, doc)
            return self._hold(event)  # a comment
        choice = _choice(doc)
        if choice is None:
            return self._hold(event)  # the usage chunk
        if not isinstance(choice, dict) or not _pure(choice):
            return self._release_with("other_block", event, doc)
        for call in _tool_calls(_delta(choice)):
            index = call.get("index")
            name = _name(call)
            if name is not None:
                if name != EXPAND_TOOL:
                    return self._release_with("client_tool", event, doc)
                self._expands[index] = _Call(call.get("id"))
            elif index not in self._expands:
                return self._release_with("other_block", event, doc)
            self._expands[index].parts.append(_arguments(call))
        finish = choice.get("finish_reason")
        if finish is not None:
            if finish not in CHAT_CALL_FINISHES:
                return self._release_with("stop_reason", event, doc)
            calls = [self._validated(call) for call in self._expands.values()]
            if not calls or None in calls:
                return self._release_with("bad_input", event, doc)
            self.calls = cast(list[ExpandCall], calls)
            self._decided = True
        return self._hold(event)

    @staticmethod
    def _validated(call: _Call) -> ExpandCall | None:
        arguments = "".join(call.parts)
        try:
            parsed = ujson.loads(arguments)
        except (ValueError, TypeError, OverflowError):
            return None
        ref = parsed.get("id") if isinstance(parsed, dict) else None
        if not isinstance(ref, str) or not isinstance(call.id, str):
            return None
        return ExpandCall(call.id, arguments, parse_marker_ref(ref))

    def _expand(self) -> Step:
        self._state = _AWAIT
        return Step(b"", EXPAND)

    def _release_with(self, reason: ReleaseReason, event: Event, doc: dict[str, object] | None) -> Step:
        return Step(self._release(reason) + self._out(event, doc))

    # -----------------------------------------------------------------------------------------
    # Output

    def _render(self, events: list[Event]) -> bytes:
        return b"".join([self._out(event, json_object(event)) for event in events])

    def _out(self, event: Event, doc: dict[str, object] | None) -> bytes:
        """The bytes the client gets for ``event``, now."""
        if doc is not None and self.hide_usage and doc.get("choices") == [] and isinstance(doc.get("usage"), dict):
            return b""  # the usage chunk only cg asked for
        role = _has_role(doc)
        if self._round == 0:
            self._role_shown = self._role_shown or role
            return event.raw
        if not event.data:
            return event.raw  # a comment
        if doc is None or "error" in doc and "choices" not in doc:
            send = event.raw  # [DONE], an error, what cg cannot read: as it came
        else:
            send = self._spliced(doc, role)
        if self._committed:
            return send
        if doc is not None and _opening(doc):
            self._opening += send  # no content yet: the continuation may still stall
            return b""
        self._committed = True
        self._fallback = None
        send, self._opening = self._opening + send, b""
        return send

    def _spliced(self, doc: dict[str, object], role: bool) -> bytes:
        """A continuation's chunk as round 1's: its head, one role in all, the usage summed."""
        out = dict(doc)
        out.update((key, value) for key, value in self._head.items() if key in doc)
        if role and self._role_shown:
            choice = cast(dict[str, object], _choice(doc))
            delta = dict(_delta(choice))
            del delta["role"]
            out["choices"] = [{**choice, "delta": delta}]
        self._role_shown = self._role_shown or role
        if isinstance(doc.get("usage"), dict):
            out["usage"] = merge_openai_usage([*self._usages, doc["usage"]]) or doc["usage"]
        return _data(out)
