"""A strict checker of an Anthropic Messages stream as a client receives it.

``check_anthropic_stream(data)`` returns the problems it finds (an empty list: the stream is fine).
It is stricter than every client (the rules Claude Code and the SDKs enforce, verified by running them), so a
stream it passes is accepted by Claude Code, the Python SDK's accumulator (dense indices) and the JS
SDK alike:

- every event has an ``event:`` line whose name equals its data's ``type``; data is a JSON object;
- exactly one ``message_start``, first (only comments may precede it);
- blocks: indices 0, 1, 2… dense and strictly increasing, one block open at a time, every
  ``content_block_start`` before its deltas and stop, every started block stopped;
- delta types fit their blocks: ``text_delta``/``citations_delta`` on text, ``input_json_delta`` on
  tool_use (and server/mcp tool use), ``thinking_delta``/``signature_delta`` on thinking,
  ``compaction_delta`` on compaction; none on blocks complete in their start (redacted thinking,
  tool results); a block type this module does not know takes any delta;
- a tool_use's input travels in ``input_json_delta``: the concatenation parses as a JSON object, and
  ``content_block_start`` carries no input of its own (clients ignore it);
- exactly one ``message_delta``, after the last block, then ``message_stop``, and nothing after it
  but pings and comments;
- no ``error`` event; no incomplete event at the end.

Shipped for users' debugging: ``python -m cg.stream.streamcheck FILE`` (``-`` for stdin) prints the
problems and exits 1 if there are any. Pure code otherwise: bytes in, strings out.
"""

from __future__ import annotations

import argparse
import sys

import ujson

from cg.wire.sse import SSEParser

__all__ = ["check_anthropic_stream", "main"]

_TOOL_BLOCKS = frozenset({"tool_use", "server_tool_use", "mcp_tool_use"})
_DELTAS = {
    "text": frozenset({"text_delta", "citations_delta"}),
    "thinking": frozenset({"thinking_delta", "signature_delta"}),
    "redacted_thinking": frozenset(),
    "compaction": frozenset({"compaction_delta"}),
    **{kind: frozenset({"input_json_delta"}) for kind in _TOOL_BLOCKS},
}
_DELTA_FIELDS: dict[object, str] = {  # looked up by whatever JSON value the delta's type is
    "text_delta": "text",
    "thinking_delta": "thinking",
    "signature_delta": "signature",
    "input_json_delta": "partial_json",
}
_BLOCK_EVENTS = frozenset({"content_block_start", "content_block_delta", "content_block_stop"})


def _allowed(block_type: str) -> frozenset[str] | None:
    """The delta types a block takes; None for any (a block type not known here)."""
    if block_type in _DELTAS:
        return _DELTAS[block_type]
    if block_type.endswith("_result"):  # web_search_tool_result, mcp_tool_result…
        return frozenset()  # complete in its start event
    return None


class _Block:
    __slots__ = ("index", "type", "json", "open")

    def __init__(self, index: int, type_: str) -> None:
        self.index = index
        self.type = type_
        self.json: list[str] = []
        self.open = True


