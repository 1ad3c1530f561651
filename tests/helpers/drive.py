"""Driving a running cg over real sockets (with rawhttp's raw client): POST a Claude Code
request, read a stream raw, an original back, /stats and /metrics; wait on the reactor."""

import json
import re

import ujson
from prometheus_client.parser import text_string_to_metric_families
from pytest_twisted import inlineCallbacks
from rawhttp import connect, dechunk, http_request, split_response
from twisted.internet import reactor, task

from cg.testing import claude_code_bytes


def post(port, raw: bytes, headers=()):
    headers = [("content-type", "application/json"), ("anthropic-version", "2023-06-01"), *headers]
    return connect(port, http_request("POST", "/v1/messages?beta=true", raw, headers))


TIMEOUT = 15


HEADERS = [("content-type", "application/json"), ("anthropic-version", "2023-06-01")]


def sleep(seconds):
    return task.deferLater(reactor, seconds, lambda: None)


@inlineCallbacks
def until(predicate, timeout=TIMEOUT, step=0.005):
    """Poll ``predicate`` on the reactor until it holds (fails the test after ``timeout``)."""
    waited = 0.0
    while not predicate():
        assert waited < timeout, "timed out waiting"
        yield sleep(step)
        waited += step


def post_body(cg, body: dict):
    """The request as Claude Code sends it, over a raw socket (Connection: close)."""
    return connect(cg.port, http_request("POST", "/v1/messages?beta=true", claude_code_bytes(body), HEADERS))


@inlineCallbacks
def raw_stream(cg, body: dict):
    """POST ``body`` raw; returns (client, de-chunked body, whether the chunked end arrived).

    A broken stream is one without the chunked terminator, whatever then closed the connection (an
    RST or a FIN: either way every HTTP client reads a truncated body)."""
    client = yield post_body(cg, body)
    raw = yield client.closed.addTimeout(TIMEOUT, reactor)
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    assert b"transfer-encoding: chunked" in head.lower()
    data, complete = dechunk(rest)
    return client, data, complete


def get_stats(port):
    client = yield connect(port, http_request("GET", "/stats"))
    status, _, body = split_response((yield client.closed))
    assert status == 200
    return ujson.loads(body)


MARKER = re.compile(r"<<cg:([0-9a-f]{16})>>")  # a marker (the tool's description shows <<cg:ID>>)


def markers(received) -> list[str]:
    return MARKER.findall(json.dumps(received.json()["messages"]))


@inlineCallbacks
def send(running, body: dict, headers=()):
    client = yield post(running.port, claude_code_bytes(body), headers)
    status, _, data = split_response((yield client.closed))
    assert status == 200, data
    return data


@inlineCallbacks
def read_original(running, ident: str):
    client = yield connect(running.port, http_request("GET", f"/cg/expand/{ident}"))
    status, _, data = split_response((yield client.closed))
    return status, data


def scrape(port, accept=None):
    headers = [("accept", accept)] if accept else []
    client = yield connect(port, http_request("GET", "/metrics", headers=headers))
    status, head, body = split_response((yield client.closed))
    assert status == 200
    return head, body.decode()


def samples(text: str) -> dict[tuple, float]:
    """(sample name, sorted labels) -> value."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text) for s in family.samples
    }


def value(text: str, name: str, **labels) -> float:
    return samples(text).get((name, tuple(sorted(labels.items()))), 0.0)
