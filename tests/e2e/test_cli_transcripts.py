"""``cg-estimate`` on transcripts the real CLIs wrote: Claude Code and Codex CLI run a few shell
commands through cg against the scripted fake, then cg-estimate reads their HOME.

Skipped unless CG_E2E is set and npm is on PATH (``tox -e e2e``).
"""

from __future__ import annotations

import io
import json
import secrets

import codex_harness
from claude_harness import Script as ClaudeScript
from claude_harness import Text, ToolUse, Turn, claude_env, numbered_output, run_claude
from pytest_twisted import ensureDeferred

from cg.compaction.options import rewrite_config
from cg.compaction.rewrite import Rewriter
from cg.record import estimate, transcripts

# Parts of a request the transcripts do not hold, rebuilt from the envelope (sizes, not content):
# Claude Code's first message (its context reminder) and system message (the listings); Codex's
# base instructions (Codex drops a few lines of them).
ENVELOPE = {transcripts.CLAUDE_CODE: {0, 1}, transcripts.CODEX: {0}}


def assert_rebuilt(home, received: list[bytes], client: str, tool: str) -> None:
    """Each request rebuilt from the transcript, rewritten offline as cg does, is what the fake got
    through the live cg, message by message (but for the envelope's parts); cg-estimate prices it."""
    [session] = [s for s in transcripts.read(transcripts.find(home)) if s.client == client]
    got = [json.loads(body) for body in received]
    got = [g for g in got if tool in [t.get("name") for t in g.get("tools") or []]]  # the agent loop's
    assert len(session.requests) == len(got) > 5
    rewriter = Rewriter(rewrite_config())
    key = "messages" if client == transcripts.CLAUDE_CODE else "input"
    for request, theirs in zip(session.requests, got):
        mine = json.loads(rewriter.rewrite(request.body, request.path.encode()).body)[key]
        assert len(mine) == len(theirs[key]) or (client == transcripts.CLAUDE_CODE and len(theirs[key]) - len(mine) == 1)
        for i, (a, b) in enumerate(zip(mine, theirs[key])):
            if i not in ENVELOPE[client]:
                assert a == b, (i, json.dumps(a)[:300], json.dumps(b)[:300])
    out, err = io.StringIO(), io.StringIO()
    assert estimate.main([str(home), "--json"], stdout=out, stderr=err) == 0, err.getvalue()
    [priced] = json.loads(out.getvalue())["sessions"]
    assert priced["client"] == client and priced["offloads"] == 2 and 0 < priced["ratio"] < 0.8


def commands(token: str) -> list[str]:
    """Shell commands of a short session: small outputs and two big ones cg offloads."""
    listing, _ = numbered_output(500, 250, f"cg-e2e-needle-{token}")
    return [f"echo cg-e2e-start-{token}", listing, "seq 1 300", "seq 1 4000", f"echo cg-e2e-end-{token}"]


def claude_decide(token: str, steps: list[str]):
    def decide(request):
        if not request.is_main_loop:
            return None
        done = sum(1 for m in request.messages for b in (m.get("content") if isinstance(m.get("content"), list) else [])
                   if isinstance(b, dict) and b.get("type") == "tool_result")
        if done >= len(steps):
            return Turn([Text(f"All {len(steps)} commands ran.")])
        return Turn([Text(f"Step {done + 1}."),
                     ToolUse(f"toolu_cge2e_{token}_{done}", "Bash", {"command": steps[done], "description": f"step {done}"})])

    return decide


def codex_decide(token: str, steps: list[str]):
    def decide(request):
        if not request.is_main_loop:
            return None
        done = len(request.outputs())
        if done >= len(steps):
            return [codex_harness.message(f"All {len(steps)} commands ran.", f"msg_cge2e_{token}_end")]
        return [codex_harness.shell_call(steps[done], f"call_cge2e_{token}_{done}")]

    return decide


@ensureDeferred
async def test_claude_code_transcript(claude_bin, claude_home, workdir, fake, make_cg):
    token = secrets.token_hex(4)
    steps = commands(token)
    script = ClaudeScript(claude_decide(token, steps))
    fake.default_reply = script
    cg = make_cg(anthropic_upstream=fake.url, expand=True)
    run = await run_claude(
        claude_bin,
        ["-p", "Run the cg e2e commands one by one.", "--output-format", "stream-json", "--verbose",
         "--allowedTools", "Bash", "--max-turns", "10"],
        env=claude_env(claude_home, cg.url), cwd=workdir,
    )
    assert run.exit_code == 0, run.describe()
    assert_rebuilt(claude_home, [r.body for r in fake.received if r.path.startswith(b"/v1/messages?")
                                 or r.path == b"/v1/messages"], transcripts.CLAUDE_CODE, "Bash")


@ensureDeferred
async def test_codex_transcript(codex_bin, codex_home, workdir, fake, make_cg):
    token = secrets.token_hex(4)
    steps = commands(token)
    script = codex_harness.Script(codex_decide(token, steps))
    fake.default_reply = script
    cg = make_cg(openai_upstream=fake.url, expand=True)
    codex_harness.write_config(codex_home / ".codex", f"{cg.url}/v1")
    run = await codex_harness.run_codex(codex_bin, codex_harness.exec_args("Run the cg e2e commands one by one.", workdir),
                                        codex_harness.codex_env(codex_home), workdir)
    assert run.exit_code == 0, run.describe()
    assert_rebuilt(codex_home, [r.body for r in fake.received if r.path == b"/v1/responses"], transcripts.CODEX,
                   "exec_command")
