"""cg.stream.usage: billed usage from responses and streams, running totals, session keys."""

import json

import pytest
import ujson
from fixturedata import claude_code_request
from hypothesis import given, settings
from hypothesis import strategies as st

from cg.stream.usage import (
    StreamUsage,
    Usage,
    UsageTotals,
    anthropic_usage,
    openai_usage,
    session_key,
)
from cg.testing import (
    anthropic_message,
    anthropic_stream_events,
    openai_completion,
    openai_stream_events,
    sse_event,
)
from cg.wire import jsonbytes
from cg.wire.body import ParsedBody
from cg.wire.dialect import CHAT_SHAPE, MESSAGES_SHAPE
from cg.wire.sse import Event, SSEParser


def events_of(*raw: bytes) -> list[Event]:
    parser = SSEParser()
    events = parser.feed(b"".join(raw))
    assert parser.close() == b""
    return events


def stream_usage(dialect: str, raw_events) -> StreamUsage:
    reader = StreamUsage(dialect)
    for event in events_of(*raw_events):
        reader.observe(event)
    return reader


def message_start(**usage) -> bytes:
    return sse_event(
        "message_start",
        {
            "type": "message_start",
            "message": {
                "id": "msg_1",
                "type": "message",
                "role": "assistant",
                "model": "claude-opus-4-8",
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": usage,
            },
        },
    )


def message_delta(**usage) -> bytes:
    return sse_event(
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": "end_turn", "stop_sequence": None},
            "usage": usage,
        },
    )


MESSAGE_STOP = sse_event("message_stop", {"type": "message_stop"})
PING = sse_event("ping", {"type": "ping"})


# ---------------------------------------------------------------------------------------------
# Usage


def test_usage_defaults_add_and_as_dict():
    assert Usage().as_dict() == {
        "input_tokens": 0,
        "cache_read_tokens": 0,
        "cache_write_tokens": 0,
        "cache_write_1h_tokens": 0,
        "output_tokens": 0,
    }
    a = Usage(1, 2, 3, 4)
    b = Usage(input_tokens=10, cache_read_tokens=20, cache_write_tokens=30, output_tokens=40)
    assert a + b == Usage(11, 22, 33, 44)
    assert sum([a, b, a]) == Usage(12, 24, 36, 48)
    assert a.prompt_tokens == 6
    assert Usage(cache_read_tokens=100, cache_write_tokens=25).cache_write_read_ratio == 0.25
    assert Usage(cache_write_tokens=25).cache_write_read_ratio is None
    with pytest.raises(TypeError):
        a + 1  # noqa: B018


# ---------------------------------------------------------------------------------------------
# Non-streaming responses


def test_anthropic_usage():
    message = anthropic_message(
        usage={
            "input_tokens": 12,
            "cache_creation_input_tokens": 300,
            "cache_read_input_tokens": 45_000,
            "output_tokens": 77,
            "cache_creation": {"ephemeral_5m_input_tokens": 300, "ephemeral_1h_input_tokens": 0},
            "service_tier": "standard",
        }
    )
    assert anthropic_usage(message) == Usage(12, 45_000, 300, 77)


def test_anthropic_cache_writes_for_an_hour_are_counted_apart():
    usage = {"input_tokens": 1, "cache_creation_input_tokens": 500, "cache_read_input_tokens": 0, "output_tokens": 2,
             "cache_creation": {"ephemeral_5m_input_tokens": 200, "ephemeral_1h_input_tokens": 300}}
    assert anthropic_usage(anthropic_message(usage=usage)) == Usage(1, 0, 500, 2, cache_write_1h_tokens=300)
    assert Usage(cache_write_1h_tokens=3) + Usage(cache_write_1h_tokens=4) == Usage(cache_write_1h_tokens=7)
    # A stream: message_start's split stands when message_delta carries none.
    reader = stream_usage(MESSAGES_SHAPE, [message_start(**usage), message_delta(output_tokens=9), MESSAGE_STOP])
    assert reader.usage == Usage(1, 0, 500, 9, cache_write_1h_tokens=300)
    for bad in (None, "x", {"ephemeral_1h_input_tokens": -1}, {"ephemeral_1h_input_tokens": True}):
        assert anthropic_usage({"usage": {"cache_creation": bad}}) == Usage()


