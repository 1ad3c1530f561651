"""--keepalive's timers on a Clock: cg.web.keepalive.KeepAlive over a MemoryUpstream (the test plays the
provider), then through cg's resource and site as a client's request arms it. Time moves only by
``clock.advance``; nothing sleeps."""

import json

import pytest
from helpers.clients import PEER, Client
from rawhttp import http_request
from twisted.internet.error import ConnectionDone, ConnectionLost, ConnectionRefusedError
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock
from twisted.python.failure import Failure
from twisted.web.http_headers import Headers

from cg.compaction.rewrite import Rewriter
from cg.exchange.keepalive import Policy
from cg.record.stats import Stats
from cg.store.memory import MemoryStore
from cg.testing import MemoryUpstream, anthropic_message, claude_code_bytes
from cg.web.config import Config
from cg.web.forwarder import Forwarder
from cg.web.keepalive import IDLE_TIMEOUT, KeepAlive
from cg.web.proxy import ProxyResource
from cg.web.service import CGService, rewrite_config
from cg.web.site import ProxySite
from cg.web.tap import Options
from cg.web.tenant import parse_tenant
from cg.web.upstream import split_base
from cg.wire.cache import TTL_1H, TTL_5M, ping_body

BODY = claude_code_bytes({"model": "claude-opus-4-8", "messages": [{"role": "user", "content": [
    {"type": "text", "text": "my private prompt", "cache_control": {"type": "ephemeral"}}]}], "max_tokens": 64000, "stream": True})
KEY = ("", b"session-1", "claude-opus-4-8")
FIRST = TTL_5M - 30.0  # the first ping, after the last request's send


def headers() -> Headers:
    return Headers({b"x-api-key": [b"sk-test"], b"anthropic-version": [b"2023-06-01"],
                    b"anthropic-beta": [b"prompt-caching-scope-2026-01-05"], b"accept-encoding": [b"gzip"]})


def usage_reply(read: int = 5000) -> bytes:
    return json.dumps(anthropic_message("", usage={"input_tokens": 2, "cache_read_input_tokens": read,
                                                   "cache_creation_input_tokens": 0, "output_tokens": 1})).encode()


def answer(request, code: int = 200, body: bytes | None = None) -> None:
    response = request.respond(code, [("content-type", "application/json")])
    response.write(usage_reply() if body is None else body)
    response.finish()


class Warm:
    """A KeepAlive on a Clock, its pings going to a MemoryUpstream."""

    def __init__(self, **policy):
        self.clock = Clock()
        self.upstream = MemoryUpstream(self.clock)
        self.stats = Stats()
        self.keepalive = KeepAlive(self.upstream, self.clock, split_base("https://anthropic.test/base"),
                                   Policy(**policy), self.stats.keepalive)

    def request(self, status: int | None = 200, ttl: float | None = TTL_5M, body: bytes = BODY) -> None:
        """A real request of the conversation, sent now and answered at once."""
        generation = self.keepalive.sent(KEY, ttl, body, b"/v1/messages?beta=true", headers())
        if generation is not None:
            self.keepalive.answered(KEY, generation, status)

    def pings_until(self, seconds: float, code: int = 200) -> list[float]:
        """Answer every ping as it comes, for ``seconds``; the times they came."""
        times = []
        end = self.clock.seconds() + seconds
        while self.clock.getDelayedCalls():
            due = min(call.getTime() for call in self.clock.getDelayedCalls())
            if due > end:
                break
            self.clock.advance(due - self.clock.seconds())
            for request in self.upstream.requests[len(times):]:
                times.append(self.clock.seconds())
                answer(request, code)
        return times


