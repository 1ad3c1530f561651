"""The fake provider's prompt cache (cg.testing.promptcache): usage billed as the provider bills it,
on the fake's clock; and through the fake's default replies, read by cg's usage parser."""

import ujson

from cg.stream.usage import anthropic_usage
from cg.testing import FakePromptCache, Received, command_output, default_reply
from cg.testing.promptcache import OUTPUT_TOKENS

BREAKPOINT = {"type": "ephemeral"}
SYSTEM = [{"type": "text", "text": "You are Claude Code. " + command_output(60), "cache_control": BREAKPOINT}]


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def anthropic(turns: int, system=SYSTEM, ttl: str | None = None) -> dict:
    """A Claude Code-shaped body: `turns` user messages, the breakpoint on the last one's block."""
    messages = []
    for i in range(turns):
        messages += [{"role": "user", "content": [{"type": "text", "text": f"turn {i}: " + command_output(40 + i)}]},
                     {"role": "assistant", "content": [{"type": "text", "text": "ok"}]}]
    messages.pop()
    block = messages[-1]["content"][-1]
    block["cache_control"] = dict(BREAKPOINT, ttl=ttl) if ttl else BREAKPOINT
    return {"model": "claude-sonnet-4-5", "max_tokens": 10, "system": system, "messages": messages}


def test_anthropic_writes_then_reads_what_it_cached_and_writes_the_new_part():
    caches = FakePromptCache(Clock())
    first = caches.usage(b"/v1/messages", b"key", anthropic(1))
    assert first["cache_read_input_tokens"] == 0 and first["cache_creation_input_tokens"] > 1024
    assert first["cache_creation"] == {"ephemeral_5m_input_tokens": first["cache_creation_input_tokens"],
                                       "ephemeral_1h_input_tokens": 0}
    second = caches.usage(b"/v1/messages", b"key", anthropic(2))
    assert second["cache_read_input_tokens"] == first["cache_creation_input_tokens"]
    assert 0 < second["cache_creation_input_tokens"] < second["cache_read_input_tokens"]
    assert second["output_tokens"] == OUTPUT_TOKENS


def test_anthropic_writes_it_all_again_after_the_lifetime_on_the_clock():
    clock = Clock()
    caches = FakePromptCache(clock)
    caches.usage(b"/v1/messages", b"key", anthropic(1))
    clock.now += 299
    assert caches.usage(b"/v1/messages", b"key", anthropic(2))["cache_read_input_tokens"] > 0  # a read refreshes
    clock.now += 301
    late = caches.usage(b"/v1/messages", b"key", anthropic(3))
    assert late["cache_read_input_tokens"] == 0 and late["cache_creation_input_tokens"] > 0


def test_anthropic_an_edited_system_prompt_reads_nothing():
    caches = FakePromptCache(Clock())
    caches.usage(b"/v1/messages", b"key", anthropic(1))
    edited = [dict(SYSTEM[0], text=SYSTEM[0]["text"] + "!")]
    assert caches.usage(b"/v1/messages", b"key", anthropic(2, edited))["cache_read_input_tokens"] == 0


def test_a_cache_per_credential_and_model_and_the_hour_lifetime():
    caches = FakePromptCache(Clock())
    caches.usage(b"/v1/messages", b"key", anthropic(1))
    assert caches.usage(b"/v1/messages", b"other", anthropic(2))["cache_read_input_tokens"] == 0
    hour = caches.usage(b"/v1/messages", b"third", anthropic(1, ttl="1h"))
    assert hour["cache_creation"]["ephemeral_1h_input_tokens"] > 0


def test_openai_caches_every_prefix_automatically_and_bills_no_write():
    caches = FakePromptCache(Clock())
    messages = [{"role": "system", "content": command_output(60)}, {"role": "user", "content": "hi"}]
    first = caches.usage(b"/v1/chat/completions", b"key", {"model": "gpt-4.1-mini", "messages": messages})
    assert first["prompt_tokens_details"] == {"cached_tokens": 0} and first["prompt_tokens"] > 1024
    messages += [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    second = caches.usage(b"/v1/chat/completions", b"key", {"model": "gpt-4.1-mini", "messages": messages})
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 1024 and cached % 128 == 0 and cached <= first["prompt_tokens"]
    items = {"model": "gpt-5.5", "input": messages}
    caches.usage(b"/v1/responses", b"key", items)
    assert caches.usage(b"/v1/responses", b"key", items)["input_tokens_details"]["cached_tokens"] >= 1024
    assert caches.usage(b"/v1/embeddings", b"key", items) is None


def test_the_default_replies_carry_the_usage_the_cache_billed():
    billed = FakePromptCache(Clock()).usage(b"/v1/messages", b"key", anthropic(1))
    for stream in (False, True):
        body = ujson.dumps(dict(anthropic(1), stream=stream)).encode()
        received = Received(b"POST", b"/v1/messages", [], body, 1, 1, None, usage=billed)
        reply = default_reply(received)
        if stream:
            start = next(e for e in reply.events if b"message_start" in e)
            usage = ujson.loads(start.split(b"data: ", 1)[1])["message"]["usage"]
        else:
            usage = reply.body["usage"]
        read = anthropic_usage({"usage": usage})
        assert (read.cache_read_tokens, read.cache_write_tokens, read.input_tokens) == (
            0, billed["cache_creation_input_tokens"], billed["input_tokens"])
