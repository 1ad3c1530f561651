"""``--keepalive``: runs cg.exchange.keepalive's Scheduler on the reactor's time, and sends its pings
through cg's own upstream pool.

The exchange driver tells it when a conversation's request went upstream (the body as forwarded,
the headers as sent) and how it was answered. A ping re-sends that body with ``max_tokens`` 1 and
``stream`` false (cg.wire.cache.ping_body) and the same headers (the client's credentials among
them), asking for an identity-encoded answer whose usage it reads. Bodies and headers are held in
memory only, never logged nor stored, and dropped when the conversation's keep-alive ends.

A conversation whose client is gone is not pinged again: the connections a conversation's requests
came on are watched (`Connection.when_closed`), and once the client itself has closed the last of
them cleanly, the scheduler hears ``gone``. What that rests on (docs/how-to/keep-the-cache-warm.md,
measured with Claude Code 2.1.197): a running Claude Code keeps its connections open between turns,
and resets (not closes) those idle for 5 minutes; one that exits, is killed or crashes closes every
connection at once, cleanly. A suspended one (a laptop asleep) closes nothing, and stays pinged.
With ``--keepalive`` cg keeps an idle client connection open for `IDLE_TIMEOUT` instead of
twisted.web's 60 s, so that it is still there to be closed when the first ping is due.
"""

from __future__ import annotations

import functools
import typing
from collections.abc import Callable

import attrs
import ujson
from twisted.internet import defer
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.protocol import Protocol, connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers

from cg.exchange.keepalive import MARGIN, Arm, Command, Disarm, End, Key, Ping, Policy, Scheduler
from cg.record.stats import KeepaliveStats
from cg.stream.usage import Usage, anthropic_usage
from cg.web.upstream import IUpstream, IUpstreamResponse
from cg.wire.cache import TTL_5M, ping_body

log = Logger(namespace="cg.web.keepalive")

_MAX_ANSWER = 1 << 20  # bytes of a ping's answer kept: a max_tokens 1 message is a few hundred
_QUIET = ("idle", "budget", "forecast", "ineligible", "evicted", "stopped", "gone")  # endings that are no news
# How long cg keeps a client connection that waits for its next request, with --keepalive: past the
# first ping (a 5-minute lifetime less the margin, from the last request), so that a client that
# exits before it is due is seen to close its connections (twisted.web's default, 60 s, would have
# closed them first).
IDLE_TIMEOUT = TTL_5M + MARGIN


class Connection(typing.Protocol):
    """A client connection, as cg.web.site.HeadTimedChannel reports its end."""

    def when_closed(self, watcher: Callable[[bool], object]) -> None: ...


@attrs.frozen
class Last:
    """A conversation's last forwarded request: what its pings re-send."""

    body: bytes
    target: bytes  # the request-target as the client sent it
    headers: Headers = attrs.field(repr=False)  # as sent upstream: the client's credentials
    # Called with its bill when a ping was answered (the prompt cache lives on): the cache-aware policy
    # records it (cg.web.forwarder.Forwarder.pinged), else the next real request would look cold while
    # it is warm; /stats prices it.
    refreshed: Callable[[Usage], object] | None = attrs.field(default=None, repr=False, eq=False)


