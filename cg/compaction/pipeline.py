"""The compaction pipeline: rewrite the tool results in a request body so it carries less.

Pure: bytes in, bytes out. Only tool results are touched (Anthropic `tool_result` blocks in user
messages, OpenAI `role: "tool"` messages, Responses `function_call_output` and
`custom_tool_call_output` input items); every other byte reaches the provider as the client sent
it, and a result gets the same bytes on every turn (see components.py), so the provider's prompt
cache stays valid. Anything unexpected means "no change": compaction never fails a request.
"""

import hashlib
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Generic, TypeVar, cast

import attrs

from cg.compaction.components import DEFAULT_COMPONENTS, Component, Context, Dedup, Offload, Outcome
from cg.compaction.tokens import estimate_tokens
from cg.wire import jsonbytes
from cg.wire.body import Earlier, ParsedBody
from cg.wire.dialect import Shape
from cg.wire.jsonbytes import EACH, StringStyle
from cg.wire.markers import EXPAND_TOOL, id_of, marker

# A message whose result changes is walked again (the body is parsed only as deep as each message:
# cg.wire.body) down to where result text sits: Anthropic content[].content (a string or text
# blocks), OpenAI content (a string or text parts), a Responses item's output (a string or
# input_text parts).
_MESSAGE_SPINE: jsonbytes.Spine = {
    "content": {EACH: {"content": {EACH: {"text": {}}}, "text": {}}},
    "output": {EACH: {"text": {}}},
}


# The config's defaults are the components' own.
_OFFLOAD, _DEDUP = Offload(), Dedup()


def _names(names: Iterable[str]) -> frozenset[str]:
    """A converter mypy's attrs plugin can type (it cannot type the generic ``frozenset``)."""
    return frozenset(names)


@attrs.frozen(cache_hash=True)
class CompactConfig:
    """What the pipeline runs, and its thresholds. Frozen and hashable: it is part of every memo key.

    `configured` is what runs: `components`, each built once with its parameters from the fields
    below (whatever an instance in `components` was built with), so that a decision depends on
    nothing the memo key leaves out.
    """

    components: tuple[Component, ...] = DEFAULT_COMPONENTS
    keep_tools: frozenset[str] = attrs.field(default=_OFFLOAD.keep_tools, converter=_names)
    offload_min_tokens: int = _OFFLOAD.min_tokens
    offload_head_lines: int = _OFFLOAD.head_lines
    offload_tail_lines: int = _OFFLOAD.tail_lines
    offload_max_line_chars: int = _OFFLOAD.max_line_chars
    offload_max_error_lines: int = _OFFLOAD.max_error_lines
    dedup_min_tokens: int = _DEDUP.min_tokens
    configured: tuple[Component, ...] = attrs.field(init=False, eq=False, repr=False)

    @configured.default
    def _configure(self) -> tuple[Component, ...]:
        return tuple(self._with_parameters(component) for component in self.components)

    def _with_parameters(self, component: Component) -> Component:
        if isinstance(component, Offload):
            return Offload(keep_tools=self.keep_tools, min_tokens=self.offload_min_tokens,
                           head_lines=self.offload_head_lines, tail_lines=self.offload_tail_lines,
                           max_line_chars=self.offload_max_line_chars,
                           max_error_lines=self.offload_max_error_lines)
        if isinstance(component, Dedup):
            return Dedup(min_tokens=self.dedup_min_tokens)
        return component


@attrs.frozen
class Older:
    """A stronger config for the tool results of the messages before `cutoff`: the cache-aware
    policy's re-decision of an older history (cg.compaction.cold), a pure input like `config`.

    `views` is the config for the results at `superseded` (message, block) positions: the file views
    the re-decision offloads (those a later call on the same file superseded, or all of them).
    """

    cutoff: int
    config: CompactConfig
    views: CompactConfig
    superseded: frozenset[tuple[int, int]] = frozenset()

    def config_for(self, message_index: int, block_index: int | None, config: CompactConfig) -> CompactConfig:
        """The config a result at this place is decided by (`config`: the first-sight one)."""
        if message_index >= self.cutoff:
            return config
        return self.views if (message_index, block_index) in self.superseded else self.config


