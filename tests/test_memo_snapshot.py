"""The memo's decisions outlive a restart: written at a graceful stop, read at the next start."""

import copy
import json
import os
import stat

import attrs
import pytest
from fixturedata import claude_code_body
from pytest_twisted import inlineCallbacks
from rawhttp import connect, http_request, split_response
from twisted.internet import reactor, task
from twisted.python import usage

from cg.compaction import snapshot
from cg.compaction.components import TextClean
from cg.compaction.pipeline import CompactConfig, Memo, Older
from cg.compaction.rewrite import RewriteConfig, Rewriter
from cg.testing import claude_code_bytes, command_output
from cg.web import memofile
from cg.web.tap import Options

URI = b"/v1/messages?beta=true"


def conversation(turns: int) -> list[bytes]:
    """One Claude Code history growing by a Bash result per turn: big test logs, ANSI, JSON, a repeat."""
    body = copy.deepcopy(claude_code_body("p_second_request_tool_result"))
    outputs = [command_output(), "\x1b[32mok\x1b[0m\rdone\n" * 40, json.dumps({"a": list(range(300))}, indent=2),
               command_output(), command_output(700).replace("PASS", "RUNS")]
    bodies = []
    for turn in range(turns):
        call = f"toolu_{turn}"
        body["messages"] += [
            {"role": "assistant", "content": [{"type": "tool_use", "id": call, "name": "Bash", "input": {"c": turn}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call,
                                          "content": outputs[turn % len(outputs)]}]},
        ]
        bodies.append(claude_code_bytes(body))
    return bodies


def rewrite_all(memo: Memo, bodies: list[bytes], older: Older | None = None) -> list[bytes]:
    rewriter = Rewriter(RewriteConfig(), memo)
    return [rewriter.finish(rewriter.parse(raw, URI, "s"), older=older).body for raw in bodies]


def stronger(cutoff: int) -> Older:
    config = attrs.evolve(RewriteConfig().compact, offload_min_tokens=300)
    superseded = frozenset({(5, 0), (13, 0)})  # decided as file views
    return Older(cutoff, config, attrs.evolve(config, keep_tools=frozenset()), superseded)


def test_restored_decisions_forward_the_same_bytes_and_decide_nothing_again():
    bodies = conversation(6)
    made = Memo()
    first = rewrite_all(made, bodies) + rewrite_all(made, bodies, stronger(9))
    assert len({config for (_, _, config, _, _) in dict(made.decisions.items())}) == 3

    restored = Memo()
    assert snapshot.restore(restored, snapshot.dump(made.decisions.items(), "code"), "code") == len(made.decisions)
    assert restored.decisions.items() == made.decisions.items()  # recency kept
    again = rewrite_all(restored, bodies) + rewrite_all(restored, bodies, stronger(9))
    assert again == first
    assert restored.decisions.misses == 0, "every decision came from the snapshot"
    assert rewrite_all(Memo(), bodies) == first[:6], "a fresh memo decides the same"


def test_a_snapshot_of_other_code_or_format_is_ignored_whole():
    made = Memo()
    rewrite_all(made, conversation(2))
    data = snapshot.dump(made.decisions.items(), "code")
    assert snapshot.restore(Memo(), data, "other code") == 0
    other_format = json.loads(data)
    other_format["format"] += 1
    assert snapshot.restore(Memo(), json.dumps(other_format).encode(), "code") == 0


def test_a_tool_name_utf8_cannot_carry_is_written_and_read_back():
    body = json.loads(conversation(1)[0])
    body["messages"][-2]["content"][0]["name"] = "B\ud800"  # a JSON escape the client may send
    made = Memo()
    rewrite_all(made, [json.dumps(body).encode()])
    assert "B\ud800" in {tool for (_, tool, _, _, _) in dict(made.decisions.items())}
    restored = Memo()
    snapshot.restore(restored, snapshot.dump(made.decisions.items(), "code"), "code")
    assert restored.decisions.items() == made.decisions.items()


def _one_row(**changes) -> bytes:
    made = Memo()
    rewrite_all(made, conversation(1))
    doc = json.loads(snapshot.dump(made.decisions.items(), "code"))
    for where, value in changes.items():
        if where.startswith("config_"):
            doc["configs"][0][where.removeprefix("config_")] = value
        else:
            doc["decisions"][-1][int(where.removeprefix("row_"))] = value
    return json.dumps(doc, separators=(",", ":")).replace('"INF"', "1e999").encode()


@pytest.mark.parametrize("data", [b"", b"{", b"[]", b'{"format": 1, "code": "code"}', b'{"code":"code","format":1}'])
def test_what_does_not_start_as_a_snapshot_of_this_code_is_not_read(data):
    memo = Memo()
    assert snapshot.restore(memo, data, "code") == 0 and len(memo.decisions) == 0


