"""The expand loop's pure parts: which calls cg answers, the continuation request, the merged response."""

import copy
import json

import pytest
from fixturedata import claude_code_body
from helpers.bodies import go_style, js_style, python_style, slash_style
from hypothesis import given, settings
from hypothesis import strategies as st

from cg.stream import continuation
from cg.stream.continuation import (
    CHAT_CALL_FINISHES,
    CHAT_LOOP,
    EVICTED,
    MALFORMED,
    MESSAGES_LOOP,
    UNKNOWN,
    ClientStyle,
    ExpandCall,
    answers,
    is_cg_answer,
    refs_to_resolve,
    resolve,
)
from cg.stream.usage import Usage
from cg.wire.markers import marker_id

ID_A = marker_id(b"original A")
ID_B = marker_id(b"original B")
THINKING = {"type": "thinking", "thinking": "Let me look at the elided log first.\n\u00e9\u2028",
            "signature": "EqQBCkgIARABGAIiQL+/z9kP3x2c/w==" + "A" * 200}



DEFAULT = object()


def tool_use(call_id: str, name: str = "context_guru_expand", tool_input=DEFAULT) -> dict:
    return {"type": "tool_use", "id": call_id, "name": name,
            "input": {"id": f"<<cg:{ID_A}>>"} if tool_input is DEFAULT else tool_input}


def anthropic_response(content: list, id="msg_1", stop_reason="tool_use", usage=None) -> dict:
    return {"id": id, "type": "message", "role": "assistant", "model": "claude-opus-4-8", "content": content,
            "stop_reason": stop_reason, "stop_sequence": None,
            "usage": usage or {"input_tokens": 3, "cache_creation_input_tokens": 100,
                               "cache_read_input_tokens": 5000, "output_tokens": 40,
                               "service_tier": "standard"}}


def openai_call(call_id: str, name: str = "context_guru_expand", arguments=None) -> dict:
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps({"id": ID_A}) if arguments is None else arguments}}


def openai_response(content=None, tool_calls=None, id="chatcmpl-1", finish_reason="tool_calls", usage=None) -> dict:
    message = {"role": "assistant", "content": content, "refusal": None, "annotations": []}
    if tool_calls is not None:
        message["tool_calls"] = tool_calls
    return {"id": id, "object": "chat.completion", "created": 1, "model": "gpt-4.1",
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}],
            "usage": usage or {"prompt_tokens": 1000, "completion_tokens": 20, "total_tokens": 1020,
                               "prompt_tokens_details": {"cached_tokens": 900, "audio_tokens": 0},
                               "completion_tokens_details": {"reasoning_tokens": 5, "audio_tokens": 0}}}


# ---------------------------------------------------------------------------------------------
# Which responses cg answers


def test_a_lone_expand_call_is_found_with_its_ref():
    response = anthropic_response([{"type": "text", "text": "Let me see."}, tool_use("toolu_1")])
    assert MESSAGES_LOOP.lone_expand_calls(response) == [
        ExpandCall("toolu_1", {"id": f"<<cg:{ID_A}>>"}, ID_A)]


def test_several_expand_calls_come_in_order_bare_ids_too():
    response = anthropic_response([tool_use("toolu_1"), tool_use("toolu_2", tool_input={"id": f" {ID_B} "})])
    assert [(c.id, c.ref) for c in MESSAGES_LOOP.lone_expand_calls(response)] == [
        ("toolu_1", ID_A), ("toolu_2", ID_B)]


@pytest.mark.parametrize("content", [
    [{"type": "text", "text": "done"}],
    [],
    [tool_use("toolu_1"), tool_use("toolu_2", name="Bash", tool_input={"command": "ls"})],
    [tool_use("toolu_2", name="Bash", tool_input={"command": "ls"}), tool_use("toolu_1")],
], ids=["text", "empty", "expand-then-bash", "bash-then-expand"])
def test_no_call_or_a_client_call_in_the_batch_means_the_client_gets_it(content):
    assert MESSAGES_LOOP.lone_expand_calls(anthropic_response(content)) is None


def test_server_tools_run_at_the_provider_and_do_not_count():
    response = anthropic_response([
        {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "x"}},
        {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": []},
        tool_use("toolu_1"),
    ])
    assert [c.id for c in MESSAGES_LOOP.lone_expand_calls(response)] == ["toolu_1"]


@pytest.mark.parametrize("tool_input", [{}, {"id": 5}, {"id": "not an id!"}, {"ID": ID_A}, "a string", None,
                                        {"id": f"<<cg:{ID_A}>> and more"}])
