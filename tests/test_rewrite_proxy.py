"""Compaction and tool injection through the running proxy, on Claude Code-shaped requests."""

import json

import pytest
import ujson
from fixturedata import claude_code_body
from helpers.bodies import history
from helpers.drive import post
from pytest_twisted import inlineCallbacks
from rawhttp import connect, http_request, split_response
from twisted.web.http_headers import Headers

from cg.compaction.expand import ANTHROPIC_TOOL, OPENAI_TOOL
from cg.testing import claude_code_bytes, command_output
from cg.web.tenant import parse_tenant
from cg.wire.markers import EXPAND_TOOL, marker_id

MARKER = "<<cg:"


@inlineCallbacks
def test_old_command_output_is_offloaded_and_stored(make_cg, fake, tmp_path):
    cg = make_cg(anthropic_upstream=fake.url, expand=True, store=f"sqlite:{tmp_path / 'store.sqlite3'}")
    bash, read = command_output(), command_output().replace("PASS", "LINE")
    assert len(bash.encode()) > 50_000
    raw = claude_code_bytes(history(bash, read))

    client = yield post(cg.port, raw)
    assert split_response((yield client.closed))[0] == 200
    client = yield post(cg.port, raw)
    yield client.closed

    first, second = fake.received[0].body, fake.received[1].body
    assert first == second, "the same history must give the same bytes on every turn"
    sent = json.loads(first)
    compacted = sent["messages"][3]["content"][0]["content"]
    ident = marker_id(bash.encode())
    assert f"<<cg:{ident}>>" in compacted and len(compacted) < len(bash) / 5
    assert "FAIL src/broken.test.ts" in compacted  # error lines from the middle survive
    assert sent["messages"][5]["content"][0]["content"] == read  # Read results are kept whole
    assert (yield cg.service.store.get("", ident)) == bash.encode()

    # every byte outside the changed string and the appended tool is the client's
    new = json.dumps(compacted, ensure_ascii=False).encode()
    old = json.dumps(bash, ensure_ascii=False).encode()
    assert first.replace(b"," + ANTHROPIC_TOOL.encode(), b"").replace(new, old) == raw
    assert sent["tools"][-1]["name"] == EXPAND_TOOL
    assert sent["tools"][:-1] == json.loads(raw)["tools"]
    stats = cg.stats.compaction.snapshot()
    assert stats["components"]["offload"]["acted"] == 2
    assert stats["components"]["offload"]["runs"] >= 2 * 2  # both results, on both requests
    assert stats["saved_tokens"] == 2 * stats["saved_tokens_unique"] > 0


@inlineCallbacks
def test_expand_tool_bytes_are_identical_across_requests_and_processes(make_cg, fake):
    cg = make_cg(anthropic_upstream=fake.url, expand=True)
    other = make_cg(anthropic_upstream=fake.url, expand=True)
    bodies = [claude_code_body(name) for name in ("p_first_request", "p_second_request_after_thinking")]
    for proxy, body in zip((cg, other), bodies):
        client = yield post(proxy.port, claude_code_bytes(body))
        yield client.closed
    tails = [r.body[r.body.rindex(b',{"name":"context_guru_expand"'):] for r in fake.received]
    assert tails[0].startswith(b"," + ANTHROPIC_TOOL.encode())
    assert tails[1].startswith(b"," + ANTHROPIC_TOOL.encode())


@inlineCallbacks
def test_without_expand_only_reformat_runs(make_cg, fake):
    cg = make_cg(anthropic_upstream=fake.url, expand=False)
    ansi = "\x1b[32mok\x1b[0m build step\n" * 2000
    raw = claude_code_bytes(history(ansi, "x"))
    client = yield post(cg.port, raw)
    yield client.closed
    sent = fake.received[0].json()
    assert sent["messages"][3]["content"][0]["content"] == "ok build step\n" * 2000
    assert MARKER not in fake.received[0].body.decode()
    assert [t["name"] for t in sent["tools"]] == [t["name"] for t in json.loads(raw)["tools"]]


