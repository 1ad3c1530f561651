"""The ledger's contract (cg.store.base.ILedger): the in-memory reference (cg.store.ledger), the SQLite
store's (a file in tmp_path) and the Redis store's (a real redis-server) answer alike."""

import concurrent.futures
import errno
import os
import sqlite3
import threading
from types import SimpleNamespace

import pytest
import pytest_twisted
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock
from twisted.logger import LogLevel
from zope.interface.verify import verifyObject

import cg.store.threaded
from cg.exchange.ledger import (
    DEFAULT_MAX_TURNS,
    HOUR,
    MINUTE,
    ORDERS,
    PING,
    REQUEST,
    Change,
    Totals,
    Turn,
    order_key,
)
from cg.store import RedisStore, SQLiteStore, StoreError
from cg.store.base import ILedger, as_store_error
from cg.store.ledger import MemoryLedger
from cg.store.sqlite import SQLiteDB
from cg.store.sqlite_ledger import find_conversation, ledger_path
from cg.store.threaded import LEDGER_BATCH_DELAY, LEDGER_RETRY_MAX, ThreadedLedger
from cg.stream.usage import Usage
from cg.web.config import Config
from cg.web.service import LEDGER_TRIM_EVERY, CGService
from cg.web.tap import Options

T0 = 1_699_999_200.0  # a whole hour (UTC)


def turn(at: float, conversation="c1", tenant="", client="claude-code", model="m", seq=0, **over) -> Turn:
    fields = dict(time=at, seq=seq, tenant=tenant, conversation=conversation, client=client, model=model,
                  dialect="anthropic", path="/v1/messages", status=200, outcome="ok", tokens_before=1000,
                  tokens_after=400, results_before=800, results_after=200,
                  billed=Usage(input_tokens=10, cache_read_tokens=300, cache_write_tokens=90, output_tokens=50),
                  cost_via_cg=0.01, cost_direct=0.02)
    fields.update(over)
    return Turn(**fields)


@pytest.fixture(params=["memory", "sqlite", "redis"])
def make_ledger(request, tmp_path, closing):
    """Every store's ledger keeps MemoryLedger's contract."""
    server = request.getfixturevalue("redis_server") if request.param == "redis" else None

    def make(**kwargs):
        if request.param == "memory":
            return MemoryLedger(**kwargs)
        options = {f"ledger_{name}": value for name, value in kwargs.items()}
        if request.param == "redis":
            store = RedisStore(server.url, **options)
        else:
            store = SQLiteStore(str(tmp_path / "store.sqlite3"), **options)
        closing(store)
        return store.ledger

    return make


@pytest_twisted.ensureDeferred
async def test_turns_sum_into_totals_buckets_and_their_conversation(make_ledger):
    ledger = make_ledger()
    ledger.record(turn(T0 + 5, seq=1), [Change(1, 2, 0, "Bash", "offload", True, "0123456789abcdef", 800, 200)])
    ledger.record(turn(T0 + 70, seq=2), [])
    totals = (await ledger.totals(None, None))
    assert totals.requests == 2 and totals.tokens_before == 2000 and totals.billed.cache_read_tokens == 600
    assert totals.cost_via_cg == pytest.approx(0.02) and totals.cost_direct == pytest.approx(0.04)
    minutes = (await ledger.buckets(None, T0, MINUTE))
    assert [(b.start, b.totals.requests) for b in minutes] == [(T0, 1), (T0 + 60, 1)]
    assert [b.totals.requests for b in (await ledger.buckets(None, T0, HOUR))] == [2]
    (summary,) = (await ledger.conversations(None, 0, 10))[0]
    assert (summary.id, summary.first, summary.last, summary.totals.requests) == ("c1", T0 + 5, T0 + 70, 2)
    found, turns, changes = (await ledger.conversation(None, "c1"))
    assert [t.seq for t in turns] == [1, 2] and [c.marker for c in changes] == ["0123456789abcdef"]


@pytest_twisted.ensureDeferred
async def test_a_window_counts_only_its_minutes(make_ledger):
    ledger = make_ledger()
    ledger.record(turn(T0), [])
    ledger.record(turn(T0 + 600), [])
    assert (await ledger.totals(None, T0 + 300)).requests == 1
    assert (await ledger.totals(None, None)).requests == 2


@pytest_twisted.ensureDeferred
async def test_a_tenant_sees_only_its_own(make_ledger):
    ledger = make_ledger()
    ledger.record(turn(T0, tenant="a", conversation="ca"), [])
    ledger.record(turn(T0, tenant="b", conversation="cb"), [])
    assert (await ledger.totals("a", None)).requests == 1
    assert [c.id for c in (await ledger.conversations("a", 0, 10))[0]] == ["ca"]
    assert (await ledger.conversation("a", "cb")) is None
    assert {c.id for c in (await ledger.conversations(None, 0, 10))[0]} == {"ca", "cb"}


@pytest_twisted.ensureDeferred
async def test_conversations_come_most_recent_first_and_page(make_ledger):
    ledger = make_ledger()
    for i in range(5):
        ledger.record(turn(T0 + i, conversation=f"c{i}"), [])
    ledger.record(turn(T0 + 10, conversation="c1"), [])
    assert [c.id for c in (await ledger.conversations(None, 0, 3))[0]] == ["c1", "c4", "c3"]
    assert [c.id for c in (await ledger.conversations(None, 3, 3))[0]] == ["c2", "c0"]


