"""The Inspector through the running proxy: Anthropic streams where cg injected the expand tool.

Real sockets: the fake upstream over TCP, cg in-process, a raw socket client (every byte the client
got, checked by cg.stream.streamcheck) and the official anthropic SDK's ``messages.stream()`` accumulator
(which raises on any index fault). The requests are Claude Code-shaped histories with a big Bash
output that cg offloads behind a marker; the fake plays the model asking for it back. The timers
(pings, the stall deadline) are tested on a Clock, in test_proxy_clock.py.
"""

import copy
import json
import re

import anthropic
import pytest
import ujson
from helpers.bodies import bash_body, history, ident_of, two_bash_body
from helpers.drive import TIMEOUT, post_body, raw_stream, until
from helpers.replies import continuation, stream
from helpers.streams import assert_spliced, events, is_insertion, names, text_of, without_pings
from pytest_twisted import inlineCallbacks
from rawhttp import connect, dechunk, http_request, split_response
from twisted.internet import reactor
from twisted.internet.threads import deferToThread

from cg.stream.streamcheck import check_anthropic_stream
from cg.testing import (
    JSONReply,
    SSEReply,
    anthropic_block_start,
    anthropic_block_stop,
    anthropic_expand_block,
    anthropic_stream_events,
    anthropic_text_block,
    anthropic_thinking_block,
    anthropic_tool_block,
    command_output,
    openai_stream_events,
    sse_event,
)
from cg.wire.markers import EXPAND_TOOL

MARKER = re.compile(rb"<<cg:[0-9a-f]{16}>>")  # a marker (the tool's description shows <<cg:ID>>)


# ---------------------------------------------------------------------------------------------
# Helpers


@inlineCallbacks
def upstream_outcome(received, timeout=2.0):
    """How the fake's request ended ("done" or "lost"), promptly. (Not ``finished.addTimeout``:
    cancelling ``finished`` runs its errback, which would turn a timeout into "lost".)"""
    yield until(lambda: received.finished.called, timeout)
    return (yield received.finished)


def sdk_final(cg, body: dict):
    """The same request through the anthropic SDK's stream accumulator (in a thread)."""
    kwargs = copy.deepcopy(body)
    kwargs.pop("stream", None)
    extra = {key: kwargs.pop(key) for key in ("context_management", "output_config") if key in kwargs}

    def run():
        client = anthropic.Anthropic(base_url=cg.url, api_key="k", max_retries=0, timeout=TIMEOUT)
        with client.messages.stream(**kwargs, extra_body=extra) as stream:
            return stream.get_final_message()

    return deferToThread(run).addTimeout(TIMEOUT + 5, reactor)


def client_body(client) -> bytes:
    """What the raw client has received so far, de-chunked (complete chunks only)."""
    _, _, rest = client.data.partition(b"\r\n\r\n")
    return dechunk(rest)[0]


def assert_sdk_spliced(message, texts: list[str], stop_reason="end_turn"):
    assert [block.type for block in message.content] == ["text"] * len(texts)
    assert [block.text for block in message.content] == texts
    assert message.stop_reason == stop_reason


def expand_turn(received) -> tuple[dict, dict]:
    """The assistant message and the tool_result message a continuation request appended."""
    messages = received.json()["messages"]
    return messages[-2], messages[-1]


def tool_use(id: str, ref: str) -> dict:
    return {"type": "tool_use", "id": id, "name": EXPAND_TOOL, "input": {"id": ref}}


def tool_result(id: str, text: str) -> dict:
    return {"type": "tool_result", "tool_use_id": id, "content": text}


# ---------------------------------------------------------------------------------------------
# Streams that never expand go through as they come


@inlineCallbacks
def test_marker_free_stream_streams_through(make_cg, fake):
    cg = make_cg(anthropic_upstream=fake.url, expand=True)
    body = history("short output\n", "x")
    upstream = anthropic_stream_events(texts=["a"] * 8)
    fake.enqueue(SSEReply(upstream, delay=0.05))
    client = yield post_body(cg, body)
    yield until(lambda: "content_block_delta" in names(client_body(client)))
    assert not fake.received[0].finished.called, "the client waited for the whole stream"
    yield client.closed.addTimeout(TIMEOUT, reactor)
    assert (yield fake.received[0].finished) == "done"
    sent = fake.received[0].body
    assert not MARKER.search(sent) and b'"name":"context_guru_expand"' in sent  # injected, no marker
    assert split_response(client.data)[2] == b"".join(upstream)
    assert check_anthropic_stream(b"".join(upstream)) == []


