"""cg.stream.inspector: forward at once, hold only a lone expand call, splice continuations.

Upstream streams are built with cg.testing's builders, parsed with cg.wire.sse.SSEParser (as the proxy
does) and fed to an Inspector; every client stream that went through a splice is checked by
cg.stream.streamcheck and by the official anthropic SDK's accumulator (which raises on index faults).
"""

from __future__ import annotations

import anthropic
import attrs
import httpx2
import pytest
import ujson
from helpers.streams import cutting, events_of, feed_round
from hypothesis import given, settings
from hypothesis import strategies as st

from cg.stream.continuation import ExpandCall
from cg.stream.inspector import ABORT, CONTINUE, DONE, EXPAND, PING, Inspector, State, Step
from cg.stream.streamcheck import check_anthropic_stream
from cg.stream.usage import Usage
from cg.testing import (
    anthropic_block_delta,
    anthropic_block_start,
    anthropic_block_stop,
    anthropic_expand_block,
    anthropic_text_block,
    anthropic_thinking_block,
    anthropic_tool_block,
    sse_event,
)
from cg.wire.markers import EXPAND_TOOL

# ---------------------------------------------------------------------------------------------
# Builders


def msg_start(input_tokens=10, cache_read=0, cache_write=0, id="msg_1") -> bytes:
    message = {
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": "claude-opus-4-8",
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {
            "input_tokens": input_tokens,
            "cache_creation_input_tokens": cache_write,
            "cache_read_input_tokens": cache_read,
            "output_tokens": 1,
        },
    }
    return sse_event("message_start", {"type": "message_start", "message": message})


def msg_delta(stop="end_turn", output_tokens=5) -> bytes:
    return sse_event(
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": stop, "stop_sequence": None},
            "usage": {"output_tokens": output_tokens},
        },
    )


PING_EV = sse_event("ping", {"type": "ping"})
STOP = sse_event("message_stop", {"type": "message_stop"})


def stream(*blocks, stop="end_turn", output_tokens=5, **start) -> list[bytes]:
    """A complete upstream Messages stream: message_start, ping, blocks, message_delta, message_stop."""
    return [
        msg_start(**start),
        PING_EV,
        *(e for b in blocks for e in b),
        msg_delta(stop, output_tokens),
        STOP,
    ]


cb_start = anthropic_block_start
cb_delta = anthropic_block_delta
cb_stop = anthropic_block_stop
thinking = anthropic_thinking_block
tool = anthropic_tool_block
expand = anthropic_expand_block


def text(index, *texts) -> list[bytes]:
    return anthropic_text_block(index, texts)


# ---------------------------------------------------------------------------------------------
# Driving an inspector the way the proxy does


@attrs.define
class Run:
    client: bytes
    action: str
    inspector: Inspector
    decisions: list = attrs.Factory(list)  # (calls, content) at each EXPAND


def splice(rounds, chunker=None, complete=True, **kw) -> Run:
    """Feed round 1 and then each continuation while the inspector asks for one; when it asks for
    more continuations than given, the caller's failure path: release()."""
    insp = Inspector(**kw)
    out = []
    run = Run(b"", CONTINUE, insp)
    for n, events in enumerate(rounds):
        if n:
            insp.begin_continuation()
        data = events if isinstance(events, bytes) else b"".join(events)
        chunks = chunker(data) if chunker else [data]
        last = n == len(rounds) - 1
        sent, action = feed_round(insp, chunks, complete=complete or not last)
        out.append(sent)
        if action != EXPAND:
            run.client, run.action = b"".join(out), action
            return run
        run.decisions.append((insp.calls, insp.content))
    out.append(insp.release())
    run.client, run.action = b"".join(out), DONE
    return run


def sdk_message(data: bytes):
    """The official SDK's accumulated message for a client stream (raises on index faults)."""

    def handler(request):
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=data)

    client = anthropic.Anthropic(
        api_key="test",
        base_url="http://cg.invalid",
        http_client=httpx2.Client(transport=httpx2.MockTransport(handler)),
        max_retries=0,
    )
    with client.messages.stream(
        model="claude-opus-4-8", max_tokens=100, messages=[{"role": "user", "content": "hi"}]
    ) as s:
        return s.get_final_message()


def client_ok(data: bytes):
    """streamcheck finds nothing and the SDK accumulates it; returns the SDK's message."""
    assert check_anthropic_stream(data) == []
    return sdk_message(data)