def test_an_input_naming_no_id_is_malformed(tool_input):
    response = anthropic_response([tool_use("toolu_1", tool_input=tool_input)])
    [call] = MESSAGES_LOOP.lone_expand_calls(response)
    assert call.ref is None and call.raw_input == tool_input


def test_openai_tool_calls():
    response = openai_response(tool_calls=[
        openai_call("call_1"), openai_call("call_2", arguments="{not json"),
        openai_call("call_3", arguments=json.dumps({"id": f"<<cg:{ID_B}>>"}))])
    assert CHAT_LOOP.lone_expand_calls(response) == [
        ExpandCall("call_1", json.dumps({"id": ID_A}), ID_A),
        ExpandCall("call_2", "{not json", None),
        ExpandCall("call_3", json.dumps({"id": f"<<cg:{ID_B}>>"}), ID_B),
    ]


@pytest.mark.parametrize("response", [
    openai_response(content="hi", finish_reason="stop"),
    openai_response(tool_calls=[]),
    openai_response(tool_calls=[openai_call("call_1"), openai_call("call_2", name="shell", arguments="{}")]),
    {"choices": []},
], ids=["text", "no-calls", "batched", "no-choices"])
def test_openai_responses_cg_does_not_answer(response):
    assert CHAT_LOOP.lone_expand_calls(response) is None


def test_expand_calls_of_a_batch_are_still_readable_for_repair():
    response = anthropic_response([tool_use("toolu_2", name="Bash", tool_input={}), tool_use("toolu_1")])
    assert [c.id for c in MESSAGES_LOOP.expand_calls(response)] == ["toolu_1"]


# ---------------------------------------------------------------------------------------------
# Resolution


def test_each_ref_is_looked_up_once_in_call_order():
    calls = [ExpandCall("1", {}, ID_B), ExpandCall("2", {}, None), ExpandCall("3", {}, ID_A), ExpandCall("4", {}, ID_B)]
    assert refs_to_resolve(calls) == [ID_B, ID_A]


def test_resolve_tells_evicted_from_unknown_by_the_shape_of_the_id():
    assert resolve(ID_A, b"the original") == b"the original"
    assert resolve(ID_A, None) is EVICTED
    assert resolve("seg_0001", None) is UNKNOWN
    assert resolve("0123456789ABCDEF", None) is UNKNOWN  # cg's IDs are lower-case hex


def test_final_answers():
    calls = [ExpandCall("1", {}, ID_A), ExpandCall("2", {"id": 5}, None), ExpandCall("3", {}, "seg_0001"),
             ExpandCall("4", {}, ID_B), ExpandCall("5", {}, "0123456789abcdef")]
    got = answers(calls, {ID_A: EVICTED, "seg_0001": UNKNOWN, ID_B: "café".encode()})
    assert [a.kind for a in got] == ["evicted", "malformed", "unknown", "resolved", "evicted"]
    assert got[0].text == (f"the original for <<cg:{ID_A}>> is no longer stored; do not retry; "
                           "re-run the command that produced it")
    assert '{"id": 5}' in got[1].text and "<<cg:ID>>" in got[1].text
    assert "'seg_0001'" in got[2].text and "do not retry" in got[2].text
    assert got[3].text == "café"
    assert got[4].text.startswith("the original for <<cg:0123456789abcdef>>")  # not looked up: not stored
    assert [is_cg_answer(a.text) for a in got] == [True, True, True, False, True]


def test_a_malformed_input_shown_in_the_answer_is_cut_short():
    [got] = answers([ExpandCall("1", "x" * 10_000, None)], {})
    assert len(got.text) < 500 and got.kind == MALFORMED.value


# ---------------------------------------------------------------------------------------------
# The continuation request


def insertion_point(raw: bytes) -> int:
    """Where a continuation inserts: just before the messages array's closing bracket."""
    body = continuation.ParsedBody.parse(raw)
    return body.spans[("messages",)][1] - 1


def claude_code_request(name="p_second_request_tool_result", **changes) -> bytes:
    body = claude_code_body(name)
    body.update(changes)
    return js_style(body)


