"""Claude Code itself, headless, through cg against the scripted fake provider.

Skipped unless CG_E2E is set and npm is on PATH (``tox -e e2e``). The CLI is installed once into
$CG_E2E_NPM_DIR (default ~/.cache/cg-e2e/claude-code) and reused by later runs.
"""

import secrets

import pytest
from claude_harness import (
    EXPAND_TOOL,
    OffloadExpand,
    Script,
    Text,
    ToolUse,
    Turn,
    bash_round_trip,
    claude_env,
    needle_scenario,
    run_claude,
    tool_use_block_events,
    turn_blocks,
)
from helpers.drive import until
from pytest_twisted import ensureDeferred

from cg.testing import SSEReply, anthropic_stream_events, anthropic_thinking_block
from cg.wire import dialect


def _failure(what: str, run, script: Script, cg) -> str:
    return (
        f"{what}\n{run.describe()}\n--- requests the fake received\n{script.describe()}\n"
        f"--- cg stats\n{cg.stats.snapshot()}"
    )


@ensureDeferred
async def test_bash_tool_round_trip(claude_bin, claude_home, workdir, fake, make_cg):
    """The fake scripts a Bash tool_use; Claude Code runs it and sends the output back through cg;
    the fake's final answer quotes that output; the run exits 0 with that answer as its result."""
    token = secrets.token_hex(4)
    # The output is not in the command's text ($((6*7)) → 42): it can only come from a real run.
    command = f"echo cg-e2e-marker-$((6*7))-{token}"
    expected_output = f"cg-e2e-marker-42-{token}"
    tool_use_id = f"toolu_cge2e_{token}"

    def final_answer(output: str) -> str:
        return f"The marker command printed: {output.strip()}"

    script = Script(bash_round_trip(command, tool_use_id, final_answer))
    fake.default_reply = script
    cg = make_cg(anthropic_upstream=fake.url)

    run = await run_claude(
        claude_bin,
        [
            "-p",
            "Run the cg e2e marker command and tell me what it printed.",
            "--output-format",
            "stream-json",
            "--verbose",
            "--allowedTools",
            "Bash",  # headless runs get no permission prompt; --dangerously-skip-permissions refuses root
            "--max-turns",
            "4",
        ],
        env=claude_env(claude_home, cg.url),
        cwd=workdir,
    )
    print(f"claude run: {run.seconds:.1f}s, {len(fake.received)} requests\n{script.describe()}")

    assert not run.timed_out, _failure("Claude Code timed out", run, script, cg)
    assert run.exit_code == 0, _failure("Claude Code failed", run, script, cg)

    result = run.result()
    assert result is not None, _failure("no stream-json result message", run, script, cg)
    assert result.get("subtype") == "success" and result.get("is_error") is False, _failure(
        f"result is an error: {result}", run, script, cg
    )
    assert result.get("result", "").strip() == final_answer(expected_output), _failure(
        "the result is not the scripted final answer", run, script, cg
    )

    # Claude Code really ran the tool and sent its output back through cg.
    main = script.main_loop_requests()
    assert len(main) == 2, _failure("expected exactly two agent-loop requests", run, script, cg)
    results = [r for r in main[1].tool_results() if r.tool_use_id == tool_use_id]
    assert len(results) == 1 and not results[0].is_error, _failure("no good tool_result", run, script, cg)
    assert results[0].text.strip() == expected_output, _failure("the tool_result is not the output", run, script, cg)
    assert main[0].tool_results() == []
    for request in main:
        assert request.query == "beta=true", request.summary()
        assert request.streaming, _failure("an agent-loop request was not streamed (fallback?)", run, script, cg)

    # cg proxied every request the fake saw, all fine; it answers Claude Code's HEAD / itself.
    assert all(r.method == b"POST" for r in fake.received), script.describe()
    stats = cg.stats.snapshot()
    assert stats["requests_by_dialect"] == {dialect.ANTHROPIC: len(fake.received)}, _failure(
        "cg's request count differs from the fake's", run, script, cg
    )
    assert stats["responses_by_status"] == {"200": len(fake.received)}, _failure("non-200 responses", run, script, cg)
    assert stats["upstream_errors"] == 0, _failure("cg saw upstream errors", run, script, cg)
    assert stats["in_flight"] == 0
    assert stats["streamed"] == sum(1 for r, _ in script.log if r.streaming)


