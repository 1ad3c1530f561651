"""The cache-aware policy (cg.compaction.cold), pure: when a request is cold, what an epoch covers,
and that the bytes it decides replay exactly on every later turn; and its offline replay."""

import copy
import json
import re

import attrs
import pytest
from fixturedata import codex_body
from helpers.bodies import bash_turns, conversation, log, messages_bytes, tool_turn
from hypothesis import example, given, settings
from hypothesis import strategies as st

from cg.compaction import cold
from cg.compaction.cold import ColdPolicy, Epoch
from cg.compaction.options import rewrite_config
from cg.compaction.pipeline import Memo
from cg.compaction.rewrite import Rewriter
from cg.compaction.tokens import estimate_tokens
from cg.record.replay import Sent, replay
from cg.wire.body import ParsedBody
from cg.wire.cache import cache_lifetime
from cg.wire.dialect import CHAT_SHAPE, MESSAGES_SHAPE, RESPONSES_SHAPE
from cg.wire.markers import marker_id

MARKER = re.compile(r"<<cg:([0-9a-f]{16})>>")
POLICY = ColdPolicy(recent_turns=2, offload_min_tokens=500, views=cold.VIEWS_SUPERSEDED)
CONFIG = rewrite_config(cold=True)
FIRST_SIGHT = rewrite_config(cold=False)


def test_a_log_is_between_the_two_thresholds():
    assert 1000 < estimate_tokens(log(0)) < 2000


def raw(body: dict) -> bytes:
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


def parsed(body: dict) -> ParsedBody:
    result = ParsedBody.parse(raw(body))
    assert result is not None
    return result


def forward(rewriter: Rewriter, body: dict, epochs: list, policy: ColdPolicy = POLICY) -> bytes:
    incoming = rewriter.parse(raw(body), b"/v1/messages?beta=true", "conversation")
    assert incoming is not None
    epoch = cold.latest(epochs, incoming.body, incoming.dialect)
    older = cold.older(epoch, incoming.body, incoming.dialect, rewriter.config.compact)
    return rewriter.finish(incoming, older=older).body


# --- when a request is cold


@settings(max_examples=50, deadline=None)
@given(hours=st.lists(st.booleans(), min_size=1, max_size=6))
def test_the_lifetime_of_a_next_turn_is_what_a_fresh_parse_finds(hours):
    """A turn parsed against its conversation's last body takes the answers for the messages they
    share (carried): the same lifetime as a fresh parse, whichever result asks for an hour."""
    opening = len(conversation([])["messages"])

    def turn(count: int) -> bytes:
        body = conversation(bash_turns(count))  # its newest block a 5-minute breakpoint
        for index, hour in enumerate(hours[:count]):
            if hour:
                body["messages"][opening + 2 * index + 1]["content"][0]["cache_control"] = {
                    "type": "ephemeral", "ttl": "1h"}
        return raw(body)

    previous = None
    for count in range(1, len(hours) + 1):
        fresh = ParsedBody.parse(turn(count))
        grown = ParsedBody.parse(turn(count), previous)
        assert fresh is not None and grown is not None
        assert cold.cache_ttl(grown, MESSAGES_SHAPE) == cold.cache_ttl(fresh, MESSAGES_SHAPE)
        assert cold.cache_ttl(fresh, MESSAGES_SHAPE) == (cold.TTL_1H if any(hours[:count]) else cold.TTL_5M)
        previous = grown.earlier()


def test_cold_only_past_the_recorded_expiry_and_the_margin():
    policy = ColdPolicy(margin=60.0)
    assert not policy.is_cold(None, 1e12)  # nothing recorded: unknown history is warm
    assert not policy.is_cold(1000.0, 1000.0)
    assert not policy.is_cold(1000.0, 1060.0)
    assert policy.is_cold(1000.0, 1060.5)


