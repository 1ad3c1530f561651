"""The proxy's timers on a Clock: cg's resource and site over in-memory transports, a MemoryUpstream behind.

No socket and no sleep: the test plays the provider (each request cg sends waits in
``upstream.requests`` until the test answers it) and moves time with ``clock.advance``.
Assertions are on the bytes the client got, on what the upstream saw, and on /stats.
"""

import json

import pytest
from helpers.bodies import TOOLS, bash_body, ident_of, messages
from helpers.clients import PEER, Client
from helpers.drive import HEADERS
from helpers.replies import DONE_EVENT, LATER, chunk, continuation, stream, turn
from helpers.replies import expanding as expanding_call
from helpers.streams import assert_spliced, docs, names, sdk_completion, without_pings
from rawhttp import http_request, split_response
from twisted.internet.error import ConnectionLost, ConnectionRefusedError
from twisted.internet.testing import MemoryReactorClock
from twisted.python.failure import Failure

from cg.compaction.rewrite import Rewriter
from cg.exchange.dialects import OPENAI_CHAT
from cg.exchange.machine import PING_INTERVAL
from cg.record.stats import Stats
from cg.store.memory import MemoryStore
from cg.stream.streamcheck import check_anthropic_stream
from cg.testing import (
    MemoryUpstream,
    anthropic_expand_block,
    anthropic_stream_events,
    anthropic_text_block,
    claude_code_bytes,
    command_output,
)
from cg.web.config import Config
from cg.web.driver import FLUSH_TIMEOUT
from cg.web.forwarder import Forwarder
from cg.web.proxy import ProxyResource
from cg.web.service import rewrite_config
from cg.web.site import ProxySite
from cg.web.tenant import parse_tenant
from cg.web.upstream import HeaderTimeout, split_base
from cg.wire.markers import EXPAND_TOOL

CONTINUATION_TIMEOUT = 60.0
SSE = [("content-type", "text/event-stream")]


class Proxy:
    """cg's resource and site on a MemoryReactorClock, built as CGService builds them."""

    def __init__(self):
        config = Config(expand=True)
        self.clock = MemoryReactorClock()
        self.upstream = MemoryUpstream(self.clock)
        store = MemoryStore()
        self.stats = Stats(store=store.stats)
        resource = ProxyResource(Forwarder(
            self.upstream,
            self.stats,
            {"anthropic": split_base("http://anthropic.test/base"), "openai": split_base("http://openai.test")},
            rewriter=Rewriter(rewrite_config(config)),
            store=store,
            tenant_of=parse_tenant(config.tenant),
            continuation_timeout=CONTINUATION_TIMEOUT,
            reactor=self.clock,
        ))
        self.forwarder = resource.forwarder
        self.site = ProxySite(resource, config.max_body, reactor=self.clock)

    def send(self, request: bytes) -> "Client":
        """A new client connection that sends `request`."""
        client = Client(self.site.buildProtocol(PEER))
        client.channel.dataReceived(request)
        return client

    def intervals(self, n: int):
        """`n` ping intervals pass, one at a time (a LoopingCall runs once for a jump of several)."""
        self.clock.pump([PING_INTERVAL] * n)

    def stats_json(self) -> dict:
        status, _, body = split_response(self.send(http_request("GET", "/stats")).transport.value())
        assert status == 200
        return json.loads(body)


@pytest.fixture
def proxy():
    return Proxy()


def claude_code_request() -> bytes:
    """A Claude Code stream request whose Bash output cg offloads behind a marker (expand injected)."""
    return http_request("POST", "/v1/messages?beta=true", claude_code_bytes(bash_body()), HEADERS)


def round_one() -> list[bytes]:
    """The model's first round: some text, then a lone expand call for the offloaded output."""
    return stream([anthropic_text_block(0, ["Let me look."]), anthropic_expand_block(1, ref=ident_of(command_output()))])


