"""The Claude Code transcript reader on the shapes that broke it on real sessions (issue 25 §3;
tests/fixtures/transcripts/shapes/, built by shapes.py there), and cg-estimate's recorded bill
beside its simulated one."""

import base64
import io
import json
import struct
from pathlib import Path

from cg.compaction.options import rewrite_config
from cg.record import estimate, transcripts
from cg.record.replay import Sent, image_tokens, replay, segments
from cg.wire.dialect import MESSAGES_SHAPE

SHAPES = Path(__file__).resolve().parent / "fixtures" / "transcripts" / "shapes"


def read(*files: Path, ttl: str | None = None) -> tuple[list[transcripts.Session], transcripts.Tally]:
    tally = transcripts.Tally()
    return list(transcripts.read([(transcripts.CLAUDE_CODE, f) for f in files], ttl, tally)), tally


def roles(request: transcripts.Request) -> list[tuple[str, list[str]]]:
    messages = json.loads(request.body)["messages"]
    return [(m["role"], [b["type"] for b in m["content"]]) for m in messages]


def test_lines_of_one_response_are_one_request_though_a_tool_result_sits_between_them():
    [session], _ = read(*sorted((SHAPES / "split-response").glob("*.jsonl")))
    assert len(session.requests) == 3  # three responses; their four lines are not four requests
    assert roles(session.requests[1]) == [("user", ["text", "text"]), ("assistant", ["text", "tool_use", "tool_use"]),
                                          ("user", ["tool_result", "tool_result"])]
    first = session.requests[0]
    assert first.output_tokens == 95 and first.billed is not None and first.billed.output == 95  # the last line's


def test_a_resumed_file_counts_the_conversation_it_copies_once():
    files = sorted((SHAPES / "resumed").glob("*.jsonl"))
    for order in (files, files[::-1]):
        sessions, tally = read(*order)
        assert sum(len(s.requests) for s in sessions) == 3 and tally.copies == 2
    sessions, _ = read(*files)
    resumed = sessions[-1]
    assert resumed.id == files[1].stem and len(resumed.requests) == 1
    assert [role for role, _ in roles(resumed.requests[0])] == ["user", "assistant", "user", "assistant", "user"]


def test_each_file_is_read_once(monkeypatch):
    """A user's transcripts can add up to gigabytes: finding, ordering and reading them reads each
    file's bytes once, besides the first lines that say when its session began (a resumed file's
    up to the end of its copy). It read each three times: to order them, for the lifetime, to parse."""
    bytes_read: dict[str, int] = {}

    class Counted(io.BufferedReader):
        def _count(self, data: bytes) -> bytes:
            bytes_read[str(self.name)] = bytes_read.get(str(self.name), 0) + len(data)
            return data

        def read(self, size: int | None = -1) -> bytes:
            return self._count(super().read(size))

        def readline(self, size: int | None = -1) -> bytes:  # iterating calls it
            return self._count(super().readline(size))

    monkeypatch.setattr(transcripts, "open", lambda path, mode: Counted(io.FileIO(path, mode.replace("b", ""))),
                        raising=False)
    sessions = list(transcripts.read(transcripts.find(SHAPES)))
    assert len(sessions) == 14 and bytes_read
    for name, count in bytes_read.items():
        size = Path(name).stat().st_size
        allowance = size if "resumed" in name else 4096  # the lines before its own session's first
        assert count <= size + allowance, (name, count, size)


def test_a_resumed_file_whose_name_sorts_first_is_read_after_the_one_it_continues(tmp_path):
    """Claude Code names a file by its session's UUID: the order of the names is no order of time."""
    projects = tmp_path / ".claude" / "projects" / "-home-user-project"
    projects.mkdir(parents=True)
    for file in (SHAPES / "resumed").glob("*.jsonl"):  # the original's id now sorts after the resumed one's
        text = file.read_text().replace("2f4e6a8c0001", "2f4e6a8cffff")
        (projects / file.name.replace("2f4e6a8c0001", "2f4e6a8cffff")).write_text(text)
    for root in (tmp_path, projects):
        files = transcripts.find(root)
        assert [path.stem[-4:] for _, path in files] == ["ffff", "0002"]
        tally = transcripts.Tally()
        sessions = list(transcripts.read(files, tally=tally))
        assert [(s.id[-4:], len(s.requests)) for s in sessions] == [("ffff", 2), ("0002", 1)] and tally.copies == 2


