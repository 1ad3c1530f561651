"""cg.stream.hidden: a spliced response's hidden turns, recorded as shown and put back in place.

Pure: an Anthropic stream through the Inspector (what the client is shown), the Messages loop's
hidden turn and merge view (JSON), and the edits that put the turns back into a later request.
"""

import json

import attrs
from helpers.streams import feed_round

from cg.stream.continuation import MESSAGES_LOOP, ClientStyle, ExpandCall
from cg.stream.hidden import MISSING, HiddenTurn, Seen, Shown, anchors, parse, record, record_key, restore
from cg.stream.inspector import EXPAND, Inspector
from cg.testing import (
    anthropic_block_start,
    anthropic_expand_block,
    anthropic_stream_events,
    anthropic_text_block,
    anthropic_thinking_block,
)
from cg.wire.body import ParsedBody
from cg.wire.markers import EXPAND_TOOL

REF = "0123456789abcdef"
THOUGHT = {"type": "thinking", "thinking": "First.", "signature": "sig-round-1"}
LATER = {"type": "thinking", "thinking": "Then.", "signature": "sig-round-2"}


def expand_use(call_id: str) -> dict:
    return {"type": "tool_use", "id": call_id, "name": EXPAND_TOOL, "input": {"id": REF}}


def turn(call_id: str) -> HiddenTurn:
    answers = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id, "content": "LOG"}]}
    return HiddenTurn(json.dumps(expand_use(call_id), separators=(",", ":")), json.dumps(answers, separators=(",", ":")))


def request(*content: dict, role_first: bool = True) -> bytes:
    message = {"role": "assistant", "content": list(content)}
    if not role_first:
        message = {"content": list(content), "role": "assistant"}
    body = {"model": "m", "messages": [{"role": "user", "content": "Go."}, message,
                                       {"role": "user", "content": "Fix it."}]}
    return json.dumps(body, separators=(",", ":")).encode()


def put_back(raw: bytes, text: bytes) -> bytes:
    body = ParsedBody.parse(raw)
    assert body is not None
    [(message, found)] = [(i, found) for i, found in enumerate(body.per_message("t", "messages", anchors)) if found]
    [edits] = [restore(body, message, block, parse(text)) for block, key in found if key == record_key(LATER["signature"])]
    return body.apply(edits)


def test_a_continuations_thinking_gets_its_hidden_turn_back_before_it():
    text = "Line 450."
    shown = Shown(("thinking", "text", "thinking", "text"), (2,), (2, LATER["signature"]))
    key, kept = record(shown, [turn("toolu_x")])
    assert key == record_key(LATER["signature"])
    out = json.loads(put_back(request(THOUGHT, {"type": "text", "text": "Looking."}, LATER,
                                      {"type": "text", "text": text}), kept))
    assert out["messages"][1:] == [
        {"role": "assistant", "content": [THOUGHT, {"type": "text", "text": "Looking."}, expand_use("toolu_x")]},
        json.loads(turn("toolu_x").answers),
        {"role": "assistant", "content": [LATER, {"type": "text", "text": text}]},
        {"role": "user", "content": "Fix it."},
    ]


def test_rounds_the_client_saw_nothing_of_keep_their_turns_in_order():
    """Round 1 (only the call) and round 2 (only a call) showed nothing: both turns go before round 3's thinking."""
    shown = Shown(("thinking", "text"), (0, 0), (0, LATER["signature"]))
    _, kept = record(shown, [turn("toolu_1"), turn("toolu_2")])
    out = json.loads(put_back(request(LATER, {"type": "text", "text": "Done."}), kept))
    assert [(m["role"], [b.get("id") or b.get("type") for b in m["content"]] if isinstance(m["content"], list)
             else m["content"]) for m in out["messages"]] == [
        ("user", "Go."), ("assistant", ["toolu_1"]), ("user", ["tool_result"]), ("assistant", ["toolu_2"]),
        ("user", ["tool_result"]), ("assistant", ["thinking", "text"]), ("user", "Fix it.")]


