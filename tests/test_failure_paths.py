"""Failure paths a review found: each ends the exchange once, and fails open where it can."""

import json

from helpers.bodies import NO_SUCH_TOOL, bash_body, expand_use, history, ident_of
from helpers.drive import raw_stream, until
from helpers.replies import stream
from pytest_twisted import inlineCallbacks
from rawhttp import connect, http_request
from twisted.logger import globalLogPublisher

from cg.stream.streamcheck import check_anthropic_stream
from cg.testing import (
    JSONReply,
    SSEReply,
    anthropic_expand_block,
    anthropic_stream_events,
    anthropic_text_block,
    command_output,
    openai_completion,
    sse_event,
)


@inlineCallbacks
def test_a_response_cg_cannot_read_ends_the_exchange(make_cg, fake_openai):
    cg = make_cg(openai_upstream=fake_openai.url)
    odd = openai_completion("x")
    odd["choices"][0]["message"]["tool_calls"] = 5  # not a list: the loop's reader raises
    fake_openai.enqueue(JSONReply(odd))
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "shell"}}]}
    client = yield connect(cg.port, http_request("POST", "/v1/chat/completions", json.dumps(body).encode(),
                                                 [("content-type", "application/json")]))
    yield client.closed
    yield until(lambda: cg.stats.in_flight == 0)


@inlineCallbacks
def test_an_error_event_before_the_continuations_content(make_cg, fake):
    errors = []

    def watch(event):
        if event.get("log_level") is not None and event["log_level"].name in ("error", "critical"):
            errors.append(event)

    globalLogPublisher.addObserver(watch)
    try:
        cg = make_cg(anthropic_upstream=fake.url)
        ident = ident_of(command_output())
        first = stream([anthropic_text_block(0, ["Let me look."]), anthropic_expand_block(1, ref=ident)])
        overloaded = sse_event("error", {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}})
        fake.enqueue(SSEReply(first), SSEReply([anthropic_stream_events()[0], overloaded]))
        client, data, complete = yield raw_stream(cg, bash_body())
        assert complete and check_anthropic_stream(data) == []
    finally:
        globalLogPublisher.removeObserver(watch)
    assert errors == []


@inlineCallbacks
def test_repair_uses_the_original_this_body_still_holds(make_cg, fake):
    cg = make_cg(anthropic_upstream=fake.url)  # an empty store: the original exists only in the body
    output = command_output()
    body = history(output, "x")
    body["messages"] += [
        {"role": "assistant", "content": [expand_use(ident_of(output), "toolu_leak")]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_leak", "is_error": True,
                                      "content": NO_SUCH_TOOL}]},
    ]
    client = yield connect(cg.port, http_request("POST", "/v1/messages", json.dumps(body).encode(),
                                                 [("content-type", "application/json")]))
    yield client.closed
    repaired = fake.received[0].json()["messages"][-1]["content"][0]
    assert repaired == {"type": "tool_result", "tool_use_id": "toolu_leak", "content": output}
