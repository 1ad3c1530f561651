"""Cache keep-alive, pure: what a ping sends (cg.wire.cache), which requests can be kept warm, and the
scheduler's rules (cg.exchange.keepalive), with no reactor: events in with their times, commands out."""

import json

import attrs
import pytest
from fixturedata import claude_code_body
from hypothesis import given, settings
from hypothesis import strategies as st

from cg.exchange.keepalive import (
    SEEN_GAPS,
    Arm,
    Disarm,
    End,
    Forecast,
    Ping,
    Policy,
    Scheduler,
    check_policy,
    concerns,
    lifetime,
)
from cg.testing import claude_code_bytes
from cg.wire.body import ParsedBody
from cg.wire.cache import TTL_1H, TTL_5M, cache_lifetime, ping_body

# ---------------------------------------------------------------------------------------------
# What a ping sends


def parsed(value: dict) -> ParsedBody:
    body = ParsedBody.parse(json.dumps(value).encode())
    assert body is not None
    return body


def test_ping_body_changes_max_tokens_and_stream_only():
    raw = claude_code_bytes(claude_code_body("p_second_request_tool_result"))
    assert raw.count(b'"max_tokens":64000') == 1 and raw.endswith(b'"stream":true}')
    ping = ping_body(raw)
    assert ping == raw.replace(b'"max_tokens":64000', b'"max_tokens":1').replace(b'"stream":true}', b'"stream":false}')
    # the cached prefix, byte for byte: everything before max_tokens (tools, system, messages)
    assert ping[: raw.index(b'"max_tokens"')] == raw[: raw.index(b'"max_tokens"')]


def test_ping_body_keeps_the_clients_spelling_and_nested_keys():
    body = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "é \"max_tokens\": 9"},
        {"type": "tool_use", "id": "u", "name": "n", "input": {"max_tokens": 7, "stream": True}}]}],
        "max_tokens": 4096}
    pretty = json.dumps(body, indent=2).encode()  # ASCII-escaped, spaces: another client's bytes
    ping = ping_body(pretty)
    assert ping == pretty.replace(b'"max_tokens": 4096', b'"max_tokens": 1')  # no stream key: none added
    assert json.loads(ping)["messages"] == body["messages"]
    assert ping_body(b'{"model":"m","messages":[]}') is None  # nothing to lower
    assert ping_body(b"not json") is None and ping_body(b"[1]") is None


def test_cache_lifetime_is_the_shortest_breakpoint():
    def body(*ttls):
        blocks = [{"type": "text", "text": str(i), **({"cache_control": {"type": "ephemeral", **ttl}} if ttl is not None else {})}
                  for i, ttl in enumerate(ttls)]
        return parsed({"system": blocks[:1], "messages": [{"role": "user", "content": blocks[1:]}]})

    assert cache_lifetime(body(None, None)) is None
    assert cache_lifetime(body({}, None)) == TTL_5M
    assert cache_lifetime(body({"ttl": "1h"}, {"ttl": "1h"})) == TTL_1H
    assert cache_lifetime(body({"ttl": "1h"}, {})) == TTL_5M  # the 5-minute entry is the longer prefix
    assert cache_lifetime(parsed({"tools": [{"name": "t", "cache_control": {"type": "ephemeral"}}]})) == TTL_5M
    assert cache_lifetime(parsed({"messages": [{"role": "user", "content": "text"}, "junk"]})) is None


def test_which_requests_can_be_kept_warm():
    claude_code = claude_code_body("p_second_request_tool_result")
    raw = claude_code_bytes(claude_code)
    assert concerns("/v1/messages", raw) and lifetime(parsed(claude_code)) == TTL_5M  # adaptive thinking: no budget
    assert not concerns("/v1/messages/count_tokens", raw) and not concerns("/v1/chat/completions", raw)
    # a cache_control only inside a string is no breakpoint
    quoted = claude_code_bytes({"max_tokens": 5, "messages": [{"role": "user", "content": '{"cache_control": 1}'}]})
    assert not concerns("/v1/messages", quoted)
    budget = {**claude_code, "thinking": {"type": "enabled", "budget_tokens": 2048}}
    assert lifetime(parsed(budget)) is None  # a ping would have to allow 2,049 tokens
    assert lifetime(parsed({k: v for k, v in claude_code.items() if k != "max_tokens"})) is None
    assert lifetime(parsed({**claude_code, "max_tokens": True})) is None


