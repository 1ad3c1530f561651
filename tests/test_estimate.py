"""cg-estimate: the pricing rules (cg.record.pricing), the transcript readers on the fixtures the real
CLIs wrote (tests/fixtures/transcripts/), the offline replay, the command line, and cg-report
agreeing with it on the same traffic through a real cg."""

import io
import json
from pathlib import Path

import pytest
from pytest_twisted import inlineCallbacks
from rawhttp import connect, http_request

from cg.compaction.options import rewrite_config
from cg.exchange import keepalive
from cg.record import estimate, plot, report, transcripts
from cg.record.pricing import TTL_1H, TTL_5M, PriceTable, PromptCache, Segment, Tokens, digest, prices
from cg.record.replay import Forwarded, Hindsight, Sent, Turn, keep_warm_session, replay, segments
from cg.testing import JSONReply, anthropic_message
from cg.wire.dialect import MESSAGES_SHAPE

HOME = Path(__file__).resolve().parent / "fixtures" / "transcripts" / "home"


def seg(name: str, tokens: int, breakpoint: float | None = None) -> Segment:
    return Segment(digest(name.encode()), tokens, breakpoint)


# ---------------------------------------------------------------------------------------------
# Pricing rules, on hand-built prompts


def test_anthropic_cache_read_write_and_expiry_by_timestamps():
    cache = PromptCache(explicit=True, min_tokens=1024)
    head = [seg("tools", 3000), seg("system", 1000, TTL_5M)]
    first = cache.bill(0.0, [*head, seg("m1", 500, TTL_5M), seg("tail", 7)])
    assert first == Tokens(input=7, cache_write_5m=4500)
    # 4 minutes later: the prefix up to the old breakpoint is read, the new messages written
    second = cache.bill(240.0, [*head, seg("m1", 500), seg("m2", 800, TTL_5M)])
    assert second == Tokens(cache_read=4500, cache_write_5m=800)
    # the hit at 240 s refreshed the lifetime: 299 s after it, still a read
    assert cache.bill(240.0 + 299, [*head, seg("m1", 500), seg("m2", 800, TTL_5M)]).cache_read == 5300
    # more than 5 minutes after the last use: everything is written again
    assert cache.bill(240.0 + 299 + 301, [*head, seg("m1", 500), seg("m2", 800, TTL_5M)]) == Tokens(cache_write_5m=5300)


def test_anthropic_one_hour_ttl_outlives_five_minutes_and_writes_at_2x():
    cache = PromptCache(explicit=True, min_tokens=1024)
    prompt = [seg("tools", 3000), seg("system", 1000, TTL_1H), seg("m1", 500, TTL_5M)]
    assert cache.bill(0.0, prompt) == Tokens(cache_write_1h=4000, cache_write_5m=500)
    later = cache.bill(1800.0, prompt)  # 30 minutes: the 1-hour entry is read, the 5-minute one expired
    assert later == Tokens(cache_read=4000, cache_write_5m=500)
    price = prices().price("claude-sonnet-4-5", "anthropic")
    assert price.cost(Tokens(cache_write_1h=1_000_000)) == 2 * price.cost(Tokens(input=1_000_000))
    assert price.cost(Tokens(cache_write_5m=1_000_000)) == 1.25 * price.cost(Tokens(input=1_000_000))
    assert price.cost(Tokens(cache_read=1_000_000)) == pytest.approx(0.1 * price.cost(Tokens(input=1_000_000)))


def test_anthropic_minimum_cacheable_size_and_lookback():
    cache = PromptCache(explicit=True, min_tokens=4096)
    small = [seg("tools", 3000), seg("system", 1000, TTL_5M), seg("m", 50)]
    assert cache.bill(0.0, small) == Tokens(input=4050)  # under the minimum: nothing cached
    assert cache.bill(1.0, small) == Tokens(input=4050)
    # the breakpoint moved on (and the old one is gone): a hit within 20 blocks back, none beyond
    base = [seg("tools", 2000), seg("system", 10, TTL_5M)]
    moved = [seg("tools", 2000), seg("system", 10)]
    blocks = [seg(f"b{i}", 10) for i in range(20)]
    cache = PromptCache(explicit=True, min_tokens=1024)
    cache.bill(0.0, base)
    assert cache.bill(1.0, [*moved, *blocks[:-1], seg("last", 10, TTL_5M)]).cache_read == 2010
    cache = PromptCache(explicit=True, min_tokens=1024)
    cache.bill(0.0, base)
    assert cache.bill(1.0, [*moved, *blocks, seg("last", 10, TTL_5M)]).cache_read == 0


