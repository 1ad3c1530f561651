"""Codex CLI itself, headless (``codex exec``), through cg against the scripted fake provider.

Skipped unless CG_E2E is set and npm is on PATH (``tox -e e2e``). The CLI (pinned,
CG_E2E_CODEX_VERSION, default 0.171.0) is installed once into $CG_E2E_CODEX_NPM_DIR (default
~/.cache/cg-e2e/codex-VERSION) and reused by later runs. Codex talks to a custom provider
(``wire_api = "responses"``) at a tap in front of cg, so each test sees what Codex itself sent as
well as what reached the fake.
"""

import json
import re
import secrets
from pathlib import Path

import attrs
import pytest
import pytest_twisted
from claude_harness import needle_scenario
from codex_harness import (
    EXPAND_TOOL,
    MODEL,
    SHELL_TOOL,
    UNSUPPORTED,
    CodexRequest,
    CodexRun,
    OffloadExpand,
    Script,
    Tap,
    codex_env,
    command_output,
    describe_tap,
    exec_args,
    outside,
    rollout_items,
    run_codex,
    sha256,
    shell_call,
    shell_round_trip,
    write_config,
)
from pytest_twisted import ensureDeferred

from cg.testing import FakeUpstream
from cg.wire import dialect


@pytest.fixture
def make_tap():
    """``make_tap(port)``: a recording relay on 127.0.0.1 in front of ``port``; stopped after the test."""
    taps = []

    def make(port: int) -> Tap:
        tap = Tap("127.0.0.1", port).listen()
        taps.append(tap)
        return tap

    yield make
    for tap in taps:
        stopped = tap.stop()
        if stopped is not None:
            pytest_twisted.blockon(stopped)


@pytest.fixture
def codex(codex_bin, codex_home, workdir, fake, make_cg, make_tap):
    """``await codex(decide, prompt, **cg_config)``: cg (its OpenAI upstream the strict fake,
    answering with ``Script(decide)``), a tap in front of it, config.toml pointing Codex at the
    tap, and one ``codex exec`` run; returns a Session."""

    async def run(decide, prompt: str, **config) -> Session:
        script = Script(decide)
        fake.default_reply = script
        fake.strict = True  # a request the real API would refuse gets a 400 and lands in fake.rejections
        cg = make_cg(openai_upstream=fake.url, **config)
        tap = make_tap(cg.port)
        write_config(codex_home / ".codex", f"{tap.url}/v1")
        run = await run_codex(codex_bin, exec_args(prompt, workdir), codex_env(codex_home), workdir)
        session = Session(script, cg, tap, run, fake, codex_home / ".codex")
        print(f"codex run: {run.seconds:.1f}s, {len(tap.requests())} requests sent, {len(fake.received)} received\n"
              f"{script.describe()}")
        return session

    return run


@attrs.define
class Session:
    """One run's parts: the script (what the fake got and answered), cg, the tap, the run."""

    script: Script
    cg: object
    tap: Tap
    run: CodexRun
    fake: FakeUpstream
    codex_home: Path

    def sent(self) -> list[CodexRequest]:
        """What Codex itself sent (before cg), in order."""
        return [CodexRequest.from_tap(r) for r in self.tap.requests()]

    def fail(self, what: str) -> str:
        return (
            f"{what}\n{self.run.describe()}\n--- requests Codex sent (the tap)\n{describe_tap(self.tap)}\n"
            f"--- requests the fake received\n{self.script.describe()}\n--- cg stats\n{self.cg.stats.snapshot()}"
        )

    def assert_ok(self, answer: str) -> None:
        run, fail = self.run, self.fail
        assert not run.timed_out, fail("Codex timed out")
        assert run.exit_code == 0, fail("Codex failed")
        assert run.turn_failed() == [], fail("Codex reported a failed turn or an error")
        assert run.final_message() == answer, fail(f"the final message is not the answer {answer!r}")
        assert self.fake.rejections == [], fail(f"the fake (strict) rejected requests: {self.fake.rejections}")


# Headers Codex sends that cg must forward as they are (§6.2 of the reference).
FORWARDED_HEADERS = (
    "authorization", "session-id", "thread-id", "x-client-request-id", "x-codex-turn-metadata",
    "x-codex-window-id", "x-codex-beta-features", "originator", "user-agent", "accept",
)


