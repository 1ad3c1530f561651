"""The proxy over real sockets: a fake provider, cg in-process, raw clients and the SDKs."""

import gzip

import anthropic
import openai
import pytest
import ujson
from pytest_twisted import inlineCallbacks
from rawhttp import connect, http_request, kernel_send_queue, split_response
from twisted.internet import defer, error, reactor, task
from twisted.internet.threads import deferToThread
from twisted.web.client import ResponseDone

from cg.testing import (
    Flood,
    JSONReply,
    Reset,
    SSEReply,
    Stall,
    anthropic_message,
    anthropic_stream_events,
    openai_stream_events,
)
from cg.web.driver import ClientFlow


def sleep(seconds):
    return task.deferLater(reactor, seconds, lambda: None)


def compact(doc) -> bytes:
    return ujson.dumps(doc, ensure_ascii=False, escape_forward_slashes=False).encode()


def anthropic_client(cg, **kw):
    return anthropic.Anthropic(base_url=cg.url, api_key="sk-ant-test", max_retries=0, **kw)


def openai_client(cg, **kw):
    return openai.OpenAI(base_url=cg.url + "/v1", api_key="sk-test", max_retries=0, **kw)


REQUEST = {"model": "claude-opus-4-8", "max_tokens": 64, "messages": [{"role": "user", "content": "hi é/<>"}]}


@inlineCallbacks
def test_pass_through_is_byte_exact(cg, fake):
    body = b'{"model":"m",  "messages":[{"role":"user","content":"caf\xc3\xa9 \\u00e9 /"}],"max_tokens":1}'
    fake.enqueue(
        JSONReply(
            b'{"id": "msg_1",   "x": "\\u00e9"}',
            status=429,
            headers=[
                ("request-id", "req_123"),
                ("retry-after", "7"),
                ("anthropic-ratelimit-requests-remaining", "0"),
                ("x-custom-upstream", "kept"),
            ],
        )
    )
    sent_headers = [
        ("x-api-key", "sk-ant-secret"),
        ("anthropic-version", "2023-06-01"),
        ("anthropic-beta", "claude-code-20250219,context-1m-2025-08-07"),
        ("x-claude-code-session-id", "5b0c"),
        ("user-agent", "claude-cli/2.1.197"),
        ("content-type", "application/json"),
    ]
    client = yield connect(cg.port, http_request("POST", "/v1/messages?beta=true", body, sent_headers))
    raw = yield client.closed
    status, headers, got = split_response(raw)

    received = fake.received[0]
    assert received.method == b"POST"
    assert received.path == b"/v1/messages?beta=true"
    assert received.body == body
    for name, value in sent_headers:
        assert received.header(name.encode()) == value.encode()
    names = {n.lower() for n, _ in received.headers}
    assert not any(n.startswith(b"x-forwarded") or n == b"forwarded" or n == b"via" for n in names)

    assert status == 429
    assert got == b'{"id": "msg_1",   "x": "\\u00e9"}'
    assert headers[b"request-id"] == [b"req_123"]
    assert headers[b"retry-after"] == [b"7"]
    assert headers[b"anthropic-ratelimit-requests-remaining"] == [b"0"]
    assert headers[b"x-custom-upstream"] == [b"kept"]
    assert b"via" not in headers


@inlineCallbacks
def test_hop_by_hop_headers_stay_on_their_hop(cg, fake):
    request = http_request(
        "POST",
        "/v1/messages",
        b"{}",
        [("Connection", "x-hop"), ("x-hop", "1"), ("Keep-Alive", "timeout=5"), ("x-e2e", "2")],
    )
    client = yield connect(cg.port, request)
    raw = yield client.closed
    assert split_response(raw)[0] == 200
    received = fake.received[0]
    assert received.header(b"x-hop") is None
    assert received.header(b"keep-alive") is None
    assert received.header(b"x-e2e") == b"2"


@inlineCallbacks
def test_head_root_is_answered_without_upstream(cg, fake):
    client = yield connect(cg.port, http_request("HEAD", "/"))
    raw = yield client.closed
    assert raw.startswith(b"HTTP/1.1 200")
    assert fake.received == []


