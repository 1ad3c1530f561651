"""The expand loop for JSON responses and the repair of expand calls, through the running proxy.

The fake upstream runs strict: it answers 400, as the real API does, to a request whose tool calls
are not all answered in order, or whose thinking blocks differ from what it sent.
"""

import hashlib
import json
import os
import subprocess
import sys

import anthropic
import openai
import pytest
import ujson
from helpers.bodies import BASH, NO_SUCH_TOOL, expand_use, repair_request, request_with_output
from helpers.replies import USAGE, tool_turn
from pytest_twisted import inlineCallbacks
from rawhttp import connect, http_request, split_response
from twisted.internet.defer import succeed
from twisted.internet.threads import deferToThread

from cg.compaction.expand import ANTHROPIC_TOOL
from cg.testing import JSONReply, Reset, anthropic_message, command_output, openai_completion
from cg.wire.markers import EXPAND_TOOL, marker_id


@pytest.fixture
def strict_cg(make_cg, fake, fake_openai):
    fake.strict = fake_openai.strict = True
    return make_cg(anthropic_upstream=fake.url, openai_upstream=fake_openai.url, expand=True)


def create(cg, body):
    client = anthropic.Anthropic(base_url=cg.url, api_key="sk-one", max_retries=0)
    return deferToThread(client.messages.create, **body)


def sent(received) -> dict:
    return json.loads(received.body)


@inlineCallbacks
def test_lone_expand_round_trip(strict_cg, fake):
    output = command_output()
    ref = marker_id(output.encode())
    fake.enqueue(
        tool_turn({"type": "text", "text": "Let me look."}, expand_use(ref), id="msg_first"),
        JSONReply(anthropic_message("The failing test is broken.test.ts.", usage={**USAGE, "output_tokens": 7})),
    )
    message = yield create(strict_cg, request_with_output(output))

    assert [b.type for b in message.content] == ["text", "text"]  # the client never sees the tool
    assert message.content[0].text == "Let me look."
    assert message.content[1].text == "The failing test is broken.test.ts."
    assert message.id == "msg_first" and message.stop_reason == "end_turn"
    # usage: the input side of the first round, output summed over rounds
    assert message.usage.input_tokens == 100 and message.usage.cache_read_input_tokens == 5000
    assert message.usage.output_tokens == 17

    first, second = fake.received
    assert f"<<cg:{ref}>>" in json.dumps(sent(first)["messages"][2])
    messages = sent(second)["messages"]
    appended = b"".join(b"," + json.dumps(m, separators=(",", ":"), ensure_ascii=False).encode()
                        for m in messages[-2:])
    assert second.body.replace(appended, b"", 1) == first.body  # the continuation only appends
    assert messages[-2] == {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                                             expand_use(ref)]}
    assert messages[-1] == {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x1",
                                                          "content": output}]}
    assert fake.rejections == []
    stats = strict_cg.stats.snapshot()
    assert stats["expand"]["bounces"] == 1 and stats["expand"]["resolved"] == 1
    assert stats["expand"]["wasted_tokens"] > 1000
    assert stats["usage"]["requests"] == 1  # one client request, billed for both rounds
    assert strict_cg.stats.usage.usage.output_tokens == 17


@inlineCallbacks
def test_two_calls_one_unknown_every_call_answered(strict_cg, fake):
    output = command_output()
    ref = marker_id(output.encode())
    fake.enqueue(
        tool_turn(expand_use(ref, "toolu_a"), expand_use("ffffffffffffffff", "toolu_b"), expand_use(ref, "toolu_c")),
        JSONReply(anthropic_message("done")),
    )
    message = yield create(strict_cg, request_with_output(output))
    assert message.content[-1].text == "done"
    results = sent(fake.received[1])["messages"][-1]["content"]
    assert [r["tool_use_id"] for r in results] == ["toolu_a", "toolu_b", "toolu_c"]
    assert results[0]["content"] == results[2]["content"] == output
    assert "no longer stored; do not retry" in results[1]["content"]
    assert strict_cg.stats.expand.evicted == 1 and strict_cg.stats.expand.resolved == 2
    assert fake.rejections == []


@inlineCallbacks
def test_thinking_then_expand_keeps_the_signature(strict_cg, fake):
    output = command_output()
    ref = marker_id(output.encode())
    thinking = {"type": "thinking", "thinking": "The middle of the log matters.", "signature": "EqQBc2lnbmF0dXJl"}
    fake.enqueue(tool_turn(thinking, expand_use(ref)), JSONReply(anthropic_message("ok")))
    body = request_with_output(output, thinking={"type": "enabled", "budget_tokens": 1024})
    message = yield create(strict_cg, body)
    assert message.content[0].type == "thinking" and message.content[0].signature == "EqQBc2lnbmF0dXJl"
    assert sent(fake.received[1])["messages"][-2]["content"][0] == thinking
    assert fake.rejections == []


