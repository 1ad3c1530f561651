"""Rebuild the requests a coding agent sent from its own local transcripts.

Pure apart from reading files. Two readers:

- Claude Code (``~/.claude/projects/<project>/<session>.jsonl``): one JSON object a line. User
  lines hold the prompt or the tool results, assistant lines one content block each (lines of
  one response share ``message.id``, even with a tool result between them) with the response's
  model and billed usage; ``attachment`` lines are what Claude Code adds to the next request
  (agent and skill listings, reminders). Each response is one request, counted once across files
  (a resumed session's file begins with a copy of the one it continues): the history before it,
  rebuilt as a Messages-API body. A sub-agent's side chain (``isSidechain`` lines, inline or in an
  ``agent-*.jsonl`` file) is a conversation of its own.
- Codex CLI (``~/.codex/sessions/YYYY/MM/DD/rollout-*.jsonl``): a ``session_meta`` line (the base
  instructions), ``turn_context`` lines (the model), ``response_item`` lines (exactly the input
  items Codex re-sends, in order) and a ``token_usage_record`` per response. Each run of model
  output items (reasoning, calls, assistant messages) after input items is one response; its
  request is every item before it, rebuilt as a Responses body.

What a transcript lacks (Claude Code's system prompt and tools, Codex's tools and request
options) comes from ``envelopes.json``: the envelope the named client version sent, scrubbed
(docs/how-to/estimate-savings.md says what is approximated and why).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import re
import uuid
from collections.abc import Iterable, Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import attrs

from cg.compaction.tokens import estimate_tokens
from cg.record.pricing import Tokens
from cg.record.replay import segments
from cg.wire.dialect import MESSAGES_SHAPE

CLAUDE_CODE, CODEX = "claude-code", "codex"
MESSAGES, RESPONSES = "/v1/messages", "/v1/responses"

_ENVELOPES: dict[str, Any] | None = None


def envelopes() -> dict[str, Any]:
    global _ENVELOPES
    if _ENVELOPES is None:
        _ENVELOPES = json.loads(resources.files("cg.record").joinpath("envelopes.json").read_text("utf-8"))
    return _ENVELOPES


def serialize(value: object) -> bytes:
    """As both clients serialize a body: compact, non-ASCII raw."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


@attrs.frozen
class Request:
    """One request a session sent, rebuilt: when, where to, the body, what the response cost."""

    time: float  # seconds since the epoch
    path: str
    body: bytes
    model: str | None = None
    output_tokens: int = 0
    billed: Tokens | None = None  # the usage the transcript recorded for it (the direct run's)
    unseen: int = 0  # tokens its prompt held beyond the rebuilt envelope (negative: fewer; claude_body)
    # Where ``output_tokens`` is cg's estimate of the response's content: the count its transcript
    # recorded, which was not the final one (see _output_not_final); else None.
    output_recorded: int | None = None


@attrs.frozen
class Session:
    client: str
    id: str
    file: str
    project: str  # the working directory the session ran in
    requests: tuple[Request, ...]
    notes: tuple[str, ...] = ()
    sidechain: bool = False  # a sub-agent's conversation
    session_id: str = ""  # the client's session it belongs to (a sub-agent's: its parent's; what cg keys keep-alive by)

    @property
    def started(self) -> float | None:
        return self.requests[0].time if self.requests else None

    @property
    def ended(self) -> float | None:
        return self.requests[-1].time if self.requests else None


def parse_time(value: object) -> float | None:
    """An ISO 8601 timestamp (``2026-12-01T16:58:36.553Z``) as epoch seconds, else None."""
    if not isinstance(value, str):
        return None
    try:
        when = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    return when.timestamp()


def _lines(path: Path) -> Iterator[dict[str, Any]]:
    with open(path, "rb") as stream:
        yield from _docs(stream)


def _docs(lines: Iterable[bytes]) -> Iterator[dict[str, Any]]:
    """The JSON objects of a transcript's lines; a line that is not one is skipped."""
    for line in lines:
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict):
            yield doc


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


# ---------------------------------------------------------------------------------------------
# Claude Code