def assert_forwarded(sent: CodexRequest, got: CodexRequest, fail, tools_injected: bool) -> None:
    """What cg forwarded of one Codex request: every byte outside ``input`` and ``tools`` (model,
    stream, reasoning, prompt_cache_key, client_metadata in its random key order…), the headers
    that identify the session, Codex's own tools (cg's expand tool added, if ``tools_injected``)."""
    assert outside(got.raw) == outside(sent.raw), fail("the bytes outside input/tools changed")
    assert got.body["client_metadata"] == sent.body["client_metadata"], fail("client_metadata")
    for name in FORWARDED_HEADERS:
        assert got.header(name) == sent.header(name), fail(f"header {name} was not forwarded as sent")
    tools = got.body.get("tools")
    assert [t for t in tools if t.get("name") != EXPAND_TOOL] == sent.body["tools"], fail("Codex's tools changed")
    injected = [t for t in tools if t.get("name") == EXPAND_TOOL]
    if tools_injected:
        assert len(injected) == 1 and injected[0].get("type") == "function", fail("no function tool injected")
    else:
        assert injected == [], fail("cg injected its tool")


def _identity(item: dict) -> dict:
    """What Codex keeps of an output item as it was sent (§6.4 re-serializes the rest)."""
    return {k: v for k, v in item.items() if k in ("type", "id", "encrypted_content", "call_id", "name", "arguments")}


# ---------------------------------------------------------------------------------------------
# 1. A shell round trip


@ensureDeferred
async def test_shell_round_trip(codex, workdir):
    """The fake scripts an exec_command call; Codex runs it and sends a function_call_output back
    through cg; the fake's message quotes the line it printed; Codex ends on that message. cg
    forwarded each request: everything outside ``input``/``tools`` byte for byte."""
    token = secrets.token_hex(4)
    # The output is not in the command's text ($((6*7)) → 42): it can only come from a real run.
    command = f"echo cg-e2e-marker-$((6*7))-{token}"
    expected = f"cg-e2e-marker-42-{token}"
    call_id = f"call_cge2e_{token}"

    def answer(output: str) -> str:
        found = re.search(r"^cg-e2e-marker-\S*$", command_output(output), re.M)
        return f"The marker command printed: {found[0] if found else '(nothing)'}"

    s = await codex(shell_round_trip(command, call_id, answer), "Run the cg e2e marker command and tell me what it printed.")
    fail = s.fail
    s.assert_ok(f"The marker command printed: {expected}")

    # Codex ran the command (its own event says so) and sent the output back.
    [ran] = s.run.items("command_execution")
    assert ran.get("exit_code") == 0 and expected in str(ran.get("aggregated_output")), fail("the command run")
    main = s.script.main_loop_requests()
    assert len(main) == 2, fail("expected exactly two agent-loop requests")
    assert main[0].outputs() == {} and main[0].calls() == [], fail("the first request has calls")
    [call] = main[1].calls(SHELL_TOOL)
    assert (call.get("call_id"), json.loads(call["arguments"])) == (call_id, {"cmd": command}), fail("the call")
    [item] = main[1].output_items(call_id)
    assert item["id"].startswith("fco_"), fail("Codex's function_call_output has no fco_ id")
    text = item["output"]
    assert text.startswith("Chunk ID: ") and "\nProcess exited with code 0\n" in text, fail("not exec_command's output")
    assert command_output(text).strip() == expected, fail("the function_call_output is not the command's output")
    for request in main:
        assert request.streaming and request.model == MODEL, fail("not a streamed gpt-5.5 request")

    # What Codex sent is what the fake got (one to one: cg made no request of its own).
    sent = s.sent()
    assert [r.path for r in sent] == ["/v1/responses"] * len(s.fake.received), fail("Codex's requests")
    got = [r for r, _, _ in s.script.log]
    for mine, theirs in zip(sent, got, strict=True):
        assert_forwarded(mine, theirs, fail, tools_injected=True)  # expand on: lossy runs, so the tool is there
        assert theirs.input == mine.input, fail("the input changed (nothing here to compact)")
    # The history Codex re-sent is the first request's input, then the reasoning item and the call
    # (as the fake sent them, reasoning's encrypted_content included), then the output.
    answered = s.script.log[0][2]
    n = len(sent[0].input)
    assert sent[1].input[:n] == sent[0].input, fail("the history is not a prefix")
    kept = [_identity(i) for i in sent[1].input[n : n + 2]]
    assert kept == [_identity(i) for i in answered], fail("the history does not hold the reasoning and the call")

    stats = s.cg.stats.snapshot()
    clients = len(s.fake.received)
    assert stats["requests_by_dialect"] == {dialect.RESPONSES: clients}, fail("cg's request count")
    assert stats["responses_by_status"] == {"200": clients}, fail("non-200 responses")
    assert stats["upstream_errors"] == 0 and stats["in_flight"] == 0, fail("upstream errors")
    assert stats["streamed"] == clients, fail("a request was not streamed")


