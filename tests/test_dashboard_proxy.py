"""The dashboard's API through a running cg: traffic from the official SDKs (and a Claude Code request)
against the fake provider, then what `/cg/api/…` says, to each viewer, beside `/stats`."""

import json

import anthropic
from helpers.bodies import history
from helpers.clients import stream_chat
from helpers.drive import until
from pytest_twisted import inlineCallbacks
from rawhttp import connect, http_request, split_response
from twisted.internet.defer import Deferred
from twisted.internet.threads import deferToThread

from cg.store.memory import MemoryStore
from cg.testing import (
    JSONReply,
    SSEReply,
    anthropic_message,
    claude_code_bytes,
    command_output,
    openai_stream_events,
)

ADMIN = "operator-token-5d1e"
USAGE = {"input_tokens": 12, "cache_read_input_tokens": 3000, "cache_creation_input_tokens": 40, "output_tokens": 7}
REQUEST = {"model": "claude-opus-4-8", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}


@inlineCallbacks
def get(cg, path: str, *headers: tuple[str, str]):
    client = yield connect(cg.port, http_request("GET", path, headers=headers))
    status, head, body = split_response((yield client.closed))
    return status, json.loads(body) if head.get(b"content-type") == [b"application/json"] else body


@inlineCallbacks
def test_the_api_says_what_stats_says_to_each_viewer_and_lists_every_turn(make_cg, fake, fake_openai):
    cg = make_cg(anthropic_upstream=fake.url, openai_upstream=fake_openai.url, tenant="credential",
                 admin_token=ADMIN, expand=True)
    sdk = anthropic.Anthropic(base_url=cg.url, api_key="sk-one", max_retries=0)
    # A viewer proves its key as its client sends it (x-api-key, or Authorization: Bearer: the SDK's choice).
    (one,) = sdk.auth_headers.items()
    two, admin = ("authorization", "Bearer sk-two"), ("authorization", f"Bearer {ADMIN}")

    # sk-one: Claude Code's request, whose Bash output cg offloads, then two SDK calls in session s1
    fake.enqueue(JSONReply(anthropic_message("ok", usage=USAGE)), JSONReply(anthropic_message("a", usage=USAGE)),
                 JSONReply(anthropic_message("b", usage=USAGE)))
    code = claude_code_bytes({**history(command_output(), "x"), "stream": False})
    client = yield connect(cg.port, http_request("POST", "/v1/messages", code, [
        ("content-type", "application/json"), ("anthropic-version", "2023-06-01"), one,
        ("user-agent", "claude-cli/2.0.14 (external, cli)"),
        ("x-claude-code-session-id", "code-1")]))
    assert split_response((yield client.closed))[0] == 200
    for _ in range(2):
        yield deferToThread(sdk.messages.create, **REQUEST, extra_headers={"x-claude-code-session-id": "s1"})
    # sk-two: a streamed chat completion with the openai SDK
    fake_openai.enqueue(SSEReply(openai_stream_events(texts=["x"], include_usage=True, prompt_tokens=100,
                                                      completion_tokens=4)))

    yield deferToThread(stream_chat, cg.url, "sk-two", "count to three")
    stats = cg.stats.snapshot()
    assert stats["requests"] == 4
    yield until(lambda: cg.service.forwarder.ledger.totals(None, None).result.requests == 4)

    status, summary = yield get(cg, "/cg/api/summary?window=start", admin)
    assert status == 200
    usage = stats["usage"]
    assert summary["requests"] == stats["requests"]
    assert summary["billed"] == {"input": usage["input_tokens"], "cache_read": usage["cache_read_tokens"],
                                 "cache_write": usage["cache_write_tokens"],
                                 "cache_write_1h": usage["cache_write_1h_tokens"], "output": usage["output_tokens"]}
    assert sum(row["requests"] for row in summary["by_tenant"]) == 4
    assert {row["client"]: row["requests"] for row in summary["by_client"]} == {"claude-code": 1, "sdk": 3}
    assert summary["cost_usd"]["via_cg"] > 0 and summary["tokens_before"] > summary["tokens_after"]

    mine = (yield get(cg, "/cg/api/summary?window=start", one))[1]
    assert mine["requests"] == 3 and "by_tenant" not in mine
    assert (yield get(cg, "/cg/api/summary?window=start", two))[1]["requests"] == 1
    assert (yield get(cg, "/cg/api/summary"))[0] == 401

    # every conversation's turns, as the admin sees them; each viewer sees only its own
    status, page = yield get(cg, "/cg/api/conversations", admin)
    rows = {row["id"]: row for row in page["conversations"]}
    assert "code-1" in rows and "s1" in rows and page["total"] == len(rows) == 3
    for ident, row in rows.items():
        detail = (yield get(cg, f"/cg/api/conversations/{ident}", admin))[1]
        assert len(detail["turns"]) == row["requests"]
        assert all(turn["billed"] is not None and turn["status"] == 200 for turn in detail["turns"])
    assert rows["s1"]["requests"] == 2 and rows["code-1"]["client"] == "claude-code"
    assert {row["id"] for row in (yield get(cg, "/cg/api/conversations", one))[1]["conversations"]} == {"code-1", "s1"}
    assert (yield get(cg, "/cg/api/conversations/s1", two))[0] == 404

    # the Claude Code turn's offload opens its original: for sk-one and the admin, not for sk-two
    (code_turn,) = (yield get(cg, "/cg/api/conversations/code-1", one))[1]["turns"]
    (marker,) = [change["marker"] for change in code_turn["changes"] if change["marker"]]
    status, original = yield get(cg, f"/cg/expand/{marker}", one)
    assert status == 200 and command_output().encode() in original
    assert (yield get(cg, f"/cg/expand/{marker}", two))[0] == 404
    tenant = rows["code-1"]["tenant"]
    assert (yield get(cg, f"/cg/expand/{marker}?tenant={tenant}", two))[0] == 404
    assert (yield get(cg, f"/cg/expand/{marker}?tenant={tenant}", admin))[0] == 200