@inlineCallbacks
def test_health_and_stats(cg, fake):
    client = yield connect(cg.port, http_request("GET", "/healthz"))
    assert split_response((yield client.closed))[0] == 200
    yield deferToThread(anthropic_client(cg).messages.create, **REQUEST)
    client = yield connect(cg.port, http_request("GET", "/stats"))
    status, _, body = split_response((yield client.closed))
    stats = ujson.loads(body)
    assert status == 200
    assert stats["requests_by_dialect"] == {"anthropic": 1}
    assert stats["bytes_in"] > 0 and stats["bytes_out"] > 0
    assert stats["added_ttfb"]["count"] == 1
    for field in ("streamed", "upstream_errors", "client_disconnects", "bytes_in", "bytes_out"):
        assert field in stats


@inlineCallbacks
def test_routing_by_path_and_anthropic_version(cg, fake, fake_openai):
    yield deferToThread(anthropic_client(cg).messages.create, **REQUEST)
    yield deferToThread(
        openai_client(cg).chat.completions.create,
        model="gpt-5",
        messages=[{"role": "user", "content": "hi"}],
    )
    yield deferToThread(anthropic_client(cg).messages.count_tokens, model="m", messages=REQUEST["messages"])
    yield deferToThread(anthropic_client(cg).models.list)  # /v1/models with anthropic-version
    yield deferToThread(openai_client(cg).models.list)
    assert [r.path.split(b"?")[0] for r in fake.received] == [
        b"/v1/messages",
        b"/v1/messages/count_tokens",
        b"/v1/models",
    ]
    assert [r.path for r in fake_openai.received] == [b"/v1/chat/completions", b"/v1/models"]


@inlineCallbacks
def test_unknown_path_is_404_and_not_forwarded(cg, fake, fake_openai):
    client = yield connect(cg.port, http_request("GET", "/elsewhere"))
    assert split_response((yield client.closed))[0] == 404
    assert fake.received == fake_openai.received == []


@inlineCallbacks
def test_first_event_reaches_client_before_upstream_finishes(cg, fake):
    fake.enqueue(SSEReply(anthropic_stream_events(texts=["a"] * 8), delay=0.05))
    body = compact({**REQUEST, "stream": True})
    client = yield connect(cg.port, http_request("POST", "/v1/messages", body))
    yield client.first_data
    upstream_done = fake.received[0].finished
    assert not upstream_done.called, "the client waited for the whole stream"
    raw = yield client.closed
    assert (yield upstream_done) == "done"
    assert split_response(raw)[2] == b"".join(anthropic_stream_events(texts=["a"] * 8))


@inlineCallbacks
def test_sdk_streams_through(cg, fake, fake_openai):
    fake.enqueue(SSEReply(anthropic_stream_events(texts=["Hel", "lo"])))

    def stream():
        with anthropic_client(cg).messages.stream(**REQUEST) as s:
            return s.get_final_message()

    message = yield deferToThread(stream)
    assert message.content[0].text == "Hello"

    fake_openai.enqueue(SSEReply(openai_stream_events(texts=["Hi", " there"])))

    def chat():
        chunks = openai_client(cg).chat.completions.create(
            model="gpt-5", messages=[{"role": "user", "content": "x"}], stream=True
        )
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    assert (yield deferToThread(chat)) == "Hi there"
    assert cg.stats.streamed == 2


@inlineCallbacks
def test_slow_client_keeps_cg_buffer_bounded(cg, fake):
    total = 64 << 20
    fake.enqueue(Flood(total))
    body = compact({**REQUEST, "stream": True})
    client = yield connect(cg.port, http_request("POST", "/v1/messages", body), pause_after_first=True)
    yield client.first_data
    last = -1
    for _ in range(100):  # until cg stops reading from the upstream
        yield sleep(0.1)
        if cg.stats.bytes_from_upstream == last:
            break
        last = cg.stats.bytes_from_upstream
    (exchange,) = cg.service.forwarder._in_flight
    cg_socket = exchange.request.channel.transport.getHandle()
    handed_to_client = kernel_send_queue(cg_socket) + client.unread_kernel_bytes() + len(client.data)
    held = cg.stats.bytes_from_upstream - handed_to_client
    assert held < 1 << 20, f"cg holds {held} bytes for a client that does not read"
    assert fake.flood_bytes_written < total // 2, "the upstream was never paused"
    client.transport.abortConnection()
    yield client.closed