@inlineCallbacks
def test_marker_bearing_stream_without_expand_streams_through(make_cg, fake):
    cg = make_cg(anthropic_upstream=fake.url, expand=True)
    upstream = stream([anthropic_text_block(0, ["the ", "test ", "fails ", "at ", "line ", "450"])],
                      stop_reason="end_turn")
    fake.enqueue(SSEReply(upstream, delay=0.05))
    client = yield post_body(cg, bash_body())
    yield until(lambda: "message_start" in names(client_body(client)))
    assert not fake.received[0].finished.called, "the client waited for the whole stream"
    yield until(lambda: "content_block_delta" in names(client_body(client)))
    assert not fake.received[0].finished.called, "text was held back"
    yield client.closed.addTimeout(TIMEOUT, reactor)
    assert MARKER.search(fake.received[0].body)
    assert split_response(client.data)[2] == b"".join(upstream)
    assert len(fake.received) == 1
    assert cg.stats.sse.snapshot()["sse_held_events"] == 0


# ---------------------------------------------------------------------------------------------
# Splicing


@inlineCallbacks
def test_expand_after_a_text_block_is_spliced(make_cg, fake):
    cg = make_cg(anthropic_upstream=fake.url, expand=True)
    bash = command_output()
    ident = ident_of(bash)
    round1 = stream([anthropic_text_block(0, ["Let me ", "look."]), anthropic_expand_block(1, ref=ident)],
                    output_tokens=7)
    round2 = continuation(["The failure ", "is on line 450."], input_tokens=9999, output_tokens=11)

    # raw: every byte the client got, and what the continuation carried
    fake.enqueue(SSEReply(round1, delay=0.03), SSEReply(round2))
    client = yield post_body(cg, bash_body(bash))
    yield until(lambda: "Let me look." == text_of(client_body(client)))
    assert len(fake.received) == 1, "round 1's text waited for the continuation"
    yield client.closed.addTimeout(TIMEOUT, reactor)
    _, _, data = split_response(client.data)
    assert_spliced(data, "Let me look.The failure is on line 450.")
    assert [doc["index"] for name, doc in events(data) if name == "content_block_start"] == [0, 1]
    (final,) = [doc for name, doc in events(data) if name == "message_delta"]
    assert final["delta"]["stop_reason"] == "end_turn"
    assert final["usage"]["output_tokens"] == 18 and final["usage"]["input_tokens"] == 10

    first, second = fake.received
    assert len(fake.received) == 2
    assert MARKER.search(first.body) and second.json()["stream"] is True
    assert is_insertion(first.body, second.body), "the continuation rewrote the forwarded request"
    assert second.json()["messages"][:-2] == first.json()["messages"]
    assistant, user = expand_turn(second)
    assert assistant == {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                                          tool_use("toolu_expand_1", ident)]}
    assert user == {"role": "user", "content": [tool_result("toolu_expand_1", bash)]}

    # the SDK's accumulator
    fake.enqueue(SSEReply(round1), SSEReply(round2))
    message = yield sdk_final(cg, bash_body(bash))
    assert_sdk_spliced(message, ["Let me look.", "The failure is on line 450."])
    assert message.usage.output_tokens == 18 and message.usage.input_tokens == 10
    assert expand_turn(fake.received[3])[1] == user


@pytest.mark.parametrize("order", ["expand_first", "client_tool_first"])
@inlineCallbacks
def test_expand_with_a_client_tool_is_verbatim(make_cg, fake, order):
    cg = make_cg(anthropic_upstream=fake.url, expand=True)
    ident = ident_of(command_output())
    if order == "expand_first":
        calls = [anthropic_expand_block(1, ref=ident), anthropic_tool_block(2)]
    else:
        calls = [anthropic_tool_block(1), anthropic_expand_block(2, ref=ident)]
    blocks = [anthropic_text_block(0, ["Checking."]), *calls]
    round1 = stream(blocks)
    fake.enqueue(SSEReply(round1, delay=0.03))
    client = yield post_body(cg, bash_body())

    def bash_events():
        return [(n, d) for n, d in events(client_body(client)) if d and d.get("index") == 2 - (order != "expand_first")]

    yield until(lambda: bash_events())
    assert [n for n, _ in bash_events()] == ["content_block_start"], "the client tool's start was held"
    _, _, data = split_response((yield client.closed.addTimeout(TIMEOUT, reactor)))
    assert data == b"".join(round1)
    assert len(fake.received) == 1
    released = {"client_tool": 1} if order == "expand_first" else {}
    assert cg.stats.sse.snapshot()["sse_released"] == released

    fake.enqueue(SSEReply(round1))
    message = yield sdk_final(cg, bash_body())
    assert [(b.type, getattr(b, "name", None)) for b in message.content][1:] == [
        ("tool_use", "context_guru_expand" if order == "expand_first" else "Bash"),
        ("tool_use", "Bash" if order == "expand_first" else "context_guru_expand"),
    ]
    assert len(fake.received) == 2


