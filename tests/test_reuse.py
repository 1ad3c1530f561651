"""Parsing a body against the previous one of its conversation gives what a fresh parse gives."""

import copy
import json

from fixturedata import claude_code_body
from helpers.bodies import js_style
from hypothesis import given, settings
from hypothesis import strategies as st

from cg.compaction import cold
from cg.compaction.pipeline import Memo
from cg.compaction.rewrite import RewriteConfig, Rewriter
from cg.exchange import keepalive
from cg.wire import jsonbytes
from cg.wire.body import UNREAD, ParsedBody
from cg.wire.cache import TTL_1H, TTL_5M, asks_for_an_hour, cache_lifetime
from cg.wire.dialect import MESSAGES_SHAPE

TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40)
MESSAGE = st.fixed_dictionaries({
    "role": st.sampled_from(["user", "assistant", "system"]),
    "content": st.one_of(TEXT, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
                                        max_size=3)),
})
STYLE = st.sampled_from([{"separators": (",", ":"), "ensure_ascii": False}, {"ensure_ascii": True}, {"indent": 1}])


def body(messages, tools=("Bash",)) -> dict:
    return {"model": "m", "messages": messages, "system": [{"type": "text", "text": "s"}],
            "tools": [{"name": t} for t in tools]}


TOOLS = st.lists(st.sampled_from(["Bash", "Read", "Édit", "Grep ✓"]), max_size=3)


@settings(max_examples=300, deadline=None)
@given(history=st.lists(MESSAGE, max_size=8), added=st.lists(MESSAGE, max_size=3),
       edit_at=st.integers(min_value=0, max_value=10), edited=MESSAGE, style=STYLE,
       tools=st.tuples(TOOLS, TOOLS))
def test_reuse_gives_a_fresh_parse(history, added, edit_at, edited, style, tools):
    before = json.dumps(body(history, tools[0]), **style).encode()
    grown = history + added
    if grown and edit_at < len(grown):  # a client may rewrite an earlier message, too
        grown = grown[:edit_at] + [edited] + grown[edit_at + 1:]
    after = json.dumps(body(grown, tools[1]), **style).encode()
    previous = ParsedBody.parse(before)
    reused, fresh = ParsedBody.parse(after, previous.earlier()), ParsedBody.parse(after)
    assert fresh.value == json.loads(after)
    assert reused.value == fresh.value
    assert reused.spans == fresh.spans
    if tools[0] == tools[1]:  # what follows the history is the same: taken, not scanned
        assert reused.value["tools"] is previous.value["tools"]


def test_shared_messages_are_not_scanned_again():
    history = [{"role": "user", "content": "x" * 1000} for _ in range(50)]
    previous = ParsedBody.parse(json.dumps(body(history)).encode())
    grown = ParsedBody.parse(json.dumps(body([*history, {"role": "user", "content": "new"}])).encode(),
                             previous.earlier())
    messages = grown.value["messages"]
    assert [i for i in range(51) if list.__getitem__(messages, i) is not UNREAD] == [50]  # only the new one
    assert grown.value["tools"] is previous.value["tools"]  # after the history, unchanged
    assert grown.value["system"] is previous.value["system"]
    assert messages[3] == history[3] and list.__getitem__(messages, 3) == history[3]  # read when looked at, once
    again = ParsedBody.parse(previous.raw, previous.earlier())
    assert all(list.__getitem__(again.value["messages"], i) is UNREAD for i in range(50))
    assert again.value == previous.value and again.doc == previous.doc  # read, now


def test_an_earlier_body_keeps_no_message():
    """A conversation's memo entry holds its bytes, not its messages' values (most of its memory)."""
    previous = ParsedBody.parse(json.dumps(body([{"role": "user", "content": "x" * 1000}] * 3)).encode())
    assert previous.value["messages"][0]["content"] == "x" * 1000
    assert previous.earlier().value["messages"] == [UNREAD] * 3
    assert previous.value["messages"][0]["content"] == "x" * 1000  # the body itself keeps its own


