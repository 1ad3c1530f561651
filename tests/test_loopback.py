"""cg.testing.loopback: connections in memory that pause, close and reset as TCP's do under Twisted.

test_upstream.py trusts it: a paused reader reads nothing, a write is a read, an abort is a reset.
"""

import pytest
from twisted.internet import defer, error, protocol
from twisted.internet.testing import MemoryReactorClock

from cg.testing.loopback import Loopback, result_of


class Recorder(protocol.Protocol):
    def __init__(self):
        self.reads: list[bytes] = []
        self.reason = None

    def dataReceived(self, data):
        self.reads.append(data)

    def connectionLost(self, reason):
        self.reason = reason


@pytest.fixture
def net():
    """A Loopback on a MemoryReactorClock of its own (`net.reactor`)."""
    return Loopback(MemoryReactorClock())


class Refused(protocol.ClientFactory):
    protocol = Recorder
    reason = None

    def clientConnectionFailed(self, connector, reason):
        self.reason = reason


@pytest.fixture
def link(net):
    """A Recorder client connected to a Recorder server: their Link."""
    net.reactor.listenTCP(9000, protocol.Factory.forProtocol(Recorder))
    net.reactor.connectTCP("127.0.0.1", 9000, protocol.ClientFactory.forProtocol(Recorder))
    net.pump()
    (link,) = net.links
    assert isinstance(link.client, Recorder) and isinstance(link.server, Recorder)
    return link


def test_each_write_is_one_read_in_order_both_ways(net, link):
    link.server_transport.write(b"a")
    link.server_transport.writeSequence([b"b", b"c"])
    link.client_transport.write(b"x")
    net.pump()
    assert link.client.reads == [b"a", b"bc"] and link.server.reads == [b"x"]


def test_a_paused_reader_reads_nothing_not_even_the_close_until_it_resumes(net, link):
    link.client_transport.pauseProducing()
    link.server_transport.write(b"a")
    link.server_transport.loseConnection()
    net.pump()
    assert link.client.reads == [] and link.client.reason is None
    assert link.server.reason is None  # the closing end ends once its bytes are delivered
    link.client_transport.resumeProducing()
    net.pump()
    assert link.client.reads == [b"a"] and link.client.reason.check(error.ConnectionDone)
    assert link.server.reason.check(error.ConnectionDone)


def test_an_abort_is_a_reset_seen_by_both_ends_after_the_call(net, link):
    link.server_transport.write(b"delivered")
    net.pump()
    link.server_transport.write(b"lost")
    link.server_transport.abortConnection()
    assert link.server.reason is None  # never from inside abortConnection
    net.pump()
    assert link.client.reads == [b"delivered"]
    assert link.client.reason.check(error.ConnectionLost) and link.server.reason.check(error.ConnectionLost)


def test_an_end_that_closed_reads_no_more(net, link):
    link.client_transport.loseConnection()
    link.server_transport.write(b"late")
    net.pump()
    assert link.client.reads == [] and link.client.reason.check(error.ConnectionDone)


def test_a_port_nothing_listens_on_refuses(net):
    factory = Refused()
    net.reactor.connectTCP("127.0.0.1", 9001, factory)
    net.pump()
    assert factory.reason.check(error.ConnectionRefusedError) and net.links == []


def test_result_of_gives_a_result_raises_a_failure_and_refuses_what_has_not_fired():
    assert result_of(defer.succeed(1)) == 1
    with pytest.raises(ValueError):
        result_of(defer.fail(ValueError()))
    with pytest.raises(AssertionError):
        result_of(defer.Deferred())