def test_the_cache_lifetime_the_client_asked_for():
    body = conversation(bash_turns(1))
    assert cold.cache_ttl(parsed(body), MESSAGES_SHAPE) == cold.TTL_5M
    body["system"][-1]["cache_control"] = {"type": "ephemeral", "ttl": "1h"}
    assert cold.cache_ttl(parsed(body), MESSAGES_SHAPE) == cold.TTL_1H
    # The same words inside a tool result are text, not a breakpoint.
    quoted = conversation([tool_turn("toolu_x", "Bash", '{"cache_control": {"ttl": "1h"}}')])
    assert cold.cache_ttl(parsed(quoted), MESSAGES_SHAPE) == cold.TTL_5M
    # ... and so are the same keys in a tool call's input; a breakpoint on a tool, or on a block
    # inside a tool result, asks for itself.
    called = conversation(bash_turns(1))
    called["messages"][-2]["content"][0]["input"] = {"cache_control": {"type": "ephemeral", "ttl": "1h"}}
    assert cold.cache_ttl(parsed(called), MESSAGES_SHAPE) == cold.TTL_5M
    on_tool = conversation(bash_turns(1))
    on_tool["tools"][0]["cache_control"] = {"type": "ephemeral", "ttl": "1h"}
    assert cold.cache_ttl(parsed(on_tool), MESSAGES_SHAPE) == cold.TTL_1H
    inside = conversation([tool_turn("toolu_x", "Bash", [{"type": "text", "text": "ok",
                                                           "cache_control": {"type": "ephemeral", "ttl": "1h"}}])])
    assert cold.cache_ttl(parsed(inside), MESSAGES_SHAPE) == cold.TTL_1H
    # Automatic caching: the request's own cache_control places the breakpoint.
    automatic = {**conversation(bash_turns(1)), "cache_control": {"type": "ephemeral", "ttl": "1h"}}
    assert cold.cache_ttl(parsed(automatic), MESSAGES_SHAPE) == cold.TTL_1H
    assert cache_lifetime(parsed({"model": "m", "messages": [], "cache_control": {"type": "ephemeral"}})) == cold.TTL_5M
    # OpenAI keeps a prefix up to an hour; a day when asked to.
    assert cold.cache_ttl(parsed({"model": "gpt-5", "input": []}), RESPONSES_SHAPE) == cold.TTL_1H
    retained = {"model": "gpt-5", "input": [], "prompt_cache_retention": "24h"}
    assert cold.cache_ttl(parsed(retained), RESPONSES_SHAPE) == cold.TTL_24H


# --- what cg remembers between requests (cold.Known)


def test_a_conversation_known_warm_asks_the_store_nothing_for_half_a_margin():
    known, margin = cold.Known(), 60.0
    assert not known.warm("t", "k", 1000.0, 1300.0, margin)  # nothing learned
    known.stored("t", "k", 1300.0)
    assert not known.warm("t", "k", 1000.0, 1300.0, margin)  # its epochs not read yet
    known.set_epochs("t", "k", [])
    assert not known.warm("t", "k", 1000.0, 1300.0, margin)  # one read: another cg may freeze one just after
    known.set_epochs("t", "k", [])  # a second read that found the same settles them
    assert known.warm("t", "k", 1000.0, 1300.0, margin)
    assert known.warm("t", "k", 1029.0, 1329.0, margin)
    assert not known.warm("t", "k", 1030.0, 1330.0, margin)  # the store's record would lag half a margin
    assert known.warm("t", "k", 1240.0, None, margin)  # a count records nothing: warm until a margin before
    assert not known.warm("t", "k", 1240.5, None, margin)
    # Maybe cold there: another cg may be freezing an epoch, so the reads before count no more.
    assert not known.warm("t", "k", 1000.0, 1300.0, margin)
    known.set_epochs("t", "k", [])
    assert not known.warm("t", "k", 1000.0, 1300.0, margin)
    known.set_epochs("t", "k", [])
    assert not known.warm("another tenant", "k", 1000.0, 1300.0, margin)
    known.stored("t", "k", 1200.0)  # an earlier expiry recorded later: the store keeps the later one
    assert known.warm("t", "k", 1000.0, 1300.0, margin)
    known.doubt("t", "k")  # the store could not read the epochs: ask it again, keep applying those read
    assert not known.warm("t", "k", 1000.0, 1300.0, margin) and known.epochs("t", "k") == []
    known.set_epochs("t", "k", [None])
    assert not known.warm("t", "k", 1000.0, 1300.0, margin) and known.epochs("t", "k") == [None]
    known.set_epochs("t", "k", [None])
    assert known.warm("t", "k", 1000.0, 1300.0, margin)