def expanding(proxy: Proxy, request: bytes | None = None, events: list[bytes] | None = None,
              path: bytes = b"/base/v1/messages?beta=true") -> tuple[Client, list[bytes]]:
    """A client whose stream's first round asked to expand: cg has sent the continuation.

    Claude Code's request and round one unless given (a chat stream gives its own)."""
    client = proxy.send(request or claude_code_request())
    (request,) = proxy.upstream.requests
    assert request.path == path
    assert EXPAND_TOOL.encode() in request.body
    events = events or round_one()
    first = request.respond(200, SSE)
    first.write(b"".join(events))
    first.finish()
    assert len(proxy.upstream.requests) == 2, "cg sent no continuation"
    return client, events


@pytest.mark.parametrize("silence", ["after_headers", "after_message_start_and_ping"])
def test_pings_every_interval_until_the_continuations_first_event(proxy, silence):
    """Claude Code gives up on a silent stream: cg pings it while the continuation is awaited, then stops."""
    client, _ = expanding(proxy)
    proxy.clock.advance(PING_INTERVAL - 0.01)
    assert client.pings() == 0
    proxy.clock.advance(0.01)
    assert client.pings() == 1  # awaiting the continuation's headers
    second = proxy.upstream.requests[1].respond(200, SSE)
    events = continuation(["Found it."])  # message_start, ping, the text block, ...
    if silence == "after_message_start_and_ping":
        second.write(events[0] + events[1])
    proxy.intervals(3)
    passed_on = 1 if silence == "after_message_start_and_ping" else 0  # the continuation's own ping
    assert client.pings() == 4 + passed_on  # no content yet: cg goes on pinging
    second.write(b"".join(events[2:] if passed_on else events))
    second.finish()
    data, complete = client.body()
    assert complete
    assert_spliced(data, "Let me look.Found it.")
    seen = names(data)
    stop = seen.index("content_block_stop")  # round 1's last forwarded event (its text block)
    assert seen[stop + 1 : seen.index("content_block_start", stop)] == ["ping"] * 5
    proxy.intervals(10)
    assert client.pings() == 5, "pings after the stream ended"


def test_pings_stop_once_the_continuation_commits(proxy):
    """The continuation's first content event ends the pings, though its body is still flowing."""
    client, _ = expanding(proxy)
    proxy.intervals(2)
    second = proxy.upstream.requests[1].respond(200, SSE)
    events = continuation(["slow ", "still going"])
    second.write(b"".join(events[:4]))  # start, ping, block start, first delta
    assert "content_block_delta" in names(client.body()[0])
    proxy.intervals(10)
    assert client.pings() == 2 + 1  # cg's, and the continuation's own
    second.write(b"".join(events[4:]))
    second.finish()
    assert client.body()[1]


def test_a_continuation_that_never_commits_gives_round_one_verbatim(proxy):
    """Headers but no content within continuation_timeout: the client gets round one as upstream sent it."""
    client, events = expanding(proxy)
    second = proxy.upstream.requests[1].respond(200, SSE)
    second.write(anthropic_stream_events()[0])  # message_start, then silence
    proxy.clock.advance(CONTINUATION_TIMEOUT - 0.01)
    assert not client.body()[1] and second.producer_calls == []
    proxy.clock.advance(0.01)
    data, complete = client.body()
    assert complete and check_anthropic_stream(data) == []
    assert without_pings(data) == without_pings(b"".join(events))  # round one verbatim, expand call and all
    assert set(second.producer_calls) == {"stop"}  # the stalled continuation is dropped
    stats = proxy.stats_json()
    assert stats["in_flight"] == 0 and stats["expand"]["continuations_failed"] == 1
    assert stats["sse_released"] == {"continuation_failed": 1}


def test_a_cut_stream_to_a_client_that_stopped_reading_is_aborted_after_the_flush_timeout(proxy):
    """The client keeps the bytes cg already wrote for FLUSH_TIMEOUT, never the last chunk; then it is cut."""
    client = proxy.send(http_request("POST", "/v1/messages", b'{"stream":true}', HEADERS))
    response = proxy.upstream.requests[0].respond(200, SSE)
    events = anthropic_stream_events(texts=["a", "b"])
    response.write(events[0])
    client.channel.pauseProducing()  # the client's socket is full: it stopped reading
    assert response.producer_calls == ["pause"]
    response.fail()
    assert client.transport.disconnecting and not client.transport.disconnected
    proxy.clock.advance(FLUSH_TIMEOUT - 0.01)
    assert not client.transport.disconnected
    proxy.clock.advance(0.01)
    assert client.transport.disconnected  # aborted
    assert client.body() == (events[0], False)
    assert proxy.stats_json()["upstream_errors"] == 1


