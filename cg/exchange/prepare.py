"""Preparation: from a request body read to the bytes forwarded, as a state machine fed the store's
answers.

Sans-io, like `cg.exchange.machine`: the driver (`cg.web.driver`) starts it with what it read of
the client's request and carries out the store commands it returns, in order, feeding back each
one's answer (`Answered`) or failure (`Failed`). It never touches the store, a Deferred or the
reactor; the store's synchronous index (`StoreIndex`: which originals it holds, whether it is
healthy) is read directly, as the store's contract makes those two answers immediate. It ends with
one `Ready`: the `Forward` the exchange sends, and a `Report` of what the request side did, which
the host counts and logs (/stats, the change log), with the facts the cache verdict judges the
turn by once it is billed (`Report.cache`, cg.exchange.verdict): gathered from what preparing
the body learned anyway, with no store command of their own.

The steps: parse the body (`cg.compaction.rewrite`); look up, at once, the frozen text of each
expand call the client answered with an error (`cg.compaction.repair`), the cache lifetime its
breakpoints ask for (--cache-ttl auto: frozen per conversation) and then the cache-aware policy's
part (`cg.compaction.cold`: record when the conversation's cache expires, read its epochs, freeze a
new one if the request is cold); rewrite; store the new originals before any marker names them.

============  ===========================================  ===========================================
state         event                                        commands → next state
============  ===========================================  ===========================================
(start)       bypassed, nothing to parse, or no JSON       Ready (the body as it came) → READY
(start)       A body cg parses                             ReadFrozen per repair and per thinking
                                                           block not seen ([Touch] those seen);
                                                           --cache-ttl auto, no
                                                           lifetime known and the cache not surely
                                                           warm (cold.Known): ReadFrozen and
                                                           [RecordCache] of the lifetime (known
                                                           frozen: [Touch] it); else
                                                           [RecordCache], [ReadFrozen epoch 0] →
                                                           LOOKING_UP (with nothing to look up: as
                                                           on its last answer)
LOOKING_UP    Answered / Failed ReadFrozen (the lifetime)  with the expiry before, both in: none
LOOKING_UP    Answered / Failed RecordCache (the           frozen and the cache expired: Freeze "1h";
              lifetime)                                    else the frozen one, or the client's; then
                                                           [RecordCache], [ReadFrozen epoch 0]
LOOKING_UP    Answered / Failed Freeze (the lifetime)      what is frozen / the client's; then as
                                                           above
LOOKING_UP    Answered ReadFrozen (a repair's text)        a text: kept. None: Freeze (this body holds
                                                           the original) or ReadOriginal
LOOKING_UP    Failed ReadFrozen (a repair's text)          the client's answer stays
LOOKING_UP    Answered ReadOriginal                        None from an unhealthy store: the client's
                                                           answer stays; else Freeze (count_tokens:
                                                           kept unfrozen)
LOOKING_UP    Answered / Failed Freeze (a repair's text)   what is frozen is kept / the answer stays
LOOKING_UP    Answered ReadFrozen (hidden turns)           a record: its turns put back before the
                                                           thinking block; None: as the client sent it
LOOKING_UP    Failed ReadFrozen (hidden turns)             the message as the client sent it
LOOKING_UP    Answered / Failed RecordCache                the expiry before (Known.stored) / None
LOOKING_UP    Answered ReadFrozen (epoch n)                a text: ReadFrozen epoch n+1 (to
                                                           MAX_EPOCHS); None: every epoch is read
LOOKING_UP    Failed ReadFrozen (epoch n)                  Known.doubt; the epochs read before
LOOKING_UP    (expiry and epochs in, the request cold)     Freeze the new epoch
LOOKING_UP    Answered / Failed Freeze (an epoch)          it, or another cg's, after the others /
                                                           Known.doubt, the epochs as they were
LOOKING_UP    (the last lookup answered)                   rewrite; [Touch]; no new original: Ready
                                                           → READY; else PutOriginals → STORING
STORING       Answered PutOriginals                        the store forgot some (once): [Touch],
                                                           PutOriginals → STORING; else Ready → READY
STORING       Failed PutOriginals                          rewrite, offloading only what the store
                                                           still holds; Ready → READY
LOOKING_UP    Failed ReadOriginal                          raises (the store broke its contract): the
                                                           driver forwards the body as it came
READY         Answered or Failed (anything)                raises `Unexpected`
============  ===========================================  ===========================================

Fail-open as before: a store that cannot say leaves each answer as the client sent it, a request
warm, the epochs this cg read before; a store that cannot keep an original sends it whole. A bug
(an exception out of `start` or `feed`) is the driver's to catch: it forwards the body as received.
`TRANSITIONS` lists the table's (state, event) pairs as data; a test checks table and code agree.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

import attrs

from cg.compaction import cold
from cg.compaction.pipeline import Older
from cg.compaction.repair import Repair, repair_answer
from cg.compaction.rewrite import Incoming, Rewrite, Rewriter
from cg.exchange import keepalive, verdict
from cg.exchange.machine import Unexpected
from cg.stream.hidden import MISSING, Record, Seen, anchors, restore
from cg.stream.usage import session_key
from cg.wire import dialect
from cg.wire.body import ParsedBody
from cg.wire.cache import CACHE_TTLS, TTL_1H, cache_lifetime
from cg.wire.jsonbytes import Span

__all__ = [
    "TRANSITIONS",
    "Answered",
    "Failed",
    "Forward",
    "Freeze",
    "PutOriginals",
    "ReadFrozen",
    "ReadOriginal",
    "Ready",
    "RecordCache",
    "Report",
    "Request",
    "State",
    "StoreContractBroken",
    "StoreIndex",
    "Touch",
    "Preparation",
]

@attrs.frozen
class Forward:
    """What the request side decided: the body to send upstream, and what the response side needs.

    `rewrite` is what cg did to the body (None: nothing it must answer for); `originals` are the
    originals behind the markers in `body`, which answer expand calls before the store is asked.
    """

    body: bytes
    seq: int  # the request's number in the change log
    session: str = "-"
    tenant: str = ""
    rewrite: Rewrite | None = None
    originals: Mapping[str, bytes] = attrs.Factory(dict)
    model: str | None = None  # the request's, for the change log's usage line
    # --keepalive: the conversation (tenant, session id, model) and its cache lifetime (None: it
    # cannot be kept warm); None when the request does not concern keep-alive.
    keepalive: tuple[tuple[str, bytes, str | None], float | None] | None = None
    cache: tuple[str, float] | None = None  # the cache-aware policy's (conversation key, cache lifetime)


@attrs.frozen
class Request:
    """What preparation reads of the client's request."""

    body: bytes
    target: bytes  # the request-target, as the client sent it
    seq: int
    tenant: str  # whose originals and frozen texts the request may read (cg.web.tenant)
    conversation: bytes  # Claude Code's or Codex CLI's session header (b"": none)
    header: Callable[[str], str | None]  # a request header's first value, by name
    bypass: bool = False  # x-cg-bypass: 1


