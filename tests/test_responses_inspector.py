"""ResponsesInspector, pure: Responses API streams (``response.*`` events) fed event by event, no reactor.

One test per row of the state table in cg/stream/responses_inspector.py, every spliced stream checked
with the official openai SDK's accumulator (``responses.stream()`` over a mock transport: it raises on
a second lifecycle id or a reused output index, and ``get_final_response()`` is the completed's
``output``), and the chunk-boundary property: however the upstream bytes are cut, the client gets the
same bytes.
"""

from __future__ import annotations

import httpx2
import openai
import pytest
import ujson
from helpers.streams import cutting, events_of, feed_round, run_rounds
from hypothesis import given, settings
from hypothesis import strategies as st

from cg.stream.continuation import ExpandCall
from cg.stream.inspector import ABORT, CONTINUE, DONE, EXPAND, State, Step
from cg.stream.responses_inspector import ResponsesInspector
from cg.testing import (
    responses_function_call,
    responses_message,
    responses_reasoning,
    responses_stream_events,
    sse_event,
)
from cg.wire.markers import EXPAND_TOOL
from cg.wire.sse import SSEParser

REF = "0123456789abcdef"
ARGS = '{"id":"' + REF + '"}'


def expand_item(call_id: str = "call_x", args: str = ARGS, id: str = "fc_x") -> dict:
    return responses_function_call(EXPAND_TOOL, args, call_id=call_id, id=id)


SHELL = responses_function_call("exec_command", '{"cmd":"ls"}', call_id="call_c", id="fc_c")
PATCH = {"id": "ctc_1", "type": "custom_tool_call", "status": "completed", "call_id": "call_p",
         "name": "apply_patch", "input": "*** Begin Patch"}
SEARCH = {"id": "ws_1", "type": "web_search_call", "status": "completed",
          "action": {"type": "search", "query": "cg"}}
THINK1, THINK2, THINK3 = (responses_reasoning(id=f"rs_{n}") for n in (1, 2, 3))
TEXT1 = responses_message("Let me look.", id="msg_1")
TEXT2 = responses_message("Line 450.", id="msg_2")


def stream(*items: dict, id: str = "resp_1", input_tokens: int = 100, output_tokens: int = 7) -> list[bytes]:
    """A whole upstream response: created, in_progress, each item's events, completed."""
    return responses_stream_events(list(items), id=id, input_tokens=input_tokens, output_tokens=output_tokens)


def ending(events: list[bytes], kind: str, status: str) -> list[bytes]:
    """``events`` with its response.completed turned into another terminal event."""
    doc = ujson.loads(events[-1].split(b"data: ", 1)[1])
    doc["type"] = kind
    doc["response"]["status"] = status
    return [*events[:-1], sse_event(kind, doc)]


def error_event(seq: int = 99) -> bytes:
    return sse_event("error", {"type": "error", "code": "server_error", "message": "overloaded", "param": None,
                               "sequence_number": seq})


ROUND1 = stream(THINK1, TEXT1, expand_item())  # 17 events; the call's starts at [11]
SENT1 = b"".join(ROUND1[:11])  # what round 1 sends before it holds
ROUND2 = stream(THINK2, TEXT2, id="resp_2", input_tokens=9999, output_tokens=5)
CODEX1 = stream(THINK1, expand_item())  # reasoning, then the call: Codex's usual expand turn


def run(rounds: list[list[bytes]], chunker=None, complete: bool = True, **kw) -> tuple[bytes, object, ResponsesInspector]:
    insp = ResponsesInspector(**kw)
    return (*run_rounds(insp, rounds, chunker, complete), insp)


def docs(data: bytes) -> list[dict]:
    return [ujson.loads(e.data) for e in SSEParser().feed(data) if e.data]


def sdk_stream(data: bytes):
    """What the official SDK's accumulator makes of a client stream: its events, and the final
    response (or the RuntimeError get_final_response() raises)."""

    def handler(request):
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=data)

    client = openai.OpenAI(api_key="k", base_url="http://cg.invalid/v1", max_retries=0,
                           http_client=httpx2.Client(transport=httpx2.MockTransport(handler)))
    with client.responses.stream(model="gpt-5.5", input="hi") as s:
        events = list(s)
        try:
            return events, s.get_final_response()
        except RuntimeError as error:
            return events, error


