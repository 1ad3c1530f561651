"""The incremental inspector: stream every event at once, hold back only a lone expand call, splice.

One ``Inspector`` serves one client response stream (every round of it). The caller parses the
upstream body with ``cg.wire.sse.SSEParser`` and feeds the events one at a time; each ``feed`` returns a
``Step``: the bytes to write to the client now, and what to do next. Pure code: no Twisted, no I/O,
no clocks.

Round 1 (the upstream's own response) is forwarded **byte for byte**, each event the moment it is
fed, except from a ``content_block_start`` that opens a ``tool_use`` named ``context_guru_expand``
(with no client-owned ``tool_use`` before it in the response): that event and every later one are
held. Then:

==========  ======================================================  ===================================
state       event                                                   action
==========  ======================================================  ===================================
WATCH       ``content_block_start`` expand tool_use                 hold it → HOLD
WATCH       ``content_block_start`` other ``tool_use`` (client's)   forward → THROUGH
WATCH       anything else                                           forward (content is recorded)
HOLD        expand start; a delta; a stop; ping; unknown; comment   hold
HOLD        ``content_block_stop`` of an expand call whose input    release "bad_input" + forward
            is not a JSON object with a string ``id``               → THROUGH
HOLD        ``content_block_start`` client ``tool_use``             release "client_tool" + forward
                                                                    → THROUGH
HOLD        ``content_block_start`` of any other block              release "other_block" + fwd
                                                                    → THROUGH
HOLD        ``message_delta`` ``stop_reason: tool_use``, every      hold, mark *decided*
            expand input valid and stopped
HOLD        ``message_delta`` another stop reason                   release "stop_reason" + fwd
HOLD        ``message_delta`` tool_use with an expand unfinished    release "bad_input" + fwd
HOLD        ``message_stop`` when decided                           hold → AWAIT, return EXPAND
HOLD        ``message_stop`` not decided                            release "stop_reason" + fwd
HOLD        ``error``                                               release "error" + forward
HOLD        held bytes > ``max_held``                               release "max_held" → THROUGH
HOLD        ``end()``: decided and complete                         → AWAIT, return EXPAND
HOLD        ``end()``: otherwise                                    release "ended" → DONE / ABORT
THROUGH     anything                                                forward
AWAIT       ``begin_continuation()``                                next round → WATCH (THROUGH at
                                                                    the round cap)
AWAIT       ``release()``                                           held bytes, "continuation_failed"
                                                                    → DONE
any         ``end()`` (not HOLD)                                    DONE, or ABORT (see ``end``)
==========  ======================================================  ===================================

"Forward" in round 1 is ``event.raw``. In a continuation round (after ``begin_continuation()``) it
goes through the splice: the continuation's ``message_start`` is swallowed; ``content_block_*``
events are re-serialized with their index renumbered so the client's indices stay dense (the next
index after the last block the client got; held expand blocks of earlier rounds never reach it);
every ``message_delta`` is rebuilt as the final one (stop reason and other fields from the
continuation; usage: round 1's input-side fields from its ``message_start``, ``output_tokens`` summed
over rounds); pings, ``message_stop``, ``error`` and unknown events keep their raw bytes. A
continuation runs through the same holding logic, up to ``max_rounds`` continuations; the last one
passes through (renumbered) whatever it holds. A release in a continuation round is renumbered too.

Failures: until a continuation has sent the client anything but pings (``committed``), the previous
round's held events are kept rendered: a continuation that answers an ``error`` event or ends before
its first block gets them released instead (the client receives what the upstream sent, a complete
stream, ``released == "continuation_failed"``). After that a broken continuation is the client's
broken stream (``ABORT``): never a clean ending on truncated content.

Cost: O(1) amortised per event plus the event's own JSON parse (the content of a round that may still
expand is recorded as lists of fragments, joined once at EXPAND; held bytes are counted as they come).
"""

from __future__ import annotations

import enum
import re
from typing import Any, Literal, get_args

import attrs
import ujson

