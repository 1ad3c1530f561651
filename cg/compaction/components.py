"""The compaction components: each rewrites one tool result's text, or leaves it alone.

A component's output must be a pure function of the text, the tool's name, its own parameters and
whether the same content came earlier in the request: the pipeline memoizes on exactly those (the
parameters through the config they are built from), and the provider's cache depends on the same
result getting the same bytes on every turn.
"""

import json
import re
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from typing import NoReturn, Protocol

import attrs

from cg.compaction.tokens import estimate_tokens
from cg.wire.markers import EXPAND_TOOL, marker


@attrs.frozen
class Outcome:
    """A component's new text; a lossy one also carries what expand must return, and its ID."""

    text: str
    original: bytes | None = None
    marker_id: str | None = None


@attrs.frozen
class Context:
    """What a component may know about the result it rewrites.

    `earlier` holds the marker IDs of the results before this one in the request; the memo keys on
    "is this result's ID in it", so that membership is all a component may read from it. The
    position is informational: the memo does not key on it.
    """

    tool_name: str | None
    message_index: int
    block_index: int | None
    part_index: int | None
    original: bytes
    marker_id: str
    earlier: AbstractSet[str]


class Component(Protocol):
    """A rewrite of one tool result; `apply` returns None for "no change"."""

    name: str
    lossy: bool

    def apply(self, text: str, ctx: Context) -> Outcome | None: ...


_ESCAPE_SEQUENCE = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]"  # CSI: colours, cursor movement, erasing
    r"|\x1b\][^\x07\x1b\n]*(?:\x07|\x1b\\)"  # OSC (titles, hyperlinks), ended by BEL or ST
    r"|\x1b[PX^_][^\x1b\n]*\x1b\\"  # DCS, SOS, PM and APC strings
    r"|\x1b[ -/]*[0-~]"  # single-character and character-set sequences (ESC 7, ESC ( B)
    r"|\x1b"  # a lone ESC that starts nothing: removed so a second pass finds nothing new
)
# What rewrites a line in place: carriage return, erase in line (EL), cursor to column 1 (CHA).
_CURSOR_CODE = re.compile(r"\x1b\[[0-2]?K|\x1b\[[01]?G")
_LINE_CONTROL = re.compile(r"(\r|\x1b\[[0-2]?K|\x1b\[[01]?G)")


class TextClean:
    """Terminal output as a terminal would finally show it: no escape codes, no progress redraws.

    Nothing else changes: CRLF endings, trailing spaces and blank lines stay (diffs, Markdown and
    Edit arguments depend on them).
    """

    name = "textclean"
    lossy = False

    def apply(self, text: str, ctx: Context) -> Outcome | None:
        if text.count("\r") != text.count("\r\n") or _CURSOR_CODE.search(text):
            cleaned = "\n".join(_clean_line(line) for line in text.split("\n"))
        elif "\x1b" in text:
            cleaned = _ESCAPE_SEQUENCE.sub("", text)
        else:
            return None
        return Outcome(cleaned) if cleaned != text else None


def _clean_line(line: str) -> str:
    ending = "\r" if line.endswith("\r") else ""  # a CRLF line ending stays
    line = line[: len(line) - len(ending)]
    if not _LINE_CONTROL.search(line):
        return _ESCAPE_SEQUENCE.sub("", line) + ending
    screen, column = "", 0
    for index, piece in enumerate(_LINE_CONTROL.split(line)):
        if index % 2 == 0:  # text: written over the line from the cursor on
            piece = _ESCAPE_SEQUENCE.sub("", piece)
            if piece:
                screen = screen[:column].ljust(column) + piece + screen[column + len(piece):]
                column += len(piece)
        elif piece == "\r" or piece.endswith("G"):
            column = 0
        elif piece in ("\x1b[K", "\x1b[0K"):
            screen = screen[:column]
        elif piece == "\x1b[1K":
            screen = " " * column + screen[column:]
        else:  # ESC [2K: the whole line (a later write still starts at the cursor)
            screen = ""
    return screen + ending