def assert_one_response(data: bytes, ids: list[str], text: str):
    """``data`` reads as one well-formed response: round 1's lifecycle, dense indexes, continuous
    sequence numbers, and the SDK's final response lists ``ids`` and says ``text``."""
    events = docs(data)
    kinds = [e["type"] for e in events]
    assert kinds.count("response.created") == 1 and kinds.count("response.in_progress") == 1
    assert kinds.count("response.completed") == 1 and kinds[-1] == "response.completed"
    assert {e["response"]["id"] for e in events if "response" in e} == {"resp_1"}
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    assert added == list(range(len(ids)))
    assert [e["item"]["id"] for e in events if e["type"] == "response.output_item.done"] == ids
    sdk_events, final = sdk_stream(data)
    assert [item.id for item in final.output] == ids and final.id == "resp_1"
    assert final.output_text == text
    return events[-1]["response"]


# ---------------------------------------------------------------------------------------------
# WATCH


def test_a_response_without_expand_is_forwarded_event_by_event():
    events = stream(THINK1, TEXT1, SHELL)
    events.insert(3, b": comment\r\n\r\n")
    insp = ResponsesInspector()
    steps = [insp.feed(event) for event in events_of(b"".join(events))]
    assert steps == [Step(raw, CONTINUE) for raw in events]  # each the moment it is fed, byte for byte
    assert insp.end(True) == Step(b"", DONE) and insp.released is None and insp.held_events == 0


@pytest.mark.parametrize("client", [SHELL, PATCH], ids=["function", "custom"])
def test_a_client_call_first_lets_a_later_expand_call_through(client):
    events = stream(client, expand_item())
    data, action, insp = run([events])
    assert data == b"".join(events) and action == DONE
    assert insp.held_events == 0 and insp.state is State.DONE


def test_a_server_call_first_does_not_stop_the_hold():
    events = stream(SEARCH, expand_item())
    data, action, insp = run([events, ROUND2])
    assert action == DONE and insp.spliced and insp.calls == [ExpandCall("call_x", ARGS, REF)]


def test_data_only_framing_is_read_by_the_json_type():
    """Codex accepts ``data:`` lines alone; the type is the JSON's."""
    bare = [[e.split(b"\n", 1)[1] for e in r] for r in (ROUND1, ROUND2)]
    data, action, insp = run(bare)
    assert action == DONE and data.startswith(b"".join(bare[0][:11]))
    assert_one_response(data, ["rs_1", "msg_1", "rs_2", "msg_2"], "Let me look.Line 450.")


# ---------------------------------------------------------------------------------------------
# HOLD and the decision


def test_a_lone_expand_call_is_held_and_decided_at_completed():
    insp = ResponsesInspector()
    sent, action = feed_round(insp, [b"".join(ROUND1)])
    assert sent == SENT1 and action == EXPAND and insp.state is State.AWAIT
    assert insp.held_events == 6  # the call's added, 2 deltas, arguments done, item done, completed
    assert insp.calls == [ExpandCall("call_x", ARGS, REF)]
    assert insp.assistant_message() == {"id": "resp_1", "status": "completed",
                                        "output": [THINK1, TEXT1, expand_item()]}
    with pytest.raises(RuntimeError):
        insp.feed(SSEParser().feed(ROUND2[0])[0])


def test_parallel_expand_calls_are_all_held():
    events = stream(expand_item(), expand_item("call_y", '{"id":"fedcba9876543210"}', "fc_y"))
    insp = ResponsesInspector()
    sent, action = feed_round(insp, [b"".join(events)])
    assert sent == b"".join(events[:2]) and action == EXPAND
    assert [(c.id, c.ref) for c in insp.calls] == [("call_x", REF), ("call_y", "fedcba9876543210")]
    assert [item["call_id"] for item in insp.assistant_message()["output"]] == ["call_x", "call_y"]


def test_an_id_that_names_no_marker_is_still_cgs_to_answer():
    events = stream(expand_item(args='{"id":"no such marker"}'))
    _, action, insp = run([events, ROUND2])
    assert action == DONE and insp.calls == [ExpandCall("call_x", '{"id":"no such marker"}', None)]