# ---------------------------------------------------------------------------------------------
# Offload and expand (issues 3, 4 and 5): a big Bash output that cg offloads, and the model
# asking for it back. Claude Code keeps a Bash output of more than 30,000 characters in a file and
# sends the model a 2 KB preview instead, so the output stays under that (~27 KB, ~6,000 tokens):
# still well over --offload-min-tokens.

PROMPT = "Run the cg e2e listing command and tell me what its middle line says."


def _expand_scenario(token: str, **kw) -> tuple[OffloadExpand, str, str]:
    """(the scenario, the output the command prints, the needle line in its middle)."""
    return needle_scenario(OffloadExpand, token, f"toolu_cge2e_bash_{token}", f"toolu_cge2e_expand_{token}", **kw)


async def _run_expand(claude_bin, claude_home, workdir, fake, make_cg, scenario: OffloadExpand):
    script = Script(scenario)
    fake.default_reply = script
    fake.strict = True  # a request the real API would refuse gets a 400 and lands in fake.rejections
    cg = make_cg(anthropic_upstream=fake.url, expand=True)
    run = await run_claude(
        claude_bin,
        ["-p", PROMPT, "--output-format", "stream-json", "--verbose", "--allowedTools", "Bash", "--max-turns", "6"],
        env=claude_env(claude_home, cg.url),
        cwd=workdir,
    )
    print(f"claude run: {run.seconds:.1f}s, {len(fake.received)} requests\n{script.describe()}")
    return cg, script, run


def _assert_offloaded(scenario: OffloadExpand, script: Script, output: str, line: str, fail) -> None:
    """What the fake got with the Bash result: cg's offloaded version, the needle elided from every
    request but those answering the expand call."""
    request = scenario.offloaded
    assert request is not None, fail("the Bash tool_result never reached the fake")
    text = next(r.text for r in request.tool_results() if r.tool_use_id == scenario.bash_id)
    assert scenario.marker_id is not None, fail(f"no <<cg:ID>> marker in the Bash tool_result: {text[:500]!r}")
    for seen, _ in script.log:
        if not any(seen is r for r in scenario.expanded):
            assert line.encode() not in seen.received.body, fail(f"the needle line was not elided: {seen.summary()}")
    assert len(text) < len(output) // 4, fail(f"the offloaded result is {len(text)} chars of {len(output)}")
    assert text.startswith(output[:200]), fail("offload lost the head of the output")


def _assert_original(text: str, output: str, fail) -> None:
    assert text.rstrip("\n") == output.rstrip("\n"), fail(
        f"the expand answer is not the original output ({len(text)} chars, expected {len(output)})"
    )


def _assert_claude_ok(run, line: str, fail) -> None:
    assert not run.timed_out, fail("Claude Code timed out")
    assert run.exit_code == 0, fail("Claude Code failed")
    result = run.result()
    assert result is not None, fail("no stream-json result message")
    assert result.get("subtype") == "success" and result.get("is_error") is False, fail(f"result: {result}")
    assert result.get("result", "").strip() == OffloadExpand.answer(line), fail("the result is not the answer")


def _no_such_tool(request) -> bool:
    return b"No such tool available" in request.received.body


def _expand_tool_uses(run) -> list[dict]:
    return [b for b in turn_blocks(run) if b.get("type") == "tool_use" and b.get("name") == EXPAND_TOOL]


