"""Codex CLI end to end: install the CLI, run ``codex exec`` headless, script the fake's Responses.

The pieces, each usable on its own by later scenarios:

- ``install_codex()``: ``npm install @openai/codex@VERSION`` once into a cache directory kept
  between runs (claude_harness's ``install_npm_cli``). The version is pinned: what Codex sends and
  tolerates was established by running 0.171.0 (tests/fixtures/codex/README.md).
- ``write_config()`` / ``codex_env()``: a fresh CODEX_HOME whose config.toml points a custom
  provider (``wire_api = "responses"``) at cg, with updates, analytics and feedback off.
- ``Tap``: a byte relay between Codex and cg that records both directions, so a test sees what
  Codex itself sent (before cg) and what it got back (after cg).
- ``run_codex()``: ``codex exec --json …`` as a child process of the reactor (cg, the tap and the
  fake live on the same reactor and keep serving), bounded by a timeout.
- ``Script``: the fake's ``default_reply`` for /v1/responses. It parses each request and asks a
  ``decide`` function for the reply: a list of output items, rendered as a valid Responses SSE
  stream (``responses_stream_events``, or a JSON response for a request that does not stream), any
  cg.testing reply, or None for the default (a short message).
- ``shell_round_trip()``: the first scenario's ``decide``: an ``exec_command`` call, then a
  message quoting a line of the ``function_call_output`` it got back.
- ``OffloadExpand``: the expand scenarios' ``decide``: an ``exec_command`` with a big output
  (claude_harness's ``numbered_output``), then a ``context_guru_expand`` call for the marker cg
  put in its place (alone, or batched with another ``exec_command``), then an answer quoting the
  SHA-256 of the original it got back and the line in its middle that offload elided.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import math
import os
import re
from collections.abc import Callable, Sequence
from json.decoder import scanstring
from pathlib import Path

import attrs
from claude_harness import (
    NPM_INSTALL_TIMEOUT,
    CliRun,
    InstallError,
    cli_version,
    home_env,
    install_npm_cli,
    numbered_output,
    run_cli,
)
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.protocols import portforward

from cg.testing import (
    JSONReply,
    Received,
    SSEReply,
    default_reply,
    responses_function_call,
    responses_message,
    responses_reasoning,
    responses_response,
    responses_stream_events,
)

__all__ = ["InstallError", "numbered_output"]

PACKAGE = "@openai/codex"
DEFAULT_VERSION = "0.171.0"  # the version tests/fixtures/codex and the reference were taken from
CODEX_TIMEOUT = 120.0
MODEL = "gpt-5.5"  # in Codex's catalog, classic mode: top-level `tools` with exec_command
SHELL_TOOL = "exec_command"
EXPAND_TOOL = "context_guru_expand"
MARKER = re.compile(r"<<cg:([A-Za-z0-9_-]{1,64})>>")
UNSUPPORTED = f"unsupported call: {EXPAND_TOOL}"  # Codex's answer to a call of a tool it lacks

# Offline: no plugin sync (github.com, chatgpt.com), nothing but the provider's loopback address.
OFFLINE_ARGS = ("--disable", "plugins", "--disable", "remote_plugin")


# ---------------------------------------------------------------------------------------------
# Installing the CLI


def codex_version_pin() -> str:
    """$CG_E2E_CODEX_VERSION, else the version the fixtures and the reference were taken from."""
    return os.environ.get("CG_E2E_CODEX_VERSION", "").strip() or DEFAULT_VERSION


def package_spec() -> str:
    return f"{PACKAGE}@{codex_version_pin()}"


def npm_dir() -> Path:
    """The npm prefix the CLI lives in: $CG_E2E_CODEX_NPM_DIR, else a per-user cache directory."""
    explicit = os.environ.get("CG_E2E_CODEX_NPM_DIR", "").strip()
    if explicit:
        return Path(explicit).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME", "").strip() or Path.home() / ".cache"
    return Path(cache) / "cg-e2e" / f"codex-{codex_version_pin()}"


def codex_binary(prefix: Path) -> Path:
    return prefix / "node_modules" / ".bin" / "codex"


def install_codex(prefix: Path | None = None, timeout: float = NPM_INSTALL_TIMEOUT) -> tuple[Path, str, bool]:
    """Make sure the pinned CLI is installed under ``prefix``; returns (binary, version, installed_now)."""
    prefix = npm_dir() if prefix is None else prefix
    binary, version, installed_now = install_npm_cli(prefix, package_spec(), codex_binary, cli_version, timeout)
    if not version.endswith(codex_version_pin()):
        raise InstallError(f"{binary} is {version!r}, not {codex_version_pin()}: remove {prefix} to reinstall")
    return binary, version, installed_now


# ---------------------------------------------------------------------------------------------
# Configuring and running the CLI


def write_config(codex_home: Path, base_url: str, model: str = MODEL, **provider: object) -> Path:
    """``codex_home/config.toml``: the custom provider ``cg`` at ``base_url`` (``…/v1``; Codex posts
    to ``{base_url}/responses``), Responses wire API, the key from OPENAI_API_KEY; no update check,
    analytics or feedback. ``provider`` adds keys to ``[model_providers.cg]``."""
    codex_home.mkdir(parents=True, exist_ok=True)
    keys = {
        "name": "cg",
        "base_url": base_url,
        "wire_api": "responses",
        "env_key": "OPENAI_API_KEY",
        "stream_idle_timeout_ms": 30000,  # a stalled stream fails well inside CODEX_TIMEOUT
        **provider,
    }
    lines = [
        f"model = {json.dumps(model)}",
        'model_provider = "cg"',
        "check_for_update_on_startup = false",
        "",
        "[model_providers.cg]",
        *(f"{key} = {json.dumps(value)}" for key, value in keys.items()),
        "",
        "[analytics]",
        "enabled = false",
        "",
        "[feedback]",
        "enabled = false",
        "",
    ]
    path = codex_home / "config.toml"
    path.write_text("\n".join(lines))
    return path


def codex_env(home: Path, api_key: str = "sk-cg-e2e-not-a-real-key", **extra: str) -> dict[str, str]:
    """The environment of a headless run with a fresh ``home``; CODEX_HOME is ``home/.codex``."""
    env = home_env(home, ".codex")
    env.update(CODEX_HOME=str(home / ".codex"), OPENAI_API_KEY=api_key)
    env.update(extra)
    return env


@attrs.define
class CodexRun(CliRun):
    """One run of ``codex exec --json``: its stdout is one JSON event per line."""

    def items(self, kind: str | None = None) -> list[dict]:
        """The items of the ``item.completed`` events (of type ``kind`` if given), in order."""
        items = [m["item"] for m in self.messages() if m.get("type") == "item.completed" and isinstance(m.get("item"), dict)]
        return [i for i in items if kind is None or i.get("type") == kind]

    def final_message(self) -> str | None:
        """The text of the last ``agent_message`` item, or None."""
        messages = self.items("agent_message")
        return messages[-1].get("text") if messages else None

    def describe(self, limit: int = 6000, line_limit: int = 400) -> str:
        """As CliRun's, each stdout line cut to ``line_limit`` characters (a command's whole output
        is in its event)."""
        lines = [
            line if len(line) <= line_limit else f"{line[:line_limit]}… ({len(line)} chars)"
            for line in self.stdout.decode(errors="replace").splitlines()
        ]
        short = attrs.evolve(self, stdout="\n".join(lines).encode())
        return CliRun.describe(short, limit)

    def turn_failed(self) -> list[dict]:
        return [m for m in self.messages() if m.get("type") in ("turn.failed", "error")]


def exec_args(prompt: str, workdir: Path, model: str = MODEL, *extra: str) -> list[str]:
    """``codex exec`` headless: JSONL events, no sandbox (the command runs as the Claude Code
    test's Bash does: in the test's own temp directory), no git repository needed, offline."""
    return [
        "exec",
        "--json",
        "--color",
        "never",
        "--skip-git-repo-check",
        "--dangerously-bypass-approvals-and-sandbox",
        *OFFLINE_ARGS,
        "-m",
        model,
        "-C",
        str(workdir),
        *extra,
        prompt,
    ]


def run_codex(
    binary: Path, args: Sequence[str], env: dict, cwd: Path, timeout: float = CODEX_TIMEOUT
) -> Deferred[CodexRun]:
    """Run the CLI under the reactor; fires with a CodexRun (never errbacks on a bad exit)."""
    return run_cli(CodexRun, binary, args, env, cwd, timeout)


def rollout_items(codex_home: Path) -> list[dict]:
    """The ``response_item`` payloads of the session files Codex wrote under ``codex_home``: its
    own history, as it keeps it (what it ran, what it answered, what it was told)."""
    items = []
    for path in sorted((codex_home / "sessions").rglob("*.jsonl")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if isinstance(doc, dict) and doc.get("type") == "response_item" and isinstance(doc.get("payload"), dict):
                items.append(doc["payload"])
    return items


# ---------------------------------------------------------------------------------------------
# The tap: what Codex sent before cg, and what it got back


@attrs.frozen
class HTTPRequest:
    """One request as it crossed the tap."""

    connection: int
    method: str
    path: str
    headers: list[tuple[str, str]]
    body: bytes
    offset: int = 0  # where the request starts in what the client sent on its connection

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k.lower() == name.lower()), None)


def split_requests(stream: bytes, connection: int = 0) -> list[HTTPRequest]:
    """The requests in the bytes a client sent on one connection (``content-length`` framing: Codex
    always sends one, §6.2 of the reference; a chunked body would raise)."""
    requests, at = [], 0
    while at < len(stream):
        end = stream.find(b"\r\n\r\n", at)
        if end < 0:
            break  # an incomplete head: the client went away mid-request
        lines = stream[at:end].decode("latin-1").split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        headers = [(k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in lines[1:])]
        if any(k.lower() == "transfer-encoding" for k, _ in headers):
            raise ValueError("a chunked request body: the tap only frames content-length")
        length = int(next((v for k, v in headers if k.lower() == "content-length"), "0"))
        body_at = end + 4
        requests.append(HTTPRequest(connection, method, path, headers, stream[body_at : body_at + length], at))
        at = body_at + length
    return requests


class _TapClient(portforward.ProxyClient):
    def dataReceived(self, data: bytes) -> None:
        self.peer.factory.tap._record(self.peer.serial, "received", data)
        super().dataReceived(data)


class _TapClientFactory(portforward.ProxyClientFactory):
    noisy = False
    protocol = _TapClient


class _TapServer(portforward.ProxyServer):
    clientProtocolFactory = _TapClientFactory

    def connectionMade(self) -> None:
        self.serial = next(self.factory.tap._serials)
        super().connectionMade()

    def dataReceived(self, data: bytes) -> None:
        self.factory.tap._record(self.serial, "sent", data)
        super().dataReceived(data)


class _TapFactory(portforward.ProxyFactory):
    noisy = False
    protocol = _TapServer

    def __init__(self, tap: Tap, host: str, port: int) -> None:
        super().__init__(host, port)
        self.tap = tap


@attrs.define(eq=False)
class Tap:
    """A TCP relay on 127.0.0.1 in front of ``host:port`` that records every byte both ways."""

    host: str
    port: int
    sent: dict[int, bytearray] = attrs.Factory(dict)  # connection -> what the client sent
    received: dict[int, bytearray] = attrs.Factory(dict)  # connection -> what it got back
    url: str | None = attrs.field(default=None, init=False)
    _serials: itertools.count = attrs.field(factory=lambda: itertools.count(1), init=False)
    _chunks: itertools.count = attrs.field(factory=itertools.count, init=False)
    _starts: dict[int, list[tuple[int, int]]] = attrs.Factory(dict)  # connection -> (offset, chunk n) sent
    _listening: object = attrs.field(default=None, init=False)

    def listen(self) -> Tap:
        self._listening = reactor.listenTCP(0, _TapFactory(self, self.host, self.port), interface="127.0.0.1")
        self.url = f"http://127.0.0.1:{self._listening.getHost().port}"
        return self

    def stop(self) -> Deferred | None:
        port, self._listening = self._listening, None
        return port.stopListening() if port is not None else None

    def _record(self, connection: int, direction: str, data: bytes) -> None:
        kept = getattr(self, direction).setdefault(connection, bytearray())
        if direction == "sent":
            self._starts.setdefault(connection, []).append((len(kept), next(self._chunks)))
        kept.extend(data)

    def requests(self) -> list[HTTPRequest]:
        """Every request the client sent, in the order their first bytes arrived (whatever the
        connection)."""
        requests = [r for c in sorted(self.sent) for r in split_requests(bytes(self.sent[c]), c)]

        def arrived(request: HTTPRequest) -> int:
            starts = self._starts[request.connection]
            return starts[bisect.bisect_right(starts, (request.offset, math.inf)) - 1][1]

        return sorted(requests, key=arrived)

    def received_bytes(self) -> bytes:
        return b"".join(bytes(self.received[c]) for c in sorted(self.received))


# ---------------------------------------------------------------------------------------------
# What Codex sent


def top_level_spans(doc: str) -> dict[str, tuple[int, int]]:
    """Where each top-level key's value lies in a JSON object's text: key -> (start, end)."""
    decoder = json.JSONDecoder()
    spans: dict[str, tuple[int, int]] = {}

    def skip(i: int) -> int:
        while i < len(doc) and doc[i] in " \t\r\n":
            i += 1
        return i

    i = skip(0)
    if doc[i : i + 1] != "{":
        raise ValueError("not a JSON object")
    i = skip(i + 1)
    while doc[i] != "}":
        if doc[i] != '"':
            raise ValueError(f"a key expected at {i}")
        key, i = scanstring(doc, i + 1)
        i = skip(i)
        if doc[i] != ":":
            raise ValueError(f"':' expected at {i}")
        start = skip(i + 1)
        _, end = decoder.raw_decode(doc, start)
        spans[key] = (start, end)
        i = skip(end)
        if doc[i] == ",":
            i = skip(i + 1)
    return spans


def outside(body: bytes, keys: Sequence[str] = ("input", "tools")) -> bytes:
    """``body`` with the values of the top-level ``keys`` cut out (their keys and commas kept)."""
    doc = body.decode("utf-8")
    spans = sorted(span for key, span in top_level_spans(doc).items() if key in keys)
    parts, at = [], 0
    for start, end in spans:
        parts.append(doc[at:start])
        at = end
    parts.append(doc[at:])
    return "".join(parts).encode("utf-8")


def output_text(output: object) -> str:
    """A call output's text: the string, or its ``input_text`` parts joined (code mode)."""
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return "".join(p.get("text", "") for p in output if isinstance(p, dict) and p.get("type") == "input_text")
    return ""