def test_messages_read_lazily_look_like_a_list_however_they_are_looked_at():
    history = [{"role": "user", "content": f"m{i} é"} for i in range(4)]
    raw = json.dumps(body(history), ensure_ascii=False).encode()
    previous = ParsedBody.parse(raw)

    def fresh():
        return ParsedBody.parse(raw, previous.earlier()).value["messages"]

    assert fresh() == history and history == fresh() and not (fresh() != history)
    assert list(fresh()) == history and fresh()[1:3] == history[1:3] and fresh()[-1] == history[-1]
    assert list(reversed(fresh())) == history[::-1] and history[2] in fresh() and fresh().index(history[2]) == 2
    assert fresh().count(history[0]) == 1 and fresh() + [1] == [*history, 1] and [0] + fresh() == [0, *history]
    assert fresh().copy() == history and copy.deepcopy(fresh()) == history and type(copy.copy(fresh())) is list
    assert json.loads(json.dumps(list(fresh()))) == history and repr(fresh()) == repr(history)
    assert sorted(fresh(), key=lambda m: m["content"]) == history and len(fresh()) == 4


def test_a_message_taken_from_the_last_parse_brings_the_spans_walked_inside_it():
    history = [{"role": "user", "content": [{"type": "text", "text": "é" * 10}]} for _ in range(3)]
    previous = ParsedBody.parse(json.dumps(body(history), ensure_ascii=False).encode())
    previous.inner[("messages", 0)] = {("content", 0, "text"): (1, 2)}
    previous.inner[("messages", 2)] = {("content", 0, "text"): (3, 4)}
    grown = [*history[:2], {"role": "user", "content": "changed"}]
    parsed = ParsedBody.parse(json.dumps(body(grown), ensure_ascii=False).encode(), previous.earlier())
    assert parsed.inner == {("messages", 0): {("content", 0, "text"): (1, 2)}}  # not the changed one


def test_common_suffix():
    assert jsonbytes.common_suffix("abcdef", "xbcdef", 10) == 5
    assert jsonbytes.common_suffix("abcdef", "xbcdef", 3) == 3
    assert jsonbytes.common_suffix(b"abc", b"abc", 10) == 3
    assert jsonbytes.common_suffix("abc", "zabc", 10) == 3
    assert jsonbytes.common_suffix("", "a", 10) == 0
    long = "y" * 200_000
    assert jsonbytes.common_suffix("a" + long, "b" + long, 300_000) == 200_000
    assert jsonbytes.common_suffix(long, "z" + "y" * 70_000, 300_000) == 70_000


def test_common_prefix():
    assert jsonbytes.common_prefix("abcdef", "abcxef") == 3
    assert jsonbytes.common_prefix("abc", "abc") == 3
    assert jsonbytes.common_prefix("abc", "abcd") == 3
    assert jsonbytes.common_prefix("", "a") == 0
    long = "y" * 200_000
    assert jsonbytes.common_prefix(long + "a", long + "b") == 200_000
    assert jsonbytes.common_prefix(long, "y" * 70_000 + "z") == 70_000


def test_a_hundred_conversations_each_parse_against_their_own_last_turn():
    """The memo keeps each conversation's last body, bounded by bytes, not by a small count."""
    rewriter = Rewriter(RewriteConfig())
    turns = [[{"role": "user", "content": f"conversation {n}: " + "x" * 2000}] for n in range(100)]
    for n, messages in enumerate(turns):
        rewriter.parse(json.dumps(body(messages)).encode(), b"/v1/messages", f"c{n}")
    for n, messages in enumerate(turns):
        grown = [*messages, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "next"}]
        assert rewriter.parse(json.dumps(body(grown)).encode(), b"/v1/messages", f"c{n}") is not None
    bodies = rewriter.memo.bodies
    assert (bodies.hits, len(bodies)) == (100, 100)

    small = Rewriter(RewriteConfig(), Memo(max_body_bytes=5_000))  # room for two of these bodies
    for n, messages in enumerate(turns[:3]):
        small.parse(json.dumps(body(messages)).encode(), b"/v1/messages", f"c{n}")
    assert len(small.memo.bodies) == 2 and small.memo.bodies.take("c0") is None  # the oldest went first


# Turns of an Anthropic conversation: a tool call and its result, small, big (offloaded),
# pretty-printed JSON (reformatted) or a repeat (deduplicated).
_BIG = "\n".join(f"line {n}: collected test_{n} PASSED" for n in range(700)) + "\nE   AssertionError: boom"
_RESULT = st.sampled_from(["ok", _BIG, _BIG + "\nmore", json.dumps({"a": [1, 2, {"b": "c"}]}, indent=2),
                           "x" * 30])