def test_anthropic_usage_missing_or_null_fields_count_as_zero():
    assert anthropic_usage(anthropic_message(usage={"input_tokens": 5, "output_tokens": 2})) == Usage(
        5, 0, 0, 2
    )
    nulls = {"input_tokens": 5, "cache_creation_input_tokens": None, "cache_read_input_tokens": "x"}
    assert anthropic_usage({"usage": nulls}) == Usage(input_tokens=5)
    assert anthropic_usage({"type": "message"}) == Usage()
    assert anthropic_usage({"usage": [1, 2]}) == Usage()
    assert anthropic_usage({"usage": {"input_tokens": True, "output_tokens": -3}}) == Usage()
    assert anthropic_usage(None) == Usage()  # type: ignore[arg-type]


def test_openai_usage_maps_cached_prompt_tokens_to_cache_reads():
    doc = openai_completion(
        usage={
            "prompt_tokens": 2006,
            "completion_tokens": 300,
            "total_tokens": 2306,
            "prompt_tokens_details": {"cached_tokens": 1920, "audio_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": 0},
        }
    )
    # prompt_tokens includes the cached ones; OpenAI has no cache-write charge.
    assert openai_usage(doc) == Usage(
        input_tokens=86, cache_read_tokens=1920, cache_write_tokens=0, output_tokens=300
    )


def test_openai_usage_without_details_or_usage():
    assert openai_usage(openai_completion()) == Usage(input_tokens=10, output_tokens=5)
    assert openai_usage({"usage": None}) == Usage()
    assert openai_usage({}) == Usage()
    details_null = {"prompt_tokens": 7, "completion_tokens": 1, "prompt_tokens_details": None}
    assert openai_usage({"usage": details_null}) == Usage(input_tokens=7, output_tokens=1)


def test_openai_responses_api_shape():
    usage = {"input_tokens": 50, "input_tokens_details": {"cached_tokens": 40}, "output_tokens": 9}
    assert openai_usage({"usage": usage}) == Usage(input_tokens=10, cache_read_tokens=40, output_tokens=9)


# ---------------------------------------------------------------------------------------------
# Anthropic streams


def test_anthropic_stream_from_the_fake_upstream():
    reader = stream_usage(MESSAGES_SHAPE, anthropic_stream_events(input_tokens=123, output_tokens=45))
    assert reader.usage == Usage(input_tokens=123, output_tokens=45)  # 45 replaced message_start's 1
    assert reader.complete and reader.has_usage


def test_message_delta_overwrites_never_adds():
    reader = stream_usage(
        MESSAGES_SHAPE,
        [
            message_start(
                input_tokens=10,
                cache_read_input_tokens=40_000,
                cache_creation_input_tokens=500,
                output_tokens=1,
            ),
            PING,
            message_delta(output_tokens=7),
            message_delta(output_tokens=30, input_tokens=12, cache_read_input_tokens=40_100),
            MESSAGE_STOP,
        ],
    )
    # Cumulative totals: fields present in a delta replace the values so far (input 12, not 22;
    # output 30, not 38); absent ones keep message_start's (cache write 500).
    assert reader.usage == Usage(
        input_tokens=12, cache_read_tokens=40_100, cache_write_tokens=500, output_tokens=30
    )
    assert reader.complete


def test_message_delta_null_fields_keep_earlier_values():
    reader = stream_usage(
        MESSAGES_SHAPE,
        [
            message_start(input_tokens=10, cache_read_input_tokens=99, output_tokens=1),
            message_delta(output_tokens=8, input_tokens=None, cache_read_input_tokens=None),
        ],
    )
    assert reader.usage == Usage(input_tokens=10, cache_read_tokens=99, output_tokens=8)


def test_stream_cut_before_message_delta_keeps_message_start_usage():
    raw = anthropic_stream_events(input_tokens=500, output_tokens=60)
    cut = b"".join(raw[:4])  # message_start, ping, content_block_start, first delta
    reader = StreamUsage(MESSAGES_SHAPE)
    parser = SSEParser()
    for event in parser.feed(cut + raw[4][:10]):
        reader.observe(event)
    assert parser.close() == raw[4][:10]
    assert reader.usage == Usage(input_tokens=500, output_tokens=1)
    assert reader.has_usage and not reader.complete


def test_stream_with_deltas_but_no_message_stop_is_incomplete():
    raw = anthropic_stream_events(input_tokens=5, output_tokens=6)
    reader = stream_usage(MESSAGES_SHAPE, raw[:-1])
    assert reader.usage == Usage(input_tokens=5, output_tokens=6)
    assert not reader.complete


def test_empty_anthropic_stream():
    reader = StreamUsage(MESSAGES_SHAPE)
    assert reader.usage == Usage() and not reader.has_usage and not reader.complete


