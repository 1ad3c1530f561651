"""The Responses API (/v1/responses, Codex CLI): the request side. Tool outputs get reformat (and
first-sight offload where the expand tool is declared: a top-level `tools` array), and every other
byte reaches the provider as the client sent it."""

import copy
import json

import openai
import pytest
from fixturedata import codex_body
from helpers.bodies import coloured_output
from helpers.drive import get_stats
from pytest_twisted import inlineCallbacks
from rawhttp import connect, http_request
from twisted.internet import reactor
from twisted.internet.threads import deferToThread

from cg.compaction import expand
from cg.compaction.rewrite import RewriteConfig, Rewriter
from cg.testing import command_output
from cg.wire.body import UNREAD, ParsedBody
from cg.wire.dialect import RESPONSES_SHAPE
from cg.wire.markers import EXPAND_TOOL

TIMEOUT = 15
RESPONSES_PATH = b"/v1/responses"


def serde(body: object) -> bytes:
    """A body as Codex (Rust serde_json) writes it: compact, non-ASCII raw, '/' not escaped."""
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


def planted(name: str, output: str) -> tuple[dict, list]:
    """The fixture with its (last) tool output replaced by `output`, and the path to that string."""
    body = copy.deepcopy(codex_body(name))
    index = max(i for i, item in enumerate(body["input"])
                if item["type"] in ("function_call_output", "custom_tool_call_output"))
    item = body["input"][index]
    if isinstance(item["output"], str):
        path = ["input", index, "output"]
    else:  # code mode: input_text parts, the command's output in the last one
        path = ["input", index, "output", len(item["output"]) - 1, "text"]
    set_at(body, path, output)
    return body, path


def set_at(body: dict, path: list, value: str) -> dict:
    target = body
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return body


def get_at(body: dict, path: list) -> object:
    for key in path:
        body = body[key]
    return body


CASES = [("second_request_tool_output", "exec_command"), ("codemode_custom_tool_output", "exec")]


def with_expand_tool(body: dict) -> dict:
    """`body` as cg forwards it to a model with top-level tools: the expand tool appended last."""
    return {**body, "tools": [*body["tools"], json.loads(expand.RESPONSES_TOOL)]}


@pytest.mark.parametrize(("name", "tool"), CASES)
def test_a_coloured_output_is_cleaned_and_every_other_byte_kept(name, tool):
    body, path = planted(name, coloured_output())
    raw = serde(body)
    rewrite = Rewriter(RewriteConfig(expand=False)).rewrite(raw, RESPONSES_PATH)
    assert rewrite is not None and rewrite.dialect is RESPONSES_SHAPE
    forwarded = json.loads(rewrite.body)
    cleaned = get_at(forwarded, path)
    assert cleaned == command_output()  # the colours gone, nothing else, nothing offloaded
    assert rewrite.body == serde(set_at(copy.deepcopy(body), path, cleaned))
    # Lossless only without the expand tool: no marker, nothing to stash.
    assert not rewrite.injected and rewrite.originals == {} and b"<<cg:" not in rewrite.body
    assert EXPAND_TOOL.encode() not in rewrite.body
    assert [(c.component, c.tool_name, c.lossy, c.message_index) for c in rewrite.changes] == [
        ("textclean", tool, False, path[1])]
    assert rewrite.runs["textclean"] >= 1 and "offload" not in rewrite.runs


def test_a_big_output_is_offloaded_at_first_sight_where_the_tool_is_declared():
    body, path = planted("second_request_tool_output", coloured_output())
    rewrite = Rewriter(RewriteConfig()).rewrite(serde(body), RESPONSES_PATH)
    assert rewrite.injected
    offloaded = get_at(json.loads(rewrite.body), path)
    (marker_id, original), = rewrite.originals.items()
    assert f"<<cg:{marker_id}>>" in offloaded and original == coloured_output().encode()
    assert [(c.component, c.lossy) for c in rewrite.changes] == [("textclean", False), ("offload", True)]
    # Every byte but that output's and the tool appended is the client's.
    expected = set_at(copy.deepcopy(body), path, offloaded)
    assert rewrite.body == serde(with_expand_tool(expected))


def test_reasoning_and_metadata_pass_byte_for_byte():
    body, _ = planted("second_request_tool_output", coloured_output())
    reasoning = [item for item in body["input"] if item["type"] == "reasoning"]
    assert reasoning and all(item["encrypted_content"] for item in reasoning)
    raw = serde(body)
    rewrite = Rewriter(RewriteConfig()).rewrite(raw, RESPONSES_PATH)
    assert rewrite.body != raw
    for item in reasoning:
        assert serde(item) in rewrite.body
    assert serde(body["client_metadata"]) in rewrite.body
    assert raw.startswith(rewrite.body[:rewrite.body.index(b'"type":"function_call_output"')])