@pytest_twisted.ensureDeferred
async def test_bounded_turns_and_retention(make_ledger):
    ledger = make_ledger(days=1, max_turns=3)
    for i in range(5):
        ledger.record(turn(T0 + i, seq=i), [])
    _, turns, _ = (await ledger.conversation(None, "c1"))
    assert [t.seq for t in turns] == [2, 3, 4]  # the newest max_turns
    assert (await ledger.totals(None, None)).requests == 5  # rollups keep counting
    assert (await ledger.trim(T0 + 2 * 86400)) > 0
    assert (await ledger.totals(None, None)) == Totals()
    assert (await ledger.conversations(None, 0, 10))[0] == []


@pytest_twisted.ensureDeferred
async def test_a_request_without_a_conversation_counts_but_has_no_row(make_ledger):
    ledger = make_ledger()
    ledger.record(turn(T0, conversation="-"), [])
    assert (await ledger.totals(None, None)).requests == 1
    assert (await ledger.conversations(None, 0, 10))[0] == []


@pytest_twisted.ensureDeferred
async def test_a_turn_that_arrives_late_moves_its_conversations_first_back(make_ledger):
    ledger = make_ledger()
    ledger.record(turn(T0 + 100, seq=2), [])
    ledger.record(turn(T0 + 5, seq=1), [])
    (summary,) = (await ledger.conversations(None, 0, 10))[0]
    assert (summary.first, summary.last) == (T0 + 5, T0 + 100)
    _, turns, _ = (await ledger.conversation(None, "c1"))
    assert [t.seq for t in turns] == [1, 2]


@pytest_twisted.ensureDeferred
async def test_conversations_sort_by_any_order_and_count_all(make_ledger):
    ledger = make_ledger()
    ledger.record(turn(T0, conversation="small"), [])
    for i in range(3):
        ledger.record(turn(T0 - 100 + i, conversation="big"), [])
    assert [c.id for c in (await ledger.conversations(None, 0, 10, "requests"))[0]] == ["big", "small"]
    assert [c.id for c in (await ledger.conversations(None, 0, 10, "first"))[0]] == ["small", "big"]
    rows, total = (await ledger.conversations(None, 1, 1, "last"))
    assert [c.id for c in rows] == ["big"] and total == 2


def ping(at: float, conversation="c1", cost=0.001, **over) -> Turn:
    """A keep-alive ping's row, as cg.record.ledger.Book.ping makes it."""
    return turn(at, conversation=conversation, kind=PING, tokens_before=0, results_before=0, results_after=0,
                billed=Usage(cache_read_tokens=390, output_tokens=1), cost_via_cg=cost, cost_direct=None, **over)


@pytest_twisted.ensureDeferred
async def test_a_ping_keeps_a_conversation_warm_until_its_next_turn(make_ledger):
    ledger = make_ledger()
    ledger.record(turn(T0, cache_until=T0 + 300), [])
    ledger.record(ping(T0 + 270, cache_until=T0 + 570), [])
    ledger.record(ping(T0 + 270, conversation="unknown", cache_until=T0 + 570), [])  # no row of its own appears
    (summary,), _ = (await ledger.conversations(None, 0, 10))
    assert (summary.cache_until, summary.kept_warm) == (T0 + 570, True)
    assert summary.last == T0  # a ping is not the conversation's activity
    ledger.record(turn(T0 + 700, cache_until=T0 + 1000), [])
    (summary,), _ = (await ledger.conversations(None, 0, 10))
    assert (summary.cache_until, summary.kept_warm) == (T0 + 1000, False)


@pytest_twisted.ensureDeferred
async def test_pings_are_counted_apart_from_requests(make_ledger):
    ledger = make_ledger()
    ledger.record(turn(T0, seq=1), [])
    await ledger.totals(None, None)  # a store's next batch holds the pings alone: they add to a row it has
    ledger.record(ping(T0 + 270, seq=2, cost=0.25), [])
    ledger.record(ping(T0 + 540, seq=3, cost=0.5), [])
    totals = await ledger.totals(None, None)
    assert (totals.requests, totals.pings, totals.cost_pings) == (1, 2, pytest.approx(0.75))
    assert totals.cost_via_cg == pytest.approx(0.01) and totals.billed.cache_read_tokens == 300  # the request's only
    assert [(b.totals.requests, b.totals.pings) for b in await ledger.buckets(None, T0, HOUR)] == [(1, 2)]
    found, turns, _ = await ledger.conversation(None, "c1")
    assert (found.totals.requests, found.totals.pings, found.totals.cost_pings) == (1, 2, pytest.approx(0.75))
    assert [(t.seq, t.kind) for t in turns] == [(1, REQUEST), (2, PING), (3, PING)]
    assert turns[1].billed == Usage(cache_read_tokens=390, output_tokens=1) and turns[1].cost_via_cg == 0.25


@pytest_twisted.ensureDeferred
async def test_every_ledger_provides_the_interface(make_ledger):
    assert verifyObject(ILedger, make_ledger())


