"""Streamed chat completions through the running proxy, read by the official openai SDK.

The fake upstream plays a model that asks for an offloaded tool output back (``context_guru_expand``)
and then answers; the SDK, streaming with its own tools, must see one completion that never mentions
cg's tool, and the continuation must carry the original.
"""

import json

import openai
import pytest
from helpers.bodies import TOOLS, messages
from helpers.replies import LATER, expanding, opening_call, turn
from helpers.streams import is_insertion
from pytest_twisted import inlineCallbacks
from twisted.internet import reactor
from twisted.internet.threads import deferToThread

from cg.testing import JSONReply, SSEReply, command_output, openai_completion
from cg.wire.markers import EXPAND_TOOL, marker_id

TIMEOUT = 15


def sdk_stream(cg, output: str, **kw):
    """``chat.completions.create(stream=True, tools=...)`` in a thread: every chunk the SDK yields."""

    def run():
        client = openai.OpenAI(base_url=cg.url + "/v1", api_key="k", max_retries=0, timeout=TIMEOUT)
        return list(client.chat.completions.create(model="gpt-5", messages=messages(output), tools=TOOLS,
                                                   stream=True, **kw))

    return deferToThread(run).addTimeout(TIMEOUT + 5, reactor)


@pytest.mark.parametrize("opening", [False, True], ids=["after_text", "opening_the_turn"])
@inlineCallbacks
def test_the_sdk_streams_one_completion_while_cg_expands(make_cg, fake_openai, opening):
    cg = make_cg(openai_upstream=fake_openai.url, expand=True)
    output = command_output()
    ident = marker_id(output.encode())
    if opening:
        round1, said = opening_call(ref=ident), ""
    else:
        round1, said = turn({"content": "Let me look."}, *expanding(ref=ident), finish="tool_calls"), "Let me look."
    round2 = turn({"content": "Line 450."}, finish="stop", head=LATER, completion=5)
    fake_openai.enqueue(SSEReply(round1, delay=0.01), SSEReply(round2))
    chunks = yield sdk_stream(cg, output)

    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == said + "Line 450."
    assert [c.choices[0].delta.role for c in chunks if c.choices and c.choices[0].delta.role] == ["assistant"]
    assert not any(c.choices and c.choices[0].delta.tool_calls for c in chunks)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert {c.id for c in chunks} == {"chatcmpl-a"}
    assert all(c.usage is None for c in chunks), "usage the client did not ask for was shown"

    first, second = fake_openai.received
    assert first.body.endswith(b',"stream_options":{"include_usage":true}}')
    assert EXPAND_TOOL in [t["function"]["name"] for t in first.json()["tools"]]
    assert is_insertion(first.body, second.body), "the continuation rewrote the forwarded request"
    tail = second.json()["messages"][-2:]
    assert tail[0]["tool_calls"][0]["function"]["name"] == EXPAND_TOOL
    assert tail[1] == {"role": "tool", "tool_call_id": "call_x", "content": output}
    assert json.loads(second.body)["stream"] is True
    stats = cg.stats.sse.snapshot()
    assert stats["sse_inspected"] == 1


@inlineCallbacks
def test_usage_the_client_asked_for_is_summed(make_cg, fake_openai):
    cg = make_cg(openai_upstream=fake_openai.url, expand=True)
    output = command_output()
    round1 = turn(*expanding(ref=marker_id(output.encode())), finish="tool_calls", prompt=100, completion=7)
    round2 = turn({"content": "Done."}, finish="stop", head=LATER, prompt=5000, completion=5)
    fake_openai.enqueue(SSEReply(round1), SSEReply(round2))
    chunks = yield sdk_stream(cg, output, stream_options={"include_usage": True})
    [usage] = [c.usage for c in chunks if c.usage is not None]
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (100, 12, 112)
    assert b"stream_options" in fake_openai.received[0].body
    assert fake_openai.received[0].body.count(b"stream_options") == 1


@pytest.mark.parametrize("finish", ["stop", "tool_calls", "length"])
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
@inlineCallbacks
def test_the_json_and_streamed_paths_answer_the_same_finish_reasons(make_cg, fake_openai, finish, stream):
    """Some OpenAI-compatible servers finish a turn of tool calls with ``stop``: cg answers that turn's
    expand calls streamed and as JSON alike (and, alike, leaves a turn cut short by ``length`` to the
    client, as the provider sent it)."""
    cg = make_cg(openai_upstream=fake_openai.url, expand=True)
    output = command_output()
    ref = marker_id(output.encode())
    if stream:
        round1 = turn(*expanding(ref=ref), finish=finish)
        fake_openai.enqueue(SSEReply(round1), SSEReply(turn({"content": "Line 450."}, finish="stop", head=LATER)))
        chunks = yield sdk_stream(cg, output)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        calls = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or () if call.id]
    else:
        round1 = openai_completion(None, calls=[("call_x", EXPAND_TOOL, '{"id":"' + ref + '"}')])
        round1["choices"][0]["finish_reason"] = finish
        fake_openai.enqueue(JSONReply(round1), JSONReply(openai_completion("Line 450.")))

        def create():
            client = openai.OpenAI(base_url=cg.url + "/v1", api_key="k", max_retries=0, timeout=TIMEOUT)
            return client.chat.completions.create(model="gpt-5", messages=messages(output), tools=TOOLS)

        completion = yield deferToThread(create).addTimeout(TIMEOUT + 5, reactor)
        text, calls = completion.choices[0].message.content, completion.choices[0].message.tool_calls or []
    if finish == "length":
        assert len(fake_openai.received) == 1 and len(calls) == 1 and not text
    else:
        assert len(fake_openai.received) == 2 and text == "Line 450." and not calls
        assert fake_openai.received[1].json()["messages"][-1] == {"role": "tool", "tool_call_id": "call_x",
                                                                   "content": output}
