"""The exchange: one client request and its upstream round(s), as a state machine fed events.

Sans-io, in the style of `cg.stream.inspector`: the driver (`cg.web.driver`) turns the client's
request, the upstream's callbacks and the reactor's timers into events, feeds them to `feed`, and
carries out the commands it returns, in order. The exchange never touches a socket, a Deferred
or the reactor; it reads the time from the clock it is given (for its record only).

The response takes one of three paths, chosen when the upstream's head arrives: pass-through,
the dialect's stream inspector (a stream where cg injected the expand tool), or the JSON expand
loop (collect the body, continue upstream while the model only calls expand, answer once).
Per-dialect knowledge lives in the adapter (`cg.exchange.dialects`).

============  =========================================  =============================================
state         event                                      commands → next state
============  =========================================  =============================================
PREPARING     Prepared                                   Send round 0 → AWAITING
AWAITING      Head of round 0                            SetHead, [Write b"" (a 2xx stream: the head
                                                         goes out now)], ReadBody → PASSING,
                                                         INSPECTING (a stream, expand injected, 2xx)
                                                         or COLLECTING (JSON, expand injected, 2xx)
AWAITING      UpstreamFailed, round 0                    SetHead 502/504, Write error, Finish → ENDED
AWAITING      Head of round k, usable                    [StartTimer STALL], ReadBody → INSPECTING /
                                                         COLLECTING
AWAITING      Head of round k, not 2xx (or not a         DiscardBody, *fall back* → ENDED
              stream where one is inspected)
AWAITING      UpstreamFailed, round k                    *fall back* → ENDED
PASSING       Chunk                                      Write
PASSING       BodyEnd                                    Finish (complete) or Abort → ENDED
INSPECTING    Chunk, BodyEnd                             Write what the inspector sends; at its
                                                         EXPAND: DetachBody, StartTimer PING, Resolve
                                                         → RESOLVING; DONE: [KeepHidden], Finish;
                                                         ABORT: Abort
COLLECTING    Chunk                                      (kept)
COLLECTING    BodyEnd, only expand calls, rounds left    Resolve → RESOLVING
COLLECTING    BodyEnd, otherwise                         Write the round(s), merged, [KeepHidden],
                                                         Finish → ENDED
                                                         (round 0 cut short: Abort)
RESOLVING     Resolved                                   Send round k+1 → AWAITING
RESOLVING     ResolveFailed                              *fall back* → ENDED
any live      TimerFired PING                            Write the dialect's keepalive
AWAITING,     TimerFired STALL, nothing of round k       StopUpstream, *fall back* → ENDED
INSPECTING    sent yet
any live      ClientGone                                 StopUpstream → ENDED
any live      Cut                                        StopUpstream, Abort → ENDED
ENDED         Anything                                   nothing
============  =========================================  =============================================

*KeepHidden*: a spliced Messages response whose continuation wrote a thinking block: the record of
the turns the client never saw, which later requests put back before it (`cg.stream.hidden`).

*Fall back*: the continuation failed before the client got any of it: a stream gets the
inspector's release (what the upstream sent, verbatim), JSON the rounds so far, merged; then
Finish. Entering ENDED cancels the running timers and emits the exchange's `Record`, exactly once.
An `Abort` flushes then closes a chunked response (without its last chunk it cannot look
complete), and aborts any other (`flush`).

Any other (state, event) raises `Unexpected` and changes nothing; the driver counts and logs it.
`TRANSITIONS` is this table as the code runs it, and a test checks that the two name the same pairs.

Cost: O(1) per event beyond the inspector's own work; a chunk passed through is one `Write`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
import ujson

from cg.compaction.pipeline import result_sizes
from cg.compaction.rewrite import Rewrite
from cg.exchange.dialects import Dialect, Resolutions, StreamInspector, for_dialect
from cg.exchange.record import Compacted, ExchangeRecord, Inspected
from cg.stream import hidden
from cg.stream.continuation import ExpandCall
from cg.stream.hidden import HiddenTurn
from cg.stream.inspector import ABORT, DONE, EXPAND, Step
from cg.stream.usage import ResponseUsage, Usage
from cg.wire.sse import Event, SSEParser

if TYPE_CHECKING:  # prepare imports this module (Unexpected)
    from cg.exchange.prepare import Report

__all__ = [
    "PING_INTERVAL",
    "TRANSITIONS",
    "Unexpected",
    "Abort",
    "BodyEnd",
    "CancelTimer",
    "Chunk",
    "ClientGone",
    "Command",
    "Cut",
    "DetachBody",
    "DiscardBody",
    "Exchange",
    "Finish",
    "Head",
    "KeepHidden",
    "Prepared",
    "ReadBody",
    "Record",
    "Resolve",
    "ResolveFailed",
    "Resolved",
    "Send",
    "SetHead",
    "StartTimer",
    "State",
    "StopUpstream",
    "Timer",
    "TimerFired",
    "UpstreamFailed",
    "Write",
]

PING_INTERVAL = 5.0  # seconds; Claude Code gives up on a silent stream after ~180 s


class Unexpected(Exception):
    """An event the machine's state has no row for: a bug in whoever fed it. Nothing changed."""