def test_bounds_that_make_keepalive_meaningless_are_refused():
    check_policy(271, 1, 1)
    for bad in ((270, 10, 1), (1800, 0, 1), (1800, 10, 0)):
        with pytest.raises(ValueError, match="--keepalive-"):
            check_policy(*bad)


# ---------------------------------------------------------------------------------------------
# The scheduler


def started(scheduler, key="c", now=0.0, ttl=TTL_5M, payload="body"):
    """A real request sent at ``now`` and answered 2xx: the commands of its answer."""
    generation, _ = scheduler.sent(key, now, ttl, payload)
    return scheduler.answered(key, generation, True)


def ping_times(scheduler, key="c", now=0.0, read=100_000, **request):
    """When the pings after a real request at ``now`` go, each reading ``read`` tokens, until the
    keep-alive ends; and why it does."""
    commands, times = started(scheduler, key, now, **request), []
    while isinstance(commands[0], Arm):
        times.append(commands[0].at - now)
        commands = answer(scheduler, scheduler.due(key, commands[0].at), read=read)
    (end,) = commands
    return times, end.why


def answer(scheduler, commands, ok=True, read=1000):
    """Answer the ping among ``commands``; the commands that follow."""
    (ping,) = [c for c in commands if isinstance(c, Ping)]
    return scheduler.pinged(ping.key, ping.generation, ok, read)


def test_a_ping_goes_before_the_lifetime_ends_counted_from_each_send():
    scheduler = Scheduler(Policy())
    assert started(scheduler, now=10.0) == [Arm("c", 10.0 + 270)]
    ping = scheduler.due("c", 280.0)
    assert ping == [Ping("c", "body", ping[0].generation, 1)]
    assert answer(scheduler, ping) == [Arm("c", 280.0 + 270)]  # from the ping's send
    # 1 hour: due 59.5 minutes after, with an idle bound that allows it
    scheduler = Scheduler(Policy(max_idle=7200))
    assert started(scheduler, ttl=TTL_1H) == [Arm("c", 3570.0)]


def test_a_real_request_disarms_and_starts_a_new_idle_period():
    scheduler = Scheduler(Policy(budget=2))
    started(scheduler)
    answer(scheduler, scheduler.due("c", 270.0))
    generation, commands = scheduler.sent("c", 300.0, TTL_5M, "body 2")
    assert commands == [Disarm("c")]
    assert scheduler.due("c", 540.0) == []  # a timer that fired anyway while the request is out
    assert scheduler.answered("c", generation, True) == [Arm("c", 570.0)]
    ping = scheduler.due("c", 570.0)
    assert ping[0].payload == "body 2" and ping[0].number == 1  # the budget is per idle period
    # a ping answered after a real request went is stale: the real request decides
    scheduler.sent("c", 600.0, TTL_5M, "body 3")
    assert answer(scheduler, ping, ok=False) == [] and "c" in scheduler


def test_no_ping_at_or_past_the_idle_bound():
    scheduler = Scheduler(Policy(max_idle=1800.0, forecast=None))
    commands = started(scheduler)
    times = []
    while isinstance(commands[0], Arm):
        times.append(commands[0].at)
        commands = answer(scheduler, scheduler.due("c", commands[0].at))
    assert times == [270.0 * k for k in range(1, 7)]  # 1,890 s would be past 1,800
    assert commands == [End("c", "idle")] and "c" not in scheduler
    # at the bound is past it: with 540 s, the ping that would go at 540 s does not
    scheduler = Scheduler(Policy(max_idle=540.0))
    answered = answer(scheduler, scheduler.due("c", started(scheduler)[0].at))
    assert answered == [End("c", "idle")]
    # a timer fired late, past the bound, still sends nothing
    scheduler = Scheduler(Policy(max_idle=1800.0))
    started(scheduler)
    assert scheduler.due("c", 1800.0) == [End("c", "idle")]