def test_what_is_known_is_bounded_in_conversations():
    known = cold.Known(max_conversations=2)
    for key in ("a", "b", "c"):
        known.set_epochs("t", key, [None])
        known.set_epochs("t", key, [None])
        known.stored("t", key, 2000.0)
    assert known.epochs("t", "a") == [] and not known.warm("t", "a", 1000.0, None, 60.0)
    assert known.epochs("t", "c") == [None] and known.warm("t", "c", 1000.0, None, 60.0)


@settings(max_examples=500, deadline=None)
@example(skews=(0.0, 0.0), requests=[(0.0, cold.TTL_5M, 0, 0), (400.0, cold.TTL_5M, 1, 1),
                                     (0.0, cold.TTL_5M, 0, 0), (10.0, cold.TTL_5M, 0, 0)])
@given(skews=st.tuples(st.floats(-25, 25), st.floats(-25, 25)),
       requests=st.lists(st.tuples(st.floats(0, 500), st.sampled_from([cold.TTL_5M, cold.TTL_1H]),
                                   st.integers(0, 1), st.integers(0, 1)), min_size=1, max_size=40))
def test_skipping_the_store_never_changes_whether_a_request_is_cold(skews, requests):
    """Two cgs sharing a store, clocks apart by less than 30 s, requests at any pace, and a cold
    request's epoch frozen only after the next request went by (the race that forgetting the reads
    made before a cold moment, and settling on the second read after it, cover). A request that skips the store would have been found warm by it, knows every epoch it
    holds, and the store's expiry lags the newest request's by less than half a margin (so another
    cg's "cold" still means surely expired)."""
    policy, known = ColdPolicy(), (cold.Known(), cold.Known())
    clock, stored, epochs, newest = 1_000_000.0, None, [], None
    pending: list[list[int]] = []  # [requests to let by, cg] of cold requests that read and will freeze

    def freeze(by: int) -> None:
        epochs.append(Epoch(len(epochs) + 1, "ab" * 16, 500, cold.VIEWS_SUPERSEDED))
        known[by].set_epochs("t", "k", list(epochs))

    for gap, ttl, cg, delay in requests:
        clock += gap
        now = clock + skews[cg]
        until, cold_now = now + ttl, False
        if known[cg].warm("t", "k", now, until, policy.margin):
            assert not policy.is_cold(stored, now)
            assert known[cg].epochs("t", "k") == epochs
        else:
            expired, stored = stored, until if stored is None else max(stored, until)
            known[cg].stored("t", "k", until)
            known[cg].set_epochs("t", "k", list(epochs))
            cold_now = policy.is_cold(expired, now)
        newest = until if newest is None else max(newest, until)
        assert newest - stored < policy.margin / 2
        for waiting in pending:
            waiting[0] -= 1
        while pending and pending[0][0] < 0:
            freeze(pending.pop(0)[1])
        if cold_now:
            pending.append([delay - 1, cg]) if delay else freeze(cg)

# --- what an epoch covers


def test_an_epoch_covers_everything_before_the_last_turns():
    body = conversation(bash_turns(5))
    epoch = POLICY.epoch(parsed(body), MESSAGES_SHAPE)
    assert epoch is not None
    messages = body["messages"]
    # The last 2 assistant messages and what follows them are the recent turns.
    assert [m["role"] for m in messages[epoch.cutoff:]] == ["assistant", "user", "assistant", "user"]
    assert epoch.cutoff == len(messages) - 4
    assert (epoch.min_tokens, epoch.views) == (500, cold.VIEWS_SUPERSEDED)
    assert ColdPolicy(recent_turns=7).epoch(parsed(body), MESSAGES_SHAPE) is None  # no older history