from cg.stream.continuation import ExpandCall
from cg.stream.hidden import Shown, thinking_key
from cg.stream.usage import StreamUsage, Usage
from cg.wire.dialect import MESSAGES_SHAPE
from cg.wire.markers import EXPAND_TOOL, parse_marker_ref
from cg.wire.sse import Event

__all__ = [
    "ABORT",
    "CONTINUE",
    "DONE",
    "EXPAND",
    "NOTHING",
    "PING",
    "RELEASE_REASONS",
    "Action",
    "Inspector",
    "RoundInspector",
    "ReleaseReason",
    "State",
    "Step",
    "frame",
    "json_object",
]


class Action(enum.Enum):
    """What the caller does once it has written a ``Step``'s ``send`` to the client."""

    CONTINUE = "continue"  # keep feeding
    EXPAND = "expand"  # the round ended with a lone expand turn: resolve ``calls``, start a continuation
    DONE = "done"  # finish the client's response cleanly
    ABORT = "abort"  # abort the client's connection (the stream broke)


# The names cg.exchange.machine compares ``Step.action`` with.
CONTINUE = Action.CONTINUE
EXPAND = Action.EXPAND
DONE = Action.DONE
ABORT = Action.ABORT


class State(enum.Enum):
    """Where the inspector is in the module docstring's state table."""

    WATCH = "watch"  # forwarding; an expand start would be held
    HOLD = "hold"  # holding from an expand start on
    THROUGH = "through"  # forwarding; nothing more is held in this round
    AWAIT = "await"  # EXPAND returned: waiting for begin_continuation() or release()
    DONE = "done"


# Module-level names for the hot path: one global lookup per comparison, no attribute lookup.
_WATCH = State.WATCH
_HOLD = State.HOLD
_THROUGH = State.THROUGH
_AWAIT = State.AWAIT
_DONE = State.DONE

# Plain strings, not an enum: they are /stats keys (``sse_released``) as they are.
ReleaseReason = Literal[
    "client_tool",
    "other_block",
    "bad_input",
    "stop_reason",
    "error",
    "ended",
    "max_held",
    "continuation_failed",
]
RELEASE_REASONS: tuple[ReleaseReason, ...] = get_args(ReleaseReason)

PING = b'event: ping\ndata: {"type":"ping"}\n\n'

_INPUT_FIELDS = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
# Looked up by whatever JSON value a delta's type is.
_PART_FIELDS: dict[object, str] = {
    "text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json",
}
_NAMES = {
    name: b"event: " + name.encode() + b"\ndata: "
    for name in ("content_block_start", "content_block_delta", "content_block_stop", "message_delta")
}


@attrs.frozen(slots=True)
class Step:
    """What one ``feed`` / ``end`` asks of the caller: write ``send`` to the client, then ``action``."""

    send: bytes
    action: Action = CONTINUE


NOTHING = Step(b"")  # nothing to send, nothing to do: compared by identity


class _Block:
    """One block of a round, recorded for the continuation's assistant message."""

    __slots__ = ("start", "parts", "signature", "citations", "other", "call", "expand")

    def __init__(self, start: dict[str, object]) -> None:
        self.start = start
        self.expand = False  # a held context_guru_expand call
        self.parts: dict[str, list[str]] = {}
        self.signature: str | None = None
        self.citations: list[object] | None = None
        self.other: dict[str, object] | None = None
        self.call: ExpandCall | None = None  # an expand call, once its input is validated

    def add(self, delta: dict[str, object]) -> None:
        kind = delta.get("type")
        field = _PART_FIELDS.get(kind)
        if field is not None:
            value = delta.get(field)
            if isinstance(value, str):
                self.parts.setdefault(field, []).append(value)
        elif kind == "signature_delta":
            signature = delta.get("signature")
            if isinstance(signature, str):
                self.signature = signature
        elif kind == "citations_delta":
            if self.citations is None:
                self.citations = []
            self.citations.append(delta.get("citation"))
        else:  # a delta type this module does not know (beta): its fields overwrite the block's
            if self.other is None:
                self.other = {}
            self.other.update((k, v) for k, v in delta.items() if k != "type")

    def joined(self, field: str) -> str:
        return "".join(self.parts.get(field, ()))

    def content(self) -> dict[str, object]:
        """The block as the Messages API returns it in ``content``."""
        out: dict[str, Any] = dict(self.start)  # the API's shapes: text, thinking strings; citations a list
        kind = out.get("type")
        if kind == "text":
            out["text"] = (out.get("text") or "") + self.joined("text")
            if self.citations is not None:
                out["citations"] = list(out.get("citations") or ()) + self.citations
        elif kind == "thinking":
            out["thinking"] = (out.get("thinking") or "") + self.joined("thinking")
            if self.signature is not None:
                out["signature"] = self.signature
        elif self.call is not None:
            out["input"] = self.call.raw_input
        elif "partial_json" in self.parts:
            parsed = _object(self.joined("partial_json"))
            if parsed is not None:
                out["input"] = parsed
        if self.other:
            out.update(self.other)
        return out


