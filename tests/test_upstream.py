"""cg.web.upstream, the real client, against a scripted raw HTTP/1.1 server: in memory, then over real sockets.

The fake provider (cg.testing) speaks well-formed HTTP through twisted.web; these replies
are written byte by byte, for the framings and failures it never produces. Most tests run
the real client (its endpoint, pool and connections) on a MemoryReactorClock, connected to
the server through `cg.testing.loopback`: each step is explicit (`net.pump()`), nothing
sleeps, and a paused reader really stops reading; so does cg itself (`cg_in_memory`) where a
test is about what it relays of the upstream leg. A few smoke tests at the end run the
client over real sockets, for the wiring and what the kernel reports (a clean close, a
reset, backpressure). The pool's timers (the idle sweep, the header timeout) are in
test_upstream_clock.py.
"""

import pytest
import pytest_twisted
from helpers.clients import CG_PORT, Body
from rawhttp import RawClient, connect, dechunk, http_request
from twisted.internet import defer, error, protocol, reactor, task
from twisted.internet.defer import CancelledError
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.web.client import ResponseDone, ResponseFailed
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers

from cg.testing import FakeUpstream, JSONReply, SSEReply
from cg.testing.loopback import result_of
from cg.testing.tables import names_in, table_rows
from cg.web import upstream as upstream_module
from cg.web.upstream import ConnectionDied, Upstream, split_base

TIMEOUT = 10
PORT = 8001  # where the scripted server listens on the MemoryReactorClock


class Script:
    """What the server answers: one entry per request, in order, on whatever connection."""

    def __init__(self, *replies):
        self.replies = list(replies)
        self.requests: list[tuple[int, bytes]] = []  # (connection number, request head)
        self.connections: list[ScriptedServer] = []
        self.closed: list[defer.Deferred] = []


class ScriptedServer(protocol.Protocol):
    """Reads requests (head + Content-Length body); answers each with the script's next reply.

    A reply is bytes to write, a list of bytes to write one by one (in memory, each
    arrives as its own read), or a callable given the transport (to hold it, close, or reset).
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
            elif isinstance(reply, list):
                for piece in reply:
                    self.transport.write(piece)
            else:
                self.transport.write(reply)

    def connectionLost(self, reason):
        self.closed.callback(None)


def _serving(script: Script):
    return protocol.Factory.forProtocol(lambda: ScriptedServer(script))


@pytest.fixture
def server(clock):
    """The scripted server, listening on the MemoryReactorClock."""
    script = Script()
    clock.listenTCP(PORT, _serving(script), interface="127.0.0.1")
    script.url = b"http://127.0.0.1:%d" % PORT
    return script


def _upstream(reactor):
    retries = []
    client = Upstream(reactor, header_timeout=5, idle_timeout=30, on_retry=lambda: retries.append(1))
    client.retries = retries
    return client


@pytest.fixture
def upstream(clock):
    return _upstream(clock)


def request(net, upstream, url: bytes, method=b"POST", body=b"{}", path=b"/v1/messages"):
    """Send a request and pump: its response (what the Deferred failed with is raised)."""
    d = upstream.request(method, url, path, Headers({b"x-api-key": [b"k"]}), body)
    net.pump()
    return result_of(d)


def read(net, response) -> Body:
    """Take the response's body and pump."""
    reader = Body()
    response.deliverBody(reader)
    net.pump()
    return reader


def fetch(net, upstream, url: bytes, **kwargs):
    """One request: (response, body bytes, how the body ended)."""
    response = request(net, upstream, url, **kwargs)
    reader = read(net, response)
    return response, b"".join(reader.chunks), reader.reason


OK_12 = b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\nrequest-id: r1\r\n\r\nhello world!"


def test_request_bytes_and_keep_alive_reuse(net, server, upstream):
    server.replies += [OK_12, OK_12]
    response, body, reason = fetch(net, upstream, server.url)
    assert (response.code, response.phrase, body) == (200, b"OK", b"hello world!")
    assert response.headers.getRawHeaders(b"request-id") == [b"r1"]
    assert reason.check(ResponseDone)
    fetch(net, upstream, server.url)
    (first_conn, head), (second_conn, _) = server.requests
    assert first_conn == second_conn == 0  # one connection, kept alive
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /v1/messages HTTP/1.1"
    assert sorted(lines[1:]) == sorted([b"Host: 127.0.0.1:%d" % PORT, b"X-Api-Key: k", b"Content-Length: 2"])