def _turn(n: int, result: str, tool: str) -> list[dict]:
    call_id = f"toolu_{n}"
    return [{"role": "assistant", "content": [{"type": "tool_use", "id": call_id, "name": tool, "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id, "content": result}]}]


@settings(max_examples=60, deadline=None)
@given(results=st.lists(st.tuples(_RESULT, st.sampled_from(["Bash", "Read"])), min_size=1, max_size=8),
       edit_at=st.integers(min_value=0, max_value=20), lossy=st.booleans())
def test_a_turn_planned_against_the_last_is_planned_as_from_scratch(results, edit_at, lossy):
    """The messages a turn shares with the last one are planned as they were: the same edits,
    changes and originals as a rewrite that never saw the earlier turn."""
    messages: list[dict] = []
    carried = Rewriter(RewriteConfig())
    for n, (result, tool) in enumerate(results):
        messages += _turn(n, result, tool)
        sent = [dict(m) for m in messages]
        # Claude Code marks the newest result for the cache: the last turn's result changes, not its call
        sent[-1] = {**sent[-1], "content": [{**sent[-1]["content"][0], "cache_control": {"type": "ephemeral"}}]}
        if edit_at < len(sent) and n == len(results) - 1:  # a client may rewrite an earlier message
            sent[edit_at] = {"role": sent[edit_at]["role"], "content": "rewritten"}
        raw = json.dumps(body(sent)).encode()
        incoming = carried.parse(raw, b"/v1/messages", "c")
        fresh = Rewriter(RewriteConfig()).parse(raw, b"/v1/messages", "c")
        got, want = carried.finish(incoming, lossy=lossy), Rewriter(RewriteConfig()).finish(fresh, lossy=lossy)
        assert (got.body, got.changes, got.originals, got.runs, got.reverted) == (
            want.body, want.changes, want.originals, want.runs, want.reverted)
    assert carried.memo.bodies.hits == len(results) - 1


def _result(call_id: str, text: str) -> str:
    return json.dumps({"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id, "content": text}]})


_COLOURED = "\x1b[31mred\x1b[0m " * 20  # textclean rewrites it: an edit inside its message


def _bodies(*arrays: str) -> bytes:
    """A body whose "messages" key comes once per value given (a duplicate key: the last one wins)."""
    return ('{"model":"m",' + ",".join(f'"messages":{a}' for a in arrays) + ',"tools":[{"name":"Bash"}]}').encode()


def _list(*messages: str) -> str:
    return "[" + ",".join(messages) + "]"


def _warm_and_cold(*turns: bytes) -> tuple[bytes, bytes]:
    """The last turn's forwarded body after the others (one conversation), and from scratch."""
    warm = Rewriter(RewriteConfig())
    for turn in turns:
        got = warm.finish(warm.parse(turn, b"/v1/messages", "c")).body
    cold = Rewriter(RewriteConfig())
    return got, cold.finish(cold.parse(turns[-1], b"/v1/messages", "c")).body


def test_a_duplicate_key_keeps_only_the_last_ones_spans():
    doc = _bodies(_list(_result("t1", "a"), _result("t2", "c")), _list(_result("t3", "x"))).decode()
    value, spans = jsonbytes.load(doc, {"messages": {jsonbytes.EACH: {}}})
    assert value == json.loads(doc)
    assert ("messages", 1) not in spans  # the first array's second message is not the body's
    start, end = spans[("messages", 0)]
    assert json.loads(doc[start:end]) == value["messages"][0]


def test_a_turn_after_a_duplicate_key_is_planned_as_from_scratch():
    """Neither a message's value, nor the spans walked inside it, nor its plan may come from an
    array a duplicate key replaced: the last would splice at the wrong place."""
    a, c, d = _result("t1", "a"), _result("t2", "c"), _result("t4", "d")
    coloured, other = _result("t1", _COLOURED), _result("t1234567890", "\x1b[32mgreen\x1b[0m " * 20)
    turns = [
        (_bodies(_list(coloured)), _bodies(_list(coloured), _list(other))),  # spans walked inside
        (_bodies(_list(a, c), _list(_result("t5", _COLOURED), _result("t6", "y"))), _bodies(_list(a, c, d))),  # plan
        (_bodies(_list(a, c), '"xyz"'), _bodies(_list(a, _result("t2", _COLOURED), d))),  # value ("xyz"[1])
        (_bodies(_list(a, c), _list(a)), _bodies(_list(a, c, d))),  # parsed at all ([a][1]: IndexError)
        (_bodies(_list(a, c), "7"), _bodies(_list(a, c, d))),  # nor raise (7[1]: TypeError)
    ]
    for earlier, turn in turns:
        warm, cold = _warm_and_cold(earlier, turn)
        assert warm == cold
        json.loads(warm)


def test_a_number_the_shared_prefix_cuts_is_scanned_again():
    previous = ParsedBody.parse(b'{"messages":[],"system":1,"tools":[]}')
    assert ParsedBody.parse(b'{"messages":[],"system":12,"tools":[]}', previous.earlier()).value["system"] == 12


def test_a_side_request_to_another_model_leaves_the_main_thread_s_body():
    """Claude Code sends small-model side requests under the same session id: the main thread's
    next turn is still parsed and planned against its own last body."""
    rewriter = Rewriter(RewriteConfig())
    history = [{"role": "user", "content": "x" * 5000}]
    main = {**body(history), "model": "claude-opus-4-8"}
    side = {**body([{"role": "user", "content": "a title for this"}]), "model": "claude-haiku-4-5"}
    first = rewriter.parse(json.dumps(main).encode(), b"/v1/messages", "session")
    rewriter.parse(json.dumps(side).encode(), b"/v1/messages", "session")
    grown = {**main, "messages": [*history, {"role": "assistant", "content": "ok"}]}
    then = rewriter.parse(json.dumps(grown).encode(), b"/v1/messages", "session")
    assert list.__getitem__(then.body.value["messages"], 0) is UNREAD  # taken, not scanned
    assert then.body.shared > len(json.dumps(history[0])) and first.body.value["messages"] == history


def test_conversations_without_a_session_id_each_parse_against_their_own_last_turn():
    """An SDK client sends no session header: interleaved conversations are told apart by how
    their messages open."""
    rewriter = Rewriter(RewriteConfig())
    histories = [[{"role": "user", "content": f"task {n}: " + "x" * 600}] for n in range(3)]
    for history in histories:
        rewriter.parse(json.dumps(body(history)).encode(), b"/v1/messages")
    for turn in range(2):
        for history in histories:
            history += [{"role": "assistant", "content": f"step {turn}"}, {"role": "user", "content": "go on"}]
            parsed = rewriter.parse(json.dumps(body(history)).encode(), b"/v1/messages")
            assert parsed.body.shared > len(json.dumps(history[0]))  # its own last turn, not another's
    assert rewriter.memo.bodies.hits == 6


@settings(max_examples=300, deadline=None)
@given(history=st.lists(MESSAGE, max_size=8), style=STYLE)
def test_spans_are_byte_offsets_and_values_the_clients_strings(history, style):
    """A body is parsed as its Latin-1 view: each message's span holds its UTF-8 bytes, and its
    value has the strings the client meant, escaped or not."""
    raw = json.dumps(body(history), **style).encode()
    parsed = ParsedBody.parse(raw)
    assert parsed.value == json.loads(raw)
    for index, message in enumerate(history):
        start, end = parsed.spans[("messages", index)]
        assert json.loads(raw[start:end]) == message == parsed.value["messages"][index]


def test_a_body_that_is_not_utf8_is_not_parsed():
    """Invalid UTF-8 in a string cg scans, whether new or past a shared prefix, is not a body cg
    edits (it is forwarded untouched), as a decode of the whole body would have found."""
    history = [{"role": "user", "content": "caf\u00e9"}]
    good = json.dumps(body(history), ensure_ascii=False).encode()
    assert ParsedBody.parse(good) is not None
    bad = good.replace("é".encode(), b"\xe9")  # Latin-1's é, alone: not UTF-8
    assert ParsedBody.parse(bad) is None
    grown = json.dumps(body([{"role": "user", "content": "x"}, *history]), ensure_ascii=False).encode()
    assert ParsedBody.parse(grown.replace("é".encode(), b"\xe9"), ParsedBody.parse(good).earlier()) is None
    assert ParsedBody.parse('{"ké": 1}'.encode().replace("é".encode(), b"\xe9")) is None
    assert ParsedBody.parse('{"ké": "\\u00e9"}'.encode()).value == {"ké": "é"}


def test_session_less_chats_of_one_app_are_named_past_its_instructions():
    """Two chats opening with the same system (or developer) message keep a body each: named by
    their first other message, each turn is parsed against its own last one, past the shared
    instructions."""
    rewriter = Rewriter(RewriteConfig())
    system = {"role": "system", "content": "You are a helpful assistant. " * 40}
    chats = [[system, {"role": "developer", "content": "be brief"}, {"role": "user", "content": f"task {i}"}]
             for i in range(2)]
    for _ in range(3):
        for chat in chats:
            chat += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
            parsed = rewriter.parse(json.dumps({"model": "m", "messages": chat}).encode(), b"/v1/chat/completions")
    assert parsed.body.shared > len(json.dumps(chat[:3]))
    assert (rewriter.memo.bodies.hits, len(rewriter.memo.bodies)) == (4, 2)


def test_a_short_session_less_chat_keeps_its_name_as_it_grows():
    """How a session-less conversation opens is its first message (its first 512 bytes when
    longer), not the bytes after it, which change every turn."""
    rewriter = Rewriter(RewriteConfig())
    messages = [{"role": "user", "content": "hello"}]
    for _ in range(4):
        rewriter.parse(json.dumps(body(messages)).encode(), b"/v1/messages")
        messages = [*messages, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    assert (rewriter.memo.bodies.hits, len(rewriter.memo.bodies)) == (3, 1)


def test_a_warm_turn_reads_only_its_new_messages(monkeypatch):
    """Everything cg asks of a turn parsed against the last one (repairs and their edits once the
    history names the expand tool, the keep-alive's lifetime when only messages carry breakpoints, the cache's
    lifetime, a cold epoch's superseded file views, the plan) reads only the messages it added:
    the memo keeps no message values (cg.wire.body.Messages), so reading the others would parse
    the history again."""
    history = claude_code_body("p_unknown_tool_followup")
    history["system"] = [{"type": "text", "text": "no breakpoint here"}]
    read = {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_read", "name": "Read", "input": {"file_path": "/a.py"}}]}
    shown = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_read",
                                          "content": "x = 1\n" * 2000}]}
    edit = {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_edit", "name": "Edit", "input": {"file_path": "/a.py"}}]}
    done = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_edit", "content": "ok",
                                         "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}
    history["messages"] += [read, shown, edit, done]
    rewriter = Rewriter(RewriteConfig())
    config = rewriter.config.compact
    cutoff = len(history["messages"]) - 1  # the Read and its Edit before it
    epochs, bodies = [], []

    def turn(value: dict) -> tuple[float | None, bool]:
        incoming = rewriter.parse(js_style(value), b"/v1/messages", "session")
        assert incoming is not None and incoming.repairs  # the history names the expand tool
        body = incoming.body
        bodies.append(body)
        epochs.append(cold.Epoch(cutoff, cold.fingerprint(body, MESSAGES_SHAPE, cutoff - 1), 100, cold.VIEWS_SUPERSEDED))
        older = cold.older(epochs[0], body, MESSAGES_SHAPE, config)
        assert older is not None and older.superseded  # the Read that the Edit superseded
        rewritten = rewriter.finish(incoming, {repair.tool_use_id: "the original" for repair in incoming.repairs},
                                    older=older)
        assert rewritten.repaired == 1
        return keepalive.lifetime(body), cold.cache_ttl(body, MESSAGES_SHAPE) == TTL_1H

    assert turn(history) == (TTL_5M, True)  # message 3's breakpoint: 5 minutes
    scans = []
    monkeypatch.setattr(jsonbytes, "scan", lambda raw, span: scans.append(span) or json.loads(raw[span[0]:span[1]]))
    history["messages"] += [{"role": "assistant", "content": [{"type": "text", "text": "next"}]},
                            {"role": "user", "content": [{"type": "text", "text": "go on"}]}]
    assert turn(history) == (TTL_5M, True)
    # The new messages came with the parse, and no other was read: only the repaired block, to
    # write it again.
    body = bodies[-1]
    assert [body.raw[start:end] for start, end in scans] == [js_style(history["messages"][3]["content"][0])]
    assert epochs[0] == epochs[1]  # the epoch matches both turns


def test_a_message_rewritten_in_place_is_answered_again():
    """A carried answer needs the message within what the two bodies share, not only at the same
    place: a client may rewrite a message to the same length (here its breakpoint's lifetime)."""
    def turn(ttl: str, earlier: ParsedBody | None = None) -> ParsedBody:
        mark = {"type": "ephemeral", "ttl": ttl}
        messages = [{"role": "user", "content": [{"type": "text", "text": "a", "cache_control": mark}]},
                    {"role": "assistant", "content": "b"}]
        parsed = ParsedBody.parse(json.dumps(body(messages)).encode(), earlier and earlier.earlier())
        assert parsed is not None
        return parsed

    first = turn("5m")
    assert not asks_for_an_hour(first)
    second = turn("1h", first)
    assert second.spans == first.spans and second.shared < second.spans[("messages", 0)][1]
    assert asks_for_an_hour(second) and cache_lifetime(second) == TTL_1H
