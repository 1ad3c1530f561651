"""The Exchange on its own, without a reactor: events in, commands out."""

import gc
import json
import types

import pytest

from cg.compaction.pipeline import Change
from cg.compaction.rewrite import Rewrite
from cg.exchange.machine import (
    PING_INTERVAL,
    Abort,
    BodyEnd,
    CancelTimer,
    Chunk,
    ClientGone,
    Cut,
    DetachBody,
    DiscardBody,
    Exchange,
    Finish,
    Head,
    KeepHidden,
    Prepared,
    ReadBody,
    Record,
    Resolve,
    Resolved,
    ResolveFailed,
    Send,
    SetHead,
    StartTimer,
    State,
    StopUpstream,
    Timer,
    TimerFired,
    UpstreamFailed,
    Write,
)
from cg.stream.continuation import ExpandCall
from cg.stream.hidden import record_key
from cg.stream.inspector import PING
from cg.stream.streamcheck import check_anthropic_stream
from cg.stream.usage import Usage
from cg.testing import (
    anthropic_expand_block,
    anthropic_message,
    anthropic_stream_events,
    anthropic_text_block,
    anthropic_thinking_block,
    openai_completion,
    openai_stream_events,
)
from cg.wire.dialect import ANTHROPIC, MESSAGES_SHAPE, OPENAI, SHAPES

REF = "0123456789abcdef"
ORIGINAL = b"the whole output, as the tool gave it"
FORWARDED = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}'
HEADERS = object()  # the driver's client headers: the exchange passes them on untouched


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def rewrite(dialect=ANTHROPIC, injected=True, changes=()):
    return Rewrite(body=FORWARDED, originals={}, changes=list(changes), injected=injected, stash=True,
                   parsed={}, dialect=SHAPES[dialect])


def exchange(dialect=ANTHROPIC, http11=True, clock=None, **limits):
    return Exchange("POST", "/v1/messages?beta=true", dialect, bytes_in=len(FORWARDED), reads=dialect,
                    http11=http11, clock=clock or Clock(), **limits)


def head(status=200, stream=False, decodable=True, headers=HEADERS):
    return Head(status, b"OK", headers, False, stream, decodable)


def started(ex, rewrite=None, **head_args):
    """The exchange with its request sent and the upstream's head fed."""
    assert ex.feed(Prepared(FORWARDED, rewrite)) == [Send(FORWARDED, 0)]
    commands = ex.feed(head(**head_args))
    status = head_args.get("status", 200)
    head_now = [Write(b"")] if head_args.get("stream") and 200 <= status < 300 else []
    assert commands == [SetHead(status, b"OK", HEADERS), *head_now, ReadBody()]
    return ex


def written(commands):
    return b"".join(c.data for c in commands if isinstance(c, Write))


def the_record(commands):
    [record] = [c.record for c in commands if isinstance(c, Record)]
    return record


def without_writes(commands):
    return [c for c in commands if not isinstance(c, Write)]


def sse(events):
    return b"".join(events)


def round1():
    """An Anthropic stream whose turn is text, then a lone expand call."""
    return anthropic_stream_events(
        blocks=[anthropic_text_block(0, ["Let me look."]), anthropic_expand_block(1, ref=REF)], stop_reason="tool_use"
    )


def continuation(texts=("Found it.",)):
    return anthropic_stream_events(blocks=[anthropic_text_block(0, list(texts))], id="msg_cont", output_tokens=7)


def text_of(data: bytes) -> str:
    out = []
    for block in data.split(b"\n\n"):
        for line in block.split(b"\n"):
            if line.startswith(b"data: "):
                doc = json.loads(line[6:])
                if doc.get("type") == "content_block_delta" and doc["delta"].get("type") == "text_delta":
                    out.append(doc["delta"]["text"])
    return "".join(out)


# ---------------------------------------------------------------------------------------------
# Pass-through


