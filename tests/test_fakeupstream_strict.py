"""The fake upstream's strict mode: it rejects, as the real APIs do, what a rewriting proxy could break."""

import copy
import json

import anthropic
import pytest
import pytest_twisted
import treq
from fixturedata import CLAUDE_CODE, CODEX, claude_code_body, codex_body
from treq.client import HTTPClient
from twisted.internet import reactor
from twisted.internet.threads import deferToThread
from twisted.web.client import Agent, HTTPConnectionPool

from cg.testing import (
    FakeUpstream,
    JSONReply,
    SSEReply,
    anthropic_message,
    anthropic_request_problems,
    anthropic_stream_events,
    anthropic_text_block,
    openai_request_problems,
    responses_function_call,
    responses_request_problems,
    sse_event,
)

TIMEOUT = 20
SIGNATURE = "EqQBCkgIARABGAIiQL+/z9kP3x2c/w=="
THINKING = {"type": "thinking", "thinking": "The log is elided; expand it.", "signature": SIGNATURE}



def turn(call_ids=("toolu_1",), answers=None, thinking=None) -> list[dict]:
    """An assistant message calling tools, and the user message answering them (in `answers` order)."""
    uses = [{"type": "tool_use", "id": i, "name": "Bash", "input": {}} for i in call_ids]
    results = [{"type": "tool_result", "tool_use_id": i, "content": "ok"}
               for i in (call_ids if answers is None else answers)]
    return [{"role": "assistant", "content": ([thinking] if thinking else []) + uses},
            {"role": "user", "content": results}]


def request(*messages, **extra) -> dict:
    return {"model": "claude-opus-4-8", "max_tokens": 100,
            "messages": [{"role": "user", "content": "hi"}, *messages], **extra}


# ---------------------------------------------------------------------------------------------
# The checks, as pure functions


def test_a_well_formed_conversation_passes():
    body = request(*turn(("toolu_1", "toolu_2")), *turn(("toolu_3",)),
                   {"role": "system", "content": "mid-conversation system entry"})
    assert anthropic_request_problems(body) == []


@pytest.mark.parametrize("messages, where", [
    (turn(("toolu_1", "toolu_2"), answers=("toolu_1",)), "messages.2"),
    (turn(("toolu_1", "toolu_2"), answers=("toolu_2", "toolu_1")), "messages.2"),
    (turn(("toolu_1",), answers=("toolu_1", "toolu_9")), "messages.2"),
    (turn(("toolu_1",))[:1], "messages.1"),
    (turn(("toolu_1",))[:1] + [{"role": "user", "content": "no results"}], "messages.2"),
    ([{"role": "assistant", "content": "text"}, turn()[1]], "messages.2"),
    (turn()[:1] + [{"role": "assistant", "content": "again"}] + turn()[1:], "messages.2"),
], ids=["missing", "out-of-order", "extra", "trailing-call", "plain-user", "answers-nothing", "not-next"])
def test_tool_use_and_tool_result_must_pair_up_in_the_next_message(messages, where):
    problems = anthropic_request_problems(request(*messages))
    assert problems and problems[0].startswith(where + ":")


def test_system_entries_between_are_skipped():
    call, answer = turn()
    assert anthropic_request_problems(request(call, {"role": "system", "content": "x"}, answer)) == []


