"""The client leg's request-head deadline: on a Clock with in-memory transports, then once over real sockets."""

import pytest
from pytest_twisted import inlineCallbacks
from rawhttp import connect, http_request, split_response
from twisted.internet import error, reactor
from twisted.internet.address import IPv4Address
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.web import resource, server

from cg.testing import SSEReply, anthropic_stream_events
from cg.web.site import ProxySite

TIMEOUT = 30.0
PEER = IPv4Address("TCP", "127.0.0.1", 40000)


class Answers(resource.Resource):
    """`GET /` answers at once; `GET /stream` writes a first chunk and stays open (a live stream)."""

    isLeaf = True

    def __init__(self):
        super().__init__()
        self.streams = []

    def render_GET(self, request):
        if request.path == b"/stream":
            request.write(b"data: first\n\n")
            self.streams.append(request)
            return server.NOT_DONE_YET
        return b"ok"

    def render_POST(self, request):
        return b"got %d" % len(request.content.getvalue())


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def connection(clock):
    """A new client connection to a ProxySite on `clock`: (channel, transport, resource)."""
    answers = Answers()
    site = ProxySite(answers, 1 << 20, request_head_timeout=TIMEOUT, reactor=clock)
    channel = site.buildProtocol(PEER)
    transport = StringTransport(peerAddress=PEER)
    channel.makeConnection(transport)
    return channel, transport, answers


def closed_with_408(transport) -> bool:
    return transport.disconnecting and transport.value().startswith(b"HTTP/1.1 408 Request Timeout\r\n")


def test_a_connection_that_sends_nothing_is_closed(clock, connection):
    _channel, transport, _ = connection
    clock.advance(TIMEOUT - 0.1)
    assert not transport.disconnecting
    clock.advance(0.1)
    assert closed_with_408(transport)


def test_slowloris_is_cut_from_the_connections_start_not_its_last_byte(clock, connection, cg_log):
    channel, transport, _ = connection
    head = b"GET / HTTP/1.1\r\nHost: cg\r\nX-Slow: " + b"a" * 100
    for second in range(29):  # a byte a second: twisted.web's idle timeout restarts on each
        channel.dataReceived(head[second : second + 1])
        clock.advance(1)
    channel.dataReceived(head[29:30])
    clock.advance(0.9)
    assert not transport.disconnecting  # 29.9 s after the connection began
    clock.advance(0.1)
    assert closed_with_408(transport)
    assert cg_log.containing("request head") == [
        "cg closed a connection from 127.0.0.1:40000: no complete request head within 30 s"
    ]


def test_a_live_stream_is_never_cut(clock, connection):
    channel, transport, answers = connection
    channel.dataReceived(b"GET /stream HTTP/1.1\r\nHost: cg\r\n\r\n")
    clock.advance(10 * TIMEOUT)
    assert not transport.disconnecting
    answers.streams[0].write(b"data: still here\n\n")
    answers.streams[0].finish()
    assert not transport.disconnecting and transport.value().endswith(b"0\r\n\r\n")


def test_a_slow_body_is_not_timed_by_it(clock, connection):
    channel, transport, _ = connection
    channel.dataReceived(b"POST / HTTP/1.1\r\nHost: cg\r\nContent-Length: 40\r\n\r\n")
    for _ in range(40):
        clock.advance(2)
        channel.dataReceived(b"x")
    assert not transport.disconnecting
    assert transport.value().endswith(b"got 40")


def test_kept_alive_connection_idles_then_its_next_head_is_timed(clock, connection):
    channel, transport, _ = connection
    assert channel.timeOut > TIMEOUT
    channel.dataReceived(b"GET / HTTP/1.1\r\nHost: cg\r\n\r\n")
    assert transport.value().endswith(b"ok")
    transport.clear()
    clock.advance(channel.timeOut - 1)  # past TIMEOUT, within twisted.web's idle timeout: it stays
    assert not transport.disconnecting
    channel.dataReceived(b"GET / HTTP/1.1\r\n")  # the next request begins, and stalls
    clock.advance(TIMEOUT - 0.1)
    assert not transport.disconnecting
    clock.advance(0.1)
    assert closed_with_408(transport)


def test_a_pipelined_request_is_timed_from_the_end_of_the_one_before(clock, connection):
    channel, transport, answers = connection
    channel.dataReceived(b"GET /stream HTTP/1.1\r\nHost: cg\r\n\r\nGET / HTTP/1.1\r\n")
    clock.advance(2 * TIMEOUT)  # the stream goes on; the queued half head waits unjudged
    assert not transport.disconnecting
    answers.streams[0].finish()
    clock.advance(TIMEOUT - 0.1)
    assert not transport.disconnecting
    clock.advance(0.1)
    assert transport.disconnecting and b"HTTP/1.1 408" in transport.value()


@inlineCallbacks
def test_a_stream_longer_than_the_timeout_arrives_whole_over_real_sockets(make_cg, fake):
    """Against a real reactor and sockets, with a 0.5 s deadline: the stream takes ~1.5 s."""
    cg = make_cg(anthropic_upstream=fake.url, request_head_timeout=0.5)
    events = anthropic_stream_events(["one", " two", " three", " four", " five", " six"])
    fake.enqueue(SSEReply(events, delay=1.5 / len(events)))
    stalled = yield connect(cg.port, b"POST /v1/messages HTTP/1.1\r\nHost: cg\r\n")  # never finishes its head
    client = yield connect(cg.port, http_request("POST", "/v1/messages", b'{"stream":true}',
                                                 [("content-type", "application/json")]))
    status, _headers, body = split_response((yield client.closed))
    assert status == 200
    assert body == b"".join(events)  # whole: split_response refuses a chunked body cut short
    assert (yield stalled.closed.addTimeout(5, reactor)).startswith(b"HTTP/1.1 408 ")


def closes(connection) -> list[bool]:
    """What `when_closed` tells of `connection`'s end: [by_client], once it is gone."""
    channel, _, _ = connection
    told = []
    channel.when_closed(told.append)
    return told


def test_a_clean_close_of_the_clients_own_is_told_as_by_the_client(connection):
    channel, _, _ = connection
    told = closes(connection)
    channel.dataReceived(b"GET / HTTP/1.1\r\nHost: cg\r\n\r\n")
    assert told == []
    channel.connectionLost(Failure(error.ConnectionDone()))  # its FIN: it exited, or let go
    assert told == [True]
    late = []
    channel.when_closed(late.append)  # a watcher that comes after the end hears of it at once
    assert late == [True] and told == [True]


def test_a_reset_or_a_close_of_cgs_is_not_the_clients_leaving(clock, connection):
    channel, _, _ = connection
    told = closes(connection)
    channel.connectionLost(Failure(error.ConnectionLost()))  # a reset (Claude Code's idle connections)
    assert told == [False]

    for idle in (True, False):
        answers = Answers()
        site = ProxySite(answers, 1 << 20, request_head_timeout=TIMEOUT, reactor=clock, timeout=600)
        channel = site.buildProtocol(PEER)
        transport = StringTransport(peerAddress=PEER)
        channel.makeConnection(transport)
        told = []
        channel.when_closed(told.append)
        if idle:  # cg's idle timeout closes it
            channel.dataReceived(b"GET / HTTP/1.1\r\nHost: cg\r\n\r\n")
            clock.advance(600)
        else:  # the client asked for it
            channel.dataReceived(b"GET / HTTP/1.1\r\nHost: cg\r\nConnection: close\r\n\r\n")
        assert transport.disconnecting
        channel.connectionLost(Failure(error.ConnectionDone()))
        assert told == [False], idle
