"""The cache-aware policy (--cold-policy) through cg: cold requests found on a controllable clock,
epochs kept in the store and replayed byte for byte by the next turns, across a restart (SQLite)
and by a second cg sharing one Redis; an expand round keeps the cache alive; a store that cannot
read the epochs leaves the request to first-sight decisions.

Claude Code-shaped requests (a conversation growing by one Bash turn each, logs too small to offload
at first sight) through cg to the fake provider; cg's wall clock is a FakeClock (no sleeping).
"""

import re

import attrs
import pytest
from helpers.bodies import bash_turns, conversation, log, messages_bytes
from helpers.drive import send, until
from helpers.stores import FakeClock
from pytest_twisted import inlineCallbacks
from rawhttp import connect, http_request, split_response
from twisted.internet import defer
from twisted.internet.task import Clock

from cg.compaction.cold import TTL_1H, TTL_5M, ColdPolicy
from cg.store import StoreError
from cg.testing import JSONReply, anthropic_message, claude_code_bytes, default_reply
from cg.wire.markers import marker_id

MARKER = re.compile(rb"<<cg:([0-9a-f]{16})>>")
# --cold-policy with a lower threshold for older results: these logs are below first sight's, so an
# epoch offloads them (the default's epochs offload superseded file views only).
POLICY = ColdPolicy(offload_min_tokens=1000)
RECENT = POLICY.recent_turns
SESSION = [("x-claude-code-session-id", "9f0c6a1e-3b7d-4c2a-8e55-0d1f2a3b4c5d")]
TURNS = bash_turns(RECENT + 6)
COLD_GAP = TTL_5M + POLICY.margin + 1


def body(k: int, **changes) -> dict:
    """The conversation after `k` tool turns."""
    return {**conversation(TURNS[:k]), **changes}


def markers(received) -> set[str]:
    return {m.decode() for m in MARKER.findall(received.body)}


def older_than_recent(k: int) -> set[str]:
    """The logs an epoch made at turn `k` covers: all but the last RECENT turns'."""
    return {marker_id(log(i).encode()) for i in range(k - RECENT)}


@pytest.fixture
def clock():
    return FakeClock(1_800_000_000.0)


@pytest.fixture
def cold_cg(make_cg, fake, clock):
    """``cold_cg(**overrides)``: a cg with --cold-policy on, whose wall clock is the test's."""

    def make(**overrides):
        running = make_cg(anthropic_upstream=fake.url, expand=True, cold_policy=True, **overrides)
        running.service.forwarder.now = clock
        rewriter = running.service.forwarder.rewriter
        rewriter.config = attrs.evolve(rewriter.config, cold=POLICY)
        return running

    return make


def turn(running, k: int, headers=(), **changes):
    return send(running, body(k, **changes), [*SESSION, *headers])


@inlineCallbacks
def test_a_request_after_the_cache_expired_re_decides_the_older_history(cold_cg, fake, clock):
    running = cold_cg()
    k = RECENT + 1
    yield turn(running, k)
    clock.advance(TTL_5M + POLICY.margin - 1)  # just within the lifetime and the margin: warm
    yield turn(running, k + 1)
    assert [markers(r) for r in fake.received] == [set(), set()]

    clock.advance(COLD_GAP)
    yield turn(running, k + 2)
    assert markers(fake.received[2]) == older_than_recent(k + 2) != set()
    clock.advance(5)
    yield turn(running, k + 3)  # warm again: the epoch's decisions, replayed (read again: a new epoch)
    assert markers(fake.received[3]) == older_than_recent(k + 2)
    count = len(body(k + 2)["messages"])
    assert messages_bytes(fake.received[3].body, count - 1) == messages_bytes(fake.received[2].body, count - 1)
    stats = running.stats.snapshot()["compaction"]["cold"]
    assert stats == {"checked": 4, "cold": 1, "epochs": 1, "applied": 2, "unknown": 0, "known_warm": 0}