def _common_stats(stats: dict, fake, bounces: int, fail) -> None:
    """cg answered every client request 200, sent the fake each of them plus ``bounces`` continuations."""
    clients = len(fake.received) - bounces
    assert stats["requests_by_dialect"] == {dialect.ANTHROPIC: clients}, fail("request count")
    assert stats["responses_by_status"] == {"200": clients}, fail("non-200 responses")
    assert stats["upstream_errors"] == 0 and stats["in_flight"] == 0, fail("upstream errors")
    assert stats["sse_buffered"] == 0, fail("a stream was buffered")
    assert stats["expand"]["bounces"] == bounces, fail("expand bounces")
    assert stats["expand"]["continuations_failed"] == 0, fail("a continuation failed")
    assert all(stats["expand"][k] == 0 for k in ("unknown", "evicted", "malformed")), fail("bad expand ids")
    compaction = stats["compaction"]
    assert compaction["components"]["offload"]["acted"] >= 1, fail("offload never acted")
    assert compaction["saved_tokens"] > 2000 and compaction["saved_tokens_unique"] > 2000, fail("savings")
    assert compaction["store_fail_open"] == 0, fail("the store failed open")
    assert fake.rejections == [], fail(f"the fake (strict) rejected requests: {fake.rejections}")


@ensureDeferred
async def test_offloaded_output_expanded_mid_stream(claude_bin, claude_home, workdir, fake, make_cg):
    """Issue 5: cg offloads the big Bash output; the model answers with a text block and a lone
    expand call; cg holds the call, resolves it, and splices the continuation (which sees the
    original) into the same stream. Claude Code never sees the tool and ends on the answer."""
    scenario, output, line = _expand_scenario(secrets.token_hex(4))
    cg, script, run = await _run_expand(claude_bin, claude_home, workdir, fake, make_cg, scenario)

    def fail(what: str) -> str:
        return _failure(what, run, script, cg)

    _assert_claude_ok(run, line, fail)
    _assert_offloaded(scenario, script, output, line, fail)

    # Turn 1 (Bash), turn 2 (offloaded result → expand), cg's continuation: nothing else.
    main = script.main_loop_requests()
    assert len(main) == 3, fail("expected two agent-loop requests and one continuation")
    turn2, continuation = main[1], main[2]
    assert main[1] is scenario.offloaded and scenario.expanded == [continuation], fail("request order")
    assert continuation.streaming and continuation.query == "beta=true", fail("the continuation is not a stream")
    session = b"x-claude-code-session-id"
    assert continuation.received.header(session) == turn2.received.header(session) is not None, fail("session")
    # The continuation extends what cg forwarded on turn 2: the same messages, then the model's turn
    # (text + expand call), then the answer to the call carrying the original.
    n = len(turn2.messages)
    assert continuation.messages[:n] == turn2.messages and len(continuation.messages) == n + 2, fail("prefix")
    assistant = continuation.messages[n]
    assert assistant.get("role") == "assistant", fail("no assistant turn in the continuation")
    assert [b.get("type") for b in assistant["content"]] == ["text", "tool_use"], fail("assistant turn")
    assert assistant["content"][0].get("text") == scenario.lead, fail("the text block was not kept")
    call = assistant["content"][1]
    assert (call.get("id"), call.get("name"), call.get("input")) == (
        scenario.expand_id, EXPAND_TOOL, {"id": scenario.marker_id}
    ), fail("the expand call in the continuation")
    [answered] = continuation.tool_result_blocks()
    assert answered.get("tool_use_id") == scenario.expand_id and "is_error" not in answered, fail("answer")
    _assert_original(continuation.tool_results()[0].text, output, fail)

    # Claude Code never saw the tool: no expand call in what it printed, no "No such tool" answer,
    # and the lead text and the final answer arrived as one turn (one message id).
    assert _expand_tool_uses(run) == [], fail("Claude Code saw the expand call")
    assert not any(_no_such_tool(r) for r, _ in script.log), fail("Claude Code answered 'No such tool'")
    assistant_ids = {
        m["message"].get("id") for m in run.messages() if m.get("type") == "assistant" and m.get("parent_tool_use_id") is None
    }
    texts = [b.get("text") for b in turn_blocks(run) if b.get("type") == "text"]
    assert texts[-2:] == [scenario.lead, OffloadExpand.answer(line)], fail("the spliced turn's texts")
    assert len(assistant_ids) == 2, fail(f"expected two assistant turns, got ids {assistant_ids}")

    stats = cg.stats.snapshot()
    _common_stats(stats, fake, 1, fail)
    assert stats["sse_spliced"] == 1 and stats["expand_rounds"] == 1, fail("not spliced")
    assert stats["sse_released"] == {}, fail("the inspector released a hold")
    assert stats["expand"]["resolved"] == 1 and stats["expand"]["repairs"] == 0, fail("expand counts")
    assert stats["expand"]["wasted_tokens"] > 2000, fail("wasted_tokens")
    original = await cg.service.store.get("", scenario.marker_id)
    _assert_original((original or b"").decode("utf-8"), output, fail)