class _Checker:
    def __init__(self) -> None:
        self.problems: list[str] = []
        self.started = False
        self.early = False  # an event came before message_start (reported once)
        self.content = False  # a block or message_delta seen
        self.deltas = 0  # message_delta events
        self.stopped = False  # message_stop seen
        self.next_index = 0
        self.blocks: dict[int, _Block] = {}
        self.open: _Block | None = None

    def problem(self, n: int, name: str | None, text: str) -> None:
        self.problems.append(f"event {n} ({name}): {text}")

    def event(self, n: int, name: str | None, data: bytes) -> None:
        if name is None:
            if data:
                self.problem(n, name, "no event: line (the SDKs drop it)")
            return  # a comment or a stray blank line
        try:
            doc = ujson.loads(data)
        except (ValueError, TypeError, OverflowError):
            self.problem(n, name, "data is not JSON")
            return
        if not isinstance(doc, dict):
            self.problem(n, name, "data is not a JSON object")
            return
        if doc.get("type") != name:
            self.problem(n, name, f"event name does not match data type {doc.get('type')!r}")
        if self.stopped and name != "ping":
            self.problem(n, name, "event after message_stop")
        if name == "ping":
            return
        if name == "error":
            where = "after content" if self.content else "before content"
            self.problem(n, name, f"error event {where}: {doc.get('error')!r}")
            return
        if name == "message_start":
            if self.started:
                self.problem(n, name, "second message_start")
            elif self.content:
                self.problem(n, name, "message_start is not first")
            self.started = True
            message = doc.get("message")
            if not isinstance(message, dict) or message.get("content") not in ([], None):
                self.problem(n, name, "message_start without an empty message.content")
            return
        if not self.started and not self.early:
            self.problem(n, name, "before message_start")
            self.early = True  # report it once
        if name in _BLOCK_EVENTS:
            self.block_event(n, name, doc)
        elif name == "message_delta":
            self.content = True
            self.deltas += 1
            if self.deltas > 1:
                self.problem(n, name, "more than one message_delta")
            if self.open is not None:
                self.problem(n, name, f"message_delta while block {self.open.index} is open")
            if not isinstance(doc.get("delta"), dict) or not isinstance(doc.get("usage"), dict):
                self.problem(n, name, "message_delta without delta and usage objects")
        elif name == "message_stop":
            if not self.deltas:
                self.problem(n, name, "message_stop without message_delta")
            self.stopped = True

    def block_event(self, n: int, name: str, doc: dict[str, object]) -> None:
        self.content = True
        index = doc.get("index")
        if not isinstance(index, int) or isinstance(index, bool):
            self.problem(n, name, f"index is not an integer: {index!r}")
            return
        if self.deltas:
            self.problem(n, name, "block event after message_delta")
        if name == "content_block_start":
            self.start(n, name, index, doc)
            return
        block = self.blocks.get(index)
        if block is None:
            self.problem(n, name, f"block {index} was never started")
            return
        if not block.open:
            self.problem(n, name, f"block {index} is already stopped")
            return
        if name == "content_block_stop":
            block.open = False
            self.open = None
            if block.type in _TOOL_BLOCKS and block.json:
                text = "".join(block.json)
                try:
                    value = ujson.loads(text)
                except (ValueError, TypeError, OverflowError):
                    value = None
                if not isinstance(value, dict):
                    self.problem(n, name, f"{block.type} input is not a JSON object: {text[:80]!r}")
            return
        delta = doc.get("delta")
        if not isinstance(delta, dict):
            delta = {}
        kind = delta.get("type")
        allowed = _allowed(block.type)
        if allowed is not None and kind not in allowed:
            self.problem(n, name, f"{kind} on a {block.type} block {index}")
            return
        field = _DELTA_FIELDS.get(kind)
        if field is not None and not isinstance(delta.get(field), str):
            self.problem(n, name, f"{kind} without a string {field}")
        elif kind == "input_json_delta":
            block.json.append(delta["partial_json"])

    def start(self, n: int, name: str, index: int, doc: dict[str, object]) -> None:
        if index != self.next_index:
            self.problem(n, name, f"index {index}, expected {self.next_index} (dense, in arrival order)")
        if index in self.blocks:
            self.problem(n, name, f"block {index} started twice")
        if self.open is not None:
            self.problem(n, name, f"block {index} started while block {self.open.index} is open")
        content_block = doc.get("content_block")
        if not isinstance(content_block, dict) or not isinstance(content_block.get("type"), str):
            self.problem(n, name, "content_block without a type")
            content_block = {"type": "?"}
        block = self.blocks[index] = _Block(index, content_block["type"])
        self.open = block
        self.next_index = max(self.next_index, index + 1)
        if block.type in _TOOL_BLOCKS and content_block.get("input") not in ({}, None):
            self.problem(n, name, f"{block.type} input given in content_block_start (clients ignore it)")

    def finish(self) -> None:
        if not self.started:
            self.problems.append("no message_start")
        for block in self.blocks.values():
            if block.open:
                self.problems.append(f"block {block.index} never stopped")
        if not self.deltas:
            self.problems.append("no message_delta")
        if not self.stopped:
            self.problems.append("no message_stop")


def check_anthropic_stream(data: bytes) -> list[str]:
    """The problems of a client-side Anthropic stream (see the module docstring); [] when OK."""
    parser = SSEParser()
    events = parser.feed(data) + parser.flush()
    tail = parser.close()
    checker = _Checker()
    for n, event in enumerate(events):
        checker.event(n, event.name, event.data)
    if tail.strip():
        checker.problems.append(f"incomplete event at the end: {tail[:80]!r}")
    checker.finish()
    return checker.problems


def main(argv: list[str] | None = None) -> int:
    """``python -m cg.stream.streamcheck FILE|-``: print the problems of a captured stream."""
    parser = argparse.ArgumentParser(
        prog="python -m cg.stream.streamcheck",
        description="Check a recorded Anthropic Messages stream (the raw SSE bytes a client "
        "received) the way the strictest clients parse it. Prints each problem, or 'ok'; exits "
        "0 when the stream is fine, 1 when it has problems, 2 when it cannot be read.",
    )
    parser.add_argument("file", metavar="FILE", help="the recorded stream; - reads standard input")
    args = parser.parse_args(argv)
    try:
        if args.file == "-":
            data = sys.stdin.buffer.read()
        else:
            with open(args.file, "rb") as f:
                data = f.read()
    except OSError as e:
        print(f"{parser.prog}: cannot read {args.file}: {e.strerror or e}", file=sys.stderr)
        return 2
    problems = check_anthropic_stream(data)
    for problem in problems:
        print(problem)
    if not problems:
        print("ok")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