# ---------------------------------------------------------------------------------------------
# Offload and expand: a big exec_command output that cg offloads, and the model asking for it back.
# Codex cuts a tool output above ~40,000 characters itself (gpt-5.5: 10,000 tokens at 4 bytes a
# token), so the output stays under that (~27 KB, ~6,700 tokens): well over offload_min_tokens.

PROMPT = "Run the cg e2e listing command and tell me what its middle line says."


def _expand_scenario(token: str, **kw) -> tuple[OffloadExpand, str, str]:
    """(the scenario, the output the command prints, the needle line in its middle)."""
    return needle_scenario(OffloadExpand, token, f"call_cge2e_listing_{token}", f"call_cge2e_expand_{token}", **kw)


def _original(s: Session, scenario: OffloadExpand, output: str) -> str:
    """The big function_call_output as Codex sent it (before cg): exec_command's header, then the
    whole output (under Codex's own truncation limit)."""
    texts = {r.outputs().get(scenario.shell_id) for r in s.sent()} - {None}
    assert len(texts) == 1, s.fail(f"Codex sent the listing's output {len(texts)} different ways")
    [text] = texts
    assert command_output(text) == output, s.fail(f"Codex did not send the whole output ({len(text)} chars)")
    return text


def _assert_offloaded(s: Session, scenario: OffloadExpand, original: str, line: str) -> None:
    """The fake got cg's offloaded version: the marker (the original's ID) in place of the middle;
    the needle line reached it only in an answer to the expand call."""
    fail = s.fail
    request = scenario.offloaded
    assert request is not None, fail("the listing's output never reached the fake")
    text = request.outputs()[scenario.shell_id]
    assert scenario.marker_id is not None, fail(f"no <<cg:ID>> marker in the function_call_output: {text[:500]!r}")
    assert scenario.marker_id == sha256(original)[:16], fail("the marker is not the ID of the original Codex sent")
    assert EXPAND_TOOL in request.tool_names, fail("cg did not inject its expand tool")
    assert len(text) < len(original) // 4 and text.startswith(original[:300]), fail("not offloaded to its head")
    for seen, _, _ in s.script.log:
        if scenario.expand_id not in seen.outputs():  # it answers the expand call: the original
            assert line.encode() not in seen.raw, fail(f"the needle line was not elided: {seen.summary()}")


def _assert_codex_never_saw_the_tool(s: Session) -> None:
    fail = s.fail
    for request in s.sent():
        assert request.calls(EXPAND_TOOL) == [], fail("Codex's history holds an expand call")
        assert UNSUPPORTED.encode() not in request.raw, fail("Codex answered 'unsupported call'")
        assert EXPAND_TOOL not in request.tool_names, fail("Codex was shown the expand tool")
    assert f'"name":"{EXPAND_TOOL}"'.encode() not in s.tap.received_bytes(), fail("the call reached Codex")
    assert EXPAND_TOOL not in json.dumps(s.run.messages()), fail("Codex printed an expand call")
    assert UNSUPPORTED not in s.run.stderr.decode(errors="replace"), fail("Codex's router refused the call")


