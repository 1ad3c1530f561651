"""The cache verdict (cg.exchange.verdict): `judge` on constructed facts, and the facts the request
side's preparation gathers on constructed sequences of Claude Code-shaped turns."""

import json

import attrs
import pytest
from helpers.bodies import superseded_view

from cg.compaction import cold
from cg.compaction.options import rewrite_config
from cg.compaction.rewrite import Rewriter
from cg.exchange.ledger import CG_PREFIX, CLIENT_PREFIX, EXPECTED, EXPIRED, KEPT_WARM
from cg.exchange.prepare import (
    Answered,
    Freeze,
    Preparation,
    PutOriginals,
    ReadFrozen,
    ReadOriginal,
    Ready,
    RecordCache,
    Request,
    Touch,
)
from cg.exchange.verdict import CacheFacts, duration, judge, stops_at
from cg.stream.usage import Usage
from cg.testing import command_output
from cg.wire.body import ParsedBody
from cg.wire.dialect import MESSAGES_SHAPE

NOW = 1_700_000_000.0
WROTE = Usage(input_tokens=3, cache_read_tokens=100, cache_write_tokens=5000, output_tokens=10)
READ = Usage(input_tokens=3, cache_read_tokens=5000, cache_write_tokens=100, output_tokens=10)
AUTOMATIC_WROTE = Usage(input_tokens=5000, cache_read_tokens=1024)  # OpenAI: no writes billed

# A turn seen before, 30 s after the last, whose prompt extends the last one.
WARM = CacheFacts(now=NOW, ttl=300.0, explicit=True, seen=True, last_request=NOW - 30, expires=NOW + 270,
                  cached=12, client_stop=12, client_stop_at="messages[10]")


@pytest.mark.parametrize(("facts", "billed", "verdict", "detail"), [
    (None, WROTE, None, ""),
    (WARM, None, None, ""),
    (WARM, READ, None, ""),  # read more than it wrote: nothing to explain
    (attrs.evolve(WARM, seen=False, last_request=None, expires=None), WROTE, EXPECTED, "first turn"),
    (attrs.evolve(WARM, seen=None, last_request=None, expires=None), WROTE, None, ""),
    (WARM, WROTE, EXPECTED, "new content only"),
    # Seen (the store had its expiry) but its last body is not in this cg's memo: cannot say more.
    (attrs.evolve(WARM, last_request=None, client_stop=None, client_stop_at=""), WROTE, None, ""),
    (WARM, attrs.evolve(WROTE, cache_read_tokens=0), EXPECTED, "new content only; nothing read back"),
    (attrs.evolve(WARM, last_request=NOW - 432, expires=NOW - 132), WROTE, EXPIRED, "idle 7m12s > 5m"),
    # Nothing recorded in the store, but cg's memo knows when the last request came.
    (attrs.evolve(WARM, last_request=NOW - 432, expires=None), WROTE, EXPIRED, "idle 7m12s > 5m"),
    # The store's record only: the cache was last used at its expiry less its lifetime.
    (attrs.evolve(WARM, last_request=None, expires=NOW - 60), WROTE, EXPIRED, "idle 6m > 5m"),
    (attrs.evolve(WARM, last_request=NOW - 3700, expires=NOW - 100, epoch=True, cg_stop=4, ttl=3600.0), WROTE,
     EXPIRED, "idle 1h01m > 1h; cg re-decided the history then (epoch)"),
    # An epoch that changed no byte is not worth a word.
    (attrs.evolve(WARM, last_request=NOW - 3700, expires=NOW - 100, epoch=True, ttl=3600.0), WROTE, EXPIRED,
     "idle 1h01m > 1h"),
    (attrs.evolve(WARM, client_stop=1, client_stop_at="system"), WROTE, CLIENT_PREFIX, "system"),
    (attrs.evolve(WARM, client_stop=5, client_stop_at="messages[3]"), WROTE, CLIENT_PREFIX, "messages[3]"),
    # A change past the cached part is new content.
    (attrs.evolve(WARM, cached=4, client_stop=5, client_stop_at="messages[3]"), WROTE, EXPECTED, "new content only"),
    (attrs.evolve(WARM, cg_stop=6, cg_stop_at="messages[4]", epoch=True), WROTE, CG_PREFIX, "epoch"),
    (attrs.evolve(WARM, cg_stop=6, cg_stop_at="messages[4]"), WROTE, CG_PREFIX, "messages[4]"),  # a bug
    # The client's change comes first: cg's follows from it.
    (attrs.evolve(WARM, client_stop=1, client_stop_at="system", cg_stop=6), WROTE, CLIENT_PREFIX, "system"),
    (attrs.evolve(WARM, last_request=NOW - 432, expires=NOW + 100), READ, KEPT_WARM, "idle 7m12s > 5m, read back"),
    (attrs.evolve(WARM, last_request=NOW - 432, expires=NOW + 100), WROTE, KEPT_WARM,
     "idle 7m12s > 5m, new content only"),
    # OpenAI: what it wrote is the prompt it did not read.
    (attrs.evolve(WARM, explicit=False), AUTOMATIC_WROTE, EXPECTED, "new content only"),
    (attrs.evolve(WARM, explicit=False), Usage(input_tokens=100, cache_read_tokens=5000), None, ""),
])
def test_judge(facts, billed, verdict, detail):
    assert judge(facts, billed) == (verdict, detail)


