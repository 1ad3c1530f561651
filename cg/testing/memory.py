"""An upstream in memory, for tests that drive cg's proxy on a Clock (in the spirit of treq's StubTreq).

`MemoryUpstream` takes the place of `cg.web.upstream.Upstream`: every request cg sends
waits in `requests` until the test answers it, with a head it chooses (`respond`) or a
failure (`fail`: `HeaderTimeout()`, `ConnectionRefusedError()`, ...). The response's body
is fed chunk by chunk (`write`), then ended cleanly (`finish`), by a clean close
(`close`: PotentialDataLoss, as a body without a length ends), or cut (`fail`). Like the
real one, the response is its body's push producer, and it records every
pause/resume/stop cg makes on it in `producer_calls`.
"""

from __future__ import annotations

from collections.abc import Iterable

from twisted.internet import defer, error
from twisted.internet.interfaces import IProtocol, IReactorTime
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone, ResponseFailed
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from zope.interface import implementer

from cg.web.upstream import IUpstream, IUpstreamResponse


@implementer(IUpstream)
class MemoryUpstream:
    """Records each request cg sends (`requests`, oldest first); the test answers them.

    `reactor` is where a stopped body's end arrives: on a later turn, never from inside
    `stopProducing`, as with a real connection (on a MemoryReactorClock, `advance(0)`).
    """

    def __init__(self, reactor: IReactorTime) -> None:
        self.reactor = reactor
        self.requests: list[MemoryRequest] = []
        self.closed = False

    def request(self, method: bytes, origin: bytes, path: bytes, headers: Headers,
                body: bytes | None) -> defer.Deferred[MemoryResponse]:
        request = MemoryRequest(self, method, origin, path, headers, body)
        self.requests.append(request)
        return request.result

    def close(self) -> defer.Deferred[None]:
        self.closed = True
        return defer.succeed(None)


class MemoryRequest:
    """One request cg sent: what it sent, and the means to answer it (once)."""

    def __init__(self, upstream: MemoryUpstream, method: bytes, origin: bytes, path: bytes, headers: Headers,
                 body: bytes | None) -> None:
        self._upstream = upstream
        self.method = method
        self.origin = origin
        self.path = path
        self.headers = headers
        self.body = body
        self.cancelled = False  # cg gave up waiting for the head (its client left, say)
        self.result: defer.Deferred[MemoryResponse] = defer.Deferred(self._cancel)

    def _cancel(self, _d: defer.Deferred[MemoryResponse]) -> None:
        self.cancelled = True

    def respond(self, code: int = 200, headers: Iterable[tuple[str | bytes, str | bytes]] = (),
                phrase: bytes = b"OK") -> MemoryResponse:
        """The response head arrives; returns the response, to feed its body."""
        response = MemoryResponse(self._upstream.reactor, code, phrase, headers)
        self.result.callback(response)
        return response

    def fail(self, reason: Exception | Failure) -> None:
        """The request fails before a head: `HeaderTimeout()`, `error.ConnectionRefusedError()`, ..."""
        self.result.errback(reason)


def _bytes(value: str | bytes) -> bytes:
    return value.encode("latin-1") if isinstance(value, str) else value


@implementer(IUpstreamResponse)
class MemoryResponse:
    """A response head the test chose; its body arrives as the test writes it.

    Bytes written before `deliverBody`, or while cg has the body paused, wait (as in a
    socket's buffer) and reach the protocol once it takes them; the body's end comes after
    them. Once cg stopped the body, whatever the test writes is dropped.
    """

    def __init__(self, reactor: IReactorTime, code: int, phrase: bytes,
                 headers: Iterable[tuple[str | bytes, str | bytes]]) -> None:
        self._reactor = reactor
        self.code = code
        self.phrase = phrase
        self.headers = Headers()
        for name, value in headers:
            self.headers.addRawHeader(_bytes(name), _bytes(value))
        self.producer_calls: list[str] = []  # "pause", "resume", "stop", in the order cg made them
        self.paused = False
        self.stopped = False
        self._protocol: IProtocol | None = None
        self._waiting: list[bytes | Failure] = []  # body bytes, then maybe its end, not yet delivered
        self._ended = False  # the test ended the body
        self._lost = False  # the protocol got connectionLost

    def deliverBody(self, protocol: IProtocol) -> None:
        self._protocol = protocol
        # The body's transport is this producer, as Agent's is a producer proxy: no ITransport.
        protocol.makeConnection(self)  # type: ignore[arg-type]
        self._deliver()

    def write(self, data: bytes) -> None:
        """One chunk of the body, as one read from the connection."""
        assert not self._ended, "the body has ended"
        if not self.stopped:
            self._waiting.append(data)
            self._deliver()

    def finish(self) -> None:
        """The body is complete (ResponseDone)."""
        self._end(Failure(ResponseDone()))

    def close(self) -> None:
        """The connection closed cleanly, ending a body without a length (PotentialDataLoss)."""
        self._end(Failure(PotentialDataLoss()))

    def fail(self, reason: Exception | None = None) -> None:
        """The body is cut short (ResponseFailed; a reset connection unless `reason` says otherwise)."""
        cause = reason if reason is not None else error.ConnectionLost("Connection reset by peer")
        self._end(Failure(ResponseFailed([Failure(cause)])))

    def pauseProducing(self) -> None:
        self.producer_calls.append("pause")
        self.paused = True

    def resumeProducing(self) -> None:
        self.producer_calls.append("resume")
        self.paused = False
        self._deliver()

    def stopProducing(self) -> None:
        """Abandon the body: nothing more of it is delivered, and it ends as failed on a later turn."""
        self.producer_calls.append("stop")
        if not (self.stopped or self._lost):
            self.stopped = True
            self._waiting.clear()
            self._reactor.callLater(0, self._aborted)

    def _aborted(self) -> None:
        self._waiting.append(Failure(ResponseFailed([Failure(error.ConnectionAborted())])))
        self._deliver()

    def _end(self, reason: Failure) -> None:
        assert not self._ended, "the body has ended"
        self._ended = True
        if not self.stopped:
            self._waiting.append(reason)
            self._deliver()

    def _deliver(self) -> None:
        while self._protocol is not None and self._waiting:
            if self.paused and isinstance(self._waiting[0], bytes):
                return
            item = self._waiting.pop(0)
            if isinstance(item, Failure):
                self._lost = True
                self._protocol.connectionLost(item)
            else:
                self._protocol.dataReceived(item)