@inlineCallbacks
def test_truncated_expand_input_is_verbatim_then_aborted(make_cg, fake):
    cg = make_cg(anthropic_upstream=fake.url, expand=True)
    ident = ident_of(command_output())
    full = stream([anthropic_text_block(0, ["Let me look."]), anthropic_expand_block(1, ref=ident)])
    cut = full.index(anthropic_expand_block(1, ref=ident)[2]) + 1  # the input so far: '{"id": "'
    sent = full[:cut]
    assert sent[-1].endswith(b'"partial_json":"{\\"id\\": \\""}}\n\n')
    fake.enqueue(SSEReply(sent, end="reset"))
    _, data, complete = yield raw_stream(cg, bash_body())
    assert not complete, "a truncated stream must not end cleanly"
    assert len(fake.received) == 1
    assert data == b"".join(sent)


@inlineCallbacks
def test_forever_expanding_upstream_is_cut_at_the_cap(make_cg, fake):
    cg = make_cg(anthropic_upstream=fake.url, expand=True)
    assert cg.service.config.max_expand_rounds == 3
    ident = ident_of(command_output())
    rounds = [stream([anthropic_text_block(0, [f"r{i} "]), anthropic_expand_block(1, ref=ident, id=f"toolu_x{i}")],
                     output_tokens=3) for i in range(5)]
    before = cg.stats.sse.snapshot()

    fake.enqueue(*(SSEReply(r) for r in rounds))
    _, data, complete = yield raw_stream(cg, bash_body())
    assert complete
    assert len(fake.received) == 4, "cap + 1 upstream requests"
    assert check_anthropic_stream(data) == []
    assert text_of(data) == "r0 r1 r2 r3 "
    starts = [doc for name, doc in events(data) if name == "content_block_start"]
    assert [s["index"] for s in starts] == [0, 1, 2, 3, 4]
    assert [s["content_block"]["type"] for s in starts] == ["text"] * 4 + ["tool_use"]
    assert starts[-1]["content_block"]["name"] == EXPAND_TOOL and starts[-1]["content_block"]["id"] == "toolu_x3"
    parts = [doc["delta"]["partial_json"] for name, doc in events(data)
             if name == "content_block_delta" and doc["index"] == 4]
    assert json.loads("".join(parts)) == {"id": ident}
    seen = names(data)
    assert seen.count("message_start") == seen.count("message_delta") == seen.count("message_stop") == 1
    (final,) = [doc for name, doc in events(data) if name == "message_delta"]
    assert final["delta"]["stop_reason"] == "tool_use" and final["usage"]["output_tokens"] == 12
    after = cg.stats.sse.snapshot()
    assert after["sse_streamed"] - before["sse_streamed"] == 1
    assert after["sse_inspected"] - before["sse_inspected"] == 1
    assert after["expand_rounds"] - before["expand_rounds"] == 3
    assert after["sse_buffered"] == 0

    fake.enqueue(*(SSEReply(r) for r in rounds))
    message = yield sdk_final(cg, bash_body())
    assert [b.type for b in message.content] == ["text"] * 4 + ["tool_use"]
    assert message.content[-1].name == EXPAND_TOOL and message.content[-1].input == {"id": ident}
    assert len(fake.received) == 8
    assert cg.stats.sse.snapshot()["sse_streamed"] - before["sse_streamed"] == 2