def test_side_chains_inline_are_conversations_of_their_own():
    [file] = (SHAPES / "sidechains").glob("*.jsonl")
    main, *sides = read(file)[0]
    assert not main.sidechain and main.notes == () and len(main.requests) == 2
    assert all(not b.get("text", "").startswith("Review module") for b in
               json.loads(main.requests[1].body)["messages"][-1]["content"])
    assert [s.id for s in sides] == [f"{main.id}~1", f"{main.id}~2"]
    for side, module in zip(sides, "ab"):  # interleaved lines, each chain its own prompt
        assert side.sidechain and transcripts.SIDECHAIN_NOTE in side.notes and len(side.requests) == 2
        prompt = json.loads(side.requests[1].body)["messages"]
        assert prompt[0]["content"][-1]["text"] == f"Review module {module}."
        assert roles(side.requests[1])[1:] == [("assistant", ["tool_use"]), ("user", ["tool_result"])]


def test_a_sub_agent_file_is_read():
    sessions, _ = read(*(path for _, path in transcripts.find(SHAPES / "agent-file")))
    by_id = {s.id: s for s in sessions}
    assert sorted(by_id) == ["9a1c3e5f-2b4d-4f6a-8c0e-1a3c5e7f0001", "agent-a4f1e2d"]
    assert len(by_id["agent-a4f1e2d"].requests) == 2 and by_id["agent-a4f1e2d"].sidechain


def test_a_compaction_starts_the_prompt_again_and_a_microcompaction_clears_results():
    [session], _ = read(*(SHAPES / "compacted").glob("*.jsonl"))
    assert len(session.requests) == 5
    after = json.loads(session.requests[2].body)["messages"]
    assert [m["role"] for m in after] == ["user"]  # the summary and the next prompt, nothing from before
    texts = [b["text"] for b in after[0]["content"]]
    assert texts[1].startswith("This session is being continued") and texts[2] == "Now speed up the slowest function."
    before = json.loads(session.requests[1].body)["messages"]
    assert len(json.dumps(after)) < len(json.dumps(before)) / 2
    results = [b for m in json.loads(session.requests[4].body)["messages"] if isinstance(m["content"], list)
               for b in m["content"] if b.get("type") == "tool_result"]
    assert [(b["tool_use_id"], b["content"]) for b in results] == [("toolu_01Cb", transcripts.CLEARED_RESULT)]


def test_a_rewind_sends_the_branch_without_what_it_abandoned():
    [session], _ = read(*(SHAPES / "rewound").glob("*.jsonl"))
    assert len(session.requests) == 4  # the abandoned branch's responses were billed too
    branch = json.loads(session.requests[3].body)["messages"]
    assert [m["role"] for m in branch] == ["user", "assistant", "user"]
    assert branch[2]["content"][-1]["text"] == "Rewrite it with threads instead."


def test_one_hour_breakpoints_as_the_recorded_usage_shows():
    [file] = (SHAPES / "split-response").glob("*.jsonl")
    assert transcripts.recorded_ttl(file.read_bytes()) == "1h"
    assert transcripts.recorded_ttl(next((SHAPES / "resumed").glob("*.jsonl")).read_bytes()) is None

    def third_request_reads(ttl: str | None) -> int:
        [session], _ = read(file, ttl=ttl)
        turns = replay([Sent(r.time, r.path, r.body, r.output_tokens) for r in session.requests],
                       rewrite_config(), conversation=session.id)
        return turns[2].direct.cache_read  # 400 s after the one before

    assert third_request_reads(transcripts.RECORDED) > 10_000 and third_request_reads(None) == 0


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return estimate.main(list(argv), stdout=out, stderr=io.StringIO()), out.getvalue()


def test_ttl_on_the_command_line():
    split = str(SHAPES / "split-response")
    costs = {}
    for ttl in ("recorded", "5m", "1h"):
        code, out = run(split, "--json", "--ttl", ttl)
        report = json.loads(out)
        assert code == 0 and report["config"]["ttl"] == ttl
        costs[ttl] = report["total"]["cost_direct"]
    assert json.loads(run(split, "--json")[1])["config"]["ttl"] == "recorded"
    assert costs["recorded"] == costs["1h"] != costs["5m"]  # the fixture records one-hour writes


def test_the_recorded_bill_stands_beside_the_simulated_one():
    code, out = run(str(SHAPES), "--json")
    total = json.loads(out)["total"]
    assert code == 0 and total["requests"] == 35 and total["recorded_requests"] == 35
    assert total["sidechains"] == 3 and total["counted_once"] == 2 and total["left_out"] == 0
    assert total["simulated_vs_recorded"] == round(total["cost_direct_simulated"] / total["cost_direct_recorded"], 4)
    assert total["cost_direct_simulated"] == total["cost_direct"]
    code, out = run(str(SHAPES))
    header, *rows = out.splitlines()
    assert code == 0 and "cost direct  recorded  sim/rec" in header
    assert any(row.split()[1] == "agent-a4f1e2d" for row in rows if row.startswith("claude-code"))
    assert f"{total['simulated_vs_recorded']:.3f}" in next(row for row in rows if row.startswith("total"))
    assert "included: 3 sub-agent conversation(s)" in out and "counted once: 2 response(s)" in out