def test_anthropic_continuation_appends_and_keeps_every_byte():
    forwarded = claude_code_request()
    response = anthropic_response([THINKING, {"type": "text", "text": "Reading it."}, tool_use("toolu_1")])
    calls = MESSAGES_LOOP.lone_expand_calls(response)
    out = MESSAGES_LOOP.continuation_body(forwarded, response, calls, {ID_A: b"line 1\nline 2 \xc3\xa9 </b>"})
    cut = insertion_point(forwarded)
    added = len(out) - len(forwarded)
    assert out[:cut] == forwarded[:cut] and out[cut + added:] == forwarded[cut:]
    got, sent = json.loads(out), json.loads(forwarded)
    assert got["messages"][:-2] == sent["messages"]
    assert {k: v for k, v in got.items() if k != "messages"} == {k: v for k, v in sent.items() if k != "messages"}
    assert got["messages"][-2:] == [
        {"role": "assistant", "content": response["content"]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "line 1\nline 2 é </b>"}]},
    ]
    # Claude Code's style (JSON.stringify): compact, raw non-ASCII, nothing else escaped.
    assert out[cut:cut + added] == b"," + js_style(got["messages"][-2]) + b"," + js_style(got["messages"][-1])


def test_the_thinking_block_and_its_signature_go_back_byte_exact():
    forwarded = claude_code_request("p_second_request_after_thinking")
    response = anthropic_response([THINKING, tool_use("toolu_1")])
    out = MESSAGES_LOOP.continuation_body(forwarded, response, MESSAGES_LOOP.lone_expand_calls(response), {ID_A: b"x"})
    assert js_style(THINKING) in out  # key order, text and signature as returned
    assert out.count(THINKING["signature"].encode()) == 1
    # the history's own thinking block is untouched too
    history_signature = b'"signature":"ZmFrZS1zaWduYXR1cmU="'
    assert out.count(history_signature) == forwarded.count(history_signature) == 1


def test_every_call_is_answered_in_order_and_the_same_id_once():
    forwarded = claude_code_request()
    response = anthropic_response([tool_use("toolu_1"), tool_use("toolu_2", tool_input={"id": "seg_0001"}),
                                   tool_use("toolu_3"), tool_use("toolu_4", tool_input={})])
    calls = MESSAGES_LOOP.lone_expand_calls(response)
    assert refs_to_resolve(calls) == [ID_A, "seg_0001"]
    out = MESSAGES_LOOP.continuation_body(forwarded, response, calls, {ID_A: b"AAA", "seg_0001": UNKNOWN})
    results = json.loads(out)["messages"][-1]["content"]
    assert [r["tool_use_id"] for r in results] == ["toolu_1", "toolu_2", "toolu_3", "toolu_4"]
    assert [r["content"] for r in results][::2] == ["AAA", "AAA"]
    assert "seg_0001" in results[1]["content"] and "takes" in results[3]["content"]
    assert all("is_error" not in r for r in results)


def test_no_cache_control_is_added():
    forwarded = claude_code_request()
    response = anthropic_response([tool_use("toolu_1")])
    out = MESSAGES_LOOP.continuation_body(forwarded, response, MESSAGES_LOOP.lone_expand_calls(response), {ID_A: b"x"})
    assert out.count(b'"cache_control"') == forwarded.count(b'"cache_control"') > 0




@pytest.mark.parametrize("stop_reason", ["refusal", "model_context_window_exceeded", "max_tokens", "pause_turn"])
def test_a_turn_that_did_not_stop_for_its_tools_is_not_cgs(stop_reason):
    assert MESSAGES_LOOP.lone_expand_calls(anthropic_response([tool_use("toolu_1")], stop_reason=stop_reason)) is None
    assert MESSAGES_LOOP.lone_expand_calls(anthropic_response([tool_use("toolu_1")])) is not None


@pytest.mark.parametrize("finish_reason", ["length", "content_filter"])
def test_a_chat_turn_cut_short_is_not_cgs(finish_reason):
    cut = openai_response(tool_calls=[openai_call("call_1")], finish_reason=finish_reason)
    assert CHAT_LOOP.lone_expand_calls(cut) is None
    assert CHAT_LOOP.lone_expand_calls(openai_response(tool_calls=[openai_call("call_1")])) is not None


@pytest.mark.parametrize(("finish_reason", "answered"), [("tool_calls", True), ("stop", True), (None, False),
                                                         ("function_call", False)])
def test_a_chat_turn_is_cgs_for_the_finish_reasons_the_stream_inspector_answers(finish_reason, answered):
    """The JSON loop and the chat stream inspector read the same `CHAT_CALL_FINISHES`."""
    response = openai_response(tool_calls=[openai_call("call_1")], finish_reason=finish_reason)
    assert (CHAT_LOOP.lone_expand_calls(response) is not None) is answered
    assert (finish_reason in CHAT_CALL_FINISHES) is answered

