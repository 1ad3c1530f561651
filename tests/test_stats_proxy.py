"""What /stats, the change log and cg-report say cg did, through the running proxy."""

import json
import time

from fixturedata import claude_code_body
from helpers.bodies import coloured_output, history
from helpers.drive import get_stats, post
from pytest_twisted import inlineCallbacks
from rawhttp import connect, http_request, split_response

from cg.compaction.tokens import estimate_tokens
from cg.record import report
from cg.testing import claude_code_bytes


@inlineCallbacks
def test_a_result_two_components_rewrote_counts_once(make_cg, fake, tmp_path):
    path = tmp_path / "changes.jsonl"
    cg = make_cg(anthropic_upstream=fake.url, expand=True, changelog=str(path))
    bash = coloured_output()
    raw = claude_code_bytes(history(bash, "x"))
    for _ in range(2):  # the same history re-sent
        client = yield post(cg.port, raw)
        yield client.closed
    forwarded = json.loads(fake.received[0].body)["messages"][3]["content"][0]["content"]
    sent, after = estimate_tokens(bash), estimate_tokens(forwarded)
    assert "<<cg:" in forwarded and after < sent / 10

    yield cg.service.changelog.flush()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    steps = [(line["seq"], line["component"], line["step"], line["part"]) for line in lines
             if line["kind"] == "compaction"]
    first, second = sorted({seq for seq, *_ in steps})
    assert steps == [(first, "textclean", 0, None), (first, "offload", 1, None),
                     (second, "textclean", 0, None), (second, "offload", 1, None)]
    textclean, offload = lines[:2]
    assert textclean["tokens_before"] == sent and offload["tokens_after"] == after
    assert sent > textclean["tokens_after"] == offload["tokens_before"] > after  # the text between

    compaction = (yield from get_stats(cg.port))["compaction"]
    assert compaction["tokens_before"] == 2 * sent
    assert compaction["tokens_after"] == 2 * after
    assert compaction["saved_tokens"] == 2 * (sent - after)
    assert compaction["saved_tokens_unique"] == sent - after
    assert compaction["savings_pct"] == round(100 * (sent - after) / sent, 2) > 90
    per_component = compaction["components"]
    assert per_component["textclean"]["saved_tokens"] + per_component["offload"]["saved_tokens"] == 2 * (sent - after)

    summary = report.tally([str(path)]).summary()
    assert summary["results"] == 2
    assert (summary["results_tokens_before"], summary["results_tokens_after"]) == (2 * sent, 2 * after)
    assert summary["results_savings_pct"] == compaction["savings_pct"]
    assert summary["unique_deleted_tokens"] == sent - after


@inlineCallbacks
def test_the_share_of_all_input_cg_forwarded(make_cg, fake):
    cg = make_cg(anthropic_upstream=fake.url, expand=True)
    rewritten = claude_code_bytes(history(coloured_output(), "x"))
    unchanged = claude_code_bytes(claude_code_body("p_first_request"))  # no tool result: only the tool added
    for raw, headers in ((rewritten, ()), (unchanged, ()), (rewritten, [("x-cg-bypass", "1")])):
        client = yield post(cg.port, raw, headers)
        yield client.closed
    client = yield connect(cg.port, http_request("GET", "/v1/models", headers=[("anthropic-version", "2023-06-01")]))
    yield client.closed
    forwarded = [r.body for r in fake.received[:2]]
    assert len(forwarded[0]) < 0.6 * len(rewritten) and len(forwarded[1]) > len(unchanged)

    compaction = (yield from get_stats(cg.port))["compaction"]
    client_bytes, forwarded_bytes = len(rewritten) + len(unchanged), sum(map(len, forwarded))
    assert compaction["input_requests"] == 2  # the bypassed request and the GET are not counted
    assert compaction["input_tokens_client"] == round(client_bytes / 3)
    assert compaction["input_tokens_forwarded"] == round(forwarded_bytes / 3)
    assert compaction["input_savings_pct"] == round(100 * (client_bytes - forwarded_bytes) / client_bytes, 2)
    assert compaction["requests_rewritten"] == 1


@inlineCallbacks
def test_the_store_size_says_when_it_was_read(make_cg, fake):
    started = time.time()
    cg = make_cg(anthropic_upstream=fake.url, expand=True)
    store = (yield from get_stats(cg.port))["store"]
    assert store["entries"] == 0 and started <= store["size_as_of"] <= time.time()

    client = yield post(cg.port, claude_code_bytes(history(coloured_output(), "x")))
    yield client.closed
    assert (yield from get_stats(cg.port))["store"] == {**store, "writes": 1}  # the size waits for its timer

    yield cg.service._refresh_store_info()
    refreshed = (yield from get_stats(cg.port))["store"]
    assert refreshed["entries"] == 1 and store["size_as_of"] < refreshed["size_as_of"] <= time.time()


@inlineCallbacks
def test_the_change_log_places_a_text_part(make_cg, fake, tmp_path):
    path = tmp_path / "changes.jsonl"
    cg = make_cg(anthropic_upstream=fake.url, expand=True, changelog=str(path))
    body = history("x", "x")
    body["messages"][3]["content"][0]["content"] = [{"type": "text", "text": "exit 1"},
                                                    {"type": "text", "text": coloured_output()}]
    client = yield post(cg.port, claude_code_bytes(body))
    yield client.closed
    yield cg.service.changelog.flush()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(c["message"], c["block"], c["part"], c["step"], c["component"]) for c in lines
            if c["kind"] == "compaction"] == [(3, 0, 1, 0, "textclean"), (3, 0, 1, 1, "offload")]


@inlineCallbacks
def test_memo_mb_sizes_what_a_re_sent_history_is_parsed_against(make_cg, fake):
    """--memo-mb: the text the memo keeps; 0 keeps no conversation's last body."""
    session = [("x-claude-code-session-id", "0b7c3a52-5f0e-4b8e-9d1a-2c6f4e8a9b10")]
    first = claude_code_body("p_second_request_tool_result")
    turns = [first, {**first, "messages": [*first["messages"], {"role": "assistant", "content": "ok"},
                                           {"role": "user", "content": "go on"}]}]
    for memo_mb, hits in ((64, 1), (0, 0)):
        running = make_cg(anthropic_upstream=fake.url, memo_mb=memo_mb)
        for body in turns:
            client = yield post(running.port, claude_code_bytes(body), session)
            assert split_response((yield client.closed))[0] == 200
        stats = yield from get_stats(running.port)
        assert stats["compaction"]["memo"]["bodies"]["hits"] == hits
