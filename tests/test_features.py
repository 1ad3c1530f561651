"""The providers' newer features through cg (tests/fixtures/features/, where each shape came from is
in its README): every shape as JSON and streamed, replayed by the fake byte for byte.

Real sockets: the fake upstream, cg in process, a raw client (every byte it got) and the official
SDKs' accumulators. For each shape: the fake receives what the client sent, byte for byte, but for
the expand tool cg appends to a declared `tools` array, the `stream_options` it adds to a streamed
chat request, and tool results compaction rewrote; the client receives what the fake sent, byte for
byte (the inspectors neither hold nor re-frame a shape that holds no expand call); the SDK
accumulates it. Then an expand call after a thinking block, a server-tool block or a reasoning item:
spliced into one stream the SDK accumulates, the continuation carrying those blocks back as the
provider requires.
"""

import json

import anthropic
import openai
import pytest
from fixturedata import feature, feature_names
from helpers.drive import TIMEOUT
from pytest_twisted import inlineCallbacks
from rawhttp import connect, http_request, split_response
from twisted.internet import reactor
from twisted.internet.threads import deferToThread

from cg.compaction.expand import ANTHROPIC_TOOL, OPENAI_TOOL, RESPONSES_TOOL
from cg.testing import JSONReply, SSEReply

# The tool results compaction rewrites in the corpus (a 900-line test log; the images and documents
# beside it, and the code execution output in an assistant turn, are not tool results it may touch).
REWRITTEN = {"anthropic_tool_result_media": ["toolu_01Tests"]}
STREAMED = [name for name in feature_names() if feature(name)["stream"] is not None]