@ensureDeferred
async def test_expand_batched_with_bash_is_repaired(claude_bin, claude_home, workdir, fake, make_cg):
    """Issue 4: the expand call comes batched with a Bash call, so cg lets both through; Claude Code
    runs Bash and answers the expand call "No such tool available"; on the next request cg puts the
    original in place of that error, and the final answer rests on it."""
    token = secrets.token_hex(4)
    bash = ToolUse(f"toolu_cge2e_true_{token}", "Bash", {"command": "true", "description": "Do nothing"})
    scenario, output, line = _expand_scenario(token, lead="Let me look at the full output too.", batch_with=bash)
    cg, script, run = await _run_expand(claude_bin, claude_home, workdir, fake, make_cg, scenario)

    def fail(what: str) -> str:
        return _failure(what, run, script, cg)

    _assert_claude_ok(run, line, fail)
    _assert_offloaded(scenario, script, output, line, fail)

    # Turn 1 (Bash), turn 2 (expand + Bash true), turn 3 (both answered): all Claude Code's.
    main = script.main_loop_requests()
    assert len(main) == 3 and scenario.expanded == [main[2]], fail("expected three agent-loop requests")
    turn3 = main[2]
    blocks = {b.get("tool_use_id"): b for b in turn3.tool_result_blocks()}
    assert set(blocks) == {scenario.expand_id, bash.id}, fail("turn 3 does not answer both calls")
    assert "is_error" not in blocks[scenario.expand_id], fail("the repaired answer still has is_error")
    repaired = next(r for r in turn3.tool_results() if r.tool_use_id == scenario.expand_id)
    _assert_original(repaired.text, output, fail)
    assert not _no_such_tool(turn3), fail("the 'No such tool' answer reached the fake")
    # The Bash result of turn 1 is offloaded again, to the same bytes (its marker unchanged).
    first = next(r.text for r in scenario.offloaded.tool_results() if r.tool_use_id == scenario.bash_id)
    again = next(m for m in turn3.messages if m.get("role") == "user" and any(
        b.get("tool_use_id") == scenario.bash_id for b in m.get("content", []) if isinstance(b, dict)
    ))
    again_text = next(b for b in again["content"] if b.get("tool_use_id") == scenario.bash_id)["content"]
    assert again_text == first, fail("the offloaded Bash result changed between turns")

    # Claude Code did see the call (released with the client tool) and answered it with the error.
    assert [b.get("id") for b in _expand_tool_uses(run)] == [scenario.expand_id], fail("the call was not released")
    errors = [
        b for b in turn_blocks(run)
        if b.get("type") == "tool_result" and b.get("tool_use_id") == scenario.expand_id
    ]
    assert len(errors) == 1 and errors[0].get("is_error") is True, fail("Claude Code's answer to the call")
    assert "No such tool available" in str(errors[0].get("content")), fail("not the 'No such tool' error")

    stats = cg.stats.snapshot()
    _common_stats(stats, fake, 0, fail)
    assert stats["expand"]["repairs"] == 1, fail("no repair counted")
    assert stats["sse_spliced"] == 0 and stats["sse_released"] == {"client_tool": 1}, fail("not released")
    frozen = await cg.service.store.frozen("", scenario.expand_id)
    _assert_original((frozen or b"").decode("utf-8"), output, fail)


