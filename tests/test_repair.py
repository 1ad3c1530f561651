"""Repair of the expand calls a client answered with an error: what is found, and which bytes change."""

import copy
import json

import pytest
from fixturedata import claude_code_body
from helpers.bodies import go_style, js_style, python_style, slash_style
from hypothesis import given, settings
from hypothesis import strategies as st

from cg.compaction.pipeline import CompactConfig, plan
from cg.compaction.repair import Repair, find_repairs, looks_like_error, repair_answer, repair_edits
from cg.stream.continuation import is_cg_answer
from cg.wire.body import ParsedBody
from cg.wire.dialect import CHAT_SHAPE, MESSAGES_SHAPE, Shape
from cg.wire.markers import marker_id

CLAUDE_CODE_ERROR = "<tool_use_error>Error: No such tool available: context_guru_expand</tool_use_error>"
EXPAND_ID = "toolu_fake172718ffed1148c695a1b7f5"
ORIGINAL = "FAILED tests/test_proxy.py::test_x - assert <Response 502> == café\n" * 3
REF = marker_id(ORIGINAL.encode())


def followup() -> dict:
    """Claude Code's answer to an expand call it could not run (the fixture)."""
    return claude_code_body("p_unknown_tool_followup")


def repaired(raw: bytes, dialect: Shape = MESSAGES_SHAPE, text: str = ORIGINAL) -> tuple[bytes, list[Repair], list]:
    body = ParsedBody.parse(raw)
    repairs = find_repairs(body, dialect)
    edits = repair_edits(body, repairs, {r.tool_use_id: text for r in repairs})
    return body.apply(edits), repairs, edits


def only_span_changed(before: bytes, after: bytes, span_start: int, span_end: int) -> bool:
    """Whether `after` is `before` with just the characters span_start..span_end replaced."""
    doc_before, doc_after = before.decode(), after.decode()
    grown = len(doc_after) - len(doc_before)
    return (doc_after[:span_start] == doc_before[:span_start]
            and doc_after[span_end + grown:] == doc_before[span_end:])


def batched_with_bash(style=js_style) -> tuple[dict, bytes]:
    """An expand call batched with a Bash call: Claude Code answers the error first, in the same message."""
    body = followup()
    body["messages"][2]["content"].append(
        {"type": "tool_use", "id": "toolu_bash", "name": "Bash", "input": {"command": "pytest"}})
    body["messages"][2]["content"][1]["input"] = {"id": f"<<cg:{REF}>>"}
    body["messages"][3]["content"].append(
        {"tool_use_id": "toolu_bash", "type": "tool_result", "content": "3 passed", "is_error": False})
    return body, style(body)


# ---------------------------------------------------------------------------------------------
# Claude Code


def test_claude_codes_no_such_tool_answer_is_repaired_and_nothing_else_changes():
    body = followup()
    raw = js_style(body)
    out, [repair], [(span, new)] = repaired(raw)
    assert repair == Repair(EXPAND_ID, "seg_0001", body["messages"][2]["content"][1]["input"], 3, 0)
    assert only_span_changed(raw, out, *span)
    assert raw.decode()[span[0]:span[1]] == js_style(body["messages"][3]["content"][0]).decode()
    got = json.loads(out)
    block = got["messages"][3]["content"][0]
    assert list(block.items()) == [("type", "tool_result"), ("content", ORIGINAL), ("tool_use_id", EXPAND_ID),
                                   ("cache_control", {"type": "ephemeral"})]
    expected = copy.deepcopy(body)
    expected["messages"][3]["content"][0] = block
    assert got == expected
    assert new == js_style(block).decode()  # the client's spelling: compact, raw non-ASCII, "<" raw


def test_an_expand_call_is_found_past_a_prefix_the_last_turn_did_not_name_it_in():
    """A turn parsed against the conversation's last body searches only past what they share when
    that body named no expand call; once one is named, the next turn searches it whole."""
    body = followup()
    expand_turn = body["messages"][2:4]
    del body["messages"][2:]
    first = ParsedBody.parse(js_style(body))
    assert find_repairs(first, MESSAGES_SHAPE) == []
    body["messages"] += [*expand_turn, {"role": "assistant", "content": [{"type": "text", "text": "ok"}]}]
    second = ParsedBody.parse(js_style(body), first.earlier())
    assert second.shared > 0 and [r.tool_use_id for r in find_repairs(second, MESSAGES_SHAPE)] == [EXPAND_ID]
    body["messages"].append({"role": "user", "content": [{"type": "text", "text": "go on"}]})
    third = ParsedBody.parse(js_style(body), second.earlier())  # the call is in the shared prefix now
    assert [r.tool_use_id for r in find_repairs(third, MESSAGES_SHAPE)] == [EXPAND_ID]


def test_a_repaired_body_repaired_again_is_unchanged():
    out, _, _ = repaired(js_style(followup()))
    again, repairs, edits = repaired(out)
    assert repairs == [] and edits == [] and again == out