def test_a_ping_goes_at_the_right_time_with_the_forwarded_body_and_the_clients_headers():
    warm = Warm()
    warm.request()
    warm.clock.advance(FIRST - 0.01)
    assert warm.upstream.requests == []
    warm.clock.advance(0.01)
    (ping,) = warm.upstream.requests
    assert ping.method == b"POST" and ping.origin == b"https://anthropic.test" and ping.path == b"/base/v1/messages?beta=true"
    assert ping.body == ping_body(BODY) and b'"max_tokens":1,"stream":false}' in ping.body
    assert ping.headers.getRawHeaders(b"x-api-key") == [b"sk-test"]
    assert ping.headers.getRawHeaders(b"anthropic-beta") == [b"prompt-caching-scope-2026-01-05"]
    assert ping.headers.getRawHeaders(b"accept-encoding") == [b"identity"]  # its usage is read here
    answer(ping)
    snapshot = warm.stats.snapshot()["keepalive"]
    assert snapshot["pings"] == 1 and snapshot["pings_failed"] == 0 and snapshot["conversations"] == 1
    assert snapshot["usage"] == {"input_tokens": 2, "cache_read_tokens": 5000, "cache_write_tokens": 0, "output_tokens": 1,
                                 "cache_write_1h_tokens": 0}
    (timer,) = warm.clock.getDelayedCalls()
    assert timer.getTime() == 2 * FIRST  # counted from the ping's send


def test_a_real_request_cancels_the_ping_and_reschedules_it():
    warm = Warm()
    warm.request()
    warm.clock.advance(200.0)
    warm.request()  # the client came back before the ping
    warm.clock.advance(FIRST - 1)
    assert warm.upstream.requests == []
    warm.clock.advance(200.0 + FIRST - warm.clock.seconds())
    assert len(warm.upstream.requests) == 1 and len(warm.clock.getDelayedCalls()) == 0  # one timer: the ping's


def test_never_a_ping_after_the_idle_bound():
    warm = Warm(max_idle=1800.0, forecast=None)
    warm.request()
    times = warm.pings_until(7200.0)
    assert times == [FIRST * k for k in range(1, 7)] and times[-1] < 1800.0
    assert warm.clock.getDelayedCalls() == []
    assert warm.stats.keepalive.ended == {"idle": 1} and warm.stats.keepalive.conversations == 0
    assert warm.keepalive.scheduler.sent(KEY, 0, TTL_5M, None)[1] == []  # body and headers were dropped


def test_one_hour_caches_are_pinged_only_under_a_longer_bound():
    warm = Warm(max_idle=1800.0)
    warm.request(ttl=TTL_1H)
    assert warm.pings_until(7200.0) == [] and warm.stats.keepalive.ended == {"idle": 1}
    warm = Warm(max_idle=7200.0)
    warm.request(ttl=TTL_1H)
    # one ping: real breaks still idle at an hour seldom end within the next (the second, at 7,140 s, does not pay)
    assert warm.pings_until(86400.0) == [TTL_1H - 30.0]


def test_the_budget_is_respected():
    warm = Warm(max_idle=86400.0, budget=2)
    warm.request()
    assert warm.pings_until(86400.0) == [FIRST, 2 * FIRST]
    assert warm.stats.keepalive.ended == {"budget": 1}


@pytest.mark.parametrize("failure", [429, 500, 400, "refused", "no cache read"])
def test_a_failed_ping_ends_the_keepalive_and_is_never_retried(failure, logged):
    log = logged("cg.web.keepalive")
    warm = Warm()
    warm.request()
    warm.clock.advance(FIRST)
    (ping,) = warm.upstream.requests
    if failure == "refused":
        ping.fail(ConnectionRefusedError())
    elif failure == "no cache read":
        answer(ping, 200, usage_reply(read=0))
    else:
        error = {"type": "error", "error": {"type": "rate_limit_error", "message": "Number of requests exceeded"}}
        answer(ping, failure, json.dumps(error).encode())
    warm.clock.advance(86400.0)
    assert len(warm.upstream.requests) == 1 and warm.clock.getDelayedCalls() == []
    stats = warm.stats.keepalive
    assert stats.pings == 1 and stats.pings_failed == (failure != "no cache read")
    assert stats.ended == {"missed" if failure == "no cache read" else "failed": 1}
    texts = " ".join(log.texts())
    assert "sk-test" not in texts and "private" not in texts  # never a header nor the body
    if failure == 429:
        assert "answered 429: Number of requests exceeded" in texts
    if failure == "no cache read":
        assert "ping 1/10 200: cache_read=0" in texts and "ended: missed" in texts