def test_at_most_four_cache_control_blocks():
    mark = {"type": "ephemeral"}
    body = request(*turn())
    body["system"] = [{"type": "text", "text": "a", "cache_control": mark}, {"type": "text", "text": "b"}]
    body["tools"] = [{"name": "Bash", "input_schema": {"type": "object", "properties": {
        "cache_control": {"type": "string"}}}, "cache_control": mark}]  # a property of that name is no mark
    body["messages"][0] = {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": mark}]}
    body["messages"][2]["content"][0]["content"] = [{"type": "text", "text": "ok", "cache_control": mark}]
    assert anthropic_request_problems(body) == []  # four
    body["messages"][2]["content"][0]["cache_control"] = mark
    assert anthropic_request_problems(body) == [
        "A maximum of 4 blocks with cache_control may be provided. Found 5."]


@pytest.mark.parametrize("name", sorted(p.stem for p in CLAUDE_CODE.glob("*.json")))
def test_every_claude_code_fixture_passes_but_for_thinking_it_never_saw(name):
    body = claude_code_body(name)
    problems = anthropic_request_problems(body)
    thinking = [b for m in body["messages"] if m["role"] == "assistant" and isinstance(m["content"], list)
                for b in m["content"] if b.get("type") == "thinking"]
    assert len(problems) == len(thinking)
    known = {b["signature"]: b["thinking"] for b in thinking}
    assert anthropic_request_problems(body, known) == []


def test_thinking_must_come_back_exactly_as_sent():
    body = request(*turn(thinking=THINKING))
    assert anthropic_request_problems(body, {SIGNATURE: THINKING["thinking"]}) == []
    assert "Invalid `signature`" in anthropic_request_problems(body, {})[0]
    altered = copy.deepcopy(body)
    altered["messages"][1]["content"][0]["thinking"] += " "
    assert "altered" in anthropic_request_problems(altered, {SIGNATURE: THINKING["thinking"]})[0]
    redacted = request(*turn(thinking={"type": "redacted_thinking", "data": "opaque"}))
    assert anthropic_request_problems(redacted, {}, {"opaque"}) == []
    assert anthropic_request_problems(redacted, {}, set()) != []


def test_openai_tool_calls_must_be_answered_before_the_next_message():
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
        {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]}
    tool = [{"role": "tool", "tool_call_id": i, "content": "ok"} for i in ("call_2", "call_1")]
    user = {"role": "user", "content": "hi"}
    assert openai_request_problems({"messages": [user, call, *tool, user]}) == []
    assert openai_request_problems({"messages": [user, call, tool[0], user]})[0].startswith("messages.1:")
    assert openai_request_problems({"messages": [user, call, tool[0]]})[0].startswith("messages.1:")
    assert openai_request_problems({"messages": [user, tool[0]]})[0].startswith("messages.1:")
    assert openai_request_problems({"messages": [user, call, *tool, tool[0]]})[0].startswith("messages.4:")


@pytest.mark.parametrize("name", sorted(p.stem for p in CODEX.glob("*.json") if codex_body(p.stem) is not None))
def test_every_codex_fixture_passes(name):
    """What Codex really sent is what the API accepts: strict mode must not reject it."""
    assert responses_request_problems(codex_body(name)) == []


def test_responses_calls_and_outputs_must_pair_up():
    """An output without its call, or a call without its output, is a 400 (cg may drop either)."""
    call = responses_function_call("f", "{}", "call_1")
    output = {"type": "function_call_output", "call_id": "call_1", "output": "ok"}
    user = {"role": "user", "content": "hi"}
    assert responses_request_problems({"input": [user, call, output, user]}) == []
    assert responses_request_problems({"input": "hi"}) == []
    assert responses_request_problems({"input": [user, output, call]}) == [
        "input[1]: No tool call found for function call output with call_id call_1.",
        "No tool output found for function call call_1.",
    ]
    custom = {"type": "custom_tool_call_output", "call_id": "call_1", "output": []}
    assert responses_request_problems({"input": [call, custom]})[0].startswith("input[1]: No tool call found")
    assert responses_request_problems({"input": {"role": "user"}}) != []
    assert responses_request_problems({"input": ["hi"]}) == ["input[0]: an item must be an object"]


def test_responses_tools_must_be_well_formed():
    """Injecting the expand tool must give a declaration the API accepts."""
    assert responses_request_problems({"input": [], "tools": [{"type": "web_search"}]}) == []
    assert responses_request_problems({"input": [], "tools": [{"type": "function"}]}) == [
        "Missing required parameter: 'tools[0].name'."
    ]
    assert responses_request_problems({"input": [], "tools": [{"name": "f"}]}) != []
    assert responses_request_problems({"input": [], "tools": {}}) == ["tools: must be a list"]


# ---------------------------------------------------------------------------------------------
# Over HTTP


@pytest.fixture
def up():
    fake = FakeUpstream(strict=True)
    fake.listen(reactor)
    yield fake
    pytest_twisted.blockon(fake.stop())


@pytest.fixture
def http():
    pool = HTTPConnectionPool(reactor, persistent=False)
    yield HTTPClient(Agent(reactor, pool=pool))
    pytest_twisted.blockon(pool.closeCachedConnections())


async def post(http, up, body: dict, path="/v1/messages?beta=true") -> tuple[int, dict]:
    response = await http.post(up.url + path, data=json.dumps(body).encode()).addTimeout(TIMEOUT, reactor)
    return response.code, json.loads(await treq.content(response))