def test_the_budget_caps_pings_per_idle_period():
    scheduler = Scheduler(Policy(max_idle=86400.0, budget=3, forecast=None))
    commands = started(scheduler)
    pings = 0
    while isinstance(commands[0], Arm):
        commands = answer(scheduler, scheduler.due("c", commands[0].at))
        pings += 1
    assert pings == 3 and commands == [End("c", "budget")]


@pytest.mark.parametrize(("ok", "read", "why"), [(False, 0, "failed"), (False, 5000, "failed"), (True, 0, "missed")])
def test_a_ping_that_fails_or_misses_ends_the_keepalive(ok, read, why):
    scheduler = Scheduler(Policy())
    started(scheduler)
    assert answer(scheduler, scheduler.due("c", 270.0), ok, read) == [End("c", why)]
    assert scheduler.due("c", 540.0) == [] and len(scheduler) == 0  # never retried


def test_a_failed_real_request_or_an_ineligible_one_ends_it():
    scheduler = Scheduler(Policy())
    generation, _ = scheduler.sent("c", 0.0, TTL_5M, "body")
    assert scheduler.answered("c", generation, False) == [End("c", "refused")]
    started(scheduler)
    assert scheduler.sent("c", 10.0, None, "thinking on a budget") == (None, [End("c", "ineligible")])
    assert scheduler.sent("d", 10.0, None, "never kept") == (None, [])


def test_the_longest_idle_conversation_is_evicted_at_the_cap():
    scheduler = Scheduler(Policy(max_conversations=2))
    started(scheduler, "a", 0.0)
    started(scheduler, "b", 1.0)
    started(scheduler, "a", 2.0)  # a is the most recent now
    _, commands = scheduler.sent("c", 3.0, TTL_5M, "body")
    assert commands == [End("b", "evicted")] and len(scheduler) == 2
    assert scheduler.stop() == [End("a", "stopped"), End("c", "stopped")] and len(scheduler) == 0