def test_a_json_response_passes_through_as_it_comes():
    clock = Clock()
    ex = started(exchange(clock=clock))
    body = json.dumps(anthropic_message("Hi")).encode()
    clock.now = 100.5
    first = ex.feed(Chunk(body[:10]))
    assert first == [Write(body[:10])]
    assert ex.feed(Chunk(body[10:])) == [Write(body[10:])]
    clock.now = 101.0
    end = ex.feed(BodyEnd(True))
    assert end[0] == Finish()
    record = the_record(end)
    assert ex.state is State.ENDED
    assert (record.status, record.outcome, record.bytes_out, record.stream) == (200, "ok", len(body), False)
    assert record.usage == Usage(input_tokens=10, output_tokens=5)  # read on the way
    assert (record.t_received, record.t_client_first, record.t_ended) == (100.0, 100.5, 101.0)
    assert ex.feed(Chunk(b"late")) == []


def test_an_upstream_error_status_is_relayed_and_recorded_as_such():
    ex = started(exchange(), rewrite(), status=529)
    assert ex.feed(Chunk(b'{"type":"error"}')) == [Write(b'{"type":"error"}')]  # not collected: no success
    assert the_record(ex.feed(BodyEnd(True))).outcome == "upstream_error_status"


def test_a_body_cut_short_is_cut_for_the_client_too():
    ex = started(exchange(), stream=True)
    ex.feed(Chunk(b"event: ping\n"))
    commands = ex.feed(BodyEnd(False))
    assert commands[:2] == [StopUpstream(), Abort(flush=True)]  # chunked: flushed, then closed
    assert the_record(commands).outcome == "upstream_broke"

    ex = started(exchange(http11=False), stream=True)
    assert ex.feed(BodyEnd(False))[:2] == [StopUpstream(), Abort(flush=False)]  # ends by close: abort


def test_an_upstream_failure_is_an_error_in_the_clients_dialect():
    ex = exchange(OPENAI)
    ex.feed(Prepared(FORWARDED, None))
    commands = ex.feed(UpstreamFailed(True, "no head in 600 s"))
    body = written(commands)
    assert commands[0] == SetHead(504, None, None, ((b"content-type", b"application/json"),
                                                    (b"content-length", b"%d" % len(body))))
    assert json.loads(body)["error"]["type"] == "timeout"
    assert "timed out waiting for the upstream: no head in 600 s" in json.loads(body)["error"]["message"]
    assert without_writes(commands)[1:] == [Finish(), Record(the_record(commands))]
    assert the_record(commands).outcome == "upstream_error"


def test_a_client_gone_before_the_request_left_ends_it_without_sending():
    ex = exchange()
    commands = ex.feed(ClientGone())
    assert commands[:1] == [StopUpstream()]
    assert the_record(commands).outcome == "client_gone"
    assert ex.feed(Prepared(FORWARDED, rewrite())) == []  # the store answered after the client left


def test_what_compaction_did_is_in_the_record():
    change = Change(message_index=1, block_index=0, part_index=None, tool_name="Bash", component="offload",
                    step=0, lossy=True, marker_id=REF, tokens_before=900, tokens_after=40, content_id=REF)
    ex = started(exchange(), rewrite(injected=False, changes=[change]))
    compacted = the_record(ex.feed(BodyEnd(True))).compacted
    assert (compacted.tokens_before, compacted.tokens_after, compacted.markers) == (900, 40, 1)


# ---------------------------------------------------------------------------------------------
# The JSON expand loop


def expand_message(ref=REF):
    return anthropic_message(content=[
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "toolu_1", "name": "context_guru_expand", "input": {"id": ref}},
    ], stop_reason="tool_use")


def test_a_json_expand_round_trip_answers_the_client_once():
    ex = started(exchange(), rewrite())
    assert ex.feed(Chunk(json.dumps(expand_message()).encode())) == []  # collected
    commands = ex.feed(BodyEnd(True))
    assert commands == [Resolve([ExpandCall("toolu_1", {"id": REF}, REF)])]
    [send] = ex.feed(Resolved({REF: ORIGINAL}))
    assert send.round == 1
    assert send.body.startswith(FORWARDED[:-len(b'],"stream":true}')])  # the forwarded bytes, kept
    sent = json.loads(send.body)
    assert sent["messages"][-1]["content"][0]["content"] == ORIGINAL.decode()
    assert ex.feed(head(headers=None)) == [ReadBody()]  # the client has its head already
    ex.feed(Chunk(json.dumps(anthropic_message("Found it.")).encode()))
    commands = ex.feed(BodyEnd(True))
    merged = json.loads(written(commands))
    assert [block["type"] for block in merged["content"]] == ["text", "text"]  # the expand call is cg's
    assert merged["content"][1]["text"] == "Found it."
    assert commands[-2] == Finish()
    record = the_record(commands)
    assert (record.expand_rounds, record.continuation_failed) == (1, None)
    assert record.usage == Usage(input_tokens=20, output_tokens=10)  # both rounds billed