@pytest_twisted.ensureDeferred
async def test_a_turn_and_its_changes_come_back_as_recorded(make_ledger):
    ledger = make_ledger()
    full = turn(T0 + 1.25, seq=7, model=None, billed=Usage(1, 2, 3, 4, 3), status=None, expand_rounds=2, repairs=1,
                epoch=True, verdict="expired", verdict_detail="idle 7m12s <b>", added_ms=1.5, cache_until=T0 + 301)
    bare = turn(T0 + 2, seq=8, billed=None, cost_via_cg=None, cost_direct=None, conversation="c1")
    changes = [Change(7, 2, None, None, "reformat", False, None, 50, 40),
               Change(7, 3, 1, "Bash", "offload", True, "0123456789abcdef", 900, 100)]
    ledger.record(full, changes)
    ledger.record(bare, [])
    summary, turns, found = await ledger.conversation("", "c1")
    assert turns == [full, bare] and found == changes
    assert summary.model == "m" and summary.client == "claude-code"  # the latest model a turn named
    assert summary.totals == Totals().add(full).add(bare)
    assert [b.model for b in await ledger.buckets("", T0, MINUTE)] == [None, "m"]


@pytest_twisted.ensureDeferred
async def test_buckets_keep_client_model_and_tenant_apart(make_ledger):
    ledger = make_ledger()
    ledger.record(turn(T0 + 1, tenant="a", client="codex", model="gpt"), [])
    ledger.record(turn(T0 + 2, tenant="a", client="claude-code", model=None), [])
    ledger.record(turn(T0 + 3, tenant="b"), [])
    ledger.record(turn(T0 + 61, tenant="a", client="codex", model="gpt"), [])
    minutes = await ledger.buckets(None, T0, MINUTE)
    assert [(b.start, b.tenant, b.client, b.model, b.totals.requests) for b in minutes] == [
        (T0, "a", "claude-code", None, 1), (T0, "a", "codex", "gpt", 1), (T0, "b", "claude-code", "m", 1),
        (T0 + 60, "a", "codex", "gpt", 1)]
    assert [b.tenant for b in await ledger.buckets("b", T0, MINUTE)] == ["b"]
    assert [b.start for b in await ledger.buckets(None, T0 + 60, MINUTE)] == [T0 + 60]  # ends after since
    assert [b.start for b in await ledger.buckets(None, T0 + 59, MINUTE)] == [T0, T0, T0, T0 + 60]
    (hour,) = await ledger.buckets("b", T0, HOUR)
    assert (hour.start, hour.width, hour.totals.requests) == (T0, HOUR, 1)


@pytest_twisted.ensureDeferred
async def test_a_window_reads_minutes_up_to_the_hour_and_whole_hours_after(make_ledger):
    ledger = make_ledger()
    arrivals = [(T0 - 30, "a"), (T0 + 90, "a"), (T0 + 1800, "a"), (T0 + HOUR + 5, "a"), (T0 + 3 * HOUR + 59, "a"),
                (T0 + 50 * HOUR, "a"), (T0 + 2 * HOUR, "b")]
    for at, tenant in arrivals:
        ledger.record(turn(at, tenant=tenant), [])
    for since in (None, T0 - 60, T0 - 31, T0, T0 + 60, T0 + 61, T0 + 1799, T0 + HOUR, T0 + 3 * HOUR + 30,
                  T0 + 100 * HOUR):
        for tenant in (None, "a", "b"):
            expected = sum(1 for at, t in arrivals if (tenant is None or t == tenant) and (since is None or at - at % 60 + 60 > since))
            assert (await ledger.totals(tenant, since)).requests == expected, (since, tenant)


@pytest_twisted.ensureDeferred
async def test_conversations_sort_by_every_order_per_tenant_and_page(make_ledger):
    ledger = make_ledger()
    # Each conversation ranks differently under each order: no two share a key.
    shapes = {"a": (5, 1, 100, 900, 0.5), "b": (1, 3, 300, 100, 0.1), "c": (3, 2, 200, 500, 0.9),
              "d": (4, 4, 50, 50, 0.2)}
    for name, (start, count, before, after, cost) in shapes.items():
        for i in range(count):
            ledger.record(turn(T0 + start * 10 + i, conversation=name, tenant="x" if name != "d" else "y",
                               tokens_before=before, tokens_after=after, cost_via_cg=cost), [])
    reference = MemoryLedger()
    for name, (start, count, before, after, cost) in shapes.items():
        for i in range(count):
            reference.record(turn(T0 + start * 10 + i, conversation=name, tenant="x" if name != "d" else "y",
                                  tokens_before=before, tokens_after=after, cost_via_cg=cost), [])
    for order in ORDERS:
        for tenant in (None, "x", "y"):
            expected, expected_total = await reference.conversations(tenant, 0, 10, order)
            rows, total = await ledger.conversations(tenant, 0, 10, order)
            assert [c.id for c in rows] == [c.id for c in expected] and total == expected_total, (order, tenant)
            assert [order_key(order)(c) for c in rows] == sorted((order_key(order)(c) for c in rows), reverse=True)
            page, _ = await ledger.conversations(tenant, 1, 2, order)
            assert [c.id for c in page] == [c.id for c in expected[1:3]]
    rows, total = await ledger.conversations(None, 10, 5)
    assert rows == [] and total == 4