@inlineCallbacks
def test_client_disconnect_cancels_upstream_stream(cg, fake):
    fake.enqueue(SSEReply(anthropic_stream_events(texts=["x"] * 200), delay=0.05))
    client = yield connect(cg.port, http_request("POST", "/v1/messages", compact({**REQUEST, "stream": True})))
    yield client.first_data
    client.transport.abortConnection()
    outcome = yield fake.received[0].finished
    assert outcome == "lost"
    assert cg.stats.client_disconnects == 1
    assert cg.stats.in_flight == 0


@inlineCallbacks
def test_client_disconnect_before_headers_cancels_upstream_request(cg, fake):
    fake.enqueue(Stall())
    client = yield connect(cg.port, http_request("POST", "/v1/messages", b"{}"))
    for _ in range(50):
        if fake.received:
            break
        yield sleep(0.02)
    client.transport.abortConnection()
    assert (yield fake.received[0].finished) == "lost"
    assert cg.stats.client_disconnects == 1


@inlineCallbacks
def test_stale_pooled_connection_is_retried_once(cg, fake):
    client = anthropic_client(cg)
    yield deferToThread(client.messages.create, **REQUEST)
    fake.reset_reused_connections = 1
    message = yield deferToThread(client.messages.create, **REQUEST)
    assert message.content[0].text
    assert [r.nth_on_connection for r in fake.received] == [1, 2, 1]
    assert fake.received[1].body == fake.received[2].body
    assert cg.stats.upstream_retries == 1


@inlineCallbacks
def test_fresh_connection_failure_is_not_retried(cg, fake):
    fake.enqueue(Reset())
    with pytest.raises(anthropic.InternalServerError):
        yield deferToThread(anthropic_client(cg).messages.create, **REQUEST)
    assert len(fake.received) == 1
    assert cg.stats.upstream_retries == 0


@inlineCallbacks
def test_upstream_down_gives_provider_shaped_502(make_cg):
    cg = make_cg(anthropic_upstream="http://127.0.0.1:1", openai_upstream="http://127.0.0.1:1")
    with pytest.raises(anthropic.InternalServerError) as caught:
        yield deferToThread(anthropic_client(cg).messages.create, **REQUEST)
    assert caught.value.status_code == 502
    assert caught.value.body["error"]["type"] == "api_error"
    with pytest.raises(openai.InternalServerError) as caught:
        yield deferToThread(
            openai_client(cg).chat.completions.create, model="m", messages=[{"role": "user", "content": "x"}]
        )
    assert caught.value.status_code == 502
    assert "upstream" in caught.value.body["message"]
    assert cg.stats.upstream_errors == 2


@inlineCallbacks
def test_midstream_reset_aborts_the_client_stream(cg, fake):
    events = anthropic_stream_events(texts=["a", "b", "c", "d"])
    fake.enqueue(SSEReply(events[:5], end="reset"))

    def stream():
        with anthropic_client(cg).messages.stream(**REQUEST) as s:
            return s.get_final_message()

    with pytest.raises(Exception) as caught:  # the SDK's transport error: anything but a message
        yield deferToThread(stream)
    assert "incomplete" in str(caught.value).lower() or isinstance(caught.value, anthropic.APIError)

    fake.enqueue(SSEReply(events[:5], end="reset"))
    client = yield connect(cg.port, http_request("POST", "/v1/messages", compact({**REQUEST, "stream": True})))
    raw = yield client.closed
    assert not client.reason.check(ResponseDone)
    with pytest.raises(ValueError, match="truncated"):
        split_response(raw)


@inlineCallbacks
def test_oversized_body_gets_413_in_provider_shape(make_cg, fake, fake_openai):
    cg = make_cg(anthropic_upstream=fake.url, openai_upstream=fake_openai.url, max_body=4096)
    big = "x" * 10_000
    with pytest.raises(anthropic.APIStatusError) as caught:
        yield deferToThread(
            anthropic_client(cg).messages.create, model="m", max_tokens=1, messages=[{"role": "user", "content": big}]
        )
    assert caught.value.status_code == 413
    assert caught.value.body["error"]["type"] == "request_too_large"
    with pytest.raises(openai.APIStatusError) as caught:
        yield deferToThread(
            openai_client(cg).chat.completions.create, model="m", messages=[{"role": "user", "content": big}]
        )
    assert caught.value.status_code == 413
    # chunked upload, no Content-Length
    request = (
        b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        + b"".join(b"%x\r\n%s\r\n" % (1000, b"y" * 1000) for _ in range(6))
        + b"0\r\n\r\n"
    )
    client = yield connect(cg.port, request)
    assert split_response((yield client.closed))[0] == 413
    assert fake.received == fake_openai.received == []
    assert cg.stats.too_large == 3