@pytest.mark.parametrize("raw", [b'{"model":"gpt-5.5","input":[{"type":', b"[1,2]", b"\xff\xfe", b""])
def test_a_body_cg_cannot_parse_is_left_alone(raw):
    assert Rewriter(RewriteConfig()).rewrite(raw, RESPONSES_PATH) is None


def test_clean_outputs_and_other_shapes_are_untouched():
    """Nothing to clean and no tools to extend (code mode, a string `input`, previous_response_id):
    the same bytes."""
    rewriter = Rewriter(RewriteConfig())
    for body in (codex_body("codemode_custom_tool_output"), codex_body("codemode_first_request"),
                 {"model": "gpt-5.5", "input": "hello", "previous_response_id": "resp_1"}):
        raw = serde(body)
        assert rewriter.rewrite(raw, RESPONSES_PATH).body is raw


def test_previous_response_id_compacts_only_what_the_request_carries():
    body = {"model": "gpt-5.5", "previous_response_id": "resp_1", "input": [
        {"type": "function_call_output", "call_id": "call_1", "output": coloured_output()}]}
    rewrite = Rewriter(RewriteConfig()).rewrite(serde(body), RESPONSES_PATH)
    assert json.loads(rewrite.body)["input"][0]["output"] == command_output()
    assert [(c.component, c.tool_name) for c in rewrite.changes] == [("textclean", None)]


@pytest.mark.parametrize("name", ["first_request", "unknown_model_first_request"])
def test_the_expand_tool_is_appended_to_top_level_tools(name):
    raw = serde(codex_body(name))
    rewrite = Rewriter(RewriteConfig()).rewrite(raw, RESPONSES_PATH)
    assert rewrite.injected
    assert rewrite.body == serde(with_expand_tool(codex_body(name)))


def test_lite_models_get_no_expand_tool_and_no_lossy_offload():
    """Code mode declares its tools in an additional_tools input item: cg does not touch it."""
    body, _ = planted("codemode_custom_tool_output", command_output() * 400)
    rewrite = Rewriter(RewriteConfig()).rewrite(serde(body), RESPONSES_PATH)
    assert not rewrite.injected and rewrite.originals == {} and EXPAND_TOOL.encode() not in rewrite.body
    assert "offload" not in rewrite.runs


def test_the_expand_tool_is_byte_identical_on_every_request():
    sent = [Rewriter(RewriteConfig()).rewrite(serde(codex_body(name)), RESPONSES_PATH).body
            for name in ("first_request", "unknown_model_first_request")]
    declared = ("," + expand.RESPONSES_TOOL + "]").encode()  # last in tools, in these very bytes
    assert all(body.count(declared) == 1 for body in sent)


@pytest.mark.parametrize(("name", "tool"), CASES)
def test_first_sight_gives_the_same_bytes_every_time(name, tool):
    raw = serde(planted(name, coloured_output())[0])
    shared = Rewriter(RewriteConfig())
    sent = [shared.rewrite(raw, RESPONSES_PATH).body for _ in range(2)]
    sent.append(Rewriter(RewriteConfig()).rewrite(raw, RESPONSES_PATH).body)
    assert sent[0] != raw and sent.count(sent[0]) == 3


def test_a_resent_history_reuses_the_previous_parse():
    body, path = planted("second_request_tool_output", coloured_output())
    rewriter = Rewriter(RewriteConfig(expand=False))
    first = rewriter.parse(serde(body), RESPONSES_PATH, "s")
    grown = copy.deepcopy(body)
    grown["input"].append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": "next"}]})
    second = rewriter.parse(serde(grown), RESPONSES_PATH, "s")
    items = len(body["input"])
    assert all(list.__getitem__(second.body.value["input"], i) is UNREAD for i in range(items))  # taken, not scanned
    assert second.body.value["input"][:items] == first.body.value["input"]
    assert second.body.value["input"][items] is not None
    fresh = ParsedBody.parse(serde(grown))
    assert second.body.value == fresh.value and second.body.spans == fresh.spans
    # ... and the output cleaned in the first request is cleaned the same way in the second.
    cleaned = rewriter.finish(first).body
    assert rewriter.finish(second).body.startswith(cleaned[:cleaned.index(b'],"tools":')])
    assert get_at(json.loads(cleaned), path) == command_output()