@inlineCallbacks
def test_an_expand_call_followed_by_text_reaches_the_openai_client_raw(make_cg, fake_openai):
    """The held expand call is released byte for byte when text follows it (CRLF comment, escapes kept)."""
    cg = make_cg(openai_upstream=fake_openai.url, expand=True)
    call = {"index": 0, "id": "call_1", "type": "function",
            "function": {"name": EXPAND_TOOL, "arguments": '{"id":"0123456789abcdef"}'}}
    chunk = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 1, "model": "gpt-5",
             "choices": [{"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": None}]}
    upstream = openai_stream_events(texts=["Hi", " é/<>"])
    upstream.insert(2, sse_event(None, chunk))
    upstream.insert(1, b": keep-alive\r\n\r\n")
    fake_openai.enqueue(SSEReply(upstream, delay=0.01))
    body = {
        "model": "gpt-5", "stream": True, "stream_options": {"include_usage": True},
        "messages": [
            {"role": "user", "content": "run it"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_0", "type": "function", "function": {"name": "shell", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_0", "content": command_output()},
        ],
        "tools": [{"type": "function", "function": {"name": "shell", "parameters": {"type": "object"}}}],
    }
    raw = ujson.dumps(body, ensure_ascii=False).encode()
    client = yield connect(cg.port, http_request("POST", "/v1/chat/completions", raw,
                                                 [("content-type", "application/json")]))
    status, _, data = split_response((yield client.closed.addTimeout(TIMEOUT, reactor)))
    assert status == 200
    assert data == b"".join(upstream)
    stats = cg.stats.sse.snapshot()
    assert stats["sse_inspected"] == 1 and stats["sse_released"] == {"other_block": 1}


@inlineCallbacks
def test_thinking_before_expand_is_carried_exactly(make_cg, fake):
    fake.strict = True
    cg = make_cg(anthropic_upstream=fake.url, expand=True)
    bash = command_output()
    ident = ident_of(bash)
    thought = 'Hmm — the “marker” says \\n "FAIL" at </line>; é 😀\nso I expand it.'
    signature = "EqQBCkYIBxgCKkD+/sig=="
    round1 = stream([
        anthropic_thinking_block(0, thought, signature),
        [anthropic_block_start(1, {"type": "redacted_thinking", "data": "EmwKAhgBEgy+/redacted=="}),
         anthropic_block_stop(1)],
        anthropic_text_block(2, ["Expanding."]),
        anthropic_expand_block(3, ref=ident),
    ])
    round2 = continuation(["Line 450 ", "fails."])

    fake.enqueue(SSEReply(round1), SSEReply(round2))
    _, data, complete = yield raw_stream(cg, bash_body(bash))
    assert complete
    assert fake.rejections == []
    assert len(fake.received) == 2
    assistant, user = expand_turn(fake.received[1])
    assert assistant["content"][:2] == [
        {"type": "thinking", "thinking": thought, "signature": signature},
        {"type": "redacted_thinking", "data": "EmwKAhgBEgy+/redacted=="},
    ]
    assert assistant["content"][2:] == [{"type": "text", "text": "Expanding."}, tool_use("toolu_expand_3", ident)]
    assert user["content"] == [tool_result("toolu_expand_3", bash)]
    assert_spliced(data, "Expanding.Line 450 fails.")
    assert data.startswith(b"".join(round1[:2 + 5 + 2]))  # thinking and redacted blocks byte for byte

    fake.enqueue(SSEReply(round1), SSEReply(round2))
    message = yield sdk_final(cg, bash_body(bash))
    assert [b.type for b in message.content] == ["thinking", "redacted_thinking", "text", "text"]
    assert message.content[0].thinking == thought and message.content[0].signature == signature
    assert fake.rejections == []


@inlineCallbacks
def test_two_expand_calls_in_one_turn_are_answered_in_order(make_cg, fake):
    cg = make_cg(anthropic_upstream=fake.url, expand=True)
    first, second = command_output(), command_output(700).replace("PASS", "OK  ")
    body = two_bash_body(first, second)
    id1, id2 = ident_of(first), ident_of(second)
    round1 = stream([anthropic_text_block(0, ["Both."]),
                     anthropic_expand_block(1, ref=id2), anthropic_expand_block(2, ref=f"<<cg:{id1}>>")])
    round2 = continuation(["Compared."])

    fake.enqueue(SSEReply(round1), SSEReply(round2))
    _, data, complete = yield raw_stream(cg, body)
    assert complete
    assert len(set(MARKER.findall(fake.received[0].body))) == 2
    assistant, user = expand_turn(fake.received[1])
    assert assistant["content"][1:] == [tool_use("toolu_expand_1", id2), tool_use("toolu_expand_2", f"<<cg:{id1}>>")]
    assert user["content"] == [tool_result("toolu_expand_1", second), tool_result("toolu_expand_2", first)]
    assert_spliced(data, "Both.Compared.")

    fake.enqueue(SSEReply(round1), SSEReply(round2))
    assert_sdk_spliced((yield sdk_final(cg, body)), ["Both.", "Compared."])