def test_no_new_epoch_where_the_current_one_covers_as_much():
    body = parsed(conversation(bash_turns(5)))
    epoch = POLICY.epoch(body, MESSAGES_SHAPE)
    assert POLICY.epoch(body, MESSAGES_SHAPE, epoch) is None
    assert attrs.evolve(POLICY, offload_min_tokens=250).epoch(body, MESSAGES_SHAPE, epoch) is not None


def test_an_epoch_is_frozen_as_text_and_read_back():
    epoch = Epoch(12, "ab" * 16, 500, cold.VIEWS_SUPERSEDED)
    assert Epoch.loads(epoch.dumps()) == epoch
    assert epoch.dumps() == b'{"cutoff":12,"last":"' + b"ab" * 16 + b'","min_tokens":500,"v":1,"views":true}'
    for other in (b'{"v":2,"cutoff":12,"last":"x","min_tokens":500,"views":true}', b"[]", b"not json",
                  b'{"v":1,"cutoff":"12","last":"x","min_tokens":500,"views":true}',
                  b'{"v":1,"cutoff":12,"last":"x","min_tokens":500,"views":1}'):
        assert Epoch.loads(other) is None


def test_an_epoch_that_offloads_every_view_is_frozen_apart_and_older_ones_keep_their_meaning():
    """Epochs frozen before "all" hold a bool: true still means superseded views only, false none;
    the new value is frozen as a string an older cg does not read (it then decides at first sight)."""
    every = Epoch(12, "ab" * 16, 2000, cold.VIEWS_ALL)
    assert every.dumps() == b'{"cutoff":12,"last":"' + b"ab" * 16 + b'","min_tokens":2000,"v":1,"views":"all"}'
    assert Epoch.loads(every.dumps()) == every
    frozen = b'{"cutoff":12,"last":"x","min_tokens":2000,"v":1,"views":%s}'
    assert Epoch.loads(frozen % b"true") == Epoch(12, "x", 2000, cold.VIEWS_SUPERSEDED)
    assert Epoch.loads(frozen % b"false") == Epoch(12, "x", 2000, cold.VIEWS_OFF)
    for other in (b'"superseded"', b'"off"', b'"ALL"', b"null", b"0"):
        assert Epoch.loads(frozen % other) is None


# --- applying epochs: the same bytes on every later turn


def test_an_epoch_replays_the_same_bytes_on_every_later_turn():
    turns = bash_turns(12)
    rewriter = Rewriter(CONFIG)
    first_sight = forward(Rewriter(CONFIG), conversation(turns[:8]), [])
    assert MARKER.search(first_sight.decode()) is None  # every log kept whole at first sight

    cold_body = conversation(turns[:8])
    epoch = POLICY.epoch(parsed(cold_body), MESSAGES_SHAPE)
    assert epoch is not None
    sent = [forward(rewriter, conversation(turns[:k]), [epoch]) for k in range(8, 13)]
    covered = {marker_id(log(i).encode()) for i in range(8 - 2)}  # the logs before the last 2 turns
    assert set(MARKER.findall(sent[0].decode())) == covered
    for k, (this, following) in enumerate(zip(sent, sent[1:]), 8):
        count = len(conversation(turns[:k])["messages"])
        assert messages_bytes(this, count - 1) == messages_bytes(following, count - 1)  # the last moves its mark
    # The same with a fresh memo, in any order: a pure function of (body, epochs).
    assert forward(Rewriter(CONFIG, Memo()), conversation(turns[:11]), [epoch]) == sent[3]


def test_results_newer_than_the_cutoff_get_first_sight_decisions():
    body = conversation(bash_turns(8))
    epoch = POLICY.epoch(parsed(body), MESSAGES_SHAPE)
    assert epoch is not None
    with_epoch = ParsedBody.parse(forward(Rewriter(CONFIG), body, [epoch]))
    without = ParsedBody.parse(forward(Rewriter(CONFIG), body, []))
    assert with_epoch is not None and without is not None
    count = len(body["messages"])
    for index in range(epoch.cutoff, count):
        start, end = with_epoch.spans[("messages", index)]
        other_start, other_end = without.spans[("messages", index)]
        assert with_epoch.doc[start:end] == without.doc[other_start:other_end]
    assert with_epoch.doc != without.doc


