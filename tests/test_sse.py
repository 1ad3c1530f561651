"""cg.wire.sse: the incremental SSE parser that keeps every event's original bytes."""

import re
import time

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cg.testing import anthropic_stream_events, anthropic_text_block, openai_stream_events, sse_event
from cg.wire.sse import Event, SSEParser


def parse(*chunks: bytes, flush: bool = False) -> tuple[list[Event], bytes]:
    parser = SSEParser()
    events = []
    for chunk in chunks:
        events += parser.feed(chunk)
    if flush:
        events += parser.flush()
    return events, parser.close()


def summary(events: list[Event]) -> list[tuple]:
    return [(e.raw, e.name, e.data) for e in events]


def split_at(data: bytes, cuts) -> list[bytes]:
    cuts = sorted(set(c for c in cuts if 0 < c < len(data)))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]


# ---------------------------------------------------------------------------------------------
# A reference parser: the WHATWG algorithm over the whole input at once, written independently
# (regex line splitting, no scan positions) to check the incremental one against.

_LINE = re.compile(rb"([^\r\n]*)(\r\n|\r|\n)")


def reference(data: bytes) -> tuple[list[tuple], bytes]:
    """(raw, name, data) of every block, and the unterminated tail; input ending in a lone CR
    counts that CR as a line end (what flush() does)."""
    events, start, name, lines, pos = [], 0, None, [], 0
    for m in _LINE.finditer(data):
        line = m.group(1)
        if m.start() == 0 and line.startswith(b"\xef\xbb\xbf"):
            line = line[3:]
        pos = m.end()
        if line == b"":
            events.append((data[start:pos], name, b"\n".join(lines)))
            start, name, lines = pos, None, []
            continue
        if line.startswith(b":"):
            continue
        field, colon, value = line.partition(b":")
        if colon and value.startswith(b" "):
            value = value[1:]
        if field == b"data":
            lines.append(value)
        elif field == b"event":
            name = value.decode("utf-8", "replace")
    return events, data[start:]


# ---------------------------------------------------------------------------------------------
# The grammar


def test_one_event_lf():
    events, tail = parse(b'event: ping\ndata: {"type":"ping"}\n\n')
    assert summary(events) == [(b'event: ping\ndata: {"type":"ping"}\n\n', "ping", b'{"type":"ping"}')]
    assert tail == b""
    assert events[0].json() == {"type": "ping"}


def test_several_events_in_one_chunk_and_multiline_data():
    events, tail = parse(b"data: a\ndata: b\n\nevent: x\ndata:c\n\ndata: trailing")
    assert summary(events) == [
        (b"data: a\ndata: b\n\n", None, b"a\nb"),
        (b"event: x\ndata:c\n\n", "x", b"c"),
    ]
    assert tail == b"data: trailing"


def test_crlf_and_cr_line_endings():
    events, _ = parse(b"event: a\r\ndata: 1\r\n\r\nevent: b\rdata: 2\r\rdata: 3\n\r\n")
    assert summary(events) == [
        (b"event: a\r\ndata: 1\r\n\r\n", "a", b"1"),
        (b"event: b\rdata: 2\r\r", "b", b"2"),
        (b"data: 3\n\r\n", None, b"3"),
    ]


def test_space_after_colon_is_stripped_once():
    events, _ = parse(b"data:  two spaces\n\ndata:none\n\nevent:  x \n\n")
    assert [e.data for e in events] == [b" two spaces", b"none", b""]
    assert events[2].name == " x "


def test_field_without_colon():
    # "data" alone is an empty data line; two of them join to one newline.
    events, _ = parse(b"data\ndata\n\nevent\ndata: x\n\n")
    assert summary(events) == [(b"data\ndata\n\n", None, b"\n"), (b"event\ndata: x\n\n", "", b"x")]


