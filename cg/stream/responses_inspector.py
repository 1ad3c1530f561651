"""The incremental inspector for OpenAI Responses API streams (``response.*`` events).

The Responses twin of ``cg.stream.inspector.Inspector`` and ``cg.stream.chat_inspector.ChatInspector``
(same ``Step``/``Action`` contract, same states, same release reasons): one ``ResponsesInspector``
serves one client response stream, every round of it, fed the events of ``cg.wire.sse.SSEParser`` one
at a time. An event's type is its JSON ``type`` (what Codex CLI and the SDK read), else its ``event:``
line. Pure code: no Twisted, no I/O.

Round 1 is forwarded **byte for byte**, each event the moment it is fed, except from a
``response.output_item.added`` whose item is a ``function_call`` named ``context_guru_expand`` (with
no client-owned item before it in the response): that event and every later one are held. An item is
the client's unless it asks the client for nothing (``cg.stream.responses.NOT_CALLS``: a
``message``, a ``reasoning`` or ``compaction`` item, a call the provider ran itself), as
``lone_expand_calls`` reads a JSON response.

==========  ======================================================  ===================================
state       event                                                   action
==========  ======================================================  ===================================
WATCH       ``output_item.added`` of an expand call                 hold it → HOLD
WATCH       ``output_item.added`` of a client's item                forward → THROUGH
WATCH       anything else                                           forward (done items are recorded)
HOLD        another expand call's ``added``; an event of a held     hold
            call (argument deltas, ``done``); an event of no item
            (unknown, comment)
HOLD        a held call's ``output_item.done`` whose ``arguments``  release "bad_input" + fwd → THROUGH
            are not a JSON object with a string ``id``, or
            without a string ``call_id``
HOLD        ``output_item.added`` of a client call (another         release "client_tool" + forward
            function, ``custom_tool_call``, another ``*_call``)     → THROUGH
HOLD        ``added`` of any other item; an event of an item not    release "other_block" + forward
            held; data that is not JSON
HOLD        ``response.completed``, every held call validated       hold → AWAIT, return EXPAND
HOLD        ``response.completed`` with a held call not done        release "bad_input" + forward
HOLD        ``response.incomplete`` / ``response.failed``           release "stop_reason" + forward
HOLD        ``error``                                               release "error" + forward
HOLD        held bytes > ``max_held``                               release "max_held" → THROUGH
HOLD        ``end()``                                               release "ended" → DONE / ABORT
THROUGH     anything                                                forward
AWAIT       ``begin_continuation()`` / ``release()``                as ``Inspector``
==========  ======================================================  ===================================

The decided round's ``response.completed`` never reaches the client: Codex stops reading at the
first one, so the client must get exactly one, at the very end. An EXPAND exposes ``calls`` and
``output`` (the round's items as in their ``output_item.done`` events, expand calls included), which
``assistant_message()`` wraps as ``cg.stream.responses.continuation_body`` takes a response.

"Forward" in round 1 is ``event.raw``. In a continuation round (after ``begin_continuation()``) it
is the splice, which makes every round read as round 1's one response (what Codex CLI and
``client.responses.stream(...).get_final_response()`` need): the continuation's
``response.created``, ``.in_progress`` and ``.queued`` are swallowed (the client has round 1's);
every other event is re-serialized as ``event: <type>`` + compact JSON with ``output_index``
renumbered densely (the next index after the items the client was shown: held expand items never
were, so they take none; the SDK raises on a reused index) and ``sequence_number`` going on from the
last one the client got. A ``response`` object gets round 1's ``id`` (the SDK raises "Lifecycle
response identity changed" otherwise); in a terminal event (completed, incomplete, failed) its
``output`` is every item the client was shown in earlier rounds (their ``output_item.done`` items)
followed by the round's own, and its ``usage`` is ``merge_responses_usage`` over the rounds (round
1's input side, output tokens summed). Comments and data cg cannot read go as they came. A
continuation runs the same holding logic, up to ``max_rounds`` continuations; the last one passes
through (spliced) whatever it holds.

Ends: round 1 is complete only with ``response.completed``, ``.incomplete``, ``.failed`` or an
``error`` event; a stream that ends without one ends the client's response with ABORT, so it never
looks complete. A continuation commits with its first event sent beyond the swallowed ones. Until
then, an ``error``, ``response.failed`` or ``response.incomplete``, or the end of its body, gets the
previous round's held events released instead (round 1's include its own ``response.completed``: a
complete, valid stream; ``released == "continuation_failed"``). After it committed, a continuation
that ends without a terminal response event (its body broke, or it gave only an ``error``) is not
ABORTed: Codex retries the whole turn five times on a stream without ``response.completed``, and
would re-send every item it already got done each time. The client gets a synthesized
``response.failed`` instead (round 1's id, ``error.code: "server_error"``, the items shown, the usage
merged so far) and the stream ends well-formed and honest: failed, never completed. A continuation
whose body breaks after its terminal event was sent ABORTs, as the other inspectors: the client
already has its one ending.

Cost: O(1) amortised per event plus the event's one JSON parse (round 1 forwards its bytes; a
continuation's events are re-serialized once). ``output_item.done`` items are kept by reference
(a round that may still expand: all of them, for its continuation; a splice: those shown, for the
final ``output``), nothing else; held bytes are counted as they come.
"""