def test_a_refused_real_request_arms_nothing():
    warm = Warm()
    warm.request(status=502)
    warm.request(status=None)  # no response head at all
    warm.clock.advance(3600.0)
    assert warm.upstream.requests == [] and warm.stats.keepalive.ended == {"refused": 2}


def test_stop_cancels_timers_and_pings_in_flight():
    warm = Warm()
    warm.request()
    warm.clock.advance(FIRST)
    (ping,) = warm.upstream.requests
    warm.keepalive.stop()
    assert ping.cancelled and warm.clock.getDelayedCalls() == []
    assert warm.stats.keepalive.pings_failed == 0 and warm.stats.keepalive.ended == {"stopped": 1}
    warm.request()  # after the stop: nothing is kept
    assert warm.clock.getDelayedCalls() == []


# ---------------------------------------------------------------------------------------------
# Through cg's resource: a client's request arms the keep-alive


class Proxy:
    """cg's resource and site on a MemoryReactorClock with --keepalive, as CGService builds them."""

    def __init__(self):
        config = Config(expand=True)
        self.clock = MemoryReactorClock()
        self.upstream = MemoryUpstream(self.clock)
        self.stats = Stats()
        base = split_base("http://anthropic.test/base")
        self.keepalive = KeepAlive(self.upstream, self.clock, base, Policy(), self.stats.keepalive)
        resource = ProxyResource(Forwarder(
            self.upstream, self.stats, {"anthropic": base, "openai": split_base("http://openai.test")},
            rewriter=Rewriter(rewrite_config(config)), store=MemoryStore(), tenant_of=parse_tenant(config.tenant),
            reactor=self.clock, keepalive=self.keepalive,
        ))
        self.site = ProxySite(resource, config.max_body, reactor=self.clock, timeout=IDLE_TIMEOUT)

    def send(self, request: bytes) -> Client:
        client = Client(self.site.buildProtocol(PEER))
        client.channel.dataReceived(request)
        return client


def client_request(session: bytes | None = b"session-1", path: str = "/v1/messages?beta=true",
                   close: bool = True) -> bytes:
    extra = [("x-claude-code-session-id", session.decode())] if session else []
    return http_request("POST", path, BODY, [("content-type", "application/json"), ("x-api-key", "sk-test"),
                                             ("anthropic-version", "2023-06-01"), *extra], close=close)


def test_a_clients_request_through_cg_is_pinged_with_its_forwarded_bytes():
    proxy = Proxy()
    proxy.send(client_request())
    (forwarded,) = proxy.upstream.requests
    answer(forwarded)
    proxy.clock.advance(FIRST)
    assert len(proxy.upstream.requests) == 2
    ping = proxy.upstream.requests[1]
    assert ping.path == forwarded.path and ping.body == ping_body(forwarded.body)
    assert ping.headers.getRawHeaders(b"x-api-key") == [b"sk-test"]
    assert ping.headers.getRawHeaders(b"x-claude-code-session-id") == [b"session-1"]


@pytest.mark.parametrize("what", ["no session id", "count_tokens", "upstream 529"])
def test_requests_that_are_not_kept_warm(what):
    proxy = Proxy()
    proxy.send(client_request(session=None) if what == "no session id" else
               client_request(path="/v1/messages/count_tokens?beta=true") if what == "count_tokens" else client_request())
    answer(proxy.upstream.requests[0], 529 if what == "upstream 529" else 200)
    proxy.clock.advance(3600.0)
    assert len(proxy.upstream.requests) == 1


# A client gone: what Claude Code does (docs/how-to/keep-the-cache-warm.md) on cg's own channels.


