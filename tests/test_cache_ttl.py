"""twistd cg --cache-ttl keep|5m|1h|auto: the lifetime a Messages request's breakpoints ask for.

The edit on its own (cg.wire.cache.lifetime_edits) over bodies with 0 to 4 breakpoints; `auto`'s
decision in the preparation machine against a store kept in a dict (frozen at the first expired
cache, read back after a restart, the client's lifetime where the store cannot say); and through
cg over real sockets: the bytes the fake provider receives from the anthropic SDK, and `auto` over
one SQLite store, for a second cg and across a restart.
"""

import json

import anthropic
import pytest
from helpers.bodies import conversation
from helpers.drive import send
from helpers.stores import FakeClock
from pytest_twisted import inlineCallbacks
from twisted.internet.threads import deferToThread
from twisted.python import usage

from cg.compaction import cold
from cg.compaction.options import rewrite_config
from cg.compaction.rewrite import Rewriter
from cg.exchange import prepare
from cg.testing import JSONReply, anthropic_message
from cg.web.tap import Options
from cg.wire.body import ParsedBody
from cg.wire.cache import TTL_1H, TTL_5M, breakpoint_ttl, lifetime_edits
from cg.wire.markers import EXPAND_TOOL

EPHEMERAL = {"type": "ephemeral"}
HOUR = {"type": "ephemeral", "ttl": "1h"}
SESSION = "3c1f0a2e-77d4-4b8e-9a10-5e2d8c6b4f01"
MARGIN = cold.ColdPolicy().margin


def messages_body(breakpoints: int, control: dict = EPHEMERAL, system_string: bool = False) -> dict:
    """A Messages request with `breakpoints` breakpoints, on tools, system, a tool result's part and
    the newest message, in that order."""
    places = [{} for _ in range(4)]
    for place in places[:breakpoints]:
        place["cache_control"] = dict(control)
    system = "You are terse." if system_string else [{"type": "text", "text": "You are terse.", **places[1]}]
    return {
        "model": "claude-opus-4-8", "max_tokens": 64, "system": system,
        "tools": [{"name": "Bash", "input_schema": {"type": "object"}, **places[0]}],
        "messages": [
            {"role": "user", "content": "run it"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "ok ✓", **places[2]}]},
                {"type": "text", "text": "go on", **places[3]}]},
        ],
    }


def breakpoints(value: object) -> list[float | None]:
    """Every breakpoint's lifetime, in document order."""
    found = []
    if isinstance(value, dict):
        if "cache_control" in value:
            found.append(breakpoint_ttl(value))
        for member in value.values():
            found += breakpoints(member)
    elif isinstance(value, list):
        for item in value:
            found += breakpoints(item)
    return found


def edited(raw: bytes, ttl: float) -> bytes:
    body = ParsedBody.parse(raw)
    assert body is not None
    return body.apply(lifetime_edits(body, ttl))


# ---------------------------------------------------------------------------------------------
# The edit


@pytest.mark.parametrize("count", range(5))
@pytest.mark.parametrize("ttl", [TTL_5M, TTL_1H])
def test_every_breakpoint_asks_for_the_lifetime_and_nothing_else_changes(count, ttl):
    raw = json.dumps(messages_body(count), ensure_ascii=False).encode()
    out = edited(raw, ttl)
    assert breakpoints(json.loads(out)) == [ttl] * count  # none added, none lost
    expected = messages_body(count, {**EPHEMERAL, "ttl": "1h"}) if ttl == TTL_1H else messages_body(count)
    assert json.loads(out) == expected
    assert (out == raw) == (ttl == TTL_5M or count == 0)  # a breakpoint without ttl is 5 minutes already
    assert edited(out, ttl) == out  # the next turn's edit of the same bytes: none


def test_5m_rewrites_only_the_breakpoints_that_ask_for_an_hour():
    raw = json.dumps(messages_body(4, HOUR)).encode()
    out = edited(raw, TTL_5M)
    assert breakpoints(json.loads(out)) == [TTL_5M] * 4
    assert json.loads(out) == messages_body(4, {**EPHEMERAL, "ttl": "5m"})
    assert edited(raw, TTL_1H) == raw


def test_the_requests_own_breakpoint_and_a_system_string():
    automatic = {**messages_body(0, system_string=True), "cache_control": EPHEMERAL}
    raw = json.dumps(automatic).encode()
    assert json.loads(edited(raw, TTL_1H)) == {**automatic, "cache_control": HOUR}
    plain = json.dumps(messages_body(0, system_string=True)).encode()
    assert edited(plain, TTL_1H) == plain


