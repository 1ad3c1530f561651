"""How the exchange speaks each provider API: one adapter per dialect, written against `Dialect`.

The exchange never branches on a dialect: it asks the adapter how to read a response's expand
calls (a JSON document, or a stream through the adapter's `StreamInspector`), how to build the
continuation request, how to merge a JSON loop's rounds into one answer, what each round billed,
and how an error reads. A dialect whose streams cg cannot inspect returns no inspector: those
streams pass through. Anthropic Messages and chat completions delegate to `cg.stream.continuation`,
`cg.stream.inspector` and `cg.stream.chat_inspector`; the Responses API to `cg.stream.responses`
and `cg.stream.responses_inspector`.
"""

from __future__ import annotations

from typing import Protocol

from cg.stream import continuation, responses
from cg.stream.chat_inspector import ChatInspector
from cg.stream.continuation import ExpandCall, Resolution
from cg.stream.inspector import PING, Inspector, ReleaseReason, Step
from cg.stream.responses_inspector import ResponsesInspector
from cg.stream.usage import ResponseUsage, Usage
from cg.wire import dialect
from cg.wire.sse import Event

__all__ = ["ANTHROPIC_MESSAGES", "OPENAI_CHAT", "OPENAI_RESPONSES", "Dialect", "StreamInspector", "for_dialect"]

Resolutions = dict[str, bytes | Resolution]


class StreamInspector(Protocol):
    """One client response stream across its rounds (`cg.stream.inspector.Inspector`'s contract)."""

    @property
    def rounds(self) -> int: ...  # continuations begun

    @property
    def held_events(self) -> int: ...

    @property
    def released(self) -> ReleaseReason | None: ...  # why the hold was released, if it was

    @property
    def spliced(self) -> bool: ...

    @property
    def calls(self) -> list[ExpandCall]: ...  # the decided round's expand calls

    @property
    def committed(self) -> bool: ...

    @property
    def billed(self) -> list[Usage]: ...

    def feed(self, event: Event) -> Step: ...

    def end(self, complete: bool, tail: bytes = b"") -> Step: ...

    def begin_continuation(self) -> None: ...

    def release(self) -> bytes: ...

    def assistant_message(self) -> dict[str, object]: ...


class Dialect(Protocol):
    """What the exchange asks of a provider API."""

    name: str
    keepalive: bytes  # what a stream's client may get at any moment, to keep it from timing out

    def error_body(self, status: int, message: str) -> bytes:
        """An error in the API's own shape, so its SDK raises cleanly."""
        ...

    def usage_meter(self, stream: bool) -> ResponseUsage:
        """Reads billed usage off a response passed through."""
        ...

    def stream_inspector(self, max_held: int, max_rounds: int, hide_usage: bool = False) -> StreamInspector | None:
        """An inspector for a stream where cg injected the expand tool; None: it passes through.

        `hide_usage`: cg asked for the stream's usage (the client did not): keep it from the client."""
        ...

    def lone_expand_calls(self, response: dict[str, object]) -> list[ExpandCall] | None:
        """The expand calls of a JSON response whose tool calls are all cg's; else None."""
        ...

    def continuation_body(self, forwarded: bytes, assistant: dict[str, object], calls: list[ExpandCall],
                          resolutions: Resolutions, stream: bool | None) -> bytes:
        """The next round's request: `forwarded` byte for byte, then the turn and its answers."""
        ...

    def merge(self, rounds: list[dict[str, object]]) -> dict[str, object]:
        """The one JSON response the client gets for several rounds."""
        ...

    def billed(self, rounds: list[dict[str, object]]) -> list[Usage]:
        """What each JSON round was billed."""
        ...


class _JSONLoop:
    """The JSON expand loop and errors, the same for every dialect `cg.stream.continuation` knows."""

    keepalive = b": keepalive\n\n"  # an SSE comment

    def __init__(self, name: str) -> None:
        self.name = name

    def error_body(self, status: int, message: str) -> bytes:
        return dialect.error_body(self.name, status, message)

    def usage_meter(self, stream: bool) -> ResponseUsage:
        return ResponseUsage(self.name, stream)

    def stream_inspector(self, max_held: int, max_rounds: int, hide_usage: bool = False) -> StreamInspector | None:
        return None

    def lone_expand_calls(self, response: dict[str, object]) -> list[ExpandCall] | None:
        return continuation.lone_expand_calls(response, self.name)

    def continuation_body(self, forwarded: bytes, assistant: dict[str, object], calls: list[ExpandCall],
                          resolutions: Resolutions, stream: bool | None) -> bytes:
        return continuation.continuation_body(forwarded, assistant, calls, resolutions, self.name, stream=stream)

    def merge(self, rounds: list[dict[str, object]]) -> dict[str, object]:
        return continuation.merge(rounds, self.name)

    def billed(self, rounds: list[dict[str, object]]) -> list[Usage]:
        return continuation.billed(rounds, self.name)


class _AnthropicMessages(_JSONLoop):
    """Anthropic Messages: JSON, and streams through the incremental inspector."""

    keepalive = PING

    def stream_inspector(self, max_held: int, max_rounds: int, hide_usage: bool = False) -> StreamInspector | None:
        return Inspector(max_held=max_held, max_rounds=max_rounds)


class _OpenAIChat(_JSONLoop):
    """OpenAI chat completions: JSON, and streams through the chat inspector."""

    def stream_inspector(self, max_held: int, max_rounds: int, hide_usage: bool = False) -> StreamInspector | None:
        return ChatInspector(max_held=max_held, max_rounds=max_rounds, hide_usage=hide_usage)


class _OpenAIResponses(_JSONLoop):
    """The OpenAI Responses API: output items, not a message (`cg.stream.responses`), and streams
    through the Responses inspector."""

    def stream_inspector(self, max_held: int, max_rounds: int, hide_usage: bool = False) -> StreamInspector | None:
        return ResponsesInspector(max_held=max_held, max_rounds=max_rounds)

    def lone_expand_calls(self, response: dict[str, object]) -> list[ExpandCall] | None:
        return responses.lone_expand_calls(response)

    def continuation_body(self, forwarded: bytes, assistant: dict[str, object], calls: list[ExpandCall],
                          resolutions: Resolutions, stream: bool | None) -> bytes:
        return responses.continuation_body(forwarded, assistant, calls, resolutions, stream)

    def merge(self, rounds: list[dict[str, object]]) -> dict[str, object]:
        return responses.merge(rounds)

    def billed(self, rounds: list[dict[str, object]]) -> list[Usage]:
        return responses.billed(rounds)


ANTHROPIC_MESSAGES: Dialect = _AnthropicMessages(dialect.ANTHROPIC)
OPENAI_CHAT: Dialect = _OpenAIChat(dialect.OPENAI)
OPENAI_RESPONSES: Dialect = _OpenAIResponses(dialect.RESPONSES)
_ADAPTERS = {adapter.name: adapter for adapter in (ANTHROPIC_MESSAGES, OPENAI_CHAT, OPENAI_RESPONSES)}


def for_dialect(name: str) -> Dialect:
    """The adapter for a dialect name (`cg.wire.dialect`); Anthropic's shape for one it does not know,
    as `cg.wire.dialect.error_body` does."""
    return _ADAPTERS.get(name, ANTHROPIC_MESSAGES)