def test_openai_automatic_prefix_cache():
    cache = PromptCache(explicit=False, min_tokens=1024, ttl=TTL_5M)
    prompt = [seg("tools", 1000), seg("dev", 300), seg("u1", 100)]
    assert cache.bill(0.0, prompt) == Tokens(input=1400)
    assert cache.bill(10.0, [*prompt, seg("u2", 50)]) == Tokens(input=1450 - 1280, cache_read=1280)  # 128-token steps
    assert cache.bill(10.0 + 301, [*prompt, seg("u2", 50)]) == Tokens(input=1450)  # expired
    assert cache.bill(320.0, [seg("tools", 1000), seg("other", 20)]) == Tokens(input=1020)  # under 1,024


def test_price_table_fallbacks_are_stated():
    table = prices()
    assert table.price("claude-sonnet-4-5", "anthropic").note is None
    dated = table.price("claude-sonnet-4-5-20250929", "anthropic")
    assert dated.key == "claude-sonnet-4-5" and "claude-sonnet-4-5-20250929" in dated.note
    assert table.price("claude-opus-4-8", "anthropic").key == "claude-opus"
    unknown = table.price("my-gateway-model", "openai")
    assert unknown.key == "gpt-5" and "not in the prices table" in unknown.note
    for entry in table.models.values():
        assert entry["date"] and entry["provider"] in table.providers
    with pytest.raises(ValueError):
        PriceTable({"providers": {"openai": {"default": "x"}}, "models": {}})


# ---------------------------------------------------------------------------------------------
# The readers, on what the real CLIs wrote


def _sessions():
    return {s.client: s for s in transcripts.read(transcripts.find(HOME))}


def test_claude_code_reader_rebuilds_messages_turn_by_turn():
    session = _sessions()[transcripts.CLAUDE_CODE]
    assert session.project == "/home/user/project" and len(session.requests) == 6
    bodies = [json.loads(r.body) for r in session.requests]
    assert [len(b["messages"]) for b in bodies] == [2, 4, 6, 8, 10, 12]
    for body in bodies:
        assert list(body)[:4] == ["model", "messages", "system", "tools"] and len(body["tools"]) == 24
        marked = [(i, j) for i, m in enumerate(body["messages"]) if isinstance(m["content"], list)
                  for j, b in enumerate(m["content"]) if "cache_control" in b]
        assert len(marked) == 1 and body["messages"][marked[0][0]]["role"] != "system"
    first, last = bodies[0]["messages"], bodies[-1]["messages"]
    assert first[0]["content"][-1]["text"] == "Run the cg e2e commands one by one."
    assert first[1]["role"] == "system"  # the attachments (agent and skill listings)
    results = [b for m in last for b in (m["content"] if isinstance(m["content"], list) else [])
               if b.get("type") == "tool_result"]
    assert len(results) == 5 and results[1]["content"].count("\n") == 499  # the 500-line listing, whole
    assert [m["role"] for m in last[2:]] == ["assistant", "user"] * 5
    assert all(r.model == "claude-opus-4-8" and r.output_tokens == 20 for r in session.requests)
    assert session.requests[0].time < session.requests[-1].time


def test_codex_reader_rebuilds_responses_input():
    session = _sessions()[transcripts.CODEX]
    assert len(session.requests) == 6 and session.requests[0].model == "gpt-5.5"
    bodies = [json.loads(r.body) for r in session.requests]
    inputs = [b["input"] for b in bodies]
    assert [len(i) for i in inputs] == [4, 7, 10, 13, 16, 19]
    assert inputs[0][0]["role"] == "developer" and inputs[0][3]["content"][0]["text"] == "Run the cg e2e commands one by one."
    for earlier, later in zip(inputs, inputs[1:]):
        assert later[: len(earlier)] == earlier  # Codex re-sends its history unchanged
    assert [i["type"] for i in inputs[1][4:]] == ["reasoning", "function_call", "function_call_output"]
    assert all("internal_chat_message_metadata_passthrough" not in i for i in inputs[-1])
    assert bodies[0]["prompt_cache_key"] == session.id and bodies[0]["tools"][0]["name"] == "exec_command"
    assert all(r.output_tokens == 5 and r.billed is not None for r in session.requests)


