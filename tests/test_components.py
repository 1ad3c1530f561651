"""The compaction components, one by one, and the golden bytes they produce."""

import json
import os
import random
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from cg.compaction.components import Context, Dedup, JsonFormat, Offload, TextClean
from cg.wire.markers import marker_id

GOLDEN = Path(__file__).parent / "golden"


def context(text="", tool_name="Bash", earlier=frozenset()):
    original = text.encode()
    return Context(
        tool_name=tool_name, message_index=3, block_index=0, part_index=None, original=original,
        marker_id=marker_id(original), earlier=earlier,
    )


def run(component, text, **kwargs):
    outcome = component.apply(text, context(text, **kwargs))
    return None if outcome is None else outcome.text


def check_golden(name: str, actual: str) -> None:
    """Compare with tests/golden/NAME; CG_UPDATE_GOLDEN=1 rewrites it (note the change in CHANGES.md:
    these bytes are what users' prompt caches hold)."""
    path = GOLDEN / name
    if os.environ.get("CG_UPDATE_GOLDEN"):
        path.write_bytes(actual.encode())
    assert actual == path.read_bytes().decode()


# textclean

@pytest.mark.parametrize(("text", "cleaned"), [
    ("\x1b[31mred\x1b[0m and \x1b[1;38;5;208mbold\x1b[m", "red and bold"),
    ("\x1b]0;my title\x07prompt$ ", "prompt$ "),
    ("\x1b]8;;https://example.com/x\x1b\\link\x1b]8;;\x1b\\ done", "link done"),
    ("\x1b7saved\x1b8 \x1b(Bascii\x1bM\x1b=", "saved ascii"),
    ("\x1bPq#0;2;0;0;0\x1b\\after", "after"),
    ("  0%\r 50%\r100%\ndone\n", "100%\ndone\n"),
    ("abcdef\rXY", "XYcdef"),
    ("abcdef\r\x1b[KXY", "XY"),
    ("downloading\x1b[2K\rok", "ok"),
    ("spinner |\x1b[1G\x1b[0Kspinner /\x1b[1G\x1b[0Kready", "ready"),
    ("hello\x1b[1K", "     "),
    ("\x1b[1mwarn\x1b[0m\r\nline  \r\n\r\n", "warn\r\nline  \r\n\r\n"),
    ("50%\r\x1b[32m100%\x1b[0m\r\n", "100%\r\n"),
    ("\x1b\x1b[31m[0m", "[0m"),
])
def test_textclean_shows_what_a_terminal_shows(text, cleaned):
    assert run(TextClean(), text) == cleaned


@pytest.mark.parametrize("text", ["plain\n", "crlf\r\nlines\r\n", "trailing  \n\n\nblank", "ends with cr\r", ""])
def test_textclean_leaves_clean_text_alone(text):
    assert run(TextClean(), text) is None


terminal_text = st.text(alphabet="\x1b[]();0123456789mKGHJ?\r\n\x07\\ abcXY\t é", max_size=200)


@given(terminal_text)
@settings(max_examples=500)
def test_textclean_is_idempotent_and_never_grows(text):
    cleaned = run(TextClean(), text)
    if cleaned is not None:
        assert len(cleaned) <= len(text)
        assert "\x1b" not in cleaned
        assert run(TextClean(), cleaned) is None


# jsonformat

def test_jsonformat_keeps_every_token_as_spelled():
    pretty = '{\n  "a": 1.0E+2,\n  "s": "caf\\u00e9  x\\n",\n  "a": [\n    1,\n    -0.50\n  ],\n  "t": true\n}\n'
    assert run(JsonFormat(), pretty) == '{"a":1.0E+2,"s":"caf\\u00e9  x\\n","a":[1,-0.50],"t":true}'


@pytest.mark.parametrize("text", [
    '{"a":1}',  # already compact
    '{"a": 1} trailing words',
    '{\n  "a": NaN\n}',
    '"just a string"',
    "42",
    "[1, 2,]",
    "not json at all",
    "{\n  \"a\": \"tab\there\"\n}",  # a raw control character: not strict JSON
])
def test_jsonformat_only_touches_pretty_printed_json(text):
    assert run(JsonFormat(), text) is None


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children) | st.dictionaries(st.text(), children),
    max_leaves=20,
)


@given(json_values.filter(lambda value: isinstance(value, (dict, list))), st.sampled_from([1, 2, 4, "\t"]))
def test_jsonformat_matches_a_compact_dump(value, indent):
    pretty = json.dumps(value, indent=indent)
    compacted = run(JsonFormat(), pretty)
    assert (compacted or pretty) == json.dumps(value, separators=(",", ":"))


@given(st.one_of(json_values.map(lambda value: json.dumps(value, indent=2)), st.text()))
def test_jsonformat_is_idempotent_and_never_grows(text):
    compacted = run(JsonFormat(), text)
    if compacted is not None:
        assert len(compacted) < len(text)
        assert run(JsonFormat(), compacted) is None


# dedup