@pytest_twisted.ensureDeferred
async def test_one_id_under_two_tenants(make_ledger):
    ledger = make_ledger()
    ledger.record(turn(T0, tenant="a", conversation="same", seq=1), [])
    ledger.record(turn(T0 + 50, tenant="b", conversation="same", seq=2), [])
    summary, turns, _ = await ledger.conversation(None, "same")  # the most recently active one
    assert summary.tenant == "b" and [t.seq for t in turns] == [2]
    summary, turns, _ = await ledger.conversation("a", "same")
    assert summary.tenant == "a" and [t.seq for t in turns] == [1]
    assert await ledger.conversation("c", "same") is None


@pytest_twisted.ensureDeferred
async def test_max_turns_counts_every_conversation_and_drops_the_oldest(make_ledger):
    ledger = make_ledger(max_turns=4)
    for i in range(6):
        ledger.record(turn(T0 + i, conversation=f"c{i % 2}", seq=i), [Change(i, 0, 0, "Bash", "offload", True,
                                                                            f"m{i}", 10, 1)])
    _, even, changes = await ledger.conversation(None, "c0")
    _, odd, _ = await ledger.conversation(None, "c1")
    assert [t.seq for t in even] == [2, 4] and [t.seq for t in odd] == [3, 5]
    assert [c.marker for c in changes] == ["m2", "m4"]
    (summary,) = [c for c in (await ledger.conversations(None, 0, 10))[0] if c.id == "c0"]
    assert summary.totals.requests == 3  # the summary keeps counting what the turns dropped


@pytest_twisted.ensureDeferred
async def test_trim_drops_only_what_is_past_retention(make_ledger):
    ledger = make_ledger(days=1)
    ledger.record(turn(T0, conversation="old", seq=1), [])
    ledger.record(turn(T0 + 86400 - 30, conversation="new", seq=2), [])
    ledger.record(turn(T0 + 86400 + 10, conversation="new", seq=3), [])
    now = T0 + 2 * 86400 - 60  # a day before: T0's minute and hour are past, the later ones are not
    assert await ledger.trim(now) > 0
    assert [c.id for c in (await ledger.conversations(None, 0, 10))[0]] == ["new"]
    assert await ledger.conversation(None, "old") is None
    _, turns, _ = await ledger.conversation(None, "new")
    assert [t.seq for t in turns] == [2, 3]
    assert (await ledger.totals(None, None)).requests == 2
    assert [b.start for b in await ledger.buckets(None, T0 - HOUR, MINUTE)] == [T0 + 86400 - 60, T0 + 86400]
    assert await ledger.trim(now) == 0  # nothing more to drop
    assert (await ledger.totals(None, T0 + 86400)).requests == 1


@pytest_twisted.ensureDeferred
async def test_a_ping_for_a_conversation_only_recorded_in_the_same_batch_warms_it(make_ledger):
    ledger = make_ledger()
    ledger.record(turn(T0, cache_until=None), [])
    ledger.record(ping(T0 + 270, cache_until=T0 + 600), [])
    ledger.record(ping(T0 + 280, cache_until=T0 + 500), [])  # an earlier expiry does not move it back
    ledger.record(ping(T0 + 270, tenant="other", cache_until=T0 + 600), [])  # another tenant's: nothing to warm
    (summary,), total = await ledger.conversations(None, 0, 10)
    assert (summary.cache_until, summary.kept_warm, total) == (T0 + 600, True, 1)
    assert summary.totals.pings == 2


# The threaded stores' ledgers: batched off the reactor, failures counted, rows that outlive a restart.


def test_rows_wait_on_the_reactor_and_go_to_the_worker_as_one_batch():
    clock = Clock()
    jobs = []

    def submit(fn, *args):
        jobs.append((fn, args))
        return succeed(None)

    ledger = ThreadedLedger(submit, SimpleNamespace(ledger_write="write", ledger_read="read"), clock, failed=None)
    ledger.record(turn(T0, seq=1), [])
    ledger.record(ping(T0 + 0.5, seq=2), [])
    ledger.record(turn(T0 + 1, seq=3), [])
    assert jobs == []  # nothing for the worker yet: record() only appended
    clock.advance(LEDGER_BATCH_DELAY)
    ((_, (ops, max_turns)),) = jobs
    assert [op[0].seq for op in ops] == [1, 2, 3]
    assert max_turns == DEFAULT_MAX_TURNS and clock.getDelayedCalls() == []
    ledger.record(turn(T0 + 2, seq=4), [])
    ledger.totals(None, None)  # a query sends what is pending first, then itself
    assert [(fn, args[0]) for fn, args in jobs[1:]] == [("write", [(turn(T0 + 2, seq=4), ())]), ("read", "totals")]
    assert clock.getDelayedCalls() == []


