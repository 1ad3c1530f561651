"""--keepalive over real sockets: a ping goes through cg's own upstream pool to the fake provider, as
the body cg forwarded with only max_tokens and stream changed, under the client's credentials, and
/stats and /metrics count it. The keep-alive's timer runs on a Clock the test advances (no sleep);
everything else is the real reactor on 127.0.0.1."""

import json

import anthropic
import pytest
from helpers.bodies import bash_body
from helpers.drive import HEADERS, scrape, until, value
from pytest_twisted import inlineCallbacks
from rawhttp import connect, http_request, split_response
from twisted.internet.task import Clock
from twisted.internet.threads import deferToThread
from twisted.python import usage

from cg.record.pricing import Tokens, prices
from cg.record.report import Tally, render, tally
from cg.testing import JSONReply, anthropic_message, claude_code_bytes
from cg.web.tap import Options
from cg.wire.cache import TTL_5M

ADMIN = "operator-token-9a2c"
CLIENT = [*HEADERS, ("x-api-key", "sk-ant-test-key"), ("anthropic-beta", "prompt-caching-scope-2026-01-05"),
          ("x-claude-code-session-id", "5e55-10n")]


@inlineCallbacks
def test_a_ping_is_the_forwarded_body_with_max_tokens_and_stream_changed(make_cg, fake, cg_log):
    fake.strict = True  # the ping must be a request the Messages API accepts
    cg = make_cg(anthropic_upstream=fake.url, expand=True, keepalive=True)
    yield cg_log.wait_for("keep-alive up to 1800 s idle, 10 pings")  # the start-up line says so
    clock = cg.service.keepalive.clock = Clock()
    raw = claude_code_bytes(bash_body())  # cg offloads its Bash output: what it forwards is not what came
    client = yield connect(cg.port, http_request("POST", "/v1/messages?beta=true", raw, CLIENT))
    assert split_response((yield client.closed))[0] == 200
    (forwarded,) = fake.received
    assert forwarded.body != raw and b'"stream":true}' in forwarded.body

    fake.enqueue(JSONReply(anthropic_message("", usage={"input_tokens": 3, "cache_read_input_tokens": 21000,
                                                        "cache_creation_input_tokens": 0, "output_tokens": 1})))
    clock.advance(TTL_5M - 30.0)
    yield until(lambda: cg.stats.keepalive.usage.cache_read_tokens > 0)
    ping = fake.received[1]
    assert ping.path == forwarded.path == b"/v1/messages?beta=true" and fake.rejections == []
    assert ping.body == forwarded.body.replace(b'"max_tokens":64000,', b'"max_tokens":1,').replace(
        b'"stream":true}', b'"stream":false}')
    assert json.loads(ping.body)["messages"] == json.loads(forwarded.body)["messages"]
    for name in (b"x-api-key", b"anthropic-version", b"anthropic-beta", b"x-claude-code-session-id"):
        assert ping.header(name) == forwarded.header(name) is not None
    assert ping.nth_on_connection == 2  # the same pool as the real requests: its idle connection, reused

    client = yield connect(cg.port, http_request("GET", "/stats"))
    stats = json.loads(split_response((yield client.closed))[2])
    assert stats["keepalive"] == {
        "enabled": True, "conversations": 1, "pings": 1, "pings_failed": 0, "ended": {},
        "usage": {"input_tokens": 3, "cache_read_tokens": 21000, "cache_write_tokens": 0, "output_tokens": 1,
                  "cache_write_1h_tokens": 0},
        "cost_usd": pytest.approx(prices().price(json.loads(ping.body)["model"], "anthropic").cost(
            Tokens(input=3, cache_read=21000, output=1)))}
    assert stats["keepalive"]["cost_usd"] > 0
    assert stats["usage"]["cache_read_tokens"] < 21000  # the clients' own requests' bill is apart
    _, text = yield from scrape(cg.port)
    assert value(text, "cg_keepalive_pings_total") == 1 and value(text, "cg_keepalive_conversations") == 1
    assert value(text, "cg_keepalive_billed_tokens_total", kind="cache_read") == 21000
    assert [call.getTime() for call in clock.getDelayedCalls()] == [2 * (TTL_5M - 30.0)]
    assert not [line for line in cg_log if "sk-ant-test-key" in line]

    yield cg.stop()
    assert clock.getDelayedCalls() == [] and cg.stats.keepalive.ended == {"stopped": 1}


@inlineCallbacks
def get_json(cg, path: str, *headers: tuple[str, str]):
    client = yield connect(cg.port, http_request("GET", path, headers=headers))
    status, _, body = split_response((yield client.closed))
    assert status == 200, body
    return json.loads(body)


