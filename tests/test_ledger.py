"""The ledger's contract (cg.store.base.ILedger) on the in-memory reference (cg.store.ledger)."""

import pytest

from cg.exchange.ledger import HOUR, MINUTE, Change, Totals, Turn
from cg.store.ledger import MemoryLedger
from cg.stream.usage import Usage

T0 = 1_699_999_200.0  # a whole hour (UTC)


def turn(at: float, conversation="c1", tenant="", client="claude-code", model="m", seq=0, **over) -> Turn:
    return Turn(time=at, seq=seq, tenant=tenant, conversation=conversation, client=client, model=model,
                dialect="anthropic", path="/v1/messages", status=200, outcome="ok", tokens_before=1000,
                tokens_after=400, results_before=800, results_after=200,
                billed=Usage(input_tokens=10, cache_read_tokens=300, cache_write_tokens=90, output_tokens=50),
                cost_via_cg=0.01, cost_direct=0.02, **over)


def result(d):
    """The value of an already-fired Deferred."""
    box = []
    d.addCallback(box.append)
    assert box, "the Deferred has not fired"
    return box[0]


def test_turns_sum_into_totals_buckets_and_their_conversation():
    ledger = MemoryLedger()
    ledger.record(turn(T0 + 5, seq=1), [Change(1, 2, 0, "Bash", "offload", True, "0123456789abcdef", 800, 200)])
    ledger.record(turn(T0 + 70, seq=2), [])
    totals = result(ledger.totals(None, None))
    assert totals.requests == 2 and totals.tokens_before == 2000 and totals.billed.cache_read_tokens == 600
    assert totals.cost_via_cg == pytest.approx(0.02) and totals.cost_direct == pytest.approx(0.04)
    minutes = result(ledger.buckets(None, T0, MINUTE))
    assert [(b.start, b.totals.requests) for b in minutes] == [(T0, 1), (T0 + 60, 1)]
    assert [b.totals.requests for b in result(ledger.buckets(None, T0, HOUR))] == [2]
    (summary,) = result(ledger.conversations(None, 0, 10))[0]
    assert (summary.id, summary.first, summary.last, summary.totals.requests) == ("c1", T0 + 5, T0 + 70, 2)
    found, turns, changes = result(ledger.conversation(None, "c1"))
    assert [t.seq for t in turns] == [1, 2] and [c.marker for c in changes] == ["0123456789abcdef"]


def test_a_window_counts_only_its_minutes():
    ledger = MemoryLedger()
    ledger.record(turn(T0), [])
    ledger.record(turn(T0 + 600), [])
    assert result(ledger.totals(None, T0 + 300)).requests == 1
    assert result(ledger.totals(None, None)).requests == 2


def test_a_tenant_sees_only_its_own():
    ledger = MemoryLedger()
    ledger.record(turn(T0, tenant="a", conversation="ca"), [])
    ledger.record(turn(T0, tenant="b", conversation="cb"), [])
    assert result(ledger.totals("a", None)).requests == 1
    assert [c.id for c in result(ledger.conversations("a", 0, 10))[0]] == ["ca"]
    assert result(ledger.conversation("a", "cb")) is None
    assert {c.id for c in result(ledger.conversations(None, 0, 10))[0]} == {"ca", "cb"}


def test_conversations_come_most_recent_first_and_page():
    ledger = MemoryLedger()
    for i in range(5):
        ledger.record(turn(T0 + i, conversation=f"c{i}"), [])
    ledger.record(turn(T0 + 10, conversation="c1"), [])
    assert [c.id for c in result(ledger.conversations(None, 0, 3))[0]] == ["c1", "c4", "c3"]
    assert [c.id for c in result(ledger.conversations(None, 3, 3))[0]] == ["c2", "c0"]


def test_bounded_turns_and_retention():
    ledger = MemoryLedger(days=1, max_turns=3)
    for i in range(5):
        ledger.record(turn(T0 + i, seq=i), [])
    _, turns, _ = result(ledger.conversation(None, "c1"))
    assert [t.seq for t in turns] == [2, 3, 4]  # the newest max_turns
    assert result(ledger.totals(None, None)).requests == 5  # rollups keep counting
    assert result(ledger.trim(T0 + 2 * 86400)) > 0
    assert result(ledger.totals(None, None)) == Totals()
    assert result(ledger.conversations(None, 0, 10))[0] == []


def test_a_request_without_a_conversation_counts_but_has_no_row():
    ledger = MemoryLedger()
    ledger.record(turn(T0, conversation="-"), [])
    assert result(ledger.totals(None, None)).requests == 1
    assert result(ledger.conversations(None, 0, 10))[0] == []


def test_a_turn_that_arrives_late_moves_its_conversations_first_back():
    ledger = MemoryLedger()
    ledger.record(turn(T0 + 100, seq=2), [])
    ledger.record(turn(T0 + 5, seq=1), [])
    (summary,) = result(ledger.conversations(None, 0, 10))[0]
    assert (summary.first, summary.last) == (T0 + 5, T0 + 100)
    _, turns, _ = result(ledger.conversation(None, "c1"))
    assert [t.seq for t in turns] == [1, 2]


def test_conversations_sort_by_any_order_and_count_all():
    ledger = MemoryLedger()
    ledger.record(turn(T0, conversation="small"), [])
    for i in range(3):
        ledger.record(turn(T0 - 100 + i, conversation="big"), [])
    assert [c.id for c in result(ledger.conversations(None, 0, 10, "requests"))[0]] == ["big", "small"]
    assert [c.id for c in result(ledger.conversations(None, 0, 10, "first"))[0]] == ["small", "big"]
    rows, total = result(ledger.conversations(None, 1, 1, "last"))
    assert [c.id for c in rows] == ["big"] and total == 2


def test_a_ping_keeps_a_conversation_warm_until_its_next_turn():
    ledger = MemoryLedger()
    ledger.record(turn(T0, cache_until=T0 + 300), [])
    ledger.warmed("", "c1", T0 + 600)
    ledger.warmed("", "unknown", T0 + 600)  # nothing to warm: no row appears
    (summary,), _ = result(ledger.conversations(None, 0, 10))
    assert (summary.cache_until, summary.kept_warm) == (T0 + 600, True)
    ledger.record(turn(T0 + 700, cache_until=T0 + 1000), [])
    (summary,), _ = result(ledger.conversations(None, 0, 10))
    assert (summary.cache_until, summary.kept_warm) == (T0 + 1000, False)
