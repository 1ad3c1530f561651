"""cg's test kit: a scripted fake Anthropic/OpenAI API, and what tests build and check with it.

Like ``treq.testing`` it ships with the package, so the proxy's tests, its benchmarks and
downstream users all drive the same fake. Every name below but those of the last two modules is
importable from ``cg.testing`` itself; the modules say where each lives:

- ``cg.testing.fake``: ``FakeUpstream``, a real twisted.web server on a TCP port. Replies are
  queued in order (``enqueue``); when the queue is empty a default reply is derived from the
  request. Every request is recorded byte for byte (``received``, each a ``Received``) so tests
  can check what the proxy really forwarded; ``strict=True`` answers 400 where the real API
  would. ``main`` serves it from a process: ``python -m cg.testing --port 0`` prints
  ``listening <port>``.
- ``cg.testing.replies``: what the fake answers: ``JSONReply``, ``SSEReply`` (timed events, then
  a close, a reset or silence), ``Reset``, ``Stall``, ``Flood``; ``default_reply`` (shaped by the
  ``x-fake-*`` headers; ``FAKE_EXPAND_ID`` and ``FAKE_EXPAND_CALL_ID`` name the expand call it plays).
- ``cg.testing.builders``: the providers' documents and streams, byte for byte:
  ``anthropic_message``, ``anthropic_stream_events`` and its blocks (``anthropic_text_block``,
  ``anthropic_thinking_block``, ``anthropic_tool_block``, ``anthropic_expand_block``,
  ``anthropic_block_start``/``_delta``/``_stop``), ``openai_completion``,
  ``openai_stream_events``, ``responses_response``, ``responses_stream_events`` and their items
  (``responses_message``, ``responses_function_call``, ``responses_reasoning``), ``sse_event``;
  and what a client sends: ``claude_code_bytes``, ``command_output``.
- ``cg.testing.promptcache``: ``FakePromptCache``, the provider's prompt cache the fake bills
  usage from (``FakeUpstream(prompt_cache=True)``), on the fake's clock.
- ``cg.testing.validators``: why the real APIs would reject a request:
  ``anthropic_request_problems``, ``openai_request_problems``, ``responses_request_problems``.
- ``cg.testing.memory``: for tests without sockets, ``MemoryUpstream`` stands in for cg's
  upstream client itself: each request (``MemoryRequest``) waits for the test to answer it
  (``MemoryResponse``), on whatever clock the test runs.

And, imported from their modules only:

- ``cg.testing.loopback``: ``Loopback(clock)`` connects a ``MemoryReactorClock``'s TCP clients to
  what listens on it (``FakeUpstream.listen(clock, port)``, a whole cg), in memory: the real
  upstream client against the fake's ``Site``, pumped with ``pump()``, as treq's ``StubTreq`` does.
- ``cg.testing.tables`` (``table_rows``, ``names_in``) reads the state tables cg's sans-io machines
  keep in their docstrings, so a test can check each against the transitions the code runs.
"""

from __future__ import annotations

from cg.testing.builders import (
    HELLO,
    anthropic_block_delta,
    anthropic_block_start,
    anthropic_block_stop,
    anthropic_expand_block,
    anthropic_message,
    anthropic_stream_events,
    anthropic_text_block,
    anthropic_thinking_block,
    anthropic_tool_block,
    claude_code_bytes,
    command_output,
    openai_completion,
    openai_stream_events,
    responses_function_call,
    responses_message,
    responses_reasoning,
    responses_response,
    responses_stream_events,
    sse_event,
)
from cg.testing.fake import FakeUpstream, Received, main
from cg.testing.memory import MemoryRequest, MemoryResponse, MemoryUpstream
from cg.testing.promptcache import OUTPUT_TOKENS, FakePromptCache
from cg.testing.replies import (
    FAKE_EXPAND_CALL_ID,
    FAKE_EXPAND_ID,
    Flood,
    HeaderPairs,
    JSONReply,
    Reply,
    Reset,
    SSEReply,
    Stall,
    _fake_texts,  # noqa: F401 -- the benchmarks' fragments of HELLO, as the default reply streams them
    default_reply,
)
from cg.testing.validators import (
    anthropic_request_problems,
    openai_request_problems,
    responses_request_problems,
)

__all__ = [
    "FAKE_EXPAND_CALL_ID",
    "FAKE_EXPAND_ID",
    "HELLO",
    "FakePromptCache",
    "FakeUpstream",
    "Flood",
    "HeaderPairs",
    "JSONReply",
    "MemoryRequest",
    "MemoryResponse",
    "MemoryUpstream",
    "OUTPUT_TOKENS",
    "Received",
    "Reply",
    "Reset",
    "SSEReply",
    "Stall",
    "anthropic_block_delta",
    "anthropic_block_start",
    "anthropic_block_stop",
    "anthropic_expand_block",
    "anthropic_message",
    "anthropic_request_problems",
    "anthropic_stream_events",
    "anthropic_text_block",
    "anthropic_thinking_block",
    "anthropic_tool_block",
    "claude_code_bytes",
    "command_output",
    "default_reply",
    "main",
    "openai_completion",
    "openai_request_problems",
    "openai_stream_events",
    "responses_function_call",
    "responses_message",
    "responses_reasoning",
    "responses_request_problems",
    "responses_response",
    "responses_stream_events",
    "sse_event",
]
