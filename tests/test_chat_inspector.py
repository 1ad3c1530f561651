"""ChatInspector, pure: chat.completion.chunk streams fed event by event, no reactor.

One test per row of the state table in cg/stream/chat_inspector.py, the splice checked with the
official openai SDK's stream accumulator (``chat.completions.stream()`` over a mock transport), and
the chunk-boundary property: however the upstream bytes are cut, the client gets the same bytes.
"""

from __future__ import annotations

import pytest
from helpers.replies import HEAD, LATER, REF, chunk, expanding, frag, opening_call, start, turn
from helpers.streams import cutting, docs, feed_round, run_rounds, sdk_completion
from hypothesis import given, settings
from hypothesis import strategies as st

from cg.stream.chat_inspector import ChatInspector
from cg.stream.continuation import ExpandCall
from cg.stream.inspector import ABORT, DONE, EXPAND, State
from cg.testing import sse_event
from cg.wire.markers import EXPAND_TOOL
from cg.wire.sse import SSEParser

ARGS = '{"id":"' + REF + '"}'


ROUND1 = turn({"content": "Let me "}, {"content": "look."}, *expanding(), finish="tool_calls")
ROUND2 = turn({"content": "Line 450."}, finish="stop", head=LATER, prompt=9999, completion=5)


def run(rounds: list[list[bytes]], chunker=None, **kw) -> tuple[bytes, object, ChatInspector]:
    insp = ChatInspector(**kw)
    return (*run_rounds(insp, rounds, chunker), insp)


# ---------------------------------------------------------------------------------------------
# WATCH


def test_a_turn_without_expand_is_forwarded_chunk_by_chunk():
    events = turn({"content": "Hi"}, finish="stop")
    insp = ChatInspector()
    parser = SSEParser()
    for raw in events:
        [event] = parser.feed(raw)
        step = insp.feed(event)
        assert step.send == raw  # at once, byte for byte
    assert insp.end(True).action == DONE and insp.released is None


def test_a_client_call_first_lets_a_later_expand_call_through():
    events = turn(start(0, "call_c", "shell", "{}"), *expanding(1), finish="tool_calls")
    data, action, insp = run([events])
    assert data == b"".join(events) and action == DONE
    assert insp.held_events == 0 and insp.state is State.DONE


def test_an_expand_start_mixed_with_text_is_not_held():
    """A mixed chunk is never split: its call goes to the client (repaired next turn)."""
    events = turn({**start(0, "call_x", args=ARGS), "content": "look"}, finish="tool_calls")
    data, action, insp = run([events])
    assert data == b"".join(events) and action == DONE and insp.held_events == 0


def test_several_choices_pass_through_uninspected():
    many = sse_event(None, {**HEAD, "choices": [{"index": 1, "delta": {"content": "b"}, "finish_reason": None}]})
    events = turn({"content": "a"}, finish="tool_calls")
    events[1:1] = [many]
    events[3:3] = [chunk(d) for d in expanding()]
    data, action, insp = run([events])
    assert data == b"".join(events) and insp.held_events == 0


# ---------------------------------------------------------------------------------------------
# HOLD and the splice


def test_a_lone_expand_call_is_held_and_decided_at_done():
    insp = ChatInspector()
    sent, action = feed_round(insp, [b"".join(ROUND1)])
    assert sent == b"".join(ROUND1[:3]) and action == EXPAND  # role and text went out at once
    assert insp.calls == [ExpandCall("call_x", ARGS, REF)]
    assert insp.assistant_message() == {"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": "call_x", "type": "function", "function": {"name": EXPAND_TOOL, "arguments": ARGS}}]}



def test_the_rounds_reasoning_content_goes_back_with_the_call():
    """An OpenAI-compatible thinking server (DeepSeek, Kimi) answers 400 to a tool-call turn sent
    back without its reasoning_content; a round without any sends none."""
    thinking = {"content": None, "reasoning_content": "The log "}
    events = turn(thinking, {**thinking, "reasoning_content": "matters."}, *expanding(), finish="tool_calls")
    insp = ChatInspector()
    _, action = feed_round(insp, [b"".join(events)])
    assert action == EXPAND
    assert insp.assistant_message() == {"role": "assistant", "content": None, "reasoning_content": "The log matters.",
                                        "tool_calls": [{"id": "call_x", "type": "function",
                                                        "function": {"name": EXPAND_TOOL, "arguments": ARGS}}]}


