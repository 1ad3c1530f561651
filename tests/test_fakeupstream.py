"""cg.testing's fake provider, over real sockets on 127.0.0.1, with treq, raw sockets and the SDKs."""

import gzip
import os
import re
import sys
import zlib
from pathlib import Path

import anthropic
import openai
import pytest
import pytest_twisted
import treq
import ujson
from treq.client import HTTPClient
from twisted.internet import error, protocol, reactor, task
from twisted.internet.defer import Deferred, succeed
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.threads import deferToThread
from twisted.web.client import (
    Agent,
    HTTPConnectionPool,
    ResponseFailed,
    ResponseNeverReceived,
)

import cg.testing
from cg.testing import (
    HELLO,
    FakeUpstream,
    Flood,
    JSONReply,
    Reset,
    SSEReply,
    Stall,
    anthropic_message,
    anthropic_stream_events,
    anthropic_text_block,
    openai_stream_events,
    responses_function_call,
    responses_message,
    responses_reasoning,
    responses_response,
    responses_stream_events,
    sse_event,
)

TIMEOUT = 20  # seconds; only there so a broken fake fails a test instead of hanging it

EVENTS = [sse_event("first", {"n": 1}), sse_event("second", {"n": 2})]


# ---------------------------------------------------------------------------------------------
# Fixtures and helpers (kept here: tests/conftest.py belongs to the proxy's tests)


@pytest.fixture
def up():
    fake = FakeUpstream()
    fake.listen(reactor, port=0, interface="127.0.0.1")
    yield fake
    pytest_twisted.blockon(fake.stop())


@pytest.fixture
def agent():
    """A plain Agent with its own keep-alive pool, so connection reuse is under the test's control.

    Plain, because treq always decodes gzip (and drops Content-Encoding) before a test sees it.
    """
    pool = HTTPConnectionPool(reactor, persistent=True)
    yield Agent(reactor, pool=pool)
    pytest_twisted.blockon(pool.closeCachedConnections())


@pytest.fixture
def http(agent):
    return HTTPClient(agent)


def within(d: Deferred, seconds: float = TIMEOUT) -> Deferred:
    return d.addTimeout(seconds, reactor)


def sleep(seconds: float) -> Deferred:
    return task.deferLater(reactor, seconds, lambda: None)


async def wait_for(condition, seconds: float = TIMEOUT) -> None:
    for _ in range(int(seconds / 0.01)):
        if condition():
            return
        await sleep(0.01)
    raise AssertionError("condition never became true")


async def settle(read, interval: float = 0.1, rounds: int = 3):
    """Wait until ``read()`` stops changing for ``rounds`` intervals; return its value."""
    value, still = read(), 0
    while still < rounds:
        await sleep(interval)
        new = read()
        still = still + 1 if new == value else 0
        value = new
    return value


class RawClient(protocol.Protocol):
    """A bare TCP client: sends bytes as given, sees every response byte (framing included)."""

    def __init__(self, keep: bool = True):
        self.keep = keep
        self.data = bytearray()
        self.count = 0
        self.lost: Deferred = Deferred()
        self._waiters: list = []

    def dataReceived(self, data: bytes) -> None:
        self.count += len(data)
        if self.keep:
            self.data += data
        for waiter in list(self._waiters):
            if waiter[0](self):
                self._waiters.remove(waiter)
                waiter[1].callback(bytes(self.data))

    def connectionLost(self, reason) -> None:
        self.lost.callback(reason.value)

    def until(self, condition) -> Deferred:
        """Fires with the data so far once ``condition(self)`` holds (checked on each read)."""
        if condition(self):
            return succeed(bytes(self.data))
        d: Deferred = Deferred()
        self._waiters.append((condition, d))
        return within(d)

    def until_seen(self, marker: bytes) -> Deferred:
        return self.until(lambda c: marker in c.data)


async def raw(up: FakeUpstream, request: bytes, keep: bool = True) -> RawClient:
    port = int(up.url.rsplit(":", 1)[1])
    client = await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", port), RawClient(keep))
    client.transport.write(request)
    return client


async def body_of(response) -> bytes:
    """The raw body of a plain Agent's response (what treq.content gives, minus gzip decoding)."""
    pieces: list[bytes] = []
    await within(treq.collect(response, pieces.append))
    return b"".join(pieces)


def post(path: bytes, body: bytes) -> bytes:
    return b"POST %s HTTP/1.1\r\nHost: fake\r\nContent-Length: %d\r\n\r\n%s" % (
        path,
        len(body),
        body,
    )