class KeepAlive:
    """The conversations cg keeps warm, their timers, and their pings in flight."""

    def __init__(self, upstream: IUpstream, clock: IReactorTime, base: tuple[bytes, bytes], policy: Policy,
                 stats: KeepaliveStats):
        self.upstream = upstream
        self.clock = clock
        self.base = base  # the Anthropic upstream's (origin, base path): `split_base`
        self.policy = policy
        self.stats = stats
        self.scheduler: Scheduler[Last] = Scheduler(policy)
        self._timers: dict[Key, IDelayedCall] = {}
        # The open connections each conversation's requests came on, and the other way round: each
        # watched once, for its life, and neither holding a conversation the scheduler ended.
        self._connections: dict[Key, set[Connection]] = {}
        self._conversations: dict[Connection, set[Key]] = {}
        self._pinging: set[defer.Deferred[None]] = set()
        self._stopped = False
        stats.enabled = True

    def sent(self, key: Key, lifetime: float | None, body: bytes, target: bytes, headers: Headers,
             refreshed: Callable[[Usage], object] | None = None,
             connection: Connection | None = None) -> int | None:
        """A real request of conversation ``key`` went upstream; returns its generation for ``answered``
        (None: this conversation is not kept warm). ``refreshed``: called with each answered ping's bill;
        ``connection``: the client's it came on (None: gone already), watched for the client's leaving."""
        if self._stopped:
            return None
        last = Last(body, target, headers, refreshed)
        generation, commands = self.scheduler.sent(key, self.clock.seconds(), lifetime, last)
        self._do(commands)
        if generation is not None and connection is not None:
            self._watch(key, connection)
        return generation

    def answered(self, key: Key, generation: int, status: int | None) -> None:
        """That request's response ended; ``status``: what the client got (None: no response head)."""
        self._do(self.scheduler.answered(key, generation, status is not None and 200 <= status < 300))

    def stop(self) -> None:
        """End every keep-alive: timers cancelled, pings in flight abandoned, bodies and headers dropped."""
        self._stopped = True
        self._do(self.scheduler.stop())
        for pinging in list(self._pinging):
            pinging.cancel()

    def _watch(self, key: Key, connection: Connection) -> None:
        self._connections.setdefault(key, set()).add(connection)
        keys = self._conversations.get(connection)
        if keys is None:
            keys = self._conversations[connection] = set()
            connection.when_closed(functools.partial(self._closed, connection))
        keys.add(key)

    def _closed(self, connection: Connection, by_client: bool) -> None:
        """A connection requests came on is gone; for each conversation it was the last open one
        of, closed by the client itself, the keep-alive ends."""
        for key in self._conversations.pop(connection, ()):
            connections = self._connections[key]
            connections.discard(connection)
            if connections:
                continue
            del self._connections[key]
            if by_client:
                self._do(self.scheduler.gone(key))

    def _forget(self, key: Key) -> None:
        """A conversation the scheduler ended: its connections no longer watched for it."""
        for connection in self._connections.pop(key, ()):
            keys = self._conversations.get(connection)
            if keys is not None:
                keys.discard(key)

    def _do(self, commands: list[Command[Last]]) -> None:
        for command in commands:
            if isinstance(command, Arm):
                self._disarm(command.key)
                delay = max(0.0, command.at - self.clock.seconds())
                self._timers[command.key] = self.clock.callLater(delay, self._due, command.key)
            elif isinstance(command, Disarm):
                self._disarm(command.key)
            elif isinstance(command, Ping):
                self._ping(command)
            elif isinstance(command, End):
                self._disarm(command.key)
                self._forget(command.key)
                self.stats.ended[command.why] += 1
                if command.why not in _QUIET:
                    log.info("keep-alive of a conversation ended: {why}", why=command.why)
        self.stats.conversations = len(self.scheduler)

    def _disarm(self, key: Key) -> None:
        timer = self._timers.pop(key, None)
        if timer is not None and timer.active():
            timer.cancel()

    def _due(self, key: Key) -> None:
        self._timers.pop(key, None)
        self._do(self.scheduler.due(key, self.clock.seconds()))

    def _ping(self, ping: Ping[Last]) -> None:
        last = ping.payload
        body = ping_body(last.body)
        if body is None:  # lifetime() saw a max_tokens: only a bug gets here
            self._do(self.scheduler.pinged(ping.key, ping.generation, False, 0))
            return
        headers = last.headers.copy()
        headers.setRawHeaders(b"accept-encoding", [b"identity"])  # the answer's usage is read here
        origin, base_path = self.base
        self.stats.pings += 1
        pinging = self.upstream.request(b"POST", origin, base_path + last.target, headers, body)
        self._pinging.add(pinging)
        pinging.addCallback(_read)
        pinging.addCallbacks(self._answered, self._failed, callbackArgs=(ping,), errbackArgs=(ping,))
        pinging.addErrback(lambda failure: log.failure("a keep-alive ping failed", failure))
        pinging.addBoth(lambda _: self._pinging.discard(pinging))

    def _answered(self, answer: tuple[int, bytes], ping: Ping[Last]) -> None:
        code, body = answer
        ok = 200 <= code < 300
        usage = _usage(body) if ok else Usage()
        self.stats.usage += usage
        if ok and ping.payload.refreshed is not None:
            ping.payload.refreshed(usage)
        if ok:
            log.info("keep-alive ping {n}/{budget} {code}: cache_read={read} cache_write={write} input={input}",
                     n=ping.number, budget=self.policy.budget, code=code, read=usage.cache_read_tokens,
                     write=usage.cache_write_tokens, input=usage.input_tokens)
        else:
            self.stats.pings_failed += 1
            log.info("keep-alive ping answered {code}: {why}", code=code, why=_error_message(body))
        self._do(self.scheduler.pinged(ping.key, ping.generation, ok, usage.cache_read_tokens))

    def _failed(self, failure: Failure, ping: Ping[Last]) -> None:
        if isinstance(failure.value, defer.CancelledError) and ping.key not in self.scheduler:
            return  # stopped
        self.stats.pings_failed += 1
        log.info("keep-alive ping failed: {why}", why=failure.getErrorMessage() or failure.type.__name__)
        self._do(self.scheduler.pinged(ping.key, ping.generation, False, 0))


def _read(response: IUpstreamResponse) -> defer.Deferred[tuple[int, bytes]]:
    """The response's status and (the first MiB of) its body, once the body is complete."""
    collect = _Collect()
    response.deliverBody(collect)
    return collect.done.addCallback(lambda body: (response.code, body))


class _Collect(Protocol):
    """Reads a small body whole (past ``_MAX_ANSWER`` bytes it keeps reading, but not keeping)."""

    def __init__(self) -> None:
        self.done: defer.Deferred[bytes] = defer.Deferred()
        self._parts: list[bytes] = []
        self._size = 0

    def dataReceived(self, data: bytes) -> None:
        if self._size < _MAX_ANSWER:
            self._parts.append(data)
            self._size += len(data)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        if isinstance(reason.value, (ResponseDone, PotentialDataLoss)):
            self.done.callback(b"".join(self._parts))
        else:
            self.done.errback(reason)


def _usage(body: bytes) -> Usage:
    try:
        return anthropic_usage(ujson.loads(body))
    except ValueError:
        return Usage()


def _error_message(body: bytes) -> str:
    """The provider's error message, short (never a header, never the request)."""
    try:
        error = ujson.loads(body).get("error", {})
        return str(error.get("message") or error.get("type"))[:200]
    except (ValueError, AttributeError):
        return "(no error message)"