def _object(text: str) -> dict[str, object] | None:
    """``text`` parsed as a JSON object ("" is ``{}``, as an input without deltas), else None."""
    if not text.strip():
        return {}
    try:
        value = ujson.loads(text)
    except (ValueError, TypeError, OverflowError):
        return None
    return value if isinstance(value, dict) else None


def json_object(event: Event) -> dict[str, object] | None:
    """The event's data as a JSON object; None for a comment, data that is not JSON, or another value."""
    if not event.data:
        return None
    try:
        doc = event.json()
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def _index(doc: dict[str, object] | None) -> int | None:
    if doc is None:
        return None
    index = doc.get("index")
    return index if isinstance(index, int) and not isinstance(index, bool) else None


def _start_block(doc: dict[str, object] | None) -> dict[str, object]:
    block = doc.get("content_block") if doc is not None else None
    return block if isinstance(block, dict) else {}


_INDEX_KEY = re.compile(rb'[{,]\s*"index"\s*:\s*(\d+)')


def _renumbered(event: Event, kind: str, doc: dict[str, object], index: int, client: int) -> bytes:
    """``event`` with its block index set to ``client``.

    The index is rewritten in place in the original bytes when the first ``"index"`` key of
    the event is a top-level one (the API writes it right after ``type``: no ``{`` or ``[``
    comes between the object's opening brace and the key; inside a JSON string a quote is
    always escaped, so the pattern only matches keys). Otherwise the event is re-serialized.
    Either way the client gets an ``event:`` line and the same JSON value.
    """
    raw = event.raw
    match = _INDEX_KEY.search(raw)
    opening = raw.find(b"{")
    if (match is not None and raw.startswith(b"event: ") and int(match[1]) == index
            and b"{" not in raw[opening + 1:match.start(1)] and b"[" not in raw[opening:match.start(1)]):
        if index == client:
            return raw
        return raw[: match.start(1)] + str(client).encode() + raw[match.end(1):]
    doc = dict(doc)
    doc["index"] = client
    return frame(kind, doc)


def frame(name: str, doc: dict[str, object]) -> bytes:
    """An event as new bytes: ``event:`` line (the SDKs drop events without one), compact JSON."""
    try:
        data = ujson.dumps(doc, ensure_ascii=False, escape_forward_slashes=False).encode()
    except UnicodeEncodeError:  # a lone surrogate from a \\ud800 escape: keep it escaped
        data = ujson.dumps(doc, escape_forward_slashes=False).encode()
    head = _NAMES.get(name) or b"event: " + name.encode() + b"\ndata: "
    return head + data + b"\n\n"