def _content_tokens(blocks: list[dict]) -> int:
    return sum(s.tokens for s in segments({"messages": [{"role": "assistant", "content": blocks}]}, MESSAGES_SHAPE))


def test_output_a_transcript_never_recorded_the_final_count_of_is_cg_s_estimate_of_the_content():
    """Claude Code 2.1.12-2.1.49 wrote each line of a response as its block began, its usage as it
    stood then (1 to 8 output tokens, stop_reason null), never the final count: on a real backup
    8,360 output tokens recorded where the responses' content was ~637,000 by cg's estimate."""
    [file] = (SHAPES / "start-counts").glob("*.jsonl")
    [session], _ = read(file)
    lines = [json.loads(line) for line in file.read_text().splitlines()]
    content: dict[str, list[dict]] = {}
    for line in lines:
        if line["type"] == "assistant":
            content.setdefault(line["message"]["id"], []).extend(line["message"]["content"])
    thought, wrote, thanked = session.requests
    for request, response, recorded in ((thought, "msg_01StA", 3), (wrote, "msg_01StB", 1)):
        assert request.output_recorded == recorded and request.output_tokens == _content_tokens(content[response])
        assert request.billed is not None and request.billed.output == request.output_tokens > 200
    # a response that wrote little is left as recorded: its count may be final
    assert thanked.output_tokens == 4 and thanked.output_recorded is None
    code, out = run(str(file), "--json")
    estimated = json.loads(out)["total"]["output_estimated"]
    assert code == 0 and estimated == {"requests": 2, "tokens": thought.output_tokens + wrote.output_tokens,
                                       "recorded": 4}
    assert (f"output estimated: 2 response(s) whose transcript recorded only the count their first block began "
            f"with (4 token(s) in all), priced at cg's estimate of their content, {estimated['tokens']:,} token(s)"
            in run(str(file))[1])


def test_output_a_transcript_records_the_final_count_of_is_kept(tmp_path):
    """The same responses where their lines record the final count: on the last line with its
    stop_reason (Claude Code 2.1.81 on), or on lines that say nothing of a stop (1.0.x, and
    transcripts that write no stop_reason), or a count above what a first block begins with."""
    [file] = (SHAPES / "start-counts").glob("*.jsonl")
    lines = [json.loads(line) for line in file.read_text().splitlines()]
    last = {line["message"]["id"]: at for at, line in enumerate(lines) if line["type"] == "assistant"}

    def written(name: str, change) -> Path:
        out = [json.loads(json.dumps(line)) for line in lines]
        for at in last.values():
            change(out[at]["message"])
        path = tmp_path / name / file.name
        path.parent.mkdir()
        path.write_text("".join(json.dumps(line) + "\n" for line in out))
        return path

    def stopped(message: dict) -> None:
        message["stop_reason"], message["usage"]["output_tokens"] = "end_turn", 300

    def counted(message: dict) -> None:
        message["usage"]["output_tokens"] = 11

    for path, final in ((written("stopped", stopped), [300, 300, 300]), (written("counted", counted), [11, 11, 11]),
                        (written("silent", lambda message: message.pop("stop_reason")), [3, 1, 4])):
        [session], _ = read(path)
        assert [(r.output_tokens, r.output_recorded) for r in session.requests] == [(count, None) for count in final]
        assert json.loads(run(str(path), "--json")[1])["total"]["output_estimated"]["requests"] == 0
    # nor does any other transcript the tests read: those the real CLIs wrote, the built ones
    fixtures = Path(__file__).resolve().parent / "fixtures" / "transcripts"
    others = [f for f in transcripts.find(fixtures) if "start-counts" not in f[1].parts]
    assert len(others) > 10 and all(r.output_recorded is None for s in transcripts.read(others) for r in s.requests)


