"""The providers' newer features through cg (tests/fixtures/features/, where each shape came from is
in its README): every shape as JSON and streamed, replayed by the fake byte for byte.

Real sockets: the fake upstream, cg in process, a raw client (every byte it got) and the official
SDKs' accumulators. For each shape: the fake receives what the client sent, byte for byte, but for
the expand tool cg appends to a declared `tools` array, the `stream_options` it adds to a streamed
chat request, and tool results compaction rewrote; the client receives what the fake sent, byte for
byte (the inspectors neither hold nor re-frame a shape that holds no expand call); the SDK
accumulates it. Then an expand call after a thinking block, a server-tool block, a compaction block
or item, a reasoning item or a chat round's reasoning_content, JSON and streamed: spliced into one
message or response the SDK accumulates, the continuation carrying those blocks back as the
provider requires (each test's docstring says what and where the provider says so), in the code
execution container the round ran in.
"""

import copy
import inspect
import json
import re

import anthropic
import openai
import pytest
from fixturedata import feature, feature_names
from helpers.drive import TIMEOUT
from helpers.replies import DONE_EVENT, continuation, frag, start, turn
from helpers.replies import chunk as reply_chunk
from helpers.streams import is_insertion
from pytest_twisted import inlineCallbacks
from rawhttp import connect, http_request, split_response
from twisted.internet import reactor
from twisted.internet.threads import deferToThread

from cg.compaction.expand import ANTHROPIC_TOOL, OPENAI_TOOL, RESPONSES_TOOL
from cg.testing import (
    JSONReply,
    SSEReply,
    anthropic_expand_block,
    anthropic_message,
    anthropic_stream_events,
    anthropic_text_block,
    anthropic_thinking_block,
    openai_completion,
    responses_function_call,
    responses_message,
    responses_reasoning,
    responses_response,
    responses_stream_events,
    sse_event,
)
from cg.wire.markers import EXPAND_TOOL

# The tool results compaction rewrites in the corpus (a 900-line test log; the images and documents
# beside it, the search results' text, and the code execution output in an assistant turn, are not
# tool results it may touch).
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
    events = split_events(shape["stream"])
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
        with client.chat.completions.stream(**sdk_kwargs(client.chat.completions.create, request)) as stream:
            return stream.get_final_completion()

    return deferToThread(run).addTimeout(TIMEOUT + 5, reactor)


def sdk_kwargs(method, request: dict) -> dict:
    """`request` as keyword arguments of an SDK `method`: what it does not take (a router's own
    fields, such as OpenRouter's `reasoning`) in `extra_body`."""
    known = inspect.signature(method).parameters
    extra = {key: value for key, value in request.items() if key not in known}
    return {**{key: value for key, value in request.items() if key in known}, "extra_body": extra}


def summary(shape: dict, final: dict) -> object:
    """What the client reads of a final message, response or completion (the SDK's or the fixture's)."""
    if shape["path"] == "/v1/messages":
        return (final["content"], final["stop_reason"], final["usage"]["output_tokens"],
                final.get("container"), final.get("context_management"))
    if shape["path"] == "/v1/responses":
        for item in final["output"]:  # the SDK's own key, for structured outputs
            for part in item.get("content") or ():
                part.pop("parsed", None)
        return final["output"], final["status"], final["usage"]
    message = final["choices"][0]["message"]
    return ({key: message.get(key) for key in ("content", "refusal", "reasoning_content", "reasoning")},
            final["choices"][0]["finish_reason"], final["choices"][0]["logprobs"])


@pytest.mark.parametrize("name", STREAMED)
@inlineCallbacks
def test_the_official_sdk_accumulates_each_stream(cg, fake, fake_openai, name):
    shape = feature(name)
    upstream_of(shape, fake, fake_openai).enqueue(SSEReply([shape["stream"]]))
    final = yield sdk_final(cg, shape)
    assert summary(shape, final.to_dict(mode="json", exclude_unset=True)) == summary(shape, shape["response"])