def _expand_stats(s: Session, bounces: int) -> dict:
    """cg answered every Codex request 200 and sent the fake each of them plus ``bounces`` continuations."""
    fail = s.fail
    stats = s.cg.stats.snapshot()
    clients = len(s.tap.requests())
    assert len(s.fake.received) == clients + bounces, fail("the fake's request count")
    assert stats["requests_by_dialect"] == {dialect.RESPONSES: clients}, fail("request count")
    assert stats["responses_by_status"] == {"200": clients}, fail("non-200 responses")
    assert stats["upstream_errors"] == 0 and stats["in_flight"] == 0, fail("upstream errors")
    assert stats["sse_inspected"] == clients and stats["sse_buffered"] == 0, fail("a stream was not inspected")
    assert stats["expand"]["bounces"] == bounces, fail("expand bounces")
    assert stats["expand"]["continuations_failed"] == 0, fail("a continuation failed")
    assert all(stats["expand"][k] == 0 for k in ("unknown", "evicted", "malformed")), fail("bad expand ids")
    compaction = stats["compaction"]
    assert compaction["components"]["offload"]["acted"] >= 1, fail("offload never acted")
    assert compaction["store_fail_open"] == 0, fail("the store failed open")
    return stats


@ensureDeferred
async def test_offloaded_output_expanded_mid_stream(codex):
    """cg offloads the big output at first sight and injects its expand tool; the model answers
    with a lone expand call; cg answers it itself and continues upstream (the continuation's input
    ends with the call and the original), splicing the continuation into Codex's stream. Codex
    never sees the tool; it runs the follow-up command and prints the SHA-256 of the original."""
    token = secrets.token_hex(4)
    scenario, output, line = _expand_scenario(token, follow_up=f"call_cge2e_digest_{token}")
    s = await codex(scenario, PROMPT, expand=True)
    fail = s.fail
    original = _original(s, scenario, output)
    s.assert_ok(OffloadExpand.answer(sha256(original), line))
    _assert_offloaded(s, scenario, original, line)
    _assert_codex_never_saw_the_tool(s)

    # The fake: turn 1 (the listing), turn 2 (offloaded output → expand), cg's continuation (→ the
    # follow-up command), turn 3 (its output → the answer). Codex sent turns 1 to 3 only.
    main = s.script.main_loop_requests()
    assert len(main) == 4 and len(s.sent()) == 3, fail("expected three Codex requests and one continuation")
    turn2, continuation, turn3 = main[1:]
    assert turn2 is scenario.offloaded and scenario.expanded == [continuation], fail("request order")
    assert scenario.followed == [turn3], fail("the follow-up")
    assert continuation.streaming, fail("the continuation is not a stream")
    assert outside(continuation.raw, ("input",)) == outside(turn2.raw, ("input",)), fail("continuation: outside input")
    for name in ("authorization", "session-id", "x-codex-turn-metadata"):
        assert continuation.header(name) == turn2.header(name) is not None, fail(f"continuation header {name}")
    # The continuation extends what cg forwarded on turn 2: the same items, then the round's
    # items as the fake sent them (reasoning, the call), then the call's answer: the original.
    n = len(turn2.input)
    assert continuation.input[:n] == turn2.input and len(continuation.input) == n + 3, fail("continuation input")
    reasoning, call, answered = continuation.input[n:]
    sent_round = next(items for r, _, items in s.script.log if r is turn2)
    assert [reasoning, call] == sent_round, fail("the round's items are not as the fake sent them")
    assert (call["name"], call["call_id"], json.loads(call["arguments"])) == (
        EXPAND_TOOL, scenario.expand_id, {"id": scenario.marker_id}
    ), fail("the expand call")
    assert answered.get("type") == "function_call_output" and answered.get("call_id") == scenario.expand_id, fail(
        "no function_call_output for the expand call"
    )
    assert answered.get("output") == original, fail(
        f"the expand answer is not the original ({len(str(answered.get('output')))} chars, expected {len(original)})"
    )

    # What Codex kept of the spliced response: no expand call, the follow-up call and its output.
    codex_turn3 = s.sent()[2]
    assert [c["call_id"] for c in codex_turn3.calls()] == [scenario.shell_id, scenario.follow_up], fail("calls kept")
    digest_output = codex_turn3.outputs()[scenario.follow_up]
    assert command_output(digest_output).strip() == f"cg-e2e-digest-{sha256(original)}", fail("the follow-up ran")
    assert_forwarded(codex_turn3, turn3, fail, tools_injected=True)
    # Every item of both rounds but the expand call: round 2's reasoning, the continuation's
    # reasoning and call; then the call's output.
    kept = codex_turn3.input[len(s.sent()[1].input) :]
    followed_round = next(items for r, _, items in s.script.log if r is continuation)
    assert [_identity(i) for i in kept[:3]] == [_identity(i) for i in [reasoning, *followed_round]], fail(
        "Codex's history of the spliced response"
    )
    assert [i["type"] for i in kept[3:]] == ["function_call_output"], fail("after the spliced response")

    stats = _expand_stats(s, 1)
    assert stats["expand"]["resolved"] == 1 and stats["expand"]["repairs"] == 0, fail("expand counts")
    assert stats["expand"]["wasted_tokens"] > 2000, fail("wasted_tokens")
    assert stats["sse_spliced"] == 1 and stats["expand_rounds"] == 1, fail("not spliced")
    assert stats["sse_released"] == {}, fail("the inspector released a hold")
    original_stored = await s.cg.service.store.get("", scenario.marker_id)
    assert (original_stored or b"").decode("utf-8") == original, fail("the store does not hold the original")