def blank_turn(call_id: str) -> HiddenTurn:
    """A round that showed a thinking block and a whitespace-only text block, then called expand."""
    return attrs.evolve(turn(call_id), blanks=((1, '{"type":"text","text":"\\n\\n"}'),))


def test_a_blank_text_block_the_client_dropped_goes_back_where_it_was():
    """Claude Code drops a whitespace-only text block from the turn it sends back; it was in the
    continuation's request, so in the prefix of the thinking after it."""
    shown = Shown(("thinking", "text", "thinking", "text"), (2,), (2, LATER["signature"]))
    _, kept = record(shown, [blank_turn("toolu_x")])
    out = json.loads(put_back(request(THOUGHT, LATER, {"type": "text", "text": "t"}), kept))
    assert out["messages"][1:3] == [
        {"role": "assistant", "content": [THOUGHT, {"type": "text", "text": "\n\n"}, expand_use("toolu_x")]},
        json.loads(turn("toolu_x").answers)]
    assert out["messages"][3] == {"role": "assistant", "content": [LATER, {"type": "text", "text": "t"}]}
    kept_blank = json.loads(put_back(request(THOUGHT, {"type": "text", "text": "\n\n"}, LATER,
                                             {"type": "text", "text": "t"}), kept))
    assert kept_blank == out  # a client that keeps it: the same request


def test_a_round_after_the_last_shown_block_has_nothing_to_precede():
    shown = Shown(("text", "thinking"), (1, 2), (1, LATER["signature"]))
    _, kept = record(shown, [turn("toolu_1"), turn("toolu_2")])
    out = json.loads(put_back(request({"type": "text", "text": "a"}, LATER), kept))
    assert [m["role"] for m in out["messages"]] == ["user", "assistant", "user", "assistant", "user"]
    assert out["messages"][3]["content"] == [LATER]


def test_no_record_without_a_continuations_thinking_or_with_a_turn_that_cannot_go_back():
    assert record(Shown(("text", "text"), (1,), None), [turn("toolu_1")]) is None
    assert record(Shown(("text", "thinking"), (1,), (1, "s")), [None]) is None


def test_a_message_that_is_not_the_recorded_one_is_left_as_the_client_sent_it():
    shown = Shown(("thinking", "text", "thinking", "text"), (2,), (2, LATER["signature"]))
    _, kept = record(shown, [turn("toolu_x")])
    for raw in (request({"type": "text", "text": "Looking."}, LATER, {"type": "text", "text": "t"}),  # a block gone
                request(THOUGHT, {"type": "tool_use", "id": "t", "name": "Bash", "input": {}}, LATER,
                        {"type": "text", "text": "t"}),  # another block
                request(THOUGHT, {"type": "text", "text": "a"}, LATER, {"type": "text", "text": "t"},
                        role_first=False)):  # the role after the content: the turn cannot be cut
        body = ParsedBody.parse(raw)
        found = body.per_message("t", "messages", anchors)[1]
        assert [restore(body, 1, block, parse(kept)) for block, key in found
                if key == record_key(LATER["signature"])] == [[]]
    assert parse(b"not a record") is None and parse(b'{"types":[]}') is None


def test_the_hidden_turn_is_the_bytes_the_continuation_appended():
    forwarded = request(THOUGHT).replace(b'"Go."', b'"G\\/o."')  # a client that escapes "/" (PHP)
    blank = {"type": "text", "text": " \n"}
    assistant = {"role": "assistant", "content": [THOUGHT, {"type": "text", "text": "é</"}, blank,
                                                  expand_use("toolu_x")]}
    calls = MESSAGES_LOOP.lone_expand_calls(dict(assistant, stop_reason="tool_use"))
    resolutions = {REF: "the original ü".encode()}
    body, hidden = MESSAGES_LOOP.continuation(forwarded, assistant, calls, resolutions)
    assert body == MESSAGES_LOOP.continuation_body(forwarded, assistant, calls, resolutions)
    style = ClientStyle(forwarded.decode("latin-1"))
    appended = body[len(forwarded) - 2:-2].decode()  # after the history's last message, before "]}"
    assert "\\/" in hidden.answers or "/" not in hidden.answers
    assert appended == "," + ",".join([style.dumps(dict(assistant, content=assistant["content"][:3]))[:-2] + ","
                                 + hidden.calls + "]}", hidden.answers])
    assert hidden.blanks == ((2, style.dumps(blank)),) and style.dumps(blank).encode() in body