@pytest.mark.parametrize("given", [None, '"container_given"', '{"id":"container_given"}'])
def test_the_continuation_names_the_container_the_round_ran_code_in(given):
    """A request without a container got a new one (the response's `container`): the continuation
    names it, added last, every other byte kept; a request that names its own keeps it as it was."""
    forwarded = claude_code_request()
    if given is not None:
        forwarded = forwarded[:-1] + b',"container":' + given.encode() + b"}"
    response = dict(anthropic_response([tool_use("toolu_1")]),
                    container={"id": "container_011CPR5C", "expires_at": "2025-10-01T12:34:56Z"})
    calls = MESSAGES_LOOP.lone_expand_calls(response)
    out = MESSAGES_LOOP.continuation_body(forwarded, response, calls, {})
    without = MESSAGES_LOOP.continuation_body(forwarded, anthropic_response([tool_use("toolu_1")]), calls, {})
    if given is None:
        assert out == without[:-1] + b',"container":"container_011CPR5C"}'
    else:
        assert out == without

@pytest.mark.parametrize("name", ["p_first_request", "p_unknown_tool_followup", "nonstreaming_fallback_request"])
@pytest.mark.parametrize("stream", [None, True, False])
def test_stream_is_forced_as_asked(name, stream):
    forwarded = claude_code_request(name)
    response = anthropic_response([tool_use("toolu_1")])
    out = MESSAGES_LOOP.continuation_body(forwarded, response, MESSAGES_LOOP.lone_expand_calls(response), {},
                            stream=stream)
    sent, got = json.loads(forwarded), json.loads(out)
    if stream is None:
        assert ("stream" in got) == ("stream" in sent) and got.get("stream") == sent.get("stream")
    else:
        assert got["stream"] is stream
    assert list(got) == list(sent) + (["stream"] if "stream" not in sent and stream is not None else [])
    cut = insertion_point(forwarded)
    assert out.startswith(forwarded[:cut])
    tail = forwarded[cut:]
    if stream is not None and "stream" in sent:
        tail = tail.replace(b'"stream":' + json.dumps(sent["stream"]).encode(), b'"stream":' + json.dumps(stream).encode())
    elif stream is not None:
        tail = tail[:-1] + b',"stream":' + json.dumps(stream).encode() + b"}"
    assert out.endswith(tail)


def test_the_continuation_of_a_continuation_extends_it():
    first = claude_code_request()
    round1 = anthropic_response([tool_use("toolu_1")])
    second = MESSAGES_LOOP.continuation_body(first, round1, MESSAGES_LOOP.lone_expand_calls(round1), {ID_A: b"A"},
                               stream=False)
    round2 = anthropic_response([tool_use("toolu_2", tool_input={"id": ID_B})], id="msg_2")
    third = MESSAGES_LOOP.continuation_body(second, round2, MESSAGES_LOOP.lone_expand_calls(round2), {ID_B: b"B"},
                              stream=False)
    cut = insertion_point(second)
    assert third.startswith(second[:cut]) and third.endswith(second[cut:])
    assert [m["role"] for m in json.loads(third)["messages"][-4:]] == ["assistant", "user", "assistant", "user"]


@pytest.mark.parametrize("style, check", [
    (python_style, lambda new: new.isascii() and b"\\u00e9" in new),
    (go_style, lambda new: b"<" not in new and b"\\u003c/b\\u003e" in new and "é".encode() in new),
    (slash_style, lambda new: b"\\/" in new and b"\\u00e9" in new),
    (js_style, lambda new: b"</b>" in new and "é".encode() in new),
], ids=["python", "go", "slashes", "js"])
def test_new_json_is_written_the_way_the_client_writes(style, check):
    body = claude_code_body("p_second_request_tool_result")
    body["messages"][0]["content"][0]["text"] += " café </a> & co"  # evidence of the client's escaping
    forwarded = style(body)
    response = anthropic_response([tool_use("toolu_1")])
    original = "é </b> a/b".encode()
    out = MESSAGES_LOOP.continuation_body(forwarded, response, MESSAGES_LOOP.lone_expand_calls(response), {ID_A: original})
    cut = insertion_point(forwarded)
    new = out[cut:cut + len(out) - len(forwarded)]
    assert check(new)
    assert json.loads(out)["messages"][-1]["content"][0]["content"] == "é </b> a/b"


