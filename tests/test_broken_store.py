"""A store that breaks while cg runs: no marker cg cannot answer, said once, healed without a restart.

A real SQLite file, damaged from outside while cg runs; Claude Code-shaped requests through cg to
the strict fake upstream.
"""

import os
import time

import pytest
from helpers.bodies import history, two_bash_body
from helpers.drive import markers, read_original, send
from helpers.stores import GARBAGE, damage
from pytest_twisted import inlineCallbacks
from twisted.logger import LogLevel

import cg.store.sqlite
from cg.testing import command_output, default_reply
from cg.wire.markers import marker_id


@pytest.fixture
def store_path(tmp_path):
    return str(tmp_path / "state" / "store.sqlite3")


@pytest.fixture
def running(make_cg, fake, store_path, monkeypatch):
    monkeypatch.setattr(cg.store.sqlite, "REOPEN_AFTER", 0.0)  # a broken store tries its file again at once
    fake.strict = True
    return make_cg(anthropic_upstream=fake.url, expand=True, store=f"sqlite:{store_path}")


@inlineCallbacks
def test_an_expand_is_answered_from_the_request_when_the_store_broke_meanwhile(running, fake, store_path):
    bash = command_output()
    ident = marker_id(bash.encode())

    def store_breaks_while_the_model_answers(received):
        if len(fake.received) == 1:
            damage(store_path, "garbage")
        return default_reply(received)

    fake.default_reply = store_breaks_while_the_model_answers
    yield send(running, history(bash, "x"), [("x-fake-expand", ident)])

    first, continuation = fake.received
    assert markers(first) == [ident]  # stored and read back before it went
    result = continuation.json()["messages"][-1]["content"][0]
    assert result["content"] == bash  # from the request: the store could not have said it
    assert running.stats.expand.resolved == 1 and running.stats.store.reads == 0
    assert fake.rejections == []


@inlineCallbacks
def test_markers_sent_before_go_whole_once_the_store_breaks(make_cg, fake, store_path):
    # Not `running`: the store must not get its file back in time for the next request.
    running = make_cg(anthropic_upstream=fake.url, expand=True, store=f"sqlite:{store_path}")
    old, new = command_output(), command_output().replace("PASS", "OK")
    yield send(running, history(old, "x"))
    assert markers(fake.received[0]) == [marker_id(old.encode())]

    damage(store_path, "drop")  # the original of the marker sent above is gone
    yield send(running, two_bash_body(old, "\x1b[1m" + new))
    sent = fake.received[1]
    # The new original could not be stored, and the store, broken, vouches for the old one no more:
    # both go whole, at the cost of the provider's cache (once), and reformat still runs.
    assert markers(sent) == []
    assert sent.json()["messages"][-1]["content"][0]["content"] == new
    assert running.stats.compaction.store_fail_open == 1
    assert running.stats.snapshot()["store"]["healthy"] is False


@inlineCallbacks
def test_a_broken_store_says_so_once_and_recovers_without_a_restart(running, fake, store_path, store_log):
    bash = command_output()
    output = "\x1b[1m" + bash  # reformat takes the escape out, with or without a store
    ident = marker_id(output.encode())
    body = history(output, "x")
    yield send(running, body)
    before = fake.received[0].body
    assert markers(fake.received[0]) == [ident]

    damaged = time.time()
    damage(store_path, "garbage")
    assert (yield read_original(running, ident))[0] == 404  # a person reads it: the read fails
    store = running.stats.snapshot()["store"]
    assert store["healthy"] is False and "not a database" in store["unhealthy_reason"]
    assert damaged <= store["unhealthy_since"] <= time.time()

    for _ in range(3):  # the file cannot be opened again: no markers, reformat only
        yield send(running, body)
    for sent in fake.received[1:]:
        assert markers(sent) == []
        assert sent.json()["messages"][3]["content"][0]["content"] == bash
    errors = store_log.texts(LogLevel.error)
    assert len([text for text in errors if "unhealthy" in text]) == 1  # once, not per request
    assert len(errors) == 2  # and the reopen's error, once
    assert open(store_path, "rb").read() == GARBAGE  # cg never overwrites a file it cannot read

    os.replace(store_path, store_path + ".broken")  # someone moves it aside
    yield send(running, body)
    assert fake.received[-1].body == before  # the same bytes as before the store broke
    store = running.stats.snapshot()["store"]
    assert (store["healthy"], store["unhealthy_reason"], store["unhealthy_since"]) == (True, None, None)
    assert store_log.texts(LogLevel.info) == [
        f"cg store {store_path} is healthy again"
    ]
    assert (yield read_original(running, ident)) == (200, output.encode())


@pytest.mark.parametrize("how", ["drop", "removed"])
@inlineCallbacks
def test_a_dropped_table_or_removed_file_is_made_again(running, fake, store_path, how):
    bash = command_output()
    ident = marker_id(bash.encode())
    body = history(bash, "x")
    yield send(running, body)
    damage(store_path, how)
    assert (yield read_original(running, ident))[0] == 404
    assert running.stats.store.healthy is False

    yield send(running, body)
    assert fake.received[1].body == fake.received[0].body  # the next request stored its originals again
    assert running.stats.store.healthy is True
    assert (yield read_original(running, ident)) == (200, bash.encode())


@inlineCallbacks
def test_a_store_file_removed_under_a_put_gets_every_original_again(running, fake, store_path):
    old, new = command_output(), command_output().replace("PASS", "OK")
    yield send(running, history(old, "x"))
    damage(store_path, "removed")  # the put below finds a new file: the old original is not in it
    yield send(running, two_bash_body(old, new))
    assert markers(fake.received[1]) == [marker_id(old.encode()), marker_id(new.encode())]
    for output in (old, new):
        assert (yield read_original(running, marker_id(output.encode()))) == (200, output.encode())
    assert running.stats.store.healthy is True