@pytest.mark.parametrize(("failure", "status", "kind"), [
    (HeaderTimeout(), 504, "timeout_error"),
    (ConnectionRefusedError(), 502, "api_error"),
])
def test_an_upstream_that_fails_before_its_head_gets_a_provider_shaped_error(proxy, failure, status, kind):
    client = proxy.send(http_request("POST", "/v1/messages", b"{}", HEADERS))
    proxy.upstream.requests[0].fail(failure)
    got, _, body = split_response(client.transport.value())
    assert (got, json.loads(body)["error"]["type"]) == (status, kind)
    assert proxy.stats_json()["upstream_errors"] == 1


def test_a_round_body_left_open_past_its_end_is_stopped_when_the_exchange_ends(proxy):
    """A gateway may keep round one's body open after message_stop: it drains unseen, then is stopped."""
    client = proxy.send(claude_code_request())
    (request,) = proxy.upstream.requests
    first = request.respond(200, SSE)
    first.write(b"".join(round_one()))  # message_stop, but the body stays open
    assert len(proxy.upstream.requests) == 2, "cg sent no continuation"
    second = proxy.upstream.requests[1].respond(200, SSE)
    second.write(b"".join(continuation(["Found it."])))
    assert "stop" not in first.producer_calls
    second.finish()
    assert client.body()[1]
    assert "stop" in first.producer_calls  # its connection does not outlive the exchange


def test_a_bug_after_the_exchange_ended_still_closes_the_client_and_the_exchange(proxy, monkeypatch):
    """Commands lost to a bug in the exchange's last step: the driver closes what they would have."""
    import cg.exchange.machine

    def broken(rewrite):
        raise RuntimeError("a bug while building the record")

    monkeypatch.setattr(cg.exchange.machine, "_compacted", broken)
    client = proxy.send(http_request("POST", "/v1/messages", b'{"model":"m","messages":[]}', HEADERS))
    (request,) = proxy.upstream.requests
    response = request.respond(200, [("content-type", "application/json")])
    response.write(b'{"type":"message","content":[]}')
    response.finish()
    assert client.transport.disconnected  # cut: what it got cannot look complete
    monkeypatch.undo()
    assert proxy.stats_json()["in_flight"] == 0


# ---------------------------------------------------------------------------------------------
# Streamed OpenAI chat completions: the same timers, with an SSE comment for the keepalive


def chat_expanding(proxy: Proxy) -> tuple[Client, list[bytes]]:
    """A streamed chat request whose tool output cg offloads; round one's lone call expands it."""
    body = {"model": "gpt-5", "messages": messages(command_output()), "tools": TOOLS, "stream": True}
    request = http_request("POST", "/v1/chat/completions", json.dumps(body).encode(),
                           [("content-type", "application/json"), ("authorization", "Bearer k")])
    events = turn({"content": "Let me look."}, *expanding_call(ref=ident_of(command_output())), finish="tool_calls")
    return expanding(proxy, request, events, path=b"/v1/chat/completions")


def keepalives(client: Client) -> int:
    return client.body()[0].count(OPENAI_CHAT.keepalive)


def test_a_chat_stream_gets_keepalives_until_the_continuation_commits(proxy):
    """An SSE comment every interval while the continuation is awaited (the SDK skips comments), none after."""
    assert OPENAI_CHAT.keepalive.startswith(b":")  # a comment, not an event a client would parse
    client, _ = chat_expanding(proxy)
    proxy.clock.advance(PING_INTERVAL - 0.01)
    assert keepalives(client) == 0
    proxy.clock.advance(0.01)
    assert keepalives(client) == 1  # awaiting the continuation's headers
    second = proxy.upstream.requests[1].respond(200, SSE)
    events = turn({"content": "Found "}, {"content": "it."}, finish="stop", head=LATER)
    second.write(events[0])  # the role chunk: the client has one already, so nothing is committed
    proxy.intervals(3)
    assert keepalives(client) == 4
    second.write(events[1])
    proxy.intervals(10)
    assert keepalives(client) == 4, "keepalives after the continuation committed"
    second.write(b"".join(events[2:]))
    second.finish()
    data, complete = client.body()
    assert complete and data.endswith(DONE_EVENT)
    assert EXPAND_TOOL.encode() not in data
    completion = sdk_completion(data)  # keepalives and all
    assert completion.choices[0].message.content == "Let me look.Found it."
    assert completion.choices[0].finish_reason == "stop"