class State(enum.Enum):
    """Where the exchange is in the module docstring's table."""

    PREPARING = "preparing"  # the request side (repair, compaction, the store) runs
    AWAITING = "awaiting"  # a request is upstream, its head not here yet
    PASSING = "passing"  # every byte to the client as it comes
    INSPECTING = "inspecting"  # a stream through the dialect's inspector
    COLLECTING = "collecting"  # a JSON body read whole, for the expand loop
    RESOLVING = "resolving"  # expand calls out for their originals
    ENDED = "ended"


class Timer(enum.Enum):
    PING = "ping"  # repeats: keeps the client's stream alive while a continuation is awaited
    STALL = "stall"  # once: a continuation that answered headers must send content in time


# ---------------------------------------------------------------------------------------------
# Events: what the driver feeds.


@attrs.frozen(slots=True)
class Prepared:
    """The request side is done: forward `body` (None: no body), as `rewrite` decided. `report`,
    what the request side did, goes out again with the exchange's `Record`."""

    body: bytes | None
    rewrite: Rewrite | None  # None when cg changed nothing it must answer for
    session: str = "-"
    seq: int = 0
    report: Report | None = None


@attrs.frozen(slots=True)
class Head:
    """The upstream's response head (a continuation's, in a later round)."""

    status: int
    phrase: bytes
    headers: object  # the client's response headers, as the driver derived them (opaque here)
    length_known: bool  # those headers carry a content-length
    stream: bool  # an event stream
    decodable: bool  # its body reaches the exchange decoded (gzip or identity)


@attrs.frozen(slots=True)
class Chunk:
    """Body bytes of the current round, decoded."""

    data: bytes


@attrs.frozen(slots=True)
class BodyEnd:
    complete: bool  # the body ended cleanly (and its encoding too)


@attrs.frozen(slots=True)
class UpstreamFailed:
    """No response head came: the request failed."""

    timeout: bool
    message: str


@attrs.frozen(slots=True)
class ClientGone:
    """The client's connection closed before its response was finished."""


@attrs.frozen(slots=True)
class Cut:
    """cg cuts the client off (the drain timeout ran out, or cg hit a bug)."""


@attrs.frozen(slots=True)
class Resolved:
    resolutions: Resolutions  # ref -> original or why there is none (`cg.stream.continuation`)


@attrs.frozen(slots=True)
class ResolveFailed:
    message: str


@attrs.frozen(slots=True)
class TimerFired:
    timer: Timer


ExchangeEvent = (
    Prepared | Head | Chunk | BodyEnd | UpstreamFailed | ClientGone | Cut | Resolved | ResolveFailed | TimerFired
)


