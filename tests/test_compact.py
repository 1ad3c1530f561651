"""The compaction pipeline: what it touches, what it must leave byte for byte, and its contract."""

import copy
import hashlib
import itertools
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
from fixturedata import CLAUDE_CODE, claude_code_body
from helpers.bodies import go_style, js_style, python_style, slash_style, tool_turn
from hypothesis import given, settings
from hypothesis import strategies as st

from cg.compaction.components import DEFAULT_COMPONENTS, Dedup, Offload, Outcome
from cg.compaction.pipeline import CompactConfig, Memo, compact, plan
from cg.wire.body import ParsedBody
from cg.wire.dialect import MESSAGES_SHAPE, SHAPES
from cg.wire.markers import body_has_marker, marker, marker_id

FIXTURE_NAMES = sorted(path.stem for path in CLAUDE_CODE.glob("*.json"))
CONFIG = CompactConfig()


def test_the_claude_code_fixtures_are_there():
    assert "p_second_request_tool_result" in FIXTURE_NAMES and len(FIXTURE_NAMES) >= 8



# How clients serialize: Claude Code (JSON.stringify), the Python SDKs, Go, PHP.
STYLES = {"js": js_style, "python": python_style, "go": go_style, "slashes": slash_style}


def bash_output(lines: int = 2500, seed: int = 0) -> str:
    """A coloured test run: paths, non-ASCII, "<", and a few failures in the middle."""
    rnd = random.Random(seed)
    out = []
    for number in range(lines):
        if number % 300 == 150:
            out.append(f"\x1b[31mFAILED\x1b[0m tests/test_proxy.py::test_{number} - assert <Response 502> == café")
        else:
            name = rnd.choice(["proxy", "store", "markers", "stats"])
            percent = number * 100 // lines
            out.append(f"\x1b[32mPASSED\x1b[0m tests/unit/test_{name}.py::test_{number} [{percent:3d}%]")
    return "\n".join(out) + "\n"


def plant(body: dict, text: str) -> dict:
    """The body with `text` as the output of a Bash call: its own Bash call's if it has one, else a new turn."""
    body = copy.deepcopy(body)
    blocks = [block for message in body["messages"] if isinstance(message["content"], list)
              for block in message["content"]]
    bash_ids = {block["id"] for block in blocks if block.get("type") == "tool_use" and block["name"] == "Bash"}
    for block in blocks:
        if block.get("type") == "tool_result" and block["tool_use_id"] in bash_ids:
            block["content"] = text
            return body
    body["messages"] += tool_turn("toolu_planted", "Bash", text)
    return body


def result_texts(body: bytes) -> list:
    """Every tool_result content of an Anthropic body, in order."""
    return [block["content"] for message in json.loads(body)["messages"] if isinstance(message["content"], list)
            for block in message["content"] if block.get("type") == "tool_result"]


def where(compaction) -> list[tuple]:
    """Where each change happened, by whom: (message, block, part, tool, component)."""
    return [(c.message_index, c.block_index, c.part_index, c.tool_name, c.component) for c in compaction.changes]


def run(body: bytes, **kwargs):
    kwargs.setdefault("config", CONFIG)
    kwargs.setdefault("lossy", True)
    return compact(body, SHAPES[kwargs.pop("dialect", "anthropic")], **kwargs)


# Byte fidelity

@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_only_the_changed_string_changes(name, style):
    output = bash_output()
    body = plant(claude_code_body(name), output)
    before = STYLES[style](body)
    literal = STYLES[style](output)
    assert before.count(literal) == 1
    head, tail = before.split(literal)

    compaction = run(before)

    assert compaction.changed
    after = compaction.body
    assert after.startswith(head) and after.endswith(tail)
    new_literal = after[len(head):len(after) - len(tail)]
    new_text = json.loads(new_literal)
    assert marker(marker_id(output.encode())) in new_text
    expected = json.loads(STYLES[style](plant(claude_code_body(name), new_text)))
    assert json.loads(after) == expected
    assert list(json.loads(after)) == list(body)  # key order too
    # The new string is spelled the way the client spells strings.
    assert (b"\\u00e9" in new_literal) == (style in ("python", "slashes"))
    assert (b"\\/" in new_literal) == (style == "slashes")
    assert (b"\\u003c\\u003ccg:" in new_literal) == (style == "go")


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_nothing_to_do_returns_the_very_same_bytes(name):
    raw = js_style(claude_code_body(name))
    compaction = run(raw)
    assert compaction.body is raw
    assert (compaction.changed, compaction.originals, compaction.changes) == (False, {}, [])