def command_output(tool_output: str) -> str:
    """The command's own output in an exec_command ``function_call_output`` (after Codex's
    ``Chunk ID: … Output:\\n`` header), or the whole text if it has no such header."""
    head, sep, rest = tool_output.partition("\nOutput:\n")
    return rest if sep and head.startswith("Chunk ID:") else tool_output


@attrs.frozen
class CodexRequest:
    """One /v1/responses request as the fake got it (or as Codex sent it, through the tap), parsed."""

    path: str  # without the query string
    headers: list[tuple[str, str]]
    raw: bytes
    body: dict
    received: Received | None = None

    @classmethod
    def parse(cls, received: Received) -> CodexRequest:
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in received.headers]
        return cls._parse(received.path.decode("latin-1"), headers, received.body, received)

    @classmethod
    def from_tap(cls, request: HTTPRequest) -> CodexRequest:
        return cls._parse(request.path, request.headers, request.body)

    @classmethod
    def _parse(cls, path: str, headers, raw: bytes, received: Received | None = None) -> CodexRequest:
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            body = {}
        return cls(path.partition("?")[0], headers, raw, body if isinstance(body, dict) else {}, received)

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k.lower() == name.lower()), None)

    @property
    def streaming(self) -> bool:
        return self.body.get("stream") is True

    @property
    def model(self) -> str:
        model = self.body.get("model")
        return model if isinstance(model, str) else MODEL

    @property
    def tool_names(self) -> list[str]:
        tools = self.body.get("tools")
        if not isinstance(tools, list):
            return []
        return [str(t.get("name") or t.get("type")) for t in tools if isinstance(t, dict)]

    @property
    def is_main_loop(self) -> bool:
        """The agent loop's own call (it offers exec_command); compaction sends ``tools: []``."""
        return self.path == "/v1/responses" and SHELL_TOOL in self.tool_names

    @property
    def input(self) -> list[dict]:
        items = self.body.get("input")
        return [i for i in items if isinstance(i, dict)] if isinstance(items, list) else []

    def calls(self, name: str | None = None) -> list[dict]:
        """The ``function_call`` items of the input (named ``name`` if given)."""
        return [i for i in self.input if i.get("type") == "function_call" and name in (None, i.get("name"))]

    def outputs(self) -> dict[str, str]:
        """call_id -> the text of its (last) ``function_call_output`` in the input."""
        return {
            str(i.get("call_id")): output_text(i.get("output"))
            for i in self.input
            if i.get("type") in ("function_call_output", "custom_tool_call_output")
        }

    def output_items(self, call_id: str) -> list[dict]:
        return [i for i in self.input if i.get("type") == "function_call_output" and i.get("call_id") == call_id]

    def summary(self) -> str:
        """One line for logs, without the 28 KB of instructions and 9 KB of tools."""
        head = f"POST {self.path}"
        if self.received is not None:
            head += f" conn={self.received.connection}#{self.received.nth_on_connection}"
        if not self.body:
            return f"{head} body={len(self.raw)}B"
        items = ",".join(
            f"{i.get('type')}:{i.get('name') or i.get('role') or i.get('call_id', '')}" for i in self.input[-6:]
        )
        return (
            f"{head} body={len(self.raw)}B model={self.body.get('model')} stream={self.body.get('stream', '<absent>')} "
            f"tools={len(self.tool_names)}{'+expand' if EXPAND_TOOL in self.tool_names else ''} "
            f"input={len(self.input)} last=[{items}] kind={_request_kind(self)}"
        )