def _attachment_text(attachment: object) -> str | None:
    """An attachment as the text Claude Code puts in the request (approximately: its text fields
    joined); None for one that adds nothing (an empty reminder)."""
    if not isinstance(attachment, dict):
        return None
    parts: list[str] = []
    for key in ("content", "addedLines", "text", "prompt"):
        value = attachment.get(key)
        if isinstance(value, str) and value:
            parts.append(value)
        elif isinstance(value, list):
            parts += [v if isinstance(v, str) else json.dumps(v, ensure_ascii=False) for v in value if v]
    return "\n".join(parts) if parts else None


def _blocks(content: object) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [dict(b) for b in content if isinstance(b, dict)] if isinstance(content, list) else []


def _claude_usage(usage: object) -> Tokens | None:
    if not isinstance(usage, dict):
        return None
    detail = usage.get("cache_creation")
    written = _count(usage.get("cache_creation_input_tokens"))
    one_hour = _count(detail.get("ephemeral_1h_input_tokens")) if isinstance(detail, dict) else 0
    return Tokens.billed(_count(usage.get("input_tokens")), _count(usage.get("cache_read_input_tokens")), written,
                         one_hour, _count(usage.get("output_tokens")))


_FILLER = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor "
_FILLER_PER_HUNDRED = estimate_tokens(_FILLER * 100)  # of one, the estimate's rounding would show


def unseen_block(tokens: int) -> dict[str, Any]:
    """A system text block of about ``tokens`` (cg's estimate) standing for what a session's prompt
    held that its transcript and the envelope do not: its CLAUDE.md and MCP tools, another
    version's system prompt, the provider's own count of the rest."""
    return {"type": "text", "text": _FILLER * max(1, round(100 * tokens / _FILLER_PER_HUNDRED))}


def _fewer_tools(tools: list[dict[str, Any]], tokens: int) -> list[dict[str, Any]]:
    """The envelope's tools less some of about ``tokens`` in all, dropped from the end: a smaller
    envelope than the one assumed (a sub-agent's, which has fewer tools; an older version's)."""
    dropped: set[int] = set()
    for at in range(len(tools) - 1, -1, -1):
        size = estimate_tokens(serialize(tools[at]).decode("utf-8"))
        if size <= tokens:
            dropped.add(at)
            tokens -= size
    return [tool for at, tool in enumerate(tools) if at not in dropped]


def claude_body(messages: list[dict[str, Any]], model: str, ttl: str | None = None, unseen: int = 0) -> dict[str, Any]:
    """A Messages-API body as Claude Code builds one around ``messages`` (its envelope: system,
    tools, options), with its cache breakpoint on the last block of the last message. ``unseen``
    tokens more in the system prompt, under its last breakpoint, as cached as the rest of it; or,
    negative, that many fewer in its tools."""
    env = envelopes()[CLAUDE_CODE]
    control: dict[str, str] = {"type": "ephemeral", **({"ttl": ttl} if ttl else {})}
    out = [dict(m) for m in messages]
    at = next((i for i in range(len(out) - 1, -1, -1) if out[i].get("role") != "system"), None)
    if at is not None:  # the breakpoint: on the last block of the last user or assistant message
        blocks = _blocks(out[at].get("content"))
        if blocks and blocks[-1].get("type") not in ("thinking", "redacted_thinking"):
            blocks[-1] = {**blocks[-1], "cache_control": control}
            out[at] = {**out[at], "content": blocks}
    system = [dict(b) for b in env["system"]]
    if unseen > 0:
        system.insert(len(system) - 1, unseen_block(unseen))
    if ttl:
        system = [{**b, "cache_control": control} if "cache_control" in b else b for b in system]
    tools = _fewer_tools(env["tools"], -unseen) if unseen < 0 else env["tools"]
    return {"model": model, "messages": out, "system": system, "tools": tools, **env["after"]}


@attrs.define
class Tally:
    """What reading a set of files counted once or left out, across files: a response is counted in
    the first file that holds it (a resumed Claude Code 1.0.x session's file begins with a copy of
    the conversation it continues, same ``message.id`` and ``requestId``)."""

    counted: set[str] = attrs.Factory(set)  # the responses counted so far
    copies: int = 0  # responses met again after they were counted
    untimed: int = 0  # responses left out: no timestamp to place them


