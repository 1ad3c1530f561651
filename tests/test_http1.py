"""cg.wire.http1: the upstream leg's HTTP/1.1 wire format, without a reactor."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cg.testing.tables import table_rows
from cg.wire.http1 import (
    NEED_DATA,
    BodyEnd,
    ChunkedDecoder,
    Framing,
    ParserState,
    ProtocolError,
    ResponseHead,
    ResponseParser,
    parse_response_head,
    request_head,
    target_problem,
)


@pytest.mark.parametrize(
    "target",
    [
        b"/v1/messages",
        b"/v1/messages?beta=true",
        b"/v1/models/ft:gpt-4o:org:custom:abc",
        b"/v1/files/file-1@x/content",  # "@" and ":" are path characters
        b"//api.example/v1/messages",  # a path whose first segment is empty, not a host
        b"/v1/.well-known/x",  # a segment that only starts with a dot
        b"/v1/a%20b",
        b"/v1/messages?q=a/b?c&x=%2F..&y=[]|{}",  # a query cannot climb out of the path
        b"/",
    ],
)
def test_origin_form_targets_are_forwarded(target):
    assert target_problem(target) is None


@pytest.mark.parametrize(
    "target",
    [
        b":9999/v1/messages",
        b"api.example:9999/v1/messages",
        b".attacker.example/v1/messages",
        b"@attacker.example/v1/messages",
        b"http://attacker.example/v1/messages",
        b"*",
        b"",
        b"?/v1/messages",
        b"/v1/messages#x",
        b"/v1/messages\\..\\x",
        b"/v1/mess ages",
        b"/v1/messages\r\nHost: attacker.example",
        b"/v1/messages\n",
        b"/v1/messages\x00",
        b"/v1/messages\x7f",
        b"/v1/messages\xa0",
        b"/v1/messages%",
        b"/v1/messages%2",
        b"/v1/messages%zz",
        b"/v1/messages/../../x",
        b"/v1/messages/..",
        b"/./v1/messages",
        b"/v1/%2e%2E/x",
        b"/v1/..;/x",
        b"/v1/.;jsessionid=1/messages",
        b"/v1/..%3b/x",
        b"/v1/.%2e/x",
        b"/%2F../v1/messages",
        b"/v1/%2f",
        b"/v1/%5C..",
        b"/v1/messages%00",
        b"/v1/messages%0d%0aHost:%20x",
        b"/v1/messages%7F",
        b"/v1/messages?x#y",
        b"/v1/messages?x=\x80",
        b"/v1/messages?x= y",
    ],
)
def test_other_targets_are_refused(target):
    assert target_problem(target) is not None


def test_request_head_carries_host_headers_and_length():
    headers = [(b"X-Api-Key", [b"k"]), (b"Anthropic-Beta", [b"a", b"b"])]  # as Headers.getAllRawHeaders gives them
    head = request_head(b"POST", b"/v1/messages?beta=true", b"api.example:8443", headers, b"{}")
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /v1/messages?beta=true HTTP/1.1"
    assert lines[1] == b"Host: api.example:8443"
    assert sorted(lines[2:-2]) == [b"Anthropic-Beta: a", b"Anthropic-Beta: b", b"Content-Length: 2", b"X-Api-Key: k"]
    assert head.endswith(b"\r\n\r\n")


def test_request_without_body_has_no_length():
    assert b"Content-Length" not in request_head(b"GET", b"/v1/models", b"h", [], None)
    assert b"Content-Length: 0\r\n" in request_head(b"POST", b"/", b"h", [], b"")


def test_response_head_framing():
    head = parse_response_head(b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\nrequest-id: r1")
    assert (head.code, head.phrase, head.length, head.chunked, head.keep_alive) == (200, b"OK", 12, False, True)
    assert head.headers == [(b"Content-Length", b"12"), (b"request-id", b"r1")]  # as received, in order

    chunked = parse_response_head(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 5")
    assert (chunked.length, chunked.chunked, chunked.keep_alive) == (None, True, False)  # TE wins; smuggling-shaped

    close = parse_response_head(b"HTTP/1.1 200 OK\r\nConnection: keep-alive, Close")
    assert (close.length, close.chunked, close.keep_alive) == (None, False, False)

    old = parse_response_head(b"HTTP/1.0 200 OK\r\nContent-Length: 0")
    assert not old.keep_alive


def test_response_head_body_rules():
    assert parse_response_head(b"HTTP/1.1 100 Continue").interim
    assert not parse_response_head(b"HTTP/1.1 204 No Content").has_body(head_request=False)
    assert not parse_response_head(b"HTTP/1.1 200 OK\r\nContent-Length: 9").has_body(head_request=True)
    assert parse_response_head(b"HTTP/1.1 200").phrase == b""


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/2 200 OK",
        b"HTTP/1.1 20 OK",
        b"ICY 200 OK",
        b"HTTP/1.1 200 OK\r\nno colon",
        b"HTTP/1.1 200 OK\r\nName : value",
        b"HTTP/1.1 200 OK\r\nA: b\r\n folded",
        b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2",
        b"HTTP/1.1 200 OK\r\nContent-Length: -1",
        b"HTTP/1.1 200 OK\r\nX: a\nContent-Length: 10",
        b"HTTP/1.1 200 OK\r\nX: a\rContent-Length: 10",
        b"HTTP/1.1 200 OK\nContent-Length: 10",
    ],
)
def test_malformed_response_heads_are_refused(head):
    with pytest.raises(ProtocolError):
        parse_response_head(head)


def _encode(chunks: list[bytes], extensions: list[bool], trailers: list[bytes]) -> bytes:
    out = []
    for chunk, ext in zip(chunks, extensions):
        out.append(b"%x%s\r\n%s\r\n" % (len(chunk), b";name=value" if ext else b"", chunk))
    out.append(b"0\r\n" + b"".join(t + b"\r\n" for t in trailers) + b"\r\n")
    return b"".join(out)


@given(
    chunks=st.lists(st.binary(min_size=1, max_size=300), max_size=8),
    data=st.data(),
    extra=st.binary(max_size=20),
)
def test_chunked_decoder_is_indifferent_to_how_reads_split(chunks, data, extra):
    extensions = data.draw(st.lists(st.booleans(), min_size=len(chunks), max_size=len(chunks)))
    trailers = data.draw(st.lists(st.sampled_from([b"x-trailer: 1", b"checksum: abc"]), max_size=2))
    wire = _encode(chunks, extensions, trailers) + extra
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=12)))
    decoder = ChunkedDecoder()
    payload = []
    for start, end in zip([0] + cuts, cuts + [len(wire)]):
        if decoder.done:
            break
        payload.append(decoder.feed(wire[start:end]))
    assert decoder.done
    assert b"".join(payload) == b"".join(chunks)
    consumed = len(wire) - len(extra)
    # What came after the body, in the read that finished it.
    last_read_end = next(end for start, end in zip([0] + cuts, cuts + [len(wire)]) if end >= consumed)
    assert decoder.extra == wire[consumed:last_read_end]


@pytest.mark.parametrize(
    "wire",
    [b"zz\r\n", b"5\r\nhelloXX", b"-1\r\n", b"\r\n", b"1" * 20 + b"\r\n", b"5" * 5000],
)
def test_chunked_decoder_refuses_what_is_not_chunked(wire):
    with pytest.raises(ProtocolError):
        ChunkedDecoder().feed(wire)


def test_chunked_decoder_waits_for_more():
    decoder = ChunkedDecoder()
    assert decoder.feed(b"5\r\nhel") == b"hel"
    assert decoder.feed(b"lo\r") == b"lo"
    assert not decoder.done
    assert decoder.feed(b"\n0\r\n\r") == b""
    assert not decoder.done
    assert decoder.feed(b"\n") == b""
    assert decoder.done and decoder.extra == b""


# ---------------------------------------------------------------------------------------------
# ResponseParser: a connection's bytes in, events out


def events(parser: ResponseParser, reads: list[bytes]) -> list:
    """Every event of `reads`, read by read, with body data of consecutive events joined."""
    out: list = []
    for data in reads:
        parser.receive(data)
        while (event := parser.next_event()) is not NEED_DATA:
            if isinstance(event, bytes) and out and isinstance(out[-1], bytes):
                out[-1] += event
            else:
                assert event != b""  # body data is never empty
                out.append(event)
    return out


def parsed(wire: bytes, head_request: bool = False, cuts=()) -> list:
    parser = ResponseParser()
    parser.start(head_request)
    bounds = [0, *sorted(cuts), len(wire)]
    return events(parser, [wire[a:b] for a, b in zip(bounds, bounds[1:])])


def _head(code: int = 200, *lines: bytes) -> bytes:
    return b"HTTP/1.1 %d X\r\n" % code + b"".join(line + b"\r\n" for line in lines) + b"\r\n"


@st.composite
def responses(draw):
    """A response's bytes (maybe after 1xx heads), whether it answers HEAD, and the events it must give."""
    interim = b"".join(_head(code) for code in draw(st.lists(st.sampled_from([100, 103]), max_size=2)))
    framing = draw(st.sampled_from(["length", "chunked", "close", "none", "head"]))
    body = draw(st.binary(max_size=200))
    if framing == "length":
        wire, payload, end = _head(200, b"Content-Length: %d" % len(body)) + body, body, [BodyEnd(True)]
    elif framing == "chunked":
        chunks = draw(st.lists(st.binary(min_size=1, max_size=60), max_size=5))
        trailers = draw(st.lists(st.sampled_from([b"x-trailer: 1", b"checksum: abc"]), max_size=2))
        extensions = [draw(st.booleans()) for _ in chunks]
        wire = _head(200, b"Transfer-Encoding: chunked") + _encode(chunks, extensions, trailers)
        payload, end = b"".join(chunks), [BodyEnd(True)]
    elif framing == "close":  # ends only when the connection does
        wire, payload, end = _head(200, b"Connection: close") + body, body, []
    elif framing == "none":
        wire, payload, end = _head(204), b"", [BodyEnd(True)]
    else:  # to HEAD: the head says the length of a body that is not sent
        wire, payload, end = _head(200, b"Content-Length: 12"), b"", [BodyEnd(True)]
    code = 204 if framing == "none" else 200
    return interim + wire, framing == "head", code, [*([payload] if payload else []), *end]