def test_chunked_body_split_anywhere_with_trailers(net, server, upstream):
    server.replies += [
        [
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;ext=1\r\nhel",
            b"lo\r\n6\r",
            b"\n world\r\n0\r\nx-trailer: 1\r\n",
            b"\r\n",
        ],
        OK_12,
    ]
    _, body, reason = fetch(net, upstream, server.url)
    assert body == b"hello world" and reason.check(ResponseDone)
    fetch(net, upstream, server.url)
    assert [c for c, _ in server.requests] == [0, 0]


def test_body_ended_by_a_clean_close_is_potential_data_loss_and_not_reused(net, server, upstream):
    def two_pieces_then_close(transport):
        transport.write(b"HTTP/1.1 200 OK\r\n\r\npart one, ")
        transport.write(b"part two")
        transport.loseConnection()

    server.replies += [two_pieces_then_close, OK_12]
    _, body, reason = fetch(net, upstream, server.url)
    assert body == b"part one, part two"
    assert reason.check(PotentialDataLoss)
    fetch(net, upstream, server.url)
    assert [c for c, _ in server.requests] == [0, 1]


@pytest.mark.parametrize(
    "reply, then",
    [
        (b"HTTP/1.1 200 OK\r\n\r\npart one", "abortConnection"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort", "loseConnection"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n", "loseConnection"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhelloXX", None),
    ],
    ids=["reset-close-delimited", "short-content-length", "chunked-without-last-chunk", "bad-chunk"],
)
def test_a_cut_body_never_looks_complete(net, server, upstream, reply, then):
    server.replies.append(reply)
    reader = read(net, request(net, upstream, server.url))
    if then is not None:  # after what came was read
        assert reader.reason is None
        getattr(server.connections[0].transport, then)()
        net.pump()
    assert reader.reason.check(ResponseFailed)


def test_connection_close_response_is_not_reused(net, server, upstream):
    server.replies += [b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok", OK_12]
    _, body, reason = fetch(net, upstream, server.url)
    assert body == b"ok" and reason.check(ResponseDone)
    assert server.closed[0].called  # cg closed it
    fetch(net, upstream, server.url)
    assert [c for c, _ in server.requests] == [0, 1]


def test_interim_responses_are_skipped(net, server, upstream):
    server.replies.append(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" + OK_12)
    response, body, _ = fetch(net, upstream, server.url)
    assert (response.code, body) == (200, b"hello world!")


def test_responses_without_a_body(net, server, upstream):
    server.replies += [
        b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\n",  # to HEAD
        b"HTTP/1.1 204 No Content\r\n\r\n",
        OK_12,
    ]
    response, body, reason = fetch(net, upstream, server.url, method=b"HEAD", body=None)
    assert (response.code, body) == (200, b"") and reason.check(ResponseDone)
    response, body, reason = fetch(net, upstream, server.url)
    assert (response.code, body) == (204, b"") and reason.check(ResponseDone)
    fetch(net, upstream, server.url)
    assert [c for c, _ in server.requests] == [0, 0, 0]
    assert b"Content-Length" not in server.requests[0][1]


def test_bytes_after_a_body_in_its_read_close_the_connection(net, server, upstream):
    server.replies += [OK_12 + b"HTTP/1.1 200 OK\r\n", OK_12]
    _, body, reason = fetch(net, upstream, server.url)
    assert body == b"hello world!" and reason.check(ResponseDone)
    assert server.closed[0].called
    fetch(net, upstream, server.url)
    assert [c for c, _ in server.requests] == [0, 1]


def test_an_idle_connection_that_got_bytes_is_not_handed_out_before_its_end(net, server, upstream):
    """Twisted's TCP ends an aborted connection on a later turn and does not mark it disconnecting:
    the connection itself must stop counting as usable at once."""
    server.replies += [OK_12]
    fetch(net, upstream, server.url)
    (link,) = net.links
    link.client.dataReceived(OK_12)  # as the transport delivers it, before any later turn
    connection = link.client._wrappedProtocol  # what the endpoint wraps: cg's _Connection
    assert link.client_transport.aborted and not connection.usable


def test_a_response_nobody_asked_for_drops_the_idle_connection(net, server, upstream):
    server.replies += [OK_12, OK_12]
    fetch(net, upstream, server.url)
    server.connections[0].transport.write(OK_12)
    net.pump()
    assert server.closed[0].called
    fetch(net, upstream, server.url)
    assert [c for c, _ in server.requests] == [0, 1]


@pytest.mark.parametrize(
    "reply",
    [
        b"SSH-2.0-OpenSSH\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n" + b"x-big: " + b"a" * 300_000,
        b"HTTP/1.1 200 OK\nContent-Length: 2\n\nok",  # bare LF: refused now, not after the header timeout
    ],
)
def test_what_is_not_http_fails_the_request_without_retry(net, server, upstream, reply):
    server.replies += [OK_12, reply]
    fetch(net, upstream, server.url)  # so the next request is on a reused connection
    with pytest.raises(ResponseFailed):
        request(net, upstream, server.url)
    assert upstream.retries == []
    assert server.closed[0].called


def test_reused_connection_dead_before_any_byte_is_retried_once(net, server, upstream):
    server.replies += [OK_12, lambda transport: transport.abortConnection(), OK_12]
    fetch(net, upstream, server.url)
    _, body, _ = fetch(net, upstream, server.url)
    assert body == b"hello world!"
    assert upstream.retries == [1]
    assert [c for c, _ in server.requests] == [0, 0, 1]


def test_fresh_connection_dead_before_any_byte_is_not_retried(net, server, upstream):
    server.replies += [lambda transport: transport.abortConnection(), OK_12]
    with pytest.raises(ConnectionDied):
        request(net, upstream, server.url)
    assert upstream.retries == [] and len(server.requests) == 1


def test_a_refused_connection_fails_the_request(clock, net, server, upstream):
    d = upstream.request(b"POST", b"http://127.0.0.1:%d" % (PORT + 1), b"/", Headers(), b"{}")
    net.pump()
    clock.advance(0.3)  # HostnameEndpoint tries its next address (there is none) after 0.3 s
    with pytest.raises(error.ConnectionRefusedError):
        result_of(d)


def test_cancel_before_the_head_drops_the_connection(net, server, upstream):
    server.replies.append(b"")  # never answers
    d = upstream.request(b"POST", server.url, b"/", Headers(), b"{}")
    net.pump()
    assert server.requests
    d.cancel()
    with pytest.raises(CancelledError):
        result_of(d)
    net.pump()
    assert server.closed[0].called


def test_stopping_the_body_drops_the_connection_and_a_stale_producer_is_inert(net, server, upstream):
    server.replies += [OK_12, b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\nsome", OK_12]
    first, _, _ = fetch(net, upstream, server.url)
    response = request(net, upstream, server.url)
    assert server.requests[-1][0] == 0  # the first response's connection, reused
    first.stopProducing()  # a stale reference: must not touch the reused connection
    first.pauseProducing()
    reader = Body()
    response.deliverBody(reader)
    assert reader.chunks == [b"some"]
    response.stopProducing()
    assert reader.reason is None  # the body ends later, never inside stopProducing
    net.pump()
    assert reader.reason.check(ResponseFailed)
    assert server.closed[0].called
    _, body, _ = fetch(net, upstream, server.url)
    assert body == b"hello world!" and server.requests[-1][0] == 1


def test_body_taken_later_loses_nothing_and_waits_unread(net, server, upstream):
    held = []
    server.replies.append(lambda transport: held.append(transport))
    d = upstream.request(b"POST", server.url, b"/", Headers(), b"{}")
    net.pump()
    held[0].write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n01234")
    net.pump()
    response = result_of(d)
    held[0].write(b"56789")
    net.pump()
    assert net.links[0].client_transport.paused  # nobody took the body: the connection is not read
    reader = read(net, response)
    assert b"".join(reader.chunks) == b"0123456789" and reader.reason.check(ResponseDone)
    assert reader.chunks == [b"01234", b"56789"]  # the second read came only once the body was taken


class StopsAtFirstData(Body):
    def dataReceived(self, data):
        super().dataReceived(data)
        self.transport.stopProducing()


def test_a_body_stopped_mid_read_ends_failed_even_if_the_read_held_its_end(net, server, upstream):
    server.replies.append(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    response = request(net, upstream, server.url)
    reader = StopsAtFirstData()
    response.deliverBody(reader)
    server.connections[0].transport.write(b"2\r\nab\r\n2\r\ncd\r\n0\r\n\r\n")  # one read, with the body's end
    net.pump()
    assert reader.chunks == [b"abcd"]
    assert reader.reason.check(ResponseFailed)
    assert server.closed[0].called


def test_pool_close_twice_fires_both_and_a_late_connection_is_not_pooled(net, server, upstream):
    held = []
    server.replies += [lambda transport: held.append(transport), OK_12]
    late = upstream.request(b"POST", server.url, b"/", Headers(), b"{}")  # connection 0, answered later
    net.pump()
    fetch(net, upstream, server.url)  # connection 1, idle in the pool after this
    first, second = upstream.close(), upstream.close()
    net.pump()
    assert first.called and second.called
    assert server.closed[1].called
    held[0].write(OK_12)
    net.pump()
    reader = read(net, result_of(late))
    assert reader.reason.check(ResponseDone)
    assert server.closed[0].called  # closed after its response, not pooled


class PausesAtOnce(Body):
    def connectionMade(self):
        self.transport.pauseProducing()  # as a client that is not reading pauses a new body


def test_a_body_paused_as_it_is_taken_stays_paused(net, server, upstream):
    server.replies.append(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n")
    response = request(net, upstream, server.url)
    reader = PausesAtOnce()
    response.deliverBody(reader)
    server.connections[0].transport.write(b"0123456789")
    net.pump()
    assert reader.chunks == [] and net.links[0].client_transport.paused  # paused: the connection is not read
    response.resumeProducing()
    net.pump()
    assert reader.reason.check(ResponseDone)
    assert b"".join(reader.chunks) == b"0123456789"


def test_a_paused_body_is_resumed_once_it_ends_so_its_connection_serves_again(net, server, upstream):
    server.replies += [b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\n", OK_12]
    response = request(net, upstream, server.url)
    reader = Body()
    response.deliverBody(reader)
    response.pauseProducing()
    response.resumeProducing()
    response.pauseProducing()
    server.connections[0].transport.write(b"ab")
    net.pump()
    assert reader.chunks == []
    response.resumeProducing()
    server.connections[0].transport.write(b"cd")
    net.pump()
    assert reader.reason.check(ResponseDone)
    response.pauseProducing()  # a stale reference again: the pooled connection reads on
    _, body, _ = fetch(net, upstream, server.url)
    assert body == b"hello world!" and [c for c, _ in server.requests] == [0, 0]


def test_the_real_client_against_the_fake_provider_in_memory(clock, net, upstream):
    """The fake's twisted.web Site, pumped in memory: its stream's events arrive on the clock, as they are sent."""
    fake = FakeUpstream()
    fake.listen(clock, PORT + 2)
    fake.enqueue(SSEReply([b"event: a\ndata: 1\n\n", b"event: b\ndata: 2\n\n"], delay=1.0), JSONReply({"ok": 1}))
    response = request(net, upstream, fake.url.encode())
    assert response.headers.getRawHeaders(b"content-type") == [b"text/event-stream"]
    reader = read(net, response)
    assert reader.chunks == [b"event: a\ndata: 1\n\n"] and reader.reason is None
    clock.advance(1)
    net.pump()
    assert reader.chunks[1:] == [b"event: b\ndata: 2\n\n"] and reader.reason.check(ResponseDone)
    _, body, _ = fetch(net, upstream, fake.url.encode())
    assert body == b'{"ok":1}'
    first, second = fake.received
    assert (first.body, (b"x-api-key", b"k") in first.headers) == (b"{}", True)
    assert (second.connection, second.nth_on_connection) == (first.connection, 2)  # kept alive


def test_a_body_that_is_not_the_gzip_it_claims_cuts_the_client_stream(clock, net, server, cg_in_memory):
    """Even when the read that broke the decoder also held the body's clean end (in memory, a write is a read)."""
    server.replies.append(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Encoding: gzip\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n9\r\nnot gzip!\r\n0\r\n\r\n"
    )
    cg = cg_in_memory(anthropic_upstream=server.url.decode())
    client = RawClient(http_request("POST", "/v1/messages", b"{}", headers=[("anthropic-version", "2023-06-01")]))
    connectProtocol(TCP4ClientEndpoint(clock, "127.0.0.1", CG_PORT), client)
    net.pump()
    assert client.closed.called
    assert client.data.startswith(b"HTTP/1.1 200 OK\r\n")
    assert not dechunk(client.data.partition(b"\r\n\r\n")[2])[1]  # no last chunk: it cannot look complete
    assert cg.stats.upstream_errors == 1


def test_the_connections_table_names_every_state_and_leads_only_to_states():
    states = {state.name for state in upstream_module._State}
    rows = table_rows(upstream_module._Connection.__doc__)
    assert {state for state, _, _ in rows} == states
    for _, _, action in rows:
        assert names_in(action.partition("→")[2], states), action  # each row says where it leads


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


def test_host_header_drops_only_the_default_port(clock):
    client = Upstream(clock)
    assert client._target(b"https://api.example:443").host == b"api.example"
    assert client._target(b"https://api.example:8443").host == b"api.example:8443"
    assert client._target(b"http://[::1]:80").host == b"[::1]"
    assert client._target(b"http://[::1]:8080").key == (b"http", b"[::1]", 8080)


# ---------------------------------------------------------------------------------------------
# Over real sockets: the wiring (endpoint, TCP, the global reactor) and what the kernel reports


@pytest.fixture
def socket_server():
    script = Script()
    port = reactor.listenTCP(0, _serving(script), interface="127.0.0.1")
    script.url = f"http://127.0.0.1:{port.getHost().port}".encode()
    yield script
    for connection in script.connections:
        connection.transport.abortConnection()
    pytest_twisted.blockon(port.stopListening())


@pytest.fixture
def socket_upstream():
    client = _upstream(reactor)
    yield client
    pytest_twisted.blockon(client.close())


async def ended(reader: Body):
    await reader.done.addTimeout(TIMEOUT, reactor)
    return reader.reason


async def fetch_over_sockets(upstream, url: bytes):
    """One request: (response, body bytes, how the body ended)."""
    d = upstream.request(b"POST", url, b"/v1/messages", Headers({b"x-api-key": [b"k"]}), b"{}")
    response = await d.addTimeout(TIMEOUT, reactor)
    reader = Body()
    response.deliverBody(reader)
    reason = await ended(reader)
    return response, b"".join(reader.chunks), reason


def later(seconds: float = 0.05):
    return task.deferLater(reactor, seconds, lambda: None)


@pytest_twisted.ensureDeferred
async def test_over_sockets_a_request_and_a_reused_connection(socket_server, socket_upstream):
    socket_server.replies += [OK_12, OK_12]
    response, body, reason = await fetch_over_sockets(socket_upstream, socket_server.url)
    assert (response.code, body) == (200, b"hello world!") and reason.check(ResponseDone)
    await fetch_over_sockets(socket_upstream, socket_server.url)
    (first_conn, head), (second_conn, _) = socket_server.requests
    assert first_conn == second_conn == 0  # one connection, kept alive
    assert head.startswith(b"POST /v1/messages HTTP/1.1\r\n")


@pytest.mark.parametrize("end, complete", [("loseConnection", True), ("abortConnection", False)], ids=["close", "reset"])
@pytest_twisted.ensureDeferred
async def test_over_sockets_a_close_delimited_body_ends_as_the_kernel_says(socket_server, socket_upstream, end, complete):
    """A clean close (FIN) completes it (PotentialDataLoss); a reset (RST) cuts it (ResponseFailed)."""
    held = []
    socket_server.replies += [lambda transport: held.append(transport), OK_12]
    d = socket_upstream.request(b"POST", socket_server.url, b"/", Headers(), b"{}")
    while not held:
        await later(0.01)
    held[0].write(b"HTTP/1.1 200 OK\r\n\r\npart one")
    response = await d.addTimeout(TIMEOUT, reactor)
    reader = Body()
    response.deliverBody(reader)
    while not reader.chunks:
        await later(0.01)
    getattr(held[0], end)()
    reason = await ended(reader)
    assert b"".join(reader.chunks) == b"part one"
    assert reason.check(PotentialDataLoss if complete else ResponseFailed)
    await fetch_over_sockets(socket_upstream, socket_server.url)
    assert [c for c, _ in socket_server.requests] == [0, 1]  # never reused



@pytest_twisted.ensureDeferred
async def test_a_cut_stream_to_a_client_that_was_not_reading_closes_once_it_drains(socket_server, make_cg):
    """cg closes the client's connection after its last bytes, not FLUSH_TIMEOUT later by a reset."""
    ping = b'event: ping\ndata: {"type":"ping"}\n\n' * 1000
    chunk = b"%x\r\n%s\r\n" % (len(ping), ping)
    sent = []

    def flood_then_reset(transport):
        transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        transport.write(chunk * 500)  # ~17 MB: more than the sockets between here and the client hold
        sent.append(transport)

    socket_server.replies.append(flood_then_reset)
    cg = make_cg(anthropic_upstream=socket_server.url.decode())
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
