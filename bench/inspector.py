"""Streaming through the inspector: Claude Code-shaped streams direct and through cg, in one run.

    python bench/inspector.py [--quick] [--json PATH]

The processes and the client are overhead.py's (imported from it): the fake provider
(``python -m cg.testing --port 0``), cg (``twistd -n cg``, here with ``--store
sqlite:<tmp>`` so originals never land in the user's store; ``--expand`` is on by default)
and this process, a raw HTTP/1.1 client on Twisted that also timestamps every SSE event of a
response the moment its blank line arrives. Every figure through cg is paired with the same
one measured direct to the fake, in alternating order, in the same run.

The requests are Claude Code's (``tests/fixtures/claude-code/p_second_request_tool_result.json``:
its system prompt and 24 tools, so cg injects ``context_guru_expand`` and the stream goes
through the inspector):

- marker-free: the fixture as it is (its one tool result is small: nothing is offloaded);
- marker-bearing: the fixture's history with a 60 KB Bash output (as tests/helpers/bodies.py's
  ``history(command_output(), ...)`` builds it), which cg offloads behind a ``<<cg:ID>>`` marker,
  so the body cg forwards carries one. The same body each time: after the warm-up, cg's rewrite
  is warm (memoized) and the original already stored, as on a re-sent history.

Measured:
 1. A stream of 20 text deltas 50 ms apart (the fake's ``x-fake-events``/``x-fake-delay-ms``):
    time to first byte (after the headers), time to the first ``text_delta`` event fully
    received, and total; marker-free, marker-bearing, and the marker-bearing body sent with
    ``x-cg-bypass: 1`` (cg's pass-through path on the same bytes: what the rewrite and the
    inspector add, apart from proxying); medians of 15 trials.
 2. A spliced round trip (the fake's ``x-fake-expand: ID``): the upstream's first round is a text
    block (5 deltas, 50 ms apart) and a ``context_guru_expand`` call for the offloaded ID;
    cg resolves it from its store, sends the continuation and splices it in. Through cg: the
    time from the request to the continuation's first text delta at the client. Direct, the
    client plays the loop itself (reads round 1 to its end, then sends its own uncompacted
    history, the assistant turn and the original as the tool result: a larger body than
    cg's compacted one): round 1's time plus the upstream's own latency (continuation
    request to its first text delta).
 3. In-process, pinned to one CPU, no sockets: events/s of ``cg.wire.sse.SSEParser`` +
    ``cg.stream.inspector.Inspector`` (and of ``cg.stream.chat_inspector.ChatInspector`` over chat
    streams, and ``cg.stream.responses_inspector.ResponsesInspector`` over Responses API streams
    where this cg has it) over long generated streams, next to the parser alone and the
    pass-through path's usage meter (``cg.stream.usage.ResponseUsage``); and memory per inspected
    stream two ways: tracemalloc around N parser+inspector pairs holding a stream open (the
    inspector's own state), and cg's RSS with N marker-bearing streams open at once (all an
    inspected Claude Code stream costs cg: request bodies, Twisted, the inspector).

Also cg's CPU per request (from /proc, 10 ms ticks summed over the trials), the busy cores
of other processes during each phase, and cg's /stats stream counters. Both subprocesses
are killed on exit, whatever happens.
"""

from __future__ import annotations

import copy
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

from overhead import (
    HOST,
    HTTPConn,
    ResponseError,
    Rows,
    _align,
    _child_env,
    _with_timeout,
    busy_s,
    clock,
    cpu_s,
    drive,
    http_get,
    ms,
    parse_args,
    pct,
    report,
    rss_kib,
    run_dir,
    sleep,
    start_fake,
)
from overhead import start_cg as _start_cg
from twisted.internet import defer, reactor
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "claude-code" / "p_second_request_tool_result.json"
TARGET_MS = 5.0  # marker-bearing time to first text delta, cg - direct
TARGET_EVENTS_S = 50_000

# ---------------------------------------------------------------------------------------------
# Requests


def fixture() -> dict:
    try:
        return json.loads(FIXTURE.read_text())
    except OSError as e:
        raise SystemExit(f"cannot read the Claude Code fixture ({e}); run from a checkout of cg") from e


def history(base: dict, bash_output: str, read_output: str) -> dict:
    """As tests/helpers/bodies.py's history: the fixture's Bash turn with ``bash_output``, then a Read turn."""
    body = copy.deepcopy(base["body"])
    body["messages"][3]["content"][0]["content"] = bash_output
    body["messages"] += [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_read1", "name": "Read",
                                           "input": {"file_path": "/repo/big.ts"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_read1",
                                      "content": read_output}]},
    ]
    return body


