"""The compaction components: each rewrites one tool result's text, or leaves it alone.

A component's output must be a pure function of the text, the tool's name, its own parameters and
whether the same content came earlier in the request: the pipeline memoizes on exactly those (the
parameters through the config they are built from), and the provider's cache depends on the same
result getting the same bytes on every turn.
"""

import itertools
import json
import os
import re
from collections import Counter
from collections.abc import Iterable, Iterator
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
        if "\x1b" not in text and "\r" not in text:
            return None  # most results: two C-speed searches instead of two counts and a regex
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
_E_LINE_HINT = re.compile(r"\n(?=E\s)")  # a lookahead: "\nE\n" must not hide the next line's "\n"
# A test run's lines that say what failed, or how many passed and failed: pytest, jest, go test,
# cargo test, mocha and TAP. Failures are kept before totals when there are more than fit. Each
# match starts at the newline before its line, a literal the regex engine finds fast (a line
# start, "^", is tried at every character): it runs over every offloaded result.
_TEST_LINE = re.compile(
    r"(?m)\n(?P<line>(?P<failure>(?:FAILED|ERROR)[ \t]+\S.*"  # pytest's short test summary
    r"|FAIL[ \t]+\S.*"  # jest's failed suite, go's failed package
    r"|(?:    )*--- FAIL: \S.*"  # go's failed test (a subtest: 4 spaces a level)
    r"|test \S+ \.\.\. FAILED.*|test result: FAILED\..*"  # cargo's failed test, failed test binary
    r"|not ok \d+.*"  # TAP
    r"|  \u25cf \S.*)"  # jest's failed test title
    r"|(?P<totals>(?:=+ )?(?:(?:\d+ [a-z]+,? )+|no tests ran )in \d+(?:\.\d+)?s\b.*"  # pytest
    r"|(?:Tests|Test Suites|Snapshots):[ \t]+.*\btotal.*"  # jest
    r"|ok[ \t]+\S+[ \t]+(?:\(cached\)|\d+(?:\.\d+)?s\b).*"  # go's passed package
    r"|test result: .*"  # cargo
    r"|  \d+ (?:passing|failing|pending)\b.*))$"  # mocha
)
# A unified diff's file headers: git's, else a ---/+++ pair (diff -u, svn, hg).
_DIFF_GIT_HEADER = re.compile(r"(?m)^diff --git (.*)$")
_DIFF_PAIR_HEADER = re.compile(r"(?m)^--- (.*)\n\+\+\+ (.*)$")
_DIFF_HEADER_START = re.compile(r"\n(?:diff --git |\+\+\+ )")  # one of them after the first line: fast to rule out
# A listing's line: one path with a directory part and a letter in it, no spaces (find, git
# ls-files, fd, rg --files, Glob); the group is its directory, up to the last "/".
_PATH_LINE = re.compile(r"(?m)^(?=[^\n]*[^\W\d_])((?:[\w.@+~%()\[\]-]*/)+)[\w.@+~%()\[\]-]*$")
# `ls -R`: a directory's header ("./src:"), then its entries, a blank line before the next.
_LS_R_HEADER = re.compile(r"(?m)^([^\s:][^\n:]*):$")
_MAX_TEST_LINES = 20  # test-result lines kept from the elided part, besides the error-like ones
_MAX_LIST_CHARS = 800  # a summary's list of files or directories is cut after about this much
_TOP_DIRECTORIES = 5  # a listing's summary names this many of its top directories


