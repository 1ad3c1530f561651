"""Replay a session's requests through cg's rewrite, offline, and price them direct and via cg.

``replay(requests, config)`` is a pure function of its arguments: (time, body, path) in order
in, a ``Turn`` per request out, with the provider's prompt cache (cg.record.pricing) run on the
bodies as sent direct and as cg would have forwarded them. No network, no store: cg's rewrite
(cg.compaction.rewrite) is pure, and the originals it would store are not needed to price.

What it states rather than measures:

- Output tokens are the same both ways (cg does not change what the model writes): each turn
  carries the transcript's own count, priced alike on both sides.
- Expand rounds: cg counts each result it offloads once (``offloads``); how often the model
  asks for one back is not in a transcript of a run without cg, so ``expand_rate`` (a fraction
  of offloads, default 0.1) is the expected number of rounds per offload. An expected round is
  priced on the cg side as one more request at the point of the offload: the prompt so far read
  from the cache, plus the original written as uncached input.
- Tokens are cg's estimator's (cg.compaction.tokens), segment by segment in prompt order,
  calibrated per conversation where the transcript recorded its prompts' sizes (``Sent.recorded``):
  what the first request holds stays as estimated (a Claude Code reader fits its envelope to that
  request's recorded prompt), and every segment it did not hold is scaled by the least-squares fit
  of the recorded prompts to the simulated ones (``calibration``). The via-cg side is sized with
  the same scale, on what cg forwards and what it removes alike: an assumption (Anthropic's count of
  an excerpt or a marker is taken to differ from cg's estimate as the conversation's text does).
  ``Turn.direct_raw`` is the direct side sized by the estimate alone.
- The client's own cache breaks: where a calibrated conversation's recorded usage read less of the
  cache than the simulation would (by a cacheable block and a tenth of the read), the client
  changed bytes the transcript does not show (a system prompt with the date or the git status, a
  cache lost): both sides read no more than the recorded run did and write the rest, since cg
  forwards the client's envelope as it is (``Turn.client_break``).
- Offloads: results cg replaces with an excerpt or a pointer (a lossy rewrite), each counted in the
  request where it first is, at the size the client sent (before any lossless step such as
  textclean). Bytes: each body as sent and as cg would forward it.
- Keep-alive (``keep_warm``, a ``cg.exchange.keepalive.Policy``): the via-cg side is priced once
  more on a prompt cache of its own, with the pings cg's keep-alive would have sent in each idle
  gap, at the times its own scheduler (the one cg runs) picks from the transcript's timestamps,
  keyed as cg keys it (``keep_warm_session``: a session's conversations share a timer per model).
  A ping is billed as the conversation's last forwarded prompt read again (cache reads, the tail
  after the last breakpoint as input) plus one output token; every real request is taken to have
  been answered 2xx when it was sent, and every ping to read what the cache holds.
- Cache lifetime (``cache_ttl``): "keep" prices the client's breakpoints as they are; "5m" and
  "1h" give every breakpoint of the via-cg prompt that lifetime (one lifetime for all: Anthropic
  wants longer ones before shorter ones); "auto" keeps the client's until the conversation's cache
  first expires (the cold policy's margin past it, as twistd cg decides) (its next request writes the prefix anyway, whatever its lifetime), then asks for
  an hour from that request on. Keep-alive pings at the lifetime the breakpoints ask for.
- The cache-aware policy (``config.cold``, cg.compaction.cold) runs on the requests' own times:
  a request later than the conversation's cache lifetime (plus the policy's margin) after the
  previous one is cold and makes an epoch, as cg's store would keep it; the offloads the epochs
  bring are counted apart (``cold_offloads``, ``cold_expand_cost``) so that a caller can price
  their expand rounds at another rate.
"""

from __future__ import annotations

import base64
import binascii
import bisect
import json
import math
import struct
from collections.abc import Iterable, Iterator
from typing import Any

import attrs

from cg.compaction import cold
from cg.compaction.pipeline import Change
from cg.compaction.rewrite import Incoming, RewriteConfig, Rewriter
from cg.compaction.tokens import estimate_tokens
from cg.exchange import keepalive
from cg.record.pricing import (
    Price,
    PriceTable,
    PromptCache,
    Segment,
    Tokens,
    digest,
    prices,
)
from cg.wire.body import ParsedBody
from cg.wire.cache import CACHE_TTLS, OUTPUT_PRICE, READ_PRICE, TTL_1H, WRITE_PRICE, breakpoint_ttl
from cg.wire.dialect import CHAT_SHAPE, MESSAGES_SHAPE, RESPONSES_SHAPE, Shape