def test_batched_with_bash_only_the_expand_answer_changes():
    body, raw = batched_with_bash()
    out, [repair], [(span, _)] = repaired(raw)
    assert (repair.ref, repair.message_index, repair.block_index) == (REF, 3, 0)
    assert only_span_changed(raw, out, *span)
    bash = js_style(body["messages"][3]["content"][1])
    assert out.count(bash) == raw.count(bash) == 1
    assert json.loads(out)["messages"][3]["content"][1] == body["messages"][3]["content"][1]


@pytest.mark.parametrize("result", [
    {"type": "tool_result", "tool_use_id": "toolu_bash", "content": "Error: exit 1", "is_error": True},
    {"type": "tool_result", "tool_use_id": "toolu_other", "content": "No such tool available: x", "is_error": True},
], ids=["bash-error", "unknown-id"])
def test_other_tool_results_are_never_touched(result):
    body, _ = batched_with_bash()
    body["messages"][3]["content"][1] = result
    body["messages"][3]["content"][0]["content"] = ORIGINAL  # the expand answer is not an error either
    body["messages"][3]["content"][0].pop("is_error")
    raw = js_style(body)
    assert find_repairs(ParsedBody.parse(raw), MESSAGES_SHAPE) == []


@pytest.mark.parametrize("content", [ORIGINAL * 100, "the original, 42 lines of build output", ""],
                         ids=["long", "plain", "empty-is-an-error"])
def test_an_answer_that_is_not_an_error_is_left_alone(content):
    body = followup()
    block = body["messages"][3]["content"][0]
    block["content"], block["is_error"] = content, False
    found = find_repairs(ParsedBody.parse(js_style(body)), MESSAGES_SHAPE)
    assert [r.tool_use_id for r in found] == ([EXPAND_ID] if content == "" else [])


def test_an_error_answer_without_the_flag_is_still_an_error():
    body = followup()
    body["messages"][3]["content"][0].pop("is_error")
    assert [r.tool_use_id for r in find_repairs(ParsedBody.parse(js_style(body)), MESSAGES_SHAPE)] == [EXPAND_ID]


def test_a_repair_with_no_text_is_left_out():
    body = ParsedBody.parse(js_style(followup()))
    assert repair_edits(body, find_repairs(body, MESSAGES_SHAPE), {}) == []


def test_a_cache_control_on_a_content_part_stays():
    body = followup()
    block = body["messages"][3]["content"][0]
    block.pop("cache_control")
    block["content"] = [{"type": "text", "text": CLAUDE_CODE_ERROR, "cache_control": {"type": "ephemeral"}}]
    raw = js_style(body)
    out, _, _ = repaired(raw)
    assert out.count(b'"cache_control"') == raw.count(b'"cache_control"')
    assert json.loads(out)["messages"][3]["content"][0]["content"] == [
        {"type": "text", "text": ORIGINAL, "cache_control": {"type": "ephemeral"}}]


@pytest.mark.parametrize("style", [js_style, python_style, go_style, slash_style],
                         ids=["js", "python", "go", "slashes"])
def test_the_repair_is_spelled_like_the_history_before_it(style):
    body, _ = batched_with_bash()
    body["messages"][0]["content"][0]["text"] += " café </a> & co"  # evidence of the client's escaping
    raw = style(body)
    out, _, [(span, new)] = repaired(raw)
    block = json.loads(out)["messages"][3]["content"][0]
    assert block["content"] == ORIGINAL
    if style is js_style:
        assert new == js_style(block).decode()
    elif style is go_style:
        assert new == go_style(block).decode()
    elif style is python_style:
        assert new.isascii() and "\\u00e9" in new
    else:
        assert "tests\\/test_proxy.py" in new


def test_the_same_text_gives_the_same_bytes_on_a_later_turn():
    """The style comes from the history before the block, which a later turn re-sends unchanged."""
    body, _ = batched_with_bash()
    raw = python_style(body)  # no non-ASCII anywhere yet: no evidence, so non-ASCII goes raw
    later = copy.deepcopy(body)
    later["messages"] += [{"role": "assistant", "content": [{"type": "text", "text": "Voilà."}]},
                          {"role": "user", "content": [{"type": "text", "text": "naïve café"}]}]
    later_raw = python_style(later)  # now the body shows \u00ef escapes, after the repaired block
    (_, _, [(_, first)]), (_, _, [(_, second)]) = repaired(raw), repaired(later_raw)
    assert first == second


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=80), style=st.sampled_from([js_style, python_style, go_style, slash_style]))
def test_property_repair_is_deterministic_local_and_idempotent(text, style):
    body, _ = batched_with_bash()
    raw = style(body)
    out, _, [(span, _)] = repaired(raw, text=text)
    assert only_span_changed(raw, out, *span)
    assert json.loads(out)["messages"][3]["content"][0]["content"] == text
    assert repaired(raw, text=text)[0] == out
    # Repaired again with the frozen text: unchanged, whether or not the text reads like an error.
    assert repaired(out, text=text)[0] == out