@attrs.define
class _Conversation:
    """One conversation rebuilt from a transcript's lines: the main chain, or a sub-agent's side
    chain (a billed conversation whose prompt is its own)."""

    id: str
    sidechain: bool
    project: str = ""
    history: list[dict[str, Any]] = attrs.Factory(list)
    pending: list[str] = attrs.Factory(list)  # attachment texts for the next user message
    requests: list[Request] = attrs.Factory(list)
    answers: dict[str, int] = attrs.Factory(dict)  # response id -> its assistant message in history
    billed_as: dict[str, int] = attrs.Factory(dict)  # response id -> its request
    last_time: float | None = None
    unseen: int | None = None  # measured on its first request: see _ClaudeReader._unseen
    length_at: dict[str, int] = attrs.Factory(dict)  # a line's uuid -> how many messages history had after it
    # A request -> its response's content blocks so far, while every line of it says it has not
    # stopped (``stop_reason: null``): its recorded output count may be the one a block began with.
    unstopped: dict[int, list[dict[str, Any]]] = attrs.Factory(dict)

    def restart(self) -> None:
        """A new chain in the same conversation (after a compaction): its prompt starts again."""
        self.rewind(0)
        self.length_at.clear()

    def rewind(self, length: int) -> None:
        """Back to the first ``length`` messages: a prompt that branches from an earlier line (Claude
        Code's rewind) is sent after them, without what the abandoned branch added."""
        del self.history[length:]
        self.answers = {response: at for response, at in self.answers.items() if at < length}

    def clear_results(self, tool_use_ids: set[str]) -> None:
        """Claude Code 2.x's microcompaction: these calls' results are sent cleared from now on."""
        for at, message in enumerate(self.history):
            content = message["content"]
            if isinstance(content, list) and any(_cleared(b, tool_use_ids) for b in content):
                self.history[at] = {**message, "content": [{**b, "content": CLEARED_RESULT} if _cleared(b, tool_use_ids)
                                                           else b for b in content]}


CLEARED_RESULT = "[Old tool result content cleared]"  # what Claude Code sends for a microcompacted result


def _cleared(block: dict[str, Any], tool_use_ids: set[str]) -> bool:
    return block.get("type") == "tool_result" and block.get("tool_use_id") in tool_use_ids


def _response_id(doc: dict[str, Any], message: dict[str, Any]) -> str | None:
    """What names one response across its lines and across files: ``message.id``, else ``requestId``."""
    for value in (message.get("id"), doc.get("requestId")):
        if isinstance(value, str) and value:
            return value
    return None


SIDECHAIN_NOTE = "a sub-agent's side chain: its own conversation, priced in the main session's envelope"