# Whatever happens, in whatever order: the bounds hold.
_EVENTS = st.lists(st.tuples(st.sampled_from(["request", "refused", "tick", "ok", "failed", "missed"]),
                             st.floats(0.0, 900.0)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(_EVENTS, st.integers(1, 8), st.sampled_from([300.0, 1800.0, 4000.0]))
def test_pings_never_break_the_bounds(events, budget, max_idle):
    scheduler = Scheduler(Policy(max_idle=max_idle, budget=budget))
    now = 0.0
    last_request = None
    pings_since = 0
    armed: float | None = None
    waiting: Ping | None = None
    generation = None
    dead = True  # no keep-alive until a request is answered 2xx
    for kind, step in events:
        now += step
        commands = []
        if kind in ("request", "refused"):
            generation, commands = scheduler.sent("c", now, TTL_5M, now)
            last_request, pings_since, waiting = now, 0, None
            commands += scheduler.answered("c", generation, kind == "request")
            dead = kind == "refused"
        elif kind == "tick" and armed is not None and now >= armed:
            commands = scheduler.due("c", now)
        elif waiting is not None and kind in ("ok", "failed", "missed"):
            commands = scheduler.pinged("c", waiting.generation, kind != "failed", 0 if kind == "missed" else 10)
            waiting = None
        for command in commands:
            if isinstance(command, Arm):
                armed = command.at
                assert command.at < last_request + max_idle
            elif isinstance(command, (End, Disarm)):
                armed = None
                dead = dead or isinstance(command, End)
            elif isinstance(command, Ping):
                armed, waiting = None, command
                pings_since += 1
                assert not dead and now < last_request + max_idle and pings_since <= budget
                assert command.payload == last_request  # the last real request's body


def test_a_client_gone_ends_its_conversation_at_once_and_its_ping_in_flight_for_nobody():
    scheduler = Scheduler(Policy())
    started(scheduler, "c")
    started(scheduler, "other")
    assert scheduler.gone("c") == [End("c", "gone")]
    assert "c" not in scheduler and "other" in scheduler
    assert scheduler.gone("c") == [] and scheduler.gone("never seen") == []

    (ping,) = [c for c in scheduler.due("other", TTL_5M - 30.0) if isinstance(c, Ping)]
    assert scheduler.gone("other") == [End("other", "gone")]
    assert scheduler.pinged("other", ping.generation, True, 1000) == []  # answered after: nothing to arm
    assert started(scheduler, "other", now=900.0) == [Arm("other", 900.0 + TTL_5M - 30.0)]  # it came back


# ---------------------------------------------------------------------------------------------
# Whether a ping pays (Forecast)


def test_with_no_history_pings_stop_where_the_next_would_cost_more_than_it_is_likely_to_spare():
    # real sessions' gaps: by 13.5 minutes idle, a return within the next 4.5 minutes is too unlikely
    # for a ping (0.1x the prefix) to pay for the re-write it would spare (1.25x - 0.1x)
    times, why = ping_times(Scheduler(Policy(max_idle=4 * 3600.0)))
    assert times == [270.0, 540.0] and why == "forecast"
    # without the rule, the same bounds ping on to the budget
    assert ping_times(Scheduler(Policy(max_idle=4 * 3600.0, forecast=None)))[0] == [270.0 * k for k in range(1, 11)]
    # a prior where every idle period is the session's end: no ping at all
    assert ping_times(Scheduler(Policy(forecast=Forecast(prior=()))))[0] == []


def test_a_conversation_that_came_back_after_long_gaps_is_pinged_longer():
    policy = Policy(max_idle=4 * 3600.0)
    scheduler, now = Scheduler(policy), 0.0
    for gap in (1700.0, 1750.0, 1650.0):  # it came back three times after ~28 minutes
        started(scheduler, now=now)
        now += gap
    times, why = ping_times(scheduler, now=now)
    assert times == [270.0 * k for k in range(1, 7)] and why == "forecast"  # to 27 min, where the prior stops at 9
    # the same gaps, not learnt from: as with no history
    scheduler, now = Scheduler(attrs.evolve(policy, forecast=Forecast(learn=False))), 0.0
    for gap in (1700.0, 1750.0, 1650.0):
        started(scheduler, now=now)
        now += gap
    assert len(ping_times(scheduler, now=now)[0]) == 2
    # gaps under the first ping's time teach nothing
    scheduler, now = Scheduler(policy), 0.0
    for gap in (60.0,) * 20:
        started(scheduler, now=now)
        now += gap
    assert len(ping_times(scheduler, now=now)[0]) == 2


def test_a_small_prefix_is_not_worth_its_output_token():
    # a ping bills one output token (5x an input token) besides the prefix read: on 40 tokens that
    # doubles its price. The first ping tells the scheduler the prefix's size (what it read); cg-estimate
    # learns it the same way, so both decide alike
    assert len(ping_times(Scheduler(Policy(max_idle=4 * 3600.0)), read=100_000)[0]) == 2
    assert ping_times(Scheduler(Policy(max_idle=4 * 3600.0)), read=40) == ([270.0], "forecast")


def test_an_hour_long_cache_is_pinged_while_a_return_within_the_hour_is_likely_enough():
    # a ping read 0.1x against a 2x write: worth it while 1 in 19 idle periods still ends within the hour
    times, why = ping_times(Scheduler(Policy(max_idle=86400.0)), ttl=TTL_1H)
    assert times and times[0] == TTL_1H - 30.0 and why == "forecast"
    assert times[-1] < 4 * 3600.0  # past the prior's longest break, nothing comes back


def test_a_conversation_keeps_only_its_latest_long_gaps():
    def pings_after(gaps):
        scheduler, now = Scheduler(Policy(max_idle=4 * 3600.0)), 0.0
        for gap in gaps:
            started(scheduler, now=now)
            now += gap
        return len(ping_times(scheduler, now=now)[0])

    # it came back after ~28 minutes, over and over: pinged to 27 minutes
    assert pings_after((1700.0,) * 40) == 6
    # then it took 10-minute breaks only, as many as are kept: the old habit is forgotten
    assert pings_after((1700.0,) * 40 + (600.0,) * SEEN_GAPS) == 2
    assert pings_after((1700.0,) * 40 + (600.0,) * (SEEN_GAPS - 1)) == 6