def client_events(data: bytes) -> list[dict]:
    return [ujson.loads(e.data) for e in events_of(data) if e.data]


def indices(data: bytes) -> list[int]:
    return [d["index"] for d in client_events(data) if d["type"] == "content_block_start"]


def final_delta(data: bytes) -> dict:
    deltas = [d for d in client_events(data) if d["type"] == "message_delta"]
    assert len(deltas) == 1
    return deltas[0]


# ---------------------------------------------------------------------------------------------
# The checks themselves can fail


def test_sdk_and_streamcheck_catch_an_index_gap():
    bad = b"".join(stream(text(0, "a"), text(2, "b")))
    with pytest.raises(IndexError):
        sdk_message(bad)
    assert check_anthropic_stream(bad)


# ---------------------------------------------------------------------------------------------
# Round 1: forwarded at once, byte for byte


def test_marker_free_stream_is_forwarded_event_by_event_byte_exact():
    server = {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {}}
    result = {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": []}
    citation = {
        "type": "char_location",
        "cited_text": "x",
        "document_index": 0,
        "start_char_index": 0,
        "end_char_index": 1,
    }
    events = stream(
        thinking(0),
        [
            cb_start(1, server),
            cb_delta(1, {"type": "input_json_delta", "partial_json": '{"query":"q"}'}),
            cb_stop(1),
        ],
        [cb_start(2, result), cb_stop(2)],
        [*text(3, "Hello")[:2], cb_delta(3, {"type": "citations_delta", "citation": citation}), cb_stop(3)],
        tool(4, "Bash"),
        expand(5),  # after a client tool: not held
        stop="tool_use",
    )
    events.insert(3, b": comment\r\n\r\n")
    insp = Inspector()
    for raw in events:
        (event,) = events_of(raw)
        assert insp.feed(event) == Step(raw, CONTINUE)  # each event the moment it is fed
    assert insp.end(True) == Step(b"", DONE)
    assert insp.held_events == 0 and insp.released is None and not insp.spliced and insp.rounds == 0


def test_text_then_expand_holds_only_the_expand_turn():
    events = stream(text(0, "Let me ", "look."), expand(1, "abc123"), stop="tool_use", output_tokens=12)
    first_held = 6  # message_start, ping, text start/2 deltas/stop
    insp = Inspector()
    sent = []
    for n, raw in enumerate(events):
        (event,) = events_of(raw)
        step = insp.feed(event)
        sent.append(step.send)
        if n < first_held:
            assert step == Step(raw, CONTINUE)
        elif n < len(events) - 1:
            assert step == Step(b"", CONTINUE)
    assert step.action == EXPAND
    assert b"".join(sent) == b"".join(events[:first_held])
    assert insp.calls == [ExpandCall("toolu_expand_1", {"id": "abc123"}, "abc123")]
    assert insp.calls[0].raw_input["id"] == "abc123"
    assert insp.content == [
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "toolu_expand_1", "name": EXPAND_TOOL, "input": {"id": "abc123"}},
    ]
    assert insp.assistant_message() == {"role": "assistant", "content": insp.content}
    assert insp.held_events == len(events) - first_held
    with pytest.raises(RuntimeError):
        insp.feed(events_of(PING_EV)[0])
    # The continuation failed: the held events, message_delta/message_stop included, verbatim.
    assert insp.release() == b"".join(events[first_held:])
    assert insp.released == "continuation_failed"
    assert insp.end(True).action == DONE


def test_text_then_expand_is_spliced():
    round1 = stream(text(0, "Let me look."), expand(1, "abc123"), stop="tool_use", output_tokens=12)
    round2 = stream(text(0, "The original ", "says 42."), output_tokens=7, input_tokens=999, id="msg_2")
    run = splice([round1, round2])
    assert run.action == DONE and run.inspector.spliced and run.inspector.rounds == 1
    assert run.client.startswith(b"".join(round1[:5]))  # round 1's bytes as they were
    assert round1[5].startswith(b"event: content_block_start") and EXPAND_TOOL.encode() in round1[5]
    assert EXPAND_TOOL.encode() not in run.client
    message = client_ok(run.client)
    assert message.id == "msg_1"
    assert [b.text for b in message.content] == ["Let me look.", "The original says 42."]
    assert message.stop_reason == "end_turn"
    assert (message.usage.input_tokens, message.usage.output_tokens) == (10, 19)
    assert indices(run.client) == [0, 1]


