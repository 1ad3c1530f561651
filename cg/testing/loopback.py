"""An in-memory network on a MemoryReactorClock, for the real upstream client and a real server.

In the spirit of treq's StubTreq (a real Agent against a real Site, in memory), one level
lower: whatever connects over the MemoryReactorClock (`cg.web.upstream.Upstream`, through its
endpoint and pool) reaches whatever listens on it (the fake provider's Site, after
``FakeUpstream.listen(clock, port)``, or any server factory), over a pair of
`twisted.test.iosim` transports. Nothing moves until the test calls `Loopback.pump`, which
moves bytes, connections and ends until nothing moves, running the clock's due calls (never
advancing its time): a test is a sequence of steps, with no sleep and no kernel.

Where iosim's own `IOPump` is lax, this one behaves as a TCP connection under Twisted does:

- each write arrives as one read (the split is the writer's; a test writes pieces to get pieces);
- a reader that paused its transport (`pauseProducing`) gets nothing, not even the end of the
  connection, until it resumes; one that closed or aborted its end reads nothing more;
- `loseConnection` ends the connection once what was written is delivered: both ends see
  ConnectionDone; `abortConnection` is a reset: what was not delivered yet is lost, and both
  ends see ConnectionLost (the aborting one on the next step, never inside the call).

What it does not model: the writer's side of backpressure (a transport buffers without bound
and never pauses its producer), TLS, and a listening port closing (a MemoryReactor's ports
never stop). Tests about those stay on real sockets.
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import Any, TypeVar

from twisted.internet import error
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IProtocol
from twisted.internet.testing import MemoryReactorClock
from twisted.python.failure import Failure
from twisted.test import iosim

__all__ = ["Link", "Loopback", "LoopbackTransport", "result_of"]

_T = TypeVar("_T")
_MAX_STEPS = 10_000  # a pump that still moves after this many steps is a loop, not a test


class LoopbackTransport(iosim.FakeTransport):
    """One end of a `Link`: an iosim transport whose pause, close and abort mean what TCP's do."""

    def __init__(self, protocol: IProtocol, is_server: bool, host: IPv4Address, peer: IPv4Address) -> None:
        super().__init__(protocol, is_server, host, peer)  # type: ignore[no-untyped-call]  # untyped in Twisted
        self.stream: deque[bytes] = deque()  # written, not delivered yet: one write a read
        self.paused = False  # its protocol stopped reading
        self.aborted = False
        self.lost = False  # its protocol got connectionLost

    def pauseProducing(self) -> None:
        self.paused = True

    def resumeProducing(self) -> None:
        self.paused = False

    def abortConnection(self) -> None:
        if not self.lost:  # as Twisted's TCP: not `disconnecting`, the end comes on a later step
            self.aborted = True
            self.stream.clear()  # a reset: what was not delivered is lost

    def _lose(self, reason: Exception) -> None:
        self.lost = True
        self.disconnected = True
        self.disconnecting = True
        self.protocol.connectionLost(Failure(reason))


class Link:
    """One connection: its client and server protocols, each with its transport."""

    def __init__(self, client: IProtocol, server: IProtocol, client_transport: LoopbackTransport,
                 server_transport: LoopbackTransport) -> None:
        self.client = client
        self.server = server
        self.client_transport = client_transport
        self.server_transport = server_transport

    @property
    def closed(self) -> bool:
        return self.client_transport.lost and self.server_transport.lost

    def step(self) -> bool:
        """Deliver what each end wrote (a write a read) and any end; whether anything moved."""
        moved = False
        ends = ((self.client_transport, self.server_transport), (self.server_transport, self.client_transport))
        for source, reader in ends:
            # A reader that closed or aborted its end reads no more, as Twisted's TCP stops reading then.
            while source.stream and not reader.paused and not (reader.disconnecting or reader.aborted):
                reader.protocol.dataReceived(source.stream.popleft())
                moved = True
            if source.producer is not None and not source.streamingProducer and not source.lost:
                source.producer.resumeProducing()  # a pull producer writes again once its writes are out
        for source, reader in ends:
            if not (source.disconnecting or source.aborted) or source.stream:
                continue
            reason = error.ConnectionLost() if source.aborted else error.ConnectionDone()
            if not source.lost:
                source._lose(reason)
                moved = True
            if not reader.lost and not reader.paused:  # a paused reader learns of the end once it reads again
                reader._lose(reason)
                moved = True
        return moved


class Loopback:
    """Connects the MemoryReactorClock's TCP clients to its listeners, and moves their bytes on `pump`.

    A connection to a port nothing listens on is refused (ConnectionRefusedError). Every
    connection made is in `links`, oldest first.
    """

    def __init__(self, reactor: MemoryReactorClock) -> None:
        self.reactor = reactor
        self.links: list[Link] = []
        self._ports = itertools.count(40000)  # the clients' ephemeral ports

    def pump(self) -> None:
        """Run the clock's due calls, connect, deliver and end, until nothing moves."""
        for _ in range(_MAX_STEPS):
            self.reactor.advance(0)
            moved = self._connect()
            for link in self.links:
                if not link.closed:
                    moved = link.step() or moved
            if not moved:
                return
        raise AssertionError(f"still moving after {_MAX_STEPS} steps")

    def _connect(self) -> bool:
        reactor = self.reactor
        moved = False
        while reactor.tcpClients:
            host, port, factory, _timeout, _bind = reactor.tcpClients.pop(0)
            connector = reactor.connectors.pop(0)  # MemoryReactor keeps both lists in step (TCP only here)
            moved = True
            if connector.stoppedConnecting:
                continue
            server_factory = next(
                (f for p, f, _backlog, interface in reactor.tcpServers
                 if p == port and interface in ("", "0.0.0.0", host)),
                None,
            )
            server_address = IPv4Address("TCP", host, port)
            client_address = IPv4Address("TCP", host, next(self._ports))
            server = server_factory.buildProtocol(client_address) if server_factory is not None else None
            client = factory.buildProtocol(server_address) if server is not None else None
            if server is None or client is None:  # nothing listens, or it turned the connection down
                refused = error.ConnectionRefusedError()
                factory.clientConnectionFailed(connector, Failure(refused))
                continue
            client_transport = LoopbackTransport(client, False, client_address, server_address)
            server_transport = LoopbackTransport(server, True, server_address, client_address)
            server.makeConnection(server_transport)
            client.makeConnection(client_transport)
            self.links.append(Link(client, server, client_transport, server_transport))
        return moved


def result_of(d: Deferred[_T]) -> _T:
    """What `d` fired with (raising what it failed with): read after `Loopback.pump`.

    AssertionError when it has not fired. Takes the result, as trial's successResultOf does.
    """
    results: list[Any] = []
    d.addBoth(results.append)
    if not results:
        raise AssertionError(f"{d!r} has not fired")
    result = results[0]
    if isinstance(result, Failure):
        result.raiseException()
    return result  # type: ignore[no-any-return]