def _request_kind(request: CodexRequest) -> str:
    try:
        return str(json.loads(request.header("x-codex-turn-metadata") or "{}").get("request_kind", "-"))
    except ValueError:
        return "?"


# ---------------------------------------------------------------------------------------------
# What the fake answers


def message(text: str, id: str) -> dict:
    return responses_message(text, id=id)


def function_call(name: str, arguments: dict, call_id: str, id: str) -> dict:
    return responses_function_call(name, json.dumps(arguments, separators=(",", ":")), call_id=call_id, id=id)


def shell_call(cmd: str, call_id: str, id: str | None = None) -> dict:
    return function_call(SHELL_TOOL, {"cmd": cmd}, call_id, id or f"fc_{call_id}")


def expand_call(marker_id: str, call_id: str) -> dict:
    return function_call(EXPAND_TOOL, {"id": marker_id}, call_id, f"fc_{call_id}")


Decision = list[dict] | JSONReply | SSEReply | None
SIDE_REPLY = "cg e2e side reply"


@attrs.define
class Script:
    """A FakeUpstream ``default_reply`` that asks ``decide`` what to answer to each /v1/responses
    request: a list of output items (a ``reasoning`` item is put first, as gpt-5.5 does: Codex keeps
    it, with its encrypted_content, in the history it re-sends), a cg.testing reply, or None for a
    short message. Anything else gets cg.testing's default. Every response has its own ids.
    ``log`` keeps (request, what was answered, the items) for assertions and failure messages."""

    decide: Callable[[CodexRequest], Decision]
    log: list[tuple[CodexRequest, str, list[dict]]] = attrs.Factory(list)
    _serial: itertools.count = attrs.field(factory=lambda: itertools.count(1), init=False)

    def __call__(self, received: Received):
        request = CodexRequest.parse(received)
        if request.path != "/v1/responses":
            self.log.append((request, "default", []))
            return default_reply(received)
        n = next(self._serial)
        decision = self.decide(request)
        if decision is None:
            decision, what = [message(SIDE_REPLY, f"msg_cge2e_side_{n}")], "side"
        else:
            what = "scripted"
        if not isinstance(decision, list):
            self.log.append((request, what, []))
            return decision
        items = [responses_reasoning(f"gAAAA-cg-e2e-{n}", id=f"rs_cge2e_{n}"), *decision]
        self.log.append((request, what, items))
        response_id = f"resp_cge2e_{n}"
        if not request.streaming:
            return JSONReply(responses_response(items, id=response_id, model=request.model, input_tokens=1000))
        events = responses_stream_events(items, deltas=3, id=response_id, model=request.model, input_tokens=1000)
        return SSEReply(events)

    def main_loop_requests(self) -> list[CodexRequest]:
        return [r for r, _, _ in self.log if r.is_main_loop]

    def describe(self) -> str:
        lines = []
        for i, (r, what, items) in enumerate(self.log):
            answered = ",".join(f"{x.get('type')}:{x.get('name', '')}" for x in items if x.get("type") != "reasoning")
            lines.append(f"  {i}: [{what}] {r.summary()} -> [{answered}]")
        return "\n".join(lines) or "  (none)"


