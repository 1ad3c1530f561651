"""cg.web.upstream's timers on a Clock: each connection the pool opens is an in-memory transport.

A MemoryReactorClock records the connection attempt (an IP literal needs no resolver); the test
connects the attempt's protocol to a StringTransport and writes the provider's bytes into it.
"""

from helpers.clients import Body
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.web.client import ResponseDone
from twisted.web.http_headers import Headers
from zope.interface.verify import verifyObject

from cg.web.upstream import HeaderTimeout, IUpstream, IUpstreamResponse, Upstream

ORIGIN = b"http://127.0.0.1:9"
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


class TCPTransport(StringTransport):
    """A StringTransport taking the TCP options cg sets on an upstream connection."""

    def setTcpNoDelay(self, enabled):
        pass

    def setTcpKeepAlive(self, enabled):
        pass


def send(clock: MemoryReactorClock, upstream: Upstream) -> tuple:
    """A request on a new connection: (its Deferred, the connection's protocol, its transport)."""
    d = upstream.request(b"POST", ORIGIN, b"/v1/messages", Headers(), b"{}")
    factory = clock.tcpClients[-1][2]
    protocol = factory.buildProtocol(None)
    transport = TCPTransport()
    protocol.makeConnection(transport)
    assert transport.value().startswith(b"POST /v1/messages HTTP/1.1\r\n")
    return d, protocol, transport


def answer(d, protocol):
    """The provider answers OK; the whole body is read, so the connection goes back to the pool."""
    protocol.dataReceived(OK)
    response = d.result
    body = Body()
    response.deliverBody(body)
    assert body.chunks == [b"ok"] and body.reason.check(ResponseDone)
    return response


def test_the_real_classes_provide_the_interfaces():
    clock = MemoryReactorClock()
    upstream = Upstream(clock)
    assert verifyObject(IUpstream, upstream)
    d, protocol, _ = send(clock, upstream)
    assert verifyObject(IUpstreamResponse, answer(d, protocol))


def test_idle_connections_are_capped_then_closed_by_the_sweep_after_the_idle_timeout():
    """At most max_idle_per_host stay; each goes at the first sweep after it idled idle_timeout (sweeps every half)."""
    clock = MemoryReactorClock()
    upstream = Upstream(clock, idle_timeout=30, max_idle_per_host=2)
    sent = [send(clock, upstream) for _ in range(3)]  # at once: three connections
    assert len(clock.tcpClients) == 3
    (a, a_t), (b, b_t), (c, c_t) = [((d, p), t) for d, p, t in sent]
    answer(*a)
    answer(*b)  # at 0 s
    clock.advance(10)
    answer(*c)  # at 10 s: a third idle one, so the oldest goes at once
    assert [t.disconnecting for t in (a_t, b_t, c_t)] == [True, False, False]
    clock.advance(5)  # the first sweep, at 15 s: nothing idled 30 s
    clock.advance(14.9)
    assert not b_t.disconnecting
    clock.advance(0.1)  # the sweep at 30 s: b idled 30 s, c 20 s
    assert (b_t.disconnecting, c_t.disconnecting) == (True, False)
    clock.advance(14.9)
    assert not c_t.disconnecting
    clock.advance(0.1)  # the sweep at 45 s: c idled 35 s
    assert c_t.disconnecting
    assert clock.getDelayedCalls() == []  # nothing idle, no sweep


def test_a_response_head_that_does_not_come_in_time_fails_with_header_timeout():
    clock = MemoryReactorClock()
    upstream = Upstream(clock, header_timeout=600)
    d, protocol, transport = send(clock, upstream)
    clock.advance(599.9)
    assert not d.called
    protocol.dataReceived(b"HTTP/1.1 200 OK\r\n")  # a head that begins is not yet in time
    clock.advance(0.1)
    assert transport.disconnected  # the connection is dropped: the provider stops
    failures = []
    d.addErrback(failures.append)
    assert failures[0].check(HeaderTimeout)