class _ClaudeReader:
    """One Claude Code transcript file, line by line, into its conversations."""

    def __init__(self, path: Path, ttl: str | None, tally: Tally):
        self.path, self.ttl, self.tally = path, ttl, tally
        self.session_id: str | None = None
        self.main: _Conversation | None = None
        self.sidechains: list[_Conversation] = []
        self.chain_of: dict[str, _Conversation] = {}  # a side-chain line's uuid -> its conversation

    def _conversation(self, doc: dict[str, Any]) -> _Conversation:
        """The main chain, or the side chain whose line this one follows (a root opens one: parallel
        sub-agents' lines interleave)."""
        if not doc.get("isSidechain"):
            if self.main is None:
                self.main = _Conversation("", False)  # named by the file's last sessionId
            return self.main
        parent = doc.get("parentUuid")
        found = self.chain_of.get(parent) if isinstance(parent, str) else None
        if found is None:
            agent = doc.get("agentId")
            name = (f"agent-{agent}" if isinstance(agent, str) and agent
                    else f"{self.session_id or self.path.stem}~{len(self.sidechains) + 1}")
            found = _Conversation(name, True)
            self.sidechains.append(found)
        if isinstance(doc.get("uuid"), str):
            self.chain_of[doc["uuid"]] = found
        return found

    def line(self, doc: dict[str, Any]) -> None:
        if isinstance(doc.get("sessionId"), str):  # the last: a resumed file's copy carries the old one
            self.session_id = doc["sessionId"]
        kind, message = doc.get("type"), doc.get("message")
        if kind == "system" and doc.get("subtype") == "compact_boundary":
            self._conversation(doc).restart()  # 2.x: the summary that follows chains to this line, not to null
            return
        if kind == "system" and doc.get("subtype") == "microcompact_boundary":
            meta = doc.get("microcompactMetadata")
            cleared = meta.get("compactedToolIds") if isinstance(meta, dict) else None
            if isinstance(cleared, list):
                self._conversation(doc).clear_results({i for i in cleared if isinstance(i, str)})
            return
        if kind == "attachment":
            conv = self._conversation(doc)
            text = _attachment_text(doc.get("attachment"))
            if text:
                conv.pending.append(text)
            conv.last_time = parse_time(doc.get("timestamp")) or conv.last_time
            return
        if kind not in ("user", "assistant") or not isinstance(message, dict):
            return
        conv = self._conversation(doc)
        if isinstance(doc.get("cwd"), str) and not conv.project:
            conv.project = doc["cwd"]
        if kind == "user":
            self._user(conv, doc, message)
        else:
            self._assistant(conv, doc, message)
        if isinstance(doc.get("uuid"), str):
            conv.length_at[doc["uuid"]] = len(conv.history)

    def _user(self, conv: _Conversation, doc: dict[str, Any], message: dict[str, Any]) -> None:
        history = conv.history
        parent = doc.get("parentUuid")
        blocks = _blocks(message.get("content"))
        if parent is None:
            conv.restart()  # a new chain: 1.0.x's /compact summary, or a fresh conversation in the file
        elif not any(b.get("type") == "tool_result" for b in blocks):
            branched = conv.length_at.get(parent) if isinstance(parent, str) else None
            if branched is not None and branched < len(history):  # a prompt after an earlier line: a rewind
                conv.rewind(branched)
        if not history:  # Claude Code's first message opens with a context reminder (the date...)
            blocks = [{"type": "text", "text": envelopes()[CLAUDE_CODE]["first_reminder"]}, *blocks]
        blocks = [{"type": "text", "text": f"<system-reminder>\n{t}\n</system-reminder>"} for t in conv.pending] + blocks
        conv.pending.clear()
        if history and history[-1]["role"] == "user":  # consecutive user lines: one message
            history[-1] = {"role": "user", "content": _blocks(history[-1]["content"]) + blocks}
        else:
            history.append({"role": "user", "content": blocks})
        conv.last_time = parse_time(doc.get("timestamp")) or conv.last_time

    def _assistant(self, conv: _Conversation, doc: dict[str, Any], message: dict[str, Any]) -> None:
        """A line of a response. Claude Code 2.x writes one line per content block, and a tool result
        may come between two of them: a later line adds its block to the same assistant message and
        its usage (the final output count, where the transcript records one) to the same request."""
        response = _response_id(doc, message)
        blocks = _blocks(message.get("content"))
        usage = _claude_usage(message.get("usage"))
        if response is not None and response in conv.answers:
            at = conv.answers[response]
            conv.history[at] = {**conv.history[at], "content": conv.history[at]["content"] + blocks}
            billed = conv.billed_as.get(response)
            if billed is not None and billed in conv.unstopped:
                if _unstopped(message):
                    conv.unstopped[billed] += blocks
                else:
                    del conv.unstopped[billed]
            if billed is not None and usage is not None:
                request = conv.requests[billed]
                conv.requests[billed] = attrs.evolve(request, output_tokens=max(request.output_tokens, usage.output),
                                                     billed=usage)
            return
        if conv.pending:  # what came after the user's message goes as a system message (Claude Code's beta)
            conv.history.append({"role": "system", "content": "\n\n".join(conv.pending)})
            conv.pending.clear()
        model = message.get("model") if isinstance(message.get("model"), str) else None
        sent = conv.last_time if conv.last_time is not None else parse_time(doc.get("timestamp"))
        if response is not None and response in self.tally.counted:
            self.tally.copies += 1
        elif model == "<synthetic>" or not conv.history:
            pass  # Claude Code's own placeholder for an error: nothing was sent for it
        elif sent is None:
            self.tally.untimed += 1
        else:
            if response is not None:
                self.tally.counted.add(response)
                conv.billed_as[response] = len(conv.requests)
            if conv.unseen is None:
                conv.unseen = self._unseen(conv, model or "claude-sonnet-4-5", usage)
            body = claude_body(conv.history, model or "claude-sonnet-4-5", self.ttl, conv.unseen)
            if _unstopped(message):
                conv.unstopped[len(conv.requests)] = list(blocks)
            conv.requests.append(Request(sent, MESSAGES, serialize(body), model, usage.output if usage else 0, usage,
                                         conv.unseen))
        if response is not None:
            conv.answers[response] = len(conv.history)
        conv.history.append({"role": "assistant", "content": blocks})

    def _unseen(self, conv: _Conversation, model: str, usage: Tokens | None) -> int:
        """How many tokens a conversation's first request held beyond what it is rebuilt with: its
        recorded prompt (input, cache reads and writes) less the rebuilt body's, as the replay
        counts it. The envelope is one version's, without the user's CLAUDE.md or MCP tools, and
        cg's estimate is not the provider's count; sizing the envelope by the difference makes
        every later request of the conversation carry it too, as the real ones did. Negative only
        for a sub-agent, which has fewer tools than the main envelope's (a main chain's recorded
        prompt below the rebuilt one is left alone: an older version's, or a test's fake usage)."""
        if usage is None:
            return 0
        body = claude_body(conv.history, model, self.ttl)
        rebuilt = sum(s.tokens for s in segments(body, MESSAGES_SHAPE))
        tools = sum(s.tokens for s in segments({"tools": body["tools"]}, MESSAGES_SHAPE)) if conv.sidechain else 0
        return max(-tools, usage.prompt - rebuilt)

    def sessions(self) -> list[Session]:
        if self.main is not None:
            self.main.id = self.session_id or self.path.stem
        conversations = ([self.main] if self.main else []) + self.sidechains
        for conv in conversations:
            for at, blocks in conv.unstopped.items():
                conv.requests[at] = _output_estimated(conv.requests[at], blocks)
        return [Session(CLAUDE_CODE, c.id, str(self.path), c.project, tuple(c.requests),
                        (SIDECHAIN_NOTE,) if c.sidechain else (), c.sidechain, self.session_id or self.path.stem)
                for c in conversations if c.requests]