@pytest.mark.parametrize(("after", "reason"), [
    (SHELL, "client_tool"),
    (PATCH, "client_tool"),
    (TEXT1, "other_block"),
    (THINK2, "other_block"),
    (SEARCH, "other_block"),
])
def test_any_other_item_releases_verbatim(after, reason):
    events = stream(expand_item(), after)
    data, action, insp = run([events])
    assert data == b"".join(events) and action == DONE and insp.released == reason


def no_call_id() -> dict:
    item = expand_item()
    del item["call_id"]
    return item


@pytest.mark.parametrize("events", [
    stream(expand_item(args='{"id": 7}')),
    stream(expand_item(args='{"id": "a')),
    stream(expand_item(args='["' + REF + '"]')),
    stream(no_call_id()),
    [*ROUND1[:15], ROUND1[16]],  # the call's output_item.done never came
], ids=["id not a string", "not JSON", "not an object", "no call_id", "never done"])
def test_a_call_cg_cannot_answer_is_released_verbatim(events):
    data, action, insp = run([events])
    assert data == b"".join(events) and action == DONE and insp.released == "bad_input"


def test_an_event_of_an_item_not_held_releases():
    interleaved = ROUND1[:13] + [ROUND1[7]] + ROUND1[13:]  # a text delta of msg_1 amid the held call
    data, action, insp = run([interleaved])
    assert data == b"".join(interleaved) and insp.released == "other_block"


@pytest.mark.parametrize(("events", "reason"), [
    (ending(ROUND1, "response.incomplete", "incomplete"), "stop_reason"),
    (ending(ROUND1, "response.failed", "failed"), "stop_reason"),
    ([*ROUND1[:-1], error_event()], "error"),
])
def test_a_response_cg_cannot_answer_is_released_verbatim(events, reason):
    data, action, insp = run([events])
    assert data == b"".join(events) and action == DONE and insp.released == reason


def test_past_max_held_the_hold_is_released():
    data, action, insp = run([ROUND1], max_held=len(ROUND1[11]) + 1)
    assert data == b"".join(ROUND1) and action == DONE and insp.released == "max_held"


def test_unknown_events_and_comments_while_holding_are_held():
    odd = [b": keep-alive\n\n", sse_event("response.rate_limits.updated", {"type": "response.rate_limits.updated"})]
    round1 = [*ROUND1[:13], *odd, *ROUND1[13:]]
    data, action, insp = run([round1, ROUND2])
    assert action == DONE and b"keep-alive" not in data and b"rate_limits" not in data


def test_an_error_event_ends_round_one():
    events = [*stream(TEXT1)[:-1], error_event()]
    data, action, insp = run([events])
    assert data == b"".join(events) and action == DONE and insp.released is None


@pytest.mark.parametrize(("events", "complete", "reason"), [
    (ROUND1[:-1], True, "ended"),  # cut while holding: released
    (stream(TEXT1)[:-1], True, None),
    (stream(TEXT1), False, None),
])
def test_a_round_one_without_its_end_never_looks_complete(events, complete, reason):
    data, action, insp = run([events], complete=complete)
    assert data == b"".join(events) and action == ABORT and insp.released == reason


# ---------------------------------------------------------------------------------------------
# The splice


def test_the_splice_reads_as_one_response():
    data, action, insp = run([ROUND1, ROUND2])
    assert action == DONE and insp.spliced and insp.rounds == 1 and insp.released is None
    assert data.startswith(SENT1) and b"fc_x" not in data and b"resp_2" not in data
    response = assert_one_response(data, ["rs_1", "msg_1", "rs_2", "msg_2"], "Let me look.Line 450.")
    assert response["usage"] == {"input_tokens": 100, "input_tokens_details": {"cached_tokens": 0},
                                 "output_tokens": 12, "output_tokens_details": {"reasoning_tokens": 0},
                                 "total_tokens": 112}
    assert [u.output_tokens for u in insp.billed] == [7, 5]
    spliced = events_of(data[len(SENT1):])
    compact = [ujson.dumps(ujson.loads(e.data), ensure_ascii=False, escape_forward_slashes=False).encode()
               for e in spliced]
    assert [e.raw for e in spliced] == [b"event: " + e.name.encode() + b"\ndata: " + c + b"\n\n"
                                        for e, c in zip(spliced, compact)]  # event lines, compact JSON


