"""The Responses API through the running proxy, read by the official openai SDK: an offloaded tool
output asked back by the model (``context_guru_expand``), answered by cg and continued upstream,
and an expand call that reached the client answered by cg on the next request (repair)."""

import json

import openai
import pytest
from helpers.drive import get_stats
from pytest_twisted import inlineCallbacks
from twisted.internet import reactor
from twisted.internet.threads import deferToThread

from cg.testing import (
    FAKE_EXPAND_CALL_ID,
    JSONReply,
    SSEReply,
    command_output,
    responses_function_call,
    responses_message,
    responses_stream_events,
)
from cg.wire.markers import EXPAND_TOOL, marker_id

TIMEOUT = 15
TOOLS = [{"type": "function", "name": "exec_command", "strict": False,
          "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}]
BIG = command_output() * 3  # well past the offload threshold


def history(output: str, *more: dict) -> list[dict]:
    return [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "run the tests"}]},
        {"type": "function_call", "call_id": "call_1", "name": "exec_command", "arguments": '{"cmd":"npm test"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": output},
        *more,
    ]


def in_thread(cg, call):
    def run():
        client = openai.OpenAI(base_url=cg.url + "/v1", api_key="k", max_retries=0, timeout=TIMEOUT)
        return call(client)

    return deferToThread(run).addTimeout(TIMEOUT + 5, reactor)


def create(cg, items: list[dict], **kw):
    return in_thread(cg, lambda client: client.responses.create(model="gpt-5.5", input=items, tools=TOOLS, store=False,
                                                                **kw))


def items_of(received) -> list[dict]:
    return received.json()["input"]


@inlineCallbacks
def test_a_json_response_that_asks_for_an_original_is_answered_and_continued(make_cg, fake_openai, tmp_path):
    changes = tmp_path / "changes.jsonl"
    cg = make_cg(openai_upstream=fake_openai.url, expand=True, changelog=str(changes))
    ident = marker_id(BIG.encode())
    response = yield create(cg, history(BIG), extra_headers={"x-fake-expand": ident})

    # One response for the client: both rounds' messages, never cg's call.
    assert [item.type for item in response.output] == ["message", "message"]
    assert EXPAND_TOOL not in response.model_dump_json()
    assert response.usage.output_tokens == 10 and response.usage.total_tokens == 20
    first, continuation = fake_openai.received
    assert f"<<cg:{ident}>>" in items_of(first)[2]["output"]
    # The continuation extends what cg forwarded, byte for byte, by the round's items and the answer.
    assert continuation.body.startswith(first.body[:first.body.rindex(b"]", 0, first.body.index(b',"tools":'))])
    call, answer = items_of(continuation)[-2:]
    assert call["name"] == EXPAND_TOOL and call["call_id"] == FAKE_EXPAND_CALL_ID
    assert answer == {"type": "function_call_output", "call_id": FAKE_EXPAND_CALL_ID, "output": BIG}

    stats = yield from get_stats(cg.port)
    assert (stats["expand"]["bounces"], stats["expand"]["resolved"]) == (1, 1)
    assert stats["requests_by_dialect"] == {"responses": 1}
    yield cg.service.changelog.flush()
    lines = [json.loads(line) for line in changes.read_text().splitlines()]
    (usage,) = [line for line in lines if line["kind"] == "usage"]
    assert (usage["dialect"], usage["path"], usage["expand_rounds"]) == ("responses", "/v1/responses", 1)
    assert (usage["input_tokens"], usage["output_tokens"]) == (20, 10)  # both rounds billed


@inlineCallbacks
def test_codexs_unsupported_call_answer_is_repaired_and_frozen(make_cg, fake_openai):
    """Codex answers an expand call it was shown with "unsupported call: NAME"; cg puts the
    original in its place, the same bytes on every later turn."""
    cg = make_cg(openai_upstream=fake_openai.url, expand=True)
    ident = marker_id(BIG.encode())
    yield create(cg, history(BIG))  # first sight: offloaded, the original stored
    leaked = [
        {"type": "function_call", "call_id": "call_x", "name": EXPAND_TOOL, "arguments": json.dumps({"id": ident})},
        {"type": "function_call_output", "call_id": "call_x", "output": f"unsupported call: {EXPAND_TOOL}"},
    ]
    yield create(cg, history(BIG, *leaked))
    yield create(cg, history(BIG, *leaked))

    _, repaired, again = fake_openai.received
    assert items_of(repaired)[-1] == {"type": "function_call_output", "call_id": "call_x", "output": BIG}
    assert again.body == repaired.body
    assert (yield from get_stats(cg.port))["expand"]["repairs"] == 2