# ---------------------------------------------------------------------------------------------
# Commands: what the driver carries out, in order.


@attrs.frozen(slots=True)
class SetHead:
    """The client response's status; `headers` replaces its headers (when given), `fields` are set."""

    status: int
    phrase: bytes | None = None  # None: the status's usual phrase
    headers: object = None
    fields: tuple[tuple[bytes, bytes], ...] = ()


@attrs.frozen(slots=True)
class Write:
    data: bytes


@attrs.frozen(slots=True)
class Finish:
    """The client's response is complete (an upstream body still flowing is dropped)."""


@attrs.frozen(slots=True)
class Abort:
    """Cut the client's connection so a truncated response cannot look complete."""

    flush: bool  # close once what was written is flushed (a chunked response); else abort now


@attrs.frozen(slots=True)
class Send:
    """A request upstream: the client's (round 0) or the k-th continuation."""

    body: bytes | None
    round: int


@attrs.frozen(slots=True)
class ReadBody:
    """Feed the body of the response whose head came last, decoded, as Chunks and a BodyEnd."""


@attrs.frozen(slots=True)
class DiscardBody:
    """Read and drop the body of the response whose head came last."""


@attrs.frozen(slots=True)
class DetachBody:
    """The current body no longer feeds the client: let it drain unseen."""


@attrs.frozen(slots=True)
class StopUpstream:
    """Cancel the request awaiting its head, or stop the body that flows."""


@attrs.frozen(slots=True)
class Resolve:
    """Look up the originals these expand calls ask for, then feed Resolved (or ResolveFailed)."""

    calls: list[ExpandCall]


@attrs.frozen(slots=True)
class KeepHidden:
    """Freeze the record of a spliced response's hidden turns under `key` (`cg.stream.hidden`), so
    the next request puts them back before the thinking a continuation wrote; no answer."""

    key: str
    text: bytes


@attrs.frozen(slots=True)
class StartTimer:
    timer: Timer
    delay: float
    repeat: bool = False  # fire every `delay` until cancelled


@attrs.frozen(slots=True)
class CancelTimer:
    timer: Timer


@attrs.frozen(slots=True)
class Record:
    """The exchange ended: what it did, and what its request side did (its ledger row's facts)."""

    record: ExchangeRecord
    report: Report | None = None


Command = (
    SetHead | Write | Finish | Abort | Send | ReadBody | DiscardBody | DetachBody | StopUpstream | Resolve
    | KeepHidden | StartTimer | CancelTimer | Record
)

_PREPARING = State.PREPARING
_AWAITING = State.AWAITING
_PASSING = State.PASSING
_INSPECTING = State.INSPECTING
_COLLECTING = State.COLLECTING
_RESOLVING = State.RESOLVING
_ENDED = State.ENDED

_FINISH = Finish()
_HEAD_NOW = Write(b"")
_READ = ReadBody()
_STOP = StopUpstream()