def test_a_breakpoints_other_members_and_the_bytes_around_it_stay():
    raw = (b'{"model":"m","max_tokens":5,"system":[{"type":"text","text":"s",'
           b'"cache_control":{"type":"ephemeral","scope":"x"}}],"messages":[]}')
    assert edited(raw, TTL_1H) == raw.replace(b'"scope":"x"}', b'"scope":"x","ttl":"1h"}')
    spaced = b'{"model":"m","max_tokens":5,"system":[{"type":"text","text":"s","cache_control":{ "ttl" : "1h" }}]}'
    assert edited(spaced, TTL_5M) == spaced.replace(b'"1h"', b'"5m"')


def test_the_rewrite_joins_it_for_messages_only_and_keep_changes_nothing():
    rewriter = Rewriter(rewrite_config())
    raw = json.dumps(messages_body(2)).encode()
    kept = rewriter.finish(rewriter.parse(raw, b"/v1/messages")).body  # the expand tool injected, as always
    hour = rewriter.finish(rewriter.parse(raw, b"/v1/messages"), lifetime=TTL_1H).body
    assert breakpoints(json.loads(kept)) == [TTL_5M] * 2 and breakpoints(json.loads(hour)) == [TTL_1H] * 2
    assert hour.replace(b',"ttl":"1h"', b"") == kept  # in the same splice: nothing else differs
    chat = json.dumps({"model": "gpt-5", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi", "cache_control": EPHEMERAL}]}]}).encode()
    assert rewriter.finish(rewriter.parse(chat, b"/v1/chat/completions"), lifetime=TTL_1H).body == chat


def test_a_breakpoint_inside_a_repaired_answer_leaves_every_lifetime_as_the_client_asked():
    """A repair rewrites the answer's block whole, keeping its breakpoint as the client wrote it: the
    other breakpoints keep theirs too, so no shorter lifetime ends up before a longer one."""
    error = "<tool_use_error>Error: No such tool available: context_guru_expand</tool_use_error>"
    leaked = {**messages_body(2), "messages": [
        {"role": "user", "content": "what failed?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_leak", "name": EXPAND_TOOL,
                                           "input": {"id": "0123456789abcdef"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_leak", "is_error": True,
                                      "content": [{"type": "text", "text": error, "cache_control": EPHEMERAL}]}]}]}
    rewriter = Rewriter(rewrite_config())
    raw = json.dumps(leaked).encode()
    hour = rewriter.finish(rewriter.parse(raw, b"/v1/messages"), lifetime=TTL_1H)
    assert breakpoints(json.loads(hour.body)) == [TTL_1H] * 3 and hour.lifetime == TTL_1H
    repaired = rewriter.finish(rewriter.parse(raw, b"/v1/messages"), {"toolu_leak": "the original"}, lifetime=TTL_1H)
    assert repaired.repaired == 1 and breakpoints(json.loads(repaired.body)) == [TTL_5M] * 3
    assert repaired.lifetime is None  # what the keep-alive's pings go by: the client's lifetime, as sent


# ---------------------------------------------------------------------------------------------
# auto, in the preparation machine


class Store:
    """The store's answers, from dicts; `broken`: every lookup fails."""

    def __init__(self):
        self.frozen: dict[str, bytes] = {}
        self.until: dict[str, float] = {}
        self.held: set[str] = set()
        self.broken = False
        self.healthy = True
        self.asked: list[prepare.StoreCommand] = []

    def asked_about_the_lifetime(self) -> int:
        """Store commands on `ttl:` keys since the last call."""
        count = sum(command.key.startswith("ttl:") for command in self.asked if hasattr(command, "key"))
        self.asked = []
        return count

    def known(self, tenant, ids):
        return {i for i in ids if i in self.held}

    def answer(self, command):
        self.asked.append(command)
        if self.broken and isinstance(command, prepare.ReadFrozen | prepare.RecordCache | prepare.Freeze):
            return prepare.Failed(command, "the store is down")
        if isinstance(command, prepare.ReadFrozen):
            return prepare.Answered(command, self.frozen.get(command.key))
        if isinstance(command, prepare.Freeze):
            return prepare.Answered(command, self.frozen.setdefault(command.key, command.text))
        if isinstance(command, prepare.RecordCache):
            before = self.until.get(command.key)
            self.until[command.key] = max(command.until, before or 0.0)
            return prepare.Answered(command, before)
        if isinstance(command, prepare.PutOriginals):
            self.held |= set(command.originals)
            return prepare.Answered(command, set(command.originals))
        assert isinstance(command, prepare.ReadOriginal)
        return prepare.Answered(command, None)


def prepared(store: Store, raw: bytes, now: float, known: cold.Known, touched: list | None = None,
             target: bytes = b"/v1/messages", **options) -> prepare.Ready:
    """`raw` prepared at `now` against `store`, its commands answered one by one (its touches, to
    `touched`)."""
    request = prepare.Request(raw, target, 7, "tenant-a", SESSION.encode(),
                      {"x-claude-code-session-id": SESSION}.get)
    machine = prepare.Preparation(request, rewriter=Rewriter(rewrite_config()), known=known, index=store, now=now,
                          cache_ttl="auto", **options)
    pending = machine.start()
    while True:
        if touched is not None:
            touched += [command for command in pending if isinstance(command, prepare.Touch)]
        pending = [command for command in pending if not isinstance(command, prepare.Touch)]
        if isinstance(pending[0], prepare.Ready):
            return pending[0]
        command, *rest = pending
        pending = rest + machine.feed(store.answer(command))


def asked(ready: prepare.Ready) -> list[float | None]:
    return breakpoints(json.loads(ready.forward.body))


def kept(ready: prepare.Ready) -> bool:
    """Whether its breakpoints went as the client wrote them (no ttl: 5 minutes)."""
    return b'"ttl"' not in ready.forward.body and asked(ready) == [TTL_5M] * len(asked(ready))


def test_auto_is_the_clients_lifetime_until_the_cache_expires_then_an_hour_frozen():
    store, known, now = Store(), cold.Known(), 1_800_000_000.0
    raw = json.dumps(messages_body(2)).encode()
    assert kept(prepared(store, raw, now, known))  # the client's lifetime
    now += TTL_5M - 10
    assert kept(prepared(store, raw, now, known))  # within the lifetime: still warm
    assert not [key for key in store.frozen if key.startswith("ttl:")]

    now += TTL_5M + MARGIN + 1  # expired: this request writes the whole prompt anyway
    expired = prepared(store, raw, now, known, keepalive=True)
    assert asked(expired) == [TTL_1H, TTL_1H]
    assert [store.frozen[key] for key in store.frozen if key.startswith("ttl:")] == [b"1h"]
    assert expired.forward.keepalive is not None and expired.forward.keepalive[1] == TTL_1H  # pings keep the hour
    assert expired.forward.cache is not None and expired.forward.cache[1] == TTL_1H  # the cold policy's expiry too

    now += 5
    later = prepared(store, raw, now, known)
    assert later.forward.body == expired.forward.body  # the same bytes on every later turn

    store.broken = True  # known in this process: the store is not asked
    assert prepared(store, raw, now + 5, known).forward.body == expired.forward.body


def test_auto_answers_a_warm_conversation_in_process_and_keeps_the_choice_every_cg_makes():
    """Until the first expiry, `auto` must know whether the cache went cold: once a second read found
    nothing frozen, a turn well within the lifetime asks the store nothing about it; every half a
    margin the record moves on (so another cg, or a restart, does not take a warm cache for cold),
    with no read: nothing is frozen while a cache is surely warm.
    The cold turn is still seen, and another cg's choice is still the one every turn sends."""
    store, known, now = Store(), cold.Known(), 1_800_000_000.0
    raw = json.dumps(messages_body(2)).encode()
    assert kept(prepared(store, raw, now, known)) and store.asked_about_the_lifetime() == 2
    assert kept(prepared(store, raw, now + 1, known)) and store.asked_about_the_lifetime() == 2  # settles it
    for seconds in range(2, 2 + int(MARGIN / 2) - 1, 3):  # agent-paced turns: no store round trip
        assert kept(prepared(store, raw, now + seconds, known))
    assert store.asked_about_the_lifetime() == 0
    now += MARGIN / 2 + 1  # the record would lag half a margin: it moves on, and only it
    assert kept(prepared(store, raw, now, known)) and store.asked_about_the_lifetime() == 1
    assert store.until[next(key for key in store.until if key.startswith("ttl:"))] == now + TTL_5M
    for _ in range(3):  # human-paced turns, minutes apart but within the lifetime: the record only
        now += TTL_5M - MARGIN - 1
        assert kept(prepared(store, raw, now, known)) and store.asked_about_the_lifetime() == 1

    other = cold.Known()  # another cg over the same store, the same conversation, warm: the client's
    now += 5
    assert kept(prepared(store, raw, now, other))
    now += TTL_5M + MARGIN + 1  # expired: each cg asks, the first freezes the hour, the other reads it
    hour = prepared(store, raw, now, known)
    assert asked(hour) == [TTL_1H, TTL_1H]
    assert prepared(store, raw, now + 1, other).forward.body == hour.forward.body
    store.asked_about_the_lifetime()
    assert prepared(store, raw, now + 2, other).forward.body == hour.forward.body
    assert store.asked_about_the_lifetime() == 0


def test_auto_touches_the_choice_it_knows_so_a_purge_spares_it():
    """A turn that takes the frozen hour from memory reads nothing, so it touches the text (the store
    writes that once a minute at most): `cg-store purge --older-than` spares a choice still in use.
    count_tokens touches nothing, as it records nothing."""
    store, known, now = Store(), cold.Known(), 1_800_000_000.0
    raw = json.dumps(messages_body(2)).encode()
    prepared(store, raw, now, known)
    hour = prepared(store, raw, now + TTL_5M + MARGIN + 1, known)
    key = next(key for key in store.frozen if key.startswith("ttl:"))
    touched: list[prepare.Touch] = []
    assert prepared(store, raw, now + TTL_5M + MARGIN + 9, known, touched=touched).forward.body == hour.forward.body
    assert [touch.frozen for touch in touched] == [frozenset({key})] and touched[0].tenant == "tenant-a"
    counted: list[prepare.Touch] = []
    prepared(store, raw, now + TTL_5M + MARGIN + 9, known, touched=counted, target=b"/v1/messages/count_tokens")
    assert not [touch for touch in counted if touch.frozen]


def test_auto_after_a_restart_reads_the_frozen_hour_and_a_store_that_cannot_say_leaves_keep():
    store, now = Store(), 1_800_000_000.0
    raw = json.dumps(messages_body(2)).encode()
    prepared(store, raw, now, cold.Known())
    hour = prepared(store, raw, now + TTL_5M + MARGIN + 1, cold.Known())
    assert asked(hour) == [TTL_1H, TTL_1H]

    restarted = prepared(store, raw, now + TTL_5M + MARGIN + 30, cold.Known())  # what it knew is gone
    assert restarted.forward.body == hour.forward.body

    store.broken = True
    assert kept(prepared(store, raw, now + TTL_5M + MARGIN + 60, cold.Known()))
    fresh = Store()
    fresh.broken = True
    assert kept(prepared(fresh, raw, now, cold.Known()))


def test_auto_leaves_a_request_without_breakpoints_alone_and_records_nothing():
    store, now = Store(), 1_800_000_000.0
    raw = json.dumps(messages_body(0)).encode()
    assert asked(prepared(store, raw, now, cold.Known())) == []
    assert asked(prepared(store, raw, now + 2 * TTL_5M, cold.Known())) == []
    assert not [key for key in {**store.frozen, **store.until} if key.startswith("ttl:")]


# ---------------------------------------------------------------------------------------------
# Through cg


def test_the_option_and_its_refusal():
    options = Options()
    options.parseOptions([])
    assert options.config().cache_ttl == "keep"
    options = Options()
    options.parseOptions(["--cache-ttl", "auto"])
    assert options.config().cache_ttl == "auto"
    with pytest.raises(usage.UsageError, match=r"^--cache-ttl must be one of keep, 5m, 1h, auto$"):
        Options().parseOptions(["--cache-ttl", "2h"])


@inlineCallbacks
def test_1h_through_the_anthropic_sdk_reaches_the_provider_on_every_breakpoint(make_cg, fake):
    fake.strict = True  # the request must be one the Messages API accepts
    cg = make_cg(anthropic_upstream=fake.url, cache_ttl="1h")
    sdk = anthropic.Anthropic(base_url=cg.url, api_key="sk-ant-test-key", max_retries=0)
    sent = {"system": [{"type": "text", "text": "You are terse.", "cache_control": EPHEMERAL}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": EPHEMERAL}]}]}
    for _ in range(2):
        fake.enqueue(JSONReply(anthropic_message("hi")))
        yield deferToThread(sdk.messages.create, model="claude-opus-4-8", max_tokens=64, **sent)
    first, second = fake.received
    assert breakpoints(json.loads(first.body)) == [TTL_1H, TTL_1H] and fake.rejections == []
    assert json.loads(first.body.replace(b',"ttl":"1h"', b"")) == {"model": "claude-opus-4-8", "max_tokens": 64,
                                                                   **sent}
    assert second.body == first.body
    assert first.header(b"anthropic-beta") is None  # the 1-hour lifetime needs no beta header now


@inlineCallbacks
def test_auto_through_cg_freezes_the_hour_in_sqlite_for_a_second_cg_and_across_a_restart(make_cg, fake, tmp_path):
    store = f"sqlite:{tmp_path / 'store.sqlite3'}"
    clock = FakeClock(1_800_000_000.0)
    headers = [("x-claude-code-session-id", SESSION)]
    body = conversation([])

    def started():
        running = make_cg(anthropic_upstream=fake.url, store=store, cache_ttl="auto")
        running.service.forwarder.now = clock
        return running

    first, other = started(), started()
    yield send(first, body, headers)
    clock.advance(TTL_5M + MARGIN + 1)
    yield send(first, body, headers)
    clock.advance(5)
    yield send(other, body, headers)  # a second cg over the same store
    yield first.stop()
    second = started()
    clock.advance(10)
    yield send(second, body, headers)
    kept, hour, beside, restarted = fake.received
    assert set(breakpoints(json.loads(kept.body))) == {TTL_5M}
    assert set(breakpoints(json.loads(hour.body))) == {TTL_1H}
    assert beside.body == restarted.body == hour.body