def parse_sse(stream: bytes) -> list[tuple[str | None, str]]:
    """The (event, data) pairs a spec-following SSE parser dispatches."""
    events, name, data = [], None, None
    for line in stream.split(b"\n"):
        if not line:
            if data is not None:
                events.append((name, data))
            name, data = None, None
        elif line.startswith(b":"):
            continue
        else:
            field, _, value = line.decode().partition(":")
            value = value.removeprefix(" ")
            if field == "event":
                name = value
            elif field == "data":
                data = value if data is None else data + "\n" + value
    return events


# ---------------------------------------------------------------------------------------------
# Recording


@pytest_twisted.ensureDeferred
async def test_records_method_path_headers_and_body_exactly(up):
    body = b'{"model":"claude-x",  "messages": [],\n "s":"\xc3\xa9\\u00e9/"}'
    client = await raw(
        up,
        b"POST /v1/messages?beta=true HTTP/1.1\r\nHost: fake\r\nX-Api-Key: k1\r\n"
        b"anthropic-beta: b1,b2\r\nX-Dup: 1\r\nContent-Length: %d\r\nx-dup:  2 \r\n\r\n"
        % len(body)
        + body,
    )
    await client.until_seen(b"msg_fake")
    [got] = up.received
    assert got.method == b"POST"
    assert got.path == b"/v1/messages?beta=true"
    assert got.headers == [
        (b"host", b"fake"),
        (b"x-api-key", b"k1"),
        (b"anthropic-beta", b"b1,b2"),
        (b"x-dup", b"1"),
        (b"content-length", b"%d" % len(body)),
        (b"x-dup", b"2"),
    ]
    assert got.header(b"X-DUP") == b"1"
    assert got.header(b"x-missing") is None
    assert got.body == body
    assert got.json()["model"] == "claude-x"
    assert (got.connection, got.nth_on_connection) == (1, 1)
    assert await within(got.finished) == "done"
    assert b'"model":"claude-x"' in client.data  # the default reply echoes the model


@pytest_twisted.ensureDeferred
async def test_numbers_connections_and_requests_on_them(up):
    chunked = (
        b"POST /second HTTP/1.1\r\nHost: fake\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
    )
    first = await raw(up, post(b"/first", b"one") + chunked)  # pipelined in one write
    await first.until(lambda c: c.data.count(b'{"ok":true}') == 2)
    second = await raw(up, post(b"/third", b""))
    await second.until_seen(b'{"ok":true}')
    assert [(r.path, r.body, r.connection, r.nth_on_connection) for r in up.received] == [
        (b"/first", b"one", 1, 1),
        (b"/second", b"abcde", 1, 2),
        (b"/third", b"", 2, 1),
    ]


@pytest_twisted.ensureDeferred
async def test_record_off_answers_and_keeps_no_request(http):
    """As ``python -m cg.testing`` serves benchmarks: large bodies are answered, never held."""
    fake = FakeUpstream(record=False)
    fake.listen(reactor, port=0, interface="127.0.0.1")
    try:
        body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x" * 300_000}]}
        response = await http.post(fake.url + "/v1/messages", json=body, headers={"x-fake-events": "2"})
        names = [n for n, _ in parse_sse(await response.content())]
        assert names[0] == "message_start" and names[-1] == "message_stop"
        assert fake.received == []
    finally:
        await fake.stop()


@pytest_twisted.ensureDeferred
async def test_queue_is_fifo_across_paths_then_default_replies(up, http):
    up.enqueue(JSONReply({"n": 1}), JSONReply({"n": 2}, status=201))
    r1 = await http.get(up.url + "/anything")
    assert (r1.code, await r1.json()) == (200, {"n": 1})
    r2 = await http.post(up.url + "/v1/messages", data=b"{}")
    assert (r2.code, await r2.json()) == (201, {"n": 2})

    r3 = await http.post(up.url + "/v1/messages?beta=true", data=b"not json")
    assert await r3.json() == anthropic_message()
    r4 = await http.post(up.url + "/v1/chat/completions", json={"model": "gpt-x"})
    completion = await r4.json()
    assert (completion["object"], completion["model"]) == ("chat.completion", "gpt-x")
    assert completion["choices"][0]["message"]["content"] == HELLO
    r5 = await http.post(up.url + "/v1/messages/count_tokens?beta=true", json={"model": "m"})
    assert await r5.json() == {"input_tokens": 10}
    r6 = await http.post(up.url + "/elsewhere", json={"stream": True})
    assert await r6.json() == {"ok": True}
    r7 = await http.head(up.url + "/")
    assert (r7.code, await r7.content()) == (200, b"")

    up.default_reply = lambda received: JSONReply({"path": received.path.decode()})
    r8 = await http.get(up.url + "/p?q=1")
    assert await r8.json() == {"path": "/p?q=1"}
    assert len(up.received) == 8


# ---------------------------------------------------------------------------------------------
# JSON replies