@inlineCallbacks
def test_expand_as_the_first_block(make_cg, fake):
    cg = make_cg(anthropic_upstream=fake.url, expand=True)
    bash = command_output()
    ident = ident_of(bash)
    round1 = stream([anthropic_expand_block(0, ref=ident)])
    round2 = continuation(["Found it."])

    fake.enqueue(SSEReply(round1), SSEReply(round2))
    _, data, complete = yield raw_stream(cg, bash_body(bash))
    assert complete
    assistant, user = expand_turn(fake.received[1])
    assert assistant == {"role": "assistant", "content": [tool_use("toolu_expand_0", ident)]}
    assert user["content"] == [tool_result("toolu_expand_0", bash)]
    assert_spliced(data, "Found it.")
    assert [doc["index"] for name, doc in events(data) if name == "content_block_start"] == [0]

    fake.enqueue(SSEReply(round1), SSEReply(round2))
    assert_sdk_spliced((yield sdk_final(cg, bash_body(bash))), ["Found it."])


@inlineCallbacks
def test_a_continuation_that_expands_again(make_cg, fake):
    cg = make_cg(anthropic_upstream=fake.url, expand=True)
    first, second = command_output(), command_output(700).replace("PASS", "OK  ")
    body = two_bash_body(first, second)
    id1, id2 = ident_of(first), ident_of(second)
    round1 = stream([anthropic_text_block(0, ["One."]), anthropic_expand_block(1, ref=id1, id="toolu_e1")],
                    output_tokens=2)
    round2 = stream([anthropic_text_block(0, ["Two."]), anthropic_expand_block(1, ref=id2, id="toolu_e2")],
                    output_tokens=3)
    round3 = continuation(["Three."], output_tokens=4)

    fake.enqueue(SSEReply(round1), SSEReply(round2), SSEReply(round3))
    _, data, complete = yield raw_stream(cg, body)
    assert complete
    assert len(fake.received) == 3
    one, two, three = fake.received
    assert is_insertion(one.body, two.body) and is_insertion(two.body, three.body)
    assert three.json()["messages"][:-2] == two.json()["messages"]
    assert three.json()["messages"][-4:] == [
        {"role": "assistant", "content": [{"type": "text", "text": "One."}, tool_use("toolu_e1", id1)]},
        {"role": "user", "content": [tool_result("toolu_e1", first)]},
        {"role": "assistant", "content": [{"type": "text", "text": "Two."}, tool_use("toolu_e2", id2)]},
        {"role": "user", "content": [tool_result("toolu_e2", second)]},
    ]
    assert_spliced(data, "One.Two.Three.")
    assert [doc["index"] for name, doc in events(data) if name == "content_block_start"] == [0, 1, 2]
    (final,) = [doc for name, doc in events(data) if name == "message_delta"]
    assert final["usage"]["output_tokens"] == 9

    fake.enqueue(SSEReply(round1), SSEReply(round2), SSEReply(round3))
    message = yield sdk_final(cg, body)
    assert_sdk_spliced(message, ["One.", "Two.", "Three."])
    assert message.usage.output_tokens == 9


# ---------------------------------------------------------------------------------------------
# Failures


OVERLOADED = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}


@inlineCallbacks
def test_continuation_refused_gives_round_one_verbatim(make_cg, fake):
    cg = make_cg(anthropic_upstream=fake.url, expand=True)
    ident = ident_of(command_output())
    round1 = stream([anthropic_text_block(0, ["Let me look."]), anthropic_expand_block(1, ref=ident)])

    fake.enqueue(SSEReply(round1), JSONReply(OVERLOADED, status=529))
    _, data, complete = yield raw_stream(cg, bash_body())
    assert complete
    assert len(fake.received) == 2
    assert data == b"".join(round1)
    assert check_anthropic_stream(data) == []
    stats = cg.stats.snapshot()
    assert stats["sse_released"] == {"continuation_failed": 1}
    assert stats["expand"]["continuations_failed"] == 1
    assert stats["sse_spliced"] == 0

    fake.enqueue(SSEReply(round1), JSONReply(OVERLOADED, status=529))
    message = yield sdk_final(cg, bash_body())
    assert [b.type for b in message.content] == ["text", "tool_use"]
    assert message.content[1].name == EXPAND_TOOL and message.content[1].input == {"id": ident}
    assert message.stop_reason == "tool_use"


