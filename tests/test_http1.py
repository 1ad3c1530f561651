"""cg.web.http1: the upstream leg's HTTP/1.1 wire format, without a reactor."""

import pytest
from hypothesis import given
from hypothesis import strategies as st
from twisted.web.http_headers import Headers

from cg.web.http1 import ChunkedDecoder, ProtocolError, parse_response_head, request_head, target_problem


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
    headers = Headers({b"x-api-key": [b"k"], b"anthropic-beta": [b"a", b"b"]})
    head = request_head(b"POST", b"/v1/messages?beta=true", b"api.example:8443", headers, b"{}")
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /v1/messages?beta=true HTTP/1.1"
    assert lines[1] == b"Host: api.example:8443"
    assert sorted(lines[2:-2]) == [b"Anthropic-Beta: a", b"Anthropic-Beta: b", b"Content-Length: 2", b"X-Api-Key: k"]
    assert head.endswith(b"\r\n\r\n")


def test_request_without_body_has_no_length():
    assert b"Content-Length" not in request_head(b"GET", b"/v1/models", b"h", Headers(), None)
    assert b"Content-Length: 0\r\n" in request_head(b"POST", b"/", b"h", Headers(), b"")


def test_response_head_framing():
    head = parse_response_head(b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\nrequest-id: r1")
    assert (head.code, head.phrase, head.length, head.chunked, head.keep_alive) == (200, b"OK", 12, False, True)
    assert head.headers.getRawHeaders(b"request-id") == [b"r1"]

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