@inlineCallbacks
def test_side_request_with_empty_tools_is_untouched(make_cg, fake):
    cg = make_cg(anthropic_upstream=fake.url, expand=True)
    body = history(command_output(), "x")
    body["tools"] = []
    raw = claude_code_bytes(body)
    client = yield post(cg.port, raw)
    yield client.closed
    sent = fake.received[0].body
    assert MARKER not in sent.decode()  # no tool to expand with: nothing lossy
    assert json.loads(sent)["tools"] == []


@inlineCallbacks
def test_bypass_header_sends_the_request_exactly(make_cg, fake):
    cg = make_cg(anthropic_upstream=fake.url, expand=True)
    raw = claude_code_bytes(history(command_output(), "x"))
    client = yield post(cg.port, raw, [("x-cg-bypass", "1")])
    yield client.closed
    assert fake.received[0].body == raw
    assert fake.received[0].header(b"x-cg-bypass") is None
    assert cg.stats.bypassed == 1


@inlineCallbacks
def test_observe_mode_forwards_originals_and_counts_savings(make_cg, fake):
    cg = make_cg(anthropic_upstream=fake.url, expand=True, observe=True)
    raw = claude_code_bytes(history(command_output(), "x"))
    client = yield post(cg.port, raw)
    yield client.closed
    assert fake.received[0].body == raw
    assert cg.stats.compaction.snapshot()["saved_tokens"] > 0