def test_expand_with_client_tool_releases_byte_exact():
    events = stream(text(0, "Two things."), expand(1), tool(2, "Bash"), stop="tool_use")
    events.insert(8, PING_EV)  # a ping inside the hold: released in place
    run = splice([events])
    assert run.client == b"".join(events)
    assert run.inspector.released == "client_tool" and run.action == DONE
    assert run.inspector.held_events == 7  # the expand block's 6 events and the ping
    # The release goes out with the client tool's start, and the rest passes at once.
    insp = Inspector()
    steps = [insp.feed(e) for e in events_of(b"".join(events))]
    bash = next(n for n, raw in enumerate(events) if b'"name":"Bash"' in raw)
    assert all(s.send == b"" for s in steps[4 + 1 : bash])
    assert steps[bash].send == b"".join(events[4 + 1 : bash + 1])
    assert [s.send for s in steps[bash + 1 :]] == events[bash + 1 :]


def test_expand_after_a_client_tool_is_not_held():
    events = stream(tool(0, "Bash"), expand(1), stop="tool_use")
    run = splice([events])
    assert run.client == b"".join(events) and run.inspector.held_events == 0


@pytest.mark.parametrize(
    "parts",
    [
        ("", '{"id": "ab'),  # truncated
        ('{"id": 5}',),  # not a string
        ('["abc"]',),  # not an object
        (),  # no input at all: {}
    ],
)
def test_bad_expand_input_releases_verbatim_at_its_stop(parts):
    events = stream(text(0, "x"), expand(1, parts=parts), stop="tool_use")
    insp = Inspector()
    out = []
    for raw in events:
        step = insp.feed(events_of(raw)[0])
        out.append(step.send)
        if raw.startswith(b"event: content_block_stop") and b'"index":1' in raw:
            assert step.send == b"".join(events[5 : events.index(raw) + 1])  # released right there
    assert insp.end(True).action == DONE
    assert b"".join(out) == b"".join(events)
    assert insp.released == "bad_input"


def test_stream_broken_mid_input_json_is_forwarded_verbatim_and_aborted():
    data = b"".join(stream(text(0, "x"), expand(1, "abcdefgh"), stop="tool_use"))
    cut = data.index(b'"partial_json":"abcdef') + 10  # mid input_json_delta event
    run = splice([data[:cut]], complete=False)
    assert run.client == data[:cut]  # held events and the parser's tail, verbatim
    assert run.action == ABORT and run.inspector.released == "ended"


def test_thinking_with_signature_before_expand():
    round1 = stream(thinking(0), expand(1, "abc"), stop="tool_use")
    insp = Inspector()
    for n, raw in enumerate(round1[:7]):  # message_start, ping, the thinking block
        assert insp.feed(events_of(raw)[0]).send == raw, n
    run = splice([round1, stream(text(0, "Done."))])
    calls, content = run.decisions[0]
    assert content[0] == {
        "type": "thinking",
        "thinking": "I should expand the marker.",
        "signature": "EqQBsig==",
    }
    assert content[1]["input"] == {"id": "abc"}
    message = client_ok(run.client)
    assert message.content[0].type == "thinking" and message.content[0].signature == "EqQBsig=="
    assert message.content[1].text == "Done."


def test_two_expand_calls_in_one_turn():
    round1 = stream(text(0, "Both."), expand(1, "aaa"), expand(2, "bbb"), stop="tool_use")
    run = splice([round1, stream(text(0, "Got them."))])
    calls, content = run.decisions[0]
    assert [(c.id, c.raw_input["id"]) for c in calls] == [("toolu_expand_1", "aaa"), ("toolu_expand_2", "bbb")]
    assert [b["type"] for b in content] == ["text", "tool_use", "tool_use"]
    message = client_ok(run.client)
    assert [b.text for b in message.content] == ["Both.", "Got them."]


def test_expand_as_the_first_block():
    round1 = stream(expand(0, "abc"), stop="tool_use")
    insp = Inspector()
    sent = [insp.feed(e).send for e in events_of(b"".join(round1))]
    assert b"".join(sent) == round1[0] + round1[1]  # message_start and ping only
    run = splice([round1, stream(text(0, "Here."))])
    assert indices(run.client) == [0]
    assert [b.text for b in client_ok(run.client).content] == ["Here."]


