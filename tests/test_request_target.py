"""The request-target: cg forwards a path to its configured upstream, never to a host a client names.

Raw sockets, because HTTP clients normalise the targets these tests send. A client's
credentials must reach no other host or port than the configured upstream's; what cg
refuses gets a 400 in the provider's error shape, and a path cg does not proxy a 404
in the shape of the dialect the client speaks.
"""

import openai
import pytest
import ujson
from pytest_twisted import inlineCallbacks
from rawhttp import connect, http_request, split_response
from twisted.internet.threads import deferToThread

from cg.testing import FakeUpstream

BODY = b'{"model":"m","max_tokens":1,"messages":[{"role":"user","content":"hi"}]}'
ANTHROPIC_CLIENT = [("x-api-key", "sk-ant-secret"), ("anthropic-version", "2023-06-01")]
OPENAI_CLIENT = [("authorization", "Bearer sk-secret")]



def port_of(upstream: FakeUpstream) -> int:
    return int(upstream.url.rsplit(":", 1)[1])


def anthropic_error(body: bytes, kind: str) -> str:
    doc = ujson.loads(body)
    assert doc["type"] == "error" and doc["error"]["type"] == kind, doc
    return doc["error"]["message"]


def openai_error(body: bytes) -> str:
    error = ujson.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and set(error) == {"message", "type", "param", "code"}, error
    return error["message"]


@pytest.mark.parametrize(
    "base, target",
    [
        ("http://127.0.0.1", ":{port}/v1/messages"),  # appended to the base: another port
        ("http://127.0.0", ".1:{port}/v1/messages"),  # appended to the base: another host
        ("http://127.0.0.1", "@127.0.0.1:{port}/v1/messages"),
        ("http://127.0.0.1", "http://127.0.0.1:{port}/v1/messages"),  # absolute-form: cg is no forward proxy
    ],
)
@inlineCallbacks
def test_a_target_that_is_not_a_path_is_refused_and_goes_nowhere(make_cg, attacker, base, target):
    cg = make_cg(anthropic_upstream=base)
    request = http_request("POST", target.format(port=port_of(attacker)), BODY, ANTHROPIC_CLIENT)
    status, _, body = split_response((yield (yield connect(cg.port, request)).closed))
    assert status == 400
    assert "does not start with /" in anthropic_error(body, "invalid_request_error")
    assert attacker.received == []


@pytest.mark.parametrize(
    "target",
    [
        "/v1/messages#frag",
        "/v1/messages\\..\\..\\x",
        "/%2F../v1/messages",
        "/v1/messages/../../x",
        "/v1/%2e%2e/x",
        "/v1/messages%00",
        "/v1/messages%0d%0aHost:%20attacker",
        "/v1/mess\x7fages",
        "/v1/mess\xa0ages",
    ],
)
@inlineCallbacks
def test_a_path_that_could_climb_out_is_refused_in_the_clients_dialect(cg, fake, fake_openai, target):
    anthropic = yield connect(cg.port, http_request("POST", target, BODY, ANTHROPIC_CLIENT))
    status, _, body = split_response((yield anthropic.closed))
    assert status == 400
    assert anthropic_error(body, "invalid_request_error").startswith("cg does not forward this request-target: ")

    openai_client = yield connect(cg.port, http_request("POST", target, BODY, OPENAI_CLIENT))
    status, _, body = split_response((yield openai_client.closed))
    assert status == 400
    assert openai_error(body).startswith("cg does not forward this request-target: ")
    assert fake.received == fake_openai.received == []


@pytest.mark.parametrize(
    "request_line",
    [
        b"POST /v1/messages\x00 HTTP/1.1",
        b"POST /v1/mess\rages HTTP/1.1",
        b"POST /v1/mess\nages HTTP/1.1",
        b"POST /v1/messages\r\nHost: 127.0.0.1:1 HTTP/1.1",
        b"POST /v1/mess\tages HTTP/1.1",
        b"POST /v1/mess ages HTTP/1.1",
    ],
)
@inlineCallbacks
def test_control_bytes_in_the_target_never_reach_the_upstream(cg, fake, fake_openai, request_line):
    """twisted.web refuses these in the request line: cg never sees them, and nothing goes upstream."""
    rest = http_request("POST", "/", BODY, ANTHROPIC_CLIENT).split(b"\r\n", 1)[1]
    client = yield connect(cg.port, request_line + b"\r\n" + rest)
    assert split_response((yield client.closed))[0] == 400
    assert fake.received == fake_openai.received == []


@pytest.mark.parametrize("base_path", ["", "/gateway/"])
@pytest.mark.parametrize(
    "target",
    [
        "/v1/messages?beta=true",
        "//127.0.0.1:{port}/v1/messages",  # a path on the configured upstream, never a host
        "/v1/messages@127.0.0.1:{port}",
    ],
)
@inlineCallbacks
def test_a_path_goes_to_the_configured_upstream_exactly(make_cg, fake, attacker, base_path, target):
    cg = make_cg(anthropic_upstream=fake.url + base_path)
    target = target.format(port=port_of(attacker))
    client = yield connect(cg.port, http_request("POST", target, BODY, ANTHROPIC_CLIENT))
    yield client.closed
    [received] = fake.received
    assert received.path == (base_path.rstrip("/") + target).encode()
    assert received.header(b"host") == fake.url.removeprefix("http://").encode()
    assert attacker.received == []


@inlineCallbacks
def test_a_path_cg_does_not_proxy_is_a_404_in_the_clients_dialect(cg, fake, fake_openai):
    openai_client = yield connect(cg.port, http_request("GET", "/elsewhere?x=1", headers=OPENAI_CLIENT))
    status, _, body = split_response((yield openai_client.closed))
    assert status == 404
    assert openai_error(body) == "cg does not proxy /elsewhere"

    anonymous = yield connect(cg.port, http_request("GET", "/v1/elsewhere"))
    status, _, body = split_response((yield anonymous.closed))
    assert status == 404
    assert anthropic_error(body, "not_found_error") == "cg does not proxy /v1/elsewhere"
    assert fake.received == fake_openai.received == []


@inlineCallbacks
def test_the_openai_sdk_without_v1_is_told_the_base_url_that_works(cg, fake_openai):
    client = openai.OpenAI(base_url=cg.url, api_key="sk-test", max_retries=0)
    with pytest.raises(openai.NotFoundError) as raised:
        yield deferToThread(client.chat.completions.create, model="m", messages=[{"role": "user", "content": "hi"}])
    message = f"cg does not proxy /chat/completions: set the OpenAI base URL to {cg.url}/v1"
    assert raised.value.body["message"] == message
    assert message in str(raised.value)
    assert fake_openai.received == []