def test_a_rewritten_or_compacted_history_matches_no_epoch():
    turns = bash_turns(8)
    body = conversation(turns)
    epoch = POLICY.epoch(parsed(body), MESSAGES_SHAPE)
    assert epoch is not None
    assert cold.latest([epoch], parsed(body), MESSAGES_SHAPE) == epoch
    later = conversation(bash_turns(10))
    assert cold.latest([epoch], parsed(later), MESSAGES_SHAPE) == epoch

    rewritten = copy.deepcopy(later)  # the client changed the last covered message
    rewritten["messages"][epoch.cutoff - 1]["content"][0]["content"] = "[Old tool result content cleared]"
    assert cold.latest([epoch], parsed(rewritten), MESSAGES_SHAPE) is None
    compacted = conversation(bash_turns(2))  # a summary and a few turns: shorter than the epoch
    assert cold.latest([epoch], parsed(compacted), MESSAGES_SHAPE) is None
    assert MARKER.search(forward(Rewriter(CONFIG), rewritten, [epoch]).decode()) is None


def test_the_latest_matching_epoch_wins():
    turns = bash_turns(12)
    first = POLICY.epoch(parsed(conversation(turns[:6])), MESSAGES_SHAPE)
    second = POLICY.epoch(parsed(conversation(turns[:10])), MESSAGES_SHAPE)
    assert first is not None and second is not None and second.cutoff > first.cutoff
    body = parsed(conversation(turns))
    assert cold.latest([first, second], body, MESSAGES_SHAPE) == second
    assert cold.latest([first, None, second, None], body, MESSAGES_SHAPE) == second  # unreadable ones skipped
    # A history rewritten after the first epoch still matches it.
    rewritten = conversation(turns)
    rewritten["messages"][second.cutoff - 1]["content"][0]["content"] = "cleared"
    assert cold.latest([first, second], parsed(rewritten), MESSAGES_SHAPE) == first


def read_turn(tool_id: str, path: str, text: str) -> list[dict]:
    return tool_turn(tool_id, "Read", text, {"file_path": path})


def edit_turn(tool_id: str, path: str) -> list[dict]:
    return tool_turn(tool_id, "Edit", "The file has been updated.", {"file_path": path, "old_string": "a",
                                                                          "new_string": "b"})


def test_a_file_view_superseded_by_a_later_call_on_the_file_is_offloaded():
    view_a, view_b, view_c, view_d, view_d2 = log(100), log(101), log(102), log(103), log(104)
    turns = [read_turn("toolu_ra", "/p/a.py", view_a), read_turn("toolu_rb", "/p/b.py", view_b),
             read_turn("toolu_rc", "/p/c.py", view_c), read_turn("toolu_rd", "/p/d.py", view_d),
             edit_turn("toolu_ea", "/p/a.py"), read_turn("toolu_rb2", "/p/b.py", view_b),
             read_turn("toolu_rd2", "/p/d.py", view_d2), *bash_turns(1),
             edit_turn("toolu_ec", "/p/c.py"), *bash_turns(1)]
    body = conversation(turns)
    epoch = POLICY.epoch(parsed(body), MESSAGES_SHAPE)
    assert epoch is not None
    found = set(MARKER.findall(forward(Rewriter(CONFIG), body, [epoch]).decode()))
    assert marker_id(view_a.encode()) in found  # read, then edited: superseded
    assert marker_id(view_d.encode()) in found  # read again, showing other text: superseded
    # Read again with the same text: the second is dedup's pointer to the first, which keeps it whole.
    assert marker_id(view_b.encode()) in found and found.isdisjoint(
        {marker_id(view_c.encode()), marker_id(view_d2.encode())})  # c: edited only after the cutoff
    forwarded = forward(Rewriter(CONFIG), body, [epoch]).decode()
    assert forwarded.count(json.dumps(view_b)) == 1 and forwarded.count(json.dumps(view_d2)) == 1
    no_views = attrs.evolve(epoch, views=cold.VIEWS_OFF)
    assert marker_id(view_a.encode()) not in MARKER.findall(forward(Rewriter(CONFIG), body, [no_views]).decode())