def test_a_continuation_that_expands_again():
    round1 = stream(text(0, "One."), expand(1, "aaa"), stop="tool_use", output_tokens=10)
    round2 = stream(thinking(0), text(1, "Two."), expand(2, "bbb"), stop="tool_use", output_tokens=20)
    round3 = stream(text(0, "Three."), output_tokens=30)
    run = splice([round1, round2, round3])
    assert run.inspector.rounds == 2 and run.action == DONE
    calls2, content2 = run.decisions[1]
    assert [c.raw_input["id"] for c in calls2] == ["bbb"]
    assert [b["type"] for b in content2] == ["thinking", "text", "tool_use"]
    assert indices(run.client) == [0, 1, 2, 3]
    message = client_ok(run.client)
    assert [b.type for b in message.content] == ["text", "thinking", "text", "text"]
    assert message.usage.output_tokens == 60
    assert EXPAND_TOOL.encode() not in run.client


def test_round_cap_lets_the_last_round_through_renumbered():
    round1 = stream(text(0, "One."), expand(1, "aaa"), stop="tool_use")
    round2 = stream(text(0, "Two."), expand(1, "bbb"), stop="tool_use")
    run = splice([round1, round2], max_rounds=1)
    assert run.action == DONE and run.inspector.capped and run.inspector.rounds == 1
    message = client_ok(run.client)
    assert [b.type for b in message.content] == ["text", "text", "tool_use"]
    assert message.content[2].name == EXPAND_TOOL and message.content[2].input == {"id": "bbb"}
    assert message.stop_reason == "tool_use"
    # max_rounds=0: round 1 itself is the last round, byte for byte.
    run = splice([round1], max_rounds=0)
    assert run.client == b"".join(round1) and run.inspector.capped and run.inspector.held_events == 0


def test_forever_expanding_upstream_is_cut_at_the_cap():
    rounds = [stream(text(0, f"r{n}"), expand(1, f"id{n}"), stop="tool_use") for n in range(5)]
    run = splice(rounds)  # max_rounds=3: rounds 1..4 used, the 4th passes through
    assert run.inspector.rounds == 3 and run.inspector.capped
    message = client_ok(run.client)
    assert [b.type for b in message.content] == ["text"] * 4 + ["tool_use"]


def test_usage_rule_in_the_final_message_delta():
    round1 = stream(
        expand(0), stop="tool_use", output_tokens=20, input_tokens=100, cache_read=5000, cache_write=70
    )
    round2 = stream(text(0, "ok"), output_tokens=30, input_tokens=300, cache_read=9000, cache_write=3)
    run = splice([round1, round2])
    delta = final_delta(run.client)
    assert delta["usage"] == {
        "output_tokens": 50,
        "input_tokens": 100,
        "cache_read_input_tokens": 5000,
        "cache_creation_input_tokens": 70,
    }
    assert delta["delta"]["stop_reason"] == "end_turn"
    assert run.client.count(b"event: message_delta\ndata: ") == 1
    assert (
        run.client.count(b"event: message_start\n") == 1 and run.client.count(b"event: message_stop\n") == 1
    )
    assert run.inspector.billed == [Usage(100, 5000, 70, 20), Usage(300, 9000, 3, 30)]
    usage = client_ok(run.client).usage
    assert (usage.input_tokens, usage.cache_read_input_tokens, usage.output_tokens) == (100, 5000, 50)


def test_renumbering_is_dense_by_arrival_whatever_the_continuation_says():
    round1 = stream(thinking(0), text(1, "a"), expand(2), stop="tool_use")
    odd = stream(text(5, "b"), text(9, "c"))  # a continuation with odd indices of its own
    run = splice([round1, odd])
    assert indices(run.client) == [0, 1, 2, 3]
    assert [d.get("index") for d in client_events(run.client) if d["type"].startswith("content_block")] == (
        [0] * 5 + [1] * 3 + [2] * 3 + [3] * 3
    )
    assert [b.type for b in client_ok(run.client).content] == ["thinking", "text", "text", "text"]