def continuation(body: dict, texts: str, ref: str, original: str) -> dict:
    """The request after an ``x-fake-expand`` round: the assistant turn and the original as its result."""
    from cg.testing import FAKE_EXPAND_ID

    out = copy.deepcopy(body)
    out["messages"] += [
        {"role": "assistant", "content": [
            {"type": "text", "text": texts},
            {"type": "tool_use", "id": FAKE_EXPAND_ID, "name": "context_guru_expand", "input": {"id": ref}},
        ]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": FAKE_EXPAND_ID, "content": original}]},
    ]
    return out


_DROP = {"host", "content-length", "connection", "accept-encoding"}  # framing; and no gzip here


def post(port: int, raw: bytes, headers: dict, shape: dict) -> bytes:
    """POST /v1/messages?beta=true with Claude Code's headers and the fake's shaping headers."""
    head = ["POST /v1/messages?beta=true HTTP/1.1", f"Host: {HOST}:{port}", "x-api-key: sk-ant-bench"]
    head += [f"{k}: {v}" for k, v in headers.items() if k.lower() not in _DROP]
    head += [f"{k}: {v}" for k, v in shape.items()]
    head.append(f"Content-Length: {len(raw)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + raw


# ---------------------------------------------------------------------------------------------
# The client: overhead.py's HTTPConn, plus a timestamp for every complete SSE event


class SSEConn(HTTPConn):
    """One keep-alive connection; ``events`` holds (seconds since the request was written, raw
    event) for each event of the last response, stamped when its terminating blank line arrived
    (the fake and cg both end events with LF LF)."""

    def request(self, data: bytes, timeout: float = 30.0) -> defer.Deferred:
        self.events: list[tuple[float, bytes]] = []
        self._sse = b""
        return super().request(data, timeout)

    def dataReceived(self, data):
        self._now = clock()
        super().dataReceived(data)

    def _body(self, data: bytes) -> None:
        if not data:
            return
        self._sse += data
        while (end := self._sse.find(b"\n\n")) >= 0:
            self.events.append((self._now - self._t0, self._sse[: end + 2]))
            self._sse = self._sse[end + 2 :]


def sse_connect(port: int) -> defer.Deferred:
    return connectProtocol(TCP4ClientEndpoint(reactor, HOST, port, timeout=10), SSEConn())


def _data(raw: bytes) -> dict:
    lines = [line[5:].lstrip() for line in raw.split(b"\n") if line.startswith(b"data:")]
    try:
        doc = json.loads(b"\n".join(lines))
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def first_text(events: list[tuple[float, bytes]], min_index: int = 0) -> float | None:
    """When the first text_delta event (of a block at ``min_index`` or later) was complete."""
    for t, raw in events:
        if b'"text_delta"' in raw:
            doc = _data(raw)
            if doc.get("type") == "content_block_delta" and doc.get("index", -1) >= min_index:
                return t
    return None


def body_of(events: list[tuple[float, bytes]]) -> bytes:
    return b"".join(raw for _, raw in events)


# ---------------------------------------------------------------------------------------------
# Processes


def start_cg(tmp: Path, env: dict, upstream_port: int) -> tuple[subprocess.Popen, int]:
    """overhead.start_cg, with a store of its own in ``tmp``; waits for /healthz."""
    return _start_cg(tmp, env, upstream_port, ("--store", f"sqlite:{tmp / 'store.sqlite3'}"))


def steal_s() -> float:
    """CPU seconds the hypervisor gave to other guests while this one wanted them (all cores)."""
    with open("/proc/stat") as f:
        return int(f.readline().split()[8]) / os.sysconf("SC_CLK_TCK")


class Load:
    """Busy cores of every other process on the machine over a phase (steal included), from /proc."""

    def __init__(self, pids: list[int | None]):
        self.pids = pids
        self.t = clock()
        self.busy = busy_s()
        self.steal = steal_s()
        self.own = sum(cpu_s(p) for p in pids)

    def others(self) -> float:
        dt = clock() - self.t
        others = busy_s() - self.busy - (sum(cpu_s(p) for p in self.pids) - self.own)
        return round(max(0.0, others / dt), 3) if dt > 0 else 0.0

    def stolen(self) -> float:
        dt = clock() - self.t
        return round(max(0.0, (steal_s() - self.steal) / dt), 3) if dt > 0 else 0.0


def revision() -> str:
    """The checkout's commit, and whether cg/ differs from it (the bench may run a work in progress)."""
    import cg

    root = Path(cg.__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "cg"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return f"cg from {root}"
    return f"cg from {root} at {head or '?'}{' with local changes in cg/' if dirty else ''}"


def _med(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


# ---------------------------------------------------------------------------------------------
# 3. In-process: the inspector's throughput and memory


def _texts(rnd: random.Random, n: int) -> list[str]:
    """``n`` text deltas of 1-6 words, about what the API streams."""
    words = ("the of and to in is that for it as with was on be by this are or from at an function "
             "return value error file test `cg` café naïve → ✓").split()
    return [" " + " ".join(rnd.choice(words) for _ in range(rnd.randint(1, 6))) for _ in range(n)]


def recorded_streams(n: int) -> dict[str, list[bytes]]:
    """Long Anthropic streams built with cg.testing's builders; each round a list of its events."""
    from cg.testing import (
        anthropic_expand_block,
        anthropic_stream_events,
        anthropic_text_block,
        anthropic_thinking_block,
        anthropic_tool_block,
    )

    rnd = random.Random(5)
    answer = anthropic_stream_events(
        blocks=[anthropic_thinking_block(0, " ".join(_texts(rnd, 40))), anthropic_text_block(1, _texts(rnd, n))]
    )
    code = json.dumps({"file_path": "/repo/src/app.ts", "content": "".join(_texts(rnd, n))})
    parts = [code[i * len(code) // n : (i + 1) * len(code) // n] for i in range(n)]
    tool = anthropic_stream_events(
        blocks=[anthropic_text_block(0, _texts(rnd, 20)), anthropic_tool_block(1, "Write", parts)],
        stop_reason="tool_use",
    )
    expand = anthropic_stream_events(
        blocks=[anthropic_text_block(0, _texts(rnd, 5)), anthropic_expand_block(1, "0123456789abcdef")],
        stop_reason="tool_use",
    )
    cont = anthropic_stream_events(_texts(rnd, n))
    return {"answer": answer, "tool": tool, "expand": expand, "continuation": cont, **chat_streams(rnd, n),
            **responses_streams(rnd, n)}


def chat_streams(rnd: random.Random, n: int) -> dict[str, list[bytes]]:
    """Long chat.completion.chunk streams: an answer, and a round whose lone call is cg's expand."""
    from cg.testing import openai_stream_events
    from cg.wire.markers import EXPAND_TOOL

    answer = openai_stream_events(_texts(rnd, n), include_usage=True)
    args = '{"id":"0123456789abcdef"}'
    expand = openai_stream_events(_texts(rnd, 5), calls=[("call_x", EXPAND_TOOL, (args[:7], args[7:]))])
    return {"chat answer": answer, "chat expand": expand, "chat continuation": openai_stream_events(_texts(rnd, n))}


def responses_streams(rnd: random.Random, n: int) -> dict[str, list[bytes]]:
    """Long Responses API streams: reasoning then a long answer, and a round whose lone call is cg's
    expand (after a short message)."""
    from cg.testing import (
        responses_function_call,
        responses_message,
        responses_reasoning,
        responses_stream_events,
    )
    from cg.wire.markers import EXPAND_TOOL

    answer = responses_stream_events([responses_reasoning(), responses_message("".join(_texts(rnd, n)))], deltas=n)
    call = responses_function_call(EXPAND_TOOL, '{"id":"0123456789abcdef"}', "call_x", "fc_x")
    expand = responses_stream_events([responses_message("".join(_texts(rnd, 5))), call], deltas=5)
    cont = responses_stream_events([responses_message("".join(_texts(rnd, n)), id="msg_2")], deltas=n, id="resp_2")
    return {"responses answer": answer, "responses expand": expand, "responses continuation": cont}


def has_responses_inspector() -> bool:
    """Whether this cg has the Responses stream inspector (it lands after the other two)."""
    import importlib.util

    return importlib.util.find_spec("cg.stream.responses_inspector") is not None


def _chunks(events: list[bytes], size: int | None) -> list[bytes]:
    """One chunk per event (as the API writes them), or the stream cut every ``size`` bytes."""
    if size is None:
        return list(events)
    data = b"".join(events)
    return [data[i : i + size] for i in range(0, len(data), size)]


def _run_parser(rounds):
    from cg.wire.sse import SSEParser

    n = 0
    for chunks in rounds:
        parser = SSEParser()
        for chunk in chunks:
            n += len(parser.feed(chunk))
    return n


def _run_meter(rounds):
    from cg.stream.usage import ResponseUsage
    from cg.wire.dialect import MESSAGES_SHAPE

    for chunks in rounds:
        meter = ResponseUsage(MESSAGES_SHAPE, True)
        for chunk in chunks:
            meter.feed(chunk)
    return None


def _new_inspector(family: str):
    from cg.stream.chat_inspector import ChatInspector
    from cg.stream.inspector import Inspector

    if family == "responses":
        from cg.stream.responses_inspector import ResponsesInspector

        return ResponsesInspector()
    return ChatInspector(hide_usage=True) if family == "chat" else Inspector()


def _run_inspector(rounds, family: str = "anthropic"):
    """Every round through one inspector of the stream family's (Inspector, ChatInspector,
    ResponsesInspector), as the exchange drives it (EXPAND -> begin_continuation)."""
    from cg.stream.inspector import EXPAND, State
    from cg.wire.sse import SSEParser

    inspector = _new_inspector(family)
    n = 0
    sent = 0
    for k, chunks in enumerate(rounds):
        if k:
            inspector.begin_continuation()
        parser = SSEParser()
        for chunk in chunks:
            for event in parser.feed(chunk):
                n += 1
                step = inspector.feed(event)
                sent += len(step.send)
        if inspector.state is not State.AWAIT:
            step = inspector.end(True, parser.close())
        assert (inspector.state is State.AWAIT) == (k < len(rounds) - 1), "a round before the last did not expand"
    assert step.action != EXPAND
    return n


def throughput(quick: bool, families: tuple[str, ...] = ("anthropic", "chat", "responses")) -> dict:
    """events/s of parser alone, pass-through meter and parser + inspector, interleaved reps; the
    cases of the stream ``families`` asked for (anthropic, chat, responses: when this cg has its
    inspector)."""
    n = 1000 if quick else 5000
    reps = 5 if quick else 31
    streams = recorded_streams(n)
    cases = [
        # family, label, rounds (lists of events), chunk size, pipelines
        ("anthropic", "long answer (thinking, then text), one chunk per event", [streams["answer"]], None,
         ("parser", "meter", "inspector")),
        ("anthropic", "long answer, 16 KiB chunks", [streams["answer"]], 16384, ("parser", "meter", "inspector")),
        ("anthropic", "text, then a client tool_use (Write) with its input in deltas", [streams["tool"]], None,
         ("parser", "inspector")),
        ("anthropic", "spliced: text + expand call, then a long continuation (renumbered)",
         [streams["expand"], streams["continuation"]], None, ("parser", "inspector")),
        ("chat", "chat: long answer, one chunk per event", [streams["chat answer"]], None, ("parser", "chat")),
        ("chat", "chat spliced: text + expand call, then a long continuation (re-serialized)",
         [streams["chat expand"], streams["chat continuation"]], None, ("parser", "chat")),
        ("responses", "Responses: reasoning, then a long answer, one chunk per event", [streams["responses answer"]],
         None, ("parser", "responses")),
        ("responses", "Responses spliced: message + expand call, then a long continuation (re-serialized)",
         [streams["responses expand"], streams["responses continuation"]], None, ("parser", "responses")),
    ]
    runners = {"parser": _run_parser, "meter": _run_meter, "inspector": _run_inspector,
               "chat": lambda rounds: _run_inspector(rounds, "chat"),
               "responses": lambda rounds: _run_inspector(rounds, "responses")}
    if not has_responses_inspector():
        families = tuple(f for f in families if f != "responses")
    out = []
    for family, label, rounds, size, pipes in cases:
        if family not in families:
            continue
        chunked = [_chunks(r, size) for r in rounds]
        events = sum(len(r) for r in rounds)
        assert _run_parser(chunked) == events
        assert runners[pipes[-1]](chunked) == events
        nbytes = sum(len(e) for r in rounds for e in r)
        samples: dict[str, list[float]] = {p: [] for p in pipes}
        for i in range(reps):
            order = pipes if i % 2 == 0 else tuple(reversed(pipes))
            for p in order:
                gc.collect()
                gc.disable()
                try:
                    t0 = time.perf_counter()
                    runners[p](chunked)
                    samples[p].append(time.perf_counter() - t0)
                finally:
                    gc.enable()
        out.append({
            "family": family,
            "label": label,
            "events": events,
            "bytes": nbytes,
            "chunks": sum(len(c) for c in chunked),
            "reps": reps,
            "seconds": {p: s for p, s in samples.items()},
            "events_per_s": {p: round(events / _med(s)) for p, s in samples.items()},
            "best_events_per_s": {p: round(events / min(s)) for p, s in samples.items()},
            # Per rep, the pipeline's time over the parser's in the same rep: robust to the host
            # switching speed between reps (it does, by up to 2x, on a shared virtual machine).
            "over_parser": {p: round(_med([a / b for a, b in zip(s, samples["parser"])]), 3)
                            for p, s in samples.items()},
        })
    return {"cases": out}


def memory(quick: bool, fake_stream: list[bytes]) -> dict:
    """tracemalloc: N parser+inspector pairs, each fed a stream up to its last block's end (open)."""
    from cg.stream.inspector import Inspector
    from cg.testing import anthropic_stream_events, anthropic_text_block, anthropic_thinking_block
    from cg.wire.sse import SSEParser

    n_streams = 50 if quick else 200
    rnd = random.Random(7)
    turn = anthropic_stream_events(
        blocks=[anthropic_thinking_block(0, " ".join(_texts(rnd, 30))), anthropic_text_block(1, _texts(rnd, 300))]
    )
    long = anthropic_stream_events(_texts(rnd, 2000))
    out = []
    for label, events in (
        ("the fake's 20-delta stream (section 1)", fake_stream),
        ("a 300-delta answer after thinking", turn),
        ("a 2000-delta answer", long),
    ):
        body = events[:-2]  # message_delta and message_stop not yet arrived: the stream is open
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        held = []
        for _ in range(n_streams):
            parser, inspector = SSEParser(), Inspector()
            for chunk in body:
                for event in parser.feed(chunk):
                    inspector.feed(event)
            held.append((parser, inspector))
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        del held
        out.append({
            "label": label,
            "events": len(body),
            "stream_bytes": sum(len(e) for e in body),
            "streams": n_streams,
            "per_stream_kib": round((after - before) / n_streams / 1024, 2),
        })
    return {"streams": n_streams, "cases": out}


def in_process(quick: bool, fake_stream: list[bytes] | None = None,
               families: tuple[str, ...] = ("anthropic", "chat", "responses")) -> dict:
    """Section 3, pinned to one CPU (the affinity is restored after); the memory cases only with
    ``fake_stream`` (the fake's Anthropic stream)."""
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    cpu = max(affinity) if affinity else None
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    load = Load([None])
    try:
        tp = throughput(quick, families)
        mem = memory(quick, fake_stream) if fake_stream is not None else None
    finally:
        if affinity:
            os.sched_setaffinity(0, affinity)
    return {"cpu": cpu, "throughput": tp, "memory": mem, "others_cores": load.others(), "steal_cores": load.stolen()}


PIPES = {"parser": "SSEParser alone", "meter": "pass-through meter", "inspector": "SSEParser + Inspector",
         "chat": "SSEParser + ChatInspector", "responses": "SSEParser + ResponsesInspector"}


def throughput_lines(tp: dict) -> list[str]:
    """Section 3's table of events/s, and the target line."""
    lines = [("", "events", "KB", "events/s", "us/event", "best ev/s", "/ parser")]
    for case in tp["cases"]:
        lines.append((f"   {case['label']}", "", "", "", "", "", ""))
        for pipe, eps in case["events_per_s"].items():
            lines.append((f"     {PIPES[pipe]}", str(case["events"]), f"{case['bytes'] / 1000:.0f}",
                          f"{eps:,}", f"{1e6 / eps:.2f}", f"{case['best_events_per_s'][pipe]:,}",
                          f"{case['over_parser'][pipe]:.2f}x"))
    widths = [max(len(x[i]) for x in lines) for i in range(7)]
    out = ["  ".join([x[0].ljust(widths[0])] + [x[i].rjust(widths[i]) for i in range(1, 7)]).rstrip() for x in lines]
    out.append("   (events/s and us/event: medians; best: the fastest rep; / parser: median over reps of the "
               "time over the parser's in the same rep)")
    inspected = [eps for c in tp["cases"] for pipe, eps in c["events_per_s"].items() if pipe not in ("parser", "meter")]
    out.append(f"   target >= {TARGET_EVENTS_S:,} events/s through the inspectors: slowest case {min(inspected):,}, "
               f"{'met' if min(inspected) >= TARGET_EVENTS_S else 'NOT met'}")
    return out


# ---------------------------------------------------------------------------------------------
# 1, 2 and the RSS: over sockets


class Bench:
    def __init__(self, args, fake, fake_port: int, cg, cg_port: int):
        self.args = args
        self.quick = args.quick
        self.fake_pid, self.fake_port = fake.pid, fake_port
        self.cg_pid, self.cg_port = cg.pid, cg_port
        self.ports = {"direct": fake_port, "cg": cg_port}
        self.results: dict = {}
        from cg.testing import claude_code_bytes, command_output
        from cg.wire.markers import marker_id

        base = fixture()
        self.headers = base["headers"]
        self.bash = command_output()

        self.ref = marker_id(self.bash.encode())
        free = copy.deepcopy(base["body"])
        bearing = history(base, self.bash, "export const x = 1;\n")
        self.bodies = {"marker-free": claude_code_bytes(free), "marker-bearing": claude_code_bytes(bearing)}
        # The marker-bearing body again with x-cg-bypass: 1: cg forwards the client's bytes as they
        # are, on the pass-through path (no rewrite, no inspector). The fake ignores the header.
        self.bodies["bypassed"] = self.bodies["marker-bearing"]
        self.extra = {"bypassed": {"x-cg-bypass": "1"}}
        self.splice_texts = 5
        from cg.testing import _fake_texts

        said = "".join(_fake_texts(self.splice_texts))
        self.cont_body = claude_code_bytes(continuation(bearing, said, self.ref, self.bash))

    def say(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def req(self, side: str, kind: str, **shape) -> bytes:
        shape = {f"x-fake-{k.replace('_', '-')}": v for k, v in shape.items()}
        return post(self.ports[side], self.bodies[kind], self.headers, {**self.extra.get(kind, {}), **shape})

    def stats(self) -> dict:
        return json.loads(http_get(self.cg_port, "/stats")[1])

    async def run(self) -> dict:
        t0 = time.monotonic()
        await self.warmup()
        await self.check()
        # Streams first: later phases leave cg's heap at their high-water mark, which would hide
        # what the open streams cost.
        await self.open_streams()
        await self.side_by_side()
        await self.spliced()
        stats = self.stats()
        self.results["cg_stats"] = {
            k: stats.get(k) for k in ("sse_streamed", "sse_buffered", "sse_buffered_pct", "sse_inspected",
                                      "sse_spliced", "sse_released", "sse_held_events", "expand_rounds",
                                      "added_ttfb", "expand", "client_disconnects", "upstream_errors")
        }
        self.results["elapsed_sockets_s"] = round(time.monotonic() - t0, 1)
        return self.results

    async def warmup(self) -> None:
        """Both bodies and the spliced request a few times each way: cg's memo, store, pools warm."""
        self.say("warm-up")
        conns = {side: await sse_connect(port) for side, port in self.ports.items()}
        for _ in range(2 if self.quick else 4):
            for side, conn in conns.items():
                for kind in ("marker-free", "marker-bearing"):
                    await conn.request(self.req(side, kind, events=3))
                await conn.request(self.req(side, "marker-bearing", events=3, expand=self.ref))
            await conns["direct"].request(post(self.fake_port, self.cont_body, self.headers, {"x-fake-events": 3}))
        for conn in conns.values():
            conn.transport.loseConnection()

    async def check(self) -> None:
        """The setup does what it claims: markers forwarded, the expand spliced, streams valid."""
        from cg.stream.streamcheck import check_anthropic_stream

        status, original = http_get(self.cg_port, f"/cg/expand/{self.ref}")
        if status != 200 or original != self.bash.encode():
            raise SystemExit(f"cg did not store the offloaded Bash output (GET /cg/expand/{self.ref}: {status})")
        conn = await sse_connect(self.cg_port)
        before = self.stats()
        await conn.request(self.req("cg", "marker-free", events=3))
        after = self.stats()
        lossy = sum(
            after["compaction"]["components"].get(c, {}).get("acted", 0)
            - before["compaction"]["components"].get(c, {}).get("acted", 0)
            for c in ("offload", "dedup")
        )
        injected = after["compaction"]["requests_injected"] - before["compaction"]["requests_injected"]
        if lossy or injected != 1 or after["sse_inspected"] != before["sse_inspected"] + 1:
            raise SystemExit("the marker-free request was not marker-free, or not inspected")
        _, _, status = await conn.request(self.req("cg", "marker-bearing", events=3, expand=self.ref))
        data = body_of(conn.events)
        spliced = self.stats()
        problems = check_anthropic_stream(data)
        if status != 200 or problems or spliced["sse_spliced"] != after["sse_spliced"] + 1:
            raise SystemExit(f"the spliced stream is wrong: status {status}, {problems}")
        conn.transport.loseConnection()
        self.results["checks"] = {
            "marker_stored": True,
            "marker_free_lossy_changes": lossy,
            "spliced_stream_problems": problems,
        }

    # 1 ---------------------------------------------------------------------------------------
    async def side_by_side(self) -> None:
        n = 2 if self.quick else 15
        self.say(f"1. 20 text deltas 50 ms apart: {n} trials x {len(self.bodies)} requests x 2 sides")
        conns = {side: await sse_connect(port) for side, port in self.ports.items()}
        out = {kind: {side: {"ttfb": [], "text": [], "total": [], "cpu": 0.0} for side in self.ports}
               for kind in self.bodies}
        load = Load([None, self.fake_pid, self.cg_pid])
        for i in range(n):
            order = list(self.ports) if i % 2 == 0 else list(reversed(self.ports))
            for kind in self.bodies:
                for side in order:
                    req = self.req(side, kind, events=20, delay_ms=50)
                    cpu0 = cpu_s(self.cg_pid)
                    ttfb, total, status = await conns[side].request(req)
                    o = out[kind][side]
                    o["cpu"] += cpu_s(self.cg_pid) - cpu0
                    if status != 200:
                        raise ResponseError(f"{side} {kind}: status {status}")
                    o["ttfb"].append(ttfb)
                    o["text"].append(first_text(conns[side].events))
                    o["total"].append(total)
        for conn in conns.values():
            conn.transport.loseConnection()
        self.results["side_by_side"] = {
            "n": n,
            "others_cores": load.others(),
            "steal_cores": load.stolen(),
            "body_bytes": {kind: len(b) for kind, b in self.bodies.items()},
            **{
                kind: {
                    side: {
                        "ttfb_p50_ms": ms(_med(o["ttfb"])),
                        "first_text_p50_ms": ms(_med(o["text"])),
                        "total_p50_ms": ms(_med(o["total"])),
                        "first_text_p90_ms": ms(pct(o["text"], 90)),
                        "cg_cpu_ms_per_request": round(o["cpu"] * 1000 / n, 2) if side == "cg" else None,
                        "ttfb_ms": [ms(x) for x in o["ttfb"]],
                        "first_text_ms": [ms(x) for x in o["text"]],
                        "total_ms": [ms(x) for x in o["total"]],
                    }
                    for side, o in sides.items()
                }
                for kind, sides in out.items()
            },
        }

    # 2 ---------------------------------------------------------------------------------------
    async def spliced(self) -> None:
        from cg.stream.streamcheck import check_anthropic_stream

        n = 2 if self.quick else 15
        k = self.splice_texts
        self.say(f"2. spliced round trip ({k} text deltas 50 ms apart, then an expand call): {n} trials x 2 sides")
        conns = {side: await sse_connect(port) for side, port in self.ports.items()}
        cont = post(self.fake_port, self.cont_body, self.headers, {"x-fake-events": k, "x-fake-delay-ms": 50})
        keys = ("r1_text", "r1_total", "latency", "loop", "cont_text", "total")
        out = {side: {key: [] for key in keys} | {"cpu": 0.0, "problems": []} for side in self.ports}
        load = Load([None, self.fake_pid, self.cg_pid])
        for i in range(n):
            order = list(self.ports) if i % 2 == 0 else list(reversed(self.ports))
            for side in order:
                conn, o = conns[side], out[side]
                req = self.req(side, "marker-bearing", events=k, delay_ms=50, expand=self.ref)
                cpu0 = cpu_s(self.cg_pid)
                _ttfb, total, status = await conn.request(req)
                if status != 200:
                    raise ResponseError(f"{side} spliced: status {status}")
                o["r1_text"].append(first_text(conn.events))
                if side == "cg":
                    o["cpu"] += cpu_s(self.cg_pid) - cpu0
                    o["cont_text"].append(first_text(conn.events, min_index=1))
                    o["total"].append(total)
                    o["problems"] += check_anthropic_stream(body_of(conn.events))
                else:
                    o["r1_total"].append(total)
                    _ttfb, total2, status = await conn.request(cont)
                    if status != 200:
                        raise ResponseError(f"direct continuation: status {status}")
                    latency = first_text(conn.events)
                    o["latency"].append(latency)
                    o["loop"].append(total + latency)
                    o["total"].append(total + total2)
        for conn in conns.values():
            conn.transport.loseConnection()
        self.results["spliced"] = {
            "n": n,
            "text_deltas_per_round": k,
            "others_cores": load.others(),
            "steal_cores": load.stolen(),
            "continuation_body_bytes_direct": len(self.cont_body),
            **{
                side: {
                    **{f"{key}_p50_ms": ms(_med(o[key])) for key in keys},
                    **{f"{key}_ms": [ms(x) for x in o[key]] for key in keys},
                    "cg_cpu_ms_per_request": round(o["cpu"] * 1000 / n, 2) if side == "cg" else None,
                    "stream_problems": o["problems"][:5],
                    "stream_problem_count": len(o["problems"]),
                }
                for side, o in out.items()
            },
        }

    # memory: RSS -------------------------------------------------------------------------------
    async def open_streams(self) -> None:
        """N marker-bearing streams (1000 deltas 100 ms apart) through cg at once, held open."""
        n = 20 if self.quick else 100
        hold = 1.0 if self.quick else 3.0
        self.say(f"3b. {n} marker-bearing streams open at once through cg, held {hold} s; RSS")
        gc.collect()
        await sleep(0.5)
        idle = rss_kib(self.cg_pid)
        before = self.stats()
        conns = await defer.gatherResults([sse_connect(self.cg_port) for _ in range(n)], consumeErrors=True)
        req = self.req("cg", "marker-bearing", events=1000, delay_ms=100)
        firsts = []
        for conn in conns:
            got = defer.Deferred()
            firsts.append(got)
            orig = conn.dataReceived

            def seen(data, orig=orig, got=got, conn=conn):
                orig(data)
                if not got.called and conn.events:
                    got.callback(conn.events[0][0])

            conn.dataReceived = seen
        opened = clock()
        for conn in conns:
            conn.request(req, timeout=300).addErrback(lambda _: None)
        ttfbs = await _with_timeout(defer.gatherResults(firsts), 60)
        all_open = clock() - opened
        samples = []
        t = clock()
        while clock() - t < hold:
            samples.append(rss_kib(self.cg_pid))
            await sleep(0.1)
        recorded = sum(len(c.events) for c in conns)
        in_flight = self.stats()["in_flight"]
        for conn in conns:
            conn.transport.abortConnection()
        closed = clock()
        while clock() - closed < 10:
            await sleep(0.1)
            if self.stats()["in_flight"] == 0:
                break
        after = self.stats()
        await sleep(0.5)
        with_streams = int(_med(samples))
        self.results["rss"] = {
            "streams": n,
            "hold_s": hold,
            "idle_kib": idle,
            "with_streams_kib": with_streams,
            "with_streams_max_kib": max(samples),
            "per_stream_kib": round((with_streams - idle) / n, 1),
            "after_close_kib": rss_kib(self.cg_pid),
            "events_per_stream_when_cut": round(recorded / n, 1),
            "in_flight_seen": in_flight,
            "inspected": after["sse_inspected"] - before["sse_inspected"],
            "seconds_to_open_all": round(all_open, 3),
            "first_event_p50_ms": ms(_med(ttfbs)),
            "body_bytes": len(self.bodies["marker-bearing"]),
        }


# ---------------------------------------------------------------------------------------------
# The table


def side_by_side_rows(rows: Rows, s: dict, kinds) -> None:
    """Section 1's rows for each (kind, what it is) measured: TTFB, first text delta, total."""
    for kind, what in kinds:
        d, c = s[kind]["direct"], s[kind]["cg"]
        rows.head(f"   {kind} ({s['body_bytes'][kind] / 1000:.0f} KB; {what})")
        rows.row("     TTFB ms", d["ttfb_p50_ms"], c["ttfb_p50_ms"])
        rows.row("     first text delta ms", d["first_text_p50_ms"], c["first_text_p50_ms"])
        rows.row("     total ms", d["total_p50_ms"], c["total_p50_ms"], ".1f")


def spliced_rows(rows: Rows, p: dict, heading: str, round_end: str, last: str) -> None:
    """Section 2's rows: a spliced round trip through cg against the client running the loop."""
    d, c = p["direct"], p["cg"]
    rows.head(heading)
    rows.row("   round 1 first text delta ms", d["r1_text_p50_ms"], c["r1_text_p50_ms"])
    rows.row(f"   round 1 to its {round_end} ms (held by cg)", d["r1_total_p50_ms"], None)
    rows.row("   upstream latency: continuation -> 1st text ms", d["latency_p50_ms"], None)
    rows.row("   request -> continuation's 1st text delta ms", d["loop_p50_ms"], c["cont_text_p50_ms"])
    rows.row(f"   {last}", d["total_p50_ms"], c["total_p50_ms"], ".1f")


def table(r: dict) -> str:
    rows = Rows()
    s = r["side_by_side"]
    rows.head(f"1. 20 text deltas 50 ms apart, Claude Code requests, median of {s['n']} trials")
    side_by_side_rows(rows, s, (("marker-free", "fixture as is; cg injects the tool, nothing offloaded"),
                                ("marker-bearing", "a Bash output offloaded: the forwarded body has a marker"),
                                ("bypassed", "the marker-bearing body with x-cg-bypass: 1: cg's pass-through path")))
    p = r["spliced"]
    d, c = p["direct"], p["cg"]
    spliced_rows(rows, p, f"2. spliced round trip: {p['text_deltas_per_round']} text deltas 50 ms apart + an "
                          f"expand call, median of {p['n']}", "message_stop", "request -> last byte ms")
    m = r["machine"]
    quick = "; --quick" if r["quick"] else ""
    out = [f"{m['date']}; {m['nproc']} cores ({m['cpu']}); Python {m['python']}, Twisted {m['twisted']}{quick}",
           r["revision"], "", *_align(rows)]

    mb = s["marker-bearing"]
    delta = mb["cg"]["first_text_p50_ms"] - mb["direct"]["first_text_p50_ms"]
    out.append("")
    out.append(
        f"target: marker-bearing first text delta within {TARGET_MS:.0f} ms of direct: {delta:+.2f} ms, "
        f"{'met' if delta <= TARGET_MS else 'NOT met'}"
    )
    splice_added = c["cont_text_p50_ms"] - d["loop_p50_ms"]
    out.append(
        f"spliced: cg adds {splice_added:+.2f} ms to the continuation's first text over the client running the "
        f"loop itself; the upstream's own latency is {d['latency_p50_ms']:.2f} ms"
    )
    out.append(
        "cg CPU ms per request (/proc, summed over the trials): "
        + ", ".join(f"{kind} {s[kind]['cg']['cg_cpu_ms_per_request']}" for kind in ("marker-free", "marker-bearing",
                                                                                  "bypassed"))
        + f", spliced {c['cg_cpu_ms_per_request']}"
    )

    ip = r["in_process"]
    out.append("")
    out.append(f"3. in-process, pinned to CPU {ip['cpu']}: events/s, {ip['throughput']['cases'][0]['reps']} reps "
               f"interleaved, gc off while timing")
    out += throughput_lines(ip["throughput"])
    mem = ip["memory"]
    out.append("memory per inspected stream, held open before its message_delta:")
    out.append(f"   inspector state (tracemalloc, {mem['streams']} SSEParser + Inspector pairs in-process):")
    for case in mem["cases"]:
        out.append(f"     {case['label']}: {case['per_stream_kib']:.1f} KiB "
                   f"({case['events']} events, {case['stream_bytes'] / 1024:.1f} KiB of stream)")
    rss = r["rss"]
    out.append(
        f"   cg RSS with {rss['streams']} marker-bearing streams open ({rss['body_bytes'] / 1000:.0f} KB request "
        f"each, cut after ~{rss['events_per_stream_when_cut']:.0f} events): {rss['idle_kib'] / 1024:.1f} -> "
        f"{rss['with_streams_kib'] / 1024:.1f} MiB, {rss['per_stream_kib']:.1f} KiB per stream; "
        f"after they closed {rss['after_close_kib'] / 1024:.1f} MiB; inspected {rss['inspected']}"
    )
    st = r["cg_stats"]
    out.append(
        f"cg /stats: sse_streamed {st['sse_streamed']}, sse_buffered {st['sse_buffered']}, sse_inspected "
        f"{st['sse_inspected']}, sse_spliced {st['sse_spliced']}, sse_released {st['sse_released']}, "
        f"expand_rounds {st['expand_rounds']}; spliced stream check problems: {p['cg']['stream_problem_count']}"
    )
    out.append(
        f"other processes on the machine (busy cores, of {os.cpu_count()}; of which steal): section 1 "
        f"{s['others_cores']:.2f} ({s['steal_cores']:.2f}), section 2 {p['others_cores']:.2f} "
        f"({p['steal_cores']:.2f}), section 3 {ip['others_cores']:.2f} ({ip['steal_cores']:.2f})"
    )
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = parse_args(
        argv, __doc__.split("\n\n")[0], "few trials: a smoke run (< 40 s)", "keep the fake's and cg's logs"
    )
    started = time.monotonic()
    env = _child_env()
    fixture()  # fail early without the fixture
    # Import cg's modules now, so the in-process figures use the code cg's process starts with.
    import cg.stream.inspector
    import cg.stream.usage  # noqa: F401
    import cg.testing
    import cg.wire.sse

    rev = revision()
    with run_dir("cg-bench-inspector-", args.keep_logs) as tmp:
        fake, fake_port = start_fake(tmp, env)
        cg, cg_port = start_cg(tmp, env, fake_port)
        print(f"fake upstream pid {fake.pid} port {fake_port}; cg pid {cg.pid} port {cg_port}", file=sys.stderr)
        bench = Bench(args, fake, fake_port, cg, cg_port)
        results, code = drive(bench.run, 120 if args.quick else 900, tmp, fake, cg)
        if results is None:
            return code
        from cg.testing import _fake_texts, anthropic_stream_events

        print("3. in-process: throughput and memory", file=sys.stderr, flush=True)
        results["in_process"] = in_process(args.quick, anthropic_stream_events(_fake_texts(20)))
        results["revision"] = rev
        return report(results, args, started, table)


if __name__ == "__main__":
    sys.exit(main())