from __future__ import annotations

from typing import cast

import ujson

from cg.stream.continuation import ExpandCall, merge_responses_usage
from cg.stream.inspector import (
    ABORT,
    DONE,
    EXPAND,
    NOTHING,
    ReleaseReason,
    RoundInspector,
    State,
    Step,
    frame,
    json_object,
)
from cg.stream.responses import NOT_CALLS, SERVER_CALLS, expand_call, is_expand_call
from cg.stream.usage import StreamUsage
from cg.wire.dialect import RESPONSES_SHAPE
from cg.wire.sse import Event

__all__ = ["ResponsesInspector"]

_WATCH, _HOLD, _THROUGH, _AWAIT, _DONE = State.WATCH, State.HOLD, State.THROUGH, State.AWAIT, State.DONE

_ADDED = "response.output_item.added"
_ITEM_DONE = "response.output_item.done"
_COMPLETED = "response.completed"
_TERMINAL = frozenset({_COMPLETED, "response.incomplete", "response.failed"})
_ENDS = _TERMINAL | {"error"}  # what makes round 1 complete
_FAILURES = _ENDS - {_COMPLETED}  # before a continuation commits: the previous round's release
_OPENING = frozenset({"response.created", "response.in_progress", "response.queued"})
_BROKEN = {"code": "server_error", "message": "cg: the upstream stream broke during an expand continuation"}


def _kind(event: Event, doc: dict[str, object] | None) -> str | None:
    """The event's JSON ``type`` (what the clients read), else its ``event:`` line."""
    given = doc.get("type") if doc is not None else None
    return given if isinstance(given, str) else event.name


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _type(item: object) -> object:
    return item.get("type") if isinstance(item, dict) else None


def _clients(item: object) -> bool:
    """An item the client acts on (or one cg does not know): the response is not cg's to answer."""
    return _type(item) not in NOT_CALLS and not is_expand_call(item)


def _client_call(item: object) -> bool:
    """A call the client runs (for the release reason: "client_tool", else "other_block")."""
    kind = _type(item)
    return kind in ("function_call", "custom_tool_call") or (
        isinstance(kind, str) and kind.endswith("_call") and kind not in SERVER_CALLS)


def _validated(item: object) -> ExpandCall | None:
    """The call a held item's ``done`` makes; None when cg cannot answer it (not an expand call,
    arguments not a JSON object with a string ``id``, no string ``call_id``)."""
    if not is_expand_call(item):
        return None
    item = cast(dict[str, object], item)
    arguments = item.get("arguments")
    try:
        parsed = ujson.loads(arguments) if isinstance(arguments, str) else None
    except (ValueError, TypeError, OverflowError):
        return None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("id"), str):
        return None
    return expand_call(item)