def test_anthropic_events_without_event_line_are_read_by_type():
    start = message_start(input_tokens=3, output_tokens=1).split(b"\n", 1)[1]  # drop "event: …"
    reader = stream_usage(MESSAGES_SHAPE, [start, b'data: {"type":"message_stop"}\n\n'])
    assert reader.usage == Usage(input_tokens=3, output_tokens=1)
    assert reader.complete


def test_a_second_message_start_starts_over():
    reader = stream_usage(
        MESSAGES_SHAPE,
        [
            message_start(input_tokens=10, output_tokens=1),
            message_delta(output_tokens=5),
            message_start(input_tokens=4),
        ],
    )
    assert reader.usage == Usage(input_tokens=4)


def test_unreadable_events_are_ignored():
    reader = stream_usage(
        MESSAGES_SHAPE,
        [
            message_start(input_tokens=10, output_tokens=1),
            b"event: message_delta\ndata: {not json\n\n",
            b"event: message_delta\ndata: []\n\n",
            b'event: message_delta\ndata: {"usage": "lots"}\n\n',
            b'event: message_delta\ndata: {"usage": {"output_tokens": "9"}}\n\n',
            b'event: message_start\ndata: {"message": null}\n\n',
            b'event: message_start\ndata: {"message": {"usage": 3}}\n\n',
            b": comment\n\n",
            b"\n",
            b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error","message":"x"}}\n\n',
        ],
    )
    assert reader.usage == Usage(input_tokens=10, output_tokens=1)
    assert not reader.complete


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from([MESSAGES_SHAPE, CHAT_SHAPE]),
    st.lists(st.tuples(st.one_of(st.none(), st.text(max_size=20)), st.binary(max_size=60))),
)
def test_observe_never_raises(dialect, events):
    reader = StreamUsage(dialect)
    for name, data in events:
        reader.observe(Event(b"", name, data))
    for name in ("message_start", "message_delta", None):
        for data in (
            b'{"type":"message_start","message":{"usage":{"input_tokens":1e400}}}',
            b'"usage"',
            b"[1]",
        ):
            reader.observe(Event(b"", name, data))
    assert isinstance(reader.usage, Usage)


def test_a_dialect_name_is_not_an_adapter():
    with pytest.raises(AttributeError):
        StreamUsage("anthropic")


# ---------------------------------------------------------------------------------------------
# OpenAI streams


def test_openai_stream_with_include_usage():
    reader = stream_usage(CHAT_SHAPE, openai_stream_events(prompt_tokens=40, completion_tokens=9))
    assert reader.usage == Usage(input_tokens=40, output_tokens=9)
    assert reader.complete and reader.has_usage


def test_openai_stream_without_include_usage():
    reader = stream_usage(CHAT_SHAPE, openai_stream_events(include_usage=False))
    assert reader.usage == Usage()
    assert reader.complete and not reader.has_usage


def test_openai_stream_cut_before_the_usage_chunk():
    raw = openai_stream_events(prompt_tokens=40, completion_tokens=9)
    reader = stream_usage(CHAT_SHAPE, raw[:-2])  # no usage chunk, no [DONE]
    assert reader.usage == Usage() and not reader.has_usage and not reader.complete
    reader = stream_usage(CHAT_SHAPE, raw[:-1])  # the usage chunk, no [DONE]
    assert reader.usage == Usage(input_tokens=40, output_tokens=9)
    assert reader.has_usage and not reader.complete


def test_openai_stream_cached_tokens_and_a_later_null_usage_does_not_erase():
    usage = {
        "prompt_tokens": 3000,
        "completion_tokens": 12,
        "total_tokens": 3012,
        "prompt_tokens_details": {"cached_tokens": 2048},
    }
    raw = [
        sse_event(None, {"id": "c", "object": "chat.completion.chunk", "choices": [], "usage": usage}),
        sse_event(None, {"id": "c", "object": "chat.completion.chunk", "choices": [], "usage": None}),
        sse_event(None, '{"error":{"message":"boom","type":"server_error"}}'),
        sse_event(None, "[DONE]"),
    ]
    reader = stream_usage(CHAT_SHAPE, raw)
    assert reader.usage == Usage(input_tokens=952, cache_read_tokens=2048, output_tokens=12)
    assert reader.complete


def test_openai_usage_string_inside_content_is_not_usage():
    chunk = {
        "id": "c",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": '"usage":{"prompt_tokens":5}'}, "finish_reason": None}],
        "usage": None,
    }
    reader = stream_usage(CHAT_SHAPE, [sse_event(None, chunk)])
    assert not reader.has_usage