DEFAULT_EXPAND_RATE = 0.1

# The paths whose requests are replayed, and their bodies' shape (whose route names the provider
# that prices them: cg.record.pricing keys its providers by the route's dialect name).
_SHAPES = {"/v1/messages": MESSAGES_SHAPE, "/v1/chat/completions": CHAT_SHAPE, "/v1/responses": RESPONSES_SHAPE}


@attrs.frozen
class Sent:
    """One request to replay: when it was sent, where, its body; the model's output tokens."""

    time: float
    path: str
    body: bytes
    output_tokens: int = 0
    recorded: Tokens | None = None  # its usage as the transcript recorded it (the direct run's)


@attrs.frozen
class Turn:
    """One request priced both ways."""

    time: float
    model: str | None
    price: Price
    direct: Tokens
    cg: Tokens
    offloads: int  # results cg offloaded for the first time in this request
    expand_rounds: float  # expected rounds this request's offloads bring
    expand_cost: float  # their expected cost (USD), part of cost_cg
    bytes_direct: int = 0  # the body as the client sent it
    bytes_cg: int = 0  # the body as cg would have forwarded it
    keepalive: Tokens | None = None  # with keep-alive: this request as billed then (output included)
    pings: int = 0  # keep-alive pings sent after this request, before its conversation's next
    ping_tokens: Tokens = Tokens()  # what they were billed
    cold: bool = False  # the cache-aware policy found this request cold and made an epoch
    cold_offloads: int = 0  # of `offloads`, those an epoch's stronger config made
    cold_expand_cost: float = 0.0  # of `expand_cost`, theirs
    cold_results: tuple[tuple[int, int | None, float], ...] = ()  # theirs: (message, block, expected expand cost)
    direct_raw: Tokens = Tokens()  # `direct` with every segment sized by cg's estimate alone (no calibration)
    scale: float = 1.0  # the conversation's calibration: what its later segments were scaled by
    client_break: bool = False  # the recorded run read less than the simulation would: its reads capped
    shared_read: bool = False  # it read more (a prefix another conversation had cached): as much read here

    @property
    def cost_direct(self) -> float:
        return self.price.cost(self.direct)

    @property
    def cost_direct_raw(self) -> float:
        return self.price.cost(self.direct_raw)

    @property
    def cost_cg(self) -> float:
        return self.price.cost(self.cg) + self.expand_cost

    @property
    def cost_keepalive(self) -> float:
        """Via cg with keep-alive: this request, the pings after it, and its expand rounds."""
        billed = self.cg if self.keepalive is None else self.keepalive
        return self.price.cost(billed + self.ping_tokens) + self.expand_cost

    @property
    def ping_cost(self) -> float:
        return self.price.cost(self.ping_tokens)


def _dump(value: object) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


class _Sizer:
    """Segments with tokens, each distinct segment estimated once per session; one the first
    request did not hold (not in ``first``) scaled by the conversation's calibration (``scale``)."""

    def __init__(self, estimates: dict[bytes, int] | None = None) -> None:
        self._tokens: dict[bytes, int] = {} if estimates is None else estimates
        self.scale = 1.0
        self.first: frozenset[bytes] = frozenset()

    def unscaled(self) -> _Sizer:
        """A sizer of cg's estimate alone, sharing this one's estimates."""
        return _Sizer(self._tokens)

    def segment(self, kind: str, value: object, breakpoint: float | None = None) -> Segment:
        if isinstance(value, dict) and "cache_control" in value:  # a breakpoint is not content
            value = {k: v for k, v in value.items() if k != "cache_control"}
        raw = _dump(value)
        key = digest(kind.encode(), raw)
        tokens = self._tokens.get(key)
        if tokens is None:
            tokens = self._tokens[key] = _estimate(value, raw)
        if self.scale != 1.0 and key not in self.first:
            tokens = round(tokens * self.scale)
        return Segment(key, tokens, breakpoint)