def test_openrouters_empty_reasoning_fields_still_hold_the_call_and_its_details_go_back_merged():
    """OpenRouter writes `"reasoning":null,"reasoning_details":[]` in every delta: the call's
    chunks are still pure. A detail streamed in fragments (its text, then its signature) goes back
    as one entry per index, as the JSON message has it."""
    quiet = {"content": "", "reasoning": None, "reasoning_details": []}
    detail = {"type": "reasoning.text", "format": "anthropic-claude-v1", "index": 0}
    events = turn({**quiet, "reasoning": "I should ", "reasoning_details": [{**detail, "text": "I should ", "signature": ""}]},
                  {**quiet, "reasoning": "look.", "reasoning_details": [{**detail, "text": "look."}]},
                  {**quiet, "reasoning_details": [{**detail, "signature": "EqQBsig=="}]},
                  *({**quiet, **delta} for delta in expanding()), finish="tool_calls")
    insp = ChatInspector()
    _, action = feed_round(insp, [b"".join(events)])
    assert action == EXPAND
    message = insp.assistant_message()
    assert message["reasoning"] == "I should look."
    assert message["reasoning_details"] == [{**detail, "text": "I should look.", "signature": "EqQBsig=="}]

def test_an_expand_call_opening_the_turn_is_held_and_the_client_gets_one_role():
    data, action, insp = run([opening_call(), ROUND2])
    assert action == DONE and insp.calls == [ExpandCall("call_x", ARGS, REF)]
    assert sum("role" in c["choices"][0]["delta"] for c in docs(data) if c["choices"]) == 1
    completion = sdk_completion(data)
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[0].message.content == "Line 450." and completion.id == HEAD["id"]


def test_an_opening_expand_call_released_keeps_its_role():
    events = opening_call()
    events[2] = chunk({}, "length")
    data, action, insp = run([events])
    assert data == b"".join(events) and insp.released == "stop_reason"


def test_the_splice_reads_as_one_completion():
    data, action, insp = run([ROUND1, ROUND2])
    assert action == DONE and insp.spliced and insp.rounds == 1
    completion = sdk_completion(data)
    assert (completion.id, completion.created, completion.model) == tuple(HEAD.values())
    message = completion.choices[0].message
    assert message.content == "Let me look.Line 450." and message.tool_calls is None
    assert completion.choices[0].finish_reason == "stop"
    usage = completion.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (100, 12, 112)
    chunks = docs(data)
    assert sum("role" in c["choices"][0]["delta"] for c in chunks if c["choices"]) == 1
    assert sum(c["choices"][0]["finish_reason"] is not None for c in chunks if c["choices"]) == 1
    assert sum(c["choices"] == [] for c in chunks) == 1 and data.count(b"data: [DONE]") == 1
    assert [u.output_tokens for u in insp.billed] == [7, 5]


def test_a_continuation_calling_a_client_tool_keeps_dense_indices():
    """Round 1's expand calls never reached the client: the continuation's call is its first, index 0."""
    round2 = turn(start(0, "call_c", "shell", '{"cmd":"ls"}'), finish="tool_calls", head=LATER)
    round1 = turn(*expanding(0, "call_x"), *expanding(1, "call_y"), finish="tool_calls")
    data, action, insp = run([round1, round2])
    assert [c.id for c in insp.calls] == ["call_x", "call_y"]
    [call] = sdk_completion(data).choices[0].message.tool_calls
    assert (call.id, call.function.name, call.function.arguments) == ("call_c", "shell", '{"cmd":"ls"}')
    assert [tc["index"] for c in docs(data) if c["choices"] for tc in c["choices"][0]["delta"].get("tool_calls", ())] == [0]


@pytest.mark.parametrize(("after", "reason"), [
    (start(1, "call_c", "shell", "{}"), "client_tool"),
    ({"content": "and text"}, "other_block"),
    (frag(5, "{}"), "other_block"),
])
def test_anything_but_expand_material_releases_verbatim(after, reason):
    events = turn(*expanding(), after, finish="tool_calls")
    data, action, insp = run([events])
    assert data == b"".join(events) and action == DONE and insp.released == reason


@pytest.mark.parametrize(("events", "reason"), [
    (turn(*expanding(), finish="length"), "stop_reason"),
    (turn(*expanding(), finish="content_filter"), "stop_reason"),
    (turn(start(0, "call_x"), frag(0, '{"id": 7}'), finish="tool_calls"), "bad_input"),
    (turn(start(0, "call_x"), frag(0, '{"id": "a'), finish="tool_calls"), "bad_input"),
    ([chunk(d) for d in expanding()] + [sse_event(None, {"error": {"message": "overloaded"}})], "error"),
])
def test_a_turn_cg_cannot_answer_is_released_verbatim(events, reason):
    data, action, insp = run([events])
    assert data == b"".join(events) and action == DONE and insp.released == reason