def test_rows_a_store_has_no_room_for_wait_for_the_next_batch_and_the_oldest_go_past_the_bound(monkeypatch):
    """A disk full for a minute must not cost the dashboard that minute's turns: a write that fails
    for want of room puts its rows back; one that fails otherwise loses them."""
    clock, jobs, failures = Clock(), [], []
    answers: list[BaseException] = []

    def submit(fn, *args):
        jobs.append([op[0].seq for op in args[0]])
        error = answers.pop(0) if answers else None
        return fail(as_store_error(error)) if error is not None else succeed(None)

    ledger = ThreadedLedger(submit, SimpleNamespace(ledger_write="write"), clock,
                            failed=lambda failure, lost: failures.append(lost))
    full = sqlite3.OperationalError("database or disk is full")
    answers += [full, OSError(errno.ENOSPC, "No space left on device")]
    ledger.record(turn(T0, seq=1), [])
    clock.advance(LEDGER_BATCH_DELAY)
    ledger.record(turn(T0 + 1, seq=2), [])
    clock.advance(2 * LEDGER_BATCH_DELAY)  # each try waits twice as long as the one before
    clock.advance(4 * LEDGER_BATCH_DELAY)
    assert jobs == [[1], [1, 2], [1, 2]] and failures == [0, 0]  # written at last, none lost, in order
    monkeypatch.setattr(cg.store.threaded, "LEDGER_HELD_MAX", 2)
    answers += [full]
    for seq in (3, 4, 5):
        ledger.record(turn(T0 + seq, seq=seq), [])
    clock.advance(LEDGER_BATCH_DELAY)  # a write that succeeded set the pace back
    clock.advance(2 * LEDGER_BATCH_DELAY)
    assert jobs[3:] == [[3, 4, 5], [4, 5]] and failures[2:] == [1]  # the oldest past the bound: lost
    answers += [sqlite3.DatabaseError("file is not a database")]
    ledger.record(turn(T0 + 6, seq=6), [])
    clock.advance(LEDGER_BATCH_DELAY)
    assert failures[3:] == [1] and clock.getDelayedCalls() == []  # not for want of room: lost at once


def test_held_rows_are_tried_again_less_and_less_often_until_a_write_succeeds():
    """A disk full for hours is not tried every second: each try for want of room waits twice as long
    as the one before, to LEDGER_RETRY_MAX, rows recorded meanwhile wait with them; a write that
    succeeds sets the pace back to one batch a second."""
    clock, jobs, writing = Clock(), [], []
    room = [False]

    def submit(fn, *args):
        jobs.append(clock.seconds())
        full = sqlite3.OperationalError("database or disk is full")
        if not room[0]:
            return fail(as_store_error(full))
        writing.append(Deferred())  # on the store's thread until the test fires it
        return writing[-1]

    ledger = ThreadedLedger(submit, SimpleNamespace(ledger_write="write"), clock, failed=lambda failure, lost: None)
    ledger.record(turn(T0, seq=1), [])
    for _ in range(10):
        ledger.record(turn(T0, seq=2), [])  # new rows do not hurry the next try
        clock.advance(1)
    clock.pump([1] * int(LEDGER_RETRY_MAX * 3))
    assert [b - a for a, b in zip(jobs, jobs[1:])] == [2, 4, 8, 16, 32, LEDGER_RETRY_MAX, LEDGER_RETRY_MAX]
    room[0] = True
    clock.pump([1] * int(LEDGER_RETRY_MAX))
    (retried,) = writing
    recorded = clock.seconds()
    ledger.record(turn(T0, seq=3), [])  # while the held rows are being written
    retried.callback(None)  # they were: a batch a second again, this row's too
    clock.advance(LEDGER_BATCH_DELAY)
    assert jobs[-1] == recorded + LEDGER_BATCH_DELAY and len(writing) == 2
    writing[-1].callback(None)
    assert clock.getDelayedCalls() == []


def test_queries_do_not_hurry_held_rows_and_a_failure_not_for_room_sets_the_pace_back():
    """The dashboard polls every 2 s: while held rows back off (the store full), a query does not
    try them again; once there is room they land at the next try. A write that fails for another
    reason loses its rows and leaves nothing to back off for: the next batch goes a second later."""
    clock, jobs = Clock(), []
    room = [False]

    def submit(fn, *args):
        if fn == "read":
            return succeed(None)
        jobs.append([op[0].seq for op in args[0]])
        if not room[0]:
            return fail(as_store_error(sqlite3.OperationalError("database or disk is full")))
        return succeed(None) if room[0] is True else fail(as_store_error(room[0]))

    ledger = ThreadedLedger(submit, SimpleNamespace(ledger_write="write", ledger_read="read"), clock,
                            failed=lambda failure, lost: None)
    ledger.record(turn(T0, seq=1), [])
    clock.advance(LEDGER_BATCH_DELAY)
    assert jobs == [[1]]
    for _ in range(5):  # the dashboard polling while the rows wait 2 s, then 4
        ledger.totals(None, None)
        clock.advance(1)
    assert jobs == [[1], [1]]  # the backoff's tries only
    room[0] = True
    clock.advance(4)
    assert jobs == [[1], [1], [1]]  # landed at the next try
    ledger.record(turn(T0 + 1, seq=2), [])
    ledger.totals(None, None)  # the pace back: a query sends what is pending first
    assert jobs[-1] == [2]
    room[0] = False
    ledger.record(turn(T0 + 2, seq=3), [])
    clock.advance(LEDGER_BATCH_DELAY)
    room[0] = sqlite3.DatabaseError("file is not a database")
    ledger.record(turn(T0 + 3, seq=4), [])  # held with 3, tried in 2 s
    clock.advance(2)
    assert jobs[-1] == [3, 4]  # lost: not for want of room
    ledger.record(turn(T0 + 4, seq=5), [])
    clock.advance(LEDGER_BATCH_DELAY)
    assert jobs[-1] == [5]  # a batch a second again, not 4 s after