@inlineCallbacks
def test_non_json_body_is_forwarded_untouched(cg, fake):
    body = b"\xff\xfe not json {{{"
    client = yield connect(cg.port, http_request("POST", "/v1/messages", body, [("content-type", "application/json")]))
    yield client.closed
    assert fake.received[0].body == body


@inlineCallbacks
def test_gzip_upstream_is_decoded_on_read_paths(cg, fake, fake_openai):
    fake.enqueue(SSEReply(anthropic_stream_events(texts=["zip", "ped"]), gzip=True))

    def stream():
        with anthropic_client(cg).messages.stream(**REQUEST) as s:
            return s.get_final_message()

    message = yield deferToThread(stream)
    assert message.content[0].text == "zipped"
    assert fake.received[0].header(b"accept-encoding") == b"gzip"

    fake.enqueue(JSONReply(anthropic_message("plain"), gzip=True))
    client = yield connect(
        cg.port, http_request("POST", "/v1/messages", b"{}", [("accept-encoding", "br, zstd")])
    )
    status, headers, body = split_response((yield client.closed))
    assert b"content-encoding" not in headers
    assert ujson.loads(body)["content"][0]["text"] == "plain"

    # elsewhere, the client's encodings pass through and the bytes are not decoded
    payload = {"data": [{"id": "gpt-5", "object": "model"}], "object": "list"}
    fake_openai.enqueue(JSONReply(payload, gzip=True))
    client = yield connect(cg.port, http_request("GET", "/v1/models", headers=[("accept-encoding", "gzip, br")]))
    status, headers, body = split_response((yield client.closed))
    assert fake_openai.received[0].header(b"accept-encoding") == b"gzip, br"
    assert headers[b"content-encoding"] == [b"gzip"]
    assert ujson.loads(gzip.decompress(body)) == payload


@inlineCallbacks
def test_graceful_stop_drains_in_flight_stream(cg, fake):
    events = anthropic_stream_events(texts=["s"] * 10)
    fake.enqueue(SSEReply(events, delay=0.05))
    port = cg.port
    client = yield connect(port, http_request("POST", "/v1/messages", compact({**REQUEST, "stream": True})))
    yield client.first_data
    stopped = cg.stop()
    assert not stopped.called
    with pytest.raises(error.ConnectionRefusedError):
        yield connect(port, http_request("GET", "/healthz"))
    raw = yield client.closed
    assert split_response(raw)[2] == b"".join(events)
    yield stopped


@inlineCallbacks
def test_graceful_stop_takes_no_new_request_on_a_kept_alive_connection(cg, fake):
    """Under steady traffic a drain that let kept-alive connections bring new requests would never
    empty before --drain-timeout, then cut them: an idle connection closes at once, a busy one
    after its response (bench/soak.py's graceful restart found it)."""
    idle = yield connect(cg.port, http_request("GET", "/healthz", close=False))
    yield idle.first_data
    events = anthropic_stream_events(texts=["s"] * 10)
    fake.enqueue(SSEReply(events, delay=0.05))
    busy = yield connect(cg.port, http_request("POST", "/v1/messages", compact({**REQUEST, "stream": True}), close=False))
    yield busy.first_data
    stopped = cg.stop()
    yield idle.closed
    assert b"message_stop" not in busy.data  # closed while the stream still drains
    raw = yield busy.closed  # closed after its response, not kept for another request
    assert split_response(raw)[2] == b"".join(events)
    yield stopped


class _Later:
    """A reply the fake plays `delay` seconds after the request came (its head not yet sent)."""

    def __init__(self, reply, delay):
        self.reply, self.delay = reply, delay

    def play(self, request, upstream):
        reactor.callLater(self.delay, self.reply.play, request, upstream)


@inlineCallbacks
def test_a_response_that_waited_for_the_provider_through_a_stop_says_connection_close(cg, fake):
    """The provider's head replaces the response's headers: the close a graceful stop asked for
    must survive it, or a pooled client sends its next request on a connection about to close."""
    fake.enqueue(_Later(JSONReply(anthropic_message("ok")), 0.3))
    client = yield connect(cg.port, http_request("POST", "/v1/messages", compact(REQUEST), close=False))
    yield task.deferLater(reactor, 0.1, lambda: None)  # the request is with the provider
    stopped = cg.stop()
    status, headers, _ = split_response((yield client.closed))
    assert status == 200 and headers[b"connection"] == [b"close"]
    yield stopped