@ensureDeferred
async def test_expand_in_non_streaming_fallback(claude_bin, claude_home, workdir, fake, make_cg):
    """Issue 4, JSON: every streamed attempt at turn 2 fails with an ``event: error`` before any
    content; Claude Code retries, then falls back to a non-streaming request (no ``stream`` key).
    The fake answers that with a JSON lone expand call; cg's continuation loop resolves it (the
    continuation is not streamed either) and Claude Code gets one merged message."""
    scenario, output, line = _expand_scenario(secrets.token_hex(4), stream_errors=10)
    cg, script, run = await _run_expand(claude_bin, claude_home, workdir, fake, make_cg, scenario)

    def fail(what: str) -> str:
        return _failure(what, run, script, cg)

    _assert_claude_ok(run, line, fail)
    _assert_offloaded(scenario, script, output, line, fail)

    # Turn 1, the failed streamed attempts at turn 2, the non-streaming one, cg's continuation.
    main = script.main_loop_requests()
    retries = len(scenario.errored)
    assert 1 <= retries < 10, fail(f"{retries} streamed attempts failed before the fallback")
    assert main[1 : 1 + retries] == scenario.errored, fail("the failed attempts")
    assert len(main) == retries + 3, fail("expected one non-streaming attempt and one continuation")
    fallback, continuation = main[-2], main[-1]
    assert "stream" not in fallback.body and "stream" not in continuation.body, fail("not the JSON fallback")
    assert scenario.expanded == [continuation], fail("the continuation")
    n = len(fallback.messages)
    assert continuation.messages[:n] == fallback.messages and len(continuation.messages) == n + 2, fail("prefix")
    [answered] = continuation.tool_result_blocks()
    assert answered.get("tool_use_id") == scenario.expand_id and "is_error" not in answered, fail("answer")
    _assert_original(continuation.tool_results()[0].text, output, fail)

    # One merged message: the lead text and the final answer, no expand call, one id.
    assert _expand_tool_uses(run) == [], fail("Claude Code saw the expand call")
    assert not any(_no_such_tool(r) for r, _ in script.log), fail("Claude Code answered 'No such tool'")
    last = [m["message"] for m in run.messages() if m.get("type") == "assistant"][-2:]
    assert [b.get("text") for m in last for b in m["content"]] == [scenario.lead, OffloadExpand.answer(line)], fail(
        "the merged message's texts"
    )
    assert len({m.get("id") for m in last}) == 1 and last[-1].get("stop_reason") == "end_turn", fail("merged")

    stats = cg.stats.snapshot()
    _common_stats(stats, fake, 1, fail)
    assert stats["expand"]["resolved"] == 1 and stats["expand"]["repairs"] == 0, fail("expand counts")
    assert stats["sse_spliced"] == 0 and stats["sse_released"] == {}, fail("the inspector did something")