@pytest.mark.parametrize("events", [
    turn(*expanding(), finish="tool_calls")[:-1],  # decided, but no [DONE]
    turn({"content": "Hi"}, finish="stop")[:-1],
])
def test_a_stream_without_done_never_looks_complete(events):
    data, action, _ = run([events])
    assert data == b"".join(events) and action == ABORT


def test_past_max_held_the_hold_is_released():
    data, action, insp = run([ROUND1], max_held=len(ROUND1[3]) + 1)
    assert data == b"".join(ROUND1) and insp.released == "max_held"


def test_a_comment_while_holding_is_held_with_the_rest():
    round1 = [*ROUND1[:4], b": keep-alive\r\n\r\n", *ROUND1[4:]]
    data, action, insp = run([round1, ROUND2])
    assert b"keep-alive" not in data and action == DONE


# ---------------------------------------------------------------------------------------------
# Failures and usage


def test_a_failed_continuation_gives_round_one_verbatim():
    data, action, insp = run([ROUND1])  # no continuation: the caller releases
    assert data == b"".join(ROUND1) and insp.released == "continuation_failed"


def test_a_continuation_that_errs_before_committing_gives_round_one_verbatim():
    data, action, insp = run([ROUND1, [sse_event(None, {"error": {"message": "overloaded"}})]])
    assert data == b"".join(ROUND1) and action == DONE and insp.released == "continuation_failed"


def test_a_continuations_role_chunk_does_not_commit_it():
    """OpenAI's role chunk comes before the model writes: a continuation that stalls after it can still fail."""
    insp = ChatInspector()
    feed_round(insp, [b"".join(ROUND1)])
    insp.begin_continuation()
    [role] = SSEParser().feed(ROUND2[0])
    assert insp.feed(role).send == b"" and not insp.committed
    assert insp.release() == b"".join(ROUND1[3:]) and insp.released == "continuation_failed"


def test_a_continuation_cut_after_committing_aborts():
    data, action, _ = run([ROUND1, ROUND2[:2]])
    assert action == ABORT and b"Line 450." in data


def test_usage_cg_asked_for_is_not_shown():
    plain = turn({"content": "Hi"}, finish="stop")
    data, _, _ = run([plain], hide_usage=True)
    assert data == b"".join(plain[:3] + plain[4:])
    data, action, _ = run([ROUND1, ROUND2], hide_usage=True)
    assert action == DONE and not any(c["choices"] == [] for c in docs(data))
    assert sdk_completion(data).usage is None


def test_a_continuations_usage_stands_alone_when_round_one_had_none():
    round1 = ROUND1[:-2] + ROUND1[-1:]  # no usage chunk
    data, _, insp = run([round1, ROUND2])
    [usage] = [c["usage"] for c in docs(data) if c["choices"] == []]
    assert usage == {"prompt_tokens": 9999, "completion_tokens": 5, "total_tokens": 10004}


# ---------------------------------------------------------------------------------------------
# Chunk boundaries


SCENARIOS = {
    "spliced": [ROUND1, ROUND2],
    "opening call": [opening_call(), turn({"content": "Let me look.Line 450."}, finish="stop", head=LATER)],
    "spliced twice": [ROUND1, turn(*expanding(0, "call_z"), finish="tool_calls", head=LATER), ROUND2],
    "released": [turn(*expanding(), start(1, "call_c", "shell", "{}"), finish="tool_calls")],
    "bad input": [turn(start(0, "call_x"), frag(0, '{"id": "a'), finish="tool_calls")],
}


@settings(max_examples=60, deadline=None)
@given(data=st.data(), name=st.sampled_from(sorted(SCENARIOS)), crlf=st.booleans())
def test_rechunking_gives_the_same_client_bytes(data, name, crlf):
    rounds = [[e.replace(b"\n", b"\r\n") for e in r] if crlf else r for r in SCENARIOS[name]]
    expected, action, _ = run(rounds)

    chunker = cutting(data)

    got, got_action, _ = run(rounds, chunker=chunker)
    assert got == expected and got_action == action == DONE
    if name.startswith("spliced") or name == "opening call":
        assert sdk_completion(got).choices[0].message.content == "Let me look.Line 450."
    else:
        assert got == b"".join(rounds[0])
