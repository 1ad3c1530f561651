"""Billed usage read off responses, the change log and cg-report, through the running proxy."""

import json
import os
import signal

import anthropic
from helpers.bodies import history
from helpers.clients import stream_chat
from pytest_twisted import inlineCallbacks
from rawhttp import connect, http_request
from twisted.internet import reactor, task
from twisted.internet.threads import deferToThread

from cg.record import report
from cg.testing import (
    JSONReply,
    SSEReply,
    anthropic_message,
    claude_code_bytes,
    command_output,
    openai_stream_events,
    sse_event,
)
from cg.web.report import tally_ledger

REQUEST = {"model": "claude-opus-4-8", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
USAGE = {"input_tokens": 12, "cache_read_input_tokens": 3000, "cache_creation_input_tokens": 40, "output_tokens": 7}


def cache_stream():
    start = {"type": "message_start", "message": {
        "id": "msg_1", "type": "message", "role": "assistant", "model": "m", "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {**USAGE, "output_tokens": 1}}}
    return [
        sse_event("message_start", start),
        sse_event("content_block_start", {"type": "content_block_start", "index": 0,
                                          "content_block": {"type": "text", "text": ""}}),
        sse_event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                          "delta": {"type": "text_delta", "text": "hi"}}),
        sse_event("content_block_stop", {"type": "content_block_stop", "index": 0}),
        sse_event("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                                    "usage": {"output_tokens": 9}}),
        sse_event("message_stop", {"type": "message_stop"}),
    ]


@inlineCallbacks
def test_usage_from_json_and_streams_reaches_stats(cg, fake, fake_openai):
    fake.enqueue(JSONReply(anthropic_message("a", usage=USAGE)), SSEReply(cache_stream()))
    client = anthropic.Anthropic(base_url=cg.url, api_key="k", max_retries=0)
    yield deferToThread(client.messages.create, **REQUEST, extra_headers={"x-claude-code-session-id": "s1"})

    def stream():
        with client.messages.stream(**REQUEST, extra_headers={"x-claude-code-session-id": "s1"}) as s:
            return s.get_final_message()

    yield deferToThread(stream)
    fake_openai.enqueue(SSEReply(openai_stream_events(texts=["x"], include_usage=True,
                                                      prompt_tokens=100, completion_tokens=4)))

    yield deferToThread(stream_chat, cg.url, "k", "x")
    usage = cg.stats.snapshot()["usage"]
    assert usage["requests"] == 3
    totals = cg.stats.usage.usage
    assert totals.cache_read_tokens == 6000
    assert totals.cache_write_tokens == 80
    assert totals.output_tokens == 7 + 9 + 4  # the stream's message_delta overwrote, never added
    assert totals.input_tokens == 12 + 12 + 100
    assert cg.stats.usage.session("s1").requests == 2


@inlineCallbacks
def test_change_log_and_report(make_cg, fake, tmp_path):
    path = tmp_path / "changes.jsonl"
    cg = make_cg(anthropic_upstream=fake.url, expand=True, changelog=str(path))
    raw = claude_code_bytes(history("\x1b[1m" + command_output(), "x"))
    for _ in range(3):  # the same history re-sent: cumulative counts it 3 times, unique once
        fake.enqueue(JSONReply(anthropic_message("ok", usage=USAGE)))
        client = yield connect(cg.port, http_request("POST", "/v1/messages", raw, [("x-claude-code-session-id", "s9")]))
        yield client.closed
    yield cg.service.changelog.flush()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    kinds = [line["kind"] for line in lines]
    assert kinds.count("usage") == 3
    compactions = [line for line in lines if line["kind"] == "compaction"]
    assert {c["component"] for c in compactions} == {"textclean", "offload"}
    assert all(c["session"] == "s9" for c in lines)
    summary = report.tally([str(path)]).summary()
    assert summary["requests"] == 3 and summary["sessions"] == 1
    assert summary["cumulative_deleted_tokens"] == 3 * summary["unique_deleted_tokens"] > 0
    assert summary["distinct_markers"] == 1

    # logrotate: the file is moved away, SIGHUP makes cg write a new one
    path.rename(tmp_path / "changes.jsonl.1")
    os.kill(os.getpid(), signal.SIGHUP)
    yield task.deferLater(reactor, 0.1, lambda: None)
    fake.enqueue(JSONReply(anthropic_message("ok", usage=USAGE)))
    client = yield connect(cg.port, http_request("POST", "/v1/messages", raw))
    yield client.closed
    yield cg.service.changelog.flush()
    assert path.exists() and '"kind":"usage"' in path.read_text()


@inlineCallbacks
def test_the_ledger_gives_the_report_the_change_log_gives(make_cg, fake, tmp_path):
    """cg-report --store counts the ledger's rows as the change log's lines of the same requests."""
    path = tmp_path / "changes.jsonl"
    cg = make_cg(anthropic_upstream=fake.url, expand=True, changelog=str(path))
    first = history("\x1b[1m" + command_output(), "x")
    for session, body in (("s1", first), ("s1", first), ("s2", history(command_output(), "y"))):
        fake.enqueue(JSONReply(anthropic_message("ok", usage=USAGE)))
        client = yield connect(cg.port, http_request("POST", "/v1/messages", claude_code_bytes(body),
                                                     [("x-claude-code-session-id", session)]))
        yield client.closed
    yield cg.service.changelog.flush()
    from_log = report.tally([str(path)]).summary()
    from_ledger = (yield tally_ledger(cg.service.forwarder.ledger, "memory:")).summary()
    assert from_ledger["rows"] == from_ledger["requests"] == 3 and from_ledger["unique_deleted_tokens"] > 0
    assert from_ledger["unique_deleted_no_marker"] > 0 and from_ledger["results"] == 3  # a reformat, counted once
    mine = {"files", "lines", "bad_lines", "other_lines", "unreadable_files", "store", "rows", "rows_counted",
            "first_time", "last_time"}  # times: the ledger's is the request's arrival, the log's when it was written
    assert {k: v for k, v in from_ledger.items() if k not in mine} == {
        k: v for k, v in from_log.items() if k not in mine}


@inlineCallbacks
def test_cache_writes_for_an_hour_reach_the_change_log(make_cg, fake, tmp_path):
    path = tmp_path / "changes.jsonl"
    cg = make_cg(anthropic_upstream=fake.url, changelog=str(path))
    split = {**USAGE, "cache_creation": {"ephemeral_5m_input_tokens": 10, "ephemeral_1h_input_tokens": 30}}
    fake.enqueue(JSONReply(anthropic_message("ok", usage=split)))
    client = anthropic.Anthropic(base_url=cg.url, api_key="k", max_retries=0)
    yield deferToThread(client.messages.create, **REQUEST)
    yield cg.service.changelog.flush()
    (line,) = [json.loads(line) for line in path.read_text().splitlines() if '"usage"' in line]
    assert (line["cache_write_tokens"], line["cache_write_1h_tokens"]) == (40, 30)
    assert cg.stats.snapshot()["usage"]["cache_write_1h_tokens"] == 30


@inlineCallbacks
def test_every_exchange_is_a_ledger_turn_with_its_bill_and_client(cg, fake, fake_openai):
    fake.enqueue(JSONReply(anthropic_message("a", usage=USAGE)), JSONReply({"error": "x"}, status=500))
    client = anthropic.Anthropic(base_url=cg.url, api_key="k", max_retries=0)
    yield deferToThread(client.messages.create, **REQUEST, extra_headers={"x-claude-code-session-id": "s1"})
    try:
        yield deferToThread(client.messages.create, **REQUEST, extra_headers={"x-claude-code-session-id": "s1"})
    except anthropic.InternalServerError:
        pass
    ledger = cg.service.forwarder.ledger
    totals = yield ledger.totals(None, None)
    assert totals.requests == 2 == cg.stats.snapshot()["requests"]
    assert totals.billed.cache_read_tokens == USAGE["cache_read_input_tokens"]
    (summary,), total = yield ledger.conversations(None, 0, 10)
    assert (summary.id, summary.client, summary.model, total) == ("s1", "sdk", REQUEST["model"], 1)
    _, turns, _ = yield ledger.conversation(None, "s1")
    assert [(t.status, t.outcome) for t in turns] == [(200, "ok"), (500, "upstream_error_status")]
    assert turns[0].tokens_after == 12 + 3000 + 40 and turns[0].cost_via_cg > 0
    assert turns[1].billed is None and turns[1].cost_via_cg is None