def test_an_epoch_of_every_view_offloads_the_old_views_no_later_call_superseded():
    """views "all": each file view before the cutoff goes, superseded or not; the recent turns'
    views stay whole, and other results are decided by the threshold as before."""
    view_a, view_c, view_r = log(110), log(111), log(112)
    turns = [read_turn("toolu_ra", "/p/a.py", view_a), edit_turn("toolu_ea", "/p/a.py"),
             read_turn("toolu_rc", "/p/c.py", view_c), *bash_turns(1), read_turn("toolu_rr", "/p/r.py", view_r),
             *bash_turns(1)]
    body = conversation(turns)
    every = attrs.evolve(POLICY, views=cold.VIEWS_ALL)
    epoch = every.epoch(parsed(body), MESSAGES_SHAPE)
    assert epoch is not None and epoch.views == cold.VIEWS_ALL
    found = set(MARKER.findall(forward(Rewriter(CONFIG), body, [epoch]).decode()))
    assert {marker_id(view_a.encode()), marker_id(view_c.encode())} <= found  # c: never superseded
    assert marker_id(view_r.encode()) not in found  # in the recent turns
    superseded = attrs.evolve(epoch, views=cold.VIEWS_SUPERSEDED)
    found = set(MARKER.findall(forward(Rewriter(CONFIG), body, [superseded]).decode()))
    assert marker_id(view_a.encode()) in found and marker_id(view_c.encode()) not in found
    # A later turn sends the covered messages as they were, and a policy of superseded views makes a new epoch.
    grown = conversation([*turns, *bash_turns(1)])
    sent = [json.loads(forward(Rewriter(CONFIG), b, [epoch]))["messages"][:epoch.cutoff] for b in (body, grown)]
    assert sent[0] == sent[1]
    assert POLICY.epoch(parsed(body), MESSAGES_SHAPE, epoch) is not None


def test_openai_and_responses_bodies_get_epochs_too():
    chat = {"model": "gpt-5", "tools": [{"type": "function", "function": {"name": "sh", "parameters": {}}}],
            "messages": [{"role": "user", "content": "go"}]}
    for i in range(5):
        chat["messages"] += [{"role": "assistant", "content": None,
                              "tool_calls": [{"id": f"c{i}", "type": "function",
                                              "function": {"name": "sh", "arguments": "{}"}}]},
                             {"role": "tool", "tool_call_id": f"c{i}", "content": log(i)}]
    epoch = POLICY.epoch(parsed(chat), CHAT_SHAPE)
    assert epoch is not None and epoch.cutoff == len(chat["messages"]) - 4
    rewriter = Rewriter(CONFIG)
    incoming = rewriter.parse(raw(chat), b"/v1/chat/completions")
    assert incoming is not None
    older = cold.older(cold.latest([epoch], incoming.body, CHAT_SHAPE), incoming.body, CHAT_SHAPE, CONFIG.compact)
    assert set(MARKER.findall(rewriter.finish(incoming, older=older).body.decode())) == {
        marker_id(log(i).encode()) for i in range(3)}

    body = copy.deepcopy(codex_body("first_request"))
    for i in range(4):  # each model turn: reasoning and a call in a row, then its output
        body["input"] += [{"type": "reasoning", "id": f"rs{i}", "summary": [], "encrypted_content": "x"},
                          {"type": "function_call", "id": f"fc{i}", "name": "exec_command", "arguments": "{}",
                           "call_id": f"call{i}"},
                          {"type": "function_call_output", "call_id": f"call{i}", "output": log(i)}]
    epoch = POLICY.epoch(parsed(body), RESPONSES_SHAPE)
    assert epoch is not None and epoch.cutoff == len(body["input"]) - 6


# --- the offline replay


def session(gaps: list[float], turns: int = 10) -> list[Sent]:
    """A conversation growing by one Bash turn per request, after these idle gaps."""
    out, now = [], 1_800_000_000.0
    for k in range(turns):
        now += gaps[k] if k < len(gaps) else 5.0
        out.append(Sent(now, "/v1/messages", raw(conversation(bash_turns(k + 1))), 100))
    return out