class Exchange:
    """One client request, from its arrival to its end. See the module docstring.

    `dialect` is the API the endpoint speaks (errors); the expand loop speaks the rewrite's. `reads`: the shape of
    this endpoint's responses, which cg parses for their usage (None: it reads none). `http11`: the client spoke HTTP/1.1 (a response
    without a content-length is chunked, so a cut can flush).
    """

    def __init__(
        self,
        method: str,
        target: str,
        dialect: str,
        *,
        bytes_in: int,
        reads: str | None,
        http11: bool,
        clock: Callable[[], float],
        max_expand_rounds: int = 3,
        max_held: int = 16 << 20,
        continuation_timeout: float = 600.0,
    ) -> None:
        self._method = method
        self._target = target
        self._dialect = dialect
        self._api = for_dialect(dialect)
        self._bytes_in = bytes_in
        self._reads = reads
        self._http11 = http11
        self._clock = clock
        self._max_expand_rounds = max_expand_rounds
        self._max_held = max_held
        self._continuation_timeout = continuation_timeout
        self._state = _PREPARING
        self._out: list[Command] = []
        self._timers: set[Timer] = set()
        self._session = "-"
        self._seq = 0
        self._rewrite: Rewrite | None = None
        self._report: Report | None = None
        self._status: int | None = None
        self._length_known = False
        self._stream = False
        self._outcome = "ok"
        self._continuation_failed: str | None = None
        self._t_received = clock()
        self._t_sent: float | None = None
        self._t_headers: float | None = None
        self._t_upstream_first: float | None = None
        self._t_client_first: float | None = None
        self._added_ttfb: float | None = None
        self._bytes_out = 0
        self._round = 0  # continuations sent
        self._forwarded: bytes | None = None  # the body sent upstream last (a continuation extends it)
        self._hidden: list[HiddenTurn | None] = []  # each continuation's turn the client never sees
        self._loop: Dialect = self._api  # the expand loop's dialect, once chosen
        self._meter: ResponseUsage | None = None  # usage off a response passed through
        self._inspector: StreamInspector | None = None
        self._parser = SSEParser()
        self._chunks: list[bytes] = []  # the JSON body of the current round
        self._rounds: list[dict[str, object]] = []  # the JSON loop's responses
        self._first_body = b""
        self._calls: list[ExpandCall] = []  # being resolved
        self._assistant: dict[str, object] = {}  # the turn that made them

    @property
    def state(self) -> State:
        return self._state

    def feed(self, event: ExchangeEvent) -> list[Command]:
        """One event in; the commands to carry out, in order, out. An event the state does not
        expect (no row of `TRANSITIONS`) raises `Unexpected` and changes nothing."""
        handler = TRANSITIONS.get((self._state, type(event)))
        if handler is None:
            raise Unexpected(f"{type(event).__name__} in {self._state.name}")
        out = self._out = []
        handler(self, event)
        self._out = []  # the commands are the caller's now: an ended exchange keeps no Write
        return out

    # -----------------------------------------------------------------------------------------
    # The request and the first head

    def _prepared(self, event: Prepared) -> None:
        self._session = event.session
        self._seq = event.seq
        self._rewrite = event.rewrite
        self._report = event.report
        self._forwarded = event.body
        self._t_sent = self._clock()
        self._state = _AWAITING
        self._out.append(Send(event.body, 0))

    def _head(self, event: Head) -> None:
        if self._round:
            self._continuation_head(event)
            return
        self._t_headers = self._clock()
        self._status = event.status
        self._length_known = event.length_known
        self._stream = event.stream
        out = self._out
        out.append(SetHead(event.status, event.phrase, event.headers))
        ok = 200 <= event.status < 300
        if event.stream and ok:
            # The head goes out now, as upstream's came (an empty write sends it): a client's
            # first-byte timer starts with it, and the first event may be seconds away.
            out.append(_HEAD_NOW)
        rewrite = self._rewrite
        self._state = _PASSING
        if rewrite is not None and rewrite.injected and rewrite.stash and ok and event.decodable:
            self._loop = for_dialect(rewrite.dialect)
            if not event.stream:
                self._state = _COLLECTING
            else:
                self._inspector = self._loop.stream_inspector(self._max_held, self._max_expand_rounds,
                                                              rewrite.usage_added)
                if self._inspector is not None:
                    self._state = _INSPECTING
        if self._state is _PASSING and self._reads is not None and ok and event.decodable:
            self._meter = for_dialect(self._reads).usage_meter(event.stream)
        out.append(_READ)

    def _failed(self, event: UpstreamFailed) -> None:
        if self._round:
            self._fall_back(event.message)
            return
        status = 504 if event.timeout else 502
        what = "timed out waiting for" if event.timeout else "could not get a response from"
        body = self._api.error_body(status, f"cg {what} the upstream: {event.message}")
        self._outcome = "upstream_error"
        self._status = status
        self._length_known = True
        self._out.append(SetHead(status, fields=((b"content-type", b"application/json"),
                                                 (b"content-length", b"%d" % len(body)))))
        self._write(body)
        self._finish()

    # -----------------------------------------------------------------------------------------
    # Bodies

    def _chunk(self, event: Chunk) -> None:
        if self._t_upstream_first is None:
            self._t_upstream_first = self._clock()
        data = event.data
        state = self._state
        if not data:
            return
        if state is _PASSING:
            if self._meter is not None:
                self._meter.feed(data)
            self._write(data)
        elif state is _INSPECTING:
            self._inspect(self._parser.feed(data))
        elif state is _COLLECTING:
            self._chunks.append(data)

    def _body_end(self, event: BodyEnd) -> None:
        state = self._state
        if state is _PASSING:
            if event.complete:
                self._finish()
            else:
                self._upstream_broke()
        elif state is _INSPECTING:
            self._inspect(self._parser.flush())
            if self._state is _INSPECTING:
                assert self._inspector is not None
                self._step(self._inspector.end(event.complete, self._parser.close()))
        elif state is _COLLECTING:
            body = b"".join(self._chunks)
            self._chunks = []
            self._json_round(event.complete, body)

    def _inspect(self, events: list[Event]) -> None:
        inspector = self._inspector
        assert inspector is not None
        for event in events:
            self._step(inspector.feed(event))
            if self._state is not _INSPECTING:
                return

    def _step(self, step: Step) -> None:
        inspector = self._inspector
        assert inspector is not None
        if step.send:
            if inspector.committed:
                self._stop_timers()
            self._write(step.send)
        action = step.action
        if action is EXPAND:
            # The round is decided at its message_stop: continue now, whatever the old body still
            # does (a gateway may keep it open); it drains unseen. Pings until the next round commits.
            self._out.append(DetachBody())
            self._stop_timers()
            self._start_timer(Timer.PING, PING_INTERVAL, repeat=True)
            self._continue(inspector.calls, inspector.assistant_message())
        elif action is DONE:
            self._finish()
        elif action is ABORT:
            self._upstream_broke()

    def _json_round(self, complete: bool, body: bytes) -> None:
        first = not self._rounds
        if not complete:
            if first:
                self._upstream_broke()
            else:
                self._fall_back("the continuation broke")
            return
        try:
            doc = ujson.loads(body)
        except ValueError:
            doc = None
        if not isinstance(doc, dict):
            if first:
                self._write(body)  # not what cg can read: as it came
                self._finish()
            else:
                self._fall_back("the continuation is not JSON")
            return
        self._rounds.append(doc)
        if first:
            self._first_body = body
        calls = self._loop.lone_expand_calls(doc)
        if calls is None or len(self._rounds) > self._max_expand_rounds:
            self._answer_json()
            return
        self._continue(calls, doc)

    def _answer_json(self) -> None:
        """One response for the client: the first as it came, or every round merged."""
        rounds = self._rounds
        if len(rounds) == 1:
            self._write(self._first_body)
        else:
            self._write(ujson.dumps(self._loop.merge(rounds), ensure_ascii=False,
                                    escape_forward_slashes=False).encode("utf-8"))
        self._finish()

    # -----------------------------------------------------------------------------------------
    # The expand loop: resolve the calls, send the continuation

    def _continue(self, calls: list[ExpandCall], assistant: dict[str, object]) -> None:
        self._calls = calls
        self._assistant = assistant
        self._state = _RESOLVING
        self._out.append(Resolve(calls))

    def _resolved(self, event: Resolved) -> None:
        assert self._forwarded is not None  # a continuation follows a response to a body
        stream = True if self._inspector is not None else None
        try:
            body, unseen = self._loop.continuation(self._forwarded, self._assistant, self._calls,
                                                   event.resolutions, stream)
        except Exception as error:  # fail open: the client gets what it would have without cg
            self._fall_back(f"building it failed: {error!r}")
            return
        self._hidden.append(unseen)
        self._forwarded = body
        self._round += 1
        self._state = _AWAITING
        self._out.append(Send(body, self._round))

    def _resolve_failed(self, event: ResolveFailed) -> None:
        self._fall_back(event.message)

    def _continuation_head(self, event: Head) -> None:
        inspector = self._inspector
        usable = 200 <= event.status < 300 and event.decodable and (inspector is None or event.stream)
        if not usable:
            self._out.append(DiscardBody())
            self._fall_back(f"HTTP {event.status}")
            return
        if inspector is None:
            self._state = _COLLECTING
        else:
            inspector.begin_continuation()
            self._parser = SSEParser()
            self._state = _INSPECTING
            # Headers came; the continuation must also commit (send content) in time. A client
            # that reads nothing keeps it paused, and past this it gets the verbatim release.
            self._start_timer(Timer.STALL, self._continuation_timeout)
        self._out.append(_READ)

    def _fall_back(self, why: str) -> None:
        """The continuation failed before the client got any of it: the rounds so far, as they came."""
        self._continuation_failed = why
        inspector = self._inspector
        if inspector is None:
            self._answer_json()
            return
        self._stop_timers()
        self._write(inspector.release())
        self._finish()

    # -----------------------------------------------------------------------------------------
    # Timers

    def _start_timer(self, timer: Timer, delay: float, repeat: bool = False) -> None:
        self._timers.add(timer)
        self._out.append(StartTimer(timer, delay, repeat))

    def _stop_timers(self) -> None:
        for timer in sorted(self._timers, key=lambda t: t.value):
            self._out.append(CancelTimer(timer))
        self._timers.clear()

    def _timer_fired(self, event: TimerFired) -> None:
        timer = event.timer
        if timer not in self._timers:
            return  # cancelled, its firing already on its way
        if timer is Timer.PING:
            self._write(self._loop.keepalive)
            return
        self._timers.discard(timer)  # STALL: the continuation never committed (that cancels it)
        self._stop_upstream()
        self._fall_back("no content in time")

    # -----------------------------------------------------------------------------------------
    # The client's side, and the end

    def _write(self, data: bytes) -> None:
        if self._t_client_first is None:
            now = self._t_client_first = self._clock()
            assert self._t_sent is not None  # nothing reaches the client before the request left
            self._added_ttfb = (self._t_sent - self._t_received) + (now - (self._t_upstream_first or now))
        self._bytes_out += len(data)
        self._out.append(Write(data))

    def _finish(self) -> None:
        if self._t_client_first is None:
            self._write(b"")
        if self._hidden:
            self._keep_hidden()
        self._out.append(_FINISH)
        self._end()

    def _keep_hidden(self) -> None:
        """A spliced response whose continuation wrote thinking: its hidden turns' record, kept
        before the client has the response's end (so before it can send the next request). A
        continuation that failed (`_fall_back`) showed nothing: the rounds before it are the
        client's, the last of them with its expand calls, so only the turns before that one were
        hidden."""
        inspector = self._inspector
        shown = inspector.shown() if inspector is not None else self._loop.shown(self._rounds)
        kept = None if shown is None else hidden.record(shown, self._hidden[:len(shown.starts)])
        if kept is not None:
            self._out.append(KeepHidden(*kept))

    def _upstream_broke(self) -> None:
        """A response cut short upstream must never look complete to the client."""
        self._abort("upstream_broke")

    def _abort(self, outcome: str) -> None:
        self._outcome = outcome
        self._stop_upstream()
        self._out.append(Abort(flush=self._http11 and not self._length_known))
        self._end()

    def _stop_upstream(self) -> None:
        self._stop_timers()
        self._out.append(_STOP)

    def _client_gone(self, event: ClientGone) -> None:
        self._outcome = "client_gone"
        self._stop_upstream()
        self._end()

    def _cut(self, event: Cut) -> None:
        self._abort("aborted")

    def _ignore(self, event: ExchangeEvent) -> None:
        """An ended exchange takes what still comes (a late answer, the client leaving) and does nothing."""

    def _end(self) -> None:
        self._state = _ENDED
        self._stop_timers()
        self._out.append(Record(self._record(), self._report))
        # Ended, it keeps no body: its driver, the client's request and Twisted's callbacks hold
        # one another in cycles that only the cyclic collector frees, rarely (cg.web.service's
        # settle_gc), and until then they would hold the forwarded body and the rounds.
        self._forwarded = self._rewrite = self._report = self._inspector = self._meter = None
        self._chunks, self._rounds, self._first_body, self._calls, self._assistant = [], [], b"", [], {}
        self._hidden = []

    def _record(self) -> ExchangeRecord:
        usage, rounds = self._billed()
        outcome = self._outcome
        if outcome == "ok" and self._status is not None and self._status >= 400:
            outcome = "upstream_error_status"  # relayed as it came, but no success
        inspector = self._inspector
        return ExchangeRecord(
            method=self._method,
            target=self._target,
            dialect=self._dialect,
            session=self._session,
            seq=self._seq,
            status=self._status,
            outcome=outcome,
            t_received=self._t_received,
            t_sent=self._t_sent,
            t_headers=self._t_headers,
            t_client_first=self._t_client_first,
            t_ended=self._clock(),
            added_ttfb=self._added_ttfb,
            bytes_in=self._bytes_in,
            bytes_out=self._bytes_out,
            stream=self._stream,
            expand_rounds=rounds,
            continuation_failed=self._continuation_failed,
            usage=usage,
            compacted=_compacted(self._rewrite),
            inspected=(None if inspector is None
                       else Inspected(inspector.spliced, inspector.held_events, inspector.released)),
        )

    def _billed(self) -> tuple[Usage | None, int]:
        """(usage of every round, continuation rounds) for this request."""
        if self._rounds:
            return sum(self._loop.billed(self._rounds), Usage()), len(self._rounds) - 1
        if self._inspector is not None:
            billed = self._inspector.billed
            return (sum(billed, Usage()) if billed else None), self._inspector.rounds
        return (self._meter.usage() if self._meter is not None else None), 0