@attrs.frozen
class Offload:
    """A large result: its head and tail lines, a notice saying how much is elided and how to get
    it back, a summary of what the elided part holds, and its key lines.

    The summary and key lines are what the model needs to go on without expanding in the common
    case (what failed, how many files, where): a diff's files in the elided part, a listing's
    paths counted by directory, a test run's failures and totals, error-like lines. Each is
    found by a few regular-expression scans, so the excerpt stays a pure function of the text.
    Results of `keep_tools` and of at most `min_tokens` stay whole; lines kept are cut at
    `max_line_chars`.
    """

    name = "offload"
    lossy = True

    keep_tools: frozenset[str] = frozenset({"Read"})
    min_tokens: int = 2000
    head_lines: int = 20
    tail_lines: int = 10
    max_line_chars: int = 500
    max_error_lines: int = 20

    def apply(self, text: str, ctx: Context) -> Outcome | None:
        if ctx.tool_name in self.keep_tools:
            return None  # before the estimate: a file a kept tool read can be the longest text
        tokens = estimate_tokens(text)
        if tokens <= self.min_tokens:
            return None
        lines = text.split("\n")
        middle_start = min(len(lines), self.head_lines)
        tail_start = max(middle_start, len(lines) - self.tail_lines)
        head = [self._cap(line) for line in lines[:middle_start]]
        tail = [self._cap(line) for line in lines[tail_start:]]
        summary: list[str] = []
        what_follows = ""
        if tail_start > middle_start:
            what = f"lines {middle_start + 1}-{tail_start} of {len(lines)} elided"
            elided_from = sum(map(len, lines[:middle_start])) + middle_start
            elided_to = elided_from + sum(map(len, lines[middle_start:tail_start])) + tail_start - middle_start - 1
            # A diff's or a listing's summary says what its elided part holds; their error-like
            # lines would be code and file names, not failures.
            files = _diff_summary(text, elided_from, elided_to) or _listing_summary(text, lines)
            if files is not None:
                summary = [files]
            else:
                summary, what_follows = self._key_lines(text[elided_from:elided_to], middle_start)
        else:
            what = "long lines shortened"
        kept = head + summary + tail
        elided_tokens = tokens - estimate_tokens("\n".join(kept))
        if elided_tokens < self.min_tokens // 2:
            return None  # not worth an expand call
        notice = (
            f"[cg: {what} (~{elided_tokens} tokens); the full output is {marker(ctx.marker_id)}: "
            f'call {EXPAND_TOOL} with id "{ctx.marker_id}" to read it.{what_follows}]'
        )
        return Outcome("\n".join(head + [notice] + summary + tail), ctx.original, ctx.marker_id)

    def _key_lines(self, middle: str, lines_before: int) -> tuple[list[str], str]:
        """The elided part's error-like and test-result lines in order, numbered as in the whole
        text, after a count of the test-result lines that did not fit; and the notice's words."""
        errors = _error_lines(middle, self.max_error_lines)
        tests, unshown = _test_lines(middle, _MAX_TEST_LINES)
        more_tests = set(tests) - set(errors)
        kept = [f"[cg: {unshown} more test-result lines in the elided part are not shown]"] if unshown else []
        kept += [f"{lines_before + number}: {self._cap(line)}" for number, line in sorted({*errors, *tests})]
        kinds = {(True, True): "Test-result and error-like", (True, False): "Test-result",
                 (False, True): "Error-like"}.get((bool(more_tests), bool(errors)))
        return kept, f" {kinds} lines from the elided part follow, with their line numbers." if kinds else ""

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


def _numbered(matches: Iterable[re.Match[str]], text: str) -> Iterator[tuple[int, re.Match[str]]]:
    """Each of `matches` (in `text`, in order) with 1 + the newlines before it: the number of the
    line it starts on."""
    number, counted_to = 1, 0
    for match in matches:
        number += text.count("\n", counted_to, match.start())
        counted_to = match.start()
        yield number, match


def _error_lines(text: str, limit: int) -> list[tuple[int, str]]:
    """The first `limit` lines that look like errors, failures or tracebacks, numbered from 1."""
    found = _numbered(_error_line_matches(text), text)
    return [(number, match[0]) for number, match in itertools.islice(found, limit)]