class ResponsesInspector(RoundInspector):
    """Inspects one Responses API stream across all its rounds. See the module docstring."""

    def __init__(self, max_held: int = 16 << 20, max_rounds: int = 3) -> None:
        super().__init__(max_held, max_rounds)
        # What an EXPAND decision exposes, beside ``calls``: the decided round's output items.
        self.output: list[object] = []
        # Across rounds.
        self._head: dict[str, object] | None = None  # round 1's response object, as first seen
        self._id: object = None  # round 1's response id
        self._usages: list[object] = []  # the usage objects of finished rounds
        self._shown: list[object] = []  # the items whose output_item.done the client got, every round
        self._next_index = 0  # the client's next output_index
        self._seq = -1  # the last sequence_number the client got
        self._new_round(_WATCH if max_rounds > 0 else _THROUGH)

    def _new_round(self, state: State) -> None:
        self._state = state
        self._held = []
        self._held_bytes = 0
        self._items: list[object] = []  # the round's done items, while it may expand
        self._expands: dict[int | None, ExpandCall | None] = {}  # held calls by output_index
        self._unfinished = 0  # held calls not validated yet
        self._saw_end = False  # a terminal response event or an error
        self._terminal_sent = False  # the client got this round's terminal response event
        self._committed = self._round == 0
        self._map: dict[int, int] = {}  # continuation output_index -> client output_index
        self._base = self._next_index
        self._shown_before = len(self._shown)  # items of earlier rounds in _shown
        self._usage = StreamUsage(RESPONSES_SHAPE)
        self._usage_doc: object = None

    # -----------------------------------------------------------------------------------------
    # Public API (``cg.exchange.dialects.StreamInspector``; the rest is RoundInspector's)

    def assistant_message(self) -> dict[str, object]:
        """The decided round as ``cg.stream.responses.continuation_body`` takes it."""
        return {"id": self._id, "status": "completed", "output": self.output}

    def feed(self, event: Event) -> Step:
        """One complete upstream event in; what to send the client now out."""
        state = self._state
        if state is _AWAIT or state is _DONE:
            return self._closed()
        self._usage.observe(event)
        doc = json_object(event)
        kind = _kind(event, doc)
        if doc is not None:
            response = doc.get("response")
            if isinstance(response, dict):
                if self._head is None and self._round == 0:
                    self._head = response
                    self._id = response.get("id")
                if kind in _TERMINAL:
                    self._usage_doc = response.get("usage")
        if kind in _ENDS:
            if kind in _FAILURES and not self._committed and self._fallback is not None:
                return Step(self._fail(), DONE)  # the continuation failed before it sent anything
            self._saw_end = True
        if state is _HOLD:
            return self._holding(event, kind, doc)
        if state is _WATCH and doc is not None:
            if kind == _ADDED:
                item = doc.get("item")
                if is_expand_call(item):
                    self._state = _HOLD
                    return self._holding(event, kind, doc)
                if _clients(item):
                    self._pass_through()  # the client owns an item of this response
            elif kind == _ITEM_DONE:
                self._items.append(doc.get("item"))
        return Step(self._out(event, kind, doc))

    def end(self, complete: bool, tail: bytes = b"") -> Step:
        """End of the upstream body: ``complete`` if it ended cleanly, ``tail`` the parser's rest.

        Returns DONE (round 1 ended cleanly after its terminal event, a continuation failed before
        committing and the previous round was released, or a committed continuation ended: with its
        terminal event, else after a synthesized ``response.failed``) or ABORT (round 1 broke or
        never ended, or a continuation broke after its terminal event). ``tail`` (an incomplete last
        event) is forwarded only in round 1.
        """
        step = self._ended_already()
        if step is not None:
            return step
        send = self._release("ended") if self._state is _HOLD else b""
        self._state = _DONE
        if self._round == 0:
            return Step(send + tail, DONE if complete and self._saw_end else ABORT)
        if self._terminal_sent:
            return Step(send, DONE if complete else ABORT)
        return Step(send + self._broken(), DONE)

    def begin_continuation(self) -> None:
        """The continuation's response has begun (2xx): feed its events next."""
        if self._state is not _AWAIT:
            raise RuntimeError("begin_continuation() without an EXPAND")
        # The release this round would give, kept until the continuation commits: rendered now,
        # as if sent next, without counting it as sent.
        kept = self._next_index, self._seq, len(self._shown)
        self._fallback = self._render(self._held)
        self._next_index, self._seq, shown = kept
        del self._shown[shown:]
        self._usages.append(self._usage_doc)
        self._next_round()

    # -----------------------------------------------------------------------------------------
    # Holding

    def _holding(self, event: Event, kind: str | None, doc: dict[str, object] | None) -> Step:
        if doc is None:
            if event.data:
                return self._release_with("other_block", event, kind, doc)
            return self._hold(event)  # a comment
        if kind == _COMPLETED:
            if not self._expands or self._unfinished:
                return self._release_with("bad_input", event, kind, doc)
            step = self._hold(event)
            return step if step is not NOTHING else self._expand()
        if kind in _TERMINAL:
            return self._release_with("stop_reason", event, kind, doc)
        if kind == "error":
            return self._release_with("error", event, kind, doc)
        if kind == _ADDED:
            item = doc.get("item")
            if not is_expand_call(item):
                return self._release_with("client_tool" if _client_call(item) else "other_block", event, kind, doc)
            self._expands[_int(doc.get("output_index"))] = None
            self._unfinished += 1
        elif "output_index" in doc:
            index = _int(doc.get("output_index"))
            if index not in self._expands:
                return self._release_with("other_block", event, kind, doc)  # content the client must see
            if kind == _ITEM_DONE and self._expands[index] is None:
                item = doc.get("item")
                call = _validated(item)
                if call is None:
                    return self._release_with("bad_input", event, kind, doc)
                self._expands[index] = call
                self._unfinished -= 1
                self._items.append(item)
        return self._hold(event)

    def _expand(self) -> Step:
        self._state = _AWAIT
        self.calls = [cast(ExpandCall, call) for call in self._expands.values()]  # decided: all validated
        self.output = self._items
        self._items = []
        return Step(b"", EXPAND)

    def _release_with(self, reason: ReleaseReason, event: Event, kind: str | None,
                      doc: dict[str, object] | None) -> Step:
        return Step(self._release(reason) + self._out(event, kind, doc))

    def _pass_through(self) -> None:
        super()._pass_through()
        self._items = []
        self._expands = {}

    # -----------------------------------------------------------------------------------------
    # Output

    def _render(self, events: list[Event]) -> bytes:
        docs = [json_object(event) for event in events]
        return b"".join([self._out(event, _kind(event, doc), doc) for event, doc in zip(events, docs)])

    def _out(self, event: Event, kind: str | None, doc: dict[str, object] | None) -> bytes:
        """The bytes the client gets for ``event``, now."""
        if doc is None:
            if event.data and not self._committed:
                self._commit()
            return event.raw  # a comment, or what cg cannot read: as it came
        if self._round == 0:
            seq = _int(doc.get("sequence_number"))
            if seq is not None:
                self._seq = seq
            index = _int(doc.get("output_index"))
            if index is not None and index >= self._next_index:
                self._next_index = index + 1
            if kind == _ITEM_DONE and self._state is _WATCH:
                self._shown.append(doc.get("item"))
            return event.raw
        if kind in _OPENING:
            return b""  # the client has round 1's
        if not self._committed:
            self._commit()
        if kind is None:
            return event.raw
        out = dict(doc)
        index = _int(doc.get("output_index"))
        if index is not None:
            if kind == _ADDED:
                client = self._map[index] = self._next_index
                self._next_index += 1
            else:
                mapped = self._map.get(index)
                client = self._base + index if mapped is None else mapped  # never added: the same fault
            out["output_index"] = client
        if kind == _ITEM_DONE:
            self._shown.append(doc.get("item"))
        response = doc.get("response")
        if isinstance(response, dict):
            out["response"] = self._response(kind, response)
        self._seq += 1
        out["sequence_number"] = self._seq
        return frame(kind, out)

    def _commit(self) -> None:
        self._committed = True
        self._fallback = None

    def _response(self, kind: str, response: dict[str, object]) -> dict[str, object]:
        """A continuation's response object as round 1's: its id; when terminal, every round's items
        the client was shown and the usage merged."""
        out = dict(response)
        out["id"] = self._id
        if kind in _TERMINAL:
            self._terminal_sent = True
            own = response.get("output")
            if isinstance(own, list):
                out["output"] = [*self._shown[:self._shown_before], *own]
            usage = merge_responses_usage([*self._usages, response.get("usage")])
            if usage is not None:
                out["usage"] = usage
        return out

    def _broken(self) -> bytes:
        """The ``response.failed`` that ends a committed continuation whose stream broke."""
        response: dict[str, object] = dict(self._head) if self._head is not None else {"object": "response"}
        response.update(id=self._id, status="failed", error=dict(_BROKEN), output=list(self._shown))
        usage = merge_responses_usage(self._usages)
        if usage is not None:
            response["usage"] = usage
        self._seq += 1
        return frame("response.failed", {"type": "response.failed", "response": response,
                                          "sequence_number": self._seq})