@pytest.mark.parametrize(("seconds", "text"), [(0, "0s"), (45.4, "45s"), (300, "5m"), (432, "7m12s"),
                                               (3600, "1h"), (3720, "1h02m"), (86400, "24h")])
def test_duration(seconds, text):
    assert duration(seconds) == text


# ---------------------------------------------------------------------------------------------
# The facts, on constructed sequences through the preparation

BASH = {"name": "Bash", "description": "run a command", "input_schema": {"type": "object"}}
SYSTEM = [{"type": "text", "text": "You are Claude Code."},
          {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
BREAKPOINT = {"type": "ephemeral"}


def turns(n: int, output_lines: int = 900) -> list[dict]:
    """`n` Bash rounds, the last user block carrying Claude Code's moving breakpoint."""
    messages: list[dict] = [{"role": "user", "content": [{"type": "text", "text": "run the tests"}]}]
    for i in range(n):
        messages += [
            {"role": "assistant", "content": [{"type": "tool_use", "id": f"toolu_{i}", "name": "Bash",
                                               "input": {"command": f"pytest -k {i}"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i}",
                                          "content": command_output(output_lines + i)}]},
        ]
    messages[-1]["content"][-1]["cache_control"] = BREAKPOINT
    return messages


def claude_code(messages: list[dict], system: list[dict] = SYSTEM) -> bytes:
    """Claude Code's key order: messages before system and tools (the provider caches tools first)."""
    return json.dumps({"model": "claude-opus-4-8", "messages": messages, "system": system, "tools": [BASH],
                       "max_tokens": 1024, "stream": True}).encode()


class Conversation:
    """One conversation's turns through `Preparation`, its store commands carried out on dicts (the
    store's `cache_until` keeps the later expiry and answers the one before, as cg.store's do)."""

    def __init__(self, cold_policy: bool = True):
        self.rewriter = Rewriter(rewrite_config(cold=cold_policy))
        self.memory = cold.Known()
        self.expiry: dict[str, float] = {}
        self.frozen: dict[str, bytes] = {}
        self.originals: dict[str, bytes] = {}
        self.forwarded: list[bytes] = []

    def turn(self, raw: bytes, at: float, target: bytes = b"/v1/messages") -> CacheFacts | None:
        request = Request(raw, target, 1, "", b"s1", {"x-claude-code-session-id": "s1"}.get)
        machine = Preparation(request, rewriter=self.rewriter, known=self.memory, index=self, now=at)
        pending = machine.start()
        while pending:
            command = pending.pop(0)
            if isinstance(command, Ready):
                self.forwarded.append(command.forward.body)
                return command.report.cache
            if not isinstance(command, Touch):
                pending += machine.feed(Answered(command, self.answer(command)))
        raise AssertionError("never ready")

    def answer(self, command):
        if isinstance(command, RecordCache):
            before = self.expiry.get(command.key)
            self.expiry[command.key] = max(before or 0.0, command.until)
            return before
        if isinstance(command, ReadFrozen):
            return self.frozen.get(command.key)
        if isinstance(command, Freeze):
            return self.frozen.setdefault(command.key, command.text)
        if isinstance(command, PutOriginals):
            self.originals.update(command.originals)
            return set(command.originals)
        assert isinstance(command, ReadOriginal)
        return self.originals.get(command.ref)

    def ping(self, at: float, ttl: float = 300.0) -> None:
        """A keep-alive ping: the conversation's cache record moves on (cg.web.forwarder.cache_used)."""
        (key,) = self.expiry
        self.expiry[key] = max(self.expiry[key], at + ttl)
        self.memory.stored("", key, at + ttl)

    # StoreIndex
    healthy = True

    def known(self, tenant, ids):
        return {i for i in ids if i in self.originals}


def with_a_superseded_view(messages: list[dict]) -> list[dict]:
    return messages[:1] + superseded_view() + messages[1:]


def next_turn(messages: list[dict], i: int) -> list[dict]:
    """`messages` with one more Bash round; the breakpoint moves to the new last block."""
    grown = json.loads(json.dumps(messages))
    del grown[-1]["content"][-1]["cache_control"]
    grown += turns(1)[1:]
    grown[-2]["content"][0]["id"] = grown[-1]["content"][0]["tool_use_id"] = f"toolu_new{i}"
    return grown


def test_the_first_turn_is_expected():
    facts = Conversation().turn(claude_code(turns(3)), NOW)
    assert facts is not None and facts.seen is False and facts.explicit
    assert judge(facts, WROTE) == (EXPECTED, "first turn")


def test_a_turn_with_new_content_only_repeats_the_whole_cached_part():
    conversation, messages = Conversation(), turns(3)
    conversation.turn(claude_code(messages), NOW)
    facts = conversation.turn(claude_code(next_turn(messages, 1)), NOW + 20)
    assert facts is not None and facts.seen and facts.last_request == NOW and facts.expires == NOW + 300
    # The last turn's prompt: tools, system, 7 messages, all cached (the breakpoint on the last one).
    assert facts.cached == 9 and facts.client_stop == 9 and facts.cg_stop is None and not facts.epoch
    assert judge(facts, WROTE) == (EXPECTED, "new content only")


def test_a_turn_after_the_lifetime_is_expired():
    conversation, messages = Conversation(cold_policy=False), turns(3)
    conversation.turn(claude_code(messages), NOW)
    facts = conversation.turn(claude_code(next_turn(messages, 1)), NOW + 432)
    assert facts is not None and facts.last_request == NOW
    assert judge(facts, WROTE) == (EXPIRED, "idle 7m12s > 5m")


def test_a_client_that_edits_its_system_prompt_changed_the_prefix():
    conversation, messages = Conversation(), turns(3)
    conversation.turn(claude_code(messages), NOW)
    edited = [SYSTEM[0], dict(SYSTEM[1], text="Be very brief.")]
    facts = conversation.turn(claude_code(next_turn(messages, 1), edited), NOW + 20)
    assert facts is not None and facts.client_stop == 1
    assert judge(facts, WROTE) == (CLIENT_PREFIX, "system")


def test_a_client_that_rewrites_an_old_message_names_it():
    conversation, messages = Conversation(), turns(3)
    conversation.turn(claude_code(messages), NOW)
    grown = next_turn(messages, 1)
    grown[3]["content"][0]["content"] = "(cleared)"
    facts = conversation.turn(claude_code(grown), NOW + 20)
    assert judge(facts, WROTE) == (CLIENT_PREFIX, "messages[3]")


def test_a_cold_turn_opens_an_epoch_and_is_expired_and_the_next_applies_it_unchanged():
    conversation, messages = Conversation(), with_a_superseded_view(turns(2))
    conversation.turn(claude_code(messages), NOW)
    grown = next_turn(messages, 1)
    facts = conversation.turn(claude_code(grown), NOW + 3600)
    assert facts is not None and facts.epoch
    assert facts.cg_stop is not None and facts.cg_stop < facts.cached  # cg changed the cached part
    assert judge(facts, WROTE) == (EXPIRED, "idle 1h > 5m; cg re-decided the history then (epoch)")
    later = conversation.turn(claude_code(next_turn(grown, 2)), NOW + 3620)
    assert later is not None and not later.epoch and later.cg_stop is None
    assert judge(later, WROTE) == (EXPECTED, "new content only")


def test_an_epoch_while_the_provider_still_had_the_cache_is_cgs_change():
    """Another cg sharing the store froze the epoch (its clock ran ahead): this turn applies it
    while its cache is warm, and says so."""
    conversation, messages = Conversation(), with_a_superseded_view(turns(2))
    conversation.turn(claude_code(messages), NOW)
    grown = next_turn(messages, 1)
    other = Conversation()
    other.frozen, other.rewriter = conversation.frozen, Rewriter(rewrite_config(cold=True))
    other.expiry = {key: NOW - 3600 for key in conversation.expiry}
    assert other.turn(claude_code(grown), NOW + 10).epoch  # found cold there: froze an epoch
    facts = conversation.turn(claude_code(next_turn(grown, 2)), NOW + 20)
    assert facts is not None and facts.epoch and facts.cg_stop is not None
    assert judge(facts, WROTE) == (CG_PREFIX, "epoch")


def test_a_keep_alive_ping_bridges_the_gap():
    conversation, messages = Conversation(), turns(3)
    conversation.turn(claude_code(messages), NOW)
    conversation.ping(NOW + 270)
    facts = conversation.turn(claude_code(next_turn(messages, 1)), NOW + 432)
    assert facts is not None and facts.expires == NOW + 570 and facts.epoch is False
    assert judge(facts, READ) == (KEPT_WARM, "idle 7m12s > 5m, read back")


def test_count_tokens_is_not_a_turn_and_leaves_the_last_one_to_judge_against():
    conversation, messages = Conversation(), turns(3)
    conversation.turn(claude_code(messages), NOW)
    grown = claude_code(next_turn(messages, 1))
    assert conversation.turn(grown, NOW + 100, b"/v1/messages/count_tokens") is None
    facts = conversation.turn(grown, NOW + 120)
    assert facts is not None and facts.last_request == NOW and facts.client_stop == facts.cached == 9


@pytest.mark.parametrize(("target", "key"), [(b"/v1/chat/completions", "messages"), (b"/v1/responses", "input")])
def test_openai_caches_the_whole_prompt(target, key):
    conversation = Conversation()
    items = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    first = json.dumps({"model": "gpt-5.5", key: items, "tools": []}).encode()
    conversation.turn(first, NOW, target)
    facts = conversation.turn(json.dumps({"model": "gpt-5.5", key: items[:1] + [{"role": "user", "content": "x"}],
                                          "tools": []}).encode(), NOW + 10, target)
    assert facts is not None and not facts.explicit and facts.cached == 4
    assert judge(facts, AUTOMATIC_WROTE) == (CLIENT_PREFIX, f"{key}[1]")


def stop(before: bytes, after: bytes) -> int:
    last = ParsedBody.parse(before)
    assert last is not None
    body = ParsedBody.parse(after, last.earlier())
    assert body is not None
    return stops_at(body, last.earlier(), MESSAGES_SHAPE)


OLD = b'{"text":"a","type":"text"}'
TEXT = b'{"type":"text","text":"' + b"x" * 5000 + b'"}'


def anthropic_bytes(*blocks: bytes, system: bytes = b'"be brief"', tools: bytes = b"[]") -> bytes:
    messages = b",".join(b'{"role":"user","content":[' + block + b"]}" for block in blocks)
    return b'{"model":"m","messages":[' + messages + b'],"system":' + system + b',"tools":' + tools + b"}"


@pytest.mark.parametrize(("before", "after", "stops"), [
    # The breakpoint moved off the last message (a later key, then the first key): new content only.
    (anthropic_bytes(TEXT, b'{"type":"text","text":"b","cache_control":{"type":"ephemeral"}}'),
     anthropic_bytes(TEXT, b'{"type":"text","text":"b"}', OLD), 4),
    (anthropic_bytes(TEXT, b'{"cache_control": {"type": "ephemeral"}, "type":"text","text":"b"}'),
     anthropic_bytes(TEXT, b'{"type":"text","text":"b"}', OLD), 4),
    # A breakpoint added to an old message is not content either.
    (anthropic_bytes(TEXT, OLD), anthropic_bytes(TEXT[:-1] + b',"cache_control":{"type":"ephemeral"}}', OLD, OLD), 4),
    # The message's text changed: it stops there.
    (anthropic_bytes(TEXT, b'{"type":"text","text":"b","cache_control":{"type":"ephemeral"}}'),
     anthropic_bytes(TEXT, b'{"type":"text","text":"c"}', OLD), 3),
    (anthropic_bytes(TEXT, OLD), anthropic_bytes(TEXT, OLD, system=b'"be kind"'), 1),
    (anthropic_bytes(TEXT, OLD), anthropic_bytes(TEXT, OLD, tools=b'[{"name":"Bash"}]'), 0),
    (anthropic_bytes(TEXT, OLD, OLD), anthropic_bytes(TEXT), 3),  # the client dropped messages
])
def test_where_a_body_stops_extending_the_last_one(before, after, stops):
    assert stop(before, after) == stops


def test_a_turn_that_asks_the_store_nothing_has_the_expiry_cg_last_learned():
    conversation, messages = Conversation(), turns(3)
    conversation.turn(claude_code(messages), NOW)
    for i in range(1, 4):  # once two reads agree on the epochs, a surely warm turn skips the store
        messages = next_turn(messages, i)
        facts = conversation.turn(claude_code(messages), NOW + 10 * i)
    # The turns at NOW + 20 and NOW + 30 were surely warm: Known's expiry, recorded at NOW + 10.
    assert facts is not None and facts.expires == NOW + 10 + 300
    assert list(conversation.expiry.values()) == [NOW + 10 + 300]  # the store was not asked since
    assert judge(facts, WROTE) == (EXPECTED, "new content only")