def test_openai_usage_with_spaces_in_json_is_read():
    raw = b'data: {"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": 2}}\n\ndata: [DONE]\n\n'
    reader = stream_usage(CHAT_SHAPE, [raw])
    assert reader.usage == Usage(input_tokens=8, output_tokens=2) and reader.complete


# ---------------------------------------------------------------------------------------------
# Totals


def test_totals_and_ratio():
    totals = UsageTotals()
    assert totals.cache_write_read_ratio is None and totals.requests == 0
    totals.add(Usage(10, 0, 1000, 5), "a")
    assert totals.cache_write_read_ratio is None  # writes but no reads yet
    totals.add(Usage(10, 4000, 0, 5), "a")
    totals.add(Usage(2, 0, 0, 1))
    assert totals.requests == 3
    assert totals.usage == Usage(22, 4000, 1000, 11)
    assert totals.cache_write_read_ratio == 0.25
    session = totals.session("a")
    assert session.requests == 2 and session.usage == Usage(20, 4000, 1000, 10)
    assert totals.session("-").requests == 1
    snapshot = totals.as_dict()
    assert snapshot["requests"] == 3
    assert snapshot["cache_write_read_ratio"] == 0.25
    assert snapshot["input_tokens"] == 22 and snapshot["cache_read_tokens"] == 4000
    assert snapshot["busiest_sessions"][0] == {
        "session": "a",
        "requests": 2,
        "input_tokens": 20,
        "cache_read_tokens": 4000,
        "cache_write_tokens": 1000,
        "output_tokens": 10,
        "cache_write_1h_tokens": 0,
        "cache_write_read_ratio": 0.25,
    }
    json.dumps(snapshot)  # /stats serves it as JSON


def test_busiest_ranks_by_prompt_tokens():
    totals = UsageTotals()
    totals.add(Usage(input_tokens=100), "small")
    totals.add(Usage(cache_read_tokens=90_000, output_tokens=1), "cached")
    totals.add(Usage(input_tokens=5000, output_tokens=50_000), "talkative")
    totals.add(Usage(cache_write_tokens=6000), "writer")
    assert [s.session for s in totals.busiest(3)] == ["cached", "writer", "talkative"]
    assert [s.session for s in totals.busiest(10)] == ["cached", "writer", "talkative", "small"]
    assert totals.busiest(0) == []


def test_sessions_are_bounded_least_recently_used_goes():
    totals = UsageTotals(max_sessions=3)
    totals.add(Usage(input_tokens=10_000), "big-old")
    totals.add(Usage(input_tokens=1), "b")
    totals.add(Usage(input_tokens=1), "c")
    totals.add(Usage(input_tokens=1), "b")  # b is active again
    totals.add(Usage(input_tokens=1), "d")  # evicts big-old: idle longest, however big
    assert [s.session for s in totals.sessions()] == ["c", "b", "d"]
    assert totals.session("big-old") is None and totals.sessions_evicted == 1
    totals.add(Usage(input_tokens=1), "e")  # evicts c
    assert sorted(s.session for s in totals.sessions()) == ["b", "d", "e"]
    assert totals.usage.input_tokens == 10_005 and totals.requests == 6  # totals keep everything
    for i in range(1000):
        totals.add(Usage(input_tokens=i), f"s{i}")
    assert len(list(totals.sessions())) == 3 and totals.as_dict()["sessions_kept"] == 3
    with pytest.raises(ValueError):
        UsageTotals(max_sessions=0)


# ---------------------------------------------------------------------------------------------
# Session keys


def headers(**values):
    values = {k.replace("_", "-"): v for k, v in values.items()}
    return lambda name: values.get(name.lower())


NO_HEADERS = headers()


def key(headers_get, body: dict | None, earlier: ParsedBody | None = None) -> str:
    """`session_key` of `body` as the proxy parses it (against the conversation's last body)."""
    parsed = ParsedBody.parse(json.dumps(body).encode(), earlier and earlier.earlier()) if body is not None else None
    return session_key(headers_get, parsed)
UUID = "7b3f5a2e-1c4d-4e8f-9a0b-112233445566"


def test_session_header_wins():
    body = {"metadata": {"user_id": f"user_abc_account_x_session_{UUID[::-1]}"}}
    assert key(headers(x_claude_code_session_id=UUID), body) == UUID
    assert key(headers(x_claude_code_session_id=" " + UUID + " "), None) == UUID