@pytest.mark.parametrize("stream", [False, True])
@inlineCallbacks
def test_usage_is_counted_for_responses(make_cg, fake_openai, stream):
    cg = make_cg(openai_upstream=fake_openai.url, expand=True)
    if stream:
        yield in_thread(cg, lambda client: list(client.responses.create(
            model="gpt-5.5", input="hi", stream=True)))
    else:
        yield create(cg, [{"type": "message", "role": "user", "content": "hi"}])
    usage = (yield from get_stats(cg.port))["usage"]
    assert (usage["input_tokens"], usage["output_tokens"]) == (10, 5)


@inlineCallbacks
def test_the_sdk_streams_one_response_while_cg_expands(make_cg, fake_openai):
    """``responses.create(stream=True)``: one created, one completed at the very end with round 1's id,
    dense output indices and sequence numbers, never cg's call."""
    cg = make_cg(openai_upstream=fake_openai.url, expand=True)
    ident = marker_id(BIG.encode())
    events = yield in_thread(cg, lambda client: [event.model_dump() for event in client.responses.create(
        model="gpt-5.5", input=history(BIG), tools=TOOLS, store=False, stream=True,
        extra_headers={"x-fake-expand": ident})])

    types = [event["type"] for event in events]
    assert types.count("response.created") == 1 and types.count("response.completed") == 1
    assert types[-1] == "response.completed"
    assert EXPAND_TOOL not in json.dumps(events)
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    done = [event for event in events if event["type"] == "response.output_item.done"]
    assert [event["output_index"] for event in done] == [0, 1]
    completed = events[-1]["response"]
    assert completed["id"] == events[0]["response"]["id"]
    assert [item["type"] for item in completed["output"]] == ["message", "message"]
    assert completed["usage"]["output_tokens"] == 10 and completed["usage"]["input_tokens"] == 10
    _, continuation = fake_openai.received
    assert items_of(continuation)[-1] == {"type": "function_call_output", "call_id": FAKE_EXPAND_CALL_ID,
                                          "output": BIG}
    assert continuation.json()["stream"] is True
    stats = yield from get_stats(cg.port)
    assert (stats["sse_inspected"], stats["sse_spliced"], stats["expand"]["bounces"]) == (1, 1, 1)


@inlineCallbacks
def test_the_sdks_stream_helper_gets_the_final_response_cg_spliced(make_cg, fake_openai):
    """``responses.stream(...).get_final_response()`` checks lifecycle ids and output indices."""
    cg = make_cg(openai_upstream=fake_openai.url, expand=True)
    ident = marker_id(BIG.encode())

    def final(client):
        with client.responses.stream(model="gpt-5.5", input=history(BIG), tools=TOOLS, store=False,
                                     extra_headers={"x-fake-expand": ident, "x-fake-events": "2"}) as stream:
            return stream.get_final_response()

    response = yield in_thread(cg, final)
    direct = yield in_thread(type("Direct", (), {"url": fake_openai.url})(), lambda client: client.responses.create(
        model="gpt-5.5", input="hi", extra_headers={"x-fake-events": "2"}))
    assert [item.type for item in response.output] == ["message", "message"]
    assert response.output_text == direct.output_text * 2  # both rounds' text, nothing of cg's call
    assert EXPAND_TOOL not in response.model_dump_json()


@inlineCallbacks
def test_a_continuation_that_fails_gives_the_client_round_one_complete(make_cg, fake_openai):
    """Before the continuation sent anything, its failure leaves the client with the first round as
    the provider sent it: the expand call included (the client answers it, cg repairs that), and
    the one response.completed Codex needs."""
    cg = make_cg(openai_upstream=fake_openai.url, expand=True)
    round1 = responses_stream_events([responses_message("Let me look."), responses_function_call(
        EXPAND_TOOL, json.dumps({"id": marker_id(BIG.encode())}), "call_e", "fc_e")])
    fake_openai.enqueue(SSEReply(round1), JSONReply({"error": {"message": "boom"}}, status=500))
    events = yield in_thread(cg, lambda client: [event.model_dump() for event in client.responses.create(
        model="gpt-5.5", input=history(BIG), tools=TOOLS, store=False, stream=True)])

    assert len(fake_openai.received) == 2
    assert [event["sequence_number"] for event in events] == list(range(len(round1)))
    assert events[-1]["type"] == "response.completed"
    assert [item["name"] for item in events[-1]["response"]["output"] if item["type"] == "function_call"] == [
        EXPAND_TOOL]
    stats = yield from get_stats(cg.port)
    assert stats["expand"]["continuations_failed"] == 1
    assert stats["sse_released"] == {"continuation_failed": 1}


@inlineCallbacks
def test_a_response_the_provider_may_store_gets_no_expand_tool(make_cg, fake_openai):
    """Its id may be the client's next previous_response_id: after a splice it would name an
    unfinished round. Lossless reformat only."""
    cg = make_cg(openai_upstream=fake_openai.url, expand=True)
    yield in_thread(cg, lambda client: client.responses.create(model="gpt-5.5", input=history(BIG), tools=TOOLS))
    forwarded = fake_openai.received[0].body
    assert EXPAND_TOOL.encode() not in forwarded and b"<<cg:" not in forwarded