@pytest_twisted.ensureDeferred
async def test_json_reply_status_headers_and_gzip(up, agent):
    up.enqueue(
        JSONReply(
            {"a": "é/", "b": [1, 2]},
            status=529,
            headers=[("request-id", "req_1"), (b"retry-after", b"3")],
            gzip=True,
        ),
        JSONReply(b"not json", headers=[("Content-Type", "text/plain")]),
    )
    r1 = await agent.request(b"GET", up.url.encode() + b"/")
    raw_body = await body_of(r1)
    assert r1.code == 529
    assert r1.headers.getRawHeaders("request-id") == ["req_1"]
    assert r1.headers.getRawHeaders("retry-after") == ["3"]
    assert r1.headers.getRawHeaders("content-type") == ["application/json"]
    assert r1.headers.getRawHeaders("content-encoding") == ["gzip"]
    assert r1.length == len(raw_body)  # the Agent turns Content-Length into .length
    assert gzip.decompress(raw_body) == '{"a":"é/","b":[1,2]}'.encode()

    r2 = await agent.request(b"GET", up.url.encode() + b"/")
    assert await body_of(r2) == b"not json"
    assert r2.headers.getRawHeaders("content-type") == ["text/plain"]
    assert r2.headers.getRawHeaders("content-encoding") is None


# ---------------------------------------------------------------------------------------------
# SSE replies


