"""How the exchange speaks each provider API: one adapter per dialect, written against `Dialect`.

The exchange never branches on a dialect: it asks the adapter how to read a response's expand
calls (a JSON document, or a stream through the adapter's `StreamInspector`), how to build the
continuation request, how to merge a JSON loop's rounds into one answer, what each round billed,
and how an error reads. A dialect whose streams cg cannot inspect returns no inspector: those
streams pass through. Each adapter composes its dialect's parts of the layers below: its body
shape (`cg.wire.dialect.Shape`), its JSON expand loop (`cg.stream.continuation.MESSAGES_LOOP`
and `CHAT_LOOP`, `cg.stream.responses.RESPONSES_LOOP`), its usage meter (`cg.stream.usage`) and
its stream inspector (`cg.stream.inspector`, `cg.stream.chat_inspector`,
`cg.stream.responses_inspector`).
"""

from __future__ import annotations

from typing import Protocol

from cg.stream.chat_inspector import ChatInspector
from cg.stream.continuation import CHAT_LOOP, MESSAGES_LOOP, ExpandCall, ExpandLoop, Resolution
from cg.stream.hidden import HiddenTurn, Shown
from cg.stream.inspector import PING, Inspector, ReleaseReason, Step
from cg.stream.responses import RESPONSES_LOOP
from cg.stream.responses_inspector import ResponsesInspector
from cg.stream.usage import ResponseUsage, Usage
from cg.wire import dialect
from cg.wire.dialect import CHAT_SHAPE, MESSAGES_SHAPE, RESPONSES_SHAPE, Shape
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

    def shown(self) -> Shown | None: ...


class Dialect(Protocol):
    """What the exchange asks of a provider API."""

    name: str
    shape: Shape  # its bodies' shape
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

    def continuation(self, forwarded: bytes, assistant: dict[str, object], calls: list[ExpandCall],
                     resolutions: Resolutions, stream: bool | None) -> tuple[bytes, HiddenTurn | None]:
        """The next round's request: `forwarded` byte for byte, then the turn and its answers; and the
        part of that turn the client never sees, where a later request gets it back before a
        continuation's thinking (`cg.stream.hidden`; None in a dialect without one)."""
        ...

    def merge(self, rounds: list[dict[str, object]]) -> dict[str, object]:
        """The one JSON response the client gets for several rounds."""
        ...

    def billed(self, rounds: list[dict[str, object]]) -> list[Usage]:
        """What each JSON round was billed."""
        ...

    def shown(self, rounds: list[dict[str, object]]) -> Shown | None:
        """What the client is shown of a JSON loop's rounds, merged; None in a dialect without
        hidden turns."""
        ...


class _JSONLoop:
    """The parts every dialect composes alike: its shape's name and errors, its usage meter, and
    its JSON expand loop (`cg.stream.continuation.ExpandLoop`)."""

    keepalive = b": keepalive\n\n"  # an SSE comment

    def __init__(self, shape: Shape, loop: ExpandLoop) -> None:
        self.shape, self.name, self._loop = shape, shape.name, loop

    def error_body(self, status: int, message: str) -> bytes:
        return dialect.error_body(self.name, status, message)

    def usage_meter(self, stream: bool) -> ResponseUsage:
        return ResponseUsage(self.shape, stream)

    def stream_inspector(self, max_held: int, max_rounds: int, hide_usage: bool = False) -> StreamInspector | None:
        return None

    def lone_expand_calls(self, response: dict[str, object]) -> list[ExpandCall] | None:
        return self._loop.lone_expand_calls(response)

    def continuation(self, forwarded: bytes, assistant: dict[str, object], calls: list[ExpandCall],
                     resolutions: Resolutions, stream: bool | None) -> tuple[bytes, HiddenTurn | None]:
        return self._loop.continuation_body(forwarded, assistant, calls, resolutions, stream), None

    def merge(self, rounds: list[dict[str, object]]) -> dict[str, object]:
        return self._loop.merge(rounds)

    def billed(self, rounds: list[dict[str, object]]) -> list[Usage]:
        return self._loop.billed(rounds)

    def shown(self, rounds: list[dict[str, object]]) -> Shown | None:
        return None


class _AnthropicMessages(_JSONLoop):
    """Anthropic Messages: JSON, and streams through the incremental inspector."""

    keepalive = PING

    def stream_inspector(self, max_held: int, max_rounds: int, hide_usage: bool = False) -> StreamInspector | None:
        return Inspector(max_held=max_held, max_rounds=max_rounds)

    def continuation(self, forwarded: bytes, assistant: dict[str, object], calls: list[ExpandCall],
                     resolutions: Resolutions, stream: bool | None) -> tuple[bytes, HiddenTurn | None]:
        return MESSAGES_LOOP.continuation(forwarded, assistant, calls, resolutions, stream)

    def shown(self, rounds: list[dict[str, object]]) -> Shown | None:
        return MESSAGES_LOOP.shown(rounds)


class _OpenAIChat(_JSONLoop):
    """OpenAI chat completions: JSON, and streams through the chat inspector."""

    def stream_inspector(self, max_held: int, max_rounds: int, hide_usage: bool = False) -> StreamInspector | None:
        return ChatInspector(max_held=max_held, max_rounds=max_rounds, hide_usage=hide_usage)


class _OpenAIResponses(_JSONLoop):
    """The OpenAI Responses API: output items, not a message (`cg.stream.responses`), and streams
    through the Responses inspector."""

    def stream_inspector(self, max_held: int, max_rounds: int, hide_usage: bool = False) -> StreamInspector | None:
        return ResponsesInspector(max_held=max_held, max_rounds=max_rounds)


ANTHROPIC_MESSAGES: Dialect = _AnthropicMessages(MESSAGES_SHAPE, MESSAGES_LOOP)
OPENAI_CHAT: Dialect = _OpenAIChat(CHAT_SHAPE, CHAT_LOOP)
OPENAI_RESPONSES: Dialect = _OpenAIResponses(RESPONSES_SHAPE, RESPONSES_LOOP)
_ADAPTERS = {adapter.name: adapter for adapter in (ANTHROPIC_MESSAGES, OPENAI_CHAT, OPENAI_RESPONSES)}


def for_dialect(name: str | Shape) -> Dialect:
    """The adapter for a body shape, or a dialect name (`cg.wire.dialect`: a route's, or a response
    shape's); Anthropic's for a name it does not know, as `cg.wire.dialect.error_body` does."""
    return _ADAPTERS.get(name if isinstance(name, str) else name.name, ANTHROPIC_MESSAGES)