def kept_alive(proxy: Proxy) -> Client:
    """A request of session-1 on a connection of its own that the client keeps open, answered."""
    client = proxy.send(client_request(close=False))
    answer(proxy.upstream.requests[-1])
    return client


def test_a_client_that_closed_its_connections_is_not_pinged():
    proxy = Proxy()
    client = kept_alive(proxy)
    proxy.clock.advance(60.0)
    client.channel.connectionLost(Failure(ConnectionDone()))  # it exited: a FIN on every connection
    proxy.clock.advance(3600.0)
    assert len(proxy.upstream.requests) == 1
    assert proxy.stats.keepalive.ended == {"gone": 1} and proxy.stats.keepalive.conversations == 0


@pytest.mark.parametrize("how", ["reset", "closed by cg"])
def test_a_client_whose_connection_was_reset_or_closed_by_cg_is_still_pinged(how):
    """A running Claude Code resets its connections idle for 5 minutes; a suspended one (a laptop
    asleep) closes nothing, and cg's own idle timeout closes it: neither is a client that left."""
    proxy = Proxy()
    client = kept_alive(proxy)
    if how == "closed by cg":
        client.transport.loseConnection()
    client.channel.connectionLost(Failure(ConnectionLost() if how == "reset" else ConnectionDone()))
    proxy.clock.advance(FIRST)
    assert len(proxy.upstream.requests) == 2 and proxy.stats.keepalive.ended == {}


def test_a_client_is_gone_once_the_last_of_its_connections_is_closed():
    proxy = Proxy()
    first, second = kept_alive(proxy), kept_alive(proxy)  # Claude Code has a few open at once
    first.channel.connectionLost(Failure(ConnectionDone()))
    proxy.clock.advance(FIRST)
    assert len(proxy.upstream.requests) == 3  # two requests and a ping: one connection is still open
    answer(proxy.upstream.requests[-1])
    second.channel.connectionLost(Failure(ConnectionDone()))
    proxy.clock.advance(3600.0)
    assert len(proxy.upstream.requests) == 3 and proxy.stats.keepalive.ended == {"gone": 1}


class Watched:
    """A client connection that stays open: the watchers of its end."""

    def __init__(self):
        self.watchers = []

    def when_closed(self, watcher) -> None:
        self.watchers.append(watcher)

    def close(self, by_client: bool = True) -> None:
        for watcher in self.watchers:
            watcher(by_client)


def test_a_connection_that_stays_open_holds_no_conversation_the_keepalive_ended():
    """A client (or a gateway in front of many) that sends conversation after conversation on one
    connection it never closes: it is watched once, and tied only to the conversations kept warm."""
    warm = Warm(max_conversations=10)
    connection = Watched()
    for n in range(2000):
        key = ("", f"session-{n}".encode(), "claude-opus-4-8")
        generation = warm.keepalive.sent(key, TTL_5M, BODY, b"/v1/messages?beta=true", headers(), connection=connection)
        warm.keepalive.answered(key, generation, 200)
    assert len(connection.watchers) == 1
    assert len(warm.keepalive._connections) == len(warm.keepalive._conversations[connection]) == 10
    assert warm.stats.keepalive.ended == {"evicted": 1990}
    connection.close()
    assert warm.stats.keepalive.ended == {"evicted": 1990, "gone": 10}
    assert warm.keepalive._connections == warm.keepalive._conversations == {}


def test_a_client_idle_at_its_prompt_keeps_its_connection_past_the_first_ping():
    """With --keepalive, cg's idle timeout outlasts the first ping (twisted.web's 60 s would close
    the connection first, and a client's leaving after that could not be seen)."""
    for argv, timeout in ((["--keepalive"], IDLE_TIMEOUT), ([], 60)):
        options = Options()
        options.parseOptions([*argv, "--store", "memory:"])
        assert CGService(options.config(), MemoryReactorClock()).site.timeOut == timeout
    assert IDLE_TIMEOUT > FIRST