@inlineCallbacks
def test_continuation_that_breaks_before_its_first_block_gives_round_one_verbatim(make_cg, fake):
    cg = make_cg(anthropic_upstream=fake.url, expand=True)
    ident = ident_of(command_output())
    round1 = stream([anthropic_text_block(0, ["Let me look."]), anthropic_expand_block(1, ref=ident)])
    fake.enqueue(SSEReply(round1), SSEReply(continuation(["never"])[:2], end="reset"))  # start, ping
    _, data, complete = yield raw_stream(cg, bash_body())
    assert complete
    assert without_pings(data) == without_pings(b"".join(round1))  # the continuation's ping may pass
    assert check_anthropic_stream(data) == []
    assert cg.stats.sse.snapshot()["sse_released"] == {"continuation_failed": 1}


@pytest.mark.parametrize("end", ["reset", "close"])
@inlineCallbacks
def test_continuation_that_breaks_midway_aborts_the_client(make_cg, fake, end):
    cg = make_cg(anthropic_upstream=fake.url, expand=True)
    ident = ident_of(command_output())
    round1 = stream([anthropic_text_block(0, ["Let me look."]), anthropic_expand_block(1, ref=ident)])
    # start, ping, block start, 2 deltas; then a reset, or a clean close without message_stop
    broken = continuation(["The failure ", "is on ", "line 450."])[:5]

    fake.enqueue(SSEReply(round1), SSEReply(broken, delay=0.05, end=end))
    _, data, complete = yield raw_stream(cg, bash_body())
    assert not complete, "a broken continuation must not look like a complete response"
    assert "message_delta" not in names(data) and "message_stop" not in names(data)
    assert text_of(data) == "Let me look.The failure is on "  # every byte upstream sent, then the break
    assert cg.stats.upstream_errors == 1

    fake.enqueue(SSEReply(round1), SSEReply(broken, end=end))
    with pytest.raises(Exception) as caught:  # noqa: B017 — the SDK's transport error, not a message
        yield sdk_final(cg, bash_body())
    assert not isinstance(caught.value, AssertionError)


@inlineCallbacks
def test_client_disconnect_during_a_streaming_continuation_cancels_it(make_cg, fake):
    cg = make_cg(anthropic_upstream=fake.url, expand=True)
    ident = ident_of(command_output())
    round1 = stream([anthropic_text_block(0, ["Let me look."]), anthropic_expand_block(1, ref=ident)])
    fake.enqueue(SSEReply(round1), SSEReply(continuation(["slow "] * 50), delay=0.1))
    client = yield post_body(cg, bash_body())
    yield until(lambda: "slow " in text_of(client_body(client)))
    assert not fake.received[1].finished.called
    client.transport.abortConnection()
    assert (yield upstream_outcome(fake.received[1])) == "lost"
    yield until(lambda: cg.stats.in_flight == 0)
    assert cg.stats.client_disconnects == 1


@inlineCallbacks
def test_stats_after_a_splice(make_cg, fake):
    cg = make_cg(anthropic_upstream=fake.url, expand=True)
    ident = ident_of(command_output())
    fake.enqueue(SSEReply(stream([anthropic_text_block(0, ["Look."]), anthropic_expand_block(1, ref=ident)])),
                 SSEReply(continuation(["Done."])))
    _, data, complete = yield raw_stream(cg, bash_body())
    assert complete and text_of(data) == "Look.Done."
    client = yield connect(cg.port, http_request("GET", "/stats"))
    status, _, body = split_response((yield client.closed.addTimeout(TIMEOUT, reactor)))
    assert status == 200
    stats = json.loads(body)
    assert stats["sse_streamed"] == 1 and stats["sse_inspected"] == 1
    assert stats["sse_spliced"] == 1
    assert stats["expand_rounds"] == 1
    assert stats["sse_held_events"] > 0
    assert stats["sse_buffered"] == 0 and stats["sse_buffered_pct"] == 0.0
    assert stats["sse_released"] == {}
    assert stats["expand"]["resolved"] == 1 and stats["expand"]["bounces"] == 1