class RoundInspector:
    """What every incremental inspector shares: rounds, and holding, releasing and falling back.

    A subclass reads its own wire format (``feed``, ``end``, ``begin_continuation``) and gives
    ``_new_round`` (the per-round state) and ``_render`` (held events as the client gets them).
    ``max_held``: held bytes beyond which the hold is released. ``max_rounds``: how many
    continuations may be spliced into one response; the last one passes through.
    """

    _state: State
    _held: list[Event]
    _held_bytes: int
    _committed: bool  # this round sent the client more than keepalives
    _usage: StreamUsage

    def __init__(self, max_held: int, max_rounds: int) -> None:
        if max_held < 0 or max_rounds < 0:
            raise ValueError("max_held and max_rounds must be >= 0")
        self.max_held = max_held
        self.max_rounds = max_rounds
        # Counters for stats.
        self.rounds = 0  # continuations begun (begin_continuation calls)
        self.held_events = 0  # events ever held, over every round
        self.released: ReleaseReason | None = None  # why the hold was released, if it was
        self.spliced = False  # a continuation was begun
        # What an EXPAND decision exposes.
        self.calls: list[ExpandCall] = []
        # Across rounds.
        self._round = 0
        self._billed: list[Usage] = []  # finished rounds
        self._fallback: bytes | None = None  # the previous round's release, until committed

    @property
    def state(self) -> State:
        """Where the inspector is (for logs and tests)."""
        return self._state

    @property
    def round(self) -> int:
        """The round being fed: 0 for the upstream's own response, k for the k-th continuation."""
        return self._round

    @property
    def committed(self) -> bool:
        """This round has sent the client more than keepalives (so the caller's pings can stop)."""
        return self._committed

    @property
    def held_bytes(self) -> int:
        """Bytes held right now."""
        return self._held_bytes

    @property
    def billed(self) -> list[Usage]:
        """The usage each round reported (its own cumulative totals), for /stats and the change log."""
        return [*self._billed, self._usage.usage]

    def shown(self) -> Shown | None:
        """What the client was shown of a spliced response, where its dialect puts a continuation's
        hidden turns back (`cg.stream.hidden`); None where it does not."""
        return None

    def release(self, reason: ReleaseReason = "continuation_failed") -> bytes:
        """Everything held, for the caller's failure path (``b""`` when nothing is held).

        After an EXPAND (the continuation could not be started, or answered non-2xx): the held
        events, a complete stream, verbatim in round 1 (renumbered in a continuation round); the
        inspector is then done. In a continuation that has sent nothing yet: the previous round's
        release. While holding: the held events, and the rest of the round passes through.
        """
        state = self._state
        if state is _AWAIT:
            send = self._render(self._held)
            self._held = []
            self._held_bytes = 0
            self._state = _DONE
            self.released = reason
            return send
        if state is _DONE:
            return b""
        if not self._committed and self._fallback is not None:
            return self._fail(reason)
        if state is _HOLD:
            return self._release(reason)
        return b""

    def _new_round(self, state: State) -> None:
        raise NotImplementedError

    def _closed(self) -> Step:
        """What ``feed`` and ``end`` give once the round is decided (a caller's error) or all is done."""
        if self._state is _AWAIT:
            raise RuntimeError("the round was decided: call begin_continuation() or release()")
        return Step(b"", DONE)

    def _next_round(self) -> None:
        """``begin_continuation``'s last part: the round billed and counted, the next one begun
        (passing through at the round cap)."""
        self._billed.append(self._usage.usage)
        self._round += 1
        self.rounds += 1
        self.spliced = True
        self._new_round(_WATCH if self._round < self.max_rounds else _THROUGH)

    def _ended_already(self) -> Step | None:
        """``end``'s answer when the state alone decides it: decided or done (``_closed``), or a
        continuation that ends before committing (the previous round's release); else None."""
        if self._state is _AWAIT or self._state is _DONE:
            return self._closed()
        if not self._committed and self._fallback is not None:
            return Step(self._fail(), DONE)
        return None

    def _render(self, events: list[Event]) -> bytes:
        raise NotImplementedError

    def _hold(self, event: Event) -> Step:
        self._held.append(event)
        self.held_events += 1
        self._held_bytes += len(event.raw)
        if self._held_bytes > self.max_held:
            return Step(self._release("max_held"))
        return NOTHING

    def _release(self, reason: ReleaseReason) -> bytes:
        """Send everything held (as the round renders it); the round passes through."""
        self.released = reason
        held = self._held
        self._held = []
        self._held_bytes = 0
        self._pass_through()
        return self._render(held)

    def _pass_through(self) -> None:
        self._state = _THROUGH

    def _fail(self, reason: ReleaseReason = "continuation_failed") -> bytes:
        """The continuation failed before committing: the previous round's release instead."""
        send = self._fallback or b""
        self._fallback = None
        self._held = []
        self._held_bytes = 0
        self._state = _DONE
        self.released = reason
        return send