def test_repair_edits_combine_with_compaction_edits():
    body, _ = batched_with_bash()
    log = "".join(f"PASSED tests/unit/test_{n}.py::test_{n} [{n % 100:3d}%]\n" for n in range(3000))
    body["messages"][3]["content"][1]["content"] = log
    parsed = ParsedBody.parse(js_style(body))
    repairs = find_repairs(parsed, MESSAGES_SHAPE)
    compaction = plan(parsed, MESSAGES_SHAPE, CompactConfig(), lossy=True)
    assert compaction.edits and compaction.originals
    out = json.loads(parsed.apply(compaction.edits + repair_edits(parsed, repairs, {EXPAND_ID: ORIGINAL})))
    assert out["messages"][3]["content"][0]["content"] == ORIGINAL
    assert "<<cg:" in out["messages"][3]["content"][1]["content"]


# ---------------------------------------------------------------------------------------------
# What the repair says


def test_repair_answers():
    call = {"id": f"<<cg:{REF}>>"}
    assert repair_answer(Repair("t", REF, call, 3, 0), ORIGINAL.encode()).text == ORIGINAL
    evicted = repair_answer(Repair("t", REF, call, 3, 0), None)
    assert evicted.kind == "evicted" and "no longer stored; do not retry" in evicted.text
    assert repair_answer(Repair("t", "seg_0001", {"id": "seg_0001"}, 3, 0), None).kind == "unknown"
    assert repair_answer(Repair("t", None, {"di": 1}, 3, 0), ORIGINAL.encode()).kind == "malformed"


@pytest.mark.parametrize("text, is_error, expected", [
    (CLAUDE_CODE_ERROR, True, True),
    ("anything at all", True, True),
    ("Error: context_guru_expand is not a valid tool, try one of [shell].", None, True),  # LangChain
    ("Tool context_guru_expand not found", None, True),
    ("unknown tool: context_guru_expand", False, True),
    ("unsupported call: context_guru_expand", None, True),  # Codex CLI
    ("Model tried to call unavailable tool 'context_guru_expand'. Available tools: bash, edit.", None,
     True),  # the Vercel AI SDK (OpenCode)
    ("Unknown tool name: 'context_guru_expand'. Available tools: 'greet'", None, True),  # Pydantic AI
    ("", None, True),
    ("  \n", None, True),
    ("3 passed in 0.2s", None, False),
    ("Error: " + "x" * 3000, None, False),  # far longer than an error: an original
    ("the original for <<cg:0123456789abcdef>> is no longer stored; do not retry; re-run the command "
     "that produced it", None, False),  # cg's own final answer
])
def test_looks_like_error(text, is_error, expected):
    assert looks_like_error(text, is_error) is expected


# ---------------------------------------------------------------------------------------------
# OpenAI


def openai_body(answer) -> dict:
    return {
        "model": "gpt-4.1",
        "messages": [
            {"role": "user", "content": "why did it fail?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_x", "type": "function", "function": {"name": "context_guru_expand",
                                                                   "arguments": json.dumps({"id": REF})}},
                {"id": "call_sh", "type": "function", "function": {"name": "shell", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_x", "content": answer},
            {"role": "tool", "tool_call_id": "call_sh", "content": "Error: exit status 1"},
            {"role": "user", "content": "and?"},
        ],
        "tools": [{"type": "function", "function": {"name": "shell", "parameters": {}}}],
    }


@pytest.mark.parametrize("answer", [
    "Error: context_guru_expand is not a valid tool, try one of [shell].",
    [{"type": "text", "text": "Tool not found: context_guru_expand"}],
])
@pytest.mark.parametrize("style", [python_style, js_style], ids=["python", "js"])
def test_openai_error_answer_is_repaired(answer, style):
    body = openai_body(answer)
    raw = style(body)
    out, [repair], [(span, new)] = repaired(raw, CHAT_SHAPE)
    assert (repair.tool_use_id, repair.ref, repair.message_index, repair.block_index) == ("call_x", REF, 2, None)
    assert only_span_changed(raw, out, *span)
    expected = copy.deepcopy(body)
    expected["messages"][2]["content"] = ORIGINAL
    assert json.loads(out) == expected  # the shell error answer is not touched
    assert repaired(out, CHAT_SHAPE)[1] == []


def test_openai_answers_that_are_cgs_own_are_left_alone():
    final = repair_answer(Repair("call_x", "seg_0001", {"id": "seg_0001"}, 2, None), None).text
    assert is_cg_answer(final) and not looks_like_error(ORIGINAL)
    for answer in [ORIGINAL, final]:
        assert find_repairs(ParsedBody.parse(js_style(openai_body(answer))), CHAT_SHAPE) == []