@pytest.mark.parametrize("data", [
    b'{"format":1,"code":"code",', b'{"format":1,"code":"code","configs":[]}',
    b'{"format":1,"code":"code","configs":[],"decisions":[[1]]}', b'{"format":1,"code":"code","configs":[],"decisions":[]',
    _one_row(row_0="xyz"), _one_row(row_1=["Bash"]), _one_row(row_2=-1), _one_row(row_2=7), _one_row(row_3=1),
    _one_row(row_5=3), _one_row(row_6=[["offload", True, "INF", 2]]), _one_row(row_7="textclean"),
    _one_row(row_8=None), _one_row(config_keep_tools="Read"), _one_row(config_offload_min_tokens="2000"),
    _one_row(config_components=[1]),
])
def test_what_is_not_a_snapshot_is_a_value_error_and_puts_nothing(data):
    memo = Memo()
    with pytest.raises(ValueError):
        snapshot.restore(memo, data, "code")
    assert len(memo.decisions) == 0


def test_a_file_that_is_not_a_snapshot_is_skipped_and_the_others_read(tmp_path):
    made = Memo()
    rewrite_all(made, conversation(2))
    (tmp_path / "worker-0.json").write_bytes(_one_row(row_1={"a": 1}))
    (tmp_path / "worker-1.json").write_bytes(snapshot.dump(made.decisions.items(), "code"))
    memo = Memo()
    assert memofile.load(memo, str(tmp_path), "code") == len(made.decisions) == len(memo.decisions)


def test_decisions_of_a_component_cg_does_not_run_by_name_are_not_written():
    class Shout(TextClean):
        name = "shout"

    made = Memo()
    rewriter = Rewriter(attrs.evolve(RewriteConfig(), compact=CompactConfig(components=(Shout(),))), made)
    rewriter.finish(rewriter.parse(conversation(1)[0], URI, "s"))
    shouted = len(made.decisions)
    rewrite_all(made, conversation(1))
    restored = Memo()
    assert snapshot.restore(restored, snapshot.dump(made.decisions.items(), "code"), "code") == len(made.decisions) - shouted > 0


def test_the_memo_budget_bounds_what_is_restored():
    made = Memo()
    rewrite_all(made, conversation(6))
    small = Memo(max_chars=3 * 512)
    snapshot.restore(small, snapshot.dump(made.decisions.items(), "code"), "code")
    assert len(small.decisions) < len(made.decisions)
    assert small.decisions.items() == made.decisions.items()[-len(small.decisions):], "the most recent stay"


def test_the_directory_is_beside_the_store_unless_given(tmp_path, monkeypatch):
    monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path / "state"))
    assert memofile.memo_dir(None, "sqlite:/var/lib/cg/store.sqlite3") == "/var/lib/cg/store.memo"
    assert memofile.memo_dir(None, None) == str(tmp_path / "state" / "store.memo")
    assert memofile.memo_dir(None, "redis://127.0.0.1:6379/0") == str(tmp_path / "state" / "memo")
    assert memofile.memo_dir(None, "memory:") is None
    assert memofile.memo_dir("none", "sqlite:/x.sqlite3") is None
    assert memofile.memo_dir("~/m", "memory:") == os.path.expanduser("~/m")


def post(port, raw: bytes):
    return connect(port, http_request("POST", "/v1/messages?beta=true", raw,
                                      [("content-type", "application/json"), ("anthropic-version", "2023-06-01")]))


@inlineCallbacks
def test_a_restarted_cg_starts_with_the_decisions_it_made(make_cg, fake, tmp_path):
    store = f"sqlite:{tmp_path / 'store.sqlite3'}"
    bodies = conversation(3)
    cg = make_cg(anthropic_upstream=fake.url, store=store)
    client = yield post(cg.port, bodies[-1])
    assert split_response((yield client.closed))[0] == 200
    decided = len(cg.service.memo.decisions)
    assert decided >= 3
    yield cg.stop()

    assert cg.service.memo_file.code == memofile.code_fingerprint(), "the code as it started, not as at the stop"
    written = tmp_path / "store.memo" / "cg.json"
    assert stat.S_IMODE(written.stat().st_mode) == 0o600, "it holds parts of tool results"
    assert [p.name for p in written.parent.iterdir()] == ["cg.json"], "no partial file left"

    restarted = make_cg(anthropic_upstream=fake.url, store=store)
    assert len(restarted.service.memo.decisions) == decided
    client = yield post(restarted.port, bodies[-1])
    assert split_response((yield client.closed))[0] == 200
    assert fake.received[1].body == fake.received[0].body
    assert restarted.service.memo.decisions.misses == 0


