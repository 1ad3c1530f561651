"""cg.web.upstream against a scripted raw HTTP/1.1 server over real sockets.

The fake provider (cg.testing) speaks well-formed HTTP through twisted.web; these
replies are written byte by byte, for the framings and failures it never produces. The pool's
timers (the idle sweep, the header timeout) are tested on a Clock, in test_upstream_clock.py.
"""

import pytest
import pytest_twisted
from helpers.clients import Body
from rawhttp import connect, dechunk, http_request
from twisted.internet import defer, error, protocol, reactor, task
from twisted.internet.defer import CancelledError
from twisted.web.client import ResponseDone, ResponseFailed
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers

from cg.web.upstream import ConnectionDied, Upstream, split_base

TIMEOUT = 10


class Script:
    """What the server answers: one entry per request, in order, on whatever connection."""

    def __init__(self, *replies):
        self.replies = list(replies)
        self.requests: list[tuple[int, bytes]] = []  # (connection number, request head)
        self.connections: list[ScriptedServer] = []
        self.closed: list[defer.Deferred] = []


class ScriptedServer(protocol.Protocol):
    """Reads requests (head + Content-Length body); answers each with the script's next reply.

    A reply is bytes to write, or a callable given the transport (to split writes,
    close, or reset).
    """

    def __init__(self, script: Script):
        self.script = script
        self.buf = b""
        self.closed = defer.Deferred()

    def connectionMade(self):
        self.number = len(self.script.connections)
        self.script.connections.append(self)
        self.script.closed.append(self.closed)

    def dataReceived(self, data):
        self.buf += data
        while b"\r\n\r\n" in self.buf:
            head, _, rest = self.buf.partition(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.lower() == b"content-length":
                    length = int(value)
            if len(rest) < length:
                return
            self.buf = rest[length:]
            self.script.requests.append((self.number, head))
            reply = self.script.replies.pop(0)
            if callable(reply):
                reply(self.transport)
            else:
                self.transport.write(reply)

    def connectionLost(self, reason):
        self.closed.callback(None)


@pytest.fixture
def server():
    script = Script()
    port = reactor.listenTCP(0, protocol.Factory.forProtocol(lambda: ScriptedServer(script)), interface="127.0.0.1")
    script.url = f"http://127.0.0.1:{port.getHost().port}".encode()
    yield script
    for connection in script.connections:
        connection.transport.abortConnection()
    pytest_twisted.blockon(port.stopListening())


@pytest.fixture
def upstream():
    retries = []
    client = Upstream(reactor, header_timeout=5, idle_timeout=30, on_retry=lambda: retries.append(1))
    client.retries = retries
    yield client
    pytest_twisted.blockon(client.close())


async def ended(reader: Body):
    await reader.done.addTimeout(TIMEOUT, reactor)
    return reader.reason


async def fetch(upstream, url: bytes, method=b"POST", body=b"{}", path=b"/v1/messages"):
    """One request: (response, body bytes, how the body ended)."""
    d = upstream.request(method, url, path, Headers({b"x-api-key": [b"k"]}), body)
    response = await d.addTimeout(TIMEOUT, reactor)
    reader = Body()
    response.deliverBody(reader)
    reason = await ended(reader)
    return response, b"".join(reader.chunks), reason


def later(seconds: float = 0.05):
    return task.deferLater(reactor, seconds, lambda: None)


def written_in_pieces(*pieces, then=None):
    """A reply written in separate reads (a reactor turn apart), then closed or reset if asked."""

    def reply(transport):
        async def go():
            for piece in pieces:
                transport.write(piece)
                await later(0.02)
            if then == "close":
                transport.loseConnection()
            elif then == "reset":
                transport.abortConnection()

        defer.ensureDeferred(go())

    return reply


OK_12 = b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\nrequest-id: r1\r\n\r\nhello world!"


@pytest_twisted.ensureDeferred
async def test_request_bytes_and_keep_alive_reuse(server, upstream):
    server.replies += [OK_12, OK_12]
    response, body, reason = await fetch(upstream, server.url)
    assert (response.code, response.phrase, body) == (200, b"OK", b"hello world!")
    assert response.headers.getRawHeaders(b"request-id") == [b"r1"]
    assert reason.check(ResponseDone)
    await fetch(upstream, server.url)
    (first_conn, head), (second_conn, _) = server.requests
    assert first_conn == second_conn == 0  # one connection, kept alive
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /v1/messages HTTP/1.1"
    assert sorted(lines[1:]) == sorted([b"Host: " + server.url[len(b"http://"):], b"X-Api-Key: k", b"Content-Length: 2"])


@pytest_twisted.ensureDeferred
async def test_chunked_body_split_anywhere_with_trailers(server, upstream):
    server.replies += [
        written_in_pieces(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;ext=1\r\nhel",
            b"lo\r\n6\r",
            b"\n world\r\n0\r\nx-trailer: 1\r\n",
            b"\r\n",
        ),
        OK_12,
    ]
    _, body, reason = await fetch(upstream, server.url)
    assert body == b"hello world" and reason.check(ResponseDone)
    await fetch(upstream, server.url)
    assert [c for c, _ in server.requests] == [0, 0]


@pytest_twisted.ensureDeferred
async def test_body_ended_by_a_clean_close_is_potential_data_loss_and_not_reused(server, upstream):
    server.replies += [written_in_pieces(b"HTTP/1.1 200 OK\r\n\r\npart one, ", b"part two", then="close"), OK_12]
    _, body, reason = await fetch(upstream, server.url)
    assert body == b"part one, part two"
    assert reason.check(PotentialDataLoss)
    await fetch(upstream, server.url)
    assert [c for c, _ in server.requests] == [0, 1]


@pytest.mark.parametrize(
    "reply",
    [
        written_in_pieces(b"HTTP/1.1 200 OK\r\n\r\npart one", then="reset"),
        written_in_pieces(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort", then="close"),
        written_in_pieces(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n", then="close"),
        written_in_pieces(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhelloXX"),
    ],
    ids=["reset-close-delimited", "short-content-length", "chunked-without-last-chunk", "bad-chunk"],
)
@pytest_twisted.ensureDeferred
async def test_a_cut_body_never_looks_complete(server, upstream, reply):
    server.replies.append(reply)
    _, _, reason = await fetch(upstream, server.url)
    assert reason.check(ResponseFailed)


@pytest_twisted.ensureDeferred
async def test_connection_close_response_is_not_reused(server, upstream):
    server.replies += [b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok", OK_12]
    _, body, reason = await fetch(upstream, server.url)
    assert body == b"ok" and reason.check(ResponseDone)
    await server.closed[0].addTimeout(TIMEOUT, reactor)  # cg closed it
    await fetch(upstream, server.url)
    assert [c for c, _ in server.requests] == [0, 1]


@pytest_twisted.ensureDeferred
async def test_interim_responses_are_skipped(server, upstream):
    server.replies.append(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" + OK_12)
    response, body, _ = await fetch(upstream, server.url)
    assert (response.code, body) == (200, b"hello world!")


@pytest_twisted.ensureDeferred
async def test_responses_without_a_body(server, upstream):
    server.replies += [
        b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\n",  # to HEAD
        b"HTTP/1.1 204 No Content\r\n\r\n",
        OK_12,
    ]
    response, body, reason = await fetch(upstream, server.url, method=b"HEAD", body=None)
    assert (response.code, body) == (200, b"") and reason.check(ResponseDone)
    response, body, reason = await fetch(upstream, server.url)
    assert (response.code, body) == (204, b"") and reason.check(ResponseDone)
    await fetch(upstream, server.url)
    assert [c for c, _ in server.requests] == [0, 0, 0]
    assert b"Content-Length" not in server.requests[0][1]


@pytest.mark.parametrize(
    "reply",
    [
        b"SSH-2.0-OpenSSH\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n" + b"x-big: " + b"a" * 300_000,
        b"HTTP/1.1 200 OK\nContent-Length: 2\n\nok",  # bare LF: refused now, not after the header timeout
    ],
)
@pytest_twisted.ensureDeferred
async def test_what_is_not_http_fails_the_request_without_retry(server, upstream, reply):
    server.replies += [OK_12, reply]
    await fetch(upstream, server.url)  # so the next request is on a reused connection
    with pytest.raises(ResponseFailed):
        await upstream.request(b"POST", server.url, b"/", Headers(), b"{}").addTimeout(TIMEOUT, reactor)
    assert upstream.retries == []


@pytest_twisted.ensureDeferred
async def test_reused_connection_dead_before_any_byte_is_retried_once(server, upstream):
    server.replies += [OK_12, lambda transport: transport.abortConnection(), OK_12]
    await fetch(upstream, server.url)
    _, body, _ = await fetch(upstream, server.url)
    assert body == b"hello world!"
    assert upstream.retries == [1]
    assert [c for c, _ in server.requests] == [0, 0, 1]


@pytest_twisted.ensureDeferred
async def test_fresh_connection_dead_before_any_byte_is_not_retried(server, upstream):
    server.replies += [lambda transport: transport.abortConnection(), OK_12]
    with pytest.raises(ConnectionDied):
        await upstream.request(b"POST", server.url, b"/", Headers(), b"{}").addTimeout(TIMEOUT, reactor)
    assert upstream.retries == [] and len(server.requests) == 1


@pytest_twisted.ensureDeferred
async def test_cancel_before_the_head_drops_the_connection(server, upstream):
    server.replies.append(b"")  # never answers
    d = upstream.request(b"POST", server.url, b"/", Headers(), b"{}")
    while not server.requests:
        await later(0.01)
    d.cancel()
    with pytest.raises(CancelledError):
        await d
    await server.closed[0].addTimeout(TIMEOUT, reactor)


@pytest_twisted.ensureDeferred
async def test_stopping_the_body_drops_the_connection_and_a_stale_producer_is_inert(server, upstream):
    server.replies += [OK_12, written_in_pieces(b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\nsome"), OK_12]
    first, _, _ = await fetch(upstream, server.url)
    response = await upstream.request(b"POST", server.url, b"/", Headers(), b"{}").addTimeout(TIMEOUT, reactor)
    assert server.requests[-1][0] == 0  # the first response's connection, reused
    first.stopProducing()  # a stale reference: must not touch the reused connection
    first.pauseProducing()
    reader = Body()
    response.deliverBody(reader)
    response.stopProducing()
    reason = await ended(reader)
    assert reason.check(ResponseFailed)
    await server.closed[0].addTimeout(TIMEOUT, reactor)
    _, body, _ = await fetch(upstream, server.url)
    assert body == b"hello world!" and server.requests[-1][0] == 1


@pytest_twisted.ensureDeferred
async def test_body_taken_later_loses_nothing(server, upstream):
    server.replies.append(written_in_pieces(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n01234", b"56789"))
    response = await upstream.request(b"POST", server.url, b"/", Headers(), b"{}").addTimeout(TIMEOUT, reactor)
    await later(0.2)
    reader = Body()
    response.deliverBody(reader)
    reason = await ended(reader)
    assert b"".join(reader.chunks) == b"0123456789" and reason.check(ResponseDone)


class StopsAtFirstData(Body):
    def dataReceived(self, data):
        super().dataReceived(data)
        self.transport.stopProducing()


@pytest_twisted.ensureDeferred
async def test_a_body_stopped_mid_read_ends_failed_even_if_the_read_held_its_end(server, upstream):
    server.replies.append(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n2\r\ncd\r\n0\r\n\r\n")
    response = await upstream.request(b"POST", server.url, b"/", Headers(), b"{}").addTimeout(TIMEOUT, reactor)
    reader = StopsAtFirstData()
    response.deliverBody(reader)
    reason = await ended(reader)
    assert reason.check(ResponseFailed)
    await server.closed[0].addTimeout(TIMEOUT, reactor)


@pytest_twisted.ensureDeferred
async def test_pool_close_twice_fires_both_and_a_late_connection_is_not_pooled(server):
    held = []
    server.replies += [lambda transport: held.append(transport), OK_12]
    client = Upstream(reactor)
    late = client.request(b"POST", server.url, b"/", Headers(), b"{}")  # connection 0, answered later
    while not held:
        await later(0.01)
    await fetch(client, server.url)  # connection 1, idle in the pool after this
    first, second = client.close(), client.close()
    await defer.gatherResults([first, second]).addTimeout(TIMEOUT, reactor)
    await server.closed[1].addTimeout(TIMEOUT, reactor)
    held[0].write(OK_12)
    response = await late.addTimeout(TIMEOUT, reactor)
    reader = Body()
    response.deliverBody(reader)
    assert (await ended(reader)).check(ResponseDone)
    await server.closed[0].addTimeout(TIMEOUT, reactor)  # closed after its response, not pooled


def test_a_base_url_splits_into_origin_and_path():
    assert split_base("https://api.anthropic.com") == (b"https://api.anthropic.com", b"")
    assert split_base("HTTPS://api.example:8443/") == (b"https://api.example:8443", b"")
    assert split_base("http://[::1]:8080/gateway/openai/") == (b"http://[::1]:8080", b"/gateway/openai")


@pytest.mark.parametrize(
    "url",
    [
        "api.anthropic.com",
        "ftp://api.example",
        "http:///v1",
        "http://api.example:0",
        "http://api.example:",
        "http://api.example:99999",
        "http://api.example:https",
        "http://user:secret@api.example",
        "http://api.example/v1?beta=true",
        "http://api.example/#v1",
        "http://api.example/gateway/../admin",
        "http://api.exämple",
    ],
)
def test_what_is_not_a_base_url_is_refused(url):
    with pytest.raises(ValueError):
        split_base(url)


@pytest_twisted.ensureDeferred
async def test_host_header_drops_only_the_default_port():
    client = Upstream(reactor)
    assert client._target(b"https://api.example:443").host == b"api.example"
    assert client._target(b"https://api.example:8443").host == b"api.example:8443"
    assert client._target(b"http://[::1]:80").host == b"[::1]"
    assert client._target(b"http://[::1]:8080").key == (b"http", b"[::1]", 8080)


@pytest_twisted.ensureDeferred
async def test_a_body_that_is_not_the_gzip_it_claims_cuts_the_client_stream(server, make_cg):
    """Even when the read that broke the decoder also held the body's clean end."""
    server.replies.append(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Encoding: gzip\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n9\r\nnot gzip!\r\n0\r\n\r\n"
    )
    cg = make_cg(anthropic_upstream=server.url.decode())
    request = http_request("POST", "/v1/messages", b"{}", headers=[("anthropic-version", "2023-06-01")])
    client = await connect(cg.port, request)
    data = await client.closed.addTimeout(TIMEOUT, reactor)
    assert not dechunk(data.partition(b"\r\n\r\n")[2])[1]  # no last chunk: it cannot look complete
    assert cg.stats.upstream_errors == 1


class PausesAtOnce(Body):
    def connectionMade(self):
        self.transport.pauseProducing()  # as a client that is not reading pauses a new body


@pytest_twisted.ensureDeferred
async def test_a_body_paused_as_it_is_taken_stays_paused(server, upstream):
    held = []
    server.replies.append(lambda transport: held.append(transport))
    response_d = upstream.request(b"POST", server.url, b"/", Headers(), b"{}")
    while not held:
        await later(0.01)
    held[0].write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n")
    response = await response_d.addTimeout(TIMEOUT, reactor)
    reader = PausesAtOnce()
    response.deliverBody(reader)
    held[0].write(b"0123456789")
    await later(0.2)
    assert reader.chunks == []  # paused: the socket is not read
    response.resumeProducing()
    assert (await ended(reader)).check(ResponseDone)
    assert b"".join(reader.chunks) == b"0123456789"


@pytest_twisted.ensureDeferred
async def test_a_cut_stream_to_a_client_that_was_not_reading_closes_once_it_drains(server, make_cg):
    """cg closes the client's connection after its last bytes, not FLUSH_TIMEOUT later by a reset."""
    ping = b'event: ping\ndata: {"type":"ping"}\n\n' * 1000
    chunk = b"%x\r\n%s\r\n" % (len(ping), ping)
    sent = []

    def flood_then_reset(transport):
        transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        transport.write(chunk * 500)  # ~17 MB: more than the sockets between here and the client hold
        sent.append(transport)

    server.replies.append(flood_then_reset)
    cg = make_cg(anthropic_upstream=server.url.decode())
    request = http_request("POST", "/v1/messages", b"{}", headers=[("anthropic-version", "2023-06-01")])
    client = await connect(cg.port, request, pause_after_first=True)
    await client.first_data
    last = -1
    for _ in range(100):  # until cg stops reading: the client is not
        if cg.stats.bytes_from_upstream == last:
            break
        last = cg.stats.bytes_from_upstream
        await later(0.2)
    # The upstream breaks mid-stream. cg has paused its read for the client, so it learns of the
    # break only once the client reads again and cg drains what it holds.
    sent[0].abortConnection()
    await later(0.05)
    client.transport.resumeProducing()
    data = await client.closed.addTimeout(TIMEOUT, reactor)
    assert client.reason.check(error.ConnectionDone)  # a close after the last byte, not a reset
    assert not dechunk(data.partition(b"\r\n\r\n")[2])[1]  # and still no last chunk
    assert cg.stats.upstream_errors == 1
