"""The request-target: a path cg does not proxy gets a 404 in the dialect the client speaks.

Raw sockets, because HTTP clients normalise the targets these tests send.
"""

import openai
import pytest
import ujson
from pytest_twisted import inlineCallbacks
from rawhttp import connect, http_request, split_response
from twisted.internet.threads import deferToThread

OPENAI_CLIENT = [("authorization", "Bearer sk-secret")]


def anthropic_error(body: bytes, kind: str) -> str:
    doc = ujson.loads(body)
    assert doc["type"] == "error" and doc["error"]["type"] == kind, doc
    return doc["error"]["message"]


def openai_error(body: bytes) -> str:
    error = ujson.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and set(error) == {"message", "type", "param", "code"}, error
    return error["message"]


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
