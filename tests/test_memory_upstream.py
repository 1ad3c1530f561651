"""cg.testing.MemoryUpstream behaves as cg.web.upstream.Upstream does where the proxy can tell.

The clock tests (test_proxy_clock.py) trust it: a body that arrives before it is taken, or
while it is paused, waits; a stopped body ends as failed on a later turn, never as complete.
"""

import pytest
from helpers.clients import Body
from twisted.internet.defer import CancelledError
from twisted.internet.testing import MemoryReactorClock
from twisted.web.client import ResponseDone, ResponseFailed
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from zope.interface.verify import verifyObject

from cg.testing import MemoryUpstream
from cg.web.upstream import HeaderTimeout, IUpstream, IUpstreamResponse


@pytest.fixture
def clock():
    return MemoryReactorClock()


@pytest.fixture
def upstream(clock):
    return MemoryUpstream(clock)


def test_it_provides_the_interfaces_and_records_the_request(upstream):
    assert verifyObject(IUpstream, upstream)
    d = upstream.request(b"POST", b"http://p", b"/v1/messages", Headers({b"x-api-key": [b"k"]}), b"{}")
    (request,) = upstream.requests
    assert (request.method, request.origin, request.path, request.body) == (b"POST", b"http://p", b"/v1/messages", b"{}")
    assert request.headers.getRawHeaders(b"x-api-key") == [b"k"]
    response = request.respond(201, [("content-type", "text/event-stream")], phrase=b"Created")
    assert d.result is response and verifyObject(IUpstreamResponse, response)
    assert (response.code, response.phrase) == (201, b"Created")
    assert response.headers.getRawHeaders(b"content-type") == [b"text/event-stream"]


def test_a_request_fails_as_told_or_is_cancelled(upstream):
    failures = []
    upstream.request(b"POST", b"http://p", b"/", Headers(), b"").addErrback(failures.append)
    upstream.requests[0].fail(HeaderTimeout())
    d = upstream.request(b"POST", b"http://p", b"/", Headers(), b"")
    d.addErrback(failures.append)
    d.cancel()
    assert upstream.requests[1].cancelled
    assert [f.type for f in failures] == [HeaderTimeout, CancelledError]


@pytest.mark.parametrize(("end", "reason"), [("finish", ResponseDone), ("close", PotentialDataLoss),
                                             ("fail", ResponseFailed)])
def test_the_body_waits_to_be_taken_and_while_paused(upstream, end, reason):
    upstream.request(b"POST", b"http://p", b"/", Headers(), b"")
    response = upstream.requests[0].respond()
    response.write(b"early ")
    body = Body()
    response.deliverBody(body)
    assert body.chunks == [b"early "]
    response.pauseProducing()
    response.write(b"held")
    getattr(response, end)()
    assert body.chunks == [b"early "] and not body.done.called  # the end waits behind the held bytes
    response.resumeProducing()
    assert body.chunks == [b"early ", b"held"] and body.reason.check(reason)
    assert response.producer_calls == ["pause", "resume"]


def test_a_stopped_body_ends_failed_on_a_later_turn_with_nothing_more(clock, upstream):
    upstream.request(b"POST", b"http://p", b"/", Headers(), b"")
    response = upstream.requests[0].respond()
    body = Body()
    response.deliverBody(body)
    response.pauseProducing()
    response.write(b"held")
    response.stopProducing()
    response.write(b"late")
    response.finish()
    assert not body.done.called  # not from inside stopProducing
    clock.advance(0)
    assert body.chunks == [] and body.reason.check(ResponseFailed)
    assert response.producer_calls == ["pause", "stop"]