# ---------------------------------------------------------------------------------------------
# An expand call after a thinking block, a server-tool block or a reasoning item

# A tool result cg offloads (900 lines, well past the offload threshold), and the marker it becomes.
LOG = "".join(f"PASS src/module_{i:04d}.test.ts (0.{i % 97:02d} s) — ✓ renders héllo/world\n" for i in range(900))
MARKER = re.compile(rb"<<cg:([0-9a-f]{16})>>")


def split_events(stream: bytes) -> list[bytes]:
    return [event + b"\n\n" for event in stream.split(b"\n\n") if event]


def with_log(messages: list[dict]) -> list[dict]:
    """`messages` with LOG as the answer to a Bash call: in the last tool_result when there is
    one, else in a new assistant call and its result."""
    messages = copy.deepcopy(messages)
    for block in messages[-1]["content"] if isinstance(messages[-1]["content"], list) else ():
        if block.get("type") == "tool_result":
            block["content"] = LOG
            return messages
    return messages + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_01Log", "name": "Bash",
                                           "input": {"command": "npm test"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01Log", "content": LOG}]},
    ]


@inlineCallbacks
def first_pass(cg, upstream, shape: dict, request: dict, reply):
    """`request` sent once as JSON and answered with `reply`: the ID of the marker cg put in place
    of LOG (the original's, the same on every request)."""
    upstream.enqueue(JSONReply(reply))
    status, _, _ = yield post(cg, shape, client_bytes(dict(shape, request=request), False))
    assert status == 200
    [ref] = MARKER.findall(upstream.received[-1].body)
    return ref.decode()


def anthropic_round_with_expand(shape: dict, ref: str) -> list[bytes]:
    """The shape's stream with a `context_guru_expand` call after its blocks, ending in tool_use
    (its message_delta's other fields, such as the container, kept)."""
    events = split_events(shape["stream"])
    final = json.loads(events[-2].split(b"data: ", 1)[1])
    final["delta"]["stop_reason"] = "tool_use"
    final["usage"]["output_tokens"] += 20
    events = events[:-2]
    index = sum(event.startswith(b"event: content_block_start") for event in events)
    return [*events, *anthropic_expand_block(index, ref=ref), sse_event("message_delta", final),
            sse_event("message_stop", {"type": "message_stop"})]


ANTHROPIC_BEFORE_EXPAND = ["anthropic_thinking", "anthropic_web_search", "anthropic_code_execution",
                           "anthropic_web_fetch", "anthropic_compaction"]