@pytest.mark.parametrize("lead", [None, "\n\n"], ids=["text", "blank"])
@ensureDeferred
async def test_thinking_in_a_continuation_gets_its_hidden_turn_back_next_turn(claude_bin, claude_home, workdir, fake,
                                                                               make_cg, lead):
    """Preserved thinking (cg.stream.hidden) with the real client: the continuation cg splices in
    thinks, then calls Bash; Claude Code runs it and sends its turn back (the lead text, that
    thinking, the Bash call) with the result. cg puts the expand call and its answer back before the
    thinking, so the fake (strict: the thinking it signed, unmodified) sees that block after exactly
    the messages of the request it was written for; also when round 1's text was whitespace only,
    which Claude Code drops from the turn it sends back."""
    token = secrets.token_hex(4)
    scenario, output, line = _expand_scenario(token, **({} if lead is None else {"lead": lead}))
    second_id, signature = f"toolu_cge2e_count_{token}", f"EqQBCkYIcge2e{token}sig=="
    thought = "The listing is long; count its lines before answering."
    later: list = []

    def decide(request):
        if not request.is_main_loop:
            return None
        results = {r.tool_use_id for r in request.tool_results()}
        if second_id in results:
            later.append(request)
            return Turn([Text(OffloadExpand.answer(line))])
        if scenario.expand_id in results:
            scenario.expanded.append(request)
            call = ToolUse(second_id, "Bash", {"command": "echo counted", "description": "Count the lines"})
            return SSEReply(anthropic_stream_events(
                id=f"msg_cge2e_cont_{token}", model=request.model, stop_reason="tool_use",
                blocks=[anthropic_thinking_block(0, thought, signature), tool_use_block_events(1, call)]))
        return scenario(request)

    script = Script(decide)
    fake.default_reply = script
    fake.strict = True
    cg = make_cg(anthropic_upstream=fake.url, expand=True)
    run = await run_claude(
        claude_bin,
        ["-p", PROMPT, "--output-format", "stream-json", "--verbose", "--allowedTools", "Bash", "--max-turns", "8"],
        env=claude_env(claude_home, cg.url), cwd=workdir,
    )

    def fail(what: str) -> str:
        return _failure(what, run, script, cg)

    _assert_claude_ok(run, line, fail)
    assert fake.rejections == [], fail(f"the fake (strict) rejected requests: {fake.rejections}")
    [continuation] = scenario.expanded
    assert len(later) == 1, fail("Claude Code did not send the Bash result back once")
    # Claude Code moves its cache_control breakpoints each turn: markup, not the prompt's content.
    sent, before = _without_breakpoints(later[0].messages), _without_breakpoints(continuation.messages)
    n = len(before)
    assert sent[:n] == before, fail("the thinking's prefix is not the continuation's request")
    thinking = sent[n]["content"][0]
    assert sent[n]["role"] == "assistant" and thinking == {"type": "thinking", "thinking": thought,
                                                           "signature": signature}, fail("the thinking block")


def _without_breakpoints(value):
    if isinstance(value, dict):
        return {key: _without_breakpoints(item) for key, item in value.items() if key != "cache_control"}
    if isinstance(value, list):
        return [_without_breakpoints(item) for item in value]
    return value


@ensureDeferred
async def test_a_run_that_exits_is_no_longer_kept_warm(claude_bin, claude_home, workdir, fake, make_cg):
    """--keepalive: a headless run's conversation is armed for a ping when its turn is answered, and
    ended ("gone") when Claude Code exits and closes its connections, long before the ping is due:
    the pings a one-shot run used to be followed by (up to the idle bound) are not sent."""
    cg = make_cg(anthropic_upstream=fake.url, keepalive=True)
    run = await run_claude(claude_bin, ["-p", "Say hi.", "--output-format", "stream-json", "--verbose",
                                        "--max-turns", "1"], env=claude_env(claude_home, cg.url), cwd=workdir)
    stats = cg.stats.keepalive
    assert run.exit_code == 0, f"{run.describe()}\n{cg.stats.snapshot()}"
    # Its connections' FINs may reach cg a moment after the process is reaped.
    await until(lambda: stats.conversations == 0, timeout=10)
    assert stats.ended["gone"] >= 1 and stats.pings == 0, cg.stats.snapshot()
    assert set(stats.ended) == {"gone"}, cg.stats.snapshot()  # every conversation it had, its side requests'
