"""Markers: their format, and finding them in forwarded bodies however the client escaped them."""

import json
import time

import pytest
from helpers.bodies import go_style, js_style, python_style, slash_style
from hypothesis import given
from hypothesis import strategies as st

from cg.wire.markers import body_has_marker, marker, marker_id, parse_marker_ref

MARKER = marker(marker_id(b"the original"))
EXPAND_TOOL = {
    "name": "context_guru_expand",
    "description": "Markers like <<cg:ID>> or <<cg:0123456789abcdef>> stand for content cg elided.",
    "input_schema": {"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"]},
}


def pretty_style(body) -> bytes:
    return json.dumps(body, indent=2, ensure_ascii=False).encode()


ENCODERS = [js_style, python_style, go_style, lambda body: go_style(body, upper_hex=True), slash_style, pretty_style]
ENCODER_NAMES = ["js", "python", "go", "go-upper-hex", "slashes", "pretty"]


def request(messages=(), system=None, tools=(EXPAND_TOOL,)):
    body = {"model": "claude-opus-4-8", "messages": list(messages)}
    if system is not None:
        body["system"] = system
    body["tools"] = list(tools)
    body["metadata"] = {"user_id": "u"}
    return body


def user(*blocks):
    return {"role": "user", "content": list(blocks)}


def text_block(text):
    return {"type": "text", "text": text}


def test_marker_ids_are_content_addressed():
    assert marker_id(b"hello") == "2cf24dba5fb0a30e"
    assert marker_id("café".encode()) == marker_id("café".encode()) != marker_id(b"cafe")
    assert marker("2cf24dba5fb0a30e") == "<<cg:2cf24dba5fb0a30e>>"


@pytest.mark.parametrize("bad", ["", "a" * 65, "has space", "colon:", "<<cg:x>>"])
def test_marker_rejects_bad_ids(bad):
    with pytest.raises(ValueError):
        marker(bad)


@pytest.mark.parametrize(("text", "expected"), [
    ("2cf24dba5fb0a30e", "2cf24dba5fb0a30e"),
    ("<<cg:2cf24dba5fb0a30e>>", "2cf24dba5fb0a30e"),
    ("  <<cg:a-b_C9>>\n", "a-b_C9"),
    ("x" * 64, "x" * 64),
    ("x" * 65, None),
    ("<<cg:>>", None),
    ("<<cg:abc", None),
    ("see <<cg:abc>>", None),
    ("", None),
])
def test_parse_marker_ref(text, expected):
    assert parse_marker_ref(text) == expected


PLACEMENTS = {
    "user text": lambda: request([user(text_block(f"look at {MARKER}"))]),
    "after a newline": lambda: request([user(text_block(f"first line\n{MARKER}\nlast"))]),
    "string system": lambda: request(system=f"You saw {MARKER} earlier."),
    "system blocks": lambda: request(system=[text_block("intro"), text_block(f"kept: {MARKER}")]),
    "tool_result string": lambda: request([user({"type": "tool_result", "tool_use_id": "t1", "content": MARKER})]),
    "nested tool_result blocks": lambda: request([user({
        "type": "tool_result", "tool_use_id": "t1",
        "content": [text_block("head"), text_block(f"[cg: lines elided; the full output is {MARKER}]")],
    })]),
    "assistant text": lambda: request([{"role": "assistant", "content": [text_block(f"I will expand {MARKER}")]}]),
    "openai tool message": lambda: request([{"role": "tool", "tool_call_id": "c1", "content": f"x {MARKER} y"}]),
}


@pytest.mark.parametrize("encode", ENCODERS, ids=ENCODER_NAMES)
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_finds_markers_in_messages_and_system(placement, encode):
    assert body_has_marker(encode(PLACEMENTS[placement]()))


@pytest.mark.parametrize("encode", ENCODERS, ids=ENCODER_NAMES)
def test_never_counts_tools_or_other_fields(encode):
    body = request([user(text_block("no marker here: <<cg:>> <cg:abc> <<cg:abc>"))], system="plain")
    body["tools"].append({"name": "Bash", "description": f"mentions {MARKER}", "input_schema": {}})
    body["metadata"]["note"] = MARKER
    assert not body_has_marker(encode(body))


def test_mixed_escaping_of_the_two_brackets():
    ident = marker_id(b"x")
    for spelling in (f"<\\u003ccg:{ident}\\u003E>", f"\\u003C<cg:{ident}>\\u003e", f"<<cg:{ident}>\\u003e"):
        raw = b'{"messages":[{"role":"user","content":"' + spelling.encode() + b'"}],"tools":[]}'
        assert body_has_marker(raw), spelling


def test_a_body_that_does_not_parse_counts_any_marker():
    assert body_has_marker(b'{"messages": [' + MARKER.encode())
    assert not body_has_marker(b'{"messages": [')


@given(prefix=st.text(), suffix=st.text(), encode=st.sampled_from(ENCODERS))
def test_finds_a_marker_anywhere_in_a_text(prefix, suffix, encode):
    assert body_has_marker(encode(request([user(text_block(prefix + MARKER + suffix))])))


@given(text=st.text(), encode=st.sampled_from(ENCODERS))
def test_no_marker_no_detection(text, encode):
    assert not body_has_marker(encode(request([user(text_block(text))], system=text)))


def test_fast_on_a_two_megabyte_body():
    results = [user({"type": "tool_result", "tool_use_id": f"t{n}", "content": "cg: output line\n" * 1200})
               for n in range(100)]
    messages = results + [user(text_block(f"now {MARKER}"))]
    raw = js_style(request(messages))
    assert len(raw) > 2_000_000
    started = time.perf_counter()
    assert body_has_marker(raw)
    assert not body_has_marker(js_style(request(results)))
    assert time.perf_counter() - started < 0.5  # generous: milliseconds on a laptop