@inlineCallbacks
def test_a_request_cg_forwards_as_it_came_counts_for_its_own_tenant(make_cg, fake):
    """A bypassed request, and one whose preparation failed, go up unchanged; their ledger rows are
    still their tenant's: under a gateway's header, not the tenant "" a viewer without it sees."""
    cg = make_cg(anthropic_upstream=fake.url, tenant="header:x-team")
    fake.enqueue(JSONReply(anthropic_message("a", usage=USAGE)), JSONReply(anthropic_message("b", usage=USAGE)))
    team = ("x-team", "blue")
    request = [("content-type", "application/json"), ("anthropic-version", "2023-06-01"), team]
    client = yield connect(cg.port, http_request("POST", "/v1/messages", json.dumps(REQUEST).encode(),
                                                 [*request, ("x-cg-bypass", "1")]))
    assert split_response((yield client.closed))[0] == 200

    def broken(*args, **kwargs):
        raise RuntimeError("a bug on the request side")

    cg.service.forwarder.preparation = broken
    client = yield connect(cg.port, http_request("POST", "/v1/messages", json.dumps(REQUEST).encode(), request))
    assert split_response((yield client.closed))[0] == 200
    yield until(lambda: cg.service.forwarder.ledger.totals(None, None).result.requests == 2)

    assert (yield get(cg, "/cg/api/summary?window=start", team))[1]["requests"] == 2
    assert (yield get(cg, "/cg/api/summary?window=start"))[1]["requests"] == 0


@inlineCallbacks
def test_a_ledger_row_cg_cannot_build_loses_that_row_not_the_request(make_cg, fake):
    cg = make_cg(anthropic_upstream=fake.url)
    fake.enqueue(JSONReply(anthropic_message("a", usage=USAGE)))

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in the ledger's row")

    cg.service.forwarder.book.turn = broken
    client = yield connect(cg.port, http_request("POST", "/v1/messages", json.dumps(REQUEST).encode(), [
        ("content-type", "application/json"), ("anthropic-version", "2023-06-01")]))
    assert split_response((yield client.closed))[0] == 200
    stats = cg.stats.snapshot()
    assert stats["in_flight"] == 0 and stats["usage"]["output_tokens"] == USAGE["output_tokens"]


@inlineCallbacks
def test_a_request_whose_client_left_before_it_was_prepared_is_still_a_row(make_cg, fake, monkeypatch):
    """/stats counts a request when it arrives; the ledger must too, or `window=start` falls short."""
    cg = make_cg(anthropic_upstream=fake.url, tenant="header:x-team", admin_token=ADMIN)
    team, admin = ("x-team", "blue"), ("authorization", f"Bearer {ADMIN}")
    asked = []

    def unanswered(store, *args):  # the store never answers: the preparation waits on it
        asked.append(args)
        return Deferred()

    for name in ("frozen", "get", "freeze", "put"):
        monkeypatch.setattr(MemoryStore, name, unanswered)
    code = claude_code_bytes({**history(command_output(), "x"), "stream": False})
    client = yield connect(cg.port, http_request("POST", "/v1/messages", code, [
        ("content-type", "application/json"), ("anthropic-version", "2023-06-01"), team,
        ("x-claude-code-session-id", "gone-1")]))
    yield until(lambda: asked)
    client.transport.abortConnection()
    yield until(lambda: cg.stats.in_flight == 0)
    assert fake.received == []  # nothing went up
    stats = cg.stats.snapshot()
    assert stats["requests"] == 1 and stats["client_disconnects"] == 1
    summary = (yield get(cg, "/cg/api/summary?window=start", admin))[1]
    assert summary["requests"] == stats["requests"]
    assert [t["tenant"] for t in summary["by_tenant"]] == ["blue"]  # its tenant's row, not tenant ""
    assert summary["tokens_before"] == summary["tokens_after"] == summary["cost_usd"]["via_cg"] == 0