_JSON_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[^ \t\n\r"]+')


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON")


class JsonFormat:
    """A result that is one pretty-printed JSON object or array, without its insignificant whitespace.

    Token by token, so every number, escape and duplicate key keeps its exact spelling.
    """

    name = "jsonformat"
    lossy = False

    def apply(self, text: str, ctx: Context) -> Outcome | None:
        document = text.strip(" \t\n\r")
        if not document.startswith(("{", "[")):
            return None
        try:
            json.loads(document, parse_constant=_reject_constant)
        except (ValueError, RecursionError):
            return None
        compacted = "".join(_JSON_TOKEN.findall(document))
        return Outcome(compacted) if compacted != text else None


@attrs.frozen
class Dedup:
    """A result identical to an earlier one in the request: a one-line pointer to it.

    `min_tokens`: a smaller result stays (the pointer would save about nothing).
    """

    name = "dedup"
    lossy = True

    min_tokens: int = 100

    def apply(self, text: str, ctx: Context) -> Outcome | None:
        if ctx.marker_id not in ctx.earlier or estimate_tokens(text) < self.min_tokens:
            return None
        pointer = (
            f"[cg: identical to an earlier tool result in this conversation, {marker(ctx.marker_id)}; "
            f'call {EXPAND_TOOL} with id "{ctx.marker_id}" to read it here]'
        )
        return Outcome(pointer, ctx.original, ctx.marker_id)


_ERROR_WORDS = (r"\b(?i:error|errors|fail|fails|failed|failure|failures|fatal|panic|panicked|traceback)\b"
                r"|\w(?:Error|Exception)\b")
_ERROR_LINE = re.compile(rf"(?m)^(?:E\s.*|.*(?:{_ERROR_WORDS}).*)$")
# What every match of _ERROR_LINE holds, found fast in ASCII text: a word in the lowered text
# (case-sensitive literals let the regex engine skip ahead) or "E" and a space starting a line.
_ERROR_WORD_HINT = re.compile("error|fail|fatal|panic|traceback|exception")
_E_LINE_HINT = re.compile(r"\nE\s")


@attrs.frozen
class Offload:
    """A large result: its head and tail lines, error-like lines from between, and a notice saying
    how much is elided and how to get it back.

    Results of `keep_tools` and of at most `min_tokens` stay whole; lines kept are cut at
    `max_line_chars`.
    """

    name = "offload"
    lossy = True

    keep_tools: frozenset[str] = frozenset({"Read"})
    min_tokens: int = 2000
    head_lines: int = 40
    tail_lines: int = 20
    max_line_chars: int = 500
    max_error_lines: int = 20

    def apply(self, text: str, ctx: Context) -> Outcome | None:
        tokens = estimate_tokens(text)
        if ctx.tool_name in self.keep_tools or tokens <= self.min_tokens:
            return None
        lines = text.split("\n")
        middle_start = min(len(lines), self.head_lines)
        tail_start = max(middle_start, len(lines) - self.tail_lines)
        head = [self._cap(line) for line in lines[:middle_start]]
        tail = [self._cap(line) for line in lines[tail_start:]]
        errors = [
            f"{middle_start + number}: {self._cap(line)}"
            for number, line in _error_lines(lines[middle_start:tail_start], self.max_error_lines)
        ]
        kept = head + errors + tail
        elided_tokens = tokens - estimate_tokens("\n".join(kept))
        if elided_tokens < self.min_tokens // 2:
            return None  # not worth an expand call
        if tail_start > middle_start:
            what = f"lines {middle_start + 1}-{tail_start} of {len(lines)} elided"
        else:
            what = "long lines shortened"
        notice = (
            f"[cg: {what} (~{elided_tokens} tokens); the full output is {marker(ctx.marker_id)}: "
            f'call {EXPAND_TOOL} with id "{ctx.marker_id}" to read it.'
            + (" Error-like lines from the elided part follow, with their line numbers." if errors else "")
            + "]"
        )
        return Outcome("\n".join(head + [notice] + errors + tail), ctx.original, ctx.marker_id)

    def _cap(self, line: str) -> str:
        limit = self.max_line_chars
        if len(line) <= limit:
            return line
        return f"{line[:limit]} [cg: {len(line) - limit} more characters]"


def _error_line_matches(text: str) -> Iterator[re.Match[str]]:
    """What `_ERROR_LINE.finditer(text)` finds, several times faster on long ASCII logs.

    The pattern is tried only at the start of a line holding a hint (a match always holds one),
    in order; a line a match already covered (``E`` then a line break takes the next line too)
    is skipped. Text that is not ASCII goes the slow way: lowering it may change its length, and
    the pattern's case-insensitive words match a few non-ASCII letters (the Kelvin sign, long s).
    """
    if not text.isascii():
        yield from _ERROR_LINE.finditer(text)
        return
    starts = {text.rfind("\n", 0, hint.start()) + 1 for hint in _ERROR_WORD_HINT.finditer(text.lower())}
    starts.update(hint.start() + 1 for hint in _E_LINE_HINT.finditer(text))
    if text.startswith("E"):
        starts.add(0)
    covered = 0
    for start in sorted(starts):
        if start < covered:
            continue
        match = _ERROR_LINE.match(text, start)
        if match is not None:
            covered = match.end()
            yield match


def _error_lines(lines: list[str], limit: int) -> list[tuple[int, str]]:
    """The first `limit` lines that look like errors, failures or tracebacks, numbered from 1."""
    text = "\n".join(lines)
    found: list[tuple[int, str]] = []
    number, counted_to = 1, 0
    for match in _error_line_matches(text):
        if len(found) == limit:
            break
        number += text.count("\n", counted_to, match.start())
        counted_to = match.start()
        found.append((number, match[0]))
    return found


DEFAULT_COMPONENTS = (TextClean(), JsonFormat(), Dedup(), Offload())