def _unstopped(message: dict[str, Any]) -> bool:
    """A line that says its response had not stopped when it was written (``stop_reason: null``)."""
    return "stop_reason" in message and message["stop_reason"] is None


# The most output a response's usage counts when its first block begins (the API's message_start:
# 1 to 9 on real transcripts).
START_OUTPUT_TOKENS = 10


def _output_not_final(recorded: int, content: int) -> bool:
    """Whether a response none of whose lines says it stopped recorded the output count its first
    block began with, not the final one. On real transcripts Claude Code 2.1.12 to 2.1.49 wrote
    nearly every response's lines as its blocks began, with that count; 1.0.x a third of them
    (1.0.89-1.0.90; the rest with the final count); 2.1.81 on write the last line with its
    stop_reason and the final count. A first block's count is far below the content (``content``
    tokens by cg's estimate), a final one in its range; the margin leaves alone a response that
    wrote little."""
    return recorded <= START_OUTPUT_TOKENS and content > 4 * recorded


def _output_estimated(request: Request, blocks: list[dict[str, Any]]) -> Request:
    """``request`` with its output at cg's estimate of its response's content (thinking, text, tool
    calls, sized as a prompt's blocks are) where the count its transcript recorded was not final."""
    if request.billed is None:
        return request  # nothing recorded: nothing to correct
    content = sum(s.tokens for s in segments({"messages": [{"role": "assistant", "content": blocks}]}, MESSAGES_SHAPE))
    if not _output_not_final(request.output_tokens, content):
        return request
    return attrs.evolve(request, output_tokens=content, billed=attrs.evolve(request.billed, output=content),
                        output_recorded=request.output_tokens)