def test_images_and_thinking_are_sized_as_billed_not_as_their_base64():
    """A screenshot's base64 is ~20,000 tokens as text and 1,280 billed (1200x800); a thinking block
    Claude Code wrote without its text is billed by the thinking its signature carries, not by the
    signature as text. Found on real 2.1.x sessions: single sessions simulated 1.8 to 3.4 times the recorded bill (docs/performance.md)."""
    code, out = run(str(SHAPES / "opaque"), "--json", "--calibrate", "off")
    [session] = json.loads(out)["sessions"]
    assert code == 0 and session["requests"] == 3
    assert 0.97 < session["simulated_vs_recorded_raw"] < 1.03  # 2.81 when base64 was sized as text

    def png(width: int, height: int) -> str:
        head = b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + struct.pack(">II", width, height)
        return base64.b64encode(head + bytes(5000)).decode()

    jpeg = b"\xff\xd8\xff\xe0" + struct.pack(">H", 16) + bytes(14) + b"\xff\xc0" + struct.pack(">HBHH", 17, 8, 300, 400)
    assert [image_tokens(png(800, 600)), image_tokens(png(1920, 1080)), image_tokens(png(4000, 100))] == [640, 1600, 82]
    assert image_tokens(base64.b64encode(jpeg + bytes(50)).decode()) == 160  # 400x300
    assert image_tokens("not an image") == image_tokens(None) == 1600  # unknown: at most
    told = {"type": "thinking", "thinking": "Check the margins first.", "signature": "Eq" + "A" * 4000}
    [with_text] = segments({"messages": [{"role": "assistant", "content": [told]}]}, MESSAGES_SHAPE)
    assert with_text.tokens < 20  # its text; the signature seals that same text


def test_a_prefix_another_session_cached_is_read_as_recorded():
    """Anthropic's cache is the account's, not a conversation's: a session begun a minute after
    another reads the envelope that one wrote, a sub-agent its parent's prefix. On real sessions
    about half the conversations' first requests did; simulated each on a cache of its own, the
    calibrated direct bill came to 1.12 times the recorded one (1.25 on one backup)."""
    code, out = run(str(SHAPES / "shared-prefix"), "--json")
    total = json.loads(out)["total"]
    assert code == 0 and total["shared_reads"] == 1 and total["client_breaks"] == 0
    assert 0.98 < total["simulated_vs_recorded"] < 1.02  # 1.51 when each session's cache was its own
    assert "shared cache: 1 request(s)" in run(str(SHAPES / "shared-prefix"))[1]


def test_the_envelope_is_fitted_to_the_first_requests_recorded_prompt():
    [file] = (SHAPES / "split-response").glob("*.jsonl")
    [session], _ = read(file)
    turns = replay([Sent(r.time, r.path, r.body, r.output_tokens) for r in session.requests], rewrite_config(),
                   conversation=session.id)
    first = session.requests[0]
    assert first.billed is not None and first.unseen > 5_000
    assert abs(turns[0].direct.prompt - first.billed.prompt) < 0.01 * first.billed.prompt
    systems = [json.loads(r.body)["system"] for r in session.requests]
    assert all(system == systems[0] for system in systems)  # the same bytes on every request: cached alike
    assert "cache_control" in systems[0][-1] and "cache_control" not in systems[0][-2]  # under the last breakpoint
    # the fixtures the real CLIs wrote recorded the fake provider's usage, smaller than any envelope: no pad
    home = Path(__file__).resolve().parent / "fixtures" / "transcripts" / "home" / ".claude"
    assert all(r.unseen == 0 for s in transcripts.read(transcripts.find(home)) for r in s.requests)
    # a sub-agent's recorded prompt smaller than the main envelope: its tools fewer, to about the size
    sessions, _ = read(*(path for _, path in transcripts.find(SHAPES / "agent-file")))
    [agent] = [s for s in sessions if s.id == "agent-a4f1e2d"]
    first = agent.requests[0]
    [turn, *_] = replay([Sent(r.time, r.path, r.body, r.output_tokens) for r in agent.requests], rewrite_config(),
                        conversation=agent.id)
    assert first.unseen < 0 and first.billed is not None
    assert len(json.loads(first.body)["tools"]) < len(transcripts.envelopes()[transcripts.CLAUDE_CODE]["tools"])
    assert abs(turn.direct.prompt - first.billed.prompt) < 200  # within the smallest tool left


def test_the_table_escapes_what_a_transcript_says(tmp_path):
    [file] = (SHAPES / "split-response").glob("*.jsonl")
    text = file.read_text().replace("5b2f0c1e-7a41-4c52-9d0e-31a7c6e0b001", "\\u001b[2J\\u0007").replace(
        "/home/user/project", "/home/user/\\u001b]0;x\\u0007").replace(  # as JSON escapes them
        "claude-sonnet-4-5-20250929", "claude-sonnet-4-5-\\u001b[31m")  # a model the price note names
    (tmp_path / "s.jsonl").write_text(text)
    code, out = run(str(tmp_path / "s.jsonl"))
    assert code == 0 and "\x1b" not in out and "\x07" not in out
    row = next(line for line in out.splitlines() if line.startswith("claude-code"))
    assert "\\x1b[2J\\x07" in row and "\\x1b]0;x\\x07" in row and "claude-sonnet-4-5-\\x1b[31m is not" in out