def test_an_expand_call_before_a_shown_block_cannot_go_back():
    assistant = {"role": "assistant", "content": [expand_use("toolu_x"), {"type": "text", "text": "after"}]}
    calls = [ExpandCall("toolu_x", {"id": REF}, REF)]
    assert MESSAGES_LOOP.continuation(request(THOUGHT), assistant, calls, {REF: b"x"})[1] is None


def test_the_merged_json_and_the_stream_show_the_same():
    expand = expand_use("toolu_expand_2")
    rounds = [{"content": [THOUGHT, {"type": "text", "text": "a"}, expand]},
              {"content": [{"type": "redacted_thinking", "data": "opaque"}, {"type": "text", "text": "b"}]}]
    merged = MESSAGES_LOOP.shown(rounds)
    assert merged == Shown(("thinking", "text", "redacted_thinking", "text"), (2,), (2, "opaque"))
    inspector = Inspector()
    first = anthropic_stream_events(stop_reason="tool_use", blocks=[
        anthropic_thinking_block(0, THOUGHT["thinking"], THOUGHT["signature"]), anthropic_text_block(1, ["a"]),
        anthropic_expand_block(2, ref=REF)])
    assert feed_round(inspector, [b"".join(first)])[1] == EXPAND
    inspector.begin_continuation()
    second = anthropic_stream_events(blocks=[
        [anthropic_block_start(0, {"type": "redacted_thinking", "data": "opaque"})], anthropic_text_block(1, ["b"])])
    feed_round(inspector, [b"".join(second)])
    assert inspector.shown() == merged


def test_a_streamed_thinking_block_is_named_by_its_signature_delta():
    inspector = Inspector()
    first = anthropic_stream_events(stop_reason="tool_use", blocks=[anthropic_expand_block(0, ref=REF)])
    assert feed_round(inspector, [b"".join(first)])[1] == EXPAND
    inspector.begin_continuation()
    second = anthropic_stream_events(blocks=[anthropic_text_block(0, ["x"]),
                                             anthropic_thinking_block(1, "Then.", "sig-late")])
    feed_round(inspector, [b"".join(second)])
    assert inspector.shown() == Shown(("text", "thinking"), (0,), (1, "sig-late"))


def test_seen_keeps_a_bounded_number_of_nones_and_size_of_records():
    seen = Seen(limit=2, max_bytes=10)
    assert seen.get("t", "a") is MISSING
    seen.put("t", "a", None)
    seen.put("t", "b", None)
    seen.put("t", "c", None)  # the oldest "none" goes
    assert seen.get("t", "a") is MISSING and seen.get("t", "b") is None and seen.get("t", "c") is None
    _, text = record(Shown(("text", "thinking"), (1,), (1, "sig")), [turn("toolu_x")])
    seen = Seen(limit=2, max_bytes=len(text) * 3 // 2)
    first = seen.put("t", "r1", text)
    assert first == parse(text) and seen.get("t", "r1") is first  # parsed once, when put
    seen.put("t", "r2", text)  # past max_bytes: the least recently used record goes
    assert seen.get("t", "r1") is MISSING and seen.get("t", "r2") == parse(text)
    seen.put("t", "r2", None)  # a record replaced (by a purge read back) is no longer counted
    seen.put("t", "r3", text)
    assert seen.get("t", "r3") == parse(text) and seen.get("t", "r2") is None
    assert seen.put("t", "r4", b"not a record") is None and seen.get("t", "r4") is None