def planted() -> bytes:
    return js_style(plant(claude_code_body("p_second_request_tool_result"), bash_output()))


@pytest.mark.parametrize("raw", [
    planted() + b" trailing", planted()[:-1], planted().replace(b'"model":"', b'"model":"\xff'),
    b"", b"not json", b"[]", b"null", b'{"messages": {}}', b'{"messages": "x"}',
    b'{"messages": [1, "x", null, [], {"role": "user", "content": [{"type": "tool_result", "content": 5}]}]}',
    b'{"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": ["x"], "content": []}]}]}',
    b'{"messages": []} trailing', b'{"messages": [', b'\xff\xfe{"messages": []}',
    b'{"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "\xc3"}]}]}',
])
def test_anything_unexpected_is_no_change(raw):
    assert run(raw).body is raw


message_shapes = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5)
    | st.sampled_from(["user", "assistant", "tool", "tool_result", "tool_use", "text", "content", "t1"]),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(
        st.sampled_from(["role", "content", "type", "text", "id", "name", "tool_use_id", "tool_call_id",
                         "tool_calls", "function"]), children, max_size=5),
    max_leaves=25,
)


@given(messages=st.lists(message_shapes, max_size=5), dialect=st.sampled_from(["anthropic", "openai"]),
       lossy=st.booleans())
@settings(max_examples=300)
def test_never_raises_on_odd_shapes(messages, dialect, lossy):
    raw = json.dumps({"messages": messages}).encode()
    compaction = compact(raw, SHAPES[dialect], CONFIG, lossy)
    if not compaction.changed:
        assert compaction.body is raw


# What is touched

def noisy(text="x"):
    """Text that every component would shrink: colours, pretty JSON, thousands of lines."""
    pretty_json = json.dumps({"k": list(range(5))}, indent=2)
    return f"\x1b[1m{text}\x1b[0m\n{pretty_json}\n{bash_output(seed=9)}"


def test_only_tool_results_are_touched():
    body = claude_code_body("p_second_request_after_thinking")
    body["system"].append({"type": "text", "text": noisy("system")})
    body["tools"][0]["description"] = noisy("tool")
    assistant = body["messages"][2]["content"]
    assistant[0]["thinking"] = noisy("thinking")
    assistant[1]["text"] = noisy("assistant")
    body["messages"][0]["content"][0]["text"] = noisy("user text")
    body["messages"][1]["content"] = noisy("mid-conversation system")
    body["messages"][3]["content"][0]["content"] = [
        {"type": "text", "text": noisy("result")},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": noisy("image")}},
    ]
    body["metadata"]["user_id"] = noisy("metadata")
    # Shapes the API would refuse: a result in an assistant message, a tool_use in a user message.
    assistant.append({"type": "tool_result", "tool_use_id": assistant[2]["id"], "content": noisy("misplaced")})
    fake_use = {"type": "tool_use", "id": assistant[2]["id"], "name": "Read", "input": {}}
    body["messages"][3]["content"].insert(0, fake_use)
    raw = js_style(body)

    compaction = run(raw)

    after = json.loads(compaction.body)
    result_part = after["messages"][3]["content"][1]["content"][0]["text"]
    assert marker(marker_id(noisy("result").encode())) in result_part
    after["messages"][3]["content"][1]["content"][0]["text"] = noisy("result")
    assert after == body
    assert where(compaction) == [(3, 1, 0, "Bash", "textclean"), (3, 1, 0, "Bash", "offload")]


def test_results_of_the_expand_tool_are_never_touched():
    body = claude_code_body("p_second_request_tool_result")
    body["messages"] += tool_turn("toolu_x", "context_guru_expand", noisy(), {"id": "0123456789abcdef"})
    raw = js_style(body)
    assert run(raw).body is raw


def test_lossy_off_runs_only_the_reformat_components():
    raw = planted()
    compaction = run(raw, lossy=False)
    assert [change.component for change in compaction.changes] == ["textclean"]
    assert compaction.originals == {}
    assert result_texts(compaction.body)[0] == bash_output().replace("\x1b[31m", "").replace(
        "\x1b[32m", "").replace("\x1b[0m", "")