@given(response=responses(), data=st.data())
def test_the_parser_gives_the_same_events_however_the_reads_split(response, data):
    wire, head_request, code, body_events = response
    cuts = data.draw(st.lists(st.integers(0, len(wire)), max_size=12))
    got = parsed(wire, head_request, cuts)
    assert isinstance(got[0], ResponseHead) and got[0].code == code  # the 1xx heads are skipped
    assert got[1:] == body_events


def test_the_parser_reads_one_response_after_another_on_a_connection():
    parser = ResponseParser()
    parser.start(head_request=False)
    first = events(parser, [_head(200, b"Content-Length: 2") + b"ok"])
    assert first[1:] == [b"ok", BodyEnd(True)] and parser.state is ParserState.IDLE
    parser.start(head_request=False)
    second = events(parser, [_head(200, b"Transfer-Encoding: chunked"), b"1\r\na\r\n0\r\n\r\n"])
    assert second[1:] == [b"a", BodyEnd(True)]


def test_an_empty_body_of_known_length_ends_with_its_head():
    parser = ResponseParser()
    parser.start(head_request=False)
    parser.receive(_head(200, b"Content-Length: 0"))
    assert isinstance(parser.next_event(), ResponseHead)
    assert parser.next_event() == BodyEnd(True)


@pytest.mark.parametrize(
    "wire",
    [
        _head(200, b"Content-Length: 2") + b"okX",
        _head(200, b"Transfer-Encoding: chunked") + b"0\r\n\r\nHTTP/1.1 200 OK\r\n",
        _head(204) + b"X",
    ],
)
def test_bytes_after_the_body_in_its_read_make_the_connection_not_reusable(wire):
    assert parsed(wire)[-1] == BodyEnd(False)