@pytest_twisted.ensureDeferred
async def test_a_redis_at_its_maxmemory_keeps_the_ledger_rows_until_it_has_room(redis_server, closing):
    store = RedisStore(redis_server.url)
    closing(store)
    redis_server.admin.config_set("maxmemory-policy", "noeviction")
    redis_server.admin.config_set("maxmemory", "1")
    try:
        store.ledger.record(turn(T0, seq=1), [])
        assert (await store.ledger.totals(None, None)).requests == 0  # the write before it: OOM
        assert store.stats.ledger_write_errors >= 1 and store.stats.ledger_rows_lost == 0
    finally:
        redis_server.admin.config_set("maxmemory", "0")
    store.ledger.flush()  # the next try, without its backoff's wait (a query alone does not hurry it)
    assert (await store.ledger.totals(None, None)).requests == 1


async def closed_with_a_turn(tmp_path) -> str:
    """The path of a SQLite store that recorded a turn (seq 1) and was closed."""
    path = str(tmp_path / "store.sqlite3")
    store = SQLiteStore(path)
    store.ledger.record(turn(T0, seq=1), [])
    await store.close()
    return path


@pytest_twisted.ensureDeferred
async def test_close_writes_what_is_pending_and_a_reopened_store_has_it(tmp_path):
    path = await closed_with_a_turn(tmp_path)
    store = SQLiteStore(path)
    try:
        _, turns, _ = await store.ledger.conversation(None, "c1")
        assert [t.seq for t in turns] == [1]
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_a_failed_write_loses_its_rows_counts_and_logs_them(tmp_path, closing, store_log):
    path = str(tmp_path / "store.sqlite3")
    store = SQLiteStore(path)
    closing(store)
    store.ledger.record(turn(T0, seq=1), [])
    await store.ledger.totals(None, None)
    conn = sqlite3.connect(ledger_path(path))
    conn.execute("DROP TABLE ledger_turns")
    conn.commit()
    conn.close()
    store.ledger.record(turn(T0 + 1, seq=2), [])  # returns, as always
    with pytest.raises(StoreError):
        await store.ledger.conversation(None, "c1")  # the write before it failed; so does this read
    assert store.stats.ledger_write_errors == 1
    assert any("ledger rows lost" in line for line in store_log.texts())
    assert store.stats.healthy  # originals are another matter


@pytest_twisted.ensureDeferred
async def test_a_conversation_is_found_by_its_id_without_reading_every_conversation(tmp_path, closing):
    """The default viewer (--tenant none) and the admin open a conversation by its id alone: with a
    million requests in the ledger, a scan of every conversation would be the API's slowest answer."""
    path = str(tmp_path / "store.sqlite3")
    store = SQLiteStore(path)
    closing(store)
    await store.ledger.totals(None, None)  # opened, its tables made
    conn = sqlite3.connect(ledger_path(path))
    try:
        for tenant in (None, "a"):
            sql, args = find_conversation(tenant, "c1")
            plan = " ".join(row[3] for row in conn.execute("EXPLAIN QUERY PLAN " + sql.replace("ledger.", ""), args))
            assert plan.startswith("SEARCH ledger_conversations"), (tenant, plan)
    finally:
        conn.close()


@pytest_twisted.ensureDeferred
async def test_another_process_writing_the_ledger_does_not_make_a_store_forget_its_originals(tmp_path, closing):
    """Two --workers on one SQLite file: each one's ledger commits every second, and the other must
    still vouch for the originals it stored (a store forgets them when the store's file changes
    under it); the ledger has a file of its own, beside the store's."""
    path = str(tmp_path / "store.sqlite3")
    one, two = SQLiteStore(path), SQLiteStore(path)
    closing(one)
    closing(two)
    await two.info()  # open (opening the file is a change the other sees, the ledger's writes must not be)
    await one.put("", {"a": b"original"})
    await one.info()
    assert one.known("", ["a"]) == {"a"}
    two.ledger.record(turn(T0), [])
    await two.ledger.totals(None, None)  # committed
    await one.info()  # a job that looks at the file
    assert one.known("", ["a"]) == {"a"}
    assert (await one.ledger.totals(None, None)).requests == 1  # and it reads the other's rows
    assert os.stat(ledger_path(path)).st_mode & 0o777 == 0o600
    assert ledger_path(path) == str(tmp_path / "store.ledger.sqlite3")


@pytest_twisted.ensureDeferred
async def test_every_instance_on_one_redis_sees_the_fleets_turns(redis_server, closing):
    one, two = RedisStore(redis_server.url), RedisStore(redis_server.url)
    closing(one)
    closing(two)
    one.ledger.record(turn(T0, seq=1), [])  # both processes number their turns from 1
    two.ledger.record(turn(T0 + 1, seq=1, tenant="t"), [])
    two.ledger.record(turn(T0 + 2, seq=2), [])
    await one.ledger.totals(None, None)
    await two.ledger.totals(None, None)
    for store in (one, two):
        assert (await store.ledger.totals(None, None)).requests == 3
        assert (await store.ledger.conversations(None, 0, 10))[1] == 2
        _, turns, _ = await store.ledger.conversation("", "c1")
        assert [t.time for t in turns] == [T0, T0 + 2]


# What cg does with it: its options, and a trim every hour.