# Anthropic's images: resized to at most this many pixels on the long edge, then billed a token per
# 750 pixels up to about 1,600 (platform.claude.com/docs/en/build-with-claude/vision, "Evaluate image size").
IMAGE_LONG_EDGE, IMAGE_PIXELS_PER_TOKEN, IMAGE_MAX_TOKENS = 1568, 750, 1600
_IMAGE_HEAD = 65536  # bytes of an image decoded to find its size (a JPEG's frame header can follow its metadata)
# What marks a block whose text is not what is billed: a base64 image, a thinking block's signature.
_OPAQUE = (b'"base64"', b'"signature"', b'"redacted_thinking"')
# A thinking block Claude Code wrote without its text still carries it, encrypted, in its signature
# (base64: 4 characters a 3 bytes): billed as that many bytes of thinking at ~4 a token.
_SIGNATURE_CHARACTERS_PER_TOKEN = 4 / 3 * 4


def _estimate(value: object, raw: bytes) -> int:
    """Tokens of a segment: cg's estimate of its text, and what is billed other than as text (an
    image by its pixels, a thinking block by its thinking) as the provider bills it: a screenshot is
    ~1,600 tokens, its base64 ~100,000 by the text estimate; a signature is no text of the prompt."""
    if not any(mark in raw for mark in _OPAQUE):
        return estimate_tokens(raw.decode("utf-8"))
    opaque: list[int] = []
    text = _readable(value, opaque)
    return estimate_tokens(_dump(text).decode("utf-8")) + sum(opaque)


def _readable(value: object, opaque: list[int]) -> object:
    """``value`` without what is not billed as its text (each base64 image's data, each thinking
    block's signature), the tokens those are billed instead appended to ``opaque``."""
    if isinstance(value, list):
        return [_readable(item, opaque) for item in value]
    if not isinstance(value, dict):
        return value
    kind, source = value.get("type"), value.get("source")
    if kind == "image" and isinstance(source, dict) and source.get("type") == "base64":
        opaque.append(image_tokens(source.get("data")))
        return {**value, "source": {**source, "data": ""}}
    if kind in ("thinking", "redacted_thinking"):
        sealed = value.get("signature" if kind == "thinking" else "data")
        if isinstance(sealed, str) and not value.get("thinking"):
            opaque.append(round(len(sealed) / _SIGNATURE_CHARACTERS_PER_TOKEN))
        return {k: v for k, v in value.items() if k not in ("signature", "data")}
    return {key: _readable(item, opaque) for key, item in value.items()}