@pytest.mark.parametrize(
    "wire, reusable",
    [
        (_head(200, b"Content-Length: 0"), True),
        (_head(200, b"Connection: close", b"Content-Length: 0"), False),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n", False),
        (_head(200, b"Transfer-Encoding: chunked", b"Content-Length: 9") + b"0\r\n\r\n", False),  # smuggling-shaped
    ],
)
def test_the_head_says_whether_the_connection_is_reusable(wire, reusable):
    assert parsed(wire)[-1] == BodyEnd(reusable)


def test_a_close_delimited_body_ends_only_at_the_close():
    parser = ResponseParser()
    parser.start(head_request=False)
    assert not parser.ends_at_close
    assert events(parser, [_head(200) + b"all", b" of it"])[1:] == [b"all of it"]
    assert parser.ends_at_close and parser.framing is Framing.CLOSE


def test_an_http_1_0_response_without_a_length_ends_at_the_close():
    parser = ResponseParser()
    parser.start(head_request=False)
    head = events(parser, [b"HTTP/1.0 200 OK\r\n\r\n"])[0]
    assert not head.keep_alive and parser.ends_at_close


def test_what_comes_after_the_parser_is_no_longer_asked_is_never_parsed():
    """The connection stops pulling events once nobody wants the response: the rest is not refused either."""
    parser = ResponseParser()
    parser.start(head_request=False)
    parser.receive(_head(200, b"Transfer-Encoding: chunked") + b"2\r\nab\r\nnot a chunk")
    assert isinstance(parser.next_event(), ResponseHead)  # and the caller stops here