class StoreIndex(Protocol):
    """The store's synchronous part (`cg.store.base.IStore`'s `known` and `stats.healthy`)."""

    def known(self, tenant: str, ids: Iterable[str]) -> set[str]: ...

    @property
    def healthy(self) -> bool: ...


class State(enum.Enum):
    LOOKING_UP = "looking up"  # repair texts, the cache's expiry, epochs
    STORING = "storing"  # new originals, before a marker names them
    READY = "ready"


# ---------------------------------------------------------------------------------------------
# Commands: the store's work, carried out by the driver. Compared by identity: each is one call.


@attrs.frozen(eq=False)
class ReadFrozen:
    """The text frozen under `key`, or None; fails when the store cannot tell."""

    tenant: str
    key: str


@attrs.frozen(eq=False)
class ReadOriginal:
    """An original (None: unknown, evicted, or the store is broken)."""

    tenant: str
    ref: str


@attrs.frozen(eq=False)
class Freeze:
    """Keep `text` under `key` unless something is there; answered with what is stored."""

    tenant: str
    key: str
    text: bytes


@attrs.frozen(eq=False)
class RecordCache:
    """The conversation's cache lives until at least `until`; answered with the expiry before."""

    tenant: str
    key: str
    until: float


@attrs.frozen(eq=False)
class PutOriginals:
    """Store these originals; answered once they are committed."""

    tenant: str
    originals: dict[str, bytes]


@attrs.frozen(eq=False)
class Touch:
    """These originals (and frozen texts) were used (for the store's LRU and purges); no answer."""

    tenant: str
    ids: frozenset[str]
    frozen: frozenset[str] = frozenset()  # keys of frozen texts