def image_tokens(data: object) -> int:
    """What Anthropic bills for a base64 image: its pixels (resized to the long-edge limit) / 750, at
    most IMAGE_MAX_TOKENS; an image whose size cannot be read (a format not parsed here) at most."""
    size = None
    if isinstance(data, str):
        head = data[: _IMAGE_HEAD // 3 * 4]
        try:
            size = _pixels(base64.b64decode(head[: len(head) // 4 * 4]))
        except (binascii.Error, ValueError):
            size = None
    if size is None:
        return IMAGE_MAX_TOKENS
    width, height = size
    shrink = min(1.0, IMAGE_LONG_EDGE / max(width, height, 1))
    return max(1, min(IMAGE_MAX_TOKENS, math.ceil(width * shrink * height * shrink / IMAGE_PIXELS_PER_TOKEN)))


def _pixels(head: bytes) -> tuple[int, int] | None:
    """(width, height) from the first bytes of a PNG, GIF or JPEG, else None."""
    if head.startswith(b"\x89PNG\r\n\x1a\n") and len(head) >= 24:
        width, height = struct.unpack(">II", head[16:24])
        return width, height
    if head[:6] in (b"GIF87a", b"GIF89a") and len(head) >= 10:
        width, height = struct.unpack("<HH", head[6:10])
        return width, height
    if head.startswith(b"\xff\xd8"):
        at = 2
        while at + 9 <= len(head) and head[at] == 0xFF:
            marker, length = head[at + 1], struct.unpack(">H", head[at + 2:at + 4])[0]
            if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):  # a frame header: its size
                height, width = struct.unpack(">HH", head[at + 5:at + 9])
                return width, height
            at += 2 + length
    return None


def segments(body: dict[str, Any], shape: Shape, sizer: _Sizer | None = None) -> list[Segment]:
    """A body's prompt in the provider's order, one segment per block: Anthropic tools, system,
    then each message's content blocks; OpenAI tools, instructions, then each message or item."""
    return shape.select(_block_segments, _item_segments, _item_segments)(body, shape, sizer or _Sizer())


def _tools(body: dict[str, Any]) -> list[Any]:
    tools = body.get("tools")
    return tools if isinstance(tools, list) else []


def _block_segments(body: dict[str, Any], shape: Shape, sizer: _Sizer) -> list[Segment]:
    """Anthropic's: its breakpoints (``cache_control``) on tools, system and content blocks."""
    out = [sizer.segment("tool", tool, breakpoint_ttl(tool)) for tool in _tools(body)]
    system = body.get("system")
    if isinstance(system, list):
        out += [sizer.segment("system", b, breakpoint_ttl(b)) for b in system]
    elif system:
        out.append(sizer.segment("system", system))
    for message in body.get(shape.items) or []:
        if not isinstance(message, dict):
            continue
        role = str(message.get("role"))
        content = message.get("content")
        if isinstance(content, list):
            out += [sizer.segment(role, b, breakpoint_ttl(b)) for b in content]
        else:
            out.append(sizer.segment(role, content))
    return out


def _item_segments(body: dict[str, Any], shape: Shape, sizer: _Sizer) -> list[Segment]:
    """OpenAI's (chat completions, Responses): no breakpoints; a message or input item a segment."""
    out = [sizer.segment("tool", tool, None) for tool in _tools(body)]
    if body.get("instructions"):
        out.append(sizer.segment("instructions", body["instructions"]))
    items = body.get(shape.items)
    if isinstance(items, str):
        items = [items]
    out += [sizer.segment("item", item) for item in items or []]
    return out


# The calibrations taken as plausible: Anthropic's count of text against cl100k's runs from about
# 1.0 to 1.4; a fit outside these bounds says the recorded usage is not the prompt's size (a fake
# provider's, say), and the estimate is left alone.
CALIBRATION_BOUNDS = (0.5, 2.0)


def calibration(prompts: Iterable[tuple[list[Segment], int | None]]) -> tuple[float | None, frozenset[bytes]]:
    """How much a conversation's later segments weigh in the provider's count against cg's estimate:
    from each request's simulated segments and its recorded prompt size (None: not recorded), the
    scale ``s`` that makes ``recorded ≈ first + s × later`` (``first``: the segments its first
    request held, as fitted; ``later``: the others) in least squares, and those first segments;
    1.0 where nothing was added; None where nothing was recorded or the fit is out of
    ``CALIBRATION_BOUNDS`` (the recorded usage is not taken as the prompt's). One pass, keeping
    sums only: a long session's prompts are never all in memory at once."""
    first: frozenset[bytes] | None = None
    covariance = variance = 0
    recorded_any = False
    for prompt, recorded in prompts:
        if first is None:
            first = frozenset(seg.digest for seg in prompt)
        if recorded is None:
            continue
        recorded_any = True
        later = sum(seg.tokens for seg in prompt if seg.digest not in first)
        covariance += later * (recorded - (sum(seg.tokens for seg in prompt) - later))
        variance += later * later
    if first is None or not recorded_any:
        return None, first or frozenset()
    if not variance:
        return 1.0, first
    scale = round(covariance / variance, 4)  # rounded: the same figure wherever it is computed
    low, high = CALIBRATION_BOUNDS
    return (scale if low <= scale <= high else None), first


def _prompt(recorded: Tokens | None) -> int | None:
    return None if recorded is None else recorded.prompt


def _client_break(billed: Tokens, recorded: Tokens, min_tokens: int) -> bool:
    """The recorded run read clearly less of the cache than the simulated one (a cacheable block's
    worth and a tenth of the simulated read): the client changed what the transcript does not show."""
    return billed.cache_read - recorded.cache_read >= max(min_tokens, billed.cache_read // 10)


def _read_at_most(billed: Tokens, read: int) -> Tokens:
    """``billed`` reading no more than ``read`` tokens from the cache, the rest written (at the
    lifetime of what it writes already, else 5 minutes)."""
    missed = billed.cache_read - read
    if missed <= 0:
        return billed
    if billed.cache_write_1h and not billed.cache_write_5m:
        return attrs.evolve(billed, cache_read=read, cache_write_1h=billed.cache_write_1h + missed)
    return attrs.evolve(billed, cache_read=read, cache_write_5m=billed.cache_write_5m + missed)


def _shared_read(billed: Tokens, recorded: Tokens, min_tokens: int) -> bool:
    """The recorded run read clearly more of the cache than the simulated one, which gives each
    conversation a cache of its own: it found a prefix another conversation of the same account had
    cached (the envelope every session sends, a parent's prompt a sub-agent or a resumed session
    begins with, a concurrent session's)."""
    return recorded.cache_read - billed.cache_read >= max(min_tokens, billed.cache_read // 10)


def _read_at_least(billed: Tokens, read: int) -> Tokens:
    """``billed`` reading ``read`` tokens from the cache where it wrote them (no more than it wrote)."""
    found = min(read - billed.cache_read, billed.cache_write)
    if found <= 0:
        return billed
    from_5m = min(found, billed.cache_write_5m)
    return attrs.evolve(billed, cache_read=billed.cache_read + found, cache_write_5m=billed.cache_write_5m - from_5m,
                        cache_write_1h=billed.cache_write_1h - (found - from_5m))


def _as_recorded(billed: Tokens, broke: bool, shared: bool, recorded: Tokens | None) -> Tokens:
    """``billed`` reading what the recorded run read where the simulated cache cannot say (a client
    cache break: no more; a prefix shared with another conversation: no less)."""
    if recorded is None:
        return billed
    if broke:
        return _read_at_most(billed, recorded.cache_read)
    return _read_at_least(billed, recorded.cache_read) if shared else billed


def _first_offloads(changes: Iterable[Change], seen: set[str]) -> dict[str, int]:
    """The results offloaded (a lossy rewrite with a marker) for the first time in this request,
    each with its size as the client sent it: the ``tokens_before`` of its first step (a lossless
    step such as textclean may come before the lossy one)."""
    sent: dict[tuple[int, int | None, int | None], int] = {}
    new: dict[str, int] = {}
    for change in changes:
        where = (change.message_index, change.block_index, change.part_index)
        if change.step == 0:
            sent[where] = change.tokens_before
        if change.lossy and change.marker_id and change.marker_id not in seen and change.marker_id not in new:
            new[change.marker_id] = sent.get(where, change.tokens_before)
    return new


class _Conversation:
    """The cache-aware policy's state of one conversation, as cg's store would hold it: when its
    cache expires (the latest request's time plus its lifetime), and its epochs."""

    def __init__(self, policy: cold.ColdPolicy):
        self.policy = policy
        self.expires: float | None = None
        self.epochs: list[cold.Epoch] = []

    def step(self, now: float, incoming: Incoming) -> tuple[cold.Epoch | None, bool]:
        """The epoch this request is decided by, and whether it was cold and made a new one."""
        body, shape = incoming.body, incoming.dialect
        current = cold.latest(self.epochs, body, shape)
        made = None
        if self.policy.is_cold(self.expires, now) and len(self.epochs) < cold.MAX_EPOCHS:
            made = self.policy.epoch(body, shape, current)
            if made is not None:
                self.epochs.append(made)
                current = made
        self.expires = max(self.expires or now, now + cold.cache_ttl(body, shape))
        return current, made is not None


class _Lifetime:
    """The lifetime cg's breakpoints ask for (``cache_ttl``, see the module docstring), per model."""

    def __init__(self, cache_ttl: str, policy: cold.ColdPolicy):
        self.policy = policy  # when a cache surely expired, as twistd cg's preparation tells it
        self.fixed = CACHE_TTLS[cache_ttl]
        self.auto = cache_ttl == "auto"
        self.expires: dict[str | None, float] = {}  # the client's cache, per model
        self.chosen: dict[str | None, float] = {}  # auto: chosen at a model's first expired cache

    def step(self, now: float, model: str | None, asked: float | None) -> float | None:
        """The lifetime this request's breakpoints get (None: the client's, ``asked``)."""
        if not self.auto or asked is None:
            return self.fixed
        expires = self.expires.get(model)
        if self.policy.is_cold(expires, now) and model not in self.chosen:
            self.chosen[model] = TTL_1H
        lifetime = self.chosen.get(model, asked)
        self.expires[model] = now + lifetime
        return self.chosen.get(model)


def replay(requests: Iterable[Sent], config: RewriteConfig | None = None, table: PriceTable | None = None,
           expand_rate: float = DEFAULT_EXPAND_RATE, conversation: str = "",
           keep_warm: keepalive.Policy | None = None, cache_ttl: str = "keep", calibrate: bool = True,
           forwarded: list[Forwarded] | None = None) -> list[Turn]:
    """Each request of one conversation priced direct and via cg (``config``: cg's rewrite
    options; None: its defaults), in order; with ``keep_warm``, via cg with keep-alive too (the
    conversation alone: ``keep_warm_session`` prices a session's conversations together);
    ``cache_ttl``: the lifetime cg's breakpoints ask for (``CACHE_TTLS``); ``calibrate``: sized
    with the conversation's calibration (``calibration``) where its requests recorded their size;
    ``forwarded``: appended, what each turn forwarded, for ``keep_warm_session``."""
    table = table or prices()
    if forwarded is None and keep_warm is not None:
        forwarded = []
    config = config or RewriteConfig()
    lifetimes = _Lifetime(cache_ttl, config.cold or cold.ColdPolicy())
    rewriter = Rewriter(config)
    # Per model, as cg keys it (cold.conversation_key): a side request to another model has a cache of its own.
    states: dict[str | None, _Conversation] = {}
    sizer = _Sizer()
    raw = sizer.unscaled()
    requests = list(requests)
    fitted = False
    if calibrate and any(request.recorded is not None for request in requests):
        # A pass of its own, each body parsed again below: a session's bodies (each the whole history
        # so far) are never all held at once.
        scale, sizer.first = calibration((segments(body, shape, raw), _prompt(request.recorded))
                                         for request, shape, body in _parsed(requests))
        fitted, sizer.scale = scale is not None, scale or 1.0
    caches: dict[tuple[str, str], tuple[PromptCache, PromptCache, PromptCache]] = {}
    seen: set[str] = set()
    turns: list[Turn] = []
    previous: dict[str | None, list[Segment]] = {}  # per model, the prompt forwarded last
    for request, shape, direct_body in _parsed(requests):
        model = direct_body.get("model") if isinstance(direct_body.get("model"), str) else None
        price = table.price(model, shape.route)
        incoming = rewriter.parse(request.body, request.path.encode(), conversation)
        epoch, was_cold = None, False
        if config.cold is not None and incoming is not None and incoming.injection is not None:
            state = states.get(model)
            if state is None:
                state = states[model] = _Conversation(config.cold)
            epoch, was_cold = state.step(request.time, incoming)
        older = None if epoch is None or incoming is None else cold.older(epoch, incoming.body, incoming.dialect,
                                                                          config.compact)
        rewrite = None if incoming is None else rewriter.finish(incoming, older=older)
        cg_body = json.loads(rewrite.body) if rewrite is not None else direct_body
        key = (price.key, price.provider)
        if key not in caches:
            fresh = [PromptCache(price.explicit_cache, price.min_cache_tokens, price.cache_ttl) for _ in range(3)]
            caches[key] = (fresh[0], fresh[1], fresh[2])
        direct_cache, cg_cache, raw_cache = caches[key]
        output = Tokens(output=request.output_tokens)
        direct = direct_cache.bill(request.time, segments(direct_body, shape, sizer))
        direct_raw = direct if sizer.scale == 1.0 else raw_cache.bill(request.time, segments(direct_body, shape, raw))
        recorded = request.recorded if fitted else None
        broke = recorded is not None and _client_break(direct, recorded, price.min_cache_tokens)
        shared = recorded is not None and _shared_read(direct, recorded, price.min_cache_tokens)
        direct = _as_recorded(direct, broke, shared, recorded) + output
        direct_raw += output
        cg_segments = segments(cg_body, shape, sizer)
        asked = min((seg.breakpoint for seg in cg_segments if seg.breakpoint is not None), default=None)
        ttl = lifetimes.step(request.time, model, asked)
        if ttl is not None:
            cg_segments = [attrs.evolve(seg, breakpoint=ttl) if seg.breakpoint is not None else seg
                           for seg in cg_segments]
        cg = cg_cache.bill(request.time, cg_segments)
        cg = _as_recorded(cg, broke, shared, recorded) + output
        changes = rewrite.changes if rewrite else []
        new = _first_offloads(changes, seen)
        seen.update(new)
        rounds = expand_rate * len(new)
        prompt = sum(s.tokens for s in cg_segments)
        costs = {i: expand_rate * price.cost(Tokens(input=original, cache_read=prompt)) for i, original in new.items()}
        at: dict[str, tuple[int, int | None]] = {}  # an epoch's offload: where it first is
        for c in changes:
            if older is not None and c.message_index < older.cutoff and c.marker_id in new:
                at.setdefault(c.marker_id, (c.message_index, c.block_index))
        by_epoch = [i for i in new if i in at]
        if forwarded is not None:
            parsed = incoming.body if incoming is not None else ParsedBody.parse(request.body)
            before = previous.get(model, [])
            same = next((k for k, (a, b) in enumerate(zip(before, cg_segments)) if a != b), min(len(before), len(cg_segments)))
            previous[model] = cg_segments
            forwarded.append(Forwarded(request.time, model, price, same, tuple(cg_segments[same:]),
                                       _keepalive_lifetime(request, parsed, ttl), broke, shared, recorded, output))
        turns.append(Turn(request.time, model, price, direct, cg, len(new), rounds, sum(costs.values()),
                          bytes_direct=len(request.body),
                          bytes_cg=len(rewrite.body) if rewrite is not None else len(request.body),
                          cold=was_cold, cold_offloads=len(by_epoch),
                          cold_expand_cost=sum((costs[i] for i in by_epoch), 0.0),
                          cold_results=tuple((*at[i], costs[i]) for i in by_epoch), direct_raw=direct_raw,
                          scale=sizer.scale, client_break=broke, shared_read=shared))
    if keep_warm is None or forwarded is None:
        return turns
    return keep_warm_session([(turns, forwarded)], keep_warm)[0]


def _parsed(requests: Iterable[Sent]) -> Iterator[tuple[Sent, Shape, dict[str, Any]]]:
    """The requests to replay, with their shape and body: those to a path replayed whose body is an object."""
    for request in requests:
        shape = _SHAPES.get(request.path)
        try:
            body = json.loads(request.body)
        except ValueError:
            continue
        if shape is not None and isinstance(body, dict):
            yield request, shape, body


_NOT_KEPT = -1.0  # a request keep-alive ignores (``keepalive.concerns``: not a Messages request with a breakpoint)


def _keepalive_lifetime(request: Sent, body: ParsedBody | None, ttl: float | None) -> float | None:
    """The lifetime keep-alive keeps a request's prefix warm for (``ttl``: the one cg gave its
    breakpoints, None: the client's); None: it ends its conversation's keep-alive; ``_NOT_KEPT``."""
    if not keepalive.concerns(request.path, request.body) or body is None:
        return _NOT_KEPT
    lifetime = keepalive.lifetime(body)
    return lifetime if ttl is None or lifetime is None else ttl


@attrs.frozen
class Forwarded:
    """What keep-alive needs of one replayed request: when, its model (cg keys a session's
    keep-alive by it), the prompt as cg forwarded it (as it differs from the one before it on the
    same model: a session's prompts are never all held), the lifetime keep-alive keeps it warm for
    (``_keepalive_lifetime``), and how its bill was set to the recorded one (``_as_recorded``)."""

    time: float
    model: str | None
    price: Price
    same: int  # leading segments it shares with the conversation's previous prompt to this model
    tail: tuple[Segment, ...]  # the rest
    lifetime: float | None
    broke: bool
    shared: bool
    recorded: Tokens | None
    output: Tokens


def keep_warm_session(conversations: list[tuple[list[Turn], list[Forwarded]]],
                      policy: keepalive.Policy) -> list[list[Turn]]:
    """The turns of one session's conversations (``replay``'s, with what each forwarded) priced via
    cg with keep-alive, as twistd cg keys it: by the session (Claude Code's sub-agents send their
    session's id) and the model, so that a sub-agent on the session's model shares its conversation's
    timer and pings whichever body went last, and one on another model has its own. Each conversation
    keeps a prompt cache of its own, as ``replay`` prices it without keep-alive."""
    warm = _KeepWarm(policy, [[f.time for f in records] for _, records in conversations],
                     [[f.model for f in records] for _, records in conversations])
    kept: dict[tuple[int, int], Tokens] = {}
    events = sorted((f.time, c, i) for c, (_, records) in enumerate(conversations) for i, f in enumerate(records))
    for when, c, i in events:
        warm.until(when)
        kept[c, i] = warm.request(c, i, conversations[c][1][i])
    warm.until(math.inf)  # after the last request, pings go on to the idle bound or the budget
    return [[attrs.evolve(turn, keepalive=kept[c, i], pings=len(warm.pings.get((c, i), ())),
                          ping_tokens=sum(warm.pings.get((c, i), ()), Tokens()))
             for i, turn in enumerate(turns)] for c, (turns, _) in enumerate(conversations)]


@attrs.define
class Hindsight:
    """The best any ping rule could do: it knows when each idle period ends (``gap``, set by
    ``keep_warm_session``) and pings only through one it bridges for less than the write it spares,
    never after a session's last request. A bound, not a rule cg can run."""

    gap: float = math.inf  # seconds from the last real request to the next one of its key

    def pays(self, ages: list[float], step: float, lifetime: float, prefix_tokens: int | None,
             seen: tuple[float, ...]) -> bool:
        if not ages or self.gap <= ages[0]:
            return False  # the next request comes before this ping: it would bridge nothing
        needed = sum(1 for age in ages if age < self.gap)
        if ages[needed - 1] + lifetime < self.gap:
            return False  # the bounds end the pings before the return
        price = READ_PRICE + (OUTPUT_PRICE / prefix_tokens if prefix_tokens else 0.0)
        return needed * price < WRITE_PRICE[lifetime] - READ_PRICE


# A turn of the replay: its conversation and index; what a keep-alive ping follows.
_Last = tuple[int, int]
# What the scheduler keeps of a key's last request: that turn, and what it forwarded (a ping re-sends it).
_Payload = tuple[int, int, Forwarded]


class _KeepWarm:
    """cg's keep-alive over one session's timestamps: the scheduler cg runs (cg.exchange.keepalive),
    its pings billed on prompt caches of their own, where the session's requests are billed too."""

    def __init__(self, policy: keepalive.Policy, times: list[list[float]], models: list[list[str | None]]):
        self.scheduler: keepalive.Scheduler[_Payload] = keepalive.Scheduler(policy)
        self.hindsight = policy.forecast if isinstance(policy.forecast, Hindsight) else None
        # Each key's request times, for the hindsight bound: when an idle period ends.
        self.times: dict[keepalive.Key, list[float]] = {}
        for conv_times, conv_models in zip(times, models):
            for when, model in zip(conv_times, conv_models):
                self.times.setdefault(model, []).append(when)
        for key_times in self.times.values():
            key_times.sort()
        self.caches: dict[tuple[int, str, str], PromptCache] = {}
        self.armed: dict[keepalive.Key, float] = {}
        self.last: dict[keepalive.Key, float] = {}  # each key's last real request
        self.prompts: dict[tuple[int, str | None], list[Segment]] = {}  # each conversation's last, per model
        self.pings: dict[_Last, list[Tokens]] = {}  # by the turn they follow

    def _cache(self, conversation: int, price: Price) -> PromptCache:
        key = (conversation, price.key, price.provider)
        if key not in self.caches:
            self.caches[key] = PromptCache(price.explicit_cache, price.min_cache_tokens, price.cache_ttl)
        return self.caches[key]

    def _foresee(self, key: keepalive.Key) -> None:
        """Tell the hindsight bound when ``key``'s idle period ends."""
        if self.hindsight is not None:
            times, last = self.times.get(key, []), self.last[key]
            later = bisect.bisect_right(times, last)
            self.hindsight.gap = times[later] - last if later < len(times) else math.inf

    def until(self, now: float) -> None:
        """Send every ping due before ``now``, in time order."""
        while self.armed:
            key, at = min(self.armed.items(), key=lambda armed: armed[1])
            if at >= now:
                return
            del self.armed[key]
            self._do(self.scheduler.due(key, at), at)

    def request(self, conversation: int, index: int, forwarded: Forwarded) -> Tokens:
        """A real request, billed on the kept-warm cache (as ``replay`` bills it without keep-alive);
        it moves its key's pings as in cg."""
        prompt = self.prompts.get((conversation, forwarded.model), [])[:forwarded.same] + list(forwarded.tail)
        self.prompts[conversation, forwarded.model] = prompt
        billed = self._cache(conversation, forwarded.price).bill(forwarded.time, prompt)
        if forwarded.lifetime != _NOT_KEPT:
            key = forwarded.model
            self.last[key] = forwarded.time
            generation, commands = self.scheduler.sent(key, forwarded.time, forwarded.lifetime,
                                                          (conversation, index, forwarded))
            self._do(commands, forwarded.time)
            if generation is not None:
                self._foresee(key)
                self._do(self.scheduler.answered(key, generation, True), forwarded.time)
        return _as_recorded(billed, forwarded.broke, forwarded.shared, forwarded.recorded) + forwarded.output

    def _do(self, commands: list[keepalive.Command[_Payload]], now: float) -> None:
        for command in commands:
            if isinstance(command, keepalive.Arm):
                self.armed[command.key] = command.at
            elif isinstance(command, (keepalive.Disarm, keepalive.End)):
                self.armed.pop(command.key, None)
            elif isinstance(command, keepalive.Ping):
                conversation, index, forwarded = command.payload  # the key's last: a ping re-sends it
                prompt = self.prompts[conversation, forwarded.model]
                billed = self._cache(conversation, forwarded.price).bill(now, prompt) + Tokens(output=1)
                self.pings.setdefault((conversation, index), []).append(billed)
                self._foresee(command.key)
                self._do(self.scheduler.pinged(command.key, command.generation, True, billed.cache_read), now)