def test_release_in_a_spliced_round_is_renumbered():
    round1 = stream(text(0, "a"), expand(1, "aaa"), stop="tool_use", output_tokens=4)
    round2 = stream(text(0, "b"), expand(1, "bbb"), tool(2, "Bash"), stop="tool_use", output_tokens=6)
    run = splice([round1, round2])
    assert run.inspector.released == "client_tool"
    message = client_ok(run.client)
    assert [(b.type, getattr(b, "name", None)) for b in message.content] == [
        ("text", None),
        ("text", None),
        ("tool_use", EXPAND_TOOL),
        ("tool_use", "Bash"),
    ]
    assert message.content[2].input == {"id": "bbb"} and message.usage.output_tokens == 10


def test_continuation_failing_after_a_spliced_expand_releases_that_round():
    round1 = stream(text(0, "a"), expand(1, "aaa"), stop="tool_use", output_tokens=4)
    round2 = stream(text(0, "b"), expand(1, "bbb"), stop="tool_use", output_tokens=6)
    run = splice([round1, round2])  # the third round never comes: release()
    assert run.inspector.released == "continuation_failed"
    message = client_ok(run.client)
    assert [b.type for b in message.content] == ["text", "text", "tool_use"]
    assert message.content[2].input == {"id": "bbb"}
    assert message.stop_reason == "tool_use" and message.usage.output_tokens == 10


def test_continuation_error_before_content_falls_back_to_round_one_verbatim():
    round1 = stream(text(0, "a"), expand(1), stop="tool_use")
    error = sse_event("error", {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}})
    run = splice([round1, [msg_start(), PING_EV, error]])
    assert run.action == DONE and run.inspector.released == "continuation_failed"
    # Round 1 up to the expand, the continuation's ping, then round 1's held events verbatim.
    assert run.client == b"".join(round1[:5]) + PING_EV + b"".join(round1[5:])
    client_ok(run.client)


def test_continuation_broken_before_content_falls_back():
    round1 = stream(expand(0), stop="tool_use")
    run = splice([round1, [msg_start()]], complete=False)
    assert run.action == DONE and run.client == b"".join(round1)
    assert run.inspector.released == "continuation_failed"
    client_ok(run.client)


def test_continuation_broken_after_content_aborts_the_client():
    round1 = stream(text(0, "a"), expand(1), stop="tool_use")
    round2 = stream(text(0, "partial", " answer"))[:4]  # message_start, ping, start, one delta
    run = splice([round1, round2], complete=False)
    assert run.action == ABORT
    assert b"message_stop" not in run.client and b"partial" in run.client
    # Ended "cleanly" but truncated: still never a clean ending.
    run = splice([round1, round2], complete=True)
    assert run.action == ABORT


def test_continuation_error_after_content_is_forwarded():
    round1 = stream(text(0, "a"), expand(1), stop="tool_use")
    error = sse_event("error", {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}})
    run = splice([round1, stream(text(0, "b"))[:4] + [error]])
    assert run.action == DONE and run.client.endswith(error)


@pytest.mark.parametrize(
    ("blocks", "stop", "reason"),
    [
        ([expand(0)], "max_tokens", "stop_reason"),
        ([expand(0), text(1, "after")], "tool_use", "other_block"),
        ([expand(0)], "end_turn", "stop_reason"),
    ],
)
def test_anything_else_releases_verbatim(blocks, stop, reason):
    events = stream(*blocks, stop=stop)
    run = splice([events])
    assert run.client == b"".join(events)
    assert run.inspector.released == reason and run.action == DONE


def test_error_event_while_holding_releases_verbatim():
    error = sse_event("error", {"type": "error", "error": {"type": "api_error", "message": "x"}})
    events = stream(text(0, "x"), expand(1))[:-3] + [error]  # mid expand block: its stop, the end cut
    run = splice([events])
    assert run.client == b"".join(events) and run.inspector.released == "error"


def test_stream_ending_while_holding_releases_verbatim():
    events = stream(text(0, "x"), expand(1), stop="tool_use")[:-2]  # no message_delta/stop
    run = splice([events])
    assert run.client == b"".join(events) and run.inspector.released == "ended" and run.action == DONE


def test_message_delta_before_an_expand_block_stops_releases():
    events = stream(text(0, "x"), expand(1)[:-1], stop="tool_use")  # no content_block_stop
    run = splice([events, stream(text(0, "y"))])
    assert run.client == b"".join(events) and run.inspector.released == "bad_input"
    assert not run.inspector.spliced