def test_the_ledger_options_reach_the_stores_ledger(tmp_path):
    options = Options()
    options.parseOptions(["--ledger-days", "7.5", "--ledger-max-turns", "0", "--store", "memory:"])
    config = options.config()
    assert (config.ledger_days, config.ledger_max_turns) == (7.5, 0)
    ledger = CGService(config, MemoryReactorClock()).store.ledger
    assert (ledger.days, ledger.max_turns) == (7.5, 0)
    defaults = Options()
    defaults.parseOptions([])
    assert (defaults.config().ledger_days, defaults.config().ledger_max_turns) == (30, 100_000)


def test_cg_trims_the_ledger_every_hour_on_the_reactors_clock():
    clock = MemoryReactorClock()
    service = CGService(Config(listen=("tcp:0:interface=127.0.0.1",), store="memory:", ledger_days=1), clock)
    ledger = service.store.ledger
    ledger.record(turn(0.0), [])
    service.startService()
    try:
        clock.advance(86400.0)  # a day after its last turn: still kept
        assert (ledger.conversations(None, 0, 10).result)[1] == 1
        clock.advance(LEDGER_TRIM_EVERY)  # past it, at the next hourly trim
        assert (ledger.conversations(None, 0, 10).result)[1] == 0
        assert ledger.totals(None, None).result == Totals()
    finally:
        service.stopService()
    assert not service._ledger_trim.running


@pytest_twisted.ensureDeferred
async def test_redis_trims_in_batches_until_nothing_is_left(redis_server, closing, monkeypatch):
    monkeypatch.setattr(cg.store.threaded, "TRIM_BATCH", 2)  # a script run deletes at most 2 of each
    store = RedisStore(redis_server.url, ledger_days=1)
    closing(store)
    for i in range(5):
        store.ledger.record(turn(T0 + i * MINUTE, conversation=f"c{i}"), [])
    assert await store.ledger.trim(T0 + 3 * 86400) == 5 + 1 + 5 + 5  # minutes, hours, summaries, turns
    assert (await store.ledger.conversations(None, 0, 10))[1] == 0
    assert await store.ledger.totals(None, None) == Totals()
    assert redis_server.admin.keys("cg:l:[bcs]:*") == []


@pytest_twisted.ensureDeferred
async def test_redis_forgets_a_tenant_once_a_trim_dropped_its_last_conversation(redis_server, closing):
    store = RedisStore(redis_server.url, ledger_days=1)
    closing(store)
    store.ledger.record(turn(T0, tenant="gone/a", conversation="c1"), [])
    store.ledger.record(turn(T0, tenant="kept", conversation="c1"), [])
    store.ledger.record(turn(T0 + 2 * 86400, tenant="kept", conversation="c2"), [])
    await store.ledger.totals(None, None)  # written
    assert redis_server.admin.smembers("cg:l:tenants") == {b"gone%2Fa", b"kept"}
    assert await store.ledger.trim(T0 + 2 * 86400) > 0
    assert redis_server.admin.smembers("cg:l:tenants") == {b"kept"}
    assert await store.ledger.conversation(None, "c1") is None
    (found, _, _) = await store.ledger.conversation(None, "c2")
    assert found.tenant == "kept"


@pytest_twisted.ensureDeferred
async def test_a_long_trim_lets_the_stores_requests_through_between_its_batches(tmp_path, closing, monkeypatch):
    monkeypatch.setattr(cg.store.threaded, "TRIM_BATCH", 2)
    store = SQLiteStore(str(tmp_path / "store.sqlite3"), ledger_days=1)
    closing(store)
    for i in range(5):
        store.ledger.record(turn(T0 + i * MINUTE, conversation=f"c{i}"), [])
    await store.ledger.totals(None, None)  # written
    trimmed: list[int] = []
    trimming = store.ledger.trim(T0 + 3 * 86400).addCallback(lambda count: trimmed.append(count) or count)
    assert await store.put("", {"a": b"original"}) == {"a"}  # submitted after the trim's first batch
    assert trimmed == []  # its later batches queued behind the put
    assert await trimming == 5 + 1 + 5 + 5  # minutes, hours, summaries, turns
    assert (await store.ledger.conversations(None, 0, 10))[1] == 0
    assert await store.ledger.totals(None, None) == Totals()


@pytest_twisted.ensureDeferred
async def test_a_ledger_file_that_cannot_open_leaves_the_store_working(tmp_path, closing, store_log):
    path = str(tmp_path / "store.sqlite3")
    os.mkdir(ledger_path(path))  # not a file SQLite can open
    store = SQLiteStore(path)
    closing(store)
    assert await store.put("", {"a": b"original"}) == {"a"}
    assert await store.get("", "a") == b"original"
    store.ledger.record(turn(T0), [])
    with pytest.raises(StoreError):
        await store.ledger.totals(None, None)
    assert store.stats.ledger_write_errors == 1 and store.stats.healthy