# Through cg, with the official SDK against the fake upstream.

def responses_input(output: str) -> list[dict]:
    return [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "run the tests"}]},
        {"type": "function_call", "call_id": "call_1", "name": "exec_command", "arguments": '{"cmd":"npm test"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": output},
    ]


def sdk_events(url: str, output: str):
    """``responses.create(stream=True)`` in a thread: every event the SDK yields, as dicts."""

    def run():
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=TIMEOUT)
        stream = client.responses.create(model="gpt-5.5", input=responses_input(output), stream=True,
                                         tools=[{"type": "function", "name": "exec_command",
                                                 "parameters": {"type": "object"}}])
        return [event.model_dump() for event in stream]

    return deferToThread(run).addTimeout(TIMEOUT + 5, reactor)


@inlineCallbacks
def test_the_sdk_streams_a_response_whose_request_cg_cleaned(make_cg, fake_openai, tmp_path):
    changes = tmp_path / "changes.jsonl"
    cg = make_cg(openai_upstream=fake_openai.url, expand=False, changelog=str(changes))
    direct = yield sdk_events(fake_openai.url, coloured_output())
    through = yield sdk_events(cg.url, coloured_output())

    assert through == direct  # cg passes the Responses stream through as it came
    assert [e["type"] for e in through][-1] == "response.completed"
    sent_direct, sent_through = (received.json() for received in fake_openai.received)
    assert sent_direct["input"][2]["output"] == coloured_output()
    assert sent_through["input"][2]["output"] == command_output()
    assert sent_through == {**sent_direct, "input": [*sent_direct["input"][:2], {
        **sent_direct["input"][2], "output": command_output()}]}

    compaction = (yield from get_stats(cg.port))["compaction"]
    assert compaction["saved_tokens"] > 0
    assert compaction["components"]["textclean"]["saved_tokens"] == compaction["saved_tokens"]
    yield cg.service.changelog.flush()
    lines = [json.loads(line) for line in changes.read_text().splitlines()]
    logged = [(line["component"], line["tool"], line["lossy"]) for line in lines if line["kind"] == "compaction"]
    assert logged == [("textclean", "exec_command", False)]


@inlineCallbacks
def test_a_responses_body_cg_cannot_parse_reaches_the_provider_untouched(make_cg, fake_openai):
    cg = make_cg(openai_upstream=fake_openai.url, expand=True)
    raw = b'{"model":"gpt-5.5","input":[{"type":"function_call_output","output":"\x1b[32mok'
    client = yield connect(cg.port, http_request("POST", "/v1/responses", raw, [("content-type", "application/json")]))
    yield client.closed
    assert fake_openai.received[0].body == raw


@inlineCallbacks
def test_codexs_session_header_names_the_conversation_whose_parse_is_reused(make_cg, fake_openai):
    """Codex sends no x-claude-code-session-id: its session-id header keeps its history's parse apart."""
    cg = make_cg(openai_upstream=fake_openai.url, expand=True)
    body = json.dumps({"model": "gpt-5.5", "input": responses_input(coloured_output())}).encode()
    headers = [("content-type", "application/json"), ("session-id", "01a231c4-session")]
    client = yield connect(cg.port, http_request("POST", "/v1/responses", body, headers))
    yield client.closed
    bodies = cg.service.forwarder.rewriter.memo.bodies
    assert len(bodies) == 1 and bodies.take("01a231c4-session\0gpt-5.5") is not None  # and its model


def test_client_metadatas_key_order_changes_nothing_cg_decides():
    """Codex shuffles client_metadata's keys on every request: it reaches the provider as sent, and
    the input and tools cg forwards are the same bytes whichever order came."""
    body, path = planted("second_request_tool_output", coloured_output())
    shuffled = copy.deepcopy(body)
    shuffled["client_metadata"] = dict(reversed(list(body["client_metadata"].items())))
    rewriter = Rewriter(RewriteConfig())
    sent = [rewriter.rewrite(serde(b), RESPONSES_PATH).body for b in (body, shuffled)]
    fresh = Rewriter(RewriteConfig()).rewrite(serde(shuffled), RESPONSES_PATH).body
    assert sent[1] == fresh and sent[0] != sent[1]
    for forwarded, given in zip(sent, (body, shuffled)):
        cut = forwarded.index(b',"client_metadata":')
        assert forwarded[cut:] == serde(given)[serde(given).index(b',"client_metadata":'):]
    assert sent[0][:sent[0].index(b',"client_metadata":')] == sent[1][:sent[1].index(b',"client_metadata":')]
