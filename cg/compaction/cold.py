"""The cache-aware policy: when the provider's prompt cache for a conversation has expired, re-decide
its older tool results under a stronger policy, then replay those decisions byte for byte.

Pure: no clock, no store, no I/O. Every decision cg makes at first sight is replayed on every later
turn because the provider caches exact bytes (cg.compaction.pipeline). A request that comes after
the cache expired is written to the cache in full anyway, so changing bytes of its history then
costs no extra cache write: that is the one moment cg may decide the history again. The new
decisions are an *epoch*: which messages they cover (the first ``cutoff``), a fingerprint of the
last covered message as the client sent it (a history the client rewrote or compacted no longer
matches), and the stronger policy's parameters. The caller (cg.web.proxy, or cg.record.replay
offline) keeps epochs per conversation in the store (first writer wins) and passes them in; what
cg forwards is then a pure function of (body, epochs), the same bytes on every later turn, after a
restart and on any cg sharing the store.

The stronger policy, for the results of messages older than the last ``recent_turns`` model turns:
a lower offload threshold, and file views (Claude Code's ``Read``, kept whole at first sight)
offloaded too: those a later ``Edit``/``Write``/``MultiEdit`` of the same file, or a ``Read`` of it
showing other text, superseded (``VIEWS_SUPERSEDED``), or every one of them (``VIEWS_ALL``).
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections import OrderedDict
from collections.abc import Sequence

import attrs

from cg.compaction.pipeline import CompactConfig, Older
from cg.wire.body import ParsedBody
from cg.wire.cache import TTL_1H, TTL_5M, asks_for_an_hour
from cg.wire.dialect import Shape

VERSION = 1  # what an epoch's fields mean; an epoch of another version is not applied

TTL_24H = 86400.0  # OpenAI's prompt_cache_retention "24h"; Anthropic's two: cg.wire.cache

# Items a model writes: an assistant message (every dialect), and the Responses API's calls and
# reasoning. A run of them in a row is one model turn.
_MODEL_ITEMS = frozenset({"function_call", "custom_tool_call", "reasoning"})
# Claude Code's file tools: a view (its result is the file's text) and what supersedes one.
VIEW_TOOLS = frozenset({"Read"})
FILE_TOOLS = frozenset({"Read", "Edit", "Write", "MultiEdit"})
MAX_EPOCHS = 64  # per conversation: a bound on the store reads that find them
# Which of the file views an epoch covers it offloads above the threshold: none, those a later call
# superseded, or all of them (after a break the model mostly works on what it did last).
VIEWS_OFF, VIEWS_SUPERSEDED, VIEWS_ALL = "off", "superseded", "all"
VIEWS = (VIEWS_OFF, VIEWS_SUPERSEDED, VIEWS_ALL)
# As an epoch is frozen: the two first values as the bools epochs held before "all" (those still mean them).
_FROZEN_VIEWS: dict[str, bool | str] = {VIEWS_OFF: False, VIEWS_SUPERSEDED: True, VIEWS_ALL: VIEWS_ALL}


@attrs.frozen
class Epoch:
    """A cold request's re-decision: the results of messages ``[0, cutoff)`` get the stronger
    config (offload above ``min_tokens``; the file views ``views`` names too, one of ``VIEWS``), on
    every later request whose message ``cutoff - 1`` still has the fingerprint ``last``."""

    cutoff: int
    last: str
    min_tokens: int
    views: str

    def dumps(self) -> bytes:
        """The text frozen in the store (sorted keys: the same epoch, the same bytes)."""
        return json.dumps({"v": VERSION, "cutoff": self.cutoff, "last": self.last, "min_tokens": self.min_tokens,
                           "views": _FROZEN_VIEWS[self.views]}, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def loads(cls, text: bytes) -> Epoch | None:
        """The epoch frozen as ``text``; None for one this cg does not read (another version)."""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if not isinstance(value, dict) or value.get("v") != VERSION:
            return None
        cutoff, last, min_tokens, views = (value.get(k) for k in ("cutoff", "last", "min_tokens", "views"))
        read = [name for name, frozen in _FROZEN_VIEWS.items() if type(frozen) is type(views) and frozen == views]
        if type(cutoff) is not int or not isinstance(last, str) or type(min_tokens) is not int or not read:
            return None
        return cls(cutoff, last, min_tokens, read[0])


@attrs.frozen
class ColdPolicy:
    """When a request is cold, and what it re-decides. Defaults measured: docs/performance.md,
    "The cache-aware policy".

    ``margin``: seconds past the recorded expiry before a request counts as cold. A wrong "cold"
    costs a cache write of the history from the first changed result on, so it errs late: it
    covers the provider taking a request some seconds after cg sent it, and clocks of cg
    instances sharing a store that disagree by a little.
    """

    recent_turns: int = 2
    offload_min_tokens: int = 2000  # first sight's: on its own, a cold request only offloads file views
    views: str = attrs.field(default=VIEWS_SUPERSEDED, validator=attrs.validators.in_(VIEWS))
    margin: float = 60.0

    def is_cold(self, expired: float | None, now: float) -> bool:
        """Whether the conversation's cache, recorded to live until ``expired`` (Unix time; None:
        nothing recorded, so nothing is known), has surely expired at ``now``."""
        return expired is not None and now > expired + self.margin

    def epoch(self, body: ParsedBody, shape: Shape, current: Epoch | None = None) -> Epoch | None:
        """The epoch a cold request makes: everything before its last ``recent_turns`` model turns.
        None when there is no older history, or when ``current`` (the epoch this body matches)
        already decides it under the same parameters."""
        items = body.value.get(shape.items)
        if not isinstance(items, list):
            return None
        cutoff = _recent_start(items, self.recent_turns)
        if cutoff is None or cutoff < 1:
            return None
        if (current is not None and current.cutoff >= cutoff
                and (current.min_tokens, current.views) == (self.offload_min_tokens, self.views)):
            return None
        return Epoch(cutoff, fingerprint(body, shape, cutoff - 1), self.offload_min_tokens, self.views)


@attrs.define
class ColdStats:
    """What the cache-aware policy did, for /stats (one request's tally, or the sum since start).

    `checked`: requests it looked at (a conversation id, the expand tool declared); `cold`: of
    those, found after their conversation's cache had expired; `epochs`: re-decisions this cg
    froze in the store at such a request (another cg sharing the store may have frozen others);
    `applied`: requests decided under an epoch; `unknown`: requests whose epochs the store could
    not read, decided by those this cg read before (none after a restart: a marker an epoch sent
    earlier then goes whole, one cache write and nothing lost); `known_warm`: requests that asked
    the store nothing, their conversation surely warm by what this cg last learned (`Known`).
    """

    checked: int = 0
    cold: int = 0
    epochs: int = 0
    applied: int = 0
    unknown: int = 0
    known_warm: int = 0

    def add(self, other: ColdStats) -> None:
        for field in attrs.fields(ColdStats):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))


@attrs.define
class Known:
    """What this cg last learned from the store of each conversation (tenant, key): its epochs,
    and an expiry its cache surely lives until (the store holds that one or a later one). Under a
    conversation's `lifetime_key`, the same for --cache-ttl auto: its frozen lifetime, or that none
    was frozen (`found_none`), and the expiry recorded under that key.

    A request that finds its conversation surely warm asks the store nothing (`warm`): an epoch is
    frozen only at a request ``margin`` seconds past the stored expiry, which this record keeps
    ahead of it, so no cg sharing the store can have frozen one since this cg last read them (its
    clock would have to run two margins ahead), once two reads in a row found the same epochs since
    the last request that found it maybe cold (a cg that took the conversation for cold just
    before this one recorded its expiry may freeze one just after this one read them; a freeze
    slower than this cg's next request is not covered, and is read once this cg's record moves
    by half a margin); and the expiry it would record is less than half a margin past the stored one, a lag
    that leaves "cold" true only once the cache surely expired.
    Two store round trips per conversation every half a margin at most, whatever its pace.
    Bounded in conversations, least recently used out first.
    """

    max_conversations: int = 10_000
    _items: OrderedDict[tuple[str, str], _Learned] = attrs.field(factory=OrderedDict, init=False)

    def epochs(self, tenant: str, key: str) -> list[Epoch | None]:
        """The epochs read so far (a copy: frozen first writer wins, so they stay true)."""
        learned = self._items.get((tenant, key))
        return list(learned.epochs) if learned is not None else []

    def set_epochs(self, tenant: str, key: str, epochs: list[Epoch | None]) -> list[Epoch | None]:
        """Every epoch the store holds for the conversation, as just read. Only a read that finds
        what the one before it found settles them: a cg that took the conversation for cold at
        the same moment as this one's last visit may have frozen one just after that read."""
        learned = self._learned(tenant, key)
        learned.settled = learned.read and epochs == learned.epochs
        learned.epochs, learned.read = epochs, True
        return epochs

    def found_none(self, tenant: str, key: str) -> None:
        """A read found nothing frozen for the conversation (the lifetime --cache-ttl auto chose):
        settled, as `set_epochs`, by a second read that finds none either."""
        self.set_epochs(tenant, key, [])

    def doubt(self, tenant: str, key: str) -> None:
        """The store could not say which epochs it holds now: ask it again next time."""
        learned = self._items.get((tenant, key))
        if learned is not None:
            learned.read = learned.settled = False

    def stored(self, tenant: str, key: str, until: float) -> None:
        """The store now holds `until` (or a later expiry) for the conversation."""
        learned = self._learned(tenant, key)
        learned.until = until if learned.until is None else max(until, learned.until)

    def until(self, tenant: str, key: str) -> float | None:
        """The expiry the conversation's cache surely lives until, as last learned (None: none)."""
        learned = self._items.get((tenant, key))
        return None if learned is None else learned.until

    def warm(self, tenant: str, key: str, now: float, until: float | None, margin: float) -> bool:
        """Whether a request at `now` that would record `until` (None: records nothing) can skip
        the store: its epochs read, its cache surely warm, and nothing to record that matters."""
        learned = self._items.get((tenant, key))
        if learned is None:
            return False
        if learned.until is None or now + margin > learned.until:
            # Maybe cold since: another cg may be freezing an epoch, which a read now can miss.
            learned.read = learned.settled = False
            return False
        if not learned.settled:
            return False
        if until is not None and until - learned.until >= margin / 2:
            return False
        self._items.move_to_end((tenant, key))
        return True

    def lifetime(self, tenant: str, key: str) -> float | None:
        """The cache lifetime frozen for the conversation (--cache-ttl auto), as last read; None:
        none read yet (frozen first writer wins, so one read stays true)."""
        learned = self._items.get((tenant, key))
        return None if learned is None else learned.lifetime

    def set_lifetime(self, tenant: str, key: str, lifetime: float) -> None:
        self._learned(tenant, key).lifetime = lifetime

    def _learned(self, tenant: str, key: str) -> _Learned:
        learned = self._items.get((tenant, key))
        if learned is None:
            learned = self._items[(tenant, key)] = _Learned()
            while len(self._items) > self.max_conversations:
                self._items.popitem(last=False)
        self._items.move_to_end((tenant, key))
        return learned


@attrs.define
class _Learned:
    epochs: list[Epoch | None] = attrs.Factory(list)
    read: bool = False  # whether `epochs` are all the store held at the last read
    settled: bool = False  # and the read before found the same
    until: float | None = None
    lifetime: float | None = None  # the cache lifetime frozen for it (--cache-ttl auto)


def _recent_start(items: list[object], turns: int) -> int | None:
    """Where the last ``turns`` model turns start (None: fewer than that)."""
    seen = 0
    index = len(items)
    while index > 0:
        index -= 1
        if _is_model(items[index]) and (index == 0 or not _is_model(items[index - 1])):
            seen += 1
            if seen == turns:
                return index
    return None


def _is_model(item: object) -> bool:
    return isinstance(item, dict) and (item.get("role") == "assistant" or item.get("type") in _MODEL_ITEMS)


def fingerprint(body: ParsedBody, shape: Shape, index: int) -> str:
    """Message (input item) ``index`` as the client sent it, hashed."""
    start, end = body.spans[(shape.items, index)]
    return hashlib.sha256(body.raw[start:end]).hexdigest()[:32]


def cache_ttl(body: ParsedBody, shape: Shape) -> float:
    """How long the provider keeps this request's prompt cached, at the longest: Anthropic's
    5 minutes, or an hour when a ``cache_control`` breakpoint asks for ``"ttl": "1h"``; OpenAI's
    (chat completions and Responses) up to an hour (it says 5 to 10 minutes, up to an hour
    off-peak), a day with ``prompt_cache_retention: "24h"``."""
    return shape.select(_breakpoints_ttl, _retention_ttl, _retention_ttl)(body)


def _breakpoints_ttl(body: ParsedBody) -> float:
    return TTL_1H if asks_for_an_hour(body) else TTL_5M


def _retention_ttl(body: ParsedBody) -> float:
    return TTL_24H if body.value.get("prompt_cache_retention") == "24h" else TTL_1H


def latest(epochs: Sequence[Epoch | None], body: ParsedBody, shape: Shape) -> Epoch | None:
    """The latest of a conversation's epochs that this body matches (None: none does).

    An epoch matches while the body still holds its last covered message byte for byte. The
    latest was made at the latest cold request, which decided the whole history before it again;
    an earlier one only counts when a rewritten history no longer holds the later one's message.
    """
    items = body.value.get(shape.items)
    if not isinstance(items, list):
        return None
    for epoch in reversed(epochs):
        if epoch is not None and 0 < epoch.cutoff <= len(items) and (
                fingerprint(body, shape, epoch.cutoff - 1) == epoch.last):
            return epoch
    return None


def older(epoch: Epoch | None, body: ParsedBody, shape: Shape, config: CompactConfig) -> Older | None:
    """What ``epoch`` (one this body matches: ``latest``) asks of the pipeline. Superseded file
    views are Claude Code's (Anthropic Messages); other shapes have none."""
    if epoch is None:
        return None
    strong, views = _configs(config, epoch.min_tokens)
    if epoch.views == VIEWS_OFF:
        offloaded = _NONE
    else:
        every = epoch.views == VIEWS_ALL
        offloaded = shape.select(_views_in, _no_views, _no_views)(body, epoch.cutoff, every)
    return Older(epoch.cutoff, strong, views, offloaded)


_NONE: frozenset[tuple[int, int]] = frozenset()


def _no_views(body: ParsedBody, cutoff: int, every: bool) -> frozenset[tuple[int, int]]:
    return _NONE


# ParsedBody.carried (`ParsedBody.up_to` message cutoff - 1): `_superseded` of the messages before,
# and every file view among them.
_SUPERSEDED = "cold: the file views superseded before a cutoff"
_EVERY = "cold: the file views before a cutoff"


def _views_in(body: ParsedBody, cutoff: int, every: bool) -> frozenset[tuple[int, int]]:
    """`_superseded` (or, ``every``, `_views`) of the body's messages, as the conversation's last
    body answered it when both hold the same messages up to ``cutoff`` (so a turn does not read its
    history again: cg.wire.body.Messages)."""
    items = body.value.get("messages")
    if not isinstance(items, list):
        return frozenset()
    if every:
        return body.up_to(_EVERY, "messages", cutoff - 1,
                          lambda: frozenset((index, block) for index, block, _, _ in _views(items, cutoff)))
    return body.up_to(_SUPERSEDED, "messages", cutoff - 1, lambda: _superseded(items, cutoff))


@functools.lru_cache(maxsize=64)
def _configs(config: CompactConfig, min_tokens: int) -> tuple[CompactConfig, CompactConfig]:
    """The stronger configs: a lower offload threshold; and, for a superseded view, the view tools no
    longer kept whole. Built once each: a config is part of every memo key."""
    strong = attrs.evolve(config, offload_min_tokens=min(min_tokens, config.offload_min_tokens))
    return strong, attrs.evolve(strong, keep_tools=strong.keep_tools - VIEW_TOOLS)


def _superseded(messages: list[object], cutoff: int) -> frozenset[tuple[int, int]]:
    """(message, block) of each file view among ``messages[:cutoff]`` that a later call on the same
    ``file_path`` in those messages superseded: an edit or a write of the file, or a read of it that
    showed other text. A read that showed the same text does not: dedup made that one a pointer
    to this one, which must keep the text. Anthropic's tool_use/tool_result.

    Only the covered messages count: the answer must not change as the history grows.
    """
    written: dict[str, int] = {}  # file_path -> the last assistant message editing or writing it
    views = _views(messages, cutoff, written)
    superseded = set()
    later: dict[str, tuple[object, bool]] = {}  # file_path -> (a later view's content, whether later ones differ)
    for index, block_index, path, content in reversed(views):  # one pass, whatever the number of views
        if path in later:
            shown, mixed = later[path]
            if mixed or shown != content:
                superseded.add((index, block_index))
            later[path] = (shown, mixed or shown != content)
        else:
            later[path] = (content, False)
        if written.get(path, -1) > index:
            superseded.add((index, block_index))
    return frozenset(superseded)


def _views(messages: list[object], cutoff: int,
           written: dict[str, int] | None = None) -> list[tuple[int, int, str, object]]:
    """(message, block, file_path, the result's content) of each file view among
    ``messages[:cutoff]``, in order; ``written`` gets, per file_path, the last assistant message
    among them editing or writing it. Anthropic's tool_use/tool_result."""
    calls: dict[str, tuple[str, str]] = {}  # tool_use id -> (tool, file_path)
    views: list[tuple[int, int, str, object]] = []
    for index, message in enumerate(messages[:cutoff]):
        if not isinstance(message, dict) or not isinstance(message.get("content"), list):
            continue
        role = message.get("role")
        for block_index, block in enumerate(message["content"]):
            if not isinstance(block, dict):
                continue
            if role == "assistant" and block.get("type") == "tool_use" and block.get("name") in FILE_TOOLS:
                tool_input = block.get("input")
                path = tool_input.get("file_path") if isinstance(tool_input, dict) else None
                if isinstance(path, str) and isinstance(block.get("id"), str):
                    calls[block["id"]] = (block["name"], path)
                    if block["name"] not in VIEW_TOOLS and written is not None:
                        written[path] = index
            elif role == "user" and block.get("type") == "tool_result":
                tool_use_id = block.get("tool_use_id")
                call = calls.get(tool_use_id) if isinstance(tool_use_id, str) else None
                if call is not None and call[0] in VIEW_TOOLS:
                    views.append((index, block_index, call[1], block.get("content")))
    return views


def conversation_key(conversation: str, model: str | None) -> str:
    """The store's name for a conversation's cache: its id and model (another model's requests, such
    as Claude Code's side requests to a small model, have a cache of their own)."""
    return hashlib.sha256(f"{model or ''}\0{conversation}".encode("utf-8", "surrogatepass")).hexdigest()[:32]


def epoch_key(conversation: str, index: int) -> str:
    """The frozen text holding epoch ``index`` of a conversation (``conversation_key``)."""
    return f"cold:{conversation}:{index}"


def lifetime_key(conversation: str) -> str:
    """The frozen text holding the cache lifetime chosen for a conversation (--cache-ttl auto)."""
    return f"ttl:{conversation}"