@pytest.mark.parametrize("streamed", [True, False], ids=["stream", "json"])
@pytest.mark.parametrize("name", ANTHROPIC_BEFORE_EXPAND)
@inlineCallbacks
def test_an_expand_call_after_thinking_or_a_server_tool_is_spliced_into_the_sdks_stream(make_cg, fake, name,
                                                                                      streamed):
    """The Messages API requires the assistant turn of a tool loop sent back as returned: during
    tool use the thinking blocks go back complete and unmodified (docs, extended thinking >
    preserving thinking blocks: text and signature; redacted_thinking's data), the server tool blocks with their encrypted fields
    (docs, web search tool; pause_turn), a compaction block "round-tripped verbatim"
    (BetaCompactionBlock). The continuation carries round 1's blocks as the fixture's JSON response
    holds them (the stream's deltas joined, the signature from its signature_delta), which the
    strict fake checks against the thinking it sent; the SDK gets one message without the call
    (JSON: the merged message)."""
    cg = make_cg(anthropic_upstream=fake.url)
    shape = feature(name)
    request = dict(shape["request"], messages=with_log(shape["request"]["messages"]))
    betas = [beta for beta in shape["headers"].get("anthropic-beta", "").split(",") if beta]
    blocks = shape["response"]["content"]

    def run():
        client = anthropic.Anthropic(base_url=cg.url, api_key="k", max_retries=0, timeout=TIMEOUT)
        if not streamed:
            return client.beta.messages.create(**request, betas=betas)
        with client.beta.messages.stream(**request, betas=betas) as stream:
            return stream.get_final_message()

    # A first pass: the marker's ID (the original's, the same on every request), and the fake
    # answering with the history's assistant blocks, as the model wrote them earlier in the
    # conversation (its strict mode accepts only thinking it sent).
    history = [block for message in request["messages"] if message["role"] == "assistant"
               for block in message["content"]]
    ref = yield first_pass(cg, fake, shape, request, anthropic_message(content=history))
    fake.strict = True
    expand_use = {"type": "tool_use", "id": f"toolu_expand_{len(blocks)}", "name": EXPAND_TOOL, "input": {"id": ref}}
    if streamed:
        fake.enqueue(SSEReply(anthropic_round_with_expand(shape, ref)),
                     SSEReply(continuation(["Line 450 ", "fails."])))
    else:
        fake.enqueue(JSONReply(dict(shape["response"], content=[*blocks, expand_use], stop_reason="tool_use")),
                     JSONReply(anthropic_message("Line 450 fails.")))
    message = yield deferToThread(run).addTimeout(TIMEOUT + 5, reactor)

    assert fake.rejections == []
    first, again = fake.received[1:]
    assistant, answers = again.json()["messages"][-2:]
    assert assistant == {"role": "assistant", "content": [*blocks, expand_use]}
    assert answers == {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": f"toolu_expand_{len(blocks)}", "content": LOG}]}
    assert is_insertion(first.body, again.body)  # every byte of round 1's request kept
    final = message.to_dict(mode="json", exclude_unset=True)
    assert final["content"] == [*blocks, {"type": "text", "text": "Line 450 fails."}]
    assert final["stop_reason"] == "end_turn"


def responses_round_with_expand(shape: dict, ref: str) -> tuple[list[bytes], dict]:
    """The shape's stream with a `context_guru_expand` call after its items (its `response.completed`
    listing it too), and the call."""
    events = [json.loads(event.split(b"data: ", 1)[1]) for event in split_events(shape["stream"])]
    completed = events.pop()
    output = completed["response"]["output"]
    arguments = json.dumps({"id": ref})
    call = responses_function_call(EXPAND_TOOL, arguments, call_id="call_expand", id="fc_expand")
    at = len(output)
    events += [
        {"type": "response.output_item.added", "output_index": at, "item": dict(call, status="in_progress",
                                                                                arguments="")},
        {"type": "response.function_call_arguments.delta", "item_id": "fc_expand", "output_index": at,
         "delta": arguments},
        {"type": "response.function_call_arguments.done", "item_id": "fc_expand", "output_index": at,
         "arguments": arguments},
        {"type": "response.output_item.done", "output_index": at, "item": call},
        {**completed, "response": dict(completed["response"], output=[*output, call])},
    ]
    return [sse_event(event["type"], dict(event, sequence_number=n)) for n, event in enumerate(events)], call


def with_responses_log(items: list[dict]) -> list[dict]:
    """`items` with LOG as the output of an exec_command call: the last function_call_output's
    when there is one, else a new call and its output."""
    items = copy.deepcopy(items)
    for item in items:
        if item.get("type") == "function_call_output":
            item["output"] = LOG
            return items
    return items + [
        {"type": "function_call", "call_id": "call_Log", "name": "exec_command", "arguments": '{"cmd":"npm test"}'},
        {"type": "function_call_output", "call_id": "call_Log", "output": LOG},
    ]


@pytest.mark.parametrize("streamed", [True, False], ids=["stream", "json"])
@pytest.mark.parametrize("name", ["responses_reasoning", "responses_web_search", "responses_builtin_tools",
                                  "responses_context_compaction"])
@inlineCallbacks
def test_an_expand_call_after_a_reasoning_item_a_web_search_or_compaction_is_spliced_into_the_sdks_stream(
        make_cg, fake_openai, name, streamed):
    """The Responses API, with `store: false`, needs the reasoning items back with their
    `encrypted_content`, each before the call it led to ("Item 'fc_…' of type 'function_call' was
    provided without its required 'reasoning' item"; docs, reasoning > keeping reasoning items in
    context), built-in tool calls and compaction items back as returned. The continuation appends every output item
    of round 1 as its `output_item.done` gave it, in order, then the answer; the SDK's
    `get_final_response()` gets one response (round 1's id) without the call (JSON: the merged
    response)."""
    fake_openai.strict = True
    cg = make_cg(openai_upstream=fake_openai.url)
    shape = feature(name)
    request = dict(shape["request"], input=with_responses_log(shape["request"]["input"]))

    def run():
        client = openai.OpenAI(base_url=cg.url + "/v1", api_key="k", max_retries=0, timeout=TIMEOUT)
        if not streamed:
            return client.responses.create(**request)
        with client.responses.stream(**request) as stream:
            return stream.get_final_response()

    ref = yield first_pass(cg, fake_openai, shape, request, dumps(shape["response"]))
    round1, call = responses_round_with_expand(shape, ref)
    reply = responses_message("Line 450 fails.", id="msg_cont")
    if streamed:
        fake_openai.enqueue(SSEReply(round1), SSEReply(responses_stream_events([reply], id="resp_cont")))
    else:
        fake_openai.enqueue(JSONReply(dict(shape["response"], output=[*shape["response"]["output"], call])),
                            JSONReply(responses_response([reply], id="resp_cont")))
    response = yield deferToThread(run).addTimeout(TIMEOUT + 5, reactor)

    assert fake_openai.rejections == []
    first, again = fake_openai.received[1:]
    output = shape["response"]["output"]
    assert again.json()["input"][len(request["input"]):] == [
        *output, call, {"type": "function_call_output", "call_id": "call_expand", "output": LOG}]
    assert is_insertion(first.body, again.body)  # every byte of round 1's request kept
    final = response.to_dict(mode="json", exclude_unset=True)
    assert final["id"] == shape["response"]["id"] and final["status"] == "completed"
    for item in final["output"]:
        for part in item.get("content") or ():
            part.pop("parsed", None)
    assert final["output"] == [*output, reply]


@pytest.mark.parametrize("streamed", [True, False], ids=["stream", "json"])
@inlineCallbacks
def test_a_continuations_reasoning_item_reaches_the_client_and_goes_back_as_it_sends_it(
        make_cg, fake_openai, streamed):
    """The Responses API's rule for reasoning items is a pairing, not a prefix: a function_call
    needs the reasoning item that led to it (the test above), and an item with `encrypted_content`
    carries its own state (cg splices only `store: false` requests, whose items are never looked up
    by id). The client never gets the expand call, so no call in its history lacks its reasoning;
    a continuation's reasoning item reaches it with its `encrypted_content` byte for byte, and its
    next turn goes upstream as it sent it: cg keeps no hidden turn for the Responses API."""
    fake_openai.strict = True
    cg = make_cg(openai_upstream=fake_openai.url)
    shape = feature("responses_reasoning")
    request = dict(shape["request"], input=with_responses_log(shape["request"]["input"]))
    ref = yield first_pass(cg, fake_openai, shape, request, dumps(shape["response"]))
    round1, call = responses_round_with_expand(shape, ref)
    later = [responses_reasoning("gAAAAB-round-2-ENCRYPTED==", id="rs_cont"), responses_message("Line 450.", id="msg_cont")]
    if streamed:
        fake_openai.enqueue(SSEReply(round1), SSEReply(responses_stream_events(later, id="resp_cont")))
    else:
        fake_openai.enqueue(JSONReply(dict(shape["response"], output=[*shape["response"]["output"], call])),
                            JSONReply(responses_response(later, id="resp_cont")))
    status, _, body = yield post(cg, shape, client_bytes(dict(shape, request=request), streamed))
    assert status == 200
    assert dumps(later[0]) in body  # as the upstream wrote it (the stream's output_item.done, JSON's output)
    shown = [*shape["response"]["output"], *later]
    turn_after = dict(request, input=[*request["input"], *shown, {"role": "user", "content": "Fix it."}])
    fake_openai.enqueue(JSONReply(responses_response([responses_message("ok")])))
    status, _, _ = yield post(cg, shape, client_bytes(dict(shape, request=turn_after), False))
    assert status == 200 and fake_openai.rejections == []
    assert fake_openai.received[-1].json()["input"][len(request["input"]):] == turn_after["input"][len(request["input"]):]


# What each chat shape's server writes in a delta without reasoning (the expand call's chunks).
QUIET = {"chat_reasoning_content": {"content": None, "reasoning_content": None},
         "chat_openrouter_reasoning": {"content": "", "reasoning": None, "reasoning_details": []}}
REASONING_FIELDS = ("reasoning_content", "reasoning", "reasoning_details")


@pytest.mark.parametrize("streamed", [True, False], ids=["stream", "json"])
@pytest.mark.parametrize("name", sorted(QUIET))
@inlineCallbacks
def test_an_expand_call_after_reasoning_is_continued_with_it(make_cg, fake_openai, name, streamed):
    """OpenAI-compatible servers that think need the turn's reasoning back while its tool calls are
    answered. DeepSeek (and Kimi): "if the model performed a tool call, the intermediate
    assistant's reasoning_content must participate in the context concatenation and must be passed
    back to the API" (DeepSeek API docs, thinking mode; 400 "Missing `reasoning_content` field in
    the assistant message" otherwise). OpenRouter: `reasoning_details` passed back unmodified, for
    a thinking Claude its signature (OpenRouter docs, reasoning tokens > preserving reasoning
    blocks). Streamed, the continuation's assistant message carries the round's reasoning as the
    deltas gave it (texts joined; each reasoning_details entry merged by its index: its text in
    fragments, its signature) beside its content and the call, equal to the message the server
    returns as JSON; the expand call's chunks carry the server's empty reasoning fields (OpenRouter
    writes `"reasoning_details":[]` in every delta) and are still held. JSON: the message as
    returned. The SDK gets one completion without the call."""
    fake_openai.strict = True
    cg = make_cg(openai_upstream=fake_openai.url)
    shape = feature(name)
    messages = [*shape["request"]["messages"],
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_Log", "type": "function", "function": {"name": "run", "arguments": '{"cmd":"npm test"}'}}]},
                {"role": "tool", "tool_call_id": "call_Log", "content": LOG}]
    request = dict(shape["request"], messages=messages)
    ref = yield first_pass(cg, fake_openai, shape, request, dumps(shape["response"]))
    chunks = split_events(shape["stream"])[:-2]  # without the finish chunk and [DONE]
    head = {key: shape["response"][key] for key in ("id", "created", "model")}
    arguments = json.dumps({"id": ref})
    message = shape["response"]["choices"][0]["message"]
    expand_call = {"id": "call_expand", "type": "function", "function": {"name": EXPAND_TOOL, "arguments": arguments}}
    if streamed:
        quiet = QUIET[name]
        round1 = [*chunks, reply_chunk({**quiet, **start(0, "call_expand")}, head=head),
                  reply_chunk({**quiet, **frag(0, arguments)}, head=head), reply_chunk({}, "tool_calls", head=head),
                  DONE_EVENT]
        fake_openai.enqueue(SSEReply(round1),
                            SSEReply(turn({"content": "Line 450 fails."}, finish="stop", head=head)))
    else:
        response = copy.deepcopy(shape["response"])
        response["choices"][0].update(message=dict(message, tool_calls=[expand_call]), finish_reason="tool_calls")
        fake_openai.enqueue(JSONReply(response), JSONReply(openai_completion("Line 450 fails.", model=head["model"])))

    def run():
        client = openai.OpenAI(base_url=cg.url + "/v1", api_key="k", max_retries=0, timeout=TIMEOUT)
        kwargs = sdk_kwargs(client.chat.completions.create, request)
        if not streamed:
            return client.chat.completions.create(**kwargs)
        with client.chat.completions.stream(**kwargs) as stream:
            return stream.get_final_completion()

    completion = yield deferToThread(run).addTimeout(TIMEOUT + 5, reactor)
    assert fake_openai.rejections == []
    assert len(fake_openai.received) == 3  # the first pass, round 1, the continuation
    assistant, answer = fake_openai.received[2].json()["messages"][-2:]
    reasoning = {key: message[key] for key in REASONING_FIELDS if key in message}
    assert reasoning
    assert assistant == {"role": "assistant", "content": message["content"], **reasoning, "tool_calls": [expand_call]}
    assert answer == {"role": "tool", "tool_call_id": "call_expand", "content": LOG}
    final = completion.choices[0].message
    joined = "\n\n" if not streamed else ""  # the JSON merge joins the rounds' texts as paragraphs
    assert final.tool_calls is None and final.content == message["content"] + joined + "Line 450 fails."


@pytest.mark.parametrize("streamed", [True, False], ids=["stream", "json"])
@inlineCallbacks
def test_an_expand_continuation_runs_in_the_container_round_1_ran_code_in(make_cg, fake, streamed):
    """A request without a `container` gets a new one, named in the response (`container.id`;
    streamed, in `message_delta.delta.container`). Continuing the turn elsewhere loses what the
    code wrote: a continuation names the container of the turn it continues, as a pause_turn's
    must (docs, code execution tool > containers: reuse one by passing the ID from a previous
    response; handling stop reasons > pause_turn). cg adds `"container":"<id>"` to a continuation
    whose request has none, every other byte kept."""
    cg = make_cg(anthropic_upstream=fake.url)
    shape = feature("anthropic_code_execution")
    request = {key: value for key, value in shape["request"].items() if key != "container"}
    request["messages"] = with_log(request["messages"])
    ref = yield first_pass(cg, fake, shape, request, anthropic_message("ok"))
    blocks = shape["response"]["content"]
    if streamed:
        fake.enqueue(SSEReply(anthropic_round_with_expand(shape, ref)), SSEReply(continuation(["Done."])))
    else:
        expand_use = {"type": "tool_use", "id": "toolu_expand_5", "name": EXPAND_TOOL, "input": {"id": ref}}
        fake.enqueue(JSONReply(dict(shape["response"], content=[*blocks, expand_use], stop_reason="tool_use")),
                     JSONReply(anthropic_message("Done.")))
    status, _, _ = yield post(cg, shape, client_bytes(dict(shape, request=request), streamed))
    assert status == 200
    first, again = fake.received[1:]
    assert "container" not in first.json()
    assert again.json()["container"] == shape["response"]["container"]["id"]
    added = b',"container":"' + shape["response"]["container"]["id"].encode() + b'"'
    assert again.body.count(added) == 1 and is_insertion(first.body, again.body.replace(added, b""))


@pytest.mark.parametrize("streamed", [True, False], ids=["stream", "json"])
@pytest.mark.parametrize("stop_reason", ["refusal", "model_context_window_exceeded", "max_tokens", "pause_turn"])
@inlineCallbacks
def test_a_turn_that_stopped_for_another_reason_is_the_clients_even_with_an_expand_call(make_cg, fake, stop_reason,
                                                                                       streamed):
    """Only a turn that stopped to use its tools (`stop_reason: tool_use`) is continued: a refusal,
    a full context window, `max_tokens` (whose last tool input may be cut) or a paused turn goes to
    the client as the provider sent it, its expand call repaired next turn if the client sends it
    back (docs, handling stop reasons)."""
    cg = make_cg(anthropic_upstream=fake.url)
    shape = feature("anthropic_refusal")
    request = dict(shape["request"], messages=with_log(shape["request"]["messages"]))
    ref = yield first_pass(cg, fake, shape, request, anthropic_message("ok"))
    blocks = [{"type": "text", "text": "Let me look."},
              {"type": "tool_use", "id": "toolu_expand_1", "name": EXPAND_TOOL, "input": {"id": ref}}]
    if streamed:
        events = [*split_events(shape["stream"])[:1], *anthropic_text_block(0, ["Let me look."]),
                  *anthropic_expand_block(1, ref=ref),
                  sse_event("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop_reason,
                                                                                "stop_sequence": None},
                                              "usage": {"output_tokens": 30}}),
                  sse_event("message_stop", {"type": "message_stop"})]
        fake.enqueue(SSEReply(events))
        sent = b"".join(events)
    else:
        sent = dumps(dict(shape["response"], content=blocks, stop_reason=stop_reason))
        fake.enqueue(JSONReply(sent))
    status, _, body = yield post(cg, shape, client_bytes(dict(shape, request=request), streamed))
    assert status == 200 and body == sent
    assert len(fake.received) == 2  # no continuation