@inlineCallbacks
def test_store_failure_forwards_without_lossy_compaction(make_cg, fake, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the store's directory should be")
    cg = make_cg(anthropic_upstream=fake.url, expand=True, store=f"sqlite:{blocker / 'store.sqlite3'}")
    ansi_and_big = "\x1b[1m" + command_output()
    raw = claude_code_bytes(history(ansi_and_big, "x"))
    client = yield post(cg.port, raw)
    assert split_response((yield client.closed))[0] == 200
    sent = fake.received[0].json()
    assert sent["messages"][3]["content"][0]["content"] == command_output()  # reformat still ran
    assert MARKER not in json.dumps(sent["messages"])
    assert cg.stats.compaction.store_fail_open == 1


@inlineCallbacks
def test_tenants_keep_originals_apart(make_cg, fake):
    cg = make_cg(anthropic_upstream=fake.url, expand=True, tenant="credential")
    bash = command_output()
    client = yield post(cg.port, claude_code_bytes(history(bash, "x")), [("x-api-key", "sk-one")])
    yield client.closed
    ident = marker_id(bash.encode())
    assert (yield cg.service.store.get("", ident)) is None
    tenant = parse_tenant("credential")(Headers({b"x-api-key": [b"sk-one"]}))
    assert (yield cg.service.store.get(tenant, ident)) == bash.encode()
    assert "sk-one" not in tenant


def openai_history(**extra) -> bytes:
    body = {
        "model": "gpt-5",
        "messages": [
            {"role": "user", "content": "run it"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "shell", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": command_output()},
        ],
        "tools": [{"type": "function", "function": {"name": "shell", "parameters": {"type": "object"}}}],
        **extra,
    }
    return ujson.dumps(body, ensure_ascii=False).encode()


@inlineCallbacks
def post_openai(cg, raw: bytes):
    client = yield connect(cg.port, http_request("POST", "/v1/chat/completions", raw,
                                                 [("content-type", "application/json")]))
    yield client.closed


@pytest.mark.parametrize("stream", [True, False])
@inlineCallbacks
def test_openai_injection_and_offload_cover_streams(make_cg, fake_openai, stream):
    """Streamed or not, the same tool bytes go upstream and the old output is offloaded."""
    cg = make_cg(openai_upstream=fake_openai.url, expand=True)
    yield post_openai(cg, openai_history(stream=stream))
    received = fake_openai.received[0]
    sent = received.json()
    assert [t["function"]["name"] for t in sent["tools"]] == ["shell", EXPAND_TOOL]
    assert MARKER in sent["messages"][2]["content"]
    assert b"," + OPENAI_TOOL.encode() + b"]" in received.body


@inlineCallbacks
def test_a_streamed_chat_request_asks_for_usage_with_the_same_bytes_every_turn(make_cg, fake_openai):
    """cg needs the usage to sum the rounds: it appends include_usage, at the end, identically each turn."""
    cg = make_cg(openai_upstream=fake_openai.url, expand=True)
    raw = openai_history(stream=True)
    yield post_openai(cg, raw)
    yield post_openai(cg, raw)
    first, second = fake_openai.received
    assert first.body.endswith(b'}],"stream":true,"stream_options":{"include_usage":true}}')
    assert first.body == second.body


@pytest.mark.parametrize("options", [{"include_usage": False}, {"include_usage": True}])
@inlineCallbacks
def test_the_clients_stream_options_are_left_as_they_are(make_cg, fake_openai, options):
    cg = make_cg(openai_upstream=fake_openai.url, expand=True)
    yield post_openai(cg, openai_history(stream=True, stream_options=options))
    received = fake_openai.received[0]
    assert received.json()["stream_options"] == options
    assert received.body.count(b"stream_options") == 1


@inlineCallbacks
def test_a_streamed_request_for_several_choices_is_left_alone(make_cg, fake_openai):
    """n > 1: the inspector reads one choice, so cg injects nothing and offloads nothing."""
    cg = make_cg(openai_upstream=fake_openai.url, expand=True)
    yield post_openai(cg, openai_history(stream=True, n=2))
    sent = fake_openai.received[0].json()
    assert [t["function"]["name"] for t in sent["tools"]] == ["shell"]
    assert MARKER not in sent["messages"][2]["content"] and "stream_options" not in sent


@inlineCallbacks
def test_a_person_can_read_an_original_under_their_tenant(make_cg, fake):
    cg = make_cg(anthropic_upstream=fake.url, expand=True, tenant="credential")
    bash = command_output()
    client = yield post(cg.port, claude_code_bytes(history(bash, "x")), [("x-api-key", "sk-one")])
    yield client.closed
    ident = marker_id(bash.encode())
    for ref, key, status in [
        (ident, "sk-one", 200),
        (f"%3C%3Ccg:{ident}%3E%3E", "sk-one", 200),  # the whole marker, URL-encoded
        (ident, "sk-two", 404),  # another key's model cannot read it, nor can its user
        ("0000000000000000", "sk-one", 404),
    ]:
        client = yield connect(cg.port, http_request("GET", f"/cg/expand/{ref}", headers=[("x-api-key", key)]))
        got_status, _, body = split_response((yield client.closed))
        assert got_status == status, ref
        if status == 200:
            assert body == bash.encode()
    assert fake.received[1:] == []  # never forwarded


@inlineCallbacks
def test_a_store_failure_keeps_the_offloads_already_sent(make_cg, fake, monkeypatch):
    from twisted.internet import defer

    from cg.store import MemoryStore, StoreError

    cg = make_cg(anthropic_upstream=fake.url)
    old, new = command_output(), command_output().replace("PASS", "OK")
    body = history(old, "x")
    client = yield post(cg.port, claude_code_bytes(body))
    yield client.closed
    first = fake.received[0].json()["messages"][3]["content"][0]["content"]
    assert MARKER in first

    monkeypatch.setattr(MemoryStore, "put", lambda self, tenant, originals: defer.fail(StoreError("disk full")))
    body["messages"] += [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_2", "name": "Bash", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2", "content": new}]},
    ]
    client = yield post(cg.port, claude_code_bytes(body))
    yield client.closed
    sent = fake.received[1].json()["messages"]
    assert sent[3]["content"][0]["content"] == first  # the cached bytes stay as they were
    assert sent[-1]["content"][0]["content"] == new  # the new original could not be stored: sent whole
    assert cg.stats.compaction.store_fail_open == 1