def test_a_chat_continuation_that_never_commits_gives_round_one_verbatim(proxy):
    """Headers and a role chunk, then silence: round one as it came, a stream that still ends in [DONE]."""
    client, events = chat_expanding(proxy)
    second = proxy.upstream.requests[1].respond(200, SSE)
    second.write(chunk({"role": "assistant", "content": ""}, head=LATER))
    proxy.clock.advance(CONTINUATION_TIMEOUT - 0.01)
    assert not client.body()[1] and second.producer_calls == []
    proxy.clock.advance(0.01)
    data, complete = client.body()
    assert complete and data.endswith(DONE_EVENT)
    got = data.replace(OPENAI_CHAT.keepalive, b"")
    usage = events[-2]  # cg asked for usage, the client did not: it is kept from the client
    assert got == b"".join(e for e in events if e != usage)  # round one, its expand call and all
    assert not any(c["choices"] == [] for c in docs(data))
    assert set(second.producer_calls) == {"stop"}
    stats = proxy.stats_json()
    assert stats["in_flight"] == 0 and stats["expand"]["continuations_failed"] == 1
    assert stats["sse_released"] == {"continuation_failed": 1}


@pytest.mark.parametrize("dialect", ["anthropic", "openai chat"])
def test_client_leaving_while_the_continuation_is_awaited_cancels_it(proxy, dialect):
    client, _ = expanding(proxy) if dialect == "anthropic" else chat_expanding(proxy)
    proxy.intervals(3)
    assert (client.pings() if dialect == "anthropic" else keepalives(client)) == 3
    waiting = proxy.upstream.requests[1]
    assert not waiting.cancelled
    client.channel.connectionLost(Failure(ConnectionLost()))
    assert waiting.cancelled
    stats = proxy.stats_json()
    assert stats["client_disconnects"] == 1 and stats["in_flight"] == 0 and stats["sse_streamed"] == 1


@pytest.mark.parametrize("where", ["preparation", "counting"])
def test_a_bug_on_the_request_side_forwards_the_body_as_received_once(proxy, monkeypatch, where):
    """A bug in the preparation, or in counting what it did, costs the request its saving, never the
    request: the body goes upstream as the client sent it, once, and the response is relayed."""
    body = claude_code_bytes(bash_body())

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    if where == "preparation":
        monkeypatch.setattr(proxy.forwarder.rewriter, "finish", broken)
    else:
        monkeypatch.setattr(proxy.forwarder, "prepared", broken)
    client = proxy.send(http_request("POST", "/v1/messages?beta=true", body, HEADERS))
    (request,) = proxy.upstream.requests
    assert request.body == body
    request.respond(200, [("content-type", "application/json")]).finish()
    assert len(proxy.upstream.requests) == 1
    assert split_response(client.transport.value())[0] == 200


def test_a_round_delivered_whole_with_its_head_is_expanded_once(proxy):
    """An upstream whose head and whole body are there at once (queued behind the head): the round's
    end, still queued when the expand call detached the body, is the detached body's, not an event
    the exchange takes while it resolves (conftest fails a test that logs an unexpected event)."""
    real = proxy.upstream.request

    def request(*args):
        result = real(*args)
        if len(proxy.upstream.requests) == 1:
            response = proxy.upstream.requests[0].respond(200, SSE)
            response.write(b"".join(round_one()))
            response.finish()
        return result

    proxy.upstream.request = request
    proxy.send(claude_code_request())
    assert len(proxy.upstream.requests) == 2, "cg sent no continuation"
