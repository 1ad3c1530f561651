"""Claude Code itself, headless, through cg against the scripted fake provider.

Skipped unless CG_E2E is set and npm is on PATH (``tox -e e2e``). The CLI is installed once into
$CG_E2E_NPM_DIR (default ~/.cache/cg-e2e/claude-code) and reused by later runs.
"""

import secrets

from claude_harness import Script, bash_round_trip, claude_env, run_claude
from pytest_twisted import ensureDeferred

from cg import dialect


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
