"""The Responses API's expand loop, pure (cg.stream.responses), its repair, and its usage."""

import json

import pytest

from cg.compaction.repair import find_repairs, looks_like_error, repair_edits
from cg.stream import responses
from cg.stream.continuation import EVICTED, ExpandCall
from cg.stream.usage import StreamUsage, Usage
from cg.testing import (
    responses_function_call,
    responses_message,
    responses_reasoning,
    responses_response,
    responses_stream_events,
)
from cg.wire.body import ParsedBody
from cg.wire.dialect import RESPONSES_SHAPE
from cg.wire.markers import EXPAND_TOOL
from cg.wire.sse import SSEParser

REF = "0123456789abcdef"


def expand_item(call_id="call_e", ref=REF, id="fc_e"):
    return responses_function_call(EXPAND_TOOL, json.dumps({"id": ref}), call_id, id)


def test_a_finished_response_of_expand_calls_reasoning_and_text_is_cgs():
    response = responses_response([responses_reasoning(), responses_message("Let me look."),
                                   expand_item("a"), expand_item("b", f"<<cg:{REF}>>"),
                                   {"type": "web_search_call", "id": "ws", "status": "completed"},
                                   {"type": "compaction", "id": "cmp", "encrypted_content": "gAAA=="}])
    assert responses.lone_expand_calls(response) == [
        ExpandCall("a", json.dumps({"id": REF}), REF), ExpandCall("b", json.dumps({"id": f"<<cg:{REF}>>"}), REF)]


@pytest.mark.parametrize("other", [
    responses_function_call("exec_command", "{}", "call_x", "fc_x"),
    {"type": "custom_tool_call", "id": "ctc", "call_id": "call_y", "name": "apply_patch", "input": ""},
    {"type": "local_shell_call", "id": "lsc", "call_id": "call_z", "action": {}},
    {"type": "something_new", "id": "x"},
    "not an item",
], ids=["function", "custom", "local_shell", "unknown", "garbage"])
def test_anything_the_client_may_have_to_answer_makes_it_the_clients(other):
    assert responses.lone_expand_calls(responses_response([expand_item(), other])) is None


def test_an_unfinished_or_callless_response_is_the_clients():
    assert responses.lone_expand_calls(responses_response([expand_item()], status="incomplete")) is None
    assert responses.lone_expand_calls(responses_response([responses_message()])) is None
    no_call_id = dict(expand_item(), call_id=None)
    assert responses.lone_expand_calls(responses_response([no_call_id])) is None


def test_a_call_without_a_usable_id_is_answered_as_malformed():
    (call,) = responses.lone_expand_calls(responses_response([expand_item(ref=None) | {"arguments": "{}"}]))
    assert call.ref is None


FORWARDED = b'{"model":"gpt-5.5","input":[{"type":"message","role":"user","content":"hi"}],"tools":[],"store":false}'


def test_the_continuation_appends_the_rounds_items_and_the_answers():
    round1 = responses_response([responses_reasoning(), expand_item()])
    calls = responses.lone_expand_calls(round1)
    body = responses.continuation_body(FORWARDED, round1, calls, {REF: "the original é".encode()}, True)
    head = FORWARDED[:FORWARDED.index(b']')]
    assert body.startswith(head + b",")
    doc = json.loads(body)
    assert doc["input"][1:] == [responses_reasoning(), expand_item(),
                                {"type": "function_call_output", "call_id": "call_e", "output": "the original é"}]
    assert doc["stream"] is True and b"\\u00e9" not in body  # written as the client writes: raw UTF-8
    assert body.endswith(b'"store":false,"stream":true}')


def test_a_string_input_becomes_a_message_and_an_unstored_ref_a_final_answer():
    forwarded = b'{"model":"gpt-5.5","input":"hi","previous_response_id":"resp_0","stream":false}'
    round1 = responses_response([expand_item()])
    body = responses.continuation_body(forwarded, round1, responses.lone_expand_calls(round1), {REF: EVICTED}, None)
    doc = json.loads(body)
    assert doc["input"][0] == {"type": "message", "role": "user", "content": "hi"}
    assert doc["input"][2]["output"].startswith(f"the original for <<cg:{REF}>> is no longer stored")
    assert doc["previous_response_id"] == "resp_0" and doc["stream"] is False


@pytest.mark.parametrize("forwarded", [b'{"model":"m"}', b'[1]', b'{"input":3}'])
def test_a_body_without_an_input_cannot_be_continued(forwarded):
    with pytest.raises(ValueError):
        responses.continuation_body(forwarded, responses_response([expand_item()]), [], {}, None)


def test_the_client_gets_one_response_for_every_round():
    round1 = responses_response([responses_reasoning(), responses_message("Let me look."), expand_item()],
                                id="resp_1", input_tokens=100, output_tokens=7)
    round2 = responses_response([responses_message("Line 450.", id="msg_2")], id="resp_2",
                                input_tokens=900, output_tokens=5)
    merged = responses.merge([round1, round2])
    assert merged["id"] == "resp_1"
    assert [item["type"] for item in merged["output"]] == ["reasoning", "message", "message"]
    assert merged["usage"]["input_tokens"] == 100 and merged["usage"]["output_tokens"] == 12
    assert merged["usage"]["total_tokens"] == 112
    assert responses.billed([round1, round2]) == [Usage(100, 0, 0, 7), Usage(900, 0, 0, 5)]


def test_codexs_unsupported_call_answer_is_found_and_repaired():
    assert looks_like_error(f"unsupported call: {EXPAND_TOOL}")
    items = [
        {"type": "message", "role": "user", "content": "go"},
        expand_item("call_x"),
        responses_function_call("exec_command", "{}", "call_s", "fc_s"),
        {"type": "function_call_output", "id": "fco_1", "call_id": "call_x", "output": f"unsupported call: {EXPAND_TOOL}"},
        {"type": "function_call_output", "id": "fco_2", "call_id": "call_s", "output": "error: exit 1"},
    ]
    raw = json.dumps({"model": "gpt-5.5", "input": items}, separators=(",", ":")).encode()
    body = ParsedBody.parse(raw)
    (repair,) = find_repairs(body, RESPONSES_SHAPE)  # the shell's own error is the client's business
    assert (repair.tool_use_id, repair.ref, repair.message_index) == ("call_x", REF, 3)
    repaired = json.loads(body.apply(repair_edits(body, [repair], {"call_x": "ORIGINAL"})))
    assert repaired["input"][3] == {"type": "function_call_output", "id": "fco_1", "call_id": "call_x",
                                    "output": "ORIGINAL"}
    assert repaired["input"][4] == items[4]


def test_a_streams_usage_is_read_off_its_terminal_event():
    usage = StreamUsage(RESPONSES_SHAPE)
    for event in SSEParser().feed(b"".join(responses_stream_events(input_tokens=40, output_tokens=3))):
        usage.observe(event)
    assert usage.complete and usage.has_usage and usage.usage == Usage(40, 0, 0, 3)
    cut = StreamUsage(RESPONSES_SHAPE)
    for event in SSEParser().feed(b"".join(responses_stream_events()[:-1])):
        cut.observe(event)
    assert not cut.complete and not cut.has_usage