@inlineCallbacks
def test_a_request_whose_head_arrives_during_a_stop_is_the_connections_last(cg, fake):
    """Twisted decides a connection's persistence when a request's head is complete: a stop that
    began while it arrived must not be undone by it."""
    fake.enqueue(SSEReply(anthropic_stream_events(texts=["s"] * 10), delay=0.05), JSONReply(anthropic_message("ok")))
    busy = yield connect(cg.port, http_request("POST", "/v1/messages", compact({**REQUEST, "stream": True})))
    yield busy.first_data  # a stream in flight keeps the drain open
    head, rest = http_request("POST", "/v1/messages", compact(REQUEST), close=False).split(b"\r\n", 1)
    client = yield connect(cg.port, head + b"\r\n")
    yield task.deferLater(reactor, 0.1, lambda: None)  # the first line is in: a request under way
    stopped = cg.stop()
    client.transport.write(rest)
    status, headers, _ = split_response((yield client.closed))  # closed after it, by cg
    assert status == 200 and headers[b"connection"] == [b"close"]
    yield stopped


@inlineCallbacks
def test_graceful_stop_cuts_streams_after_drain_timeout(make_cg, fake):
    cg = make_cg(anthropic_upstream=fake.url, drain_timeout=0.2)
    fake.enqueue(SSEReply(anthropic_stream_events(texts=["s"] * 3), end="stall"))
    client = yield connect(cg.port, http_request("POST", "/v1/messages", compact({**REQUEST, "stream": True})))
    yield client.first_data
    yield cg.stop()
    raw = yield client.closed
    with pytest.raises(ValueError, match="truncated"):
        split_response(raw)
    assert (yield fake.received[0].finished) == "lost"


@inlineCallbacks
def test_many_concurrent_streams(cg, fake):
    fake.default_reply = lambda received: SSEReply(anthropic_stream_events(texts=["x"] * 5), delay=0.01)
    body = compact({**REQUEST, "stream": True})
    clients = yield defer.gatherResults([connect(cg.port, http_request("POST", "/v1/messages", body)) for _ in range(30)])
    raws = yield defer.gatherResults([c.closed for c in clients])
    expected = b"".join(anthropic_stream_events(texts=["x"] * 5))
    assert all(split_response(raw)[2] == expected for raw in raws)
    assert cg.stats.in_flight == 0


class Recorder:
    def __init__(self):
        self.calls: list[str] = []

    def pauseProducing(self):
        self.calls.append("pause")

    def resumeProducing(self):
        self.calls.append("resume")

    def stopProducing(self):
        self.calls.append("stop")


def test_client_flow_hands_the_clients_state_to_each_body():
    flow = ClientFlow()
    first, second = Recorder(), Recorder()
    flow.attach(first)
    flow.pauseProducing()
    flow.detach()  # a round ends while the client is paused: its body must drain
    flow.attach(second)  # the next round's body starts paused
    flow.resumeProducing()
    flow.stopProducing()
    flow.detach()
    flow.pauseProducing()  # no body: nothing to do
    assert first.calls == ["pause", "resume"]
    assert second.calls == ["pause", "resume", "stop"]


@pytest.mark.parametrize("path, body", [
    ("/v1/messages", b'{"model":"m","max_tokens":5,"stream":true,"messages":[{"role":"user","content":"hi"}]}'),
    ("/v1/chat/completions", b'{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}'),
], ids=["anthropic", "openai"])
@inlineCallbacks
def test_a_streams_head_reaches_the_client_before_its_first_event(make_cg, fake, path, body):
    """The head is sent as upstream's arrives, not with the first event (10 s away here)."""
    cg = make_cg(anthropic_upstream=fake.url, openai_upstream=fake.url)
    headers = [("content-type", "application/json"), ("x-fake-first-delay-ms", "10000")]
    client = yield connect(cg.port, http_request("POST", path, body, headers))
    first = yield client.first_data.addTimeout(5, reactor)
    assert first.startswith(b"HTTP/1.1 200 ") and first.endswith(b"\r\n\r\n")
    assert b"event:" not in first and b"data:" not in first
    client.transport.abortConnection()
    yield client.closed
