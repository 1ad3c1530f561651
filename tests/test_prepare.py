"""The request side's preparation on its own, without a reactor: the request in, store commands out,
their answers in, one `Ready` out (cg.exchange.prepare)."""

import json

import pytest

from cg.compaction import cold
from cg.compaction.options import rewrite_config
from cg.compaction.rewrite import Rewriter
from cg.exchange import prepare
from cg.exchange.machine import Unexpected
from cg.exchange.prepare import (
    Answered,
    Failed,
    Freeze,
    Preparation,
    PutOriginals,
    ReadFrozen,
    ReadOriginal,
    Ready,
    RecordCache,
    Request,
    State,
    StoreContractBroken,
    Touch,
)
from cg.stream.hidden import HiddenTurn, Seen, Shown, record, record_key
from cg.testing import command_output
from cg.testing.tables import names_in, table_rows
from cg.wire.markers import EXPAND_TOOL, marker_id

NOW = 1_700_000_000.0
BASH = {"name": "Bash", "description": "run a command", "input_schema": {"type": "object"}}
NO_SUCH_TOOL = "<tool_use_error>Error: No such tool available: context_guru_expand</tool_use_error>"
OUTPUT = command_output()
REF = marker_id(OUTPUT.encode())


class Index:
    """The store's synchronous part: what it holds, and whether it is healthy."""

    def __init__(self, held=(), healthy=True):
        self.held = set(held)
        self.healthy = healthy

    def known(self, tenant, ids):
        return {i for i in ids if i in self.held}