@pytest.mark.parametrize("thinks", [True, False])
def test_a_continuation_that_thinks_keeps_its_hidden_turn_before_the_client_has_the_end(thinks):
    """KeepHidden comes before Finish, so before the client can send the turn that carries the
    thinking back (cg.stream.hidden); a continuation without thinking keeps nothing."""
    ex = started(exchange(), rewrite())
    ex.feed(Chunk(json.dumps(expand_message()).encode()))
    ex.feed(BodyEnd(True))
    ex.feed(Resolved({REF: ORIGINAL}))
    ex.feed(head(headers=None))
    thinking = [{"type": "thinking", "thinking": "So.", "signature": "sig-2"}] if thinks else []
    ex.feed(Chunk(json.dumps(anthropic_message(content=[*thinking, {"type": "text", "text": "Found it."}])).encode()))
    commands = without_writes(ex.feed(BodyEnd(True)))
    kept = [c for c in commands if isinstance(c, KeepHidden)]
    if not thinks:
        assert kept == [] and commands[0] == Finish()
        return
    assert commands[:2] == [kept[0], Finish()]
    assert kept[0].key == record_key("sig-2")
    record = json.loads(kept[0].text)
    assert (record["types"], record["starts"], record["at"]) == (["text", "thinking", "text"], [1], 1)
    [(calls, answers, blanks)] = record["hidden"]
    assert blanks == []
    assert json.loads(calls) == expand_message()["content"][1]
    assert json.loads(answers) == {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": ORIGINAL.decode()}]}


def test_a_json_continuation_that_thinks_then_fails_to_continue_keeps_its_hidden_turn():
    """Round 1 wrote thinking and called expand again, and that call could not be answered: the
    client gets both rounds, round 1's expand call its own, and round 1's thinking comes back on
    its next turn after hidden turn 0 alone, which must be kept."""
    ex = started(exchange(), rewrite())
    ex.feed(Chunk(json.dumps(expand_message()).encode()))
    ex.feed(BodyEnd(True))
    ex.feed(Resolved({REF: ORIGINAL}))
    ex.feed(head(headers=None))
    again = expand_message("fedcba9876543210")
    again["content"].insert(0, {"type": "thinking", "thinking": "So.", "signature": "sig-2"})
    ex.feed(Chunk(json.dumps(again).encode()))
    ex.feed(BodyEnd(True))
    commands = ex.feed(ResolveFailed("the store is gone"))
    assert [block["type"] for block in json.loads(written(commands))["content"]] == [
        "text", "thinking", "text", "tool_use"]
    commands = without_writes(commands)
    assert isinstance(commands[0], KeepHidden) and commands[1] == Finish()
    assert commands[0].key == record_key("sig-2")
    record = json.loads(commands[0].text)
    assert (record["types"], record["starts"], record["at"]) == (["text", "thinking", "text", "tool_use"], [1], 1)
    [(calls, _, _)] = record["hidden"]
    assert json.loads(calls) == expand_message()["content"][1]
    assert the_record(commands).continuation_failed == "the store is gone"


def test_each_continuation_extends_the_last_one_byte_for_byte():
    ex = started(exchange(), rewrite())
    ex.feed(Chunk(json.dumps(expand_message()).encode()))
    ex.feed(BodyEnd(True))
    [first] = ex.feed(Resolved({REF: ORIGINAL}))
    ex.feed(head(headers=None))
    ex.feed(Chunk(json.dumps(expand_message("fedcba9876543210")).encode()))
    assert ex.feed(BodyEnd(True)) == [Resolve([ExpandCall("toolu_1", {"id": "fedcba9876543210"}, "fedcba9876543210")])]
    [second] = ex.feed(Resolved({"fedcba9876543210": None}))
    assert second.round == 2
    assert second.body.startswith(first.body[:-len(b'],"stream":true}')])
    assert len(json.loads(second.body)["messages"]) == len(json.loads(first.body)["messages"]) + 2


def test_a_json_continuation_refused_gives_the_client_the_first_round_as_it_came():
    ex = started(exchange(), rewrite())
    first = json.dumps(expand_message()).encode()
    ex.feed(Chunk(first))
    ex.feed(BodyEnd(True))
    ex.feed(Resolved({REF: ORIGINAL}))
    commands = ex.feed(head(status=500, headers=None))
    assert commands[0] == DiscardBody()
    assert written(commands) == first
    assert the_record(commands).continuation_failed == "HTTP 500"


def test_a_lookup_that_fails_gives_the_rounds_so_far():
    ex = started(exchange(), rewrite())
    first = json.dumps(expand_message()).encode()
    ex.feed(Chunk(first))
    ex.feed(BodyEnd(True))
    commands = ex.feed(ResolveFailed("the store is gone"))
    assert written(commands) == first
    assert the_record(commands).continuation_failed == "the store is gone"


def test_the_round_cap_hands_the_expand_call_to_the_client():
    ex = started(exchange(max_expand_rounds=0), rewrite())
    first = json.dumps(expand_message()).encode()
    ex.feed(Chunk(first))
    assert written(ex.feed(BodyEnd(True))) == first


def test_an_openai_json_response_goes_through_the_openai_adapter():
    ex = started(exchange(OPENAI), rewrite(OPENAI))
    doc = openai_completion()
    doc["choices"][0]["message"]["tool_calls"] = [{
        "id": "call_1", "type": "function",
        "function": {"name": "context_guru_expand", "arguments": json.dumps({"id": REF})},
    }]
    ex.feed(Chunk(json.dumps(doc).encode()))
    assert ex.feed(BodyEnd(True)) == [Resolve([ExpandCall("call_1", json.dumps({"id": REF}), REF)])]
    [send] = ex.feed(Resolved({REF: ORIGINAL}))
    assert json.loads(send.body)["messages"][-1] == {"role": "tool", "tool_call_id": "call_1",
                                                      "content": ORIGINAL.decode()}
    assert send.body.endswith(b'],"stream":true}')  # a JSON round leaves `stream` as the client sent it


def test_an_openai_stream_with_the_tool_injected_goes_through_the_chat_inspector():
    """No expand call: every chunk reaches the client as it came, and the record says it was inspected."""
    ex = started(exchange(OPENAI), rewrite(OPENAI), stream=True)
    data = sse(openai_stream_events())
    assert written(ex.feed(Chunk(data))) == data
    record = the_record(ex.feed(BodyEnd(True)))
    assert record.inspected is not None and record.inspected.released is None
    assert record.outcome == "ok"


# ---------------------------------------------------------------------------------------------
# Anthropic streams: the inspector


def held_expand(clock=None):
    """A stream exchange that forwarded round 1's text and holds its expand call, resolved and sent."""
    ex = started(exchange(clock=clock), rewrite(), stream=True)
    events = round1()
    commands = ex.feed(Chunk(sse(events)))
    held = sse(events[5:])  # from the expand call's start on
    assert written(commands) == sse(events[:5])  # every event before the expand call, at once
    assert without_writes(commands) == [
        DetachBody(), StartTimer(Timer.PING, PING_INTERVAL, repeat=True),
        Resolve([ExpandCall("toolu_expand_1", {"id": REF}, REF)]),
    ]
    [send] = ex.feed(Resolved({REF: ORIGINAL}))
    assert send.round == 1 and json.loads(send.body)["stream"] is True
    return ex, sse(events), held


def test_a_stream_with_a_held_expand_call_is_spliced():
    ex, _, _ = held_expand()
    assert ex.feed(head(stream=True, headers=None)) == [StartTimer(Timer.STALL, 600.0), ReadBody()]
    data = sse(continuation())
    commands = ex.feed(Chunk(data[:40]))
    assert commands == []  # the continuation's message_start is swallowed; nothing committed yet
    commands = ex.feed(Chunk(data[40:]))
    assert commands[0] == Write(PING)  # the continuation's own ping: no commitment yet
    assert commands[1:3] == [CancelTimer(Timer.PING), CancelTimer(Timer.STALL)]  # its first block commits
    end = ex.feed(BodyEnd(True))
    assert end[-2] == Finish()
    client = sse(round1()[:5]) + written(commands) + written(end)
    assert check_anthropic_stream(client) == []
    assert text_of(client) == "Let me look.Found it."
    record = the_record(end)
    assert record.expand_rounds == 1 and record.inspected.spliced and record.inspected.held_events > 0
    assert record.stream and record.outcome == "ok"


def test_a_continuation_that_fails_before_committing_gets_the_verbatim_release():
    ex, round_1, held = held_expand()
    commands = ex.feed(UpstreamFailed(False, "connection refused"))
    assert commands[0] == CancelTimer(Timer.PING)
    assert written(commands) == held  # the client gets exactly what the upstream sent
    assert sse(round1()[:5]) + written(commands) == round_1
    assert without_writes(commands)[1] == Finish()
    record = the_record(commands)
    assert record.continuation_failed == "connection refused" and record.inspected.released == "continuation_failed"


@pytest.mark.parametrize("failure", ["HTTP 529", "no content in time"])
def test_a_stream_continuation_that_thinks_then_fails_to_continue_keeps_its_hidden_turn(failure):
    """Round 1 wrote thinking and called expand again; round 2 is refused (529), or begins and
    sends nothing in time: the client gets round 1's expand call as it came, and hidden turn 0 is
    kept for round 1's thinking."""
    ex, _, _ = held_expand()
    ex.feed(head(stream=True, headers=None))
    round_2 = anthropic_stream_events(blocks=[anthropic_thinking_block(0, signature="sig-2"),
                                              anthropic_expand_block(1, ref="fedcba9876543210")],
                                      id="msg_cont", stop_reason="tool_use")
    client = written(ex.feed(Chunk(sse(round_2))))
    [send] = [c for c in ex.feed(Resolved({"fedcba9876543210": None})) if isinstance(c, Send)]
    assert send.round == 2
    if failure == "HTTP 529":
        commands = ex.feed(head(status=529, stream=True, headers=None))
    else:
        ex.feed(head(stream=True, headers=None))
        ex.feed(Chunk(sse(continuation())[:40]))  # message_start only: not committed
        commands = ex.feed(TimerFired(Timer.STALL))
    client = sse(round1()[:5]) + client + written(commands)
    assert check_anthropic_stream(client) == []
    [kept] = [c for c in commands if isinstance(c, KeepHidden)]
    assert kept.key == record_key("sig-2")
    record = json.loads(kept.text)
    assert (record["types"], record["starts"], record["at"]) == (["text", "thinking", "tool_use"], [1], 1)
    [(calls, _, _)] = record["hidden"]
    assert json.loads(calls)["id"] == "toolu_expand_1"
    assert the_record(commands).continuation_failed == failure


def test_a_continuation_answering_no_stream_is_refused():
    ex, _, held = held_expand()
    commands = ex.feed(head(stream=False, headers=None))
    assert commands[0] == DiscardBody()
    assert written(commands) == held


def test_a_client_gone_mid_continuation_stops_it():
    ex, _, _ = held_expand()
    commands = ex.feed(ClientGone())
    assert without_writes(commands)[:2] == [CancelTimer(Timer.PING), StopUpstream()]
    assert written(commands) == b""
    assert the_record(commands).outcome == "client_gone"
    assert ex.feed(head(stream=True, headers=None)) == []
    assert ex.feed(TimerFired(Timer.PING)) == []


def test_pings_keep_the_client_alive_while_the_continuation_is_awaited():
    ex, _, _ = held_expand()
    assert ex.feed(TimerFired(Timer.PING)) == [Write(PING)]
    assert ex.feed(TimerFired(Timer.PING)) == [Write(PING)]
    ex.feed(head(stream=True, headers=None))
    ex.feed(Chunk(sse(continuation())))
    assert ex.feed(TimerFired(Timer.PING)) == []  # cancelled once the continuation committed


def test_a_continuation_that_stalls_after_its_head_gets_the_release():
    ex, _, held = held_expand()
    ex.feed(head(stream=True, headers=None))
    ex.feed(Chunk(sse(continuation())[:40]))  # message_start only: not committed
    commands = ex.feed(TimerFired(Timer.STALL))
    assert without_writes(commands)[:2] == [CancelTimer(Timer.PING), StopUpstream()]
    assert written(commands) == held
    assert the_record(commands).continuation_failed == "no content in time"


def test_a_stall_timer_after_commit_changes_nothing():
    ex, _, _ = held_expand()
    ex.feed(head(stream=True, headers=None))
    ex.feed(Chunk(sse(continuation())))
    assert ex.feed(TimerFired(Timer.STALL)) == []


def test_a_cut_mid_stream_aborts_the_client():
    ex, _, _ = held_expand()
    commands = ex.feed(Cut())
    assert without_writes(commands)[:3] == [CancelTimer(Timer.PING), StopUpstream(), Abort(flush=True)]
    assert the_record(commands).outcome == "aborted"
    assert ex.feed(Cut()) == []


def _reaches(start: object, target: object, depth: int = 4) -> bool:
    """Whether `target` is among what `start` refers to, `depth` references deep (classes,
    modules and functions left out: they are not the exchange's)."""
    seen, level = {id(start)}, [start]
    for _ in range(depth):
        following = []
        for obj in level:
            for ref in gc.get_referents(obj):
                if ref is target:
                    return True
                if id(ref) not in seen and not isinstance(ref, (type, types.ModuleType, types.FunctionType)):
                    seen.add(id(ref))
                    following.append(ref)
        level = following
    return False


def test_an_ended_exchange_keeps_no_body():
    """The driver, the client's request and Twisted's callbacks hold one another in cycles that
    the cyclic collector frees late: an exchange that ended must not keep the bodies alive."""
    body = FORWARDED.replace(b'"hi"', b'"hello"')  # this test's own bytes object
    sent = Rewrite(body=body, originals={}, changes=[], injected=True, stash=True, parsed={}, dialect=MESSAGES_SHAPE)
    ex = exchange()
    ex.feed(Prepared(body, sent))
    ex.feed(head())
    ex.feed(Chunk(json.dumps(expand_message()).encode()))
    [resolve] = ex.feed(BodyEnd(True))
    [send] = ex.feed(Resolved({REF: ORIGINAL}))
    assert _reaches(ex, body) and _reaches(ex, send.body)  # the test can see them while it runs
    ex.feed(head(headers=None))
    ex.feed(Chunk(json.dumps(anthropic_message("Found it.")).encode()))
    commands = ex.feed(BodyEnd(True))
    assert ex.state is State.ENDED and the_record(commands).expand_rounds == 1
    [answer] = [command.data for command in commands if isinstance(command, Write)]
    assert not _reaches(ex, body) and not _reaches(ex, send.body) and not _reaches(ex, answer)


def test_the_docstring_table_names_the_transitions_the_code_runs():
    from cg.exchange import machine
    from cg.testing.tables import names_in, table_rows

    events = {"Prepared", "Head", "Chunk", "BodyEnd", "UpstreamFailed", "ClientGone", "Cut", "Resolved",
              "ResolveFailed", "TimerFired"}
    live = {state for state in State if state is not State.ENDED}
    documented = set()
    for state_cell, event_cell, _ in table_rows(machine.__doc__):
        states = live if state_cell.startswith("any live") else {State[s] for s in names_in(state_cell, set(State.__members__))}
        said = events if event_cell.startswith("Anything") else set(names_in(event_cell, events))
        assert states and said, (state_cell, event_cell)
        documented |= {(state, getattr(machine, event)) for state in states for event in said}
    assert documented == set(machine.TRANSITIONS)


def test_an_event_the_state_has_no_row_for_raises_and_changes_nothing():
    from cg.exchange.machine import Unexpected

    exchange = Exchange("POST", "/v1/messages", ANTHROPIC, bytes_in=0, reads=ANTHROPIC, http11=True,
                        clock=Clock())
    with pytest.raises(Unexpected):
        exchange.feed(Chunk(b"data before any request"))
    assert exchange.state is State.PREPARING
    assert [type(c) for c in exchange.feed(Prepared(FORWARDED, None))] == [Send]