def test_unknown_id_and_retry_fields_are_ignored_but_kept_in_raw():
    raw = b"id: 7\nretry: 100\nfoo: bar\ndata: x\nevent: a\nevent: b\n\n"
    events, _ = parse(raw)
    assert summary(events) == [(raw, "b", b"x")]  # last event: line wins


def test_comments_belong_to_their_block():
    stream = b": hello\nevent: a\n: between\ndata: 1\n: before blank\n\n: keep-alive\n\n"
    events, tail = parse(stream)
    assert summary(events) == [
        (b": hello\nevent: a\n: between\ndata: 1\n: before blank\n\n", "a", b"1"),
        (b": keep-alive\n\n", None, b""),  # a comment-only block is an Event of its own
    ]
    assert tail == b""


def test_a_stray_blank_line_is_an_empty_event():
    events, _ = parse(b"data: 1\n\n\n\r\ndata: 2\n\n")
    assert summary(events) == [
        (b"data: 1\n\n", None, b"1"),
        (b"\n", None, b""),
        (b"\r\n", None, b""),
        (b"data: 2\n\n", None, b"2"),
    ]


def test_a_colon_in_the_value_is_kept():
    events, _ = parse(b'data: {"a":"b: c"}\n\n')
    assert events[0].data == b'{"a":"b: c"}'


def test_bom_at_the_start_of_the_stream_only():
    events, _ = parse(b"\xef\xbb\xbfevent: a\ndata: 1\n\n\xef\xbb\xbfevent: b\n\n")
    assert [e.name for e in events] == ["a", None]
    assert events[0].raw.startswith(b"\xef\xbb\xbf")  # still in raw: bytes are never dropped


def test_name_is_decoded_data_stays_bytes():
    events, _ = parse("event: héllo\ndata: ünïcode\n\n".encode())
    assert events[0].name == "héllo"
    assert events[0].data == "ünïcode".encode()
    events, _ = parse(b"event: \xff\ndata: \xff\n\n")
    assert events[0].name == "\ufffd"
    assert events[0].data == b"\xff"


# ---------------------------------------------------------------------------------------------
# Chunk boundaries


def test_split_mid_line_and_mid_utf8_character():
    raw = 'event: content_block_delta\ndata: {"text":"é€😀"}\n\n'.encode()
    euro = raw.index("€".encode())
    for cut in (3, 10, euro + 1, euro + 2, len(raw) - 1):
        events, tail = parse(raw[:cut], raw[cut:])
        assert summary(events) == [(raw, "content_block_delta", '{"text":"é€😀"}'.encode())]
        assert tail == b""
    assert parse(raw[: euro + 1])[1] == raw[: euro + 1]


def test_split_between_cr_and_lf_waits_for_the_lf():
    parser = SSEParser()
    assert parser.feed(b"event: a\r\ndata: 1\r\n\r") == []  # CR or CRLF? not known yet
    events = parser.feed(b"\ndata: 2\r")
    assert summary(events) == [(b"event: a\r\ndata: 1\r\n\r\n", "a", b"1")]
    assert parser.feed(b"\n") == []
    assert summary(parser.feed(b"\r\n")) == [(b"data: 2\r\n\r\n", None, b"2")]
    assert parser.close() == b""


def test_lone_cr_at_end_of_input_needs_flush():
    parser = SSEParser()
    assert parser.feed(b"data: 1\r\r") == []
    assert summary(parser.feed(b"data: 2\r\r")) == [(b"data: 1\r\r", None, b"1")]
    assert summary(parser.flush()) == [(b"data: 2\r\r", None, b"2")]
    assert parser.close() == b""
    # Without flush() the held bytes come back as the tail: nothing is lost either way.
    parser = SSEParser()
    parser.feed(b"data: 1\r\r")
    assert parser.close() == b"data: 1\r\r"