@attrs.frozen
class Change:
    """One component's rewrite of one tool result (one line of the change log).

    `step` is its place among the components that rewrote the result: step 0 got the result as
    the client sent it, each later one the previous one's output. Summing `tokens_before` over
    every step would count that intermediate text twice; a result's size as sent is its step 0's
    `tokens_before`, and its saving is the sum of its steps' savings.
    """

    message_index: int
    block_index: int | None
    part_index: int | None
    tool_name: str | None
    component: str
    step: int
    lossy: bool
    marker_id: str | None
    tokens_before: int
    tokens_after: int
    content_id: str  # the original's marker ID even when no marker is shown: counts unique savings


def result_sizes(changes: list[Change]) -> tuple[int, int]:
    """Tokens of the tool results `changes` rewrote, as the client sent them and as forwarded.

    Each result counts once however many components rewrote it: its step 0's size before,
    less every step's saving.
    """
    before = sum(change.tokens_before for change in changes if change.step == 0)
    return before, before - sum(change.tokens_before - change.tokens_after for change in changes)


@attrs.frozen
class Compaction:
    """The body to forward; `originals` (marker ID -> original) must be stored before it is sent."""

    body: bytes
    changed: bool
    originals: Mapping[str, bytes]
    changes: list[Change]


class Originals(Mapping[str, bytes]):
    """Marker ID -> original, each read from the body's bytes when it is read.

    A turn's plan carries every original its history holds (each offloaded result, every turn);
    the proxy reads the bytes only of those the store does not know yet, or that an expand call
    asks for. Each is the span of its JSON string in `raw`, so that a conversation's memo keeps no
    result text (cg.wire.body.Messages).
    """

    def __init__(self, raw: bytes = b"") -> None:
        self._raw = raw
        self._spans: dict[str, jsonbytes.Span] = {}

    def add(self, pairs: Iterable[tuple[str, jsonbytes.Span]]) -> None:
        """(marker ID, span of the original's JSON string in `raw`) pairs: texts that encode (the
        decisions encoded them)."""
        self._spans.update(pairs)

    def __getitem__(self, result_id: str) -> bytes:
        return cast(str, jsonbytes.scan(self._raw, self._spans[result_id])).encode("utf-8")

    def __contains__(self, result_id: object) -> bool:
        return result_id in self._spans  # Mapping's would read the text to answer

    def __iter__(self) -> Iterator[str]:
        return iter(self._spans)

    def __len__(self) -> int:
        return len(self._spans)


@attrs.frozen
class _Step:
    component: str
    lossy: bool
    tokens_before: int
    tokens_after: int


@attrs.frozen
class _Decision:
    result_id: str  # the original's marker ID
    text: str | None
    steps: tuple[_Step, ...]
    ran: tuple[str, ...] = ()  # components that ran on the result
    reverted: tuple[str, ...] = ()  # ...of which raised, broke the contract or did not shorten it


# (SHA-256 of the result's UTF-8, tool name, config, lossy, seen earlier in the request): all a
# decision depends on.
_DecisionKey = tuple[bytes, "str | None", CompactConfig, bool, bool]

# What a decision costs the memo besides its rewritten text, in the characters its budget counts:
# the key, the decision and the table's entry (~500 bytes; measured with tracemalloc).
_DECISION_CHARS = 512


_Key = TypeVar("_Key")
_Value = TypeVar("_Value")