def test_dedup_points_to_an_earlier_identical_result():
    text = "identical output line\n" * 60
    pointer = run(Dedup(), text, earlier={marker_id(text.encode())})
    assert pointer == (
        f"[cg: identical to an earlier tool result in this conversation, <<cg:{marker_id(text.encode())}>>; "
        f'call context_guru_expand with id "{marker_id(text.encode())}" to read it here]'
    )
    outcome = Dedup().apply(text, context(text, earlier={marker_id(text.encode())}))
    assert (outcome.original, outcome.marker_id) == (text.encode(), marker_id(text.encode()))


def test_dedup_needs_an_earlier_copy_and_a_result_worth_pointing_at():
    text = "identical output line\n" * 60
    assert run(Dedup(), text, earlier={marker_id(b"something else")}) is None
    assert run(Dedup(), "ok\n", earlier={marker_id(b"ok\n")}) is None


# offload

def build_log(lines=3000, seed=5):
    """A pytest-like log with a few failures in the middle and some very long lines."""
    rnd = random.Random(seed)
    out = []
    for number in range(lines):
        if number % 250 == 125:
            out.append(f"E       AssertionError: expected {rnd.randint(0, 99)} got {rnd.randint(100, 999)}")
        elif number % 400 == 7:
            out.append("x" * 1200)
        else:
            out.append(f"tests/test_mod{number % 17}.py::test_case_{number} PASSED [{number * 100 // lines:3d}%]")
    return "\n".join(out) + "\n"


def test_offload_keeps_head_tail_and_errors_with_a_notice():
    log = build_log()
    text = run(Offload(), log)
    lines = text.split("\n")
    notice = lines[40]
    assert lines[:40] == [line if len(line) <= 500 else f"{line[:500]} [cg: {len(line) - 500} more characters]"
                          for line in log.split("\n")[:40]]
    assert lines[-20:] == log.split("\n")[-20:]
    assert notice.startswith("[cg: lines 41-2981 of 3001 elided (~")
    assert f"<<cg:{marker_id(log.encode())}>>" in notice
    assert f'call context_guru_expand with id "{marker_id(log.encode())}"' in notice
    errors = lines[41:-20]
    assert len(errors) == 12 and all(": E       AssertionError" in line for line in errors)
    assert errors[0].startswith("126: ")
    check_golden("offload_pytest_log.txt", text)


def test_offload_keeps_at_most_the_configured_error_lines():
    log = "\n".join(["header"] * 40 + ["Error: failed to fetch"] * 3000 + ["footer"] * 20)
    text = run(Offload(), log)
    assert text.count("Error: failed to fetch") == 20


def test_offload_caps_long_lines_of_a_one_line_result():
    blob = "word " * 4000
    text = run(Offload(), blob)
    assert text.startswith("word " * 100 + " [cg: 19500 more characters]\n[cg: long lines shortened (~")


def test_offload_leaves_small_results_kept_tools_and_thin_savings_alone():
    assert run(Offload(), "short output\n" * 50) is None
    assert run(Offload(), build_log(), tool_name="Read") is None
    assert run(Offload(keep_tools=frozenset({"Bash"})), build_log()) is None
    barely = "\n".join(f"line {n} " + "lorem ipsum dolor sit amet " * 8 for n in range(62))
    assert run(Offload(), barely) is None


def test_offload_lossy_outcome_carries_the_exact_original():
    log = build_log() + "caf\u00e9 \u2014 \U0001f600"
    outcome = Offload().apply(log, context(log))
    assert outcome.original == log.encode("utf-8")
    assert outcome.marker_id == marker_id(log.encode("utf-8"))


def test_golden_textclean_and_jsonformat():
    progress = "".join(f"\r\x1b[2K\x1b[36m[{'#' * n:<20}]\x1b[0m {n * 5}%" for n in range(21)) + "\r\nok\r\n"
    pretty = json.dumps({"name": "cg", "deps": {"ujson": ">=5.8", "attrs": ">=23.1"}, "n": [1, 2.5]}, indent=2)
    check_golden("textclean_progress.txt", run(TextClean(), progress))
    check_golden("jsonformat_package.txt", run(JsonFormat(), pretty))


_LOG_PIECES = st.sampled_from(["E", "E ", "\n", " ", "\r", "\t", "x", "error", "Errors", "xError", "ERROR", "failed",
                               "failures!", "panicked", "Traceback", "KeyException", "exception", "errored", "_fail",
                               "fatal:", "ok", "K", "ſ", "İ", "\x1c"])


@settings(max_examples=1500, deadline=None)
@example(text="E\nerror: the line a match of E and a line break covers")
@given(text=st.lists(_LOG_PIECES, max_size=40).map("".join))
def test_error_lines_are_found_as_the_pattern_finds_them(text):
    """The fast search decides which lines an excerpt keeps: it must find what the pattern does."""
    from cg.compaction.components import _ERROR_LINE, _error_line_matches

    assert [m.span() for m in _error_line_matches(text)] == [m.span() for m in _ERROR_LINE.finditer(text)]
