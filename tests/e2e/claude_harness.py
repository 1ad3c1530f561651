"""Claude Code end to end: install the CLI, run it headless, script the fake provider's replies.

The pieces, each usable on its own by later scenarios:

- ``install_claude()``: ``npm install`` the CLI once into a cache directory kept between runs.
- ``run_claude()``: run ``claude -p … --output-format stream-json`` as a child process of the
  reactor (so cg and the fake, which live on the same reactor, keep serving), bounded by a timeout.
- ``Script``: the fake's ``default_reply``. It parses each request and asks a ``decide`` function
  for the reply; ``decide`` returns a ``Turn`` (text and tool_use blocks, rendered as a valid
  Messages stream, or as a JSON message when the request is not streaming), any cg.testing reply,
  or None for the default (a short text stream, good for side requests).
- ``bash_round_trip()``: the first scenario's ``decide``: a Bash tool_use, then a final answer
  that quotes the tool_result it got back.
- ``OffloadExpand``: the expand scenarios' ``decide``: a Bash command with a big output
  (``numbered_output``), then a ``context_guru_expand`` call for the marker cg put in its place
  (alone, or batched with a client tool, or after failed streams), then an answer quoting the line
  in the middle of the original that offload elided.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import attrs
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.protocol import ProcessProtocol

from cg.testing import (
    JSONReply,
    Received,
    SSEReply,
    anthropic_message,
    anthropic_stream_events,
    anthropic_text_block,
    default_reply,
    sse_event,
)

PACKAGE = "@anthropic-ai/claude-code"
NPM_INSTALL_TIMEOUT = 300.0
CLAUDE_TIMEOUT = 120.0

# What the issue asks for: no telemetry, updates, error reports or other traffic besides the API.
QUIET_ENV = {
    "DISABLE_TELEMETRY": "1",
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
}


# ---------------------------------------------------------------------------------------------
# Installing the CLI


def package_spec() -> str:
    """``@anthropic-ai/claude-code``, or ``…@VERSION`` when CG_E2E_CLAUDE_CODE_VERSION pins one."""
    version = os.environ.get("CG_E2E_CLAUDE_CODE_VERSION", "").strip()
    return f"{PACKAGE}@{version}" if version else PACKAGE


def npm_dir() -> Path:
    """The npm prefix the CLI lives in: $CG_E2E_NPM_DIR, else a per-user cache directory."""
    explicit = os.environ.get("CG_E2E_NPM_DIR", "").strip()
    if explicit:
        return Path(explicit).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME", "").strip() or Path.home() / ".cache"
    version = os.environ.get("CG_E2E_CLAUDE_CODE_VERSION", "").strip()
    return Path(cache) / "cg-e2e" / (f"claude-code-{version}" if version else "claude-code")


def claude_binary(prefix: Path) -> Path:
    return prefix / "node_modules" / ".bin" / "claude"


def cli_version(binary: Path, timeout: float = 60.0) -> str | None:
    """``BINARY --version``'s output (Claude Code's, Codex CLI's), or None when the binary is
    missing or does not run; run in a throwaway HOME."""
    if not os.access(binary, os.X_OK):
        return None
    try:
        with tempfile.TemporaryDirectory(prefix="cg-e2e-home-") as home:
            done = _run_bounded([str(binary), "--version"], timeout, env=_bare_env(Path(home)))
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.decode(errors="replace").strip() if done.returncode == 0 else None


class InstallError(Exception):
    pass


def install_claude(prefix: Path | None = None, timeout: float = NPM_INSTALL_TIMEOUT) -> tuple[Path, str, bool]:
    """Make sure the CLI is installed under ``prefix``; returns (binary, version, installed_now)."""
    return install_npm_cli(npm_dir() if prefix is None else prefix, package_spec(), claude_binary, cli_version, timeout)


def install_npm_cli(
    prefix: Path,
    spec: str,
    binary_of: Callable[[Path], Path],
    version_of: Callable[[Path], str | None],
    timeout: float = NPM_INSTALL_TIMEOUT,
) -> tuple[Path, str, bool]:
    """Make sure the npm package ``spec`` is installed under ``prefix``, its CLI at
    ``binary_of(prefix)`` answering ``version_of``; returns (binary, version, installed_now).

    Runs before cg and the fake start, so blocking here holds up nothing. The install goes to a
    staging directory that is renamed into place only once the CLI runs, so an install that was
    killed half-way is never mistaken for a good one (and concurrent runs don't mix files).
    """
    binary = binary_of(prefix)
    version = version_of(binary)
    if version is not None:
        return binary, version, False
    npm = shutil.which("npm")
    if npm is None:
        raise InstallError("npm is not on PATH")
    prefix.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=prefix.name + ".installing-", dir=prefix.parent))
    try:
        argv = [npm, "install", "--prefix", str(staging), "--no-audit", "--no-fund", "--loglevel=http"]
        try:
            done = _run_bounded([*argv, spec], timeout)
        except subprocess.TimeoutExpired as e:
            raise InstallError(f"{' '.join(argv)} took more than {timeout:.0f}s:\n{_tail(e.output, e.stderr)}") from e
        if done.returncode != 0:
            raise InstallError(f"{' '.join(argv)} exited {done.returncode}:\n{_tail(done.stdout, done.stderr)}")
        version = version_of(binary_of(staging))
        if version is None:
            raise InstallError(f"npm installed {spec} but {binary_of(staging)} --version fails")
        theirs = version_of(binary)
        if theirs is not None:  # a concurrent run installed it meanwhile: keep theirs
            return binary, theirs, True
        if prefix.exists():  # a broken earlier install
            shutil.rmtree(prefix, ignore_errors=True)
        try:
            staging.rename(prefix)
        except OSError:
            # Another run installed it meanwhile: use theirs if it works.
            version = version_of(binary)
            if version is None:
                raise InstallError(f"could not move the new install into {prefix}") from None
        return binary, version, True
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def _run_bounded(argv: Sequence[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """subprocess.run in its own session, killing the whole process group on timeout.

    Blocking: only for use while nothing else needs the reactor (installing, --version).
    """
    with subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True, env=env,
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _killpg(proc.pid)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(argv, timeout, out, err) from None
        return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _tail(out: bytes | None, err: bytes | None, limit: int = 4000) -> str:
    text = (out or b"").decode(errors="replace") + (err or b"").decode(errors="replace")
    return text[-limit:]


# ---------------------------------------------------------------------------------------------
# Running the CLI


def _bare_env(home: Path) -> dict[str, str]:
    """A minimal environment: nothing of the caller's ANTHROPIC_*/CLAUDE_* or proxies leaks in."""
    env = {
        "PATH": os.environ.get("PATH", os.defpath),
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "NO_COLOR": "1",
    }
    shell = shutil.which("bash")
    if shell:
        env["SHELL"] = shell  # the Bash tool needs bash (or zsh)
    return env


def home_env(home: Path, *dirs: str) -> dict[str, str]:
    """`_bare_env` with every XDG directory and TMPDIR inside a fresh ``home`` (made, with ``dirs``):
    a CLI run writes nothing outside it."""
    xdg = {"XDG_CONFIG_HOME": ".config", "XDG_CACHE_HOME": ".cache", "XDG_DATA_HOME": ".local/share",
           "XDG_STATE_HOME": ".local/state", "TMPDIR": "tmp"}
    for sub in (*dirs, *xdg.values()):
        (home / sub).mkdir(parents=True, exist_ok=True)
    env = _bare_env(home)
    env.update((name, str(home / sub)) for name, sub in xdg.items())
    return env


def claude_env(home: Path, base_url: str, api_key: str = "sk-ant-cg-e2e-not-a-real-key", **extra: str) -> dict:
    """The environment of a headless run through cg at ``base_url`` with a fresh ``home``."""
    env = home_env(home)
    env.update(
        ANTHROPIC_BASE_URL=base_url,
        ANTHROPIC_API_KEY=api_key,
        **QUIET_ENV,
    )
    env.update(extra)
    return env


@attrs.define
class CliRun:
    """One finished (or killed) run of a CLI."""

    argv: list[str]
    exit_code: int | None
    signal: int | None
    stdout: bytes
    stderr: bytes
    timed_out: bool
    seconds: float

    def messages(self) -> list[dict]:
        """The output lines (stream-json, JSONL) that parse as JSON objects, in order."""
        out = []
        for line in self.stdout.decode(errors="replace").splitlines():
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if isinstance(doc, dict):
                out.append(doc)
        return out

    def describe(self, limit: int = 6000) -> str:
        out = self.stdout.decode(errors="replace")
        err = self.stderr.decode(errors="replace")
        status = "killed after timeout" if self.timed_out else f"exit={self.exit_code} signal={self.signal}"
        return (
            f"$ {' '.join(self.argv)}\n{status} in {self.seconds:.1f}s\n"
            f"--- stdout (last {limit} chars)\n{out[-limit:]}\n--- stderr (last {limit} chars)\n{err[-limit:]}"
        )


@attrs.define
class ClaudeRun(CliRun):
    """One run of Claude Code."""

    def result(self) -> dict | None:
        """The final ``{"type": "result", …}`` message, or None."""
        results = [m for m in self.messages() if m.get("type") == "result"]
        return results[-1] if results else None


RunT = TypeVar("RunT", bound=CliRun)


class _Collector(ProcessProtocol):
    def __init__(self) -> None:
        self.out: list[bytes] = []
        self.err: list[bytes] = []
        self.ended: Deferred = Deferred()

    def connectionMade(self) -> None:
        self.transport.closeStdin()  # -p with an open stdin would wait for input on it

    def outReceived(self, data: bytes) -> None:
        self.out.append(data)

    def errReceived(self, data: bytes) -> None:
        self.err.append(data)

    def processEnded(self, reason) -> None:
        self.ended.callback(reason.value)


def run_claude(
    binary: Path, args: Sequence[str], env: dict, cwd: Path, timeout: float = CLAUDE_TIMEOUT
) -> Deferred[ClaudeRun]:
    """Run the CLI under the reactor; fires with a ClaudeRun (never errbacks on a bad exit)."""
    return run_cli(ClaudeRun, binary, args, env, cwd, timeout)


def run_cli(
    run_class: type[RunT], binary: Path, args: Sequence[str], env: dict, cwd: Path, timeout: float
) -> Deferred[RunT]:
    """Run a CLI under the reactor; fires with a ``run_class`` (a CliRun), never errbacks.

    It runs in a session of its own (setsid), so a timeout kills it and everything it started.
    """
    setsid = shutil.which("setsid")
    argv = [str(binary), *args]
    spawn_argv = [setsid, *argv] if setsid else argv
    proto = _Collector()
    started = time.monotonic()
    # The child is not a process-group leader, so setsid(1) execs in place: same pid, own group.
    transport = reactor.spawnProcess(proto, spawn_argv[0], spawn_argv, env=env, path=str(cwd))
    pid = transport.pid
    state = {"timed_out": False}

    def kill() -> None:
        state["timed_out"] = True
        if setsid:
            _killpg(pid)
        else:
            transport.signalProcess("KILL")

    watchdog = reactor.callLater(timeout, kill)

    def ended(reason) -> RunT:
        if watchdog.active():
            watchdog.cancel()
        if setsid:
            _killpg(pid)  # whatever it left running in its session
        return run_class(
            argv=argv,
            exit_code=getattr(reason, "exitCode", None),
            signal=getattr(reason, "signal", None),
            stdout=b"".join(proto.out),
            stderr=b"".join(proto.err),
            timed_out=state["timed_out"],
            seconds=time.monotonic() - started,
        )

    return proto.ended.addCallback(ended)


# ---------------------------------------------------------------------------------------------
# What Claude Code sent


@attrs.frozen
class ToolResult:
    tool_use_id: str
    text: str  # the content, text blocks joined
    is_error: bool


def _text_of(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") == "text")
    return ""


def _blocks(message: dict) -> list[dict]:
    content = message.get("content")
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [b for b in content if isinstance(b, dict)] if isinstance(content, list) else []


@attrs.frozen
class ClaudeRequest:
    """One request as Claude Code sent it (through cg), parsed."""

    received: Received
    path: str  # without the query string
    query: str
    body: dict

    @classmethod
    def parse(cls, received: Received) -> ClaudeRequest:
        path, _, query = received.path.decode("latin-1").partition("?")
        try:
            body = json.loads(received.body) if received.body else {}
        except ValueError:
            body = {}
        return cls(received, path, query, body if isinstance(body, dict) else {})

    @property
    def streaming(self) -> bool:
        return self.body.get("stream") is True

    @property
    def model(self) -> str:
        model = self.body.get("model")
        return model if isinstance(model, str) else "claude-opus-4-8"

    @property
    def tool_names(self) -> list[str]:
        tools = self.body.get("tools")
        return [t.get("name", "?") for t in tools if isinstance(t, dict)] if isinstance(tools, list) else []

    @property
    def is_main_loop(self) -> bool:
        """The agent loop's own call (it offers Bash); side requests send ``tools: []`` or none."""
        return self.path == "/v1/messages" and "Bash" in self.tool_names

    @property
    def messages(self) -> list[dict]:
        messages = self.body.get("messages")
        return [m for m in messages if isinstance(m, dict)] if isinstance(messages, list) else []

    def last_user_message(self) -> dict | None:
        """The last ``role: "user"`` message (``role: "system"`` entries may come after it)."""
        return next((m for m in reversed(self.messages) if m.get("role") == "user"), None)

    def tool_results(self) -> list[ToolResult]:
        """The tool_result blocks of the last user message."""
        message = self.last_user_message()
        if message is None:
            return []
        return [
            ToolResult(str(b.get("tool_use_id")), _text_of(b.get("content")), bool(b.get("is_error")))
            for b in _blocks(message)
            if b.get("type") == "tool_result"
        ]

    def tool_result_blocks(self) -> list[dict]:
        """The tool_result blocks of the last user message, as sent (to see which keys they carry)."""
        message = self.last_user_message()
        return [b for b in _blocks(message) if b.get("type") == "tool_result"] if message else []

    def prompt(self) -> str:
        """The text of the first user message (the ``-p`` prompt, with Claude Code's additions)."""
        first = next((m for m in self.messages if m.get("role") == "user"), None)
        return "" if first is None else "\n".join(b.get("text", "") for b in _blocks(first) if b.get("type") == "text")

    def summary(self) -> str:
        """One line for logs: what a request was, without its 70 KB of tool definitions."""
        r = self.received
        head = f"{r.method.decode()} {r.path.decode('latin-1')} conn={r.connection}#{r.nth_on_connection}"
        if not self.body:
            return f"{head} body={len(r.body)}B"
        roles = ",".join(str(m.get("role")) for m in self.messages)
        last = self.last_user_message()
        last_types = ",".join(str(b.get("type")) for b in _blocks(last)) if last else "-"
        return (
            f"{head} body={len(r.body)}B keys={list(self.body)} model={self.body.get('model')} "
            f"stream={self.body.get('stream', '<absent>')} tools={len(self.tool_names)} "
            f"max_tokens={self.body.get('max_tokens')} roles=[{roles}] last_user=[{last_types}] "
            f"beta={(r.header(b'anthropic-beta') or b'-').decode()} ua={(r.header(b'user-agent') or b'-').decode()}"
        )


def describe_received(received: Sequence[Received]) -> str:
    return "\n".join(f"  {i}: {ClaudeRequest.parse(r).summary()}" for i, r in enumerate(received)) or "  (none)"


# ---------------------------------------------------------------------------------------------
# What the fake answers


@attrs.frozen
class Text:
    text: str


@attrs.frozen
class ToolUse:
    id: str
    name: str
    input: dict


Block = Text | ToolUse


def _split(text: str, parts: int = 3) -> list[str]:
    """``text`` in up to ``parts`` non-empty pieces, so every block really streams."""
    n = max(1, min(parts, len(text)))
    return [text[len(text) * i // n : len(text) * (i + 1) // n] for i in range(n)] if text else [""]


def tool_use_block_events(index: int, block: ToolUse) -> list[bytes]:
    """A streamed tool_use: input ``{}`` in the start (Claude Code ignores it), then the real input
    as input_json_delta fragments (first ``""``, as the API does), then the stop."""
    raw = json.dumps(block.input, separators=(",", ":"), ensure_ascii=False)
    start = {
        "type": "content_block_start",
        "index": index,
        "content_block": {"type": "tool_use", "id": block.id, "name": block.name, "input": {}},
    }
    deltas = [
        sse_event(
            "content_block_delta",
            {"type": "content_block_delta", "index": index, "delta": {"type": "input_json_delta", "partial_json": p}},
        )
        for p in ["", *_split(raw)]
    ]
    return [sse_event("content_block_start", start), *deltas, sse_event("content_block_stop", {"type": "content_block_stop", "index": index})]


@attrs.frozen
class Turn:
    """One assistant reply; rendered for the request it answers (stream or JSON, its model)."""

    blocks: Sequence[Block] = attrs.field(converter=tuple)
    stop_reason: str | None = None  # default: tool_use if a block is one, else end_turn
    input_tokens: int = 100
    output_tokens: int = 20

    def reply(self, request: ClaudeRequest) -> JSONReply | SSEReply:
        stop = self.stop_reason or ("tool_use" if any(isinstance(b, ToolUse) for b in self.blocks) else "end_turn")
        msg_id = f"msg_cge2e_{len(request.received.body):x}_{request.received.connection}"
        if not request.streaming:  # Claude Code's fallback after a failed stream: no "stream" key
            content = [
                {"type": "text", "text": b.text}
                if isinstance(b, Text)
                else {"type": "tool_use", "id": b.id, "name": b.name, "input": b.input}
                for b in self.blocks
            ]
            usage = {
                "input_tokens": self.input_tokens,
                "output_tokens": self.output_tokens,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
            }
            return JSONReply(
                anthropic_message(id=msg_id, model=request.model, stop_reason=stop, usage=usage, content=content)
            )
        blocks = [
            anthropic_text_block(i, _split(b.text)) if isinstance(b, Text) else tool_use_block_events(i, b)
            for i, b in enumerate(self.blocks)
        ]
        return SSEReply(
            anthropic_stream_events(
                id=msg_id,
                model=request.model,
                stop_reason=stop,
                input_tokens=self.input_tokens,
                output_tokens=self.output_tokens,
                blocks=blocks,
            )
        )


SIDE_REPLY = "cg e2e side reply"

Decision = Turn | JSONReply | SSEReply | None


@attrs.define
class Script:
    """A FakeUpstream ``default_reply`` that asks ``decide`` what to answer to each request.

    ``decide(request)`` sees every ``/v1/messages`` request; returning None gives the default
    (a short text turn: fine for title generation and other side requests). count_tokens gets a
    plausible count, anything else cg.testing's default. ``log`` keeps (request, what was
    answered) for assertions and failure messages.
    """

    decide: Callable[[ClaudeRequest], Decision]
    log: list[tuple[ClaudeRequest, str]] = attrs.Factory(list)

    def __call__(self, received: Received):
        request = ClaudeRequest.parse(received)
        if request.path == "/v1/messages/count_tokens":
            self.log.append((request, "count_tokens"))
            return JSONReply({"input_tokens": max(1, len(received.body) // 4)})
        if request.path != "/v1/messages":
            self.log.append((request, "default"))
            return default_reply(received)
        decision = self.decide(request)
        if decision is None:
            decision = Turn([Text(SIDE_REPLY)], input_tokens=20, output_tokens=5)
            what = "side"
        else:
            what = "scripted"
        self.log.append((request, what))
        return decision.reply(request) if isinstance(decision, Turn) else decision

    def main_loop_requests(self) -> list[ClaudeRequest]:
        return [r for r, _ in self.log if r.is_main_loop]

    def describe(self) -> str:
        return "\n".join(f"  {i}: [{what}] {r.summary()}" for i, (r, what) in enumerate(self.log)) or "  (none)"


# ---------------------------------------------------------------------------------------------
# Scenarios


def bash_round_trip(command: str, tool_use_id: str, answer: Callable[[str], str]) -> Callable[[ClaudeRequest], Decision]:
    """Main loop: no tool_result yet → a Bash tool_use running ``command``; the tool_result back →
    the final answer ``answer(output)``. Side requests → the default."""

    def decide(request: ClaudeRequest) -> Decision:
        if not request.is_main_loop:
            return None
        results = [r for r in request.tool_results() if r.tool_use_id == tool_use_id]
        if results:
            return Turn([Text(answer(results[-1].text))])
        return Turn(
            [
                Text("I'll run the command."),
                ToolUse(tool_use_id, "Bash", {"command": command, "description": "Print the cg e2e marker"}),
            ]
        )

    return decide


# ---------------------------------------------------------------------------------------------
# Offload and expand: a big Bash output that cg offloads, and the model asking for it back

EXPAND_TOOL = "context_guru_expand"
MARKER = re.compile(r"<<cg:([A-Za-z0-9_-]{1,64})>>")


def numbered_output(lines: int, needle_at: int, needle: str) -> tuple[str, str]:
    """(a shell command, the output it prints): ``lines`` numbered lines, line ``needle_at`` being
    ``needle NNN TOKEN`` where NNN is computed by the shell (so it is not in the command's text).

    Nothing in it looks like an error, so offload keeps only the head and tail lines: the needle,
    in the middle, is elided."""
    product = needle_at * 7
    command = (
        f"seq 1 {lines} | awk '{{ if ($1 == {needle_at}) print \"{needle}\", $1 * 7; "
        "else printf \"line %05d of the cg e2e listing, nothing to see here\\n\", $1 }'"
    )
    out = [
        f"{needle} {product}" if n == needle_at else f"line {n:05d} of the cg e2e listing, nothing to see here"
        for n in range(1, lines + 1)
    ]
    return command, "\n".join(out) + "\n"


NEEDLE_LINES, NEEDLE_AT = 500, 250  # ~27 KB of output: over cg's offload threshold, under both CLIs' own cuts


def needle_scenario(make, token: str, listing_id: str, expand_id: str, **kw):
    """(`make`'s expand scenario for a listing with a needle line in its middle, the output the
    command prints, that needle line): the expand e2e tests' common start, for either CLI."""
    needle = f"cg-e2e-needle-{token}"
    command, output = numbered_output(NEEDLE_LINES, NEEDLE_AT, needle)
    scenario = make(command, listing_id, expand_id, re.compile(rf"{needle} \d+"), **kw)
    return scenario, output, f"{needle} {NEEDLE_AT * 7}"


def turn_blocks(run: ClaudeRun) -> list[dict]:
    """Every content block of the assistant and user messages Claude Code printed (stream-json)."""
    blocks = []
    for message in run.messages():
        if message.get("type") in ("assistant", "user") and isinstance(message.get("message"), dict):
            blocks += _blocks(message["message"])
    return blocks


def error_event(kind: str = "overloaded_error", message: str = "Overloaded") -> bytes:
    return sse_event("error", {"type": "error", "error": {"type": kind, "message": message}})


@attrs.define
class OffloadExpand:
    """A ``decide`` for the expand scenarios, keeping what it saw for the test's assertions.

    Main loop, in order:

    1. no tool_result yet → a Bash tool_use running ``command`` (its output is big);
    2. the Bash tool_result back (cg has offloaded it: the marker is in it) → ``Text(lead)`` and a
       ``context_guru_expand`` call for that marker, batched with ``batch_with`` if given (a client
       tool: cg cannot answer the expand call then). While ``stream_errors`` lasts, a streamed
       request gets an ``event: error`` before any content instead (Claude Code's retries, then its
       non-streaming fallback);
    3. a tool_result for the expand call (cg's continuation, or the client's answer repaired by cg)
       → the final answer, quoting the line ``needle`` finds in it.
    """

    command: str
    bash_id: str
    expand_id: str
    needle: re.Pattern
    lead: str = "Let me look at the full output."
    batch_with: ToolUse | None = None
    stream_errors: int = 0
    marker_id: str | None = None
    offloaded: ClaudeRequest | None = None  # the first request carrying the Bash tool_result
    expanded: list[ClaudeRequest] = attrs.Factory(list)  # requests carrying the expand call's result
    errored: list[ClaudeRequest] = attrs.Factory(list)  # requests answered with an error event

    @staticmethod
    def answer(line: str) -> str:
        return f"The middle of the output reads: {line}"

    def __call__(self, request: ClaudeRequest) -> Decision:
        if not request.is_main_loop:
            return None
        results = {r.tool_use_id: r for r in request.tool_results()}
        if self.expand_id in results:
            self.expanded.append(request)
            found = self.needle.search(results[self.expand_id].text)
            return Turn([Text(self.answer(found[0]) if found else "The expanded output has no needle.")])
        if self.bash_id in results:
            if self.offloaded is None:
                self.offloaded = request
                found = MARKER.search(results[self.bash_id].text)
                self.marker_id = found[1] if found else None
            if self.marker_id is None:
                return Turn([Text("cg did not offload the output: no marker to expand.")])
            if request.streaming and self.stream_errors > 0:
                self.stream_errors -= 1
                self.errored.append(request)
                return SSEReply([error_event()])
            expand = ToolUse(self.expand_id, EXPAND_TOOL, {"id": self.marker_id})
            return Turn([Text(self.lead), expand, *([self.batch_with] if self.batch_with else [])])
        return Turn(
            [
                Text("I'll run the listing command."),
                ToolUse(self.bash_id, "Bash", {"command": self.command, "description": "Print the cg e2e listing"}),
            ]
        )