def test_a_lone_surrogate_travels_escaped():
    forwarded = claude_code_request()
    response = anthropic_response([{"type": "text", "text": "bad \ud800 text"}, tool_use("toolu_1")])
    out = MESSAGES_LOOP.continuation_body(forwarded, response, MESSAGES_LOOP.lone_expand_calls(response), {})
    assert json.loads(out)["messages"][-2]["content"][0]["text"] == "bad \ud800 text"


def test_openai_continuation_appends_the_message_as_returned_and_one_tool_message_per_call():
    body = {"model": "gpt-4.1", "messages": [{"role": "system", "content": "be brief"},
                                             {"role": "user", "content": "what failed?"}],
            "tools": [{"type": "function", "function": {"name": "shell", "parameters": {}}}]}
    forwarded = json.dumps(body).encode()  # the Python SDK's spelling
    response = openai_response(content="Reading.", tool_calls=[
        openai_call("call_1"), openai_call("call_2", arguments="{}")])
    out = CHAT_LOOP.continuation_body(forwarded, response, CHAT_LOOP.lone_expand_calls(response), {ID_A: b"AAA"})
    got = json.loads(out)["messages"]
    assert got[:2] == body["messages"]
    assert got[2] == response["choices"][0]["message"]
    assert got[3] == {"role": "tool", "tool_call_id": "call_1", "content": "AAA"}
    assert got[4]["role"] == "tool" and got[4]["tool_call_id"] == "call_2" and is_cg_answer(got[4]["content"])
    cut = insertion_point(forwarded)
    assert out.startswith(forwarded[:cut]) and out.endswith(forwarded[cut:])


def test_empty_messages_get_no_leading_comma():
    out = MESSAGES_LOOP.continuation_body(b'{"messages":[]}', anthropic_response([tool_use("t")]),
                                          [ExpandCall("t", {}, ID_A)], {ID_A: b"x"})
    assert [m["role"] for m in json.loads(out)["messages"]] == ["assistant", "user"]


@pytest.mark.parametrize("raw", [b"[]", b'{"model":"x"}', b'{"messages":{}}', b"not json"])
def test_a_body_without_messages_is_refused(raw):
    with pytest.raises(ValueError):
        MESSAGES_LOOP.continuation_body(raw, anthropic_response([]), [], {})