@attrs.define
class Report:
    """What the request side did, for /stats and the change log."""

    client_bytes: int
    bypassed: bool = False
    rewrite: Rewrite | None = None  # as decided (with its parse), counted whether or not forwarded
    cold: cold.ColdStats = attrs.Factory(cold.ColdStats)
    store_fail_open: bool = False
    cache: verdict.CacheFacts | None = None  # for the cache verdict (None: not a turn cg can judge)
    hidden_restored: int = 0  # messages given back the hidden turns a continuation's thinking follows


@attrs.frozen(eq=False)
class Ready:
    """Preparation is done: forward `forward`."""

    forward: Forward
    report: Report


StoreCommand = ReadFrozen | ReadOriginal | Freeze | RecordCache | PutOriginals
Command = StoreCommand | Touch | Ready


# ---------------------------------------------------------------------------------------------
# Events: the store's answers.


@attrs.frozen(slots=True)
class Answered:
    command: StoreCommand
    value: object  # what the store's call fired with


@attrs.frozen(slots=True)
class Failed:
    command: StoreCommand
    message: str


Event = Answered | Failed


class StoreContractBroken(Exception):
    """The store failed a call its contract says never fails (`get` answers None instead)."""


# The module docstring's table, as data: (state, event, command) for each row that takes an event.
TRANSITIONS: frozenset[tuple[State, type, type]] = frozenset(
    {(State.LOOKING_UP, event, command) for event in (Answered, Failed)
     for command in (ReadFrozen, Freeze, RecordCache)}
    | {(State.LOOKING_UP, Answered, ReadOriginal), (State.LOOKING_UP, Failed, ReadOriginal)}
    | {(State.STORING, Answered, PutOriginals), (State.STORING, Failed, PutOriginals)}
)


_Handler = Callable[[object], None]
_ANCHORS = "hidden-turn anchors"  # what ParsedBody.per_message carries each message's thinking blocks under