@inlineCallbacks
def test_a_model_that_expands_forever_stops_at_the_cap(strict_cg, fake):
    output = command_output()
    ref = marker_id(output.encode())
    fake.default_reply = lambda received: tool_turn(expand_use(ref, f"toolu_{len(fake.received)}"))
    message = yield create(strict_cg, request_with_output(output))
    assert len(fake.received) == 3 + 1  # --max-expand-rounds 3: the request and 3 continuations
    assert message.stop_reason == "tool_use"
    assert message.content[-1].name == EXPAND_TOOL  # the last round passes as it is: repaired next turn
    assert fake.rejections == []


@inlineCallbacks
def test_expand_batched_with_a_client_tool_goes_to_the_client_verbatim(strict_cg, fake):
    output = command_output()
    reply = anthropic_message(content=[expand_use(marker_id(output.encode())),
                                       {"type": "tool_use", "id": "toolu_ls", "name": "Bash",
                                        "input": {"command": "ls"}}], stop_reason="tool_use")
    raw_reply = b'{"id": "msg_1",  "content": ' + ujson.dumps(reply["content"]).encode() + b', "type": "message"}'
    fake.enqueue(JSONReply(raw_reply))
    client = yield connect(strict_cg.port, http_request("POST", "/v1/messages", json.dumps(request_with_output(output)).encode(),
                                                         [("content-type", "application/json")]))
    assert split_response((yield client.closed))[2] == raw_reply
    assert len(fake.received) == 1