def test_a_codex_turn_reads_as_the_continuations_answer():
    data, action, _ = run([CODEX1, ROUND2])
    assert action == DONE
    assert_one_response(data, ["rs_1", "rs_2", "msg_2"], "Line 450.")


def test_two_continuations_read_as_one_response():
    round2 = stream(THINK2, expand_item("call_z", id="fc_z"), id="resp_2", input_tokens=500, output_tokens=3)
    round3 = stream(THINK3, TEXT2, id="resp_3", input_tokens=600, output_tokens=5)
    data, action, insp = run([ROUND1, round2, round3])
    assert action == DONE and insp.rounds == 2 and [c.id for c in insp.calls] == ["call_z"]
    response = assert_one_response(data, ["rs_1", "msg_1", "rs_2", "rs_3", "msg_2"], "Let me look.Line 450.")
    assert (response["usage"]["input_tokens"], response["usage"]["output_tokens"]) == (100, 15)
    assert [u.output_tokens for u in insp.billed] == [7, 3, 5]


def test_the_second_decision_gives_that_rounds_items():
    round2 = stream(THINK2, expand_item("call_z", id="fc_z"), id="resp_2")
    insp = ResponsesInspector()
    feed_round(insp, [b"".join(ROUND1)])
    insp.begin_continuation()
    sent, action = feed_round(insp, [b"".join(round2)])
    assert action == EXPAND and [e["item"]["id"] for e in docs(sent) if "item" in e] == ["rs_2", "rs_2"]
    assert insp.assistant_message() == {"id": "resp_1", "status": "completed",
                                        "output": [THINK2, expand_item("call_z", id="fc_z")]}


def test_a_continuation_calling_a_client_tool_keeps_dense_indexes():
    data, action, insp = run([CODEX1, stream(SHELL, id="resp_2")])
    assert action == DONE
    assert_one_response(data, ["rs_1", "fc_c"], "")
    assert [c.id for c in insp.calls] == ["call_x"]


def test_a_release_in_a_continuation_is_spliced():
    round2 = stream(expand_item("call_z", id="fc_z"), TEXT2, id="resp_2")
    data, action, insp = run([ROUND1, round2])
    assert action == DONE and insp.released == "other_block"
    assert_one_response(data, ["rs_1", "msg_1", "fc_z", "msg_2"], "Let me look.Line 450.")


def test_at_the_round_cap_an_expand_call_goes_to_the_client_spliced():
    round2 = stream(THINK2, expand_item("call_z", id="fc_z"), id="resp_2")
    data, action, insp = run([ROUND1, round2], max_rounds=1)
    assert action == DONE and insp.rounds == 1 and insp.released is None
    assert_one_response(data, ["rs_1", "msg_1", "rs_2", "fc_z"], "Let me look.")


def test_no_rounds_no_hold():
    data, action, insp = run([ROUND1], max_rounds=0)
    assert data == b"".join(ROUND1) and action == DONE and insp.held_events == 0


def test_a_continuations_usage_stands_alone_when_round_one_had_none():
    doc = ujson.loads(ROUND1[-1].split(b"data: ", 1)[1])
    doc["response"]["usage"] = None
    round1 = [*ROUND1[:-1], sse_event("response.completed", doc)]
    data, _, _ = run([round1, ROUND2])
    assert docs(data)[-1]["response"]["usage"]["input_tokens"] == 9999


# ---------------------------------------------------------------------------------------------
# Failures


def test_a_continuation_that_cannot_start_gives_round_one_verbatim():
    data, action, insp = run([ROUND1])  # no continuation: the caller releases
    assert data == b"".join(ROUND1) and action == DONE and insp.released == "continuation_failed"


@pytest.mark.parametrize("round2", [
    [*ROUND2[:2], error_event(2)],
    ending(ROUND2[:2] + ROUND2[-1:], "response.failed", "failed"),
    ending(ROUND2[:2] + ROUND2[-1:], "response.incomplete", "incomplete"),
    ROUND2[:2],  # created and in_progress, then the end: nothing committed
], ids=["error", "failed", "incomplete", "ended"])
def test_a_continuation_that_fails_before_committing_gives_round_one_verbatim(round2):
    data, action, insp = run([ROUND1, round2])
    assert data == b"".join(ROUND1) and action == DONE and insp.released == "continuation_failed"
    assert isinstance(sdk_stream(data)[1].output[2], openai.types.responses.ResponseFunctionToolCall)