class Inspector(RoundInspector):
    """Inspects one client response stream across all its rounds. See the module docstring.

    ``max_held``: held bytes beyond which the hold is released (16 MiB). ``max_rounds``: how many
    continuations may be spliced into one response (3); the last one passes through.
    """

    def __init__(self, max_held: int = 16 << 20, max_rounds: int = 3) -> None:
        super().__init__(max_held, max_rounds)
        self.capped = False  # an expand call went to the client because of the round cap
        # What an EXPAND decision exposes, beside ``calls``.
        self.content: list[dict[str, object]] = []
        self.container: dict[str, object] | None = None  # the decided round's (its message_delta's)
        self.message_start: dict[str, object] | None = None  # round 1's ``message`` object
        # Across rounds.
        self._next_index = 0  # the client's next block index
        self._output_before = 0  # output tokens of the finished rounds
        self._input_fields: dict[str, object] = {}  # round 1's message_start usage, input side
        # What the client is shown (`shown`): each block's type, where each continuation's begin,
        # a continuation's first thinking block, and its thinking blocks awaiting their signature.
        self._types: list[str] = []
        self._starts: list[int] = []
        self._thinking: tuple[int, str] | None = None
        self._signing: dict[int, int] = {}  # the round's index -> the client's
        self._shown_by_fallback = Shown((), (), None)  # `shown` after the release a continuation would fail to
        self._new_round(_WATCH if max_rounds > 0 else _THROUGH)

    def _new_round(self, state: State) -> None:
        self._state = state
        self._collect = state == _WATCH  # record content: this round may still expand
        self._blocks: list[_Block] = []
        self._by_index: dict[int | None, _Block] = {}  # looked up with _index()'s None too
        self._map: dict[int, int] = {}  # continuation index -> client index
        self._base = self._next_index
        self._held = []
        self._held_bytes = 0
        self._expands: list[_Block] = []
        self._unfinished = 0  # expand calls started and not yet validly stopped
        self._decided = False
        self._saw_stop = False
        self._saw_error = False
        self._committed = self._round == 0  # sent the client more than pings in this round
        self._usage = StreamUsage(MESSAGES_SHAPE)

    # -----------------------------------------------------------------------------------------
    # Public API

    def assistant_message(self) -> dict[str, object]:
        """The decided round's assistant message, for the continuation request, with the code
        execution container it ran in when it named one (`cg.stream.continuation` reads it as a
        JSON response's)."""
        message: dict[str, object] = {"role": "assistant", "content": self.content}
        if self.container is not None:
            message["container"] = self.container
        return message

    def shown(self) -> Shown:
        """What the client was shown of the response so far (`cg.stream.hidden`)."""
        return Shown(tuple(self._types), tuple(self._starts), self._thinking)

    def _fail(self, reason: ReleaseReason = "continuation_failed") -> bytes:
        """The previous round's release, and what it shows: this continuation showed nothing."""
        shown = self._shown_by_fallback
        self._types, self._starts, self._thinking = list(shown.types), list(shown.starts), shown.thinking
        return super()._fail(reason)

    def feed(self, event: Event) -> Step:
        """One complete upstream event in; what to send the client now out."""
        state = self._state
        if state is _AWAIT or state is _DONE:
            return self._closed()
        kind = event.name
        self._usage.observe(event)
        if kind == "message_start" and self._round == 0:
            self._note_start(event)
        elif kind == "message_stop":
            self._saw_stop = True
        elif kind == "error":
            if not self._committed and self._fallback is not None:
                return Step(self._fail(), DONE)
            self._saw_error = True
        if state is _HOLD:
            return self._holding(event, kind)
        if self._collect:
            self._record(event, kind)
            if kind == "content_block_start":
                block = _start_block(json_object(event))
                if block.get("type") == "tool_use":
                    if block.get("name") == EXPAND_TOOL:
                        self._state = _HOLD
                        self._add_expand()
                        return self._hold(event)
                    self._pass_through()  # the client owns a call in this batch
        return Step(self._out(event, kind))

    def end(self, complete: bool, tail: bytes = b"") -> Step:
        """End of the upstream body: ``complete`` if it ended cleanly, ``tail`` the parser's rest.

        Returns EXPAND (a decided round whose ``message_stop`` never came), DONE (finish the
        client's response: round 1 ended cleanly, a continuation ended with ``message_stop`` or an
        ``error`` event, or a continuation failed before committing and the previous round was
        released), or ABORT (the upstream broke, or a continuation ended on truncated content).
        ``tail`` (an incomplete last event) is forwarded only in round 1.
        """
        state = self._state
        if state is _AWAIT or state is _DONE:
            return self._closed()
        if state is _HOLD and self._decided and complete:
            return self._expand()
        if not self._committed and self._fallback is not None:
            return Step(self._fail(), DONE)
        send = self._release("ended") if state is _HOLD else b""
        if self._round == 0:
            send += tail
            ok = complete
        else:
            ok = complete and (self._saw_stop or self._saw_error)
        self._state = _DONE
        return Step(send, DONE if ok else ABORT)

    def begin_continuation(self) -> None:
        """The continuation's response has begun (2xx): feed its events next."""
        if self._state is not _AWAIT:
            raise RuntimeError("begin_continuation() without an EXPAND")
        # The release this round would give, kept until the continuation commits, and what the
        # client is shown if it gets it instead (`_fail`).
        next_index, shown, thinking = self._next_index, len(self._types), self._thinking
        self._fallback = self._render(self._held)
        self._shown_by_fallback = self.shown()
        self._next_index, self._thinking = next_index, thinking
        del self._types[shown:]
        self._output_before += self._usage.usage.output_tokens
        self._starts.append(next_index)
        self._signing = {}
        self._next_round()

    # -----------------------------------------------------------------------------------------
    # Holding

    def _holding(self, event: Event, kind: str | None) -> Step:
        self._record(event, kind)
        if kind == "content_block_start":
            self._decided = False
            start = _start_block(json_object(event))
            if start.get("type") != "tool_use":
                return self._release_with("other_block", event, kind)
            if start.get("name") != EXPAND_TOOL:
                return self._release_with("client_tool", event, kind)
            self._add_expand()
        elif kind == "content_block_stop":
            block = self._by_index.get(_index(json_object(event)))
            if block is not None and block.expand and block.call is None:
                parsed = _object(block.joined("partial_json"))
                ref = parsed.get("id") if parsed is not None else None
                call_id = block.start.get("id")
                if parsed is None or not isinstance(ref, str) or not isinstance(call_id, str):
                    return self._release_with("bad_input", event, kind)
                block.call = ExpandCall(call_id, parsed, parse_marker_ref(ref))
                self._unfinished -= 1
        elif kind == "message_delta":
            doc = json_object(event)
            delta = doc.get("delta") if doc is not None else None
            stop = delta.get("stop_reason") if isinstance(delta, dict) else None
            if isinstance(delta, dict) and isinstance(delta.get("container"), dict):
                self.container = delta["container"]
            if stop != "tool_use":
                return self._release_with("stop_reason", event, kind)
            if self._unfinished:
                return self._release_with("bad_input", event, kind)
            self._decided = True
        elif kind == "message_stop":
            if not self._decided:
                return self._release_with("stop_reason", event, kind)
            step = self._hold(event)
            return step if step is not NOTHING else self._expand()
        elif kind == "error":
            return self._release_with("error", event, kind)
        return self._hold(event)

    def _add_expand(self) -> None:
        block = self._blocks[-1]
        block.expand = True
        self._expands.append(block)
        self._unfinished += 1

    def _expand(self) -> Step:
        self._state = _AWAIT
        self.calls = []
        for block in self._expands:
            assert block.call is not None  # decided: every expand call was validated at its stop
            self.calls.append(block.call)
        self.content = [block.content() for block in self._blocks]
        self._blocks = []
        self._by_index = {}
        return Step(b"", EXPAND)

    def _release_with(self, reason: ReleaseReason, event: Event, kind: str | None) -> Step:
        return Step(self._release(reason) + self._out(event, kind))

    def _pass_through(self) -> None:
        super()._pass_through()
        self._collect = False
        self._blocks = []
        self._by_index = {}
        self._expands = []

    # -----------------------------------------------------------------------------------------
    # Recording and output

    def _note_start(self, event: Event) -> None:
        doc = json_object(event)
        message = doc.get("message") if doc is not None else None
        if isinstance(message, dict):
            self.message_start = message
            usage = message.get("usage")
            if isinstance(usage, dict):
                self._input_fields = {k: usage[k] for k in _INPUT_FIELDS if k in usage}

    def _record(self, event: Event, kind: str | None) -> None:
        """Keep the round's content, for the assistant message of a continuation."""
        if kind == "content_block_start":
            doc = json_object(event)
            block = _Block(dict(_start_block(doc)))
            self._blocks.append(block)
            index = _index(doc)
            if index is not None:
                self._by_index[index] = block
        elif kind == "content_block_delta":
            doc = json_object(event)
            recorded = self._by_index.get(_index(doc))
            delta = doc.get("delta") if doc is not None else None
            if recorded is not None and isinstance(delta, dict):
                recorded.add(delta)

    def _render(self, events: list[Event]) -> bytes:
        return b"".join([self._out(event, event.name) for event in events])

    def _out(self, event: Event, kind: str | None) -> bytes:
        """The bytes the client gets for ``event``, forwarded now."""
        if self._round == 0:
            if kind == "content_block_start":
                doc = json_object(event)
                index = _index(doc)
                if index is not None and index >= self._next_index:
                    self._next_index = index + 1
                    self._types.append(str(_start_block(doc).get("type")))
                if self.max_rounds == 0:
                    self._note_capped(event)
            return event.raw
        if kind == "message_start":
            return b""  # the client has round 1's
        if kind is None or kind == "ping":
            return event.raw
        self._commit()
        if kind == "message_delta":
            doc = json_object(event)
            return event.raw if doc is None else self._final_delta(doc)
        if kind not in _NAMES:  # message_stop, error, unknown events: as they came
            return event.raw
        doc = json_object(event)
        index = _index(doc)
        if doc is None or index is None:
            return event.raw
        if kind == "content_block_start":
            client = self._map[index] = self._next_index
            self._next_index += 1
            if self._round >= self.max_rounds:
                self._note_capped(event)
            self._note_shown(_start_block(doc), index, client)
        else:
            mapped = self._map.get(index)
            # A block never started: the client would see the same fault.
            client = self._base + index if mapped is None else mapped
            if index in self._signing:
                self._note_signature(doc, index)
        return _renumbered(event, kind, doc, index, client)

    def _note_shown(self, block: dict[str, object], index: int, client: int) -> None:
        """A continuation's block the client is shown: its type, and its key if it is the first
        thinking block (a thinking block's signature comes in a later delta)."""
        self._types.append(str(block.get("type")))
        if self._thinking is None:
            key = thinking_key(block)
            if key is not None:
                self._thinking = (client, key)
            elif block.get("type") == "thinking":
                self._signing[index] = client

    def _note_signature(self, doc: dict[str, object], index: int) -> None:
        delta = doc.get("delta")
        signature = delta.get("signature") if isinstance(delta, dict) else None
        if isinstance(delta, dict) and delta.get("type") == "signature_delta" and self._thinking is None:
            if isinstance(signature, str) and signature:
                self._thinking = (self._signing.pop(index), signature)

    def _commit(self) -> None:
        if not self._committed:
            self._committed = True
            self._fallback = None

    def _note_capped(self, event: Event) -> None:
        block = _start_block(json_object(event))
        if block.get("type") == "tool_use" and block.get("name") == EXPAND_TOOL:
            self.capped = True

    def _final_delta(self, doc: dict[str, object]) -> bytes:
        """The spliced response's message_delta: input side from round 1, output summed."""
        out = dict(doc)
        given = doc.get("usage")
        usage: dict[str, object] = dict(given) if isinstance(given, dict) else {}
        usage.update(self._input_fields)
        usage["output_tokens"] = self._output_before + self._usage.usage.output_tokens
        out["usage"] = usage
        return frame("message_delta", out)