def test_changes_and_originals():
    output = bash_output() + "ünïcödé ✓ 😀"
    raw = js_style(plant(claude_code_body("p_second_request_tool_result"), output))
    compaction = run(raw)
    ident = marker_id(output.encode())
    assert compaction.originals == {ident: output.encode("utf-8")}
    textclean, offload = compaction.changes
    assert (textclean.message_index, textclean.block_index, textclean.part_index) == (3, 0, None)
    assert (textclean.tool_name, textclean.component, textclean.lossy, textclean.marker_id) == (
        "Bash", "textclean", False, None)
    assert (offload.component, offload.lossy, offload.marker_id) == ("offload", True, ident)
    assert textclean.tokens_before > textclean.tokens_after == offload.tokens_before > offload.tokens_after
    assert (textclean.step, offload.step) == (0, 1)  # the result as sent is step 0's tokens_before
    assert body_has_marker(compaction.body)


def test_tool_names_come_from_the_matching_tool_use():
    body = claude_code_body("p_second_request_tool_result")
    body["messages"] += (tool_turn("toolu_read", "Read", bash_output(seed=1))
                         + tool_turn("toolu_bash", "Bash", bash_output(seed=2))
                         + [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_unknown",
                                                          "content": bash_output(seed=3)}]}])
    compaction = run(js_style(body))
    offloaded = {(c.message_index, c.tool_name) for c in compaction.changes if c.component == "offload"}
    assert offloaded == {(7, "Bash"), (8, None)}
    assert {(c.message_index, c.tool_name) for c in compaction.changes} >= {(5, "Read")}  # cleaned, not cut

    compaction = run(js_style(body), config=CompactConfig(keep_tools={"Bash"}))
    assert {c.tool_name for c in compaction.changes if c.component == "offload"} == {"Read", None}


