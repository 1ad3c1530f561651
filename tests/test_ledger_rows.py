"""Each exchange's ledger row (cg.record.ledger): its client, its bill, and its cost without cg."""

import pytest

from cg.compaction.expand import tool_tokens
from cg.compaction.pipeline import Change
from cg.compaction.rewrite import Rewrite
from cg.exchange.ledger import EXPIRED
from cg.exchange.prepare import Report
from cg.exchange.record import ExchangeRecord
from cg.exchange.verdict import CacheFacts
from cg.record.ledger import Book, Sent, client_of
from cg.record.pricing import Tokens, prices
from cg.stream.usage import Usage
from cg.wire.dialect import MESSAGES_SHAPE

MODEL = "claude-opus-4-8"


@pytest.mark.parametrize(("agent", "client"), [
    ("claude-cli/2.1.3 (external, cli)", "claude-code"),
    ("codex_exec/0.171.0 (Linux; x86_64) xterm (codex_exec; 0.171.0)", "codex"),
    ("codex_cli_rs/0.50.0", "codex"),
    ("Anthropic/Python 0.75.0", "sdk"),
    ("OpenAI/JS 5.1.0", "sdk"),
    ("curl/8.5.0", "other"),
    (None, "other"),
])
def test_the_client_is_told_by_its_user_agent(agent, client):
    assert client_of(agent) == client


def record(usage: Usage | None, session="s1", seq=1) -> ExchangeRecord:
    return ExchangeRecord(method="POST", target="/v1/messages?beta=true", dialect="anthropic", session=session,
                          seq=seq, status=200, outcome="ok", t_received=0.0, t_sent=0.0, t_headers=0.1,
                          t_client_first=0.1, t_ended=1.0, added_ttfb=0.002, bytes_in=100, bytes_out=10,
                          stream=False, expand_rounds=0, continuation_failed=None, usage=usage, compacted=None,
                          inspected=None)


def offload(content_id: str, before=1000, after=100, message=3) -> Change:
    return Change(message, 0, None, "Bash", "offload", 0, True, content_id, before, after, content_id)


def report(*changes: Change, injected=True) -> Report:
    rewrite = Rewrite(b"{}", {}, list(changes), injected, True, {}, dialect=MESSAGES_SHAPE)
    return Report(100, rewrite=rewrite)


SENT = Sent(1_700_000_000.0, "", MODEL, "claude-cli/2.1.3", lifetime=300.0)
PRICE = prices().price(MODEL, "anthropic")


def test_a_turn_cg_left_alone_costs_the_same_both_ways():
    billed = Usage(input_tokens=10, cache_read_tokens=5000, cache_write_tokens=200, output_tokens=30)
    turn, changes = Book().turn(SENT, Report(100), record(billed))
    assert changes == [] and turn.cost_direct == turn.cost_via_cg == PRICE.cost(Tokens(10, 5000, 200, 0, 30))
    assert turn.tokens_before == turn.tokens_after == 5210
    assert (turn.client, turn.path, turn.added_ms, turn.cache_until) == ("claude-code", "/v1/messages", 2.0,
                                                                          SENT.time + 300)


def test_a_result_first_offloaded_would_have_been_written_and_later_read():
    book = Book()
    billed = Usage(input_tokens=10, cache_read_tokens=5000, cache_write_tokens=200, output_tokens=30)
    injected = tool_tokens(MESSAGES_SHAPE)
    first, (change,) = book.turn(SENT, report(offload("a")), record(billed))
    # Direct: the 900 removed tokens written with the new content; no expand tool in the read prefix.
    assert first.cost_direct == pytest.approx(PRICE.cost(Tokens(10, 5000 - injected, 200 + 900, 0, 30)))
    assert (first.results_before, first.results_after, first.tokens_before) == (1000, 100, 5210 + 900 - injected)
    assert (change.marker, change.tokens_before) == ("a", 1000)
    second, _ = book.turn(SENT, report(offload("a")), record(billed, seq=2))
    assert second.cost_direct == pytest.approx(PRICE.cost(Tokens(10, 5000 + 900 - injected, 200, 0, 30)))
    assert second.cost_direct > second.cost_via_cg > 0


def test_a_turn_that_read_nothing_would_have_written_what_cg_removed():
    billed = Usage(input_tokens=3, cache_read_tokens=0, cache_write_tokens=8000, output_tokens=5)
    book = Book()
    book.turn(SENT, report(offload("a")), record(billed))
    again, _ = book.turn(SENT, report(offload("a")), record(billed, seq=2))  # sent before, but the cache is cold
    injected = tool_tokens(MESSAGES_SHAPE)
    assert again.cost_direct == pytest.approx(PRICE.cost(Tokens(3, 0, 8000 + 900 - injected, 0, 5)))


def test_conversations_do_not_share_what_they_sent():
    book = Book()
    billed = Usage(input_tokens=10, cache_read_tokens=5000, cache_write_tokens=200, output_tokens=30)
    one, _ = book.turn(SENT, report(offload("a")), record(billed, session="one"))
    other, _ = book.turn(SENT, report(offload("a")), record(billed, session="other"))
    assert one.cost_direct == other.cost_direct


def test_nothing_billed_is_no_cost_either_way():
    turn, _ = Book().turn(SENT, report(offload("a")), record(None))
    assert (turn.cost_via_cg, turn.cost_direct, turn.tokens_before, turn.cache_until) == (None, None, 0, None)
    assert turn.results_before == 1000


def test_a_turn_that_wrote_more_than_it_read_says_why():
    billed = Usage(input_tokens=3, cache_read_tokens=0, cache_write_tokens=8000, output_tokens=5)
    facts = CacheFacts(now=SENT.time, ttl=300.0, explicit=True, seen=True, last_request=SENT.time - 432)
    turn, _ = Book().turn(SENT, Report(100, cache=facts), record(billed))
    assert (turn.verdict, turn.verdict_detail) == (EXPIRED, "idle 7m12s > 5m")
    quiet, _ = Book().turn(SENT, Report(100), record(billed))
    assert (quiet.verdict, quiet.verdict_detail) == (None, "")


def test_a_bill_smaller_than_the_expand_tool_is_not_made_smaller_still():
    turn, _ = Book().turn(SENT, report(), record(Usage(input_tokens=10, output_tokens=1)))
    assert (turn.tokens_before, turn.tokens_after) == (10, 10)


def test_the_results_remembered_are_bounded(monkeypatch):
    from cg.record import ledger as rows

    monkeypatch.setattr(rows, "MAX_CONVERSATIONS", 1)
    book = Book()
    billed = Usage(input_tokens=10, cache_read_tokens=5000, cache_write_tokens=200, output_tokens=30)
    first, _ = book.turn(SENT, report(offload("a")), record(billed, session="one"))
    book.turn(SENT, report(offload("b")), record(billed, session="two"))  # "one" is forgotten
    again, _ = book.turn(SENT, report(offload("a")), record(billed, session="one"))
    assert again.cost_direct == first.cost_direct  # priced as a first send again, a write