def _test_lines(text: str, limit: int) -> tuple[list[tuple[int, str]], int]:
    """A test run's first failure lines and its last totals (a run's own come last; a quarter of
    `limit` is theirs however many failures), `limit` at most, numbered from 1; and how many
    more there are."""
    failures: list[tuple[int, str]] = []
    totals: list[tuple[int, str]] = []
    found = 0
    lined = "\n" + text  # a match starts at its line's newline
    for number, match in _numbered(_TEST_LINE.finditer(lined), lined):
        found += 1
        if match["failure"] is None:
            totals.append((number, match["line"]))
        elif len(failures) < limit:
            failures.append((number, match["line"]))
    shown_totals = min(len(totals), max(limit - len(failures), limit // 4))
    shown = failures[: limit - shown_totals] + totals[len(totals) - shown_totals:]
    return shown, found - len(shown)


def _listed(names: list[str]) -> str:
    """`names` joined by commas, cut at about `_MAX_LIST_CHARS` with a count of the rest."""
    shown: list[str] = []
    length = 0
    for name in names:
        if shown and length + len(name) > _MAX_LIST_CHARS:
            return ", ".join(shown) + f", and {len(names) - len(shown)} more"
        shown.append(name)
        length += len(name) + 2
    return ", ".join(shown)


def _diff_summary(text: str, elided_from: int, elided_to: int) -> str | None:
    """The files of a unified diff whose headers fall in the elided part, each with its lines
    added and removed; None if there are none."""
    if not _DIFF_HEADER_START.search(text):
        return None
    headers = [(match.start(), _diff_git_name(match[1])) for match in _DIFF_GIT_HEADER.finditer(text)]
    if not headers:
        headers = [(match.start(), _diff_pair_name(match[1], match[2])) for match in _DIFF_PAIR_HEADER.finditer(text)]
    files = []
    for index, (start, name) in enumerate(headers):
        if elided_from <= start < elided_to:
            end = headers[index + 1][0] if index + 1 < len(headers) else len(text)
            hunks = text.find("\n@@", start, end)
            if hunks < 0:  # a rename, a mode change, a binary file: no lines
                files.append(name)
            else:
                added, removed = text.count("\n+", hunks, end), text.count("\n-", hunks, end)
                files.append(f"{name} +{added} -{removed}")
    if not files:
        return None
    return (f"[cg: the elided part holds {len(files)} of the diff's {len(headers)} files (lines added, removed): "
            f"{_listed(files)}]")


def _diff_git_name(names: str) -> str:
    """The file of a `diff --git a/X b/Y` header: X when X is Y, else "X -> Y" (a rename); the
    header as it is when it has no such prefixes (diff.noprefix, quoted names)."""
    if not names.startswith("a/") or " b/" not in names:
        return names
    old, new = names[2:].split(" b/", 1)
    return old if old == new else f"{old} -> {new}"


def _diff_pair_name(old: str, new: str) -> str:
    """The file of a `--- old` / `+++ new` pair: the new name (the old one for a deletion),
    without its timestamp or `b/`."""
    old, new = old.split("\t", 1)[0], new.split("\t", 1)[0]
    name = old if new == "/dev/null" else new
    return name[2:] if name.startswith(("a/", "b/")) else name


def _listing_summary(text: str, lines: list[str]) -> str | None:
    """How many paths a listing holds, in how many directories, and under which of its top
    directories most are; None if the text is not a listing."""
    if text.count(" ", 0, 1 << 16) * 10 > len(lines) or text.count(" ") * 10 > len(lines):
        return None  # spaces on more than a tenth of the lines: prose, code, a log (most fail in the first 64 KiB)
    entries = len(lines) - lines.count("")
    per_directory: Counter[str] = Counter(_PATH_LINE.findall(text) if text.count("/") * 2 >= entries else ())
    if per_directory.total() * 10 < entries * 9:  # not nine lines in ten a path: maybe `ls -R`
        per_directory = _ls_r_directories(text, lines)
        if not per_directory:
            return None
    paths = per_directory.total()
    common = os.path.commonprefix([min(per_directory), max(per_directory)])
    prefix = common[: common.rfind("/") + 1]
    under: Counter[str] = Counter()
    for directory, count in per_directory.items():
        top = directory[len(prefix):].split("/", 1)[0]
        under[f"{top}/" if top else "(top level)"] += count
    ranked = sorted(under.items(), key=lambda item: (-item[1], item[0]))
    where = f" under {prefix}" if prefix else ""
    most = _listed([f"{name} ({count})" for name, count in ranked[:_TOP_DIRECTORIES]])
    rest = sum(count for _, count in ranked[_TOP_DIRECTORIES:])
    others = f"; {rest} more under {len(ranked) - _TOP_DIRECTORIES} others" if rest else ""
    return f"[cg: the output lists {paths} paths in {len(per_directory)} directories{where}; most under: {most}{others}]"


def _ls_r_directories(text: str, lines: list[str]) -> Counter[str]:
    """`ls -R`'s entries counted by directory (each named with a final "/"); empty if the text
    is not `ls -R` output: its first line a header, a blank line before every other header."""
    if not lines[0].endswith(":"):
        return Counter()
    headers = set(_LS_R_HEADER.findall(text))
    if len(headers) < 2 or text.count("\n\n") < len(headers) - 1:
        return Counter()
    per_directory: Counter[str] = Counter()
    directory = ""
    for line in lines:
        if line.endswith(":") and line[:-1] in headers:
            directory = line[:-1].rstrip("/") + "/"
            per_directory[directory] += 0
        elif line:
            per_directory[directory] += 1
    return per_directory


DEFAULT_COMPONENTS = (TextClean(), JsonFormat(), Dedup(), Offload())