RECORDED = "recorded"  # a ttl: the lifetime the transcript's own usage shows the client asked for


_ONE_HOUR_WRITES = re.compile(rb'"ephemeral_1h_input_tokens"\s*:\s*[1-9]')


def recorded_ttl(data: bytes) -> str | None:
    """``"1h"`` where a transcript's recorded usage (``data``, the file's bytes) has one-hour cache
    writes (Claude Code asks for them on some plans), else None: the five-minute default. Found in
    the bytes: the lifetime decides every body built from the first line on."""
    return "1h" if _ONE_HOUR_WRITES.search(data) else None


def read_claude_code(path: Path, ttl: str | None = None, tally: Tally | None = None) -> list[Session]:
    """The conversations of one Claude Code transcript file: its main chain and each sub-agent's side
    chain (inline, or a whole ``agent-*.jsonl`` file), each response counted once across the files
    read with the same ``tally``. ``ttl``: the breakpoints' lifetime (None: five minutes; RECORDED:
    as the file's own usage shows). The file is read once (a user's can hold hundreds of MB)."""
    with open(path, "rb") as stream:
        data = stream.read()
    if ttl == RECORDED:
        ttl = recorded_ttl(data)
    reader = _ClaudeReader(path, ttl, Tally() if tally is None else tally)
    for doc in _docs(data.splitlines()):
        reader.line(doc)
    return reader.sessions()


# ---------------------------------------------------------------------------------------------
# Codex CLI

# Items a response adds to the history (everything else in it is input the client sent).
_OUTPUT_ITEMS = frozenset({"reasoning", "function_call", "custom_tool_call", "local_shell_call",
                           "web_search_call", "image_generation_call", "tool_search_call"})
# Rollout-only keys Codex does not send to a custom provider.
_ROLLOUT_ONLY = ("internal_chat_message_metadata_passthrough",)


def _is_output(item: dict[str, Any]) -> bool:
    if item.get("type") == "message":
        return item.get("role") == "assistant"
    return item.get("type") in _OUTPUT_ITEMS


def codex_body(items: list[dict[str, Any]], model: str, session_id: str) -> dict[str, Any]:
    """A Responses body as Codex builds one around ``items`` (its envelope's tools and options)."""
    env = envelopes()[CODEX]
    return {"model": model, "stream": True, "input": items, "tools": env["tools"], **env["after"],
            "prompt_cache_key": session_id, "text": env["text"]}


def read_codex(path: Path) -> list[Session]:
    """The session of one Codex rollout file."""
    items: list[dict[str, Any]] = []
    requests: list[Request] = []
    notes: list[str] = []
    session_id, project, model = path.stem, "", str(envelopes()[CODEX]["model"])
    last_input_time: float | None = None
    in_response = False
    open_request: int | None = None  # the request whose response is being read (for its usage)
    for doc in _lines(path):
        kind, payload = doc.get("type"), doc.get("payload")
        if not isinstance(payload, dict):
            continue
        when = parse_time(doc.get("timestamp"))
        if kind == "session_meta":
            session_id = str(payload.get("id") or session_id)
            project = str(payload.get("cwd") or project)
            base = payload.get("base_instructions")
            text = base.get("text") if isinstance(base, dict) else None
            if isinstance(text, str) and not items:
                ident = uuid.uuid5(uuid.NAMESPACE_URL, f"codex-base-instructions:{session_id}")
                items.append({"type": "message", "id": f"msg_{ident}", "role": "developer",
                              "content": [{"type": "input_text", "text": text}]})
        elif kind == "turn_context" and isinstance(payload.get("model"), str):
            model = payload["model"]
        elif kind == "compacted":
            replacement = payload.get("replacement_history")
            if isinstance(replacement, list):
                items = [i for i in replacement if isinstance(i, dict)]
                notes.append("a compaction replaced the history")
        elif kind == "token_usage_record" and open_request is not None:
            usage = payload.get("usage")
            if isinstance(usage, dict):
                cached = _count(usage.get("cached_input_tokens"))
                billed = Tokens(input=max(0, _count(usage.get("input_tokens")) - cached), cache_read=cached,
                                output=_count(usage.get("output_tokens")))
                requests[open_request] = attrs.evolve(requests[open_request], output_tokens=billed.output,
                                                      billed=billed)
            open_request = None
        elif kind == "response_item":
            item = {k: v for k, v in payload.items() if k not in _ROLLOUT_ONLY}
            if _is_output(item):
                if not in_response:
                    in_response = True
                    sent = last_input_time if last_input_time is not None else when
                    if sent is not None:
                        requests.append(Request(sent, RESPONSES, serialize(codex_body(list(items), model, session_id)),
                                                model))
                        open_request = len(requests) - 1
            else:
                in_response = False
                last_input_time = when or last_input_time
            items.append(item)
    if not requests:
        return []
    return [Session(CODEX, session_id, str(path), project, tuple(requests), tuple(notes))]