def dumps(value) -> bytes:
    """JSON as the SDKs and Claude Code send it: compact, non-ASCII raw."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def client_bytes(shape: dict, stream: bool) -> bytes:
    body = dict(shape["request"])
    if shape["path"] != "/v1/responses/compact":  # the compact endpoint does not stream
        body["stream"] = stream
    return dumps(body)


def headers_of(shape: dict) -> list[tuple[str, str]]:
    headers = [("content-type", "application/json")]
    if shape["path"].startswith("/v1/messages"):
        headers += [("anthropic-version", "2023-06-01"), ("x-api-key", "sk-ant-test")]
    else:
        headers += [("authorization", "Bearer sk-test")]
    return headers + list(shape["headers"].items())


def expected_forward(shape: dict, sent: bytes, stream: bool) -> bytes:
    """What cg may change in a request of a shape: the expand tool appended to a non-empty `tools`
    (a Responses request only when `store` is false), `stream_options.include_usage` added to a
    streamed chat request; nothing on a path it does not rewrite."""
    path, request = shape["path"], shape["request"]
    tool = {"/v1/messages": ANTHROPIC_TOOL, "/v1/chat/completions": OPENAI_TOOL,
            "/v1/responses": RESPONSES_TOOL}.get(path)
    tools = request.get("tools")
    if tool is not None and tools and (path != "/v1/responses" or request.get("store") is False):
        declared = dumps(tools)
        assert sent.count(declared) == 1
        sent = sent.replace(declared, declared[:-1] + b"," + tool.encode() + b"]")
    if path == "/v1/chat/completions" and stream and "stream_options" not in request:
        sent = sent[:-1] + b',"stream_options":{"include_usage":true}}'
    return sent


def tool_outputs(path: str, body: dict) -> dict[str, object]:
    """The tool results of a request, by call id: what compaction may rewrite."""
    if path == "/v1/messages":
        return {block["tool_use_id"]: block.get("content") for message in body["messages"]
                if isinstance(message["content"], list)
                for block in message["content"] if block.get("type") == "tool_result"}
    if path == "/v1/chat/completions":
        return {message["tool_call_id"]: message["content"] for message in body["messages"]
                if message["role"] == "tool"}
    items = body["input"] if isinstance(body["input"], list) else []
    return {item["call_id"]: item["output"] for item in items if item.get("type", "").endswith("_call_output")}


def compaction_undone(path: str, received: bytes, sent: bytes) -> tuple[bytes, list[str]]:
    """`received` with every tool result compaction rewrote put back as sent, and those results'
    ids. Only text is rewritten: a result with an image or a document is never one of them."""
    got, wanted = tool_outputs(path, json.loads(received)), tool_outputs(path, json.loads(sent))
    assert got.keys() == wanted.keys()
    changed = [key for key in got if got[key] != wanted[key]]
    for key in changed:
        parts = wanted[key] if isinstance(wanted[key], list) else []
        assert all(part["type"] in ("text", "input_text") for part in parts), f"{key}: media rewritten"
        assert received.count(dumps(got[key])) == 1
        received = received.replace(dumps(got[key]), dumps(wanted[key]))
    return received, changed


@inlineCallbacks
def post(cg, shape: dict, raw: bytes):
    client = yield connect(cg.port, http_request("POST", shape["path"], raw, headers_of(shape)))
    return split_response((yield client.closed.addTimeout(TIMEOUT, reactor)))


def upstream_of(shape: dict, fake, fake_openai):
    return fake if shape["path"].startswith("/v1/messages") else fake_openai


# ---------------------------------------------------------------------------------------------
# Every shape passes through


@pytest.mark.parametrize("name", feature_names())
@inlineCallbacks
def test_a_json_exchange_passes_through_byte_for_byte(cg, fake, fake_openai, name):
    shape = feature(name)
    upstream = upstream_of(shape, fake, fake_openai)
    reply = dumps(shape["response"])
    upstream.enqueue(JSONReply(reply))
    sent = client_bytes(shape, stream=False)
    status, _, body = yield post(cg, shape, sent)
    assert status == 200
    assert body == reply
    [received] = upstream.received
    assert received.path.decode() == shape["path"]
    forwarded, rewritten = compaction_undone(shape["path"], received.body, sent)
    assert forwarded == expected_forward(shape, sent, stream=False)
    assert rewritten == REWRITTEN.get(name, [])


@pytest.mark.parametrize("name", STREAMED)
@inlineCallbacks
def test_a_stream_passes_through_byte_for_byte(cg, fake, fake_openai, name):
    shape = feature(name)
    upstream = upstream_of(shape, fake, fake_openai)
    events = [event + b"\n\n" for event in shape["stream"].split(b"\n\n") if event]
    assert b"".join(events) == shape["stream"]
    upstream.enqueue(SSEReply(events))
    sent = client_bytes(shape, stream=True)
    status, headers, body = yield post(cg, shape, sent)
    assert status == 200 and headers[b"content-type"] == [b"text/event-stream"]
    assert body == shape["stream"]
    [received] = upstream.received
    forwarded, rewritten = compaction_undone(shape["path"], received.body, sent)
    assert forwarded == expected_forward(shape, sent, stream=True)
    assert rewritten == REWRITTEN.get(name, [])
    sse = cg.stats.sse.snapshot()
    assert sse["sse_held_events"] == 0 and sse["sse_released"] == {}


def sdk_final(cg, shape: dict):
    """The shape's request through its official SDK's stream accumulator (in a thread): the final
    message, response or completion."""
    request = dict(shape["request"])

    def run():
        if shape["path"] == "/v1/messages":
            client = anthropic.Anthropic(base_url=cg.url, api_key="k", max_retries=0, timeout=TIMEOUT)
            betas = [beta for beta in shape["headers"].get("anthropic-beta", "").split(",") if beta]
            with client.beta.messages.stream(**request, betas=betas) as stream:
                return stream.get_final_message()
        client = openai.OpenAI(base_url=cg.url + "/v1", api_key="k", max_retries=0, timeout=TIMEOUT)
        if shape["path"] == "/v1/responses":
            with client.responses.stream(**request) as stream:
                return stream.get_final_response()
        with client.chat.completions.stream(**request) as stream:
            return stream.get_final_completion()

    return deferToThread(run).addTimeout(TIMEOUT + 5, reactor)


def summary(shape: dict, final: dict) -> object:
    """What the client reads of a final message, response or completion (the SDK's or the fixture's)."""
    if shape["path"] == "/v1/messages":
        return ([block for block in final["content"]], final["stop_reason"], final["usage"]["output_tokens"],
                final.get("container"), final.get("context_management"))
    if shape["path"] == "/v1/responses":
        for item in final["output"]:  # the SDK's own key, for structured outputs
            for part in item.get("content") or ():
                part.pop("parsed", None)
        return final["output"], final["status"], final["usage"]
    message = final["choices"][0]["message"]
    return ({key: message.get(key) for key in ("content", "refusal", "reasoning_content")},
            final["choices"][0]["finish_reason"], final["choices"][0]["logprobs"])


@pytest.mark.parametrize("name", STREAMED)
@inlineCallbacks
def test_the_official_sdk_accumulates_each_stream(cg, fake, fake_openai, name):
    shape = feature(name)
    upstream_of(shape, fake, fake_openai).enqueue(SSEReply([shape["stream"]]))
    final = yield sdk_final(cg, shape)
    assert summary(shape, final.to_dict(mode="json", exclude_unset=True)) == summary(shape, shape["response"])