text_no_surrogates = st.text(st.characters(blacklist_categories=("Cs",)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(
    history=st.lists(text_no_surrogates, max_size=4),
    originals=st.lists(text_no_surrogates, min_size=1, max_size=3),
    style=st.sampled_from([js_style, python_style, go_style, slash_style]),
)
def test_property_the_continuation_keeps_the_request_and_answers_every_call(history, originals, style):
    body = {"model": "m", "messages": [{"role": "user", "content": text} for text in history] or
            [{"role": "user", "content": "hi"}], "tools": [], "max_tokens": 5}
    forwarded = style(body)
    ids = [marker_id(text.encode()) for text in originals]
    response = anthropic_response([tool_use(f"toolu_{i}", tool_input={"id": ref}) for i, ref in enumerate(ids)])
    calls = MESSAGES_LOOP.lone_expand_calls(response)
    out = MESSAGES_LOOP.continuation_body(forwarded, response, calls, {ref: t.encode() for ref, t in zip(ids, originals)})
    cut = insertion_point(forwarded)
    added = len(out) - len(forwarded)
    assert out[:cut] == forwarded[:cut] and out[cut + added:] == forwarded[cut:]
    answered = json.loads(out)["messages"][-1]["content"]
    by_id = dict(zip(ids, originals))
    assert [r["content"] for r in answered] == [by_id[ref] for ref in ids]


def test_client_style_without_evidence_writes_like_json_stringify():
    value = {"a": "é </b> & \u2028 a/b"}
    assert ClientStyle("").dumps(value) == json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    # an escaped backslash before "u" or "/" is not evidence of escaping
    assert ClientStyle('{"t":"C:\\\\u00e9\\\\/x"}').dumps(value) == ClientStyle("").dumps(value)


# ---------------------------------------------------------------------------------------------
# The merged response


def usage(input_tokens, read, write, output):
    return {"input_tokens": input_tokens, "cache_creation_input_tokens": write,
            "cache_read_input_tokens": read, "output_tokens": output}


def test_anthropic_merge_keeps_the_first_id_the_non_expand_content_and_the_final_stop():
    round1 = anthropic_response([THINKING, {"type": "text", "text": "Let me expand."}, tool_use("toolu_1")],
                                id="msg_first", usage=usage(3, 5000, 100, 40))
    round2 = anthropic_response([{"type": "text", "text": "Still need B."}, tool_use("toolu_2")],
                                id="msg_second", usage=usage(2, 5100, 300, 30))
    round3 = anthropic_response([{"type": "text", "text": "The test failed because X."}], id="msg_third",
                                stop_reason="end_turn", usage=usage(1, 5400, 10, 20))
    merged = MESSAGES_LOOP.merge([round1, round2, round3])
    assert merged["id"] == "msg_first"
    assert list(merged) == list(round1)
    assert merged["content"] == [THINKING, {"type": "text", "text": "Let me expand."},
                                 {"type": "text", "text": "Still need B."},
                                 {"type": "text", "text": "The test failed because X."}]
    assert merged["stop_reason"] == "end_turn"
    assert merged["usage"] == usage(3, 5000, 100, 90)
    assert round1["content"][2]["type"] == "tool_use"  # the rounds themselves are not changed
    assert MESSAGES_LOOP.billed([round1, round2, round3]) == [
        Usage(3, 5000, 100, 40), Usage(2, 5100, 300, 30), Usage(1, 5400, 10, 20)]


def test_anthropic_merge_keeps_the_final_rounds_calls_whole():
    round1 = anthropic_response([tool_use("toolu_1")])
    final = anthropic_response([{"type": "text", "text": "Now run it."}, tool_use("toolu_2"),
                                tool_use("toolu_3", name="Bash", tool_input={"command": "make"})])
    merged = MESSAGES_LOOP.merge([round1, final])
    assert merged["content"] == final["content"] and merged["stop_reason"] == "tool_use"


def test_merging_one_round_gives_it_back():
    response = anthropic_response([THINKING, tool_use("toolu_1")])
    assert MESSAGES_LOOP.merge([response]) == response
    completion = openai_response(content="hi", finish_reason="stop")
    assert CHAT_LOOP.merge([completion]) == completion


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(*[st.integers(0, 10**6)] * 4), min_size=1, max_size=5))
def test_property_usage_input_side_from_the_first_round_output_summed(counts):
    rounds = [anthropic_response([tool_use(f"t{i}")], usage=usage(*c)) for i, c in enumerate(counts)]
    merged = MESSAGES_LOOP.merge(rounds)["usage"]
    first = counts[0]
    assert merged == usage(first[0], first[1], first[2], sum(c[3] for c in counts))


def test_openai_merge():
    round1 = openai_response(content="Let me look.", tool_calls=[openai_call("call_1")], id="chatcmpl-first")
    round2 = openai_response(content=None, tool_calls=[openai_call("call_2")], id="chatcmpl-2",
                             usage={"prompt_tokens": 1500, "completion_tokens": 7, "total_tokens": 1507,
                                    "prompt_tokens_details": {"cached_tokens": 1000},
                                    "completion_tokens_details": {"reasoning_tokens": 2, "audio_tokens": 0}})
    final = openai_response(content="It failed because X.", tool_calls=[openai_call("call_9", name="shell")],
                            id="chatcmpl-3", finish_reason="tool_calls")
    merged = CHAT_LOOP.merge([round1, round2, final])
    assert merged["id"] == "chatcmpl-first" and list(merged) == list(round1)
    [choice] = merged["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me look.\n\nIt failed because X."
    assert choice["message"]["tool_calls"] == final["choices"][0]["message"]["tool_calls"]
    assert merged["usage"] == {"prompt_tokens": 1000, "completion_tokens": 47, "total_tokens": 1047,
                               "prompt_tokens_details": {"cached_tokens": 900, "audio_tokens": 0},
                               "completion_tokens_details": {"reasoning_tokens": 12, "audio_tokens": 0}}
    final_stop = copy.deepcopy(final)
    final_stop["choices"][0]["message"].pop("tool_calls")
    final_stop["choices"][0]["finish_reason"] = "stop"
    merged = CHAT_LOOP.merge([round1, final_stop])
    assert "tool_calls" not in merged["choices"][0]["message"]
    assert merged["choices"][0]["finish_reason"] == "stop"
    assert CHAT_LOOP.billed([round1, round2]) == [Usage(100, 900, 0, 20), Usage(500, 1000, 0, 7)]


def test_merge_needs_a_round():
    with pytest.raises(ValueError):
        MESSAGES_LOOP.merge([])