@inlineCallbacks
def test_an_unreadable_snapshot_is_ignored_and_replaced(make_cg, fake, tmp_path):
    memo_dir = tmp_path / "memo"
    memo_dir.mkdir()
    (memo_dir / "cg.json").write_bytes(b"{ not json")
    cg = make_cg(anthropic_upstream=fake.url, store=f"sqlite:{tmp_path / 'store.sqlite3'}", memo_dir=str(memo_dir))
    assert len(cg.service.memo.decisions) == 0
    client = yield post(cg.port, conversation(1)[0])
    assert split_response((yield client.closed))[0] == 200
    yield cg.stop()
    assert snapshot.restore(Memo(), (memo_dir / "cg.json").read_bytes(), cg.service.memo_file.code) > 0


@inlineCallbacks
def test_memo_dir_none_writes_nothing(make_cg, fake, tmp_path):
    cg = make_cg(anthropic_upstream=fake.url, store=f"sqlite:{tmp_path / 'store.sqlite3'}", memo_dir="none")
    assert cg.service.memo_file is None
    client = yield post(cg.port, conversation(1)[0])
    yield client.closed
    yield cg.stop()
    assert not (tmp_path / "store.memo").exists() and not (tmp_path / "none").exists()


@inlineCallbacks
def test_the_file_names_the_code_it_is_given(tmp_path):
    made = Memo()
    rewrite_all(made, conversation(1))
    (tmp_path / ".cg.json.99999").write_bytes(b"the part a killed process wrote")
    (tmp_path / ".worker-1.json.99999").write_bytes(b"another's")
    yield memofile.MemoFile(made, str(tmp_path), "cg.json", "code at start").stop()
    assert json.loads((tmp_path / "cg.json").read_bytes())["code"] == "code at start"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".worker-1.json.99999", "cg.json"]
    assert memofile.load(Memo(), str(tmp_path), memofile.code_fingerprint()) == 0


def _until(predicate):
    """Wait (the reactor running) for what the writes' thread does."""
    for _ in range(500):
        if predicate():
            return
        yield task.deferLater(reactor, 0.01, lambda: None)
    raise AssertionError("never happened")


@inlineCallbacks
def test_checkpoints_write_while_the_memo_makes_new_decisions(tmp_path):
    memo, clock = Memo(), task.Clock()
    bodies = conversation(3)
    rewrite_all(memo, bodies[:1])
    written = tmp_path / "cg.json"
    file = memofile.MemoFile(memo, str(tmp_path), "cg.json", "code", reactor, interval=600, clock=clock)
    file.start()
    clock.advance(600)  # nothing new since it started: nothing written
    assert not written.exists()

    rewrite_all(memo, bodies)
    clock.advance(599)
    assert not written.exists()
    clock.advance(1)
    yield from _until(written.exists)
    assert snapshot.restore(Memo(), written.read_bytes(), "code") == len(memo.decisions)
    written.unlink()
    clock.advance(600)  # nothing new again
    yield file.stop()  # and the last write, whatever changed
    assert snapshot.restore(Memo(), written.read_bytes(), "code") == len(memo.decisions)
    assert not file._checkpoints.running


def test_a_snapshot_is_encoded_in_chunks_and_reads_as_one():
    made = Memo()
    rewrite_all(made, conversation(6))
    items = made.decisions.items() * 300  # more rows than a chunk: the same decisions again
    assert len(items) > 2 * snapshot._CHUNK
    restored = Memo()
    assert snapshot.restore(restored, snapshot.dump(items, "code"), "code") == len(items)
    assert restored.decisions.items() == made.decisions.items()
    assert snapshot.restore(Memo(), snapshot.dump([], "code"), "code") == 0


@inlineCallbacks
def test_a_stop_goes_on_when_the_memo_cannot_be_written(make_cg, fake, tmp_path, logged):
    blocker = tmp_path / "file"
    blocker.write_text("where the directory would be")
    cg = make_cg(anthropic_upstream=fake.url, store=f"sqlite:{tmp_path / 'store.sqlite3'}", memo_dir=str(blocker))
    client = yield post(cg.port, conversation(1)[0])
    yield client.closed
    errors = logged("cg.web.memofile")
    yield cg.stop()  # fires, and without an error: what fails to be written is logged
    assert len(errors) == 1 and "cannot write cg.json" in errors.texts()[0]


@pytest.mark.parametrize("value", ["", "FILE"])
def test_a_memo_dir_that_cannot_be_one_is_refused_at_start(value, tmp_path):
    (tmp_path / "FILE").write_text("a file")
    option = str(tmp_path / value) if value else value
    with pytest.raises(usage.UsageError, match="--memo-dir .*not a directory"):
        Options().parseOptions(["--memo-dir", option])
    Options().parseOptions(["--memo-dir", str(tmp_path / "new")])  # made at the first write