@pytest_twisted.ensureDeferred
async def test_turns_are_every_kept_turn_oldest_first_with_their_changes(make_ledger):
    ledger = make_ledger()
    offload = Change(1, 2, 0, "Bash", "offload", True, "0123456789abcdef", 800, 200, content_id="0123456789abcdef",
                     part=None, step=0)
    reformat = Change(1, 3, 1, "Read", "textclean", False, None, 300, 250, content_id="fedcba9876543210", part=2,
                      step=1)
    ledger.record(turn(T0 + 70, seq=2, conversation="-"), [])  # no conversation: no summary, but a turn
    ledger.record(turn(T0 + 5, seq=1), [offload, reformat])
    ledger.record(turn(T0 + 90, seq=3, tenant="b:/%"), [])
    assert [(t.seq, list(c)) for t, c in await ledger.turns()] == [
        (1, [offload, reformat]), (2, []), (3, [])]  # of every tenant


@pytest_twisted.ensureDeferred
async def test_a_sqlite_ledger_from_before_pings_were_counted_reads_and_counts_them(tmp_path):
    """A file an older cg made has no pings columns: opened, they are added (0 in the rows it has)."""
    path = await closed_with_a_turn(tmp_path)
    drop_pings_columns(path)
    store = SQLiteStore(path)
    try:
        assert (await store.ledger.totals(None, None)).requests == 1
        store.ledger.record(ping(T0 + 270, seq=2, cost=0.25), [])
        store.ledger.record(turn(T0 + 600, seq=3), [])
        totals = await store.ledger.totals(None, None)
        assert (totals.requests, totals.pings, totals.cost_pings) == (2, 1, 0.25)
        found, turns, _ = await store.ledger.conversation(None, "c1")
        assert (found.totals.requests, found.totals.pings, found.last) == (2, 1, T0 + 600)
    finally:
        await store.close()


def drop_pings_columns(path: str) -> None:
    """Make the ledger beside the store at `path` like one a cg from before pings were counted made."""
    conn = sqlite3.connect(ledger_path(path))
    for table in ("ledger_buckets", "ledger_conversations"):
        for column in ("pings", "cost_pings"):
            conn.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
    conn.commit()
    conn.close()


@pytest_twisted.ensureDeferred
async def test_workers_opening_an_older_sqlite_ledger_at_once_all_attach_it(tmp_path):
    """`--workers N` started on a file an older cg made: each process adds the missing columns or
    sees them added, never runs on without a ledger (two threads, each its own connection, as two
    processes would; rounds, as the race is one of timing)."""
    path = await closed_with_a_turn(tmp_path)
    drop_pings_columns(path)
    older = tmp_path / "older"
    older.mkdir()
    for suffix in ("", ".ledger"):
        (older / f"store{suffix}.sqlite3").write_bytes((tmp_path / f"store{suffix}.sqlite3").read_bytes())
    for round_ in range(12):
        here = tmp_path / str(round_)
        here.mkdir()
        for suffix in ("", ".ledger"):
            (here / f"store{suffix}.sqlite3").write_bytes((older / f"store{suffix}.sqlite3").read_bytes())
        start = threading.Barrier(2)

        def open_and_count_a_ping(seq, path=str(here / "store.sqlite3"), start=start):
            start.wait()
            db = SQLiteDB.open(path, 1 << 20, clock=lambda: T0)
            try:
                db.ledger.write([(ping(T0 + 60, seq=seq), ())], 100)
                return db.ledger_error
            finally:
                db.close()

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            assert list(pool.map(open_and_count_a_ping, (2, 3))) == ["", ""]
        conn = sqlite3.connect(ledger_path(str(here / "store.sqlite3")))
        assert conn.execute("SELECT pings, requests FROM ledger_conversations").fetchall() == [(2, 1)]
        conn.close()


@pytest_twisted.ensureDeferred
async def test_a_sqlite_ledger_that_cannot_be_attached_is_logged_and_the_store_works_on(tmp_path, store_log):
    path = str(tmp_path / "store.sqlite3")
    (tmp_path / "store.ledger.sqlite3").write_bytes(b"not a database" * 100)
    store = SQLiteStore(path)
    try:
        await store.put("", {"a": b"."})
        assert await store.get("", "a") == b"."
        assert store_log.texts(LogLevel.error) == [
            f"cg store {path}: cannot attach the ledger {ledger_path(path)}: file is not a database"]
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_a_redis_ledger_from_before_pings_were_counted_reads_and_counts_them(redis_server, closing):
    """Sums an older cg packed have FLAT's first 14 numbers: read, the rest are 0; added to, they grow."""
    store = RedisStore(redis_server.url)
    closing(store)
    store.ledger.record(turn(T0, seq=1), [])
    await store.ledger.totals(None, None)
    admin = redis_server.admin
    keys = admin.keys("cg:l:[bsc]:*")
    assert len(keys) == 5  # a minute's and an hour's bucket and tenant sums, the conversation
    for key in keys:
        for field, packed in admin.hgetall(key).items():
            if field in (b"client", b"first", b"last", b"model", b"until", b"warm"):
                continue
            admin.hset(key, field, b",".join(packed.split(b",")[:14]))
    assert (await store.ledger.totals(None, None)).pings == 0
    store.ledger.record(ping(T0 + 270, seq=2, cost=0.25), [])
    store.ledger.record(turn(T0 + 600, seq=3), [])
    totals = await store.ledger.totals(None, None)
    assert (totals.requests, totals.pings, totals.cost_pings) == (2, 1, 0.25)
    (found,), _ = await store.ledger.conversations(None, 0, 10)
    assert (found.totals.requests, found.totals.pings) == (2, 1)