# ---------------------------------------------------------------------------------------------
# Finding them


def default_dirs() -> dict[str, Path]:
    """Where the clients keep their transcripts for this user ($CLAUDE_CONFIG_DIR, $CODEX_HOME)."""
    home = Path.home()
    claude = Path(os.environ.get("CLAUDE_CONFIG_DIR") or home / ".claude") / "projects"
    codex = Path(os.environ.get("CODEX_HOME") or home / ".codex") / "sessions"
    return {CLAUDE_CODE: claude, CODEX: codex}


def find(root: Path) -> list[tuple[str, Path]]:
    """(client, file) for every transcript under ``root``: a Claude Code projects directory, a Codex
    sessions directory, a HOME holding either, or one file."""
    if root.is_file():
        return [(_kind_of(root), root)]
    out: list[tuple[str, Path]] = []
    for client, sub in ((CLAUDE_CODE, ".claude/projects"), (CODEX, ".codex/sessions")):
        if (root / sub).is_dir():
            out += [(client, p) for p in (root / sub).rglob("*.jsonl")]
    if not out:
        out = [(_kind_of(p), p) for p in root.rglob("*.jsonl")]
    # In the order their sessions began: a response in more than one file is counted in the first
    # read (`read`), which must be the session it was made in, not one resumed from it. Codex's
    # file names begin with the session's start; Claude Code's are a UUID.
    return sorted(out, key=lambda found: (_began(found[1]) if found[0] == CLAUDE_CODE else 0.0, str(found[1])))


def _began(path: Path) -> float:
    """When a Claude Code file's own session began: the first timestamp of a line of its own session
    (a resumed file begins with a copy of the one it continues, with that one's id and times), else
    of any line (a sub-agent's file carries its parent's id); a file with none sorts last."""
    own, first = path.stem, math.inf
    try:
        with open(path, "rb") as stream:
            for line in stream:
                if first != math.inf and own.startswith("agent-"):
                    break  # a sub-agent's file has no session of its own, and copies none: read no further
                if first != math.inf and own.encode() not in line:
                    continue  # only a line of its own session can come before what was found
                try:
                    doc = json.loads(line)
                except ValueError:
                    continue
                when = parse_time(doc.get("timestamp")) if isinstance(doc, dict) else None
                if when is not None and doc.get("sessionId") == own:
                    return when
                if when is not None and first == math.inf:
                    first = when
    except OSError:
        pass  # read (and reported) as the others are
    return first


def _kind_of(path: Path) -> str:
    """Codex's rollout files start with a session_meta line; anything else is read as Claude Code's."""
    try:
        with open(path, "rb") as stream:
            first = stream.readline(1 << 20)
        doc = json.loads(first)
    except (OSError, ValueError):
        return CLAUDE_CODE
    return CODEX if isinstance(doc, dict) and doc.get("type") == "session_meta" else CLAUDE_CODE


def read(files: Iterable[tuple[str, Path]], ttl: str | None = None, tally: Tally | None = None) -> Iterator[Session]:
    """Every session of ``files``; a response in more than one file is counted in the first."""
    tally = Tally() if tally is None else tally
    for client, path in files:
        yield from (read_codex(path) if client == CODEX else read_claude_code(path, ttl, tally))