def thinking_prefixes(request: dict, content: list | None = None) -> dict[str, object]:
    """Each thinking block's prefix, by signature: the `system`, `tools` and everything before the
    block, in `request`'s messages (and, for a block of the response `content`, the whole request
    and the response's blocks before it)."""
    head = (request.get("system"), request.get("tools"))
    prefixes: dict[str, object] = {}
    messages = request["messages"]
    for i, message in enumerate(messages):
        blocks = message["content"] if isinstance(message["content"], list) else []
        for j, block in enumerate(blocks):
            if block.get("type") == "thinking":
                prefixes[block["signature"]] = (head, messages[:i], blocks[:j])
    for j, block in enumerate(content or ()):
        if block.get("type") == "thinking":
            prefixes[block["signature"]] = (head, messages, content[:j])
    return prefixes


@inlineCallbacks
def test_a_continuations_thinking_keeps_its_prefix_on_the_next_turn(make_cg, fake):
    """Preserved thinking: "If the prefix differs from what you sent when the block was produced,
    that block and every later thinking block are invalid, and the API rejects the request with a
    400 error or drops the invalid blocks" (platform.claude.com/docs/build-with-claude/
    preserved-thinking; enforced by default for accounts created from August 31, 2026). A block's
    prefix is `system`, `tools` and everything before it. A thinking block the model writes in an
    expand continuation follows the hidden expand call and its answer; the client, which never saw
    them, sends that block back next turn after round 1's blocks alone."""
    cg = make_cg(anthropic_upstream=fake.url)
    shape = feature("anthropic_thinking")
    request = dict(shape["request"], messages=with_log(shape["request"]["messages"]))
    ref = yield first_pass(cg, fake, shape, request, anthropic_message("ok"))
    later = {"type": "thinking", "thinking": "The log shows line 450.", "signature": "EqQBCkYIround2sig=="}
    round2 = anthropic_stream_events(id="msg_cont", blocks=[
        anthropic_thinking_block(0, later["thinking"], later["signature"]),
        anthropic_text_block(1, ["Line 450 fails."])])
    fake.enqueue(SSEReply(anthropic_round_with_expand(shape, ref)), SSEReply(round2))
    status, _, body = yield post(cg, shape, client_bytes(dict(shape, request=request), True))
    assert status == 200
    got = [json.loads(line[6:]) for line in body.split(b"\n") if line.startswith(b"data: ")]
    blocks = [event["content_block"] for event in got if event["type"] == "content_block_start"]
    assert [block["type"] for block in blocks] == ["thinking", "redacted_thinking", "text", "thinking", "text"]
    generated = thinking_prefixes(fake.received[2].json(), [later])
    # The client's next turn: the message it got (its thinking signed as the deltas said), then a question.
    message = [*shape["response"]["content"], later, {"type": "text", "text": "Line 450 fails."}]
    turn_after = dict(request, messages=[*request["messages"], {"role": "assistant", "content": message},
                                         {"role": "user", "content": "Fix it."}])
    fake.enqueue(JSONReply(anthropic_message("ok")))
    status, _, _ = yield post(cg, shape, client_bytes(dict(shape, request=turn_after), False))
    assert status == 200
    forwarded = thinking_prefixes(fake.received[3].json())
    first = shape["response"]["content"][0]["signature"]  # round 1's thinking keeps its prefix
    assert forwarded[first] == thinking_prefixes(fake.received[1].json(), shape["response"]["content"])[first]
    assert forwarded[later["signature"]] == generated[later["signature"]]