@pytest_twisted.ensureDeferred
async def test_sse_headers_then_each_event_before_the_end(up):
    up.enqueue(SSEReply(EVENTS, first_delay=0.2, delay=0.3))
    client = await raw(up, post(b"/v1/messages", b"{}"))

    head = await client.until_seen(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ")
    assert b"\r\nContent-Type: text/event-stream\r\n" in head
    assert b"event:" not in head  # headers went out before the first event

    await client.until_seen(EVENTS[0])
    [got] = up.received
    assert EVENTS[1] not in client.data
    assert not got.finished.called

    await client.until_seen(b"\r\n0\r\n\r\n")  # the terminating chunk: a clean end
    assert await within(got.finished) == "done"
    assert client.data.index(EVENTS[0]) < client.data.index(EVENTS[1])


@pytest_twisted.ensureDeferred
async def test_sse_gzip_stream_is_decodable_event_by_event(up, agent):
    up.enqueue(SSEReply(EVENTS, delay=0.3, gzip=True))
    response = await agent.request(b"GET", up.url.encode() + b"/")
    assert response.headers.getRawHeaders("content-encoding") == ["gzip"]
    [got] = up.received
    decoder = zlib.decompressobj(wbits=31)
    out, snapshots = [], []

    def feed(data: bytes) -> None:
        out.append(decoder.decompress(data))
        if EVENTS[0] in b"".join(out) and not snapshots:
            snapshots.append((b"".join(out), got.finished.called))

    await within(treq.collect(response, feed))
    assert snapshots == [(EVENTS[0], False)]
    assert b"".join(out) == b"".join(EVENTS)
    assert decoder.eof


@pytest_twisted.ensureDeferred
async def test_sse_end_reset_is_not_a_clean_end(up, http):
    up.enqueue(SSEReply(EVENTS, end="reset"))
    response = await http.get(up.url + "/", unbuffered=True)
    pieces = []
    with pytest.raises(ResponseFailed):
        await within(treq.collect(response, pieces.append))
    assert b"".join(pieces) == b"".join(EVENTS)
    assert await within(up.received[0].finished) == "lost"


@pytest_twisted.ensureDeferred
async def test_sse_end_stall_keeps_the_response_open_and_silent(up):
    up.enqueue(SSEReply(EVENTS, end="stall"))
    client = await raw(up, post(b"/", b""))
    await client.until_seen(EVENTS[-1])
    size = await settle(lambda: client.count)
    [got] = up.received
    assert client.data.endswith(EVENTS[-1] + b"\r\n")  # no terminating chunk
    assert not got.finished.called and not client.lost.called
    await up.stop()
    assert isinstance(await within(client.lost), error.ConnectionClosed)
    assert await within(got.finished) == "lost"
    assert client.count == size


# ---------------------------------------------------------------------------------------------
# Stall, Reset, reused connections


@pytest_twisted.ensureDeferred
async def test_stall_never_answers(up):
    up.enqueue(Stall())
    client = await raw(up, post(b"/v1/messages", b"{}"))
    await wait_for(lambda: up.received)
    await sleep(0.3)
    assert client.data == b"" and not client.lost.called
    assert not up.received[0].finished.called
    await up.stop()
    await within(client.lost)
    assert client.data == b""
    assert await within(up.received[0].finished) == "lost"


@pytest_twisted.ensureDeferred
async def test_reset_aborts_without_a_response_byte(up, http):
    up.enqueue(Reset(), Reset())
    client = await raw(up, post(b"/v1/messages", b"{}"))
    reason = await within(client.lost)
    assert client.data == b""
    assert isinstance(reason, error.ConnectionLost)  # an RST, not an orderly close
    with pytest.raises(ResponseNeverReceived):
        await within(http.post(up.url + "/v1/messages", data=b"{}"))
    assert [await within(r.finished) for r in up.received] == ["lost", "lost"]


@pytest_twisted.ensureDeferred
async def test_reset_reused_connections_aborts_a_kept_alive_connection(up, http):
    first = await http.post(up.url + "/v1/messages", data=b"{}")
    await first.content()
    await wait_for(lambda: up.received[0].finished.called)
    up.reset_reused_connections = 1
    up.enqueue(JSONReply({"n": 1}))
    with pytest.raises(ResponseNeverReceived):
        await within(http.post(up.url + "/v1/messages", data=b"{}"))
    third = await http.post(up.url + "/v1/messages", data=b"{}")
    assert await third.json() == {"n": 1}  # the aborted request used no queued reply

    a, b, c = up.received
    assert (a.nth_on_connection, b.nth_on_connection, c.nth_on_connection) == (1, 2, 1)
    assert a.connection == b.connection != c.connection
    assert await within(b.finished) == "lost"
    assert up.reset_reused_connections == 0


# ---------------------------------------------------------------------------------------------
# Flood


@pytest_twisted.ensureDeferred
async def test_flood_writes_exactly_total_bytes_of_valid_sse(up, http):
    total = 1_000_003
    up.enqueue(Flood(total, chunk_size=65536), Flood(10, chunk_size=4))
    response = await http.get(up.url + "/")
    assert response.headers.getRawHeaders("content-type") == ["text/event-stream"]
    body = await response.content()
    assert len(body) == total == up.flood_bytes_written
    # 15 full chunks and a last one of 16963 bytes, each one ping; nothing else dispatched.
    assert parse_sse(body) == [("ping", '{"type":"ping"}')] * 16
    assert body.endswith(b"\n\n")
    assert await within(up.received[0].finished) == "done"

    tiny = await (await http.get(up.url + "/")).content()
    assert len(tiny) == 10 and parse_sse(tiny) == []
    assert up.flood_bytes_written == total + 10


@pytest_twisted.ensureDeferred
async def test_flood_waits_for_a_paused_client(up):
    total = 128 * 1024 * 1024
    up.enqueue(Flood(total))
    client = await raw(up, post(b"/", b""), keep=False)
    client.transport.pauseProducing()  # stop reading: kernel buffers fill, then the fake must wait
    await wait_for(lambda: up.flood_bytes_written > 0)
    written = await settle(lambda: up.flood_bytes_written)
    assert written < total // 8
    assert not up.received[0].finished.called

    client.transport.resumeProducing()
    assert await within(up.received[0].finished, 60) == "done"
    assert up.flood_bytes_written == total
    await client.until(lambda c: c.count > total)  # body plus HTTP framing, all delivered


@pytest_twisted.ensureDeferred
async def test_flood_stops_when_the_client_goes_away(up):
    total = 128 * 1024 * 1024
    up.enqueue(Flood(total))
    client = await raw(up, post(b"/", b""), keep=False)
    client.transport.pauseProducing()
    await wait_for(lambda: up.flood_bytes_written > 0)
    await settle(lambda: up.flood_bytes_written)
    client.transport.abortConnection()
    assert await within(up.received[0].finished) == "lost"
    written = up.flood_bytes_written
    await sleep(0.3)
    assert up.flood_bytes_written == written < total


# ---------------------------------------------------------------------------------------------
# Default streams and their tuning headers


@pytest_twisted.ensureDeferred
async def test_default_streams_follow_the_x_fake_headers(up, http):
    shaped = {"x-fake-events": "7", "x-fake-delay-ms": "1", "x-fake-first-delay-ms": "1"}
    r1 = await http.post(up.url + "/v1/messages?beta=true", json={"stream": True}, headers=shaped)
    assert r1.headers.getRawHeaders("content-type") == ["text/event-stream"]
    events = parse_sse(await r1.content())
    deltas = [ujson.loads(d)["delta"]["text"] for n, d in events if n == "content_block_delta"]
    assert len(deltas) == 7 and "".join(deltas) == HELLO
    assert [n for n, _ in events][:2] == ["message_start", "ping"]
    assert [n for n, _ in events][-2:] == ["message_delta", "message_stop"]

    r2 = await http.post(
        up.url + "/v1/messages", json={"stream": True}, headers={"x-fake-events": "40"}
    )
    deltas = [
        ujson.loads(d)["delta"]["text"]
        for n, d in parse_sse(await r2.content())
        if n == "content_block_delta"
    ]
    assert len(deltas) == 40 and "".join(deltas) == HELLO + " " + HELLO

    r3 = await http.post(
        up.url + "/v1/chat/completions", json={"stream": True}, headers={"x-fake-events": "5"}
    )
    chunks = parse_sse(await r3.content())
    assert chunks[-1] == (None, "[DONE]")
    contents = [ujson.loads(d)["choices"][0]["delta"].get("content") for _, d in chunks[1:-2]]
    assert len(contents) == 5 and "".join(contents) == HELLO
    assert all("usage" not in ujson.loads(d) for _, d in chunks[:-1])  # not asked for


@pytest_twisted.ensureDeferred
async def test_x_fake_expand_plays_a_model_asking_for_an_original(up, http):
    """Opt-in: a text block then a context_guru_expand call; answering that call ends it."""
    ref = "0123456789abcdef"
    shaped = {"x-fake-expand": ref, "x-fake-events": "4"}
    asked = {"model": "claude-x", "stream": True, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_other", "name": "Bash", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_other", "content": "x"}]},
    ]}
    r1 = await http.post(up.url + "/v1/messages?beta=true", json=asked, headers=shaped)
    events = [(n, ujson.loads(d)) for n, d in parse_sse(await r1.content())]
    starts = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert [b["type"] for b in starts] == ["text", "tool_use"]
    assert (starts[1]["name"], starts[1]["id"]) == ("context_guru_expand", cg.testing.FAKE_EXPAND_ID)
    deltas = [d for n, d in events if n == "content_block_delta"]
    assert "".join(d["delta"]["text"] for d in deltas if d["index"] == 0) == HELLO
    assert len([d for d in deltas if d["index"] == 0]) == 4
    call = "".join(d["delta"]["partial_json"] for d in deltas if d["index"] == 1)
    assert ujson.loads(call) == {"id": ref}
    assert [d["delta"]["stop_reason"] for n, d in events if n == "message_delta"] == ["tool_use"]
    assert [n for n, _ in events][-1] == "message_stop"

    answered = dict(asked, messages=asked["messages"] + [
        {"role": "assistant", "content": [{"type": "text", "text": HELLO}, {
            "type": "tool_use", "id": cg.testing.FAKE_EXPAND_ID, "name": "context_guru_expand", "input": {"id": ref}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": cg.testing.FAKE_EXPAND_ID, "content": "o"}]},
    ])
    r2 = await http.post(up.url + "/v1/messages", json=answered, headers=shaped)
    events = [(n, ujson.loads(d)) for n, d in parse_sse(await r2.content())]
    assert [d["content_block"]["type"] for n, d in events if n == "content_block_start"] == ["text"]
    assert [d["delta"]["stop_reason"] for n, d in events if n == "message_delta"] == ["end_turn"]

    r3 = await http.post(up.url + "/v1/messages", json=dict(asked, stream=False), headers=shaped)
    message = ujson.loads(await r3.content())
    assert message["stop_reason"] == "tool_use"
    assert [b["type"] for b in message["content"]] == ["text", "tool_use"]
    assert message["content"][1]["input"] == {"id": ref}
    r4 = await http.post(up.url + "/v1/messages", json=dict(answered, stream=False), headers=shaped)
    assert ujson.loads(await r4.content()) == cg.testing.anthropic_message(model="claude-x")

    # Without the header, or on another path, nothing changes.
    r5 = await http.post(up.url + "/v1/messages", json=asked)
    assert [n for n, _ in parse_sse(await r5.content())].count("content_block_start") == 1
    r7 = await http.post(up.url + "/v1/messages/count_tokens", json=asked, headers=shaped)
    assert ujson.loads(await r7.content()) == {"input_tokens": 10}


# ---------------------------------------------------------------------------------------------
# The official SDKs accept what the fake sends

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest_twisted.ensureDeferred
async def test_anthropic_sdk_parses_the_default_replies(up):
    def call():
        client = anthropic.Anthropic(base_url=up.url, api_key="x", max_retries=0, timeout=TIMEOUT)
        try:
            message = client.messages.create(model="claude-x", max_tokens=10, messages=MESSAGES)
            with client.messages.stream(
                model="claude-x", max_tokens=10, messages=MESSAGES
            ) as stream:
                final = stream.get_final_message()
            return message, final
        finally:
            client.close()

    message, final = await within(deferToThread(call))
    for m in (message, final):
        assert [b.text for b in m.content] == [HELLO]
        assert (m.model, m.stop_reason) == ("claude-x", "end_turn")
        assert (m.usage.input_tokens, m.usage.output_tokens) == (10, 5)
    assert [r.path for r in up.received] == [b"/v1/messages", b"/v1/messages"]
    assert "stream" not in up.received[0].json() and up.received[1].json()["stream"] is True
    assert up.received[0].header(b"anthropic-version") is not None


@pytest_twisted.ensureDeferred
async def test_openai_sdk_parses_the_default_replies(up):
    def call():
        client = openai.OpenAI(base_url=up.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
        try:
            completion = client.chat.completions.create(model="gpt-x", messages=MESSAGES)
            plain = list(
                client.chat.completions.create(model="gpt-x", messages=MESSAGES, stream=True)
            )
            with_usage = list(
                client.chat.completions.create(
                    model="gpt-x",
                    messages=MESSAGES,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            with client.chat.completions.stream(
                model="gpt-x", messages=MESSAGES, stream_options={"include_usage": True}
            ) as stream:
                final = stream.get_final_completion()
            return completion, plain, with_usage, final
        finally:
            client.close()

    completion, plain, with_usage, final = await within(deferToThread(call))
    assert completion.choices[0].message.content == HELLO
    assert completion.usage.total_tokens == 15
    for chunks in (plain, with_usage):
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == HELLO
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert all(c.usage is None for c in plain)
    assert with_usage[-1].choices == [] and with_usage[-1].usage.completion_tokens == 5
    assert final.choices[0].message.content == HELLO and final.usage.prompt_tokens == 10
    assert {r.path for r in up.received} == {b"/v1/chat/completions"}


@pytest_twisted.ensureDeferred
async def test_sdks_accept_scripted_gzip_replies_and_blocks(up):
    two_blocks = anthropic_stream_events(
        blocks=[anthropic_text_block(0, ["zi", "pped"]), anthropic_text_block(1, ["two"])]
    )
    up.enqueue(
        JSONReply(anthropic_message("zipped"), gzip=True),
        SSEReply(two_blocks, gzip=True, delay=0.01),
        SSEReply(openai_stream_events(("zi", "pped")), gzip=True),
    )

    def call():
        a = anthropic.Anthropic(base_url=up.url, api_key="x", max_retries=0, timeout=TIMEOUT)
        o = openai.OpenAI(base_url=up.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
        try:
            message = a.messages.create(model="m", max_tokens=10, messages=MESSAGES)
            with a.messages.stream(model="m", max_tokens=10, messages=MESSAGES) as stream:
                final = stream.get_final_message()
            chunks = list(o.chat.completions.create(model="m", messages=MESSAGES, stream=True))
            return message, final, chunks
        finally:
            a.close()
            o.close()

    message, final, chunks = await within(deferToThread(call))
    assert [b.text for b in message.content] == ["zipped"]
    assert [b.text for b in final.content] == ["zipped", "two"]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "zipped"
    assert chunks[-1].usage.total_tokens == 15


def without_completed_output(events: list[bytes]) -> list[bytes]:
    """The stream with ``output`` dropped from ``response.completed``: the SDK must then rebuild it
    from the ``output_item.done`` items (it returns a completed's ``output`` as sent otherwise)."""
    completed = ujson.loads(parse_sse(events[-1])[0][1])
    del completed["response"]["output"]
    return [*events[:-1], sse_event("response.completed", completed)]


def sdk_dump(items) -> list[dict]:
    """SDK output items as wire dicts; ``exclude_none`` drops the stream helper's own ``parsed: None``."""
    return [item.model_dump(exclude_unset=True, exclude_none=True) for item in items]


@pytest_twisted.ensureDeferred
async def test_openai_sdk_rebuilds_the_responses_json_output_from_the_stream(up):
    """The SDK's stream accumulator checks order, ids and indexes; what it rebuilds from the
    item events must be exactly the output the JSON reply carries."""
    output = [responses_reasoning(), responses_message("Hé/llo <wörld>")]
    up.enqueue(
        JSONReply(responses_response(output)),
        SSEReply(without_completed_output(responses_stream_events(output, deltas=3))),
    )

    def call():
        client = openai.OpenAI(base_url=up.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
        try:
            response = client.responses.create(model="gpt-x", input="hi")
            with client.responses.stream(model="gpt-x", input="hi") as stream:
                texts = [e.snapshot for e in stream if e.type == "response.output_text.delta"]
                final = stream.get_final_response()
            default = list(client.responses.create(model="gpt-x", input="hi", stream=True))
            return response, texts, final, default
        finally:
            client.close()

    response, texts, final, default = await within(deferToThread(call))
    assert sdk_dump(response.output) == output
    assert sdk_dump(final.output) == output
    assert texts == ["Hé/l", "Hé/llo <w", "Hé/llo <wörld>"]
    assert (final.id, final.status, final.output_text) == ("resp_fake", "completed", "Hé/llo <wörld>")
    assert (final.usage.input_tokens, final.usage.output_tokens, final.usage.total_tokens) == (10, 5, 15)

    # The default streamed reply: every event numbered in order; the last carries the whole response.
    assert [e.sequence_number for e in default] == list(range(len(default)))
    assert [e.type for e in default][:2] == ["response.created", "response.in_progress"]
    assert "".join(e.delta for e in default if e.type == "response.output_text.delta") == HELLO
    assert default[-1].type == "response.completed" and default[-1].response.output_text == HELLO
    assert default[-1].response.model == "gpt-x"
    assert [r.path for r in up.received] == [b"/v1/responses"] * 3


def expanding_client(up, ref: str) -> openai.OpenAI:
    """The OpenAI SDK on the fake, playing a model that asks for ``ref`` (4 events a stream)."""
    return openai.OpenAI(base_url=up.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT,
                         default_headers={"x-fake-expand": ref, "x-fake-events": "4"})


@pytest_twisted.ensureDeferred
async def test_openai_sdk_parses_the_fake_expand_call_on_the_responses_api(up):
    """x-fake-expand plays a model calling context_guru_expand; its arguments stream as
    function_call_arguments deltas, and answering the call ends it."""
    ref = "0123456789abcdef"
    asked = [{"role": "user", "content": "hi"}]
    answered = [
        *asked,
        responses_function_call("context_guru_expand", '{"id":"x"}', cg.testing.FAKE_EXPAND_CALL_ID),
        {"type": "function_call_output", "call_id": cg.testing.FAKE_EXPAND_CALL_ID, "output": "original"},
    ]

    def call():
        client = expanding_client(up, ref)
        try:
            with client.responses.stream(model="gpt-x", input=asked) as stream:
                events = list(stream)
                final = stream.get_final_response()
            response = client.responses.create(model="gpt-x", input=asked)
            done = client.responses.create(model="gpt-x", input=answered)
            return events, final, response, done
        finally:
            client.close()

    events, final, response, done = await within(deferToThread(call))
    arguments = '{"id":"' + ref + '"}'  # compact, as the API sends arguments
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) == 4 and {e.output_index for e in deltas} == {1}
    assert "".join(e.delta for e in deltas) == arguments
    [args_done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert (args_done.item_id, args_done.arguments) == ("fc_fake_expand", arguments)
    for r in (final, response):
        assert [item.type for item in r.output] == ["message", "function_call"]
        call_item = r.output[1]
        assert (call_item.name, call_item.call_id) == ("context_guru_expand", cg.testing.FAKE_EXPAND_CALL_ID)
        assert ujson.loads(call_item.arguments) == {"id": ref}
    assert [item.type for item in done.output] == ["message"]


@pytest_twisted.ensureDeferred
async def test_openai_sdk_parses_the_fake_expand_call_on_chat_completions(up):
    """x-fake-expand on /v1/chat/completions: the text, then a context_guru_expand tool call whose
    arguments stream in fragments (finish_reason tool_calls); a tool message answering it ends it."""
    ref = "0123456789abcdef"
    asked = [{"role": "user", "content": "hi"}]
    answered = [
        *asked,
        {"role": "assistant", "content": HELLO, "tool_calls": [{"id": cg.testing.FAKE_EXPAND_CALL_ID, "type": "function",
                                                                 "function": {"name": "context_guru_expand",
                                                                              "arguments": '{"id":"x"}'}}]},
        {"role": "tool", "tool_call_id": cg.testing.FAKE_EXPAND_CALL_ID, "content": "original"},
    ]

    def call():
        client = expanding_client(up, ref)
        try:
            chunks = list(client.chat.completions.create(model="gpt-x", messages=asked, stream=True))
            with client.chat.completions.stream(
                model="gpt-x", messages=asked, stream_options={"include_usage": True}
            ) as stream:
                final = stream.get_final_completion()
            completion = client.chat.completions.create(model="gpt-x", messages=asked)
            done = list(client.chat.completions.create(model="gpt-x", messages=answered, stream=True))
            done_json = client.chat.completions.create(model="gpt-x", messages=answered)
            return chunks, final, completion, done, done_json
        finally:
            client.close()

    chunks, final, completion, done, done_json = await within(deferToThread(call))
    arguments = '{"id":"' + ref + '"}'  # compact, as the API sends arguments
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == HELLO
    calls = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or ()]
    assert len(calls) == 3 and {tc.index for tc in calls} == {0}
    assert (calls[0].id, calls[0].function.name) == (cg.testing.FAKE_EXPAND_CALL_ID, "context_guru_expand")
    assert "".join(tc.function.arguments for tc in calls) == arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]
    for c in (final, completion):
        message = c.choices[0].message
        assert (c.choices[0].finish_reason, message.content) == ("tool_calls", HELLO)
        [tool_call] = message.tool_calls
        assert (tool_call.id, tool_call.function.name) == (cg.testing.FAKE_EXPAND_CALL_ID, "context_guru_expand")
        assert ujson.loads(tool_call.function.arguments) == {"id": ref}
    assert final.usage.prompt_tokens == 10
    assert not any(c.choices[0].delta.tool_calls for c in done if c.choices)
    assert [c.choices[0].finish_reason for c in done if c.choices[0].finish_reason] == ["stop"]
    assert done_json.choices[0].message.tool_calls is None
    assert done_json.choices[0].finish_reason == "stop"


# ---------------------------------------------------------------------------------------------
# Builders


def test_sse_event_framing():
    assert sse_event("ping", {"type": "ping", "s": "é/ x"}) == (
        b'event: ping\ndata: {"type":"ping","s":"\xc3\xa9/ x"}\n\n'
    )
    assert sse_event(None, "[DONE]") == b"data: [DONE]\n\n"
    assert sse_event(None, {"a": 1}) == b'data: {"a":1}\n\n'


def test_stream_builders_follow_the_wire_grammar():
    names = [n for n, _ in parse_sse(b"".join(anthropic_stream_events(("a", "b", "c"))))]
    assert names == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    for name, data in parse_sse(b"".join(anthropic_stream_events())):
        assert ujson.loads(data)["type"] == name

    chunks = parse_sse(b"".join(openai_stream_events(("a", "b"))))
    assert all(name is None for name, _ in chunks)
    bodies = [ujson.loads(d) for _, d in chunks[:-1]]
    assert chunks[-1][1] == "[DONE]"
    assert bodies[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [b["choices"][0]["delta"].get("content") for b in bodies[1:3]] == ["a", "b"]
    assert bodies[3]["choices"][0]["finish_reason"] == "stop"
    assert bodies[4]["choices"] == [] and bodies[4]["usage"]["total_tokens"] == 15
    assert all(b["usage"] is None for b in bodies[:4])
    assert len(openai_stream_events(("a",), include_usage=False)) == 4


def test_responses_stream_follows_the_wire_grammar():
    """Codex reads items only from output_item.done and stops at response.completed; the SDK wants
    the events' order, per-item output_index and sequence numbers as the real API sends them."""
    output = [responses_function_call("f", '{"a":1}'), responses_message("ab")]
    events = [(n, ujson.loads(d)) for n, d in parse_sse(b"".join(responses_stream_events(output)))]
    assert [n for n, _ in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert all(d["type"] == n for n, d in events)
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert [d.get("output_index") for _, d in events[2:-1]] == [0] * 5 + [1] * 7
    assert [d["item"] for n, d in events if n == "response.output_item.done"] == output
    assert events[0][1]["response"]["output"] == [] and events[0][1]["response"]["status"] == "in_progress"
    assert events[-1][1]["response"] == responses_response(output)


# ---------------------------------------------------------------------------------------------
# Standalone process


class _Process(protocol.ProcessProtocol):
    def __init__(self):
        self.out = b""
        self.err = b""
        self.first_line: Deferred = Deferred()
        self.ended: Deferred = Deferred()

    def outReceived(self, data: bytes) -> None:
        self.out += data
        if b"\n" in self.out and not self.first_line.called:
            self.first_line.callback(self.out.split(b"\n", 1)[0])

    def errReceived(self, data: bytes) -> None:
        self.err += data

    def processEnded(self, reason) -> None:
        self.ended.callback(reason.value)


@pytest_twisted.ensureDeferred
async def test_cli_prints_its_port_and_serves_until_terminated(http):
    # Import the same cg this test process uses, however it is installed.
    package_root = str(Path(cg.testing.__file__).parents[1])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])),
    }
    proc = _Process()
    transport = reactor.spawnProcess(
        proc, sys.executable, [sys.executable, "-m", "cg.testing", "--port", "0"], env=env
    )
    try:
        line = await within(proc.first_line)
        assert re.fullmatch(rb"listening [1-9]\d*", line), (line, proc.err)
        url = f"http://127.0.0.1:{int(line.split()[1])}"
        response = await http.post(url + "/v1/messages", json={"model": "m", "stream": True})
        names = [n for n, _ in parse_sse(await response.content())]
        assert names[0] == "message_start" and names[-1] == "message_stop"
    finally:
        if not proc.ended.called:
            transport.signalProcess("TERM")
    reason = await within(proc.ended)
    assert isinstance(reason, error.ProcessDone), (reason, proc.err)
    assert proc.out == line + b"\n"
    assert proc.err == b""