class _Bounded(Generic[_Key, _Value]):
    """A mapping bounded in entries and in characters held, least recently used out first.

    `hits` and `misses` count its lookups (plain ints: /stats and /metrics read them).
    """

    def __init__(self, max_chars: int, max_entries: int | None = None):
        self._items: OrderedDict[_Key, tuple[_Value, int]] = OrderedDict()
        self._chars = 0
        self._max_entries = max_entries
        self._max_chars = max_chars
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._items)

    @property
    def chars(self) -> int:
        """What the entries count against `max_chars`, as put (bytes for bodies; 512 and the
        rewritten text for each decision)."""
        return self._chars

    def items(self) -> list[tuple[_Key, _Value]]:
        """Every entry, least recently used first (a copy: cg.compaction.snapshot writes it)."""
        return [(key, value) for key, (value, _) in self._items.items()]

    def get(self, key: _Key) -> _Value | None:
        item = self._items.get(key)
        if item is None:
            self.misses += 1
            return None
        self.hits += 1
        self._items.move_to_end(key)
        return item[0]

    def take(self, key: _Key) -> _Value | None:
        """Remove and return the entry (a lookup: counted as `get` counts it)."""
        item = self._items.pop(key, None)
        if item is None:
            self.misses += 1
            return None
        self.hits += 1
        self._chars -= item[1]
        return item[0]

    def put(self, key: _Key, value: _Value, chars: int) -> None:
        if key in self._items:
            return
        self._items[key] = (value, chars)
        self._chars += chars
        while self._chars > self._max_chars or (self._max_entries is not None and len(self._items) > self._max_entries):
            _, (_, evicted) = self._items.popitem(last=False)
            self._chars -= evicted


MEMO_BYTES = 64 << 20
"""The text the conversation memo keeps by default (--memo-mb)."""
_MAX_BODIES = 10_000  # a body's parse holds more than its bytes: many tiny ones are bounded by count