def tool_turns(n: int) -> list[dict]:
    """`n` Bash calls, each answered with a long output (the last one's is OUTPUT)."""
    messages: list[dict] = [{"role": "user", "content": "run the tests"}]
    for i in range(n):
        output = OUTPUT if i == n - 1 else command_output(900 + i)
        messages += [
            {"role": "assistant", "content": [{"type": "tool_use", "id": f"toolu_{i}", "name": "Bash",
                                               "input": {"command": "pytest"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": output}]},
        ]
    return messages


def body(messages: list[dict], **extra) -> bytes:
    return json.dumps({"model": "claude-opus-4-8", "max_tokens": 1024, "tools": [BASH], "messages": messages,
                       **extra}).encode()


def repair_body(ref: str) -> bytes:
    return body([
        {"role": "user", "content": "what failed?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_leak", "name": EXPAND_TOOL,
                                           "input": {"id": ref}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_leak", "is_error": True,
                                      "content": NO_SUCH_TOOL}, {"type": "text", "text": "go on"}]},
    ])


def preparation(raw: bytes, *, conversation=b"", index=None, bypass=False, target=b"/v1/messages",
                known=None, now=NOW, **options) -> Preparation:
    headers = {"x-claude-code-session-id": conversation.decode()} if conversation else {}
    request = Request(raw, target, 7, "tenant-a", conversation, headers.get, bypass=bypass)
    return Preparation(request, rewriter=Rewriter(rewrite_config()), known=known or cold.Known(),
                       index=Index() if index is None else index, now=now, **options)


def ready(commands) -> Ready:
    assert len(commands) == 1 and isinstance(commands[0], Ready), commands
    return commands[0]


def sent_messages(forward) -> list:
    return json.loads(forward.body)["messages"]


def test_a_bypassed_request_is_ready_at_once_as_it_came():
    raw = body(tool_turns(1))
    machine = preparation(raw, bypass=True)
    done = ready(machine.start())
    assert done.forward.body == raw and done.forward.rewrite is None
    assert done.report.bypassed and machine.state is State.READY
    assert done.forward.tenant == "tenant-a"  # its ledger row is its tenant's, not tenant "" (anyone's under header:NAME)


def test_a_body_cg_does_not_parse_goes_as_it_came_with_its_session():
    done = ready(preparation(b'{"model": ', conversation=b"s1").start())
    assert done.forward.body == b'{"model": ' and done.forward.session == "s1"
    assert done.forward.tenant == "tenant-a" and done.report.rewrite is None  # its ledger row: its tenant's


def test_new_originals_are_stored_before_their_marker_is_forwarded():
    index = Index()
    machine = preparation(body(tool_turns(1)), index=index)
    (put,) = machine.start()
    assert isinstance(put, PutOriginals) and put.tenant == "tenant-a"
    assert put.originals == {REF: OUTPUT.encode()} and machine.state is State.STORING
    index.held.add(REF)
    done = ready(machine.feed(Answered(put, {REF})))
    assert f"<<cg:{REF}>>" in done.forward.body.decode()
    assert done.forward.originals == {REF: OUTPUT.encode()}
    assert done.forward.rewrite is not None and done.forward.rewrite.parsed == {}  # the parse is not kept
    assert done.report.rewrite is not None and done.report.rewrite.parsed  # but counted


def test_originals_the_store_holds_are_touched_not_stored_again():
    commands = preparation(body(tool_turns(1)), index=Index({REF})).start()
    assert [type(c) for c in commands] == [Touch, Ready]
    assert commands[0].ids == frozenset({REF})


def test_a_store_that_forgot_what_it_stored_is_given_them_once_more():
    machine = preparation(body(tool_turns(1)))
    (put,) = machine.start()
    (again,) = machine.feed(Answered(put, {REF}))  # the index still does not know it
    assert isinstance(again, PutOriginals) and again is not put
    done = ready(machine.feed(Answered(again, {REF})))
    assert f"<<cg:{REF}>>" in done.forward.body.decode()


def test_a_store_that_cannot_keep_an_original_sends_it_whole():
    raw = body(tool_turns(1))
    machine = preparation(raw)
    (put,) = machine.start()
    done = ready(machine.feed(Failed(put, "disk full")))
    assert sent_messages(done.forward)[2]["content"][0]["content"] == OUTPUT
    assert done.report.store_fail_open and done.forward.originals == {}


def test_observe_mode_decides_and_counts_but_forwards_the_body_as_it_came():
    raw = body(tool_turns(1))
    done = ready(preparation(raw, observe=True).start())
    assert done.forward.body == raw and done.forward.rewrite is None
    assert done.report.rewrite is not None and done.report.rewrite.originals


def test_a_repair_reads_its_frozen_text_first():
    machine = preparation(repair_body(REF), index=Index({REF}))
    (read,) = machine.start()
    assert read == read and isinstance(read, ReadFrozen) and read.key == "toolu_leak"
    done = ready(machine.feed(Answered(read, b"the frozen answer")))
    assert sent_messages(done.forward)[2]["content"][0] == {"type": "tool_result", "tool_use_id": "toolu_leak",
                                                             "content": "the frozen answer"}
    assert done.report.rewrite is not None and done.report.rewrite.repaired == 1


def test_a_first_repair_reads_the_original_and_freezes_its_answer():
    machine = preparation(repair_body(REF))
    (read,) = machine.start()
    (get,) = machine.feed(Answered(read, None))
    assert isinstance(get, ReadOriginal) and get.ref == REF
    (freeze,) = machine.feed(Answered(get, OUTPUT.encode()))
    assert isinstance(freeze, Freeze) and freeze.key == "toolu_leak" and freeze.text == OUTPUT.encode()
    done = ready(machine.feed(Answered(freeze, b"what another cg froze first")))
    assert sent_messages(done.forward)[2]["content"][0]["content"] == "what another cg froze first"


@pytest.mark.parametrize("failure", ["frozen", "freeze", "unhealthy"])
def test_a_repair_the_store_cannot_answer_leaves_the_clients_answer(failure):
    index = Index(healthy=failure != "unhealthy")
    machine = preparation(repair_body(REF), index=index)
    (read,) = machine.start()
    if failure == "frozen":
        commands = machine.feed(Failed(read, "locked"))
    else:
        (get,) = machine.feed(Answered(read, None))
        commands = machine.feed(Answered(get, None if failure == "unhealthy" else OUTPUT.encode()))
        if failure == "freeze":
            (freeze,) = commands
            commands = machine.feed(Failed(freeze, "locked"))
    done = ready(commands)
    assert sent_messages(done.forward)[2]["content"][0]["content"] == NO_SUCH_TOOL
    assert done.report.rewrite is not None and done.report.rewrite.repaired == 0


def test_a_store_that_fails_a_read_it_never_fails_is_a_bug():
    machine = preparation(repair_body(REF))
    (read,) = machine.start()
    (get,) = machine.feed(Answered(read, None))
    with pytest.raises(StoreContractBroken):
        machine.feed(Failed(get, "boom"))


def test_a_warm_request_records_its_cache_and_reads_the_epochs():
    machine = preparation(body(tool_turns(4)), conversation=b"s1", index=Index({REF}))
    record, read = machine.start()
    key = cold.conversation_key("s1", "claude-opus-4-8")
    assert isinstance(record, RecordCache) and (record.key, record.until) == (key, NOW + 300)
    assert isinstance(read, ReadFrozen) and read.key == cold.epoch_key(key, 0)
    assert machine.feed(Answered(read, None)) == []  # the expiry is still out
    commands = machine.feed(Answered(record, NOW - 1))  # expired a second ago: within the margin
    assert [type(c) for c in commands] in ([Touch, PutOriginals], [PutOriginals])
    assert machine.state is State.STORING


def test_a_cold_request_freezes_an_epoch_before_it_forwards():
    machine = preparation(body(tool_turns(4)), conversation=b"s1", index=Index({REF}))
    record, read = machine.start()
    machine.feed(Answered(record, NOW - 3600))
    (freeze,) = machine.feed(Answered(read, None))
    key = cold.conversation_key("s1", "claude-opus-4-8")
    assert isinstance(freeze, Freeze) and freeze.key == cold.epoch_key(key, 0)
    commands = machine.feed(Answered(freeze, freeze.text))
    done = commands[-1] if isinstance(commands[-1], Ready) else None
    report = done.report if done else machine._report
    assert report.cold.cold == 1 and report.cold.epochs == 1 and report.cold.applied == 1


def test_epochs_applied_from_memory_are_touched():
    """A purge (or an LRU) must spare a live conversation's epochs, or a restart or another worker
    decides at first sight and sends other bytes: those this process applies without a read are
    touched, whether the store is asked about later ones or nothing, in the one Touch of frozen
    texts a request sends."""
    known, index = cold.Known(), Index({REF})
    key = cold.conversation_key("s1", "claude-opus-4-8")

    def run(messages: int, expired: float) -> tuple[list, list]:
        """A request prepared to Ready, the store's answers made up: what it asked, what it touched."""
        machine = preparation(body(tool_turns(messages)), conversation=b"s1", index=index, known=known)
        asked, touched, commands = [], [], machine.start()
        while not isinstance(commands[-1], Ready):
            command = commands.pop(0)
            if isinstance(command, Touch):
                touched += [command.frozen] if command.frozen else []
                continue
            asked.append(command)
            if isinstance(command, PutOriginals):
                index.held.update(command.originals)
                answer: object = set(command.originals)
            else:
                answer = {RecordCache: expired, ReadFrozen: None}.get(type(command), getattr(command, "text", None))
            commands += machine.feed(Answered(command, answer))
        touched += [c.frozen for c in commands if isinstance(c, Touch) and c.frozen]
        return asked, touched

    asked, touched = run(4, NOW - 3600)  # cold: epoch 0 frozen
    assert cold.epoch_key(key, 0) in [c.key for c in asked if isinstance(c, Freeze)] and touched == []
    asked, touched = run(5, NOW + 300)  # its expiry recorded, the epochs after the one known read
    assert [c.key for c in asked if isinstance(c, ReadFrozen)] == [cold.epoch_key(key, 1)]
    assert touched == [{cold.epoch_key(key, 0)}]
    asked, touched = run(5, NOW + 300)  # known warm now (a second read found the same)
    assert not any(isinstance(c, ReadFrozen | RecordCache) for c in asked)
    assert touched == [{cold.epoch_key(key, 0)}]


def test_epochs_the_store_cannot_read_leave_the_request_as_known():
    known = cold.Known()
    machine = preparation(body(tool_turns(4)), conversation=b"s1", index=Index({REF}), known=known)
    record, read = machine.start()
    machine.feed(Failed(read, "timeout"))
    commands = machine.feed(Answered(record, NOW - 3600))  # cold, but the epochs are unknown: none made
    assert not any(isinstance(c, Freeze) for c in commands)
    assert machine._report.cold.unknown == 1 and machine._report.cold.cold == 0


def test_an_answer_to_nothing_asked_or_after_ready_raises_and_changes_nothing():
    index = Index()
    machine = preparation(body(tool_turns(1)), index=index)
    (put,) = machine.start()
    with pytest.raises(Unexpected):
        machine.feed(Answered(ReadFrozen("tenant-a", "x"), None))
    with pytest.raises(Unexpected):  # an answer of the wrong kind for the state: the put stays out
        machine.feed(Failed(ReadOriginal("tenant-a", REF), "x"))
    index.held.add(REF)
    ready(machine.feed(Answered(put, {REF})))
    with pytest.raises(Unexpected):
        machine.feed(Answered(put, {REF}))


def test_the_docstring_table_names_the_transitions_the_code_runs():
    events = {"Answered", "Failed"}
    commands = {"ReadFrozen", "ReadOriginal", "Freeze", "RecordCache", "PutOriginals"}
    documented = set()
    for state, event, _ in table_rows(prepare.__doc__):
        if state not in State.__members__:
            continue
        said, command = names_in(event, events), names_in(event, commands)
        if not (said and command):
            continue  # a row of the machine's own steps, or READY's (it raises)
        (command,) = command
        documented |= {(State[state], getattr(prepare, e), getattr(prepare, command)) for e in said}
    assert documented == set(prepare.TRANSITIONS)


def test_a_conversation_at_its_epoch_bound_reads_no_more_and_is_still_compacted():
    """MAX_EPOCHS read already: no epoch read goes out, and the request is decided as usual (before
    this machine, such a request raised inside the Deferred chain and went as received)."""
    known = cold.Known()
    key = cold.conversation_key("s1", "claude-opus-4-8")
    known.set_epochs("tenant-a", key, [None] * cold.MAX_EPOCHS)
    machine = preparation(body(tool_turns(4)), conversation=b"s1", known=known)
    (record,) = machine.start()
    assert isinstance(record, RecordCache)
    (put,) = machine.feed(Answered(record, NOW - 3600))  # cold, but no room for another epoch
    assert isinstance(put, PutOriginals) and REF in put.originals
    assert machine._report.cold.cold == 0


def test_without_a_store_nothing_is_offloaded_and_no_store_command_goes_out():
    raw = repair_body(REF)
    machine = Preparation(Request(body(tool_turns(1)), b"/v1/messages", 7, "", b"", {}.get),
                          rewriter=Rewriter(rewrite_config()), known=cold.Known(), index=None, now=NOW)
    done = ready(machine.start())
    assert sent_messages(done.forward)[2]["content"][0]["content"] == OUTPUT
    repaired = ready(Preparation(Request(raw, b"/v1/messages", 8, "", b"", {}.get), rewriter=Rewriter(rewrite_config()),
                                 known=cold.Known(), index=None, now=NOW).start())
    assert sent_messages(repaired.forward)[2]["content"][0]["content"] == NO_SUCH_TOOL


# ---------------------------------------------------------------------------------------------
# Hidden turns (cg.stream.hidden)

THINKING = {"type": "thinking", "thinking": "Then.", "signature": "sig-later"}


def thinking_body() -> bytes:
    return body([{"role": "user", "content": "go"},
                 {"role": "assistant", "content": [{"type": "text", "text": "a"}, THINKING]},
                 {"role": "user", "content": "Fix it."}])


def test_a_thinking_block_is_asked_about_once_per_process_and_a_failed_read_leaves_it_as_sent():
    seen = Seen(shared=True)  # --workers, Redis: another process may have written the record
    raw = thinking_body()
    machine = preparation(raw, hidden=seen)
    (read,) = machine.start()
    assert isinstance(read, ReadFrozen) and (read.tenant, read.key) == ("tenant-a", record_key("sig-later"))
    assert sent_messages(ready(machine.feed(Failed(read, "the store cannot tell"))).forward) == json.loads(raw)["messages"]
    machine = preparation(raw, hidden=seen)  # a failure is not an answer: asked again
    (read,) = machine.start()
    assert sent_messages(ready(machine.feed(Answered(read, None))).forward) == json.loads(raw)["messages"]
    later = later_body()
    machine = preparation(later, hidden=seen)  # "none" for the latest reply was not kept: asked again
    (read,) = machine.start()
    assert sent_messages(ready(machine.feed(Answered(read, None))).forward) == json.loads(later)["messages"]
    assert isinstance(ready(preparation(later, hidden=seen).start()), Ready)  # an older one's is known: no read


def test_alone_on_its_store_a_process_asks_about_a_thinking_block_once():
    """No other process writes its store's records: a "none" is true for good, the latest reply's too
    (most turns with thinking had no expand splice: they must not wait on the store every turn)."""
    seen = Seen()
    machine = preparation(thinking_body(), hidden=seen)
    (read,) = machine.start()
    assert isinstance(ready(machine.feed(Answered(read, None))), Ready)
    assert isinstance(ready(preparation(later_body(), hidden=seen).start()), Ready)  # no read


def later_body() -> bytes:
    """`thinking_body`'s conversation a turn on: its thinking is no longer in the latest reply."""
    return body([*json.loads(thinking_body())["messages"], {"role": "assistant", "content": "Fixed."},
                 {"role": "user", "content": "Thanks."}])


def prepared(raw: bytes, seen: Seen, store: dict) -> list:
    """The messages a process with `seen` forwards, its reads answered from `store` (key -> record)."""
    machine = preparation(raw, hidden=seen)
    commands = [command for command in machine.start() if not isinstance(command, Touch)]
    while not (len(commands) == 1 and isinstance(commands[0], Ready)):
        (read,) = commands
        assert isinstance(read, ReadFrozen)
        commands = machine.feed(Answered(read, store.get(read.key)))
    return sent_messages(commands[0].forward)


def test_a_process_that_asks_before_another_processs_record_commits_asks_again_next_turn():
    """--workers: one process wrote the continuation's thinking and froze its record; another got
    the next turn before the freeze committed. Its next turn must carry the hidden turn too, as the
    writer's turns do, or the prefix differs by process and the thinking is invalid."""
    key, text = record(Shown(("text", "thinking"), (1,), (1, "sig-later")), [HiddenTurn(CALL, ANSWER)])
    writer, other, store = Seen(shared=True), Seen(shared=True), {}
    writer.put("tenant-a", key, text)
    assert prepared(thinking_body(), other, store) == json.loads(thinking_body())["messages"]  # too early
    store[key] = text  # the writer's freeze commits
    restored = [{"role": "assistant", "content": [{"type": "text", "text": "a"}, json.loads(CALL)]},
                json.loads(ANSWER), {"role": "assistant", "content": [THINKING]}]
    for raw in (thinking_body(), later_body()):
        assert prepared(raw, other, store)[1:4] == prepared(raw, writer, {})[1:4] == restored


CALL = '{"type":"tool_use","id":"toolu_x","name":"context_guru_expand","input":{"id":"0123456789abcdef"}}'
ANSWER = '{"role":"user","content":[{"type":"tool_result","tool_use_id":"toolu_x","content":"LOG"}]}'


def test_a_record_this_process_kept_puts_the_turn_back_without_a_read():
    seen = Seen()
    shown = Shown(("text", "thinking"), (1,), (1, "sig-later"))
    call, answer = CALL, ANSWER
    key, text = record(shown, [HiddenTurn(call, answer)])
    seen.put("tenant-a", key, text)
    touch, done = preparation(thinking_body(), hidden=seen).start()
    # Touched, so that `cg-store purge --older-than` spares a record its conversation still uses.
    assert isinstance(touch, Touch) and (touch.tenant, touch.ids, touch.frozen) == ("tenant-a", frozenset(), {key})
    messages = sent_messages(ready([done]).forward)
    assert messages[1:4] == [{"role": "assistant", "content": [{"type": "text", "text": "a"}, json.loads(call)]},
                             json.loads(answer), {"role": "assistant", "content": [THINKING]}]