@ensureDeferred
async def test_expand_batched_with_shell_is_repaired(codex):
    """The expand call comes batched with an exec_command call, so cg lets the response through;
    Codex runs the command and answers the expand call "unsupported call: context_guru_expand"; on
    the next request cg puts the original in place of that answer, and the answer rests on it."""
    token = secrets.token_hex(4)
    batched = shell_call(f"echo cg-e2e-batched-$((6*7))-{token}", f"call_cge2e_batched_{token}")
    scenario, output, line = _expand_scenario(token, batch_with=batched)
    s = await codex(scenario, PROMPT, expand=True)
    fail = s.fail
    original = _original(s, scenario, output)
    s.assert_ok(OffloadExpand.answer(sha256(original), line))
    _assert_offloaded(s, scenario, original, line)

    # Turns 1 (the listing), 2 (expand + echo), 3 (both answered): all Codex's own.
    main = s.script.main_loop_requests()
    sent = s.sent()
    assert len(main) == 3 == len(sent) and scenario.expanded == [main[2]], fail("expected three requests")
    codex_turn3, turn3 = sent[2], main[2]

    # Codex saw the call (released with its own), ran the echo, answered the expand call (§6.7).
    assert [c["call_id"] for c in codex_turn3.calls()] == [scenario.shell_id, scenario.expand_id, batched["call_id"]], fail(
        "Codex's history does not hold both calls"
    )
    [refused] = codex_turn3.output_items(scenario.expand_id)
    assert refused["output"] == UNSUPPORTED, fail(f"Codex's answer to the expand call: {refused['output']!r}")
    echoed = codex_turn3.outputs()[batched["call_id"]]
    assert command_output(echoed).strip() == f"cg-e2e-batched-42-{token}", fail("the batched command did not run")
    assert UNSUPPORTED in s.run.stderr.decode(errors="replace"), fail("Codex's router did not log the call")

    # What the fake got on turn 3: the original in place of "unsupported call", nothing else changed.
    [repaired] = turn3.output_items(scenario.expand_id)
    assert repaired["output"] == original, fail(
        f"the expand answer was not repaired ({len(str(repaired['output']))} chars: {str(repaired['output'])[:200]!r})"
    )
    assert {k: v for k, v in repaired.items() if k != "output"} == {k: v for k, v in refused.items() if k != "output"}, fail(
        "the repaired item's other keys changed"
    )
    assert UNSUPPORTED.encode() not in turn3.raw, fail("'unsupported call' reached the fake")
    assert turn3.outputs()[batched["call_id"]] == echoed, fail("the batched call's output changed")
    assert_forwarded(codex_turn3, turn3, fail, tools_injected=True)
    # The listing's output is offloaded again, to the same bytes (its marker unchanged).
    assert turn3.outputs()[scenario.shell_id] == scenario.offloaded.outputs()[scenario.shell_id], fail(
        "the offloaded output changed between turns"
    )
    # Codex's own history (its session file) keeps its answer, not cg's.
    refusals = [i for i in rollout_items(s.codex_home) if i.get("call_id") == scenario.expand_id and "output" in i]
    assert [i["output"] for i in refusals] == [UNSUPPORTED], fail(f"Codex's session file: {refusals}")

    stats = _expand_stats(s, 0)
    assert stats["expand"]["repairs"] == 1, fail("no repair counted")
    assert stats["sse_spliced"] == 0 and stats["sse_released"] == {"client_tool": 1}, fail("not released")