def test_replay_simulates_the_policy_on_the_requests_times():
    config = attrs.evolve(CONFIG, cold=POLICY)
    warm = replay(session([5.0] * 10), config)
    assert not any(t.cold for t in warm) and sum(t.cold_offloads for t in warm) == 0
    assert [t.cost_cg for t in warm] == [t.cost_cg for t in replay(session([5.0] * 10), FIRST_SIGHT)]

    gaps = [5.0] * 6 + [POLICY.margin + cold.TTL_5M + 1.0]  # the 7th request comes after the cache expired
    turns = replay(session(gaps), config)
    assert [t.cold for t in turns] == [False] * 6 + [True] + [False] * 3
    assert turns[6].cold_offloads == 7 - 2 and sum(t.cold_offloads for t in turns) == 5  # counted once
    assert turns[6].cold_expand_cost > 0
    # Each placed where it is (bench/cold.py follows what the session did next with it): the older
    # Bash results, the cutoff's messages, their expand costs adding up to the turn's.
    messages = conversation(bash_turns(7))["messages"]
    placed = [(m, b) for m, b, _ in turns[6].cold_results]
    assert len(placed) == 5 and all(messages[m]["content"][b]["type"] == "tool_result" for m, b in placed)
    assert sum(usd for _, _, usd in turns[6].cold_results) == pytest.approx(turns[6].cold_expand_cost)
    assert not any(t.cold_results for t in turns[7:])
    first_sight = replay(session(gaps), FIRST_SIGHT)
    assert sum(t.cost_cg for t in turns[7:]) < sum(t.cost_cg for t in first_sight[7:])
    # A gap within the margin is not cold.
    assert not any(t.cold for t in replay(session([5.0] * 6 + [cold.TTL_5M + POLICY.margin - 1.0]), config))


@pytest.mark.parametrize("turns", [3, 9])
def test_replay_makes_no_epoch_without_older_history(turns):
    config = attrs.evolve(CONFIG, cold=ColdPolicy(recent_turns=turns + 5))
    assert sum(t.cold_offloads for t in replay(session([5.0, 400.0], turns), config)) == 0


def test_replay_keeps_each_models_cache_apart():
    """As cg does (cold.conversation_key): a side request to another model in the gap does not keep
    the main model's cache warm."""
    config = attrs.evolve(CONFIG, cold=POLICY)
    main = session([5.0] * 7, 7)
    gap = POLICY.margin + cold.TTL_5M + 1.0
    later = [Sent(t.time + gap, t.path, t.body, t.output_tokens) for t in session([5.0] * 8, 8)[7:]]
    side = json.loads(main[-1].body)
    side["model"] = "claude-haiku-4-5"
    turns = replay([*main, Sent(main[-1].time + gap - 30.0, "/v1/messages", raw(side), 10), *later], config)
    assert [t.cold for t in turns] == [False] * 8 + [True]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["Read", "Edit", "Write", "Bash"]), st.sampled_from(["a.py", "b.py"]),
                          st.sampled_from(["one", "two", ["one"]])), max_size=12), st.integers(0, 30))
def test_superseded_views_are_those_a_later_call_supersedes(calls, cutoff):
    """One pass over the views gives the definition: a view is superseded by a later edit or
    write of its file, or by a later read of it that showed other text."""
    messages = []
    for n, (tool, path, content) in enumerate(calls):
        messages += [{"role": "assistant", "content": [{"type": "tool_use", "id": f"t{n}", "name": tool,
                                                        "input": {"file_path": path}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{n}", "content": content}]}]
    def later_supersedes(n: int, path: str, content: object) -> bool:
        return any(m > n and p == path and ((t in ("Edit", "Write") and 2 * m < cutoff)  # the call is covered
                                            or (t == "Read" and 2 * m + 1 < cutoff and c != content))  # its result
                   for m, (t, p, c) in enumerate(calls))

    expected = {(2 * n + 1, 0) for n, (tool, path, content) in enumerate(calls)
                if tool == "Read" and 2 * n + 1 < cutoff and later_supersedes(n, path, content)}
    assert cold._superseded(messages, cutoff) == expected