def test_text_block_lists_are_compacted_part_by_part():
    small = "\x1b[1mbuild ok\x1b[0m"
    parts = [{"type": "text", "text": bash_output()},
             {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
             {"type": "text", "text": small, "cache_control": {"type": "ephemeral"}}]
    raw = js_style(plant(claude_code_body("p_second_request_tool_result"), parts))
    compaction = run(raw)
    new_parts = result_texts(compaction.body)[0]
    assert marker(marker_id(bash_output().encode())) in new_parts[0]["text"]
    assert new_parts[1:] == [parts[1], {**parts[2], "text": "build ok"}]
    assert compaction.originals == {marker_id(bash_output().encode()): bash_output().encode()}
    assert [(c.part_index, c.component) for c in compaction.changes] == [
        (0, "textclean"), (0, "offload"), (2, "textclean")]


def test_openai_tool_messages():
    calls = [{"id": "call_bash", "type": "function", "function": {"name": "Bash", "arguments": "{}"}},
             {"id": "call_read", "type": "function", "function": {"name": "Read", "arguments": "{}"}}]
    body = {"model": "gpt-5", "messages": [
        {"role": "system", "content": noisy("system")},
        {"role": "user", "content": noisy("user")},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_bash", "content": bash_output(seed=4)},
        {"role": "tool", "tool_call_id": "call_read", "content": [{"type": "text", "text": bash_output(seed=5)}]},
    ], "tools": [{"type": "function", "function": {"name": "Bash", "description": noisy("tool")}}]}
    compaction = run(js_style(body), dialect="openai")
    after = json.loads(compaction.body)
    assert after["messages"][:3] == body["messages"][:3] and after["tools"] == body["tools"]
    assert marker(marker_id(bash_output(seed=4).encode())) in after["messages"][3]["content"]
    assert where(compaction) == [(3, None, None, "Bash", "textclean"), (3, None, None, "Bash", "offload"),
                                 (4, None, 0, "Read", "textclean")]


# The component contract

class Raises:
    name, lossy = "raises", False

    def apply(self, text, ctx):
        raise RuntimeError("bug")


class Grows:
    name, lossy = "grows", False

    def apply(self, text, ctx):
        return Outcome(text + " and more words")


class LossyWithoutOriginal:
    name, lossy = "no-original", True

    def apply(self, text, ctx):
        return Outcome(f"gone {marker(ctx.marker_id)}", None, ctx.marker_id)


class LossyWithoutMarker:
    name, lossy = "no-marker", True

    def apply(self, text, ctx):
        return Outcome("gone", ctx.original, ctx.marker_id)


def test_a_raising_component_is_skipped_and_the_rest_still_run():
    raw = planted()
    compaction = run(raw, config=CompactConfig(components=(Raises(), *DEFAULT_COMPONENTS)))
    assert [change.component for change in compaction.changes] == ["textclean", "offload"]


@pytest.mark.parametrize("component", [Raises(), Grows(), LossyWithoutOriginal(), LossyWithoutMarker()])
def test_rewrites_breaking_the_contract_are_reverted(component):
    raw = planted()
    config = CompactConfig(components=(component,))
    assert run(raw, config=config).body is raw
    parsed = ParsedBody.parse(raw)
    counted = plan(parsed, MESSAGES_SHAPE, config, lossy=True)
    assert counted.reverted[component.name] == counted.runs[component.name] > 0


def test_the_config_sets_each_components_parameters():
    assert CompactConfig().configured == DEFAULT_COMPONENTS
    raises = Raises()
    config = CompactConfig(components=(raises, Dedup(min_tokens=1), Offload(min_tokens=1)), keep_tools={"Bash"},
                           offload_min_tokens=3000, offload_head_lines=5, offload_tail_lines=6,
                           offload_max_line_chars=70, offload_max_error_lines=8, dedup_min_tokens=9)
    assert config.configured == (raises, Dedup(min_tokens=9), Offload(
        keep_tools=frozenset({"Bash"}), min_tokens=3000, head_lines=5, tail_lines=6, max_line_chars=70, max_error_lines=8))
    assert hash(config) == hash(attrs.evolve(config)) and config == attrs.evolve(config)


# Decided once, forever

def conversation(turns: int) -> dict:
    """A growing history: the same test output twice, a large log, and short answers."""
    body = claude_code_body("p_second_request_tool_result")
    outputs = ["collected 12 items\n" + "tests/test_x.py::test_a PASSED\n" * 40, bash_output(seed=7), "ok"]
    for turn in range(turns):
        output = outputs[turn % 3] if turn < 4 else f"done {turn}"
        body["messages"] += tool_turn(f"toolu_{turn:04d}", "Bash", output)
    return body


def test_earlier_bytes_stay_the_same_as_history_grows():
    outputs = []
    for turns in range(1, 8):
        raw = js_style(conversation(turns))
        after = run(raw, memo=None).body
        tail = raw[raw.rindex(b'],"system":'):]
        outputs.append(after[: len(after) - len(tail)])
    for shorter, longer in itertools.pairwise(outputs):
        assert longer.startswith(shorter)
    final = result_texts(run(js_style(conversation(7))).body)
    repeated = "collected 12 items\n" + "tests/test_x.py::test_a PASSED\n" * 40
    assert final[1] == repeated  # first sight: kept
    assert final[4].startswith("[cg: identical to an earlier tool result") and marker(
        marker_id(repeated.encode())) in final[4]


def test_same_input_same_bytes_with_or_without_memo():
    raw = js_style(conversation(6))
    memo = Memo()
    cold = run(raw, memo=memo)
    warm = run(raw, memo=memo)
    assert cold.body == warm.body == run(raw).body
    assert cold.changes == warm.changes and cold.originals == warm.originals


def test_same_bytes_in_another_process():
    raw = js_style(conversation(6))
    script = ("import sys, hashlib; from cg.compaction.pipeline import compact, CompactConfig; "
              "from cg.wire.dialect import MESSAGES_SHAPE; "
              "print(hashlib.sha256(compact(sys.stdin.buffer.read(), MESSAGES_SHAPE, CompactConfig(), True).body)"
              ".hexdigest())")
    for seed in ("1", "2"):
        result = subprocess.run([sys.executable, "-c", script], input=raw, capture_output=True, check=True,
                                cwd=Path(__file__).parents[1], env={**os.environ, "PYTHONHASHSEED": seed})
        assert result.stdout.decode().strip() == hashlib.sha256(run(raw).body).hexdigest()


def test_memo_is_bounded():
    memo = Memo(max_chars=3 * 512)  # each decision counts 512 characters and its rewritten text
    raw = js_style(conversation(6))
    assert run(raw, memo=memo).body == run(raw).body
    assert 0 < len(memo) <= 3 and 512 * len(memo) <= memo.decisions.chars <= 3 * 512
    memo = Memo(max_chars=10)
    run(raw, memo=memo)
    assert len(memo) <= 2


def test_claude_code_compact_request_is_compacted_like_any_other():
    raw = js_style(plant(claude_code_body("compact_request"), bash_output()))
    assert run(raw).changed


def test_results_with_lone_surrogates_are_left_alone():
    raw = js_style(plant(claude_code_body("p_second_request_tool_result"), "PLANTED")).replace(
        b'"PLANTED"', json.dumps(bash_output() + "\ud800").encode())
    assert run(raw).body is raw


def test_golden_bytes():
    """Pins the exact bytes sent for a fixed body: a change here changes what users' caches hold."""
    raw = planted()
    assert hashlib.sha256(run(raw).body).hexdigest() == GOLDEN_SHA256


GOLDEN_SHA256 = "fd8423a830ad7162e6c22ba510b57e2bad88e607c8bda933320f5bdfdb1a10ec"