@pytest_twisted.ensureDeferred
async def test_strict_is_off_by_default(http):
    fake = FakeUpstream()
    fake.listen(reactor)
    try:
        code, _ = await post(http, fake, request(*turn()[:1]))
        assert code == 200 and fake.rejections == []
    finally:
        await fake.stop()


@pytest_twisted.ensureDeferred
async def test_a_rejected_request_gets_a_400_and_keeps_the_queued_reply(http, up):
    up.enqueue(JSONReply(anthropic_message("scripted")))
    code, error = await post(http, up, request(*turn()[:1]))
    assert code == 400 and error["type"] == "error"
    assert error["error"]["type"] == "invalid_request_error" and "toolu_1" in error["error"]["message"]
    assert len(up.rejections) == 1 and len(up.received) == 1
    code, reply = await post(http, up, request(*turn()))
    assert code == 200 and reply["content"][0]["text"] == "scripted" and len(up.rejections) == 1


@pytest_twisted.ensureDeferred
async def test_openai_rejections_have_openai_shape(http, up):
    call = {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                 "function": {"name": "f", "arguments": "{}"}}]}
    code, error = await post(http, up, {"model": "gpt", "messages": [call]}, "/v1/chat/completions")
    assert code == 400 and error["error"]["type"] == "invalid_request_error" and up.rejections


@pytest_twisted.ensureDeferred
async def test_responses_rejections_have_openai_shape(http, up):
    """Clients (Codex prints the body of a 400) see the OpenAI error shape; a real Codex body passes."""
    answer = {"type": "function_call_output", "call_id": "call_gone", "output": "ok"}
    code, error = await post(http, up, {"model": "gpt", "input": [answer]}, "/v1/responses")
    assert code == 400 and error["error"]["type"] == "invalid_request_error"
    assert "call_gone" in error["error"]["message"] and up.rejections
    code, reply = await post(http, up, dict(codex_body("unknown_tool_followup"), stream=False), "/v1/responses")
    assert code == 200 and reply["object"] == "response" and len(up.rejections) == 1


@pytest_twisted.ensureDeferred
async def test_thinking_sent_in_json_is_remembered(http, up):
    content = [THINKING, {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {}}]
    up.enqueue(JSONReply(anthropic_message(content=content, stop_reason="tool_use")))
    code, reply = await post(http, up, request())
    assert code == 200
    assert (await post(http, up, request(*turn(thinking=reply["content"][0]))))[0] == 200
    altered = dict(reply["content"][0], thinking="something else")
    assert (await post(http, up, request(*turn(thinking=altered))))[0] == 400
    forged = dict(reply["content"][0], signature="Zm9yZ2Vk")
    assert (await post(http, up, request(*turn(thinking=forged))))[0] == 400
    assert len(up.rejections) == 2


def thinking_stream(text_parts, signature) -> list[bytes]:
    block = [
        sse_event("content_block_start", {"type": "content_block_start", "index": 0,
                                          "content_block": {"type": "thinking", "thinking": "", "signature": ""}}),
        *(sse_event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                            "delta": {"type": "thinking_delta", "thinking": part}})
          for part in text_parts),
        sse_event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                          "delta": {"type": "signature_delta", "signature": signature}}),
        sse_event("content_block_stop", {"type": "content_block_stop", "index": 0}),
    ]
    return anthropic_stream_events(blocks=[block, anthropic_text_block(1, ["Hi"])])


@pytest_twisted.ensureDeferred
async def test_thinking_sent_in_a_stream_is_remembered(up):
    up.enqueue(SSEReply(thinking_stream(["I should ", "look first."], SIGNATURE)))

    def call():
        client = anthropic.Anthropic(base_url=up.url, api_key="x", max_retries=0, timeout=TIMEOUT)
        with client.messages.stream(model="m", max_tokens=10, messages=[{"role": "user", "content": "hi"}]) as s:
            block = s.get_final_message().content[0].model_dump()
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [dict(block)]},
                    {"role": "user", "content": "go on"}]
        ok = client.messages.create(model="m", max_tokens=10, messages=messages)
        messages[1]["content"][0]["thinking"] = "I should look first"
        with pytest.raises(anthropic.BadRequestError, match="altered"):
            client.messages.create(model="m", max_tokens=10, messages=messages)
        return block, ok

    block, ok = await deferToThread(call).addTimeout(TIMEOUT, reactor)
    assert block == {"type": "thinking", "thinking": "I should look first.", "signature": SIGNATURE}
    assert ok.content[0].type == "text" and len(up.rejections) == 1