def test_close_returns_the_incomplete_event_verbatim():
    parser = SSEParser()
    parser.feed(b"event: a\ndata: 1\n\nevent: b\r\n: c\r\nda")
    parser.feed(b"ta: {")
    assert parser.buffered == len(b"event: b\r\n: c\r\ndata: {")
    assert parser.close() == b"event: b\r\n: c\r\ndata: {"
    with pytest.raises(ValueError):
        parser.feed(b"more")


def test_empty_chunks_are_harmless():
    parser = SSEParser()
    assert parser.feed(b"") == []
    assert parser.feed(b"data: 1\n") == []
    assert parser.feed(b"") == []
    assert [e.data for e in parser.feed(b"\n")] == [b"1"]


# ---------------------------------------------------------------------------------------------
# Event


def test_event_json_is_cached_and_bad_json_raises_valueerror():
    event = parse(b'data: {"a": [1, 2]}\n\n')[0][0]
    assert event.json() == {"a": [1, 2]}
    assert event.json() is event.json()
    for bad in (b"data: [DONE]\n\n", b"data: {\n\n", b": only a comment\n\n", b"data: \xff\n\n"):
        event = parse(bad)[0][0]
        with pytest.raises(ValueError):
            event.json()
        with pytest.raises(ValueError):  # the failure is cached too, and raised again
            event.json()


def test_event_is_frozen_and_compares_by_fields():
    a = parse(b"event: x\ndata: {}\n\n")[0][0]
    b = Event(b"event: x\ndata: {}\n\n", "x", b"{}")
    a.json()  # the cache does not take part in equality
    assert a == b and hash(a) == hash(b)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        a.name = "y"
    assert not hasattr(a, "__dict__")


# ---------------------------------------------------------------------------------------------
# Cost: never re-scan the pending event


def test_large_event_in_small_chunks_scans_each_byte_a_bounded_number_of_times():
    payload = b"x" * (256 * 1024)
    raw = b"event: big\ndata: " + payload + b"\n\n"
    parser = SSEParser()
    events = []
    for i in range(len(raw)):  # one byte at a time
        events += parser.feed(raw[i : i + 1])
    assert summary(events) == [(raw, "big", payload)]
    # Each byte is searched at most once for "\n" and once for "\r". A parser that re-scanned the
    # pending line on each feed would search ~len(raw)**2 / 2 bytes here (3e10).
    assert parser.scanned <= 2 * len(raw) + 16


def test_large_event_many_lines_in_small_chunks_is_linear():
    raw = b"event: big\n" + b"data: 0123456789abcdef\r\n" * 40_000 + b"\r\n"  # ~1 MB, one event
    parser = SSEParser()
    for i in range(0, len(raw), 3):
        events = parser.feed(raw[i : i + 3])
    assert len(events) == 1 and events[0].raw == raw
    assert events[0].data.count(b"\n") == 40_000 - 1
    assert parser.scanned <= 2 * len(raw) + 16


def test_2mb_event_in_small_chunks_finishes_fast():
    # A generous bound: linear takes ~0.1 s here; quadratic re-scanning would take minutes.
    payload = b"y" * (2 * 1024 * 1024)
    raw = b"event: big\ndata: " + payload + b"\n\n"
    chunks = [raw[i : i + 16] for i in range(0, len(raw), 16)]
    parser = SSEParser()
    started = time.perf_counter()
    events = []
    for chunk in chunks:
        events += parser.feed(chunk)
    elapsed = time.perf_counter() - started
    assert len(events) == 1 and events[0].data == payload
    assert elapsed < 15, elapsed


def test_many_events_in_one_chunk_is_linear():
    one = sse_event("ping", {"type": "ping"})
    events, tail = parse(one * 50_000)
    assert len(events) == 50_000 and tail == b""


# ---------------------------------------------------------------------------------------------
# Realistic streams