def test_readers_skip_what_they_cannot_read(tmp_path):
    (tmp_path / "junk.jsonl").write_text("not json\n{}\n[1]\n")
    assert list(transcripts.read(transcripts.find(tmp_path))) == []


# ---------------------------------------------------------------------------------------------
# The replay


def test_replay_prices_both_ways_and_counts_offloads_once():
    session = _sessions()[transcripts.CLAUDE_CODE]
    sent = [Sent(r.time, r.path, r.body, r.output_tokens) for r in session.requests]
    turns = replay(sent, rewrite_config(), expand_rate=0.5)
    assert len(turns) == 6
    assert sum(t.offloads for t in turns) == 2 and sum(t.expand_rounds for t in turns) == 1.0
    assert all(t.direct.output == t.cg.output == 20 for t in turns)
    assert sum(t.cost_cg for t in turns) < 0.7 * sum(t.cost_direct for t in turns)
    # expand off: reformat only, no offloads; the cost is about direct's
    plain = replay(sent, rewrite_config(expand=False), expand_rate=0.5)
    assert sum(t.offloads for t in plain) == 0
    assert sum(t.cost_cg for t in plain) == pytest.approx(sum(t.cost_direct for t in plain), rel=0.05)
    # pure: the same input, the same figures
    assert [t.cost_cg for t in replay(sent, rewrite_config(), expand_rate=0.5)] == [t.cost_cg for t in turns]


def test_replay_counts_an_offload_after_a_lossless_step():
    """A coloured log is cleaned (textclean, step 0) then offloaded (step 1): one offload, priced
    at the size the client sent; the bodies' sizes both ways."""
    log = "\n".join(f"\x1b[32mPASSED\x1b[0m tests/test_{i}.py::test_case_{i} some words here" for i in range(3000))
    bash = {"name": "Bash", "description": "Run a command", "input_schema": {"type": "object"}}
    body = {"model": "claude-sonnet-4-5", "max_tokens": 100, "tools": [bash], "messages": [
        {"role": "user", "content": "run the tests"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Bash",
                                           "input": {"command": "pytest"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": log,
                                      "cache_control": {"type": "ephemeral"}}]}]}
    raw = json.dumps(body).encode()
    (turn,) = replay([Sent(0.0, "/v1/messages", raw)], rewrite_config(), expand_rate=1.0)
    assert turn.offloads == 1 and turn.expand_rounds == 1.0
    assert turn.bytes_direct == len(raw) and 0 < turn.bytes_cg < len(raw) // 5
    assert turn.expand_cost > turn.price.cost(Tokens(input=len(log) // 8))  # the original as sent


def test_segments_ignore_where_the_breakpoint_sits():
    a = {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}]}]}
    b = {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}
    assert segments(a, MESSAGES_SHAPE)[0].digest == segments(b, MESSAGES_SHAPE)[0].digest
    assert segments(a, MESSAGES_SHAPE)[0].breakpoint == TTL_5M and segments(b, MESSAGES_SHAPE)[0].breakpoint is None


# ---------------------------------------------------------------------------------------------
# The command line