@inlineCallbacks
def test_a_conversation_that_asks_for_the_1_hour_cache_is_cold_after_an_hour(cold_cg, fake, clock):
    running = cold_cg()
    system = conversation([])["system"]
    system[-1]["cache_control"] = {"type": "ephemeral", "ttl": "1h"}
    k = RECENT + 1
    yield turn(running, k, system=system)
    clock.advance(COLD_GAP)  # past 5 minutes, within the hour
    yield turn(running, k + 1, system=system)
    assert markers(fake.received[1]) == set()
    clock.advance(TTL_1H + POLICY.margin + 1)
    yield turn(running, k + 2, system=system)
    assert markers(fake.received[2]) == older_than_recent(k + 2)


@inlineCallbacks
def test_without_a_conversation_id_or_the_option_decisions_are_first_sight(cold_cg, make_cg, fake, clock):
    running = cold_cg()
    plain = make_cg(anthropic_upstream=fake.url, expand=True, cold_policy=False)
    plain.service.forwarder.now = clock
    k = RECENT + 1
    for target, headers in ((running, ()), (plain, SESSION)):
        yield send(target, body(k), headers)
        clock.advance(COLD_GAP)
        yield send(target, body(k + 1), headers)
    assert [markers(r) for r in fake.received] == [set()] * 4
    assert running.stats.compaction.cold.checked == 0


@inlineCallbacks
def test_an_expand_round_keeps_the_cache_alive(cold_cg, fake, clock):
    running = cold_cg()

    def the_model_takes_its_time(received):
        if len(fake.received) == 1:
            clock.advance(TTL_5M - 100)  # the continuation goes out this much later
        return default_reply(received)

    fake.default_reply = the_model_takes_its_time
    k = RECENT + 1
    yield turn(running, k, [("x-fake-expand", "0123456789abcdef")])
    assert len(fake.received) == 2  # the round, and cg's continuation
    clock.advance(COLD_GAP - (TTL_5M - 100))  # cold from the first round, warm from the continuation
    yield turn(running, k + 1)
    assert markers(fake.received[2]) == set()
    assert running.stats.compaction.cold.cold == 0


@inlineCallbacks
def test_two_cg_sharing_one_redis_send_the_same_bytes_for_a_cold_turn(cold_cg, fake, clock, redis_server):
    one, two = cold_cg(store=redis_server.url), cold_cg(store=redis_server.url)
    k = RECENT + 1
    yield turn(one, k)
    clock.advance(10)
    yield turn(two, k + 1)  # warm: the record one wrote
    clock.advance(COLD_GAP)
    yield turn(one, k + 2)  # cold, through the first
    assert markers(fake.received[2]) == older_than_recent(k + 2)
    clock.advance(10)
    yield turn(two, k + 2)  # a retry of it through the second: the very same bytes
    yield turn(two, k + 3)  # the next turn through the second
    assert fake.received[3].body == fake.received[2].body
    count = len(body(k + 2)["messages"])
    assert messages_bytes(fake.received[4].body, count - 1) == messages_bytes(fake.received[2].body, count - 1)
    assert (one.stats.compaction.cold.epochs, two.stats.compaction.cold.epochs) == (1, 0)
    assert (one.stats.compaction.cold.cold, two.stats.compaction.cold.cold) == (1, 0)
    assert two.stats.compaction.cold.applied == 2


@inlineCallbacks
def test_epochs_and_cache_records_outlive_a_restart(cold_cg, fake, clock, tmp_path):
    store = f"sqlite:{tmp_path / 'store.sqlite3'}"
    first = cold_cg(store=store)
    k = RECENT + 1
    yield turn(first, k)
    clock.advance(COLD_GAP)
    yield turn(first, k + 1)
    assert markers(fake.received[1]) == older_than_recent(k + 1)
    yield first.stop()

    second = cold_cg(store=store)
    clock.advance(10)
    yield turn(second, k + 2)  # warm by the record the first wrote; decided by the epoch it froze
    assert markers(fake.received[2]) == older_than_recent(k + 1)
    count = len(body(k + 1)["messages"])
    assert messages_bytes(fake.received[2].body, count - 1) == messages_bytes(fake.received[1].body, count - 1)
    assert second.stats.compaction.cold.cold == 0 and second.stats.compaction.cold.applied == 1