def test_the_options_and_their_refusals():
    options = Options()
    options.parseOptions([])
    assert options.config().keepalive is False  # off by default
    options = Options()
    options.parseOptions(["--keepalive", "--keepalive-max-idle", "3600", "--keepalive-budget", "4",
                          "--keepalive-max-conversations", "32"])
    config = options.config()
    assert (config.keepalive, config.keepalive_max_idle, config.keepalive_budget,
            config.keepalive_max_conversations) == (True, 3600.0, 4, 32)
    for argv, message in ((["--keepalive-max-idle", "270"], "--keepalive-max-idle must be more than 270 seconds"),
                          (["--keepalive-budget", "0"], "--keepalive-budget must be 1 or more"),
                          (["--keepalive-max-conversations", "0"], "--keepalive-max-conversations must be 1 or more")):
        with pytest.raises(usage.UsageError, match=message):
            Options().parseOptions(["--keepalive", *argv])


@inlineCallbacks
def test_a_ping_is_counted_in_the_change_log_the_ledger_cg_report_and_the_dashboard(make_cg, fake, tmp_path):
    """A ping is cg's spending: the change log has a line for it and the ledger a row (kind "ping"),
    which cg-report (either source) and /cg/api count apart from the clients' requests."""
    changelog = tmp_path / "changes.jsonl"
    cg = make_cg(anthropic_upstream=fake.url, keepalive=True, changelog=str(changelog), admin_token=ADMIN)
    clock = cg.service.keepalive.clock = Clock()
    sdk = anthropic.Anthropic(base_url=cg.url, api_key="sk-ant-test-key", max_retries=0)
    fake.enqueue(JSONReply(anthropic_message("hi", usage={"input_tokens": 5, "cache_read_input_tokens": 0,
                                                          "cache_creation_input_tokens": 4000, "output_tokens": 2})))
    yield deferToThread(sdk.messages.create, model="claude-opus-4-8", max_tokens=64, extra_headers={
        "x-claude-code-session-id": "s-ping", "user-agent": "claude-cli/2.1.197 (external, cli)"},
        system=[{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": "hi"}])
    fake.enqueue(JSONReply(anthropic_message("", usage={"input_tokens": 3, "cache_read_input_tokens": 4000,
                                                        "cache_creation_input_tokens": 0, "output_tokens": 1})))
    clock.advance(TTL_5M - 30.0)
    yield until(lambda: cg.stats.keepalive.usage.cache_read_tokens > 0)
    ledger = cg.service.forwarder.ledger
    yield until(lambda: ledger.totals(None, None).result.pings == 1)
    price = prices().price("claude-opus-4-8", "anthropic")
    cost = price.cost(Tokens(input=3, cache_read=4000, output=1))

    admin = ("authorization", f"Bearer {ADMIN}")
    summary = yield get_json(cg, "/cg/api/summary?window=start", admin)
    assert summary["requests"] == 1 and summary["pings"] == {"count": 1, "cost_usd": pytest.approx(cost)}
    assert summary["billed"]["cache_read"] == 0  # the request's own bill, without the ping's
    assert summary["cost_usd"]["via_cg"] == pytest.approx(price.cost(Tokens(input=5, cache_write_5m=4000, output=2)))
    (row,) = (yield get_json(cg, "/cg/api/conversations", admin))["conversations"]
    assert (row["requests"], row["pings"]["count"], row["cache"]["state"]) == (1, 1, "kept_warm")
    detail = yield get_json(cg, f"/cg/api/conversations/{row['id']}", admin)
    assert [(t["kind"], t["billed"]["cache_read"]) for t in detail["turns"]] == [("request", 0), ("ping", 4000)]

    yield cg.service.forwarder.changelog.flush()
    lines = [json.loads(line) for line in changelog.read_text().splitlines()]
    (line,) = [line for line in lines if line["kind"] == "ping"]
    assert (line["session"], line["model"], line["cache_read_tokens"]) == (row["id"], "claude-opus-4-8", 4000)
    assert line["cost_usd"] == pytest.approx(cost)
    from_log = tally([str(changelog)], quiet=True).summary()
    from_store = Tally()
    for turn, changes in ledger.turns().result:
        from_store.add_turn(turn, changes)
    for report in (from_log, from_store.summary()):
        assert report["usage"]["requests"] == 1 and report["usage"]["cache_read_tokens"] == 0
        assert report["pings"]["count"] == 1 and report["pings"]["cache_read_tokens"] == 4000
        assert report["pings"]["cost_usd"] == pytest.approx(cost, abs=1e-6)
        assert "Keep-alive pings: 1, $" in render(report)