class Preparation:
    """One request's preparation. See the module docstring.

    `rewriter` is None when cg rewrites nothing (then only the session is read). `index` is None
    when cg has no store: then nothing is offloaded (reformat only), repaired or re-decided, and no
    store command goes out. `now` is the wall-clock time (the cache-aware policy's expiries are
    Unix times).
    """

    def __init__(
        self,
        request: Request,
        *,
        rewriter: Rewriter | None,
        known: cold.Known,
        index: StoreIndex | None,
        observe: bool = False,
        keepalive: bool = False,
        now: float,
        hidden: Seen | None = None,
        cache_ttl: str = "keep",
    ) -> None:
        self._request = request
        self._cache_ttl = cache_ttl  # --cache-ttl: the lifetime its breakpoints ask for (cg.wire.cache.CACHE_TTLS)
        self._lifetime: float | None = None  # as decided for this request (None: the client's)
        self._hidden = hidden if hidden is not None else Seen()
        self._restored: list[tuple[Span, str]] = []  # hidden turns put back (cg.stream.hidden)
        # Frozen texts used from memory, with no read (a hidden turn, the lifetime, the epochs):
        # touched in one Touch when ready, so a purge or an LRU spares them while they are used.
        self._used_frozen: set[str] = set()
        self._rewriter = rewriter
        self._known = known
        self._index = index
        self._observe = observe
        self._keepalive = keepalive
        self._now = now
        self.state = State.LOOKING_UP
        self._out: list[Command] = []
        self._report = Report(len(request.body))
        # Each command out with the store, and what its answer and failure do.
        self._pending: dict[StoreCommand, tuple[_Handler, Callable[[str], None] | None]] = {}
        self._incoming: Incoming | None = None
        self._unchanged = Forward(request.body, request.seq, tenant=request.tenant)  # the ledger's row is its tenant's
        self._texts: dict[str, str] = {}  # repaired answers, per tool_use_id
        self._older: Older | None = None
        # The cold part, open until an epoch (or none) applies: the expiry recorded before (None:
        # unknown), whether its answer is still out, and the epochs read (all of them: complete).
        self._cold_open = False
        self._expired: float | None = None
        self._expiry_out = False
        self._epochs: list[cold.Epoch | None] = []
        self._epochs_in = False
        self._complete = False
        self._key = ""
        self._ttl = 0.0
        self._stored_again = False  # PutOriginals was sent a second time
        self._rewrite: Rewrite | None = None
        # The cache verdict's facts: whether the store or Known had the conversation's expiry, and
        # whether this turn opened an epoch.
        self._seen: bool | None = None
        self._opened = False
        self._epoch: cold.Epoch | None = None  # the one applied

    def start(self) -> list[Command]:
        """The first commands: the body parsed, its lookups sent (or `Ready` at once)."""
        out = self._out = []
        request = self._request
        if request.bypass:
            self._report.bypassed = True
            self._ready(self._unchanged)
            return out
        rewriter = self._rewriter
        conversation = request.conversation.decode("latin-1")
        incoming = rewriter.parse(request.body, request.target, conversation) if rewriter else None
        session = session_key(request.header, incoming.body if incoming else None)
        tenant = request.tenant
        if rewriter is None or incoming is None:
            self._ready(Forward(request.body, request.seq, session, tenant))
            return out
        self._incoming = incoming
        model = incoming.body.value.get("model")
        model = model if isinstance(model, str) else None
        warm = None
        path = dialect.split_path(request.target).decode("latin-1")
        if self._keepalive and request.conversation and keepalive.concerns(path, request.body):
            # One keep-alive per model: a provider caches per model, and Claude Code's side requests go to another.
            warm = ((tenant, request.conversation, model), keepalive.lifetime(incoming.body))
        self._unchanged = Forward(request.body, request.seq, session, tenant, model=model, keepalive=warm)
        if incoming.repairs and self._index is not None:
            in_body = rewriter.originals(incoming)
            for repair in incoming.repairs:
                self._look_up_repair(repair, in_body)
        if self._index is not None and incoming.injection is not None:
            self._look_up_hidden(incoming.body, incoming.dialect)
        self._start_lifetime(conversation)
        self._maybe_rewrite()
        return out

    def feed(self, event: Event) -> list[Command]:
        """A store's answer in; the commands to carry out next, out."""
        if (event.command not in self._pending
                or (self.state, type(event), type(event.command)) not in TRANSITIONS):
            raise Unexpected(f"{type(event).__name__} of {type(event.command).__name__} in {self.state.name}")
        out = self._out = []
        answered, failed = self._pending.pop(event.command)
        if isinstance(event, Answered):
            answered(event.value)
        elif failed is None:
            raise StoreContractBroken(f"{type(event.command).__name__} failed: {event.message}")
        else:
            failed(event.message)
        if self.state is State.LOOKING_UP:
            self._maybe_rewrite()
        return out

    def _ask(self, command: StoreCommand, answered: _Handler, failed: Callable[[str], None] | None) -> None:
        self._pending[command] = (answered, failed)
        self._out.append(command)

    # -----------------------------------------------------------------------------------------
    # Repairs: the answer for each expand call the client answered with an error, frozen per call

    def _look_up_repair(self, repair: Repair, in_body: Mapping[str, bytes]) -> None:
        """The first repair of a call freezes its text; every later turn replays exactly those
        bytes, even after the original was evicted, so a repair never changes what the provider
        cached. The original comes from this very body when it still holds it, else from the
        store. A store that cannot say whether a text is frozen, or cannot read the original (it
        is unhealthy), leaves that answer as the client sent it: freezing "no longer stored" then
        would replay a loss that lasted seconds on every later turn."""
        tenant = self._request.tenant
        stash = self._incoming is not None and self._incoming.stash

        def keep(text: bytes) -> None:
            self._texts[repair.tool_use_id] = text.decode("utf-8")

        def answered(original: object) -> None:
            assert original is None or isinstance(original, bytes)
            if original is None and not (self._index is not None and self._index.healthy):
                return  # the store could not say: the client's answer stays, nothing frozen
            text = repair_answer(repair, original).text
            if not stash:  # count_tokens reads, never writes
                self._texts[repair.tool_use_id] = text
                return
            self._ask(Freeze(tenant, repair.tool_use_id, text.encode("utf-8")), _bytes(keep), _stays)

        def frozen(text: object) -> None:
            if text is not None:
                keep(_as_bytes(text))
            elif repair.ref is not None and repair.ref in in_body:
                answered(in_body[repair.ref])
            elif repair.ref:
                self._ask(ReadOriginal(tenant, repair.ref), answered, None)
            else:
                answered(None)

        self._ask(ReadFrozen(tenant, repair.tool_use_id), frozen, _stays)

    # -----------------------------------------------------------------------------------------
    # Hidden turns: a continuation's thinking gets back the expand turn it was written after

    def _look_up_hidden(self, body: ParsedBody, shape: dialect.Shape) -> None:
        """Each assistant thinking block a spliced response's continuation wrote has a record of
        the turns the client never saw (`cg.stream.hidden`): they are put back before it, the same
        bytes on every turn. The blocks are read from the new messages only (the others' answers are
        carried), and the store is asked only about those this process has not seen. A store that
        cannot say leaves the message as the client sent it, for that turn.

        On a store other processes write too (`Seen.shared`), "none" is kept only for a block older
        than the latest assistant message: that message's response may have ended in another process
        whose record is not committed yet, and a "none" kept for good would leave this process
        without the turns the writer puts back (the prefix differing by process); asked again next
        turn, it is there. Alone on its store, this process wrote every record it could be told of.
        A record put back from memory is touched (as --cache-ttl auto's choice), so a purge spares
        it while its conversation goes on."""
        reader = shape.select(anchors, None, None)
        if reader is None:
            return
        tenant, seen = self._request.tenant, self._hidden
        latest = _latest_reply(body.value.get(shape.items))
        replayed: set[str] = set()
        for message, found in enumerate(body.per_message(_ANCHORS, shape.items, reader)):
            for block, key in found:

                def read(text: object, message: int = message, block: int = block, key: str = key) -> None:
                    if text is None:
                        if message != latest or not seen.shared:
                            seen.put(tenant, key, None)
                        return
                    found = seen.put(tenant, key, _as_bytes(text))
                    if found is not None:
                        self._restore(body, message, block, found)

                known = seen.get(tenant, key)
                if known is MISSING:
                    self._ask(ReadFrozen(tenant, key), read, _stays)
                elif isinstance(known, Record):
                    self._restore(body, message, block, known)
                    replayed.add(key)
        if self._incoming is not None and self._incoming.stash:
            self._used_frozen |= replayed

    def _restore(self, body: ParsedBody, message: int, block: int, found: Record) -> None:
        edits = restore(body, message, block, found)
        self._restored += edits
        self._report.hidden_restored += bool(edits)

    # -----------------------------------------------------------------------------------------
    # The cache lifetime its breakpoints ask for (--cache-ttl)

    def _start_lifetime(self, conversation: str) -> None:
        """`5m` and `1h` give every breakpoint of a Messages request that lifetime. `auto` gives the
        client's until the conversation's cache first expires, then an hour: that request writes
        the whole prompt anyway, so the longer lifetime costs no extra write. The choice is frozen
        (first writer wins: every later turn, a restart and another cg send the same bytes); the
        expiry is recorded under a key of its own, as the client's lifetime has it. A store that
        cannot say leaves the client's lifetime, for that request. The cold policy then runs with
        the lifetime decided (it records the cache's true expiry)."""
        incoming, rewriter = self._incoming, self._rewriter
        assert incoming is not None and rewriter is not None
        body = incoming.body
        asked = cache_lifetime(body) if incoming.dialect.select(True, False, False) else None
        fixed = CACHE_TTLS.get(self._cache_ttl)
        if asked is None or self._observe:
            self._start_cold(conversation)
            return
        if fixed is not None or self._cache_ttl != "auto" or not conversation or self._index is None:
            self._lifetime = fixed
            self._start_cold(conversation)
            return
        tenant = self._request.tenant
        key = cold.lifetime_key(cold.conversation_key(conversation, self._unchanged.model))
        self._lifetime = self._known.lifetime(tenant, key)
        policy = rewriter.config.cold or cold.ColdPolicy()  # its margin says when a cache surely expired
        now = self._now
        until = now + asked if incoming.stash else None  # count_tokens reads, never writes
        if self._lifetime is not None or self._known.warm(tenant, key, now, until, policy.margin):
            # Known in this process: the choice frozen, or nothing frozen and the cache not cold yet
            # (cold.Known.warm: its record in the store kept within half a margin). The store is
            # asked nothing; a frozen choice is touched (the store writes that at most once a
            # minute, TOUCH_EVERY), so `cg-store purge --older-than` spares it while it is used.
            if self._lifetime is not None and until is not None:
                self._used_frozen.add(key)
            self._start_cold(conversation)
            return
        answers: dict[str, object] = {}

        def chose(text: object) -> None:
            lifetime = _LIFETIMES.get(_as_bytes(text)) if text is not None else None
            if lifetime is not None:
                self._known.set_lifetime(tenant, key, lifetime)
                self._lifetime = lifetime
            self._start_cold(conversation)

        def answer(name: str) -> _Handler:
            def got(value: object) -> None:
                answers[name] = value
                if len(answers) < 2:
                    return
                frozen, before = answers["frozen"], answers["before"]
                if frozen is _UNKNOWN:
                    self._known.doubt(tenant, key)
                elif frozen is None:
                    self._known.found_none(tenant, key)
                if frozen is not None or not isinstance(before, float | int) or not policy.is_cold(before, now):
                    chose(frozen if frozen is not _UNKNOWN else None)
                    return
                self._ask(Freeze(tenant, key, b"1h"), chose, lambda message: chose(None))
            return got

        def recorded(before: object) -> None:
            assert until is not None
            self._known.stored(tenant, key, until)
            answer("before")(before)

        if self._known.warm(tenant, key, now, None, policy.margin):
            # Surely warm, only its record lagging (a turn minutes after the last): nothing can have
            # been frozen since the last reads, so only the record moves on.
            answers["frozen"] = None
        else:
            self._ask(ReadFrozen(tenant, key), answer("frozen"), lambda message: answer("frozen")(_UNKNOWN))
        if until is not None:
            self._ask(RecordCache(tenant, key, until), recorded, lambda message: answer("before")(None))
        else:
            answers["before"] = None

    # -----------------------------------------------------------------------------------------
    # The cache-aware policy (--cold-policy, cg.compaction.cold)

    def _start_cold(self, conversation: str) -> None:
        """Each request records how long its conversation's prompt cache lives (but for one this
        cg surely knows to be warm, which asks the store nothing: cold.Known); one that comes
        after it expired is cold, and re-decides the older history as an epoch, frozen in the
        store (first writer wins) before anything is forwarded. Every request applies the latest
        epoch its history matches. A store that cannot say when the cache expires leaves the
        request warm; one that cannot read the epochs leaves those this cg read before, and makes
        none (after a restart: first-sight decisions, so a marker an epoch sent before goes whole,
        one cache write and nothing lost). count_tokens applies epochs, and records and makes
        none."""
        incoming, rewriter = self._incoming, self._rewriter
        assert incoming is not None and rewriter is not None
        policy = rewriter.config.cold
        if policy is None or not conversation or incoming.injection is None or self._index is None:
            return
        tally = self._report.cold
        tally.checked += 1
        tenant, body = self._request.tenant, incoming.body
        key = self._key = cold.conversation_key(conversation, self._unchanged.model)
        now, ttl = self._now, self._lifetime or cold.cache_ttl(body, incoming.dialect)
        self._ttl = ttl
        until = now + ttl if incoming.stash else None
        if self._known.warm(tenant, key, now, until, policy.margin):
            tally.known_warm += 1
            self._seen, self._expired = True, self._known.until(tenant, key)
            epochs = self._known.epochs(tenant, key)
            self._used_epochs(len(epochs), until)
            self._apply(cold.latest(epochs, body, incoming.dialect))
            return
        if until is not None:
            self._expiry_out = True

            def recorded(before: object) -> None:
                assert before is None or isinstance(before, float | int)
                self._known.stored(tenant, key, until)
                self._expired = None if before is None else float(before)
                self._seen = before is not None
                self._expiry_out = False
                self._maybe_decide()

            def unrecorded(message: str) -> None:
                self._expiry_out = False
                self._maybe_decide()

            self._ask(RecordCache(tenant, key, until), recorded, unrecorded)
        self._cold_open = True
        self._epochs = self._known.epochs(tenant, key)
        self._used_epochs(len(self._epochs), until)  # the store reads only those after them
        self._read_epoch()

    def _used_epochs(self, count: int, until: float | None) -> None:
        """Epochs applied from memory are used as much as those read: touched (as --cache-ttl auto's
        choice), so `cg-store purge --older-than` or an LRU spares them while the conversation goes
        on, and a restart or another worker applies the same ones. count_tokens (no `until`: it
        records nothing) touches nothing."""
        if until is not None:
            self._used_frozen.update(cold.epoch_key(self._key, index) for index in range(count))

    def _read_epoch(self) -> None:
        """The conversation's epochs: those read before, then any another cg (or this one, before
        a restart) froze since."""
        tenant, key, found = self._request.tenant, self._key, self._epochs
        if len(found) >= cold.MAX_EPOCHS:
            self._epochs_read(True)
            return

        def got(text: object) -> None:
            if text is None:
                self._epochs_read(True)
            else:
                found.append(cold.Epoch.loads(_as_bytes(text)))
                self._read_epoch()

        def unread(message: str) -> None:
            self._known.doubt(tenant, key)
            self._epochs = self._known.epochs(tenant, key)
            self._epochs_read(False)

        self._ask(ReadFrozen(tenant, cold.epoch_key(key, len(found))), got, unread)

    def _epochs_read(self, complete: bool) -> None:
        if complete:
            self._known.set_epochs(self._request.tenant, self._key, self._epochs)
        else:
            self._report.cold.unknown += 1
        self._complete = complete
        self._epochs_in = True
        self._maybe_decide()

    def _maybe_decide(self) -> None:
        """Once the expiry and the epochs are in: cold or not, and a new epoch for a cold one."""
        if self._expiry_out or not self._epochs_in:
            return
        self._epochs_in = False
        incoming, rewriter = self._incoming, self._rewriter
        assert incoming is not None and rewriter is not None and rewriter.config.cold is not None
        policy = rewriter.config.cold
        body, shape, known = incoming.body, incoming.dialect, self._epochs
        current = cold.latest(known, body, shape)
        if (not (self._complete and incoming.stash and policy.is_cold(self._expired, self._now))
                or len(known) >= cold.MAX_EPOCHS):
            self._apply(current)
            return
        self._report.cold.cold += 1
        made = policy.epoch(body, shape, current)
        if made is None:
            self._apply(current)
            return
        self._freeze_epoch(made)

    def _freeze_epoch(self, made: cold.Epoch) -> None:
        """`made` frozen after the known epochs, or what another cg froze there first; as they
        were if the store cannot freeze (the request is cold: its bytes cost nothing extra)."""
        incoming = self._incoming
        assert incoming is not None
        tenant, key, known = self._request.tenant, self._key, self._epochs

        def frozen(text: object) -> None:
            stored = cold.Epoch.loads(_as_bytes(text))
            self._report.cold.epochs += stored == made
            self._opened = stored is not None
            epochs = self._known.set_epochs(tenant, key, [*known, stored])
            self._apply(cold.latest(epochs, incoming.body, incoming.dialect))

        def unfrozen(message: str) -> None:
            self._known.doubt(tenant, key)  # another cg's may be there: read them again next time
            self._apply(cold.latest(known, incoming.body, incoming.dialect))

        self._ask(Freeze(tenant, cold.epoch_key(key, len(known)), made.dumps()), frozen, unfrozen)

    def _apply(self, epoch: cold.Epoch | None) -> None:
        """The epoch this request is decided under (None: first sight only)."""
        incoming, rewriter = self._incoming, self._rewriter
        assert incoming is not None and rewriter is not None
        self._cold_open = False
        self._epoch = epoch
        self._report.cold.applied += epoch is not None
        self._older = cold.older(epoch, incoming.body, incoming.dialect, rewriter.config.compact)
        if incoming.stash:
            self._unchanged = attrs.evolve(self._unchanged, cache=(self._key, self._ttl))

    # -----------------------------------------------------------------------------------------
    # The rewrite, and storing its originals

    def _maybe_rewrite(self) -> None:
        if self._pending or self._cold_open or self.state is not State.LOOKING_UP:
            return
        incoming, rewriter = self._incoming, self._rewriter
        assert incoming is not None and rewriter is not None
        lossy = self._index is not None  # no store: no original could be kept, so no marker goes
        rewrite = self._rewrite = rewriter.finish(incoming, self._texts, lossy=lossy, older=self._older,
                                                  restored=self._restored, lifetime=self._lifetime)
        if self._observe or not rewrite.originals:
            self._chosen(rewrite, {})
            return
        self._vouch()

    def _vouch(self) -> None:
        """Markers only for originals the store vouches for: it first stores those it does not
        know. A store that forgot some while storing the others (it broke and came back, or
        another process wrote) is given them once more."""
        rewrite, index, tenant = self._rewrite, self._index, self._request.tenant
        assert rewrite is not None and index is not None
        known = index.known(tenant, rewrite.originals)
        if known:
            self._out.append(Touch(tenant, frozenset(known)))
        new = {i: rewrite.originals[i] for i in rewrite.originals if i not in known}  # only these encoded
        if not new:
            self._chosen(rewrite, rewrite.originals)
            return
        self.state = State.STORING
        self._ask(PutOriginals(tenant, new), self._stored, lambda message: self._unstored(known))

    def _stored(self, value: object) -> None:
        rewrite, index = self._rewrite, self._index
        assert rewrite is not None and index is not None
        if not self._stored_again and len(index.known(self._request.tenant, rewrite.originals)) < len(rewrite.originals):
            self._stored_again = True
            self._vouch()
            return
        self._chosen(rewrite, rewrite.originals)

    def _unstored(self, known: set[str]) -> None:
        """A store that cannot keep them vouches for what it still knows (nothing, once it is
        unhealthy): the rest go whole, and reformat still runs. Offloads sent on earlier turns
        stay while the store still vouches for them, so the bytes the provider has cached do not
        change. The store logs the failure, once."""
        incoming, rewriter, index = self._incoming, self._rewriter, self._index
        assert incoming is not None and rewriter is not None and index is not None
        self._report.store_fail_open = True
        vouched = rewriter.finish(incoming, self._texts, lossy=frozenset(index.known(self._request.tenant, known)),
                                  older=self._older, restored=self._restored, lifetime=self._lifetime)
        self._chosen(vouched, vouched.originals)

    def _chosen(self, rewrite: Rewrite, originals: Mapping[str, bytes]) -> None:
        """Forward the rewrite (in observe mode, the body as it came)."""
        self._report.rewrite = rewrite
        self._cache_facts(rewrite)
        unchanged = self._unchanged
        if self._observe:
            self._ready(unchanged)
            return
        # Pings keep the lifetime the breakpoints ask for: the chosen one unless the rewrite had to
        # leave them as the client sent them (Rewriter.finish: all or none).
        if rewrite.lifetime is not None and unchanged.keepalive is not None and unchanged.keepalive[1] is not None:
            unchanged = attrs.evolve(unchanged, keepalive=(unchanged.keepalive[0], rewrite.lifetime))
        # Kept for the response's life: what it decides by (not the parse), and the originals
        # behind its markers, which answer expand calls even if the store breaks meanwhile.
        self._ready(attrs.evolve(unchanged, body=rewrite.body, rewrite=attrs.evolve(rewrite, originals={}, parsed={}),
                                 originals=originals))

    def _cache_facts(self, rewrite: Rewrite) -> None:
        """The cache verdict's facts (cg.exchange.verdict), from what preparing the body learned:
        no store command of their own, and O(what changed) of the body."""
        incoming = self._incoming
        assert incoming is not None
        body, shape, previous = incoming.body, incoming.dialect, incoming.previous
        last = verdict.last_turn(body)  # carried by `previous`
        stop = verdict.stops_at(body, previous, shape) if last is not None and previous is not None else 0
        if not incoming.stash:  # count_tokens: not a turn, and what the next turn is judged against stays
            verdict.pass_on(body, stop)
            return
        arrived, cached, epoch, repeats = last if last is not None else (None, 0, None, None)
        client_stop = None if last is None else stop if repeats is None else min(stop, repeats)
        moved = None
        if last is not None and rewrite.moved is not None and not self._observe:
            moved = verdict.FIRST_MESSAGE + rewrite.moved
        self._report.cache = verdict.CacheFacts(
            now=self._now, ttl=self._ttl or cold.cache_ttl(body, shape), explicit=shape.select(True, False, False),
            seen=True if last is not None else self._seen, last_request=arrived, expires=self._expired,
            cached=cached, client_stop=client_stop,
            client_stop_at="" if client_stop is None else verdict.element_name(client_stop, shape),
            cg_stop=moved, cg_stop_at="" if moved is None else verdict.element_name(moved, shape),
            epoch=self._opened if last is None else self._epoch != epoch)
        verdict.remember(body, self._now, shape, self._epoch)

    def _ready(self, forward: Forward) -> None:
        self.state = State.READY
        self._incoming = self._rewrite = None
        if self._used_frozen:
            self._out.append(Touch(self._request.tenant, frozenset(), frozenset(self._used_frozen)))
        self._out.append(Ready(forward, self._report))


_LIFETIMES = {b"1h": TTL_1H}  # a frozen lifetime's text, read back
_UNKNOWN = object()  # a lookup the store could not answer


def _as_bytes(value: object) -> bytes:
    assert isinstance(value, bytes)
    return value


def _bytes(handler: Callable[[bytes], None]) -> _Handler:
    return lambda value: handler(_as_bytes(value))


def _stays(message: str) -> None:
    """A repair the store cannot look up or freeze: the client's answer stays."""


def _latest_reply(messages: object) -> int | None:
    """The index of the last assistant message (the response this request follows), if any."""
    if isinstance(messages, list):
        for index in range(len(messages) - 1, -1, -1):
            message = messages[index]
            if isinstance(message, dict) and message.get("role") == "assistant":
                return index
    return None