@inlineCallbacks
def test_epochs_the_store_cannot_read_leave_what_is_known(cold_cg, fake, clock, tmp_path, monkeypatch):
    store = f"sqlite:{tmp_path / 'store.sqlite3'}"
    first, second = cold_cg(store=store), cold_cg(store=store)
    k = RECENT + 1
    yield turn(first, k)
    clock.advance(COLD_GAP)
    yield turn(first, k + 1)
    epoch_markers = older_than_recent(k + 1)
    assert markers(fake.received[1]) == epoch_markers

    for running in (first, second):
        monkeypatch.setattr(running.service.forwarder.store, "frozen",
                            lambda tenant, key: defer.fail(StoreError("the store is down")))
    clock.advance(POLICY.margin)  # far enough that the first asks the store again (cold.Known)
    yield turn(first, k + 2)  # it read the epoch before: it still applies it
    assert markers(fake.received[2]) == epoch_markers
    yield turn(second, k + 2)  # it never read it: first sight, the results whole (one cache write, no loss)
    assert markers(fake.received[3]) == set()
    assert (first.stats.compaction.cold.unknown, second.stats.compaction.cold.unknown) == (1, 1)
    assert second.stats.compaction.cold.applied == 0


@inlineCallbacks
def test_count_tokens_sizes_what_cg_sends_and_records_nothing(cold_cg, fake, clock):
    running = cold_cg()
    k = RECENT + 1
    yield turn(running, k)
    clock.advance(COLD_GAP)
    yield turn(running, k + 1)  # cold: an epoch
    clock.advance(COLD_GAP)  # cold again, but a count makes no epoch and records no use
    headers = [("content-type", "application/json"), ("anthropic-version", "2023-06-01"), *SESSION]
    count = {key: value for key, value in body(k + 2).items() if key in ("model", "messages", "tools")}
    client = yield connect(running.port, http_request("POST", "/v1/messages/count_tokens?beta=true",
                                                      claude_code_bytes(count), headers))
    assert split_response((yield client.closed))[0] == 200
    assert markers(fake.received[2]) == older_than_recent(k + 1)  # sized under the epoch
    yield turn(running, k + 2)  # still cold: the count did not touch the cache
    assert markers(fake.received[3]) == older_than_recent(k + 2)
    stats = running.stats.compaction.cold
    assert (stats.cold, stats.epochs, stats.applied) == (2, 2, 3)


@inlineCallbacks
def test_a_keepalive_ping_keeps_the_cache_alive(cold_cg, fake, clock):
    """--keepalive's pings refresh the prompt cache: a request after a gap the pings bridged is warm,
    not cold (an epoch then would change the history's bytes, a full cache write the pings paid to avoid)."""
    running = cold_cg(keepalive=True)
    pings = running.service.keepalive.clock = Clock()
    k = RECENT + 1
    yield turn(running, k)
    fake.enqueue(JSONReply(anthropic_message("", usage={"input_tokens": 3, "cache_read_input_tokens": 2100,
                                                        "cache_creation_input_tokens": 0, "output_tokens": 1})))
    clock.advance(TTL_5M - 30.0)
    pings.advance(TTL_5M - 30.0)
    yield until(lambda: running.stats.keepalive.usage.cache_read_tokens > 0)
    clock.advance(COLD_GAP - (TTL_5M - 30.0))  # cold from the request, warm from the ping
    yield turn(running, k + 1)
    assert len(fake.received) == 3
    assert markers(fake.received[2]) == set()
    assert running.stats.compaction.cold.cold == 0


@inlineCallbacks
def test_a_conversation_at_a_busy_pace_asks_the_store_once_per_half_margin(cold_cg, fake, clock, monkeypatch):
    running = cold_cg()
    store = running.service.forwarder.store
    asked: list[str] = []
    for name in ("cache_until", "frozen"):
        real = getattr(store, name)
        monkeypatch.setattr(store, name, lambda *args, real=real, name=name: asked.append(name) or real(*args))
    k = RECENT + 1
    for step in range(4):  # every 10 s: the first two ask (the second settles the epochs), then known warm
        yield turn(running, k + step)
        clock.advance(10)
    assert asked.count("cache_until") == 2 and asked.count("frozen") == 2
    assert running.stats.compaction.cold.known_warm == 2
    # What it skipped is what the store would have answered: the same bytes on each turn.
    assert all(markers(r) == set() for r in fake.received)
    clock.advance(COLD_GAP)
    yield turn(running, k + 4)  # cold: the store is asked, and an epoch made
    assert markers(fake.received[-1]) == older_than_recent(k + 4)