def run(*argv):
    out, err = io.StringIO(), io.StringIO()
    code = estimate.main(list(argv), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def test_table_on_the_fixtures():
    code, out, err = run(str(HOME))
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["client", "session", "started", "(UTC)"]
    assert lines[1].startswith("claude-code") and lines[2].startswith("codex")
    assert any(line.startswith("total") and "2 session(s)" in line for line in lines)
    assert "note: claude-opus-4-8 is not in the prices table" in out


def test_json_and_options(tmp_path):
    code, out, _ = run(str(HOME), "--json")
    report_ = json.loads(out)
    assert code == 0 and list(report_) == ["sessions", "total", "config", "prices", "unreadable", "assumptions"]
    total = report_["total"]
    assert total["requests"] == 12 and total["offloads"] == 4 and 0 < total["ratio"] < 0.7
    s = report_["sessions"][0]
    assert len(s["cumulative_direct"]) == s["requests"] and s["cumulative_cg"][-1] == pytest.approx(s["cost_cg"], abs=1e-5)
    # the compaction options as twistd cg has them
    _, out, _ = run(str(HOME), "--json", "--offload-min-tokens", "100000")
    assert json.loads(out)["total"]["offloads"] == 0
    _, out, _ = run(str(HOME), "--json", "--disable", "offload", "--keep-tools", "Bash")
    assert json.loads(out)["config"]["disable"] == ["offload"]
    # the cache-aware policy, simulated on the transcripts' times (no gap in them outlives the cache)
    assert report_["config"]["cold_policy"] is True and report_["total"]["cold_requests"] == 0
    _, out, _ = run(str(HOME), "--json", "--cold-policy", "off")
    assert json.loads(out)["config"]["cold_policy"] is False and json.loads(out)["total"]["cold_requests"] == 0
    _, out, _ = run(str(HOME), "--json", "--project", "project", "--since", "2026-11-30")
    assert json.loads(out)["total"]["sessions"] == 2
    _, out, _ = run(str(HOME / ".codex"), "--json")
    assert [s["client"] for s in json.loads(out)["sessions"]] == ["codex"]


def test_refusals_are_one_line(tmp_path):
    code, out, err = run(str(tmp_path / "missing"))
    assert code == 1 and out == "" and err.count("\n") == 1 and "no such file or directory" in err
    code, out, err = run(str(tmp_path))
    assert code == 1 and err.count("\n") == 1 and "no Claude Code or Codex session" in err
    code, out, err = run(str(HOME), "--project", "elsewhere")
    assert code == 1 and "matching --since/--project" in err
    with pytest.raises(SystemExit):
        run(str(HOME), "--disable", "nothing")
    with pytest.raises(SystemExit):
        run(str(HOME), "--cold-policy", "yes")


@pytest.mark.parametrize(("option", "value", "said"), [
    ("--offload-min-tokens", "-5", "argument --offload-min-tokens: negative: -5"),
    ("--keep-tools", "bad name!", "argument --keep-tools: 'bad name!' is not a tool name"),
])
def test_a_compaction_option_refuses_as_twistd_cg_does(capsys, option, value, said):
    with pytest.raises(SystemExit):
        run(str(HOME), option, value)
    assert said in capsys.readouterr().err


def test_plot_without_the_extra_says_how(monkeypatch, tmp_path):
    monkeypatch.setattr(plot, "available", lambda: False)
    code, out, err = run(str(HOME), "--plot", str(tmp_path / "p.png"))
    assert code == 2 and out == "" and err.count("\n") == 1 and "pip install 'cg[plot]'" in err


def test_plot_draws_png_and_svg(tmp_path):
    pytest.importorskip("matplotlib")
    for name in ("p.png", "p.svg"):
        code, _, err = run(str(HOME), "--plot", str(tmp_path / name))
        assert code == 0, err
        assert (tmp_path / name).stat().st_size > 1000


# ---------------------------------------------------------------------------------------------
# cg-report agrees: the same requests through a real cg, against a fake that bills as the provider


class Provider:
    """The fake's replies: usage as Anthropic would bill the bytes cg forwarded (the same cache
    rules, at the transcript's times), the transcript's output tokens."""

    def __init__(self, requests):
        self.requests = list(requests)
        price = prices().price(self.requests[0].model, "anthropic")
        self.cache = PromptCache(True, price.min_cache_tokens, price.cache_ttl)

    def __call__(self, received):
        request = self.requests.pop(0)
        t = self.cache.bill(request.time, segments(json.loads(received.body), MESSAGES_SHAPE))
        usage = {"input_tokens": t.input, "cache_read_input_tokens": t.cache_read,
                 "cache_creation_input_tokens": t.cache_write, "output_tokens": request.output_tokens}
        return JSONReply(anthropic_message("ok", model=request.model, usage=usage))


@inlineCallbacks
def test_cg_report_and_cg_estimate_agree(make_cg, fake, tmp_path):
    session = _sessions()[transcripts.CLAUDE_CODE]
    path = tmp_path / "changes.jsonl"
    fake.default_reply = Provider(session.requests)
    cg = make_cg(anthropic_upstream=fake.url, expand=True, changelog=str(path))
    for request in session.requests:
        client = yield connect(cg.port, http_request("POST", request.path, request.body,
                                                     [("x-claude-code-session-id", session.id)]))
        yield client.closed
    yield cg.service.changelog.flush()
    billed = report.tally([str(path)]).summary()
    assert billed["usage"]["requests"] == 6 and billed["cost"]["by_model"][0]["model"] == "claude-opus-4-8"

    code, out, _ = run(str(HOME / ".claude"), "--json", "--expand-rate", "0")
    estimated = json.loads(out)["sessions"][0]
    assert code == 0
    assert billed["cost"]["usd"] == pytest.approx(estimated["cost_cg"], rel=1e-6)
    assert billed["usage"]["cache_read_tokens"] == estimated["tokens_cg"]["cache_read"]
    assert billed["usage"]["cache_write_tokens"] == estimated["tokens_cg"]["cache_write_5m"]
    assert billed["usage"]["input_tokens"] == estimated["tokens_cg"]["input"]


# ---------------------------------------------------------------------------------------------
# Keep-alive, priced (--keepalive): cg's own scheduler on the transcript's timestamps


def keepalive_session(*times: float, model: str = "claude-sonnet-4-5", path: str = "/v1/messages",
                      thinking: dict | None = None) -> list[Sent]:
    """A conversation sent at ``times``: a 2,000-token system prompt and a growing history, the
    newest message marked, as Claude Code marks it."""
    system = [{"type": "text", "text": "You are a careful engineer. " * 280, "cache_control": {"type": "ephemeral"}}]
    messages: list[dict] = []
    sent = []
    for i, t in enumerate(times):
        for message in messages:
            message["content"][-1].pop("cache_control", None)
        messages += [{"role": "user", "content": [{"type": "text", "text": f"step {i}: " + "do it " * 40,
                                                    "cache_control": {"type": "ephemeral"}}]}]
        body = {"model": model, "max_tokens": 8000, "system": system, "messages": messages,
                **({"thinking": thinking} if thinking else {}), "stream": True}
        sent.append(Sent(t, path, json.dumps(body).encode(), 50))
        messages.append({"role": "assistant", "content": [{"type": "text", "text": "done " * 30}]})
    return sent


def test_keepalive_reads_where_an_expired_cache_would_be_written():
    session = keepalive_session(0.0, 10.0, 610.0, 610.0 + 3000)  # gaps: 10 s, 10 min, 50 min
    plain = replay(session, rewrite_config())
    turns = replay(session, rewrite_config(), keep_warm=keepalive.Policy(max_idle=1800.0, forecast=None))
    assert [t.cost_cg for t in turns] == [t.cost_cg for t in plain]  # the via-cg figures stay as they were
    assert plain[2].cg.cache_write_5m > 2000  # 10 minutes: the prefix expired and is written again
    kept = turns[2].keepalive
    assert kept.cache_read + kept.cache_write_5m == plain[2].cg.cache_write_5m and kept.cache_write_5m < 200
    # pings: 2 in the 10-minute gap (at 280 and 550 s), 6 in the 50-minute one up to the 30-minute bound
    # (the request after it is written anew), 6 after the last request; each reads the prefix once
    assert [t.pings for t in turns] == [0, 2, 6, 6]
    assert turns[1].ping_tokens.cache_read == 2 * turns[2].keepalive.cache_read and turns[1].ping_tokens.output == 2
    assert turns[1].ping_tokens.cache_write == 0 and turns[1].ping_tokens.input < 10
    assert turns[3].keepalive.cache_write_5m == plain[3].cg.cache_write_5m  # past the bound: no saving
    saving = turns[2].cost_cg - turns[2].cost_keepalive - turns[1].ping_cost
    assert saving > 0 and turns[1].cost_keepalive == pytest.approx(turns[1].cost_cg + turns[1].ping_cost)


def test_keepalive_pings_by_the_lifetime_cache_ttl_gives_the_breakpoints():
    """--cache-ttl 1h: the breakpoints ask for an hour, so a ping is due 30 s before the hour, not
    before 5 minutes (the client's own lifetime): a 10-minute gap needs none."""
    session = keepalive_session(0.0, 610.0)  # one 10-minute gap
    policy = keepalive.Policy(max_idle=7200.0, forecast=None)
    client = replay(session, rewrite_config(), keep_warm=policy)
    hour = replay(session, rewrite_config(), keep_warm=policy, cache_ttl="1h")
    assert client[0].pings == 2 and hour[0].pings == 0  # 280 and 550 s; the hour's first is at 3570 s
    kept = hour[1].keepalive  # the prefix read (the hour held it), only the new turn written
    assert kept.cache_read > 10 * kept.cache_write_1h and kept.cache_write_5m == 0
    assert hour[1].pings == 2  # after the last request, at 3580 and 7150 s (the idle bound 7200 s)


def test_keepalive_bounds_and_what_it_leaves_alone():
    session = keepalive_session(0.0, 610.0)
    one = replay(session, rewrite_config(), keep_warm=keepalive.Policy(budget=1))
    assert one[0].pings == 1 and one[1].keepalive.cache_write_5m > 2000  # the cache expired 580 s after the ping
    short = replay(session, rewrite_config(), keep_warm=keepalive.Policy(max_idle=500.0))
    assert short[0].pings == 1 and short[1].pings == 1  # 550 s is past 500 s; after the last, one at 880 s
    for alone in (keepalive_session(0.0, 610.0, thinking={"type": "enabled", "budget_tokens": 4000}),
                  keepalive_session(0.0, 610.0, path="/v1/chat/completions")):
        turns = replay(alone, rewrite_config(), keep_warm=keepalive.Policy())
        assert sum(t.pings for t in turns) == 0 and [t.cost_keepalive for t in turns] == [t.cost_cg for t in turns]


def _session_kept(policy: keepalive.Policy, *conversations: list[Sent]) -> list[list[Turn]]:
    replayed = []
    for sent in conversations:
        forwarded: list[Forwarded] = []
        replayed.append((replay(sent, rewrite_config(), forwarded=forwarded), forwarded))
    return keep_warm_session(replayed, policy)


def test_keepalive_keys_a_session_by_model_as_twistd_cg_does():
    """Claude Code's sub-agents send their session's id: one on the session's model shares the main
    conversation's timer, so the ping after it re-sends the sub-agent's body and the main
    conversation's prefix expires; one on another model has a timer of its own."""
    policy = keepalive.Policy(forecast=None)
    main = keepalive_session(0.0, 610.0)
    alone = replay(main, rewrite_config(), keep_warm=policy)
    assert alone[0].pings == 2 and alone[1].keepalive.cache_write_5m < 200  # bridged
    same, agent = _session_kept(policy, main, keepalive_session(100.0))
    assert same[0].pings == 0 and agent[0].pings == 1  # at 370 s, the sub-agent's body; 610 s comes before the next
    assert agent[0].ping_tokens.cache_read > 1900 and same[1].keepalive.cache_write_5m > 1900  # main's expired
    other, haiku = _session_kept(policy, main, keepalive_session(100.0, model="claude-haiku-4-5"))
    assert other[0].pings == 2 and other[1].keepalive == alone[1].keepalive  # its own timer: bridged
    assert haiku[0].pings > 0  # the sub-agent's own, after its only request


def test_hindsight_pings_only_through_the_breaks_it_bridges_for_less():
    """The bound on any ping rule: two pings bridge a 10-minute break (0.2 of the prefix read against
    1.15 spared); a 70-minute one would need 15 (more than the write), the end any number."""
    turns = replay(keepalive_session(0.0, 610.0, 610.0 + 4200), rewrite_config(),
                   keep_warm=keepalive.Policy(max_idle=14_400.0, budget=100, forecast=Hindsight()))
    assert [t.pings for t in turns] == [2, 0, 0] and turns[1].keepalive.cache_write_5m < 200


def test_keepalive_on_the_command_line():
    code, out, err = run(str(HOME), "--keepalive")
    assert code == 0 and err == ""
    assert out.splitlines()[0].split()[-5:] == ["pings", "ping", "cost", "keep-alive", "net"]
    assert "pings: 2 after a session's last request" in out and "1 of 2 session(s) cost more with keep-alive" in out
    _, out, _ = run(str(HOME), "--json", "--keepalive")
    doc = json.loads(out)
    claude, codex = doc["sessions"]
    # one headless run: all it gets is the pings after its last request, until the forecast finds that
    # a third (at 13.5 min) would cost more than it is likely to spare (real breaks end early)
    assert claude["keepalive"]["pings"] == 2 and claude["keepalive"]["net_saving"] < 0
    assert claude["keepalive"]["net_saving"] == pytest.approx(-claude["keepalive"]["ping_cost"], abs=1e-6)
    assert codex["keepalive"]["pings"] == 0 and codex["keepalive"]["net_saving"] == 0  # OpenAI: never pinged
    assert doc["total"]["keepalive"]["pings"] == 2 and doc["config"]["keepalive"] == {"max_idle": 1800.0, "budget": 10}
    # where they went: all after the end, no break to bridge; the session behind
    assert claude["keepalive"]["pings_after_end"] == 2 and claude["keepalive"]["breaks"] == 0
    assert claude["keepalive"]["ping_cost_after_end"] == claude["keepalive"]["ping_cost"]
    assert {k: doc["total"]["keepalive"][k] for k in ("pings_after_end", "pings_in_breaks", "breaks_bridged",
                                                      "behind")} == {"pings_after_end": 2, "pings_in_breaks": 0,
                                                                     "breaks_bridged": 0, "behind": 1}
    _, out, _ = run(str(HOME), "--json", "--keepalive", "--keepalive-max-idle", "400", "--keepalive-budget", "1")
    assert json.loads(out)["total"]["keepalive"]["pings"] == 1
    _, out, _ = run(str(HOME), "--json")
    assert json.loads(out)["total"]["keepalive"] is None and "pings" not in run(str(HOME))[1]
    code, out, err = run(str(HOME), "--keepalive", "--keepalive-max-idle", "200")
    assert code == 2 and out == "" and err.count("\n") == 1 and "--keepalive-max-idle must be more than 270" in err


def test_cache_ttl_prices_the_lifetime_cg_would_ask_for(capsys):
    session = keepalive_session(0.0, 10.0, 610.0, 620.0, 620.0 + 1800)  # gaps: 10 s, 10 min, 10 s, 30 min
    keep = replay(session, rewrite_config())
    hour = replay(session, rewrite_config(), cache_ttl="1h")
    auto = replay(session, rewrite_config(), cache_ttl="auto")
    assert replay(session, rewrite_config(), cache_ttl="5m") == keep  # Claude Code's breakpoints ask for 5 min
    assert all(t.cg.cache_write_1h == 0 for t in keep) and keep[2].cg.cache_write_5m > 2000
    assert keep[4].cg.cache_write_5m > 2000  # 30 minutes: written again
    # 1h: every write at 2x, and neither break writes the prefix again
    assert all(t.cg.cache_write_5m == 0 for t in hour) and hour[0].cg.cache_write_1h == keep[0].cg.cache_write_5m
    assert hour[2].cg.cache_write_1h < 200 and hour[4].cg.cache_write_1h < 200
    # auto: the client's until the first expired cache (the request after 10 minutes writes anyway), an
    # hour from that request on, which bridges the 30-minute break
    assert [t.cg for t in auto[:2]] == [t.cg for t in keep[:2]]
    assert auto[2].cg.cache_write_1h == keep[2].cg.cache_write_5m and auto[4].cg.cache_write_1h < 200
    costs = [sum(t.cost_cg for t in turns) for turns in (keep, auto, hour)]
    assert costs == sorted(costs, reverse=True)  # here an hour from the start bridges both breaks: cheapest
    _, out, _ = run(str(HOME), "--json", "--cache-ttl", "1h")
    assert json.loads(out)["config"]["cache_ttl"] == "1h"
    with pytest.raises(SystemExit):
        run(str(HOME), "--cache-ttl", "2h")
    assert "argument --cache-ttl: invalid choice: '2h'" in capsys.readouterr().err