def _compacted(rewrite: Rewrite | None) -> Compacted | None:
    if rewrite is None or not rewrite.changes:
        return None
    before, after = result_sizes(rewrite.changes)
    return Compacted(before, after, len({c.marker_id for c in rewrite.changes if c.marker_id}))


_LIVE = tuple(state for state in State if state is not _ENDED)
_BODY = (_PASSING, _INSPECTING, _COLLECTING)
_EVENTS = (Prepared, Head, Chunk, BodyEnd, UpstreamFailed, ClientGone, Cut, Resolved, ResolveFailed, TimerFired)

# The module docstring's table, as the code runs it: (state, event type) -> its handler. A test
# reads the docstring's table and checks that it names exactly these pairs.
TRANSITIONS: dict[tuple[State, type], Callable[[Exchange, Any], None]] = {
    (_PREPARING, Prepared): Exchange._prepared,
    (_AWAITING, Head): Exchange._head,
    (_AWAITING, UpstreamFailed): Exchange._failed,
    **{(state, Chunk): Exchange._chunk for state in _BODY},
    **{(state, BodyEnd): Exchange._body_end for state in _BODY},
    (_RESOLVING, Resolved): Exchange._resolved,
    (_RESOLVING, ResolveFailed): Exchange._resolve_failed,
    **{(state, TimerFired): Exchange._timer_fired for state in _LIVE},
    **{(state, ClientGone): Exchange._client_gone for state in _LIVE},
    **{(state, Cut): Exchange._cut for state in _LIVE},
    **{(_ENDED, event): Exchange._ignore for event in _EVENTS},
}