def test_session_from_legacy_user_id():
    user_id = f"user_{'ab' * 32}_account_0f0e0d0c-aaaa-bbbb-cccc-ddddeeeeffff_session_{UUID}"
    assert key(NO_HEADERS, {"metadata": {"user_id": user_id}}) == UUID
    assert key(headers(x_claude_code_session_id=""), {"metadata": {"user_id": user_id}}) == UUID
    no_account = f"user_{'ab' * 32}_account__session_{UUID}"
    assert key(NO_HEADERS, {"metadata": {"user_id": no_account}}) == UUID


def test_session_from_json_user_id():
    user_id = ujson.dumps({"device_id": "d" * 64, "account_uuid": "", "session_id": UUID})
    assert key(NO_HEADERS, {"metadata": {"user_id": user_id}}) == UUID


def test_user_id_without_a_session_falls_through_to_the_first_message():
    body = {"metadata": {"user_id": "user_abc"}, "messages": [{"role": "user", "content": "hi"}]}
    opened = key(NO_HEADERS, body)
    assert opened.startswith("h:") and len(opened) == 18
    body["metadata"]["user_id"] = '{"device_id": "x"}'
    assert key(NO_HEADERS, body) == opened
    body["metadata"]["user_id"] = "{not json"
    assert key(NO_HEADERS, body) == opened


def test_first_user_message_hash_is_stable_across_turns():
    first = {
        "messages": [
            {"role": "system", "content": "mid-conversation system"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
                    {"type": "text", "text": "fix the bug", "cache_control": {"type": "ephemeral"}},
                ],
            },
        ]
    }
    later = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
                    {"type": "text", "text": "fix the bug"},
                ],
            },
            {"role": "assistant", "content": [{"type": "text", "text": "done"}]},
            {
                "role": "user",
                "content": [{"type": "text", "text": "thanks", "cache_control": {"type": "ephemeral"}}],
            },
        ]
    }
    assert key(NO_HEADERS, first) == key(NO_HEADERS, later)
    other = {"messages": [{"role": "user", "content": "fix the other bug"}]}
    assert key(NO_HEADERS, other) != key(NO_HEADERS, first)


def test_claude_code_fixtures():
    first, second = claude_code_request("p_first_request"), claude_code_request("p_second_request_tool_result")
    other = claude_code_request("p_second_request_after_thinking")
    # With the header (what Claude Code sends): the header's session.
    for request in (first, second):
        assert (
            key(request["headers"].get, request["body"])
            == request["headers"]["x-claude-code-session-id"]
        )
    # Without it, the first user message still ties the turns of one session together.
    assert key(NO_HEADERS, first["body"]) == key(NO_HEADERS, second["body"])
    assert key(NO_HEADERS, first["body"]) != key(NO_HEADERS, other["body"])
    assert key(NO_HEADERS, first["body"]).startswith("h:")


def test_a_later_turn_takes_the_first_user_message_s_hash_without_reading_it(monkeypatch):
    """A client with no session header: the hash of its first user message is carried from turn to
    turn, not read again (the memo keeps no message values: cg.wire.body.Messages)."""
    history = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "fix the bug " * 500}]
    first = ParsedBody.parse(json.dumps({"messages": history}).encode())
    expected = session_key(NO_HEADERS, first)
    assert expected.startswith("h:")
    scans = []
    monkeypatch.setattr(jsonbytes, "scan", lambda raw, span: scans.append(span) or json.loads(raw[span[0]:span[1]]))
    history += [{"role": "assistant", "content": "done"}, {"role": "user", "content": "thanks"}]
    assert key(NO_HEADERS, {"messages": history}, first) == expected and scans == []
    # A client rewrote it, the same length: the same span, past what the two bodies share. Hashed again.
    history[1] = {"role": "user", "content": "fix the bog " * 500}
    assert key(NO_HEADERS, {"messages": history}, first) == key(NO_HEADERS, {"messages": history[1:2]}) != expected


def test_no_session_at_all():
    assert key(NO_HEADERS, None) == "-"
    assert key(NO_HEADERS, {}) == "-"
    assert key(NO_HEADERS, {"messages": [{"role": "assistant", "content": "x"}]}) == "-"
    assert key(NO_HEADERS, {"messages": "nope", "metadata": "nope"}) == "-"
    assert key(NO_HEADERS, {"messages": [{"role": "user", "content": ""}]}) == "-"
    assert key(NO_HEADERS, [1, 2]) == "-"  # type: ignore[arg-type]

    def broken(name):
        raise KeyError(name)

    assert key(broken, None) == "-"


def test_openai_messages_hash_too():
    body = {
        "messages": [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": [{"type": "text", "text": "q"}]},
        ]
    }
    opened = key(NO_HEADERS, body)
    body["messages"] += [{"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}]
    assert key(NO_HEADERS, body) == opened != "-"