def anthropic_stream() -> bytes:
    tool = [
        sse_event(
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 1,
                "content_block": {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {}},
            },
        ),
        sse_event(
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": 1,
                "delta": {"type": "input_json_delta", "partial_json": '{"command": "ls \\u00e9"}'},
            },
        ),
        sse_event("content_block_stop", {"type": "content_block_stop", "index": 1}),
    ]
    blocks = [anthropic_text_block(0, ["Héllo", " wörld 😀", "\n\ndata: not a field"]), tool]
    return b"".join(anthropic_stream_events(blocks=blocks, stop_reason="tool_use"))


def test_anthropic_stream():
    stream = anthropic_stream()
    events, tail = parse(stream)
    assert tail == b""
    assert b"".join(e.raw for e in events) == stream
    names = [e.name for e in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert all(e.json()["type"] == e.name for e in events)
    texts = [e.json()["delta"].get("text") for e in events if e.name == "content_block_delta"]
    assert texts[:3] == ["Héllo", " wörld 😀", "\n\ndata: not a field"]


def test_openai_stream_with_and_without_usage():
    for include_usage in (True, False):
        stream = b"".join(openai_stream_events(include_usage=include_usage))
        events, tail = parse(stream)
        assert tail == b"" and b"".join(e.raw for e in events) == stream
        assert all(e.name is None for e in events)
        assert events[-1].data == b"[DONE]"
        assert [e.json()["object"] for e in events[:-1]] == ["chat.completion.chunk"] * len(events[:-1])


def crlf(stream: bytes) -> bytes:
    return stream.replace(b"\n", b"\r\n")


def realistic_streams() -> list[bytes]:
    a = anthropic_stream()
    o = b"".join(openai_stream_events())
    with_comments = a.replace(b"event: ping\n", b": keep-alive\nevent: ping\n") + b": bye\n\n"
    return [a, o, crlf(a), crlf(o), with_comments, b"\xef\xbb\xbf" + o]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(range(6)), st.lists(st.integers(min_value=0, max_value=10_000), max_size=40))
def test_realistic_streams_rechunked(which, cuts):
    stream = realistic_streams()[which]
    whole, whole_tail = parse(stream)
    events, tail = parse(*split_at(stream, cuts))
    assert summary(events) == summary(whole)
    assert tail == whole_tail == b""
    assert b"".join(e.raw for e in events) == stream
    assert (summary(whole), whole_tail) == reference(stream)


def test_realistic_stream_one_byte_at_a_time():
    for stream in realistic_streams():
        events, tail = parse(*(stream[i : i + 1] for i in range(len(stream))))
        assert (summary(events), tail) == reference(stream)


# ---------------------------------------------------------------------------------------------
# Property: arbitrary byte streams, arbitrary chunking

_PIECES = [
    b"\n", b"\r", b"\r\n", b":", b": ", b" ", b"data", b"data:", b"data: ", b"event", b"event: ",
    b"id: 1", b"x", b"{}", "é".encode(), "😀".encode(), b"\xef\xbb\xbf", b"\xff",
]  # fmt: skip

streams = st.lists(st.sampled_from(_PIECES), max_size=60).map(b"".join)


@settings(max_examples=1000, deadline=None)
@given(streams, st.lists(st.integers(min_value=0, max_value=400), max_size=30))
def test_rechunking_never_changes_events(stream, cuts):
    whole, whole_tail = parse(stream)
    events, tail = parse(*split_at(stream, cuts))
    assert summary(events) == summary(whole)
    assert tail == whole_tail
    assert b"".join(e.raw for e in events) + tail == stream


@settings(max_examples=1000, deadline=None)
@given(streams, st.lists(st.integers(min_value=0, max_value=400), max_size=30))
def test_matches_the_reference_algorithm(stream, cuts):
    events, tail = parse(*split_at(stream, cuts), flush=True)
    assert (summary(events), tail) == reference(stream)


@settings(max_examples=300, deadline=None)
@given(streams)
def test_one_byte_chunks(stream):
    events, tail = parse(*(stream[i : i + 1] for i in range(len(stream))))
    whole, whole_tail = parse(stream)
    assert summary(events) == summary(whole) and tail == whole_tail
