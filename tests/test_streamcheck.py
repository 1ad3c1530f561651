"""cg.stream.streamcheck: each rule catches its fault, and a well-formed stream passes."""

from __future__ import annotations

import pytest

from cg.stream.streamcheck import check_anthropic_stream, main
from cg.testing import anthropic_stream_events, anthropic_text_block, sse_event


def start(index: int, block: dict) -> bytes:
    return sse_event(
        "content_block_start", {"type": "content_block_start", "index": index, "content_block": block}
    )


def delta(index: int, d: dict) -> bytes:
    return sse_event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": d})


def stop(index: int) -> bytes:
    return sse_event("content_block_stop", {"type": "content_block_stop", "index": index})


def thinking(index: int) -> list[bytes]:
    return [
        start(index, {"type": "thinking", "thinking": "", "signature": ""}),
        delta(index, {"type": "thinking_delta", "thinking": "hmm"}),
        delta(index, {"type": "signature_delta", "signature": "sig=="}),
        stop(index),
    ]


def tool(
    index: int, parts=("", '{"command":', ' "ls"}'), name: str = "Bash", input: dict | None = None
) -> list[bytes]:
    block = {
        "type": "tool_use",
        "id": f"toolu_{index}",
        "name": name,
        "input": {} if input is None else input,
    }
    return [
        start(index, block),
        *(delta(index, {"type": "input_json_delta", "partial_json": p}) for p in parts),
        stop(index),
    ]


def good() -> list[bytes]:
    return anthropic_stream_events(
        blocks=[thinking(0), anthropic_text_block(1, ["Hi", " there"]), tool(2)], stop_reason="tool_use"
    )


def check(events: list[bytes]) -> list[str]:
    return check_anthropic_stream(b"".join(events))


def test_well_formed_streams_pass():
    assert check(good()) == []
    assert check(anthropic_stream_events()) == []
    # Comments, pings anywhere, CRLF, a server tool result block: all fine.
    events = good()
    events.insert(3, b": keepalive\n\n")
    events.insert(5, sse_event("ping", {"type": "ping"}))
    result = {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": []}
    events[-2:-2] = [start(3, result), stop(3)]
    assert check(events) == []
    assert check_anthropic_stream(b"".join(events).replace(b"\n", b"\r\n")) == []


def one(events: list[bytes], needle: str) -> None:
    problems = check(events)
    assert problems, "expected a problem"
    assert any(needle in p for p in problems), problems


def test_index_gap_start_at_one_and_reorder():
    events = good()
    events[2:] = [e.replace(b'"index":0', b'"index":9') for e in events[2:6]] + events[6:]
    one(events, "index 9, expected 0")
    shifted = anthropic_stream_events(blocks=[anthropic_text_block(1, ["x"])])
    one(shifted, "index 1, expected 0")


def test_delta_before_start_and_after_stop():
    events = anthropic_stream_events()
    block = events[2:6]
    events[2:6] = [block[1], block[0], block[2], block[3]]
    one(events, "never started")
    events = anthropic_stream_events()
    events.insert(6, delta(0, {"type": "text_delta", "text": "late"}))
    one(events, "already stopped")


def test_delta_type_must_fit_block():
    events = anthropic_stream_events()
    events.insert(4, delta(0, {"type": "input_json_delta", "partial_json": "{}"}))
    one(events, "input_json_delta on a text block")
    events = anthropic_stream_events(blocks=[tool(0)])
    events.insert(4, delta(0, {"type": "text_delta", "text": "x"}))
    one(events, "text_delta on a tool_use block")
    events = anthropic_stream_events(blocks=[thinking(0)])
    events.insert(4, delta(0, {"type": "citations_delta", "citation": {}}))
    one(events, "citations_delta on a thinking block")


def test_unstopped_block_and_interleaving():
    events = anthropic_stream_events()
    del events[-3]  # the content_block_stop
    one(events, "block 0 never stopped")
    events = anthropic_stream_events(blocks=[anthropic_text_block(0, ["a"]), anthropic_text_block(1, ["b"])])
    events.insert(7, events.pop(4))  # block 0's stop after block 1's start
    one(events, "started while block 0 is open")


def test_message_start_rules():
    events = anthropic_stream_events()
    one([events[0], *events], "second message_start")
    one(events[1:], "no message_start")
    one([events[2], *events[:2], *events[3:]], "message_start is not first")


def test_message_delta_and_stop_rules():
    events = anthropic_stream_events()
    one(events[:-1], "no message_stop")
    one(events[:-2] + events[-1:], "message_stop without message_delta")
    one(events[:-1] + events[-2:], "more than one message_delta")
    one(
        events + [sse_event("content_block_stop", {"type": "content_block_stop", "index": 0})],
        "after message_stop",
    )


def test_event_line_and_name():
    events = anthropic_stream_events()
    events[3] = events[3].split(b"\n", 1)[1]  # drop the event: line
    one(events, "no event: line")
    events = anthropic_stream_events()
    events[3] = events[3].replace(b"event: content_block_delta", b"event: content_block_stop")
    one(events, "does not match data type")


def test_tool_input_rules():
    one(anthropic_stream_events(blocks=[tool(0, parts=("", '{"command": "l'))]), "input is not a JSON object")
    one(anthropic_stream_events(blocks=[tool(0, parts=("[1]",))]), "input is not a JSON object")
    one(
        anthropic_stream_events(blocks=[tool(0, parts=(), input={"command": "ls"})]),
        "input given in content_block_start",
    )
    assert check(anthropic_stream_events(blocks=[tool(0, parts=())])) == []  # no deltas: input {}


def test_error_event():
    events = anthropic_stream_events()
    error = sse_event("error", {"type": "error", "error": {"type": "overloaded_error", "message": "x"}})
    one(events[:4] + [error], "error event after content")


def test_incomplete_tail():
    data = b"".join(anthropic_stream_events())
    assert check_anthropic_stream(data) == []
    problems = check_anthropic_stream(data + b"event: ping\ndata: {")
    assert any("incomplete event" in p for p in problems), problems


@pytest.mark.parametrize("ok", [True, False])
def test_main(tmp_path, capsys, ok):
    path = tmp_path / "stream.sse"
    events = anthropic_stream_events()
    path.write_bytes(b"".join(events if ok else events[:-1]))
    assert main([str(path)]) == (0 if ok else 1)
    out = capsys.readouterr().out
    assert ("ok" in out) if ok else ("no message_stop" in out)


def test_main_usage_and_unreadable_file(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--help"])
    assert exit.value.code == 0
    assert "usage: python -m cg.stream.streamcheck" in capsys.readouterr().out
    assert main([str(tmp_path / "missing.sse")]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == f"python -m cg.stream.streamcheck: cannot read {tmp_path / 'missing.sse'}: No such file or directory\n"
    with pytest.raises(SystemExit) as exit:
        main([])
    assert exit.value.code == 2
    assert "usage:" in capsys.readouterr().err