def test_a_failed_second_continuation_gives_the_first_continuations_release():
    round2 = stream(THINK2, expand_item("call_z", id="fc_z"), id="resp_2")
    data, action, insp = run([ROUND1, round2, ROUND2[:2]])
    assert action == DONE and insp.released == "continuation_failed"
    assert_one_response(data, ["rs_1", "msg_1", "rs_2", "fc_z"], "Let me look.")


@pytest.mark.parametrize(("round2", "complete", "shown"), [
    (ROUND2[:8], False, ["rs_2"]),  # broke mid-text
    (ROUND2[:-1], True, ["rs_2", "msg_2"]),  # ended without its completed
    ([*ROUND2[:4], error_event(4)], True, ["rs_2"]),  # an error, and no terminal response event
], ids=["broke", "no completed", "error"])
def test_a_continuation_broken_after_committing_ends_with_a_failed_response(round2, complete, shown):
    data, action, insp = run([ROUND1, round2], complete=complete)
    assert action == DONE and insp.state is State.DONE
    events = docs(data)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events].count("response.completed") == 0
    failed = events[-1]
    assert failed["type"] == "response.failed" and data.endswith(b"\n\n")
    response = failed["response"]
    assert (response["id"], response["status"], response["error"]["code"]) == ("resp_1", "failed", "server_error")
    assert [item["id"] for item in response["output"]] == ["rs_1", "msg_1", *shown]
    assert (response["usage"]["input_tokens"], response["usage"]["output_tokens"]) == (100, 7)
    _, final = sdk_stream(data)
    assert isinstance(final, RuntimeError) and "response.completed" in str(final)


def test_a_continuation_cut_after_its_completed_aborts():
    data, action, _ = run([ROUND1, ROUND2], complete=False)
    assert action == ABORT and b"response.failed" not in data


def test_after_the_end_nothing_more_is_sent():
    insp = ResponsesInspector()
    feed_round(insp, [b"".join(stream(TEXT1))])
    assert insp.feed(SSEParser().feed(ROUND2[0])[0]).action == DONE
    assert insp.end(True).send == b"" and insp.release() == b""
    with pytest.raises(RuntimeError):
        insp.begin_continuation()


# ---------------------------------------------------------------------------------------------
# Chunk boundaries


SCENARIOS = {
    "spliced": ([ROUND1, ROUND2], "Let me look.Line 450."),
    "codex": ([CODEX1, ROUND2], "Line 450."),
    "spliced twice": ([ROUND1, stream(expand_item("call_z", id="fc_z"), id="resp_2"), ROUND2],
                      "Let me look.Line 450."),
    "data only": ([[e.split(b"\n", 1)[1] for e in r] for r in (ROUND1, ROUND2)], "Let me look.Line 450."),
    "released": ([stream(TEXT1, expand_item(), SHELL)], None),
    "bad input": ([stream(TEXT1, expand_item(args='{"id": "a'))], None),
}


@settings(max_examples=60, deadline=None)
@given(data=st.data(), name=st.sampled_from(sorted(SCENARIOS)), crlf=st.booleans())
def test_rechunking_gives_the_same_client_bytes(data, name, crlf):
    rounds, text = SCENARIOS[name]
    if crlf:
        rounds = [[e.replace(b"\n", b"\r\n") for e in r] for r in rounds]
    expected, action, _ = run(rounds)

    chunker = cutting(data)

    got, got_action, _ = run(rounds, chunker=chunker)
    assert got == expected and got_action == action == DONE
    if text is None:
        assert got == b"".join(rounds[0])
        return
    _, final = sdk_stream(got)
    assert final.id == "resp_1" and final.output_text == text
    assert {item.type for item in final.output} <= {"reasoning", "message"}
    added = [e["output_index"] for e in docs(got) if e["type"] == "response.output_item.added"]
    assert added == list(range(len(final.output)))