@pytest.mark.parametrize(
    "reads",
    [
        [b"SSH-2.0-OpenSSH\r\n\r\n"],
        [b"HTTP/1.1 200 OK\r\n" + b"x-big: " + b"a" * 300_000],
        [b"HTTP/1.1 200 OK\r\nx-big: " + b"a" * 200_000, b"a" * 100_000],  # too large, over two reads
        [b"HTTP/1.1 200 OK\r\nx-big: " + b"a" * 300_000 + b"\r\n\r\n"],  # too large, though whole in one read
        [b"HTTP/1.1 200 OK\nContent-Length: 2\n\nok"],  # bare LF: refused at once, not after a timeout
        [b"HTTP/1.1 200 OK\r\nContent-Length: 2\n", b"\nok"],  # the bare LFs straddle two reads
        [_head(200, b"Transfer-Encoding: chunked") + b"5\r\nhelloXX"],
    ],
)
def test_what_is_not_http_is_refused_and_the_parser_stays_broken(reads):
    parser = ResponseParser()
    parser.start(head_request=False)
    with pytest.raises(ProtocolError):
        events(parser, reads)
    assert parser.state is ParserState.BROKEN
    with pytest.raises(ProtocolError):
        parser.next_event()


def test_a_bad_chunk_gives_none_of_its_read():
    """The read that holds a framing error gives no payload: what came before it in that read is not relayed."""
    parser = ResponseParser()
    parser.start(head_request=False)
    assert events(parser, [_head(200, b"Transfer-Encoding: chunked")])[1:] == []
    parser.receive(b"2\r\nab\r\nzz\r\n")
    with pytest.raises(ProtocolError):
        parser.next_event()


def test_a_request_cannot_start_before_the_previous_response_ended():
    parser = ResponseParser()
    parser.start(head_request=False)
    with pytest.raises(RuntimeError):
        parser.start(head_request=False)


def test_the_parsers_table_names_every_state_and_only_states():
    states = set(ParserState.__members__)
    rows = table_rows(ResponseParser.__doc__)
    assert {state for state, *_ in rows} == states
    assert all(next_state in states for *_, next_state in rows)