OVERLOADED = JSONReply({"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}, status=529)


# A reset on the reused connection is retried once on a fresh one (the foundation's rule): reset both.
@pytest.mark.parametrize("failures", [[OVERLOADED], [Reset(), Reset()]])
@inlineCallbacks
def test_a_failed_continuation_gives_the_rounds_so_far(strict_cg, fake, failures):
    output = command_output()
    ref = marker_id(output.encode())
    fake.enqueue(tool_turn({"type": "text", "text": "Looking."}, expand_use(ref)), *failures)
    message = yield create(strict_cg, request_with_output(output))
    assert message.content[0].text == "Looking." and message.content[1].name == EXPAND_TOOL
    assert strict_cg.stats.expand.continuations_failed == 1


@inlineCallbacks
def test_another_tenant_cannot_expand_my_id(make_cg, fake):
    cg = make_cg(anthropic_upstream=fake.url, expand=True, tenant="credential")
    output = command_output()
    ref = marker_id(output.encode())
    fake.enqueue(JSONReply(anthropic_message("stored")))
    yield create(cg, request_with_output(output))  # stores the original under sk-one
    fake.enqueue(tool_turn(expand_use(ref)), JSONReply(anthropic_message("ok")))
    other = anthropic.Anthropic(base_url=cg.url, api_key="sk-two", max_retries=0)
    yield deferToThread(other.messages.create, **request_with_output("short", max_tokens=5))
    answer = sent(fake.received[-1])["messages"][-1]["content"][0]["content"]
    assert output not in answer and "no longer stored" in answer


@inlineCallbacks
def test_repair_replaces_the_clients_error_and_is_frozen(strict_cg, fake):
    output = command_output()
    ref = marker_id(output.encode())
    yield strict_cg.service.store.put("", {ref: output.encode()})
    raw = json.dumps(repair_request(ref), separators=(",", ":")).encode()
    for _ in range(2):
        client = yield connect(strict_cg.port, http_request("POST", "/v1/messages", raw, [("content-type", "application/json")]))
        yield client.closed
    first, second = fake.received
    assert first.body == second.body
    block = sent(first)["messages"][2]["content"][0]
    assert block == {"type": "tool_result", "tool_use_id": "toolu_leak", "content": output}
    # every other byte as the client sent it (the tool appended last)
    new = json.dumps(block, separators=(",", ":"), ensure_ascii=False).encode()
    old = json.dumps(repair_request(ref)["messages"][2]["content"][0], separators=(",", ":")).encode()
    assert first.body.replace(new, old).replace(b"," + ANTHROPIC_TOOL.encode(), b"") == raw
    assert strict_cg.stats.expand.repairs == 2

    strict_cg.service.store._originals.clear()  # the original is evicted: the repair replays
    client = yield connect(strict_cg.port, http_request("POST", "/v1/messages", raw, [("content-type", "application/json")]))
    yield client.closed
    assert fake.received[2].body == first.body


@inlineCallbacks
def test_repair_of_an_unknown_id_answers_finally(strict_cg, fake):
    raw = json.dumps(repair_request("0123456789abcdef")).encode()
    client = yield connect(strict_cg.port, http_request("POST", "/v1/messages", raw, [("content-type", "application/json")]))
    yield client.closed
    block = sent(fake.received[0])["messages"][2]["content"][0]
    assert "no longer stored; do not retry" in block["content"] and "is_error" not in block


@inlineCallbacks
def test_answers_that_are_not_errors_are_not_repaired(strict_cg, fake):
    body = repair_request("0123456789abcdef")
    body["messages"][2]["content"][0] = {"type": "tool_result", "tool_use_id": "toolu_leak", "content": "fine"}
    raw = json.dumps(body).encode()
    client = yield connect(strict_cg.port, http_request("POST", "/v1/messages", raw, [("content-type", "application/json")]))
    yield client.closed
    assert sent(fake.received[0])["messages"] == body["messages"]


@inlineCallbacks
def test_openai_expand_and_repair(strict_cg, fake_openai):
    output = command_output()
    ref = marker_id(output.encode())
    tools = [{"type": "function", "function": {"name": "shell", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "user", "content": "run it"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "shell", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": output},
    ]
    call = {"id": "call_x", "type": "function", "function": {"name": EXPAND_TOOL, "arguments": json.dumps({"id": ref})}}
    first = openai_completion("")
    first["choices"][0]["message"] = {"role": "assistant", "content": None, "tool_calls": [call]}
    first["choices"][0]["finish_reason"] = "tool_calls"
    fake_openai.enqueue(JSONReply(first), JSONReply(openai_completion("all green")))
    client = openai.OpenAI(base_url=strict_cg.url + "/v1", api_key="k", max_retries=0)
    reply = yield deferToThread(client.chat.completions.create, model="gpt-5", messages=messages, tools=tools)
    assert reply.choices[0].message.content == "all green"
    assert sent(fake_openai.received[1])["messages"][-1] == {"role": "tool", "tool_call_id": "call_x", "content": output}

    # the client answered the expand call itself with an error: repaired next turn
    answered = [*messages, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_x", "content": "Error: unknown tool context_guru_expand"}]
    fake_openai.enqueue(JSONReply(openai_completion("ok")))
    yield deferToThread(client.chat.completions.create, model="gpt-5", messages=answered, tools=tools)
    assert sent(fake_openai.received[2])["messages"][-1]["content"] == output
    assert fake_openai.rejections == []


@inlineCallbacks
def test_count_tokens_sees_what_cg_sends_and_stores_nothing(strict_cg, fake):
    output = command_output()
    client = anthropic.Anthropic(base_url=strict_cg.url, api_key="k", max_retries=0)
    yield deferToThread(client.messages.count_tokens, model="claude-opus-4-8", tools=[BASH],
                        messages=request_with_output(output)["messages"])
    counted = sent(fake.received[0])
    assert counted["tools"][-1]["name"] == EXPAND_TOOL
    assert "<<cg:" in json.dumps(counted["messages"])
    assert strict_cg.service.store.known("", [marker_id(output.encode())]) == set()


def test_tool_bytes_are_the_same_in_every_process():
    """Pinned: a change to the tool's bytes re-bills every user's cache once (note it in CHANGES.md)."""
    script = "from cg.compaction.expand import ANTHROPIC_TOOL, OPENAI_TOOL; print(ANTHROPIC_TOOL); print(OPENAI_TOOL)"
    outputs = {
        subprocess.run([sys.executable, "-c", script], capture_output=True, check=True,
                       env={**os.environ, "PYTHONHASHSEED": seed}).stdout
        for seed in ("0", "1", "4242")
    }
    assert len(outputs) == 1
    assert hashlib.sha256(ANTHROPIC_TOOL.encode()).hexdigest()[:12] == "47c7d3620d32"


@inlineCallbacks
def test_a_store_that_cannot_read_the_original_freezes_no_repair(strict_cg, fake, monkeypatch):
    """A read failure of seconds must not become a "no longer stored" frozen for every later turn."""
    output = command_output()
    ref = marker_id(output.encode())
    store = strict_cg.service.store
    yield store.put("", {ref: output.encode()})
    raw = json.dumps(repair_request(ref), separators=(",", ":")).encode()

    def failing_get(self, tenant, ident):
        self.stats.healthy = False  # as SQLiteStore marks itself on a failed read
        return succeed(None)

    monkeypatch.setattr(type(store), "get", failing_get)
    client = yield connect(strict_cg.port, http_request("POST", "/v1/messages", raw, [("content-type", "application/json")]))
    yield client.closed
    block = sent(fake.received[0])["messages"][2]["content"][0]
    assert block["content"] == NO_SUCH_TOOL  # the client's answer, as it sent it
    assert (yield store.frozen("", "toolu_leak")) is None
    monkeypatch.undo()
    store.stats.healthy = True
    client = yield connect(strict_cg.port, http_request("POST", "/v1/messages", raw, [("content-type", "application/json")]))
    yield client.closed
    assert sent(fake.received[1])["messages"][2]["content"][0]["content"] == output