@pytest.mark.parametrize("streamed", [True, False], ids=["stream", "json"])
@inlineCallbacks
def test_a_continuations_thinking_gets_the_same_hidden_turn_back_on_every_turn_and_after_a_restart(
        make_cg, fake, tmp_path, streamed):
    """The hidden turns are frozen in the store (cg.stream.hidden): a later turn carries the same
    bytes whether it is sent again, or by a cg started afresh on the same store, and a store that
    no longer has them (here: another) leaves the message as the client sent it."""
    store = f"sqlite:{tmp_path / 'store.sqlite3'}"
    cg = make_cg(anthropic_upstream=fake.url, store=store)
    shape = feature("anthropic_thinking")
    request = dict(shape["request"], messages=with_log(shape["request"]["messages"]))
    ref = yield first_pass(cg, fake, shape, request, anthropic_message("ok"))
    later = {"type": "thinking", "thinking": "The log shows line 450.", "signature": "EqQBCkYIround2sig=="}
    blocks = shape["response"]["content"]
    if streamed:
        round2 = anthropic_stream_events(id="msg_cont", blocks=[
            anthropic_thinking_block(0, later["thinking"], later["signature"]),
            anthropic_text_block(1, ["Line 450 fails."])])
        fake.enqueue(SSEReply(anthropic_round_with_expand(shape, ref)), SSEReply(round2))
    else:
        expand_use = {"type": "tool_use", "id": "toolu_expand_9", "name": EXPAND_TOOL, "input": {"id": ref}}
        fake.enqueue(JSONReply(dict(shape["response"], content=[*blocks, expand_use], stop_reason="tool_use")),
                     JSONReply(anthropic_message(content=[later, {"type": "text", "text": "Line 450 fails."}])))
    status, _, _ = yield post(cg, shape, client_bytes(dict(shape, request=request), streamed))
    assert status == 200
    generated = thinking_prefixes(fake.received[2].json(), [later])
    message = [*blocks, later, {"type": "text", "text": "Line 450 fails."}]
    turn_after = client_bytes(dict(shape, request=dict(request, messages=[
        *request["messages"], {"role": "assistant", "content": message}, {"role": "user", "content": "Fix it."}])),
        False)

    @inlineCallbacks
    def forward(running):
        fake.enqueue(JSONReply(anthropic_message("ok")))
        status, _, _ = yield post(running, shape, turn_after)
        assert status == 200
        return fake.received[-1].body

    sent = yield forward(cg)
    assert thinking_prefixes(json.loads(sent))[later["signature"]] == generated[later["signature"]]
    expand = cg.stats.snapshot()["expand"]
    assert (expand["hidden_kept"], expand["hidden_restored"]) == (1, 1)
    assert (yield forward(cg)) == sent
    yield cg.stop()
    assert (yield forward(make_cg(anthropic_upstream=fake.url, store=store))) == sent
    elsewhere = f"sqlite:{tmp_path / 'another.sqlite3'}"
    as_sent = json.loads((yield forward(make_cg(anthropic_upstream=fake.url, store=elsewhere))))
    assert as_sent["messages"][-2] == {"role": "assistant", "content": message}