class Memo:
    """Decisions already made and each conversation's last body, so a re-sent history costs a
    dict lookup per result, and no parse of what it shares with the previous turn.

    Decisions are keyed by (SHA-256 of the result, tool name, config, lossy, seen earlier in the
    request): everything a decision depends on. A miss computes the digest anyway (the marker ID
    is its start); a hit pays it only for a message planned again (the tail of a turn, or a body
    `bodies` no longer holds), and an entry holds no result text: ~1.3 KB with its rewritten text
    (`_DECISION_CHARS` counted for each, so that the budget bounds memory). `bodies` (conversation and
    model -> its last body as `cg.wire.body.Earlier`, kept by `cg.compaction.rewrite.Rewriter`) is
    bounded by the bytes of the bodies it holds, not by a count: an entry holds about 1.6 times its
    bytes (the bytes, their spans, the plans carried: no message values, which are read again from
    the bytes when looked at, cg.wire.body.Messages), and the default, 48 MiB of bodies (~75 MiB
    held), keeps about 150 conversations of 330 KB (docs/performance.md, Gateway). A turn parsed
    against its conversation's last body looks up decisions only for its new messages, so
    `decisions` matter after a body was evicted, or a restart: the default 16 Mi characters
    (~21 MiB held) keep ~18,000 decisions, the results of several hundred conversations of 330 KB
    (bench/pipeline.py's "no body memo" row).
    Every table is bounded in entries and in the text it holds, least recently used out first,
    and counts its hits and misses.
    """

    def __init__(self, max_chars: int = MEMO_BYTES // 4, max_body_bytes: int = MEMO_BYTES * 3 // 4):
        self.decisions: _Bounded[_DecisionKey, _Decision] = _Bounded(max_chars)  # each counts 512 at least
        self.bodies: _Bounded[str, Earlier] = _Bounded(max_body_bytes, _MAX_BODIES)

    @classmethod
    def sized(cls, text_bytes: int) -> "Memo":
        """A memo keeping `text_bytes` of text (--memo-mb): three quarters bodies, a quarter
        decisions, as the defaults split their 64 MiB. The process holds ~1.5 times as much."""
        return cls(max_chars=text_bytes // 4, max_body_bytes=text_bytes * 3 // 4)  # as the defaults

    def __len__(self) -> int:
        return len(self.decisions)

    def remember(self, key: _DecisionKey, decision: _Decision) -> None:
        """Keep a decision, counted against the budget as `_DECISION_CHARS` and its text."""
        self.decisions.put(key, decision, _DECISION_CHARS + len(decision.text or ""))


@attrs.frozen
class _ToolResult:
    path: jsonbytes.Path  # from its message to the result's string
    text: str
    tool_name: str | None
    message_index: int
    block_index: int | None
    part_index: int | None


@attrs.frozen
class Plan:
    """Compaction as span edits of a ParsedBody, with the originals to stash first."""

    edits: list[tuple[jsonbytes.Span, str]]
    originals: Originals
    changes: list[Change]
    runs: Counter[str] = attrs.Factory(Counter)  # component -> tool results it ran on
    reverted: Counter[str] = attrs.Factory(Counter)  # component -> rewrites undone by the contract
    # The first message the body shares with the conversation's last one (from its start) whose
    # edits differ from those forwarded then (`forwarded`); None: none does.
    moved: int | None = None
    forwarded: tuple[object, list["_Planned"]] = (None, [])  # (the plan's inputs, each message planned)


# ParsedBody.carried: the plan forwarded (`forwarded`), whatever its inputs, for the next turn to
# tell whether its own edits of the same messages differ.
_FORWARDED = "plan: the last forwarded"


def forwarded(body: ParsedBody, made: Plan) -> None:
    """`made` is the plan whose edits `body` was forwarded with."""
    body.carried[_FORWARDED] = made.forwarded


def plan(body: ParsedBody, shape: Shape, config: CompactConfig, lossy: bool | frozenset[str],
         memo: Memo | None = None, older: Older | None = None) -> Plan:
    """The edits that compact the tool results of `body`; no edits when nothing changes.

    `lossy`: True, False, or the marker IDs whose originals may be replaced by a marker. `older`:
    a stronger config for the results of older messages (None: `config` for every result).

    Planned message by message. A message that lies in what `body` shares with the conversation's
    last body from its start (`ParsedBody.shared`) is planned as it was last time (`_Planned`,
    carried in `ParsedBody.carried` under this plan's inputs): everything before it is the same
    bytes, so its tool names, its results' "seen earlier" and their decisions are too. Such a
    message planned again (under other inputs, or not carried) is compared with the plan
    forwarded last time (`Plan.moved`): a turn that replans nothing compares nothing.
    """
    key = shape.items
    messages = body.value.get(key)
    if not isinstance(messages, list):
        return Plan([], Originals(), [])
    out = Plan([], Originals(body.raw), [])
    walk = _Walk(shape, config, lossy, memo, older)
    cache_key = ("plan", shape, config, lossy, older) if isinstance(lossy, bool) else None
    last = body.earlier_carried.get(cache_key, []) if cache_key else []
    sent_key, sent = cast("tuple[object, list[_Planned]]", body.earlier_carried.get(_FORWARDED, (None, [])))
    same_inputs = cache_key is not None and sent_key == cache_key
    planned: list[_Planned] = []
    moved: int | None = None
    for index in range(len(messages)):  # a message planned last time is not looked at (cg.wire.body.Messages)
        span = body.spans[(key, index)]
        # The same place, too: a duplicate key past the shared prefix could have made another
        # array the earlier body's messages (the last one wins).
        shared = span[1] <= body.shared
        if index < len(last) and shared and cast(_Planned, last[index]).span == span:
            done = cast(_Planned, last[index])
            replanned = False
        else:
            done = _plan_message(body, key, index, messages[index], walk)
            replanned = True
        if ((replanned or not same_inputs) and moved is None and shared and index < len(sent)
                and sent[index].span == span and sent[index].edits != done.edits):
            moved = index
        done.add_to(out, walk)
        planned.append(done)
    if cache_key is not None:
        body.carried[cache_key] = planned
    return attrs.evolve(out, moved=moved, forwarded=(cache_key, planned))


@attrs.frozen
class _Planned:
    """One message planned: what it adds to the plan, and to the walk's state for later messages."""

    edits: tuple[tuple[jsonbytes.Span, str], ...] = ()
    changes: tuple[Change, ...] = ()
    originals: tuple[tuple[str, jsonbytes.Span], ...] = ()  # (marker ID, its JSON string's span): read when read
    ran: tuple[str, ...] = ()
    reverted: tuple[str, ...] = ()
    digests: tuple[bytes, ...] = ()  # its results' SHA-256 and IDs, for "seen earlier" after it
    ids: tuple[str, ...] = ()
    tool_names: tuple[tuple[str, str], ...] = ()  # the calls it makes: (call ID, tool name)
    span: jsonbytes.Span = (0, 0)  # where the message was

    def add_to(self, out: Plan, walk: "_Walk") -> None:
        # Most messages have no results or calls: Counter.update is a Python-level call each.
        if self.edits:
            out.edits.extend(self.edits)
            out.changes.extend(self.changes)
        if self.originals:
            out.originals.add(self.originals)
        if self.ran:
            out.runs.update(self.ran)
        if self.reverted:
            out.reverted.update(self.reverted)
        if self.digests:
            walk.seen_digests.update(self.digests)
            walk.seen_ids.update(self.ids)
        if self.tool_names:
            walk.tool_names.update(self.tool_names)


def _plan_message(body: ParsedBody, key: str, index: int, message: object, walk: "_Walk") -> _Planned:
    """Decide the tool results of message `index` (or input item) and make their edits."""
    edits: list[tuple[jsonbytes.Span, str]] = []
    changes: list[Change] = []
    originals: list[tuple[str, jsonbytes.Span]] = []
    ran: list[str] = []
    reverted: list[str] = []
    digests: list[bytes] = []
    ids: list[str] = []
    calls: list[tuple[str, str]] = []
    spans: dict[jsonbytes.Path, jsonbytes.Span] | None = None
    for result, digest, decision in walk.decisions(index, message, calls):
        digests.append(digest)
        ids.append(decision.result_id)
        ran += decision.ran
        reverted += decision.reverted
        if decision.text is None:
            continue
        result_id = decision.result_id
        if spans is None:
            spans = _message_spans(body, key, index)
        start, end = spans[result.path]
        edits.append(((start, end), StringStyle.of(body.doc[start:end], result.text).encode(decision.text)))
        changes += [
            Change(message_index=result.message_index, block_index=result.block_index,
                   part_index=result.part_index, tool_name=result.tool_name, component=step.component,
                   step=number, lossy=step.lossy, marker_id=result_id if step.lossy else None,
                   tokens_before=step.tokens_before, tokens_after=step.tokens_after, content_id=result_id)
            for number, step in enumerate(decision.steps)
        ]
        if any(step.lossy for step in decision.steps):
            originals.append((result_id, (start, end)))
    return _Planned(tuple(edits), tuple(changes), tuple(originals), tuple(ran), tuple(reverted),
                    tuple(digests), tuple(ids), tuple(calls), body.spans[(key, index)])


def _message_spans(body: ParsedBody, key: str, index: int) -> dict[jsonbytes.Path, jsonbytes.Span]:
    """Where the strings of message (or input item) `index` sit: walked once per message of a
    conversation (a message taken from its last parse brings its spans: `ParsedBody.inner`)."""
    start, _ = body.spans[(key, index)]
    relative = body.inner.get((key, index))
    if relative is None:
        found = jsonbytes.spans_below(body.doc, start, _MESSAGE_SPINE)
        relative = body.inner[(key, index)] = {path: (a - start, b - start) for path, (a, b) in found.items()}
    return {path: (start + a, start + b) for path, (a, b) in relative.items()}


def compact(body: bytes, shape: Shape, config: CompactConfig, lossy: bool,
            memo: Memo | None = None) -> Compaction:
    """Compact the tool results of a body of `shape`.

    Lossy components run only when `lossy` (the request can answer expand calls). When nothing
    changes, the returned body is the very bytes object passed in.
    """
    parsed = ParsedBody.parse(body)
    if parsed is None:
        return Compaction(body=body, changed=False, originals={}, changes=[])
    edits = plan(parsed, shape, config, lossy, memo)
    return Compaction(body=parsed.apply(edits.edits), changed=bool(edits.edits),
                      originals=edits.originals, changes=edits.changes)


class _Walk:
    """The walk over a body's messages in order: what a result's decision depends on besides
    itself (its tool's name, from the call an earlier message made; whether the same text came
    earlier in the request), and the decision inputs that stay the same for every result."""

    def __init__(self, shape: Shape, config: CompactConfig, lossy: bool | frozenset[str], memo: Memo | None,
                 older: Older | None):
        self.find = message_results(shape)
        self.config, self.memo, self.older = config, memo, older
        # `lossy` may be a set of marker IDs: lossy rewrites only for those originals (the ones
        # already stored), reformat only for the rest.
        self.only: frozenset[str] | None = lossy if isinstance(lossy, frozenset) else None
        self.lossy = bool(lossy) if self.only is None else True
        self.seen_digests: set[bytes] = set()  # the results' SHA-256: the same text came earlier
        self.seen_ids: set[str] = set()
        self.tool_names: dict[str, str] = {}

    def decisions(self, index: int, message: object,
                  calls: list[tuple[str, str]]) -> Iterator[tuple[_ToolResult, bytes, _Decision]]:
        """Each tool result of message `index` with its SHA-256 and decision (text None: no
        change); the calls the message makes are added to `calls` (and to the walk's tool names)."""
        for result in self.find(index, message, _Calls(self.tool_names, calls)):
            if result.tool_name == EXPAND_TOOL:
                continue  # what the model asked to see again stays as it is
            try:
                original = result.text.encode("utf-8")
            except UnicodeEncodeError:
                continue  # a lone surrogate: no exact original to give back
            digest = hashlib.sha256(original).digest()
            earlier = digest in self.seen_digests
            decided_by = self.config
            if self.older is not None:
                decided_by = self.older.config_for(result.message_index, result.block_index, self.config)
            decision = _decision(result, original, digest, earlier, self.seen_ids, decided_by, self.lossy, self.memo)
            only = self.only
            if only is not None and decision.result_id not in only and any(s.lossy for s in decision.steps):
                decision = _decision(result, original, digest, earlier, self.seen_ids, decided_by, False, self.memo)
            self.seen_digests.add(digest)
            self.seen_ids.add(decision.result_id)
            yield result, digest, decision


def _decision(result: _ToolResult, original: bytes, digest: bytes, earlier: bool, seen_ids: set[str],
              config: CompactConfig, lossy: bool, memo: Memo | None) -> _Decision:
    """The memo's decision, or a new one (`original`: the result's UTF-8; `digest`: its SHA-256)."""
    key: _DecisionKey = (digest, result.tool_name, config, lossy, earlier)
    decision = memo.decisions.get(key) if memo is not None else None
    if decision is None:
        decision = _decide(result, original, id_of(digest), seen_ids, config, lossy)
        if memo is not None:
            memo.remember(key, decision)
    return decision


def _decide(result: _ToolResult, original: bytes, result_id: str, earlier: set[str],
            config: CompactConfig, lossy: bool) -> _Decision:
    """Run the components in order; keep each rewrite only if it is valid and saves tokens."""
    ctx = Context(
        tool_name=result.tool_name, message_index=result.message_index, block_index=result.block_index,
        part_index=result.part_index, original=original, marker_id=result_id, earlier=earlier,
    )
    # Sized only once a component offers a rewrite: most results stay as they are, and a file a
    # kept tool read (keep_tools) can be the longest text of the request.
    text, tokens = result.text, None
    steps: list[_Step] = []
    ran: list[str] = []
    reverted: list[str] = []
    for component in config.configured:
        if component.lossy and not lossy:
            continue
        ran.append(component.name)
        try:
            outcome = component.apply(text, ctx)
        except Exception:  # noqa: BLE001, S112 -- fail open: a bug costs its saving, not the request
            reverted.append(component.name)
            continue
        if outcome is None:
            continue
        if tokens is None:
            tokens = estimate_tokens(text)
        after = estimate_tokens(outcome.text) if isinstance(outcome.text, str) else tokens
        if after >= tokens or not _keeps_contract(component, outcome, ctx):
            reverted.append(component.name)
            continue
        steps.append(_Step(component.name, component.lossy, tokens, after))
        text, tokens = outcome.text, after
    return _Decision(result_id, text if steps else None, tuple(steps), tuple(ran), tuple(reverted))


def _keeps_contract(component: Component, outcome: Outcome, ctx: Context) -> bool:
    """A lossy rewrite must carry the original and show the marker that gets it back."""
    if not isinstance(outcome.text, str):
        return False
    if not component.lossy:
        return outcome.original is None and outcome.marker_id is None
    return (outcome.original == ctx.original and outcome.marker_id == ctx.marker_id
            and marker(ctx.marker_id) in outcome.text)


def _anthropic_results(index: int, message: object, calls: "_Calls") -> Iterator[_ToolResult]:
    if not isinstance(message, dict):
        return
    content = message.get("content")
    if not isinstance(content, list):
        return
    role = message.get("role")
    for block_index, block in enumerate(content):
        if not isinstance(block, dict):
            continue
        if role == "assistant" and block.get("type") == "tool_use":
            _remember(calls, block.get("id"), block.get("name"))
        elif role == "user" and block.get("type") == "tool_result":
            yield from _result_texts(
                block.get("content"), ("content", block_index, "content"),
                _look_up(calls, block.get("tool_use_id")), index, block_index, "text",
            )


def _openai_results(index: int, message: object, calls: "_Calls") -> Iterator[_ToolResult]:
    if not isinstance(message, dict):
        return
    if message.get("role") == "assistant" and isinstance(message.get("tool_calls"), list):
        for call in message["tool_calls"]:
            if isinstance(call, dict) and isinstance(call.get("function"), dict):
                _remember(calls, call.get("id"), call["function"].get("name"))
    elif message.get("role") == "tool":
        yield from _result_texts(
            message.get("content"), ("content",),
            _look_up(calls, message.get("tool_call_id")), index, None, "text",
        )


# The Responses API's calls and their outputs, matched by `call_id`.
_RESPONSES_CALLS = ("function_call", "custom_tool_call")
_RESPONSES_OUTPUTS = ("function_call_output", "custom_tool_call_output")


def _responses_results(index: int, item: object, calls: "_Calls") -> Iterator[_ToolResult]:
    """The outputs among Responses `input` items: a string, or input_text parts (other parts stay)."""
    if not isinstance(item, dict):
        return
    kind = item.get("type")
    if kind in _RESPONSES_CALLS:
        _remember(calls, item.get("call_id"), item.get("name"))
    elif kind in _RESPONSES_OUTPUTS:
        yield from _result_texts(
            item.get("output"), ("output",),
            _look_up(calls, item.get("call_id")), index, None, "input_text",
        )


_FindResults = Callable[[int, object, "_Calls"], Iterator[_ToolResult]]


def message_results(shape: Shape) -> _FindResults:
    """A body shape's tool results in one message (or input item) of its `Shape.items`, given the
    calls made before it (call ID -> tool name), to which the message's own calls are added."""
    return shape.select(_anthropic_results, _openai_results, _responses_results)


def _result_texts(content: object, path: jsonbytes.Path, tool_name: str | None, message_index: int,
                  block_index: int | None, part_type: str) -> Iterator[_ToolResult]:
    """A result's text: its string content, or each `part_type` part of a list (other parts stay)."""
    if isinstance(content, str):
        yield _ToolResult(path, content, tool_name, message_index, block_index, None)
    elif isinstance(content, list):
        for part_index, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == part_type and isinstance(part.get("text"), str):
                yield _ToolResult(path + (part_index, "text"), part["text"], tool_name, message_index,
                                  block_index, part_index)


@attrs.frozen
class _Calls:
    """The tool names of the calls made so far (call ID -> name), and the list of those one
    message adds (what a replay of that message must add again)."""

    names: dict[str, str]
    added: list[tuple[str, str]]


def _remember(calls: _Calls, call_id: object, name: object) -> None:
    if isinstance(call_id, str) and isinstance(name, str):
        calls.names[call_id] = name
        calls.added.append((call_id, name))


def _look_up(calls: _Calls, call_id: object) -> str | None:
    return calls.names.get(call_id) if isinstance(call_id, str) else None
