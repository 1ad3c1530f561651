"""Cache keep-alive, pure: which conversations cg keeps warm in the provider's prompt cache, and when
it pings them.

A conversation whose provider cache expires between two turns pays for its whole prefix again as a
cache write (1.25x the input price for the 5-minute lifetime, 2x for 1 hour) where a read would
have cost 0.1x. A ping (the conversation's last forwarded body with ``max_tokens`` 1: see
cg.wire.cache.ping_body) sent before the lifetime ends reads the prefix, which refreshes it, so
the next real turn reads too.

``Scheduler`` holds one state per conversation and is fed events (a real request sent, its answer,
a ping's timer fired, a ping's answer, its client gone) with the time; it answers with commands (arm a conversation's
timer at a time, disarm it, send a ping, end the conversation's keep-alive). It keeps no time and
touches no socket: cg.web.keepalive runs it on a reactor, cg.record.replay on a transcript's
timestamps, so cg-estimate prices exactly what cg would send.

The rules:

- Only Anthropic Messages requests (``/v1/messages``) that carry a ``cache_control`` breakpoint
  (``concerns``; others are ignored), and not those with extended thinking on a budget, which end
  their conversation's keep-alive (``lifetime``). OpenAI caches automatically, with no write premium
  and no promised lifetime: a ping there buys nothing certain.
- A ping is due ``margin`` seconds before the lifetime ends, counted from when the last request
  (real or ping) was *sent*: the provider refreshes the entry when it reads it, no earlier.
- A real request disarms the conversation's timer; its answer (2xx) arms it again and starts a new
  idle period with a fresh budget. A failed real request ends the keep-alive (its prefix may not be
  cached at all).
- No ping is sent ``max_idle`` seconds or more after the last real request, nor more than
  ``budget`` pings in one idle period.
- A ping that fails (any non-2xx, 429 included, or no answer) ends the keep-alive; so does one
  that read nothing from the cache (the prefix was not cached: under the model's minimum, or not
  the bytes cg thought), since every later ping would miss too. Nothing is ever retried.
- At most ``max_conversations`` are kept; a new one evicts the one whose last real request is
  oldest.
- Within those bounds, a ping is armed only when it pays (``Forecast``): its price (a cache read
  of the prefix and an output token) against what it is expected to spare (the prefix's re-write
  above a read, if the next request comes before the ping after it), weighed by how likely the
  idle period is to end in that window, from the gaps of real sessions (``PRIOR``) and the gaps cg
  has seen in this conversation, counting what later pings would add (optimal stopping over the
  remaining pings). Where no ping pays, the keep-alive ends ("forecast").
- A conversation whose client is gone (``gone``: the client itself closed every connection its
  requests came on, as cg.web.keepalive sees it) ends at once: its pings would be paid for nobody.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, Protocol, TypeVar

import attrs

from cg.wire.body import ParsedBody
from cg.wire.cache import OUTPUT_PRICE, READ_PRICE, TTL_5M, WRITE_PRICE, cache_lifetime

MESSAGES_PATH = "/v1/messages"
MARGIN = 30.0  # seconds before the cache's lifetime ends that a ping goes out
DEFAULT_MAX_IDLE = 1800.0
DEFAULT_BUDGET = 10
DEFAULT_MAX_CONVERSATIONS = 256

# The command-line options twistd cg and cg-estimate share: (name, default, help).
KEEPALIVE_HELP = (
    "Keep each conversation's Anthropic prompt cache warm: before it would expire (5 minutes, or 1 hour "
    "where the request asks for it), send the provider the conversation's last request with max_tokens 1, "
    "so that the next turn reads the cache (0.1x the input price) instead of writing it again (1.25x, 2x)."
)
MAX_IDLE = (
    "keepalive-max-idle",
    DEFAULT_MAX_IDLE,
    "Seconds after a conversation's last real request past which no keep-alive ping is sent.",
)
BUDGET = (
    "keepalive-budget",
    DEFAULT_BUDGET,
    "Most keep-alive pings per conversation between two real requests.",
)
MAX_CONVERSATIONS = (
    "keepalive-max-conversations",
    DEFAULT_MAX_CONVERSATIONS,
    "Most conversations kept warm at once (each holds its last request body in memory); a new one "
    "evicts the longest idle.",
)

Key = Hashable
P = TypeVar("P")


@attrs.frozen
class Band:
    """Idle periods that end between ``low`` and ``high`` seconds, log-uniform, ``weight`` of them."""

    weight: float
    low: float
    high: float

    def left(self, age: float) -> float:
        """How many of them are still idle at ``age``."""
        if age <= self.low:
            return self.weight
        if age >= self.high:
            return 0.0
        return self.weight * math.log(self.high / age) / math.log(self.high / self.low)


# Fitted (bench/realkeepalive.py, 2026-12-06) to the idle periods of 191 public Claude Code sessions
# and their 273 sub-agent conversations (four backups, Claude Code 1.0.80-2.1.150), keyed as cg keys
# them (a session and a model: 272 keys): of the idle periods past the first ping (4.5 min), how
# many ended in each band, a ping step apart to 31.5 min, then wider; the ends are the 272 keys'
# last requests and 2 gaps over a day. Log-uniform within a band. Out of sample (fitted on three
# backups, priced by cg-estimate's replay on the fourth) it netted more than issue 25's 70-session
# prior (118 idle periods ending in 5-30 min, 33 later, 70 ends) on each of the four: +0.63% of the
# via-cg bill in all against -0.52%, with 405 pings instead of 851; and on a fifth backup's gaps
# alone (docs/performance.md, "Keep-alive on real sessions, keyed as cg keys it").
PRIOR = (Band(179.0, 270.0, 540.0), Band(65.0, 540.0, 810.0), Band(31.0, 810.0, 1080.0),
         Band(20.0, 1080.0, 1350.0), Band(15.0, 1350.0, 1620.0), Band(10.0, 1620.0, 1890.0),
         Band(22.0, 1890.0, 3600.0), Band(47.0, 3600.0, 14_400.0), Band(20.0, 14_400.0, 86_400.0))
PRIOR_ENDS = 274.0
PRIOR_WEIGHT = 4.0  # the prior counts as this many idle periods against a conversation's own
SEEN_GAPS = 32  # a conversation's long gaps kept, the latest (its habits of the day, bounded memory)


@attrs.frozen
class Forecast:
    """Whether a ping pays: the gaps expected of a conversation (``PRIOR``, ``PRIOR_ENDS``, worth
    ``prior_weight`` idle periods) and, with ``learn``, the long gaps cg has seen in it."""

    prior: tuple[Band, ...] = PRIOR
    prior_ends: float = PRIOR_ENDS
    prior_weight: float = PRIOR_WEIGHT
    learn: bool = True

    def idle_at(self, age: float, seen: tuple[float, ...]) -> float:
        """The weight of idle periods still idle at ``age`` (seconds since the last request)."""
        scale = self.prior_weight / (self.prior_ends + sum(band.weight for band in self.prior))
        prior = self.prior_ends + sum(band.left(age) for band in self.prior)
        return scale * prior + sum(1.0 for gap in seen if gap > age)

    def pays(self, ages: list[float], step: float, lifetime: float, prefix_tokens: int | None,
             seen: tuple[float, ...]) -> bool:
        """Whether pinging at ``ages[0]`` (then, while it pays, at each later one, ``step`` apart:
        each ping bridges a return before the next) is worth more than it costs. Optimal stopping,
        valued from the last ping back; prices per prefix token, in input prices."""
        spared = WRITE_PRICE[lifetime] - READ_PRICE  # a break bridged: a read instead of a write
        price = READ_PRICE + (OUTPUT_PRICE / prefix_tokens if prefix_tokens else 0.0)
        seen = seen if self.learn else ()
        value = 0.0  # of going on pinging after the ping considered
        for k in range(len(ages) - 1, -1, -1):
            idle = self.idle_at(ages[k], seen)
            back = (idle - self.idle_at(ages[k] + step, seen)) / idle if idle > 0 else 0.0
            worth = back * spared - price + (1.0 - back) * value
            if k == 0:
                return worth > 0
            value = max(0.0, worth)
        return False


class Rule(Protocol):
    """What decides whether a ping pays (``Forecast``; cg.record.replay's ``Hindsight`` bounds it)."""

    def pays(self, ages: list[float], step: float, lifetime: float, prefix_tokens: int | None,
             seen: tuple[float, ...]) -> bool: ...


@attrs.frozen
class Policy:
    """The bounds on what keep-alive spends (see the module docstring), and the rule within them
    (``forecast``; None: ping until a bound ends it)."""

    max_idle: float = DEFAULT_MAX_IDLE
    budget: int = DEFAULT_BUDGET
    max_conversations: int = DEFAULT_MAX_CONVERSATIONS
    margin: float = MARGIN
    forecast: Rule | None = Forecast()


def check_policy(max_idle: float, budget: int, max_conversations: int = 1) -> None:
    """ValueError, with the one line to show, for bounds that make keep-alive meaningless."""
    first = TTL_5M - MARGIN
    if not max_idle > first:
        raise ValueError(f"--keepalive-max-idle must be more than {first:g} seconds (when the first ping "
                         "goes out), or keep-alive never pings")
    if budget < 1:
        raise ValueError("--keepalive-budget must be 1 or more")
    if max_conversations < 1:
        raise ValueError("--keepalive-max-conversations must be 1 or more")


def concerns(path: str, raw: bytes) -> bool:
    """Whether a request touches keep-alive at all: a Messages request (not count_tokens) with a
    ``cache_control`` key (found by its bytes: an escaped one in a string does not match).

    One that does not is ignored: it neither caches a prefix nor moves a conversation's pings.
    """
    return path == MESSAGES_PATH and b'"cache_control"' in raw


def lifetime(body: ParsedBody) -> float | None:
    """How long the cache a Messages request writes lives, when cg may keep it warm; None when not.

    Not: no ``max_tokens`` to lower, no breakpoint, or extended thinking with a budget. That last
    one cannot be pinged cheaply: changing ``thinking`` invalidates the cached messages, and
    ``max_tokens`` must exceed the budget, so a ping could be billed thousands of thinking tokens.
    (Adaptive thinking, Claude Code's, has no budget: its pings go with ``max_tokens`` 1.)
    """
    ttl = cache_lifetime(body)  # first: its answers are carried to the next turn (cg.wire.cache)
    max_tokens = body.value.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
        return None
    thinking = body.value.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "enabled":
        return None
    return ttl


# ---------------------------------------------------------------------------------------------
# Commands


@attrs.frozen
class Arm:
    """Fire the conversation's timer (``Scheduler.due``) at ``at``, replacing any armed before."""

    key: Key
    at: float


@attrs.frozen
class Disarm:
    """Cancel the conversation's timer: a real request is on its way."""

    key: Key


@attrs.frozen
class Ping(Generic[P]):
    """Send the ping now; answer with ``Scheduler.pinged(key, generation, ...)``."""

    key: Key
    payload: P
    generation: int
    number: int  # in this idle period, from 1


@attrs.frozen
class End:
    """The conversation's keep-alive ends: cancel its timer, forget its payload."""

    key: Key
    why: str  # idle, budget, forecast, failed, missed, refused, ineligible, evicted, stopped, gone


Command = Arm | Disarm | Ping[P] | End


@attrs.define
class _Conversation(Generic[P]):
    payload: P
    lifetime: float
    last_request: float  # when the last real request was sent
    sent: float  # when the last request, real or ping, was sent
    generation: int  # of that request: answers to older ones are stale
    pings: int = 0  # sent in this idle period
    waiting: bool = True  # that request is not answered yet
    prefix_tokens: int | None = None  # the prefix the last ping read: None before the first


class Scheduler(Generic[P]):
    """Keep-alive state per conversation: events in (with the time), commands out."""

    def __init__(self, policy: Policy | None = None):
        self.policy = policy or Policy()
        self._conversations: OrderedDict[Key, _Conversation[P]] = OrderedDict()
        self._generations = itertools.count(1)
        # Per conversation, kept past its keep-alive's end: when its last real request was sent,
        # and its idle periods that outlasted the first ping (what ``Forecast`` learns from).
        self._history: OrderedDict[Key, tuple[float, tuple[float, ...]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._conversations)

    def __contains__(self, key: Key) -> bool:
        return key in self._conversations

    def sent(self, key: Key, now: float, lifetime: float | None,
             payload: P) -> tuple[int | None, list[Command[P]]]:
        """A real request for ``key`` went upstream (``lifetime``: see ``lifetime``; None: it cannot
        be kept warm). Returns its generation, for ``answered``, and the commands."""
        self._remember(key, now, lifetime)
        conversation = self._conversations.get(key)
        if lifetime is None:
            return None, [] if conversation is None else self._end(key, "ineligible")
        generation = next(self._generations)
        commands: list[Command[P]] = []
        if conversation is None:
            if len(self._conversations) >= self.policy.max_conversations:
                oldest = next(iter(self._conversations))
                commands += self._end(oldest, "evicted")
            self._conversations[key] = _Conversation(payload, lifetime, now, now, generation)
        else:
            commands.append(Disarm(key))
            conversation.payload, conversation.lifetime = payload, lifetime
            conversation.last_request = conversation.sent = now
            conversation.generation, conversation.pings, conversation.waiting = generation, 0, True
            self._conversations.move_to_end(key)
        return generation, commands

    def answered(self, key: Key, generation: int, ok: bool) -> list[Command[P]]:
        """The real request of that generation was answered: 2xx (``ok``) or not."""
        conversation = self._current(key, generation)
        if conversation is None:
            return []
        conversation.waiting = False
        return self._next(key, conversation) if ok else self._end(key, "refused")

    def due(self, key: Key, now: float) -> list[Command[P]]:
        """The conversation's timer fired."""
        conversation = self._conversations.get(key)
        if conversation is None or conversation.waiting:
            return []
        if now >= conversation.last_request + self.policy.max_idle:
            return self._end(key, "idle")
        if conversation.pings >= self.policy.budget:
            return self._end(key, "budget")
        conversation.pings += 1
        conversation.sent = now
        conversation.generation = next(self._generations)
        conversation.waiting = True
        return [Ping(key, conversation.payload, conversation.generation, conversation.pings)]

    def pinged(self, key: Key, generation: int, ok: bool, cache_read: int) -> list[Command[P]]:
        """The ping of that generation was answered: 2xx (``ok``), having read ``cache_read`` tokens."""
        conversation = self._current(key, generation)
        if conversation is None:
            return []  # a real request went meanwhile: it decides
        conversation.waiting = False
        if not ok:
            return self._end(key, "failed")
        if cache_read <= 0:
            return self._end(key, "missed")
        conversation.prefix_tokens = cache_read  # what the next ping will cost, for the forecast
        return self._next(key, conversation)

    def gone(self, key: Key) -> list[Command[P]]:
        """The client of ``key`` is gone (its ping in flight, if any, is answered for nobody)."""
        return self._end(key, "gone") if key in self._conversations else []

    def stop(self) -> list[Command[P]]:
        """End every conversation's keep-alive (cg is stopping)."""
        return [command for key in list(self._conversations) for command in self._end(key, "stopped")]

    def _remember(self, key: Key, now: float, lifetime: float | None) -> None:
        """Note when ``key``'s real request was sent, and the idle period it ends if that one
        outlasted the first ping."""
        last, gaps = self._history.pop(key, (now, ()))
        if lifetime is not None and now - last > lifetime - self.policy.margin:
            gaps = (*gaps, now - last)[-SEEN_GAPS:]
        self._history[key] = (now, gaps)
        if len(self._history) > self.policy.max_conversations:
            self._history.popitem(last=False)

    def _current(self, key: Key, generation: int) -> _Conversation[P] | None:
        conversation = self._conversations.get(key)
        return conversation if conversation is not None and conversation.generation == generation else None

    def _next(self, key: Key, conversation: _Conversation[P]) -> list[Command[P]]:
        """Arm the next ping, unless it would come at or past the idle bound, or over budget."""
        at = conversation.sent + conversation.lifetime - self.policy.margin
        if at >= conversation.last_request + self.policy.max_idle:
            return self._end(key, "idle")
        if conversation.pings >= self.policy.budget:
            return self._end(key, "budget")
        if not self._pays(key, conversation, at):
            return self._end(key, "forecast")
        return [Arm(key, at)]

    def _pays(self, key: Key, conversation: _Conversation[P], at: float) -> bool:
        """Whether the ping at ``at`` pays (``Forecast``), counting the later ones the bounds allow."""
        forecast = self.policy.forecast
        lifetime = conversation.lifetime
        if forecast is None or lifetime not in WRITE_PRICE:
            return True
        step = lifetime - self.policy.margin
        ages = [at - conversation.last_request + k * step
                for k in range(self.policy.budget - conversation.pings)]
        ages = [age for age in ages if age < self.policy.max_idle]
        _, seen = self._history.get(key, (conversation.last_request, ()))
        return forecast.pays(ages, step, lifetime, conversation.prefix_tokens, seen)

    def _end(self, key: Key, why: str) -> list[Command[P]]:
        del self._conversations[key]
        return [End(key, why)]