def test_max_held_releases():
    parts = (" ",) * 30 + ('{"id":"a"}',)  # ~30 events of ~110 bytes each: more than 600 held
    events = stream(text(0, "x"), expand(1, parts=parts), stop="tool_use")
    run = splice([events], max_held=600)
    assert run.client == b"".join(events) and run.inspector.released == "max_held"
    assert run.inspector.held_bytes == 0
    # The same stream under the default limit is an expand turn.
    run = splice([events, stream(text(0, "y"))])
    assert run.inspector.released is None and run.inspector.rounds == 1
    client_ok(run.client)


def test_ping_event_is_a_valid_keepalive():
    assert PING == b'event: ping\ndata: {"type":"ping"}\n\n'
    round1 = stream(text(0, "a"), expand(1), stop="tool_use")
    insp = Inspector()
    out, action = feed_round(insp, [b"".join(round1)])
    assert action == EXPAND
    out += PING * 3
    insp.begin_continuation()
    more, action = feed_round(insp, [b"".join(stream(text(0, "b")))])
    client_ok(out + more)


def test_contract_errors():
    insp = Inspector()
    with pytest.raises(RuntimeError):
        insp.begin_continuation()
    assert insp.release() == b""


# ---------------------------------------------------------------------------------------------
# Chunking never changes what the client gets


SCENARIOS = {
    "spliced twice": [
        stream(
            thinking(0), text(1, "Let me ", "check é…"), expand(2, "abc"), stop="tool_use", output_tokens=9
        ),
        stream(text(0, "Half"), expand(1, "def"), stop="tool_use", output_tokens=8),
        stream(text(0, "Done ✓"), output_tokens=7),
    ],
    "released": [stream(text(0, "x"), expand(1), tool(2, "Bash"), stop="tool_use")],
    "bad input": [stream(expand(0, parts=('{"id": "a',)), stop="tool_use")],
}


def _crlf(events):
    return [e.replace(b"\n", b"\r\n") for e in events]


@settings(max_examples=60, deadline=None)
@given(data=st.data(), name=st.sampled_from(sorted(SCENARIOS)), crlf=st.booleans())
def test_rechunking_gives_the_same_client_bytes(data, name, crlf):
    rounds = [_crlf(r) if crlf else r for r in SCENARIOS[name]]
    expected = splice(rounds)
    if name == "spliced twice":
        assert check_anthropic_stream(expected.client) == []
    else:  # released verbatim
        assert expected.client == b"".join(rounds[0])

    chunker = cutting(data)

    got = splice(rounds, chunker=chunker)
    assert got.client == expected.client
    assert got.action == expected.action


@pytest.mark.parametrize("crlf", [False, True])
def test_spliced_scenario_passes_the_sdk(crlf):
    rounds = [_crlf(r) if crlf else r for r in SCENARIOS["spliced twice"]]
    run = splice(rounds)
    assert run.client.startswith(b"".join(rounds[0][:11]))  # round 1 up to the expand, as it came
    assert EXPAND_TOOL.encode() in rounds[0][11] and EXPAND_TOOL.encode() not in run.client
    message = client_ok(run.client)
    assert [b.type for b in message.content] == ["thinking", "text", "text", "text"]
    assert message.content[1].text == "Let me check é…" and message.content[3].text == "Done ✓"
    assert message.usage.output_tokens == 24


# ---------------------------------------------------------------------------------------------
# Cost


def test_held_bytes_are_counted_incrementally():
    insp = Inspector()
    events = events_of(b"".join(stream(expand(0), stop="tool_use")))
    total = 0
    for event in events[:-2]:
        insp.feed(event)
        if insp.state is State.HOLD:
            total += len(event.raw)
            assert insp.held_bytes == total
    assert total > 0


def test_renumbering_in_place_only_touches_the_top_level_index():
    from cg.stream.inspector import _renumbered

    plain = sse_event("content_block_delta", {"type": "content_block_delta", "index": 1,
                                              "delta": {"type": "text_delta", "text": '"index":1'}})
    nested_first = sse_event("content_block_start", {"type": "content_block_start",
                                                     "content_block": {"type": "text", "text": "", "index": 1},
                                                     "index": 1})
    for raw in (plain, nested_first):
        event = events_of(raw)[0]
        out = _renumbered(event, event.name, event.json(), 1, 7)
        (renumbered,) = events_of(out)
        assert renumbered.name == event.name
        assert renumbered.json() == {**event.json(), "index": 7}