def describe_tap(tap: Tap) -> str:
    return "\n".join(f"  {i}: {CodexRequest.from_tap(r).summary()}" for i, r in enumerate(tap.requests())) or "  (none)"


# ---------------------------------------------------------------------------------------------
# Scenarios


def shell_round_trip(command: str, call_id: str, answer: Callable[[str], str]) -> Callable[[CodexRequest], Decision]:
    """Main loop: no output for ``call_id`` yet → an exec_command call running ``command``; its
    function_call_output back → the message ``answer(output)``. Other requests → the default."""

    def decide(request: CodexRequest) -> Decision:
        if not request.is_main_loop:
            return None
        outputs = request.outputs()
        if call_id in outputs:
            return [message(answer(outputs[call_id]), f"msg_{call_id}_answer")]
        return [shell_call(command, call_id)]

    return decide


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@attrs.define
class OffloadExpand:
    """A ``decide`` for the expand scenarios, keeping what it saw for the test's assertions.

    Main loop, in order:

    1. no output yet → an exec_command call running ``command`` (its output is big);
    2. that call's output back (cg has offloaded it: the marker is in it) → a ``context_guru_expand``
       call for the marker, batched with ``batch_with`` (another exec_command: a client call, so cg
       lets the response through and Codex answers the expand call "unsupported call") if given;
    3. an output for the expand call (cg's continuation, or Codex's answer repaired by cg) → with
       ``follow_up``, one more exec_command (``echo`` of the digest; so that Codex sends one more
       request, whose history shows what Codex kept of the spliced response), then the answer;
       without, the answer at once. The answer quotes the SHA-256 of the original the fake got and
       the line ``needle`` finds in it.
    """

    command: str
    shell_id: str
    expand_id: str
    needle: re.Pattern
    batch_with: dict | None = None
    follow_up: str | None = None  # the call_id of the follow-up exec_command
    marker_id: str | None = None
    original: str | None = None  # the expand call's output as the fake first got it
    offloaded: CodexRequest | None = None  # the first request carrying the big output
    expanded: list[CodexRequest] = attrs.Factory(list)  # requests carrying the expand call's output
    followed: list[CodexRequest] = attrs.Factory(list)  # requests carrying the follow-up's output

    @staticmethod
    def answer(digest: str, line: str) -> str:
        return f"The original output has sha256 {digest}; its middle line reads: {line}"

    def final(self) -> list[dict]:
        original = self.original or ""
        found = self.needle.search(original)
        text = self.answer(sha256(original), found[0]) if found else "The expanded output has no needle."
        return [message(text, f"msg_{self.expand_id}_answer")]

    def __call__(self, request: CodexRequest) -> Decision:
        if not request.is_main_loop:
            return None
        outputs = request.outputs()
        if self.follow_up is not None and self.follow_up in outputs:
            self.followed.append(request)
            return self.final()
        if self.expand_id in outputs:
            self.expanded.append(request)
            if self.original is None:
                self.original = outputs[self.expand_id]
            if self.follow_up is not None:
                return [shell_call(f"echo cg-e2e-digest-{sha256(self.original)}", self.follow_up)]
            return self.final()
        if self.shell_id in outputs:
            if self.offloaded is None:
                self.offloaded = request
                found = MARKER.search(outputs[self.shell_id])
                self.marker_id = found[1] if found else None
            if self.marker_id is None:
                return [message("cg did not offload the output: no marker to expand.", "msg_cge2e_no_marker")]
            return [expand_call(self.marker_id, self.expand_id), *([self.batch_with] if self.batch_with else [])]
        return [shell_call(self.command, self.shell_id)]
