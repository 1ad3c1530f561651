"""Soak: cg as the README runs it, under a paced load with faults, for a configurable time (issue 24 §3).

    python bench/soak.py [--duration S] [--quick] [--plot PNG] [--json PATH] [--keep-logs]

Three processes on 127.0.0.1, besides this one (the load and the checks, on Twisted):

- cg, ``twistd -n cg`` (a real process, restarted during the run): a SQLite store with a small
  ``--store-max-mb`` so eviction happens, on a filesystem of its own (a tmpfs of a few MB this
  script mounts when it runs as root, so the disk can be filled: ENOSPC), the change log on
  (``--changelog``, rotated with SIGHUP during the run), ``--memo-dir``.
- the fake provider, this script's ``--serve-fake`` mode: ``cg.testing.FakeUpstream`` with its
  default replies, and a model that expands markers. For every request it reads every marker in
  the body and looks its original up **in the store directly** (the SQLite file, read-only):
  a marker whose original is not there at the moment the fake received it is a loss. Every
  ``EXPAND_EVERY``-th request that carries a marker is answered with an expand call of one of
  them, drawn at random (``x-fake-expand``), which cg answers **through its expand path** (from the
  store, continuing upstream): the continuation's tool result must carry the original, not
  "no longer stored". It appends one JSON line per request to a file, so its findings outlive
  its own restarts.
- the load: ``--claude`` Claude Code-shaped conversations (bench/sessions.py: the fixture's
  system prompt, tools and headers, a new tool result each turn, the history re-sent byte for
  byte, a new session once it passes ``SESSION_BYTES``) on ``/v1/messages?beta=true``, and
  ``--codex`` Codex-shaped ones (tests/fixtures/codex/first_request.json grown with reasoning,
  function_call and function_call_output items, bench/openai_parity.py's shell outputs) on
  ``/v1/responses``, all streamed, each waiting ``--pace`` seconds (± half) after a response.
  Every response must be 200 and its stream well-formed: Anthropic's by
  ``cg.stream.streamcheck.check_anthropic_stream``, the Responses API's by the ``openai`` SDK's
  stream accumulator and the rule Codex keeps (one ``response.completed``, last; every item added
  is done).

Sampled every ``--sample`` seconds and printed: cg's RSS, open fds and threads, the store file's
and its WAL's sizes, the originals' total against the cap, evictions.

Faults, at fixed fractions of the run: SIGHUP (the change log renamed first, as logrotate
does), a client that disappears mid-stream, the store's disk full (a filler file takes the
tmpfs's free space, then goes), the upstream restarting (SIGTERM, then a new fake on the same
port), and a graceful restart as ``systemctl restart`` does it (SIGTERM, cg drains, exits, a
new cg starts on the same port and store). Requests in flight while the upstream is down, or
sent while no cg listens, are the load's meant failures; every other request must succeed.

A pass/fail line per check, and exit status 1 if any failed. ``--plot`` draws the samples
(the plot extra: ``pip install 'cg[plot]'``). All subprocesses are killed on exit, whatever happens.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import random
import re
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from overhead import (  # noqa: E402
    HOST,
    REPO,
    HTTPConn,
    ResponseError,
    _child_env,
    _kill_children,
    _spawn,
    _start_announced,
    _tail,
    http_get,
    sleep,
    start_cg,
)

if str(REPO) not in sys.path:
    sys.path.append(str(REPO))  # tests/fixturedata.py

SESSION_BYTES = 160_000  # a conversation starts a new session past this many bytes of history
EXPAND_EVERY = 3  # the fake expands one marker of every third request that carries one
MARKER_ID = re.compile(rb"[0-9a-f]{16}")  # cg.wire.markers.marker_id's (the expand tool's description says "ID")
LOST_TEXT = "is no longer stored"  # cg's answer to an expand of an evicted original (cg.stream.continuation)
TOUCH_SLACK_S = 75.0  # cg saves a use at most once a minute per original, in batches every 2 s
FAULTS = (  # (fraction of the run, fault)
    (0.12, "sighup"),
    (0.25, "client_gone"),
    (0.40, "enospc"),
    (0.62, "upstream_restart"),
    (0.80, "graceful_restart"),
)
CLK_TCK = os.sysconf("SC_CLK_TCK")
RETRIES, BACKOFF_S = 2, 0.5  # the anthropic and openai SDKs' defaults: 2 retries, from 0.5 s


# ---------------------------------------------------------------------------------------------
# The fake provider (its own process): default replies, and a model that expands markers


def serve_fake(port: int, store: str, events: str) -> None:
    """``--serve-fake``: the fake on ``port``, checking every marker against ``store``."""
    import attrs
    from twisted.internet import reactor

    from cg.testing.fake import FakeUpstream, Received
    from cg.testing.replies import FAKE_EXPAND_CALL_ID, FAKE_EXPAND_ID, default_reply
    from cg.wire.markers import _RAW_TAIL  # noqa: PLC2701  the raw scan cg itself uses

    rng = random.Random(7)
    counter = [0]
    out = open(events, "a", buffering=1)  # noqa: SIM115  one line per request, for the whole run
    db: list[sqlite3.Connection | None] = [None]

    def stored(ids: list[str]) -> set[str] | None:
        """Which of ``ids`` the store holds now (None: the file could not be read)."""
        for _attempt in range(2):
            try:
                if db[0] is None:
                    db[0] = sqlite3.connect(f"file:{store}?mode=ro", uri=True, timeout=5)
                found = set()
                for i in range(0, len(ids), 500):
                    chunk = ids[i:i + 500]
                    rows = db[0].execute(
                        f"SELECT id FROM originals WHERE id IN ({','.join('?' * len(chunk))})", chunk)
                    found.update(r[0] for r in rows)
                return found
            except sqlite3.Error:
                with contextlib.suppress(sqlite3.Error):
                    if db[0] is not None:
                        db[0].close()
                db[0] = None
        return None

    pending: list[str] = []  # the markers asked for, oldest first, until a continuation carries them

    def carries_original(body: bytes, ref: str) -> bool:
        """Whether ``body`` holds the original of ``ref`` as the store has it, as a JSON string's inside."""
        try:
            row = db[0].execute("SELECT body FROM originals WHERE id = ?", (ref,)).fetchone() if db[0] else None
        except sqlite3.Error:
            return False
        if row is None:
            return False
        text = bytes(row[0]).decode("utf-8", "replace")
        return any(json.dumps(text, ensure_ascii=ascii)[1:-1].encode() in body for ascii in (False, True))

    def answer(received: Received) -> object:
        body = received.body
        ids = sorted({m.group()[3:19].decode() for m in _RAW_TAIL.finditer(body) if MARKER_ID.fullmatch(m.group()[3:19])})
        present = stored(ids) if ids else set()
        line: dict = {"t": time.time(), "path": received.path.decode(), "markers": ids}
        if present is None:
            line["unreadable"] = True
        else:
            line["missing"] = sorted(set(ids) - present)
        if FAKE_EXPAND_ID.encode() in body or FAKE_EXPAND_CALL_ID.encode() in body:
            # cg's continuation after an expand call this fake asked for: the original, or the loss
            line["expand"] = "lost" if LOST_TEXT.encode() in body else "unverified"
            for ref in list(pending):
                if carries_original(body, ref):
                    pending.remove(ref)
                    line["expand"] = "ok"
                    break
        elif ids and (received.header(b"x-fake-events") is not None):
            counter[0] += 1
            if counter[0] % EXPAND_EVERY == 0:
                ref = rng.choice(ids)
                pending.append(ref)
                del pending[:-50]  # an ask whose continuation never came (a fault cut it) is not kept
                line["expand"] = "asked"
                line["ref"] = ref
                received = attrs.evolve(received, headers=[*received.headers, (b"x-fake-expand", ref.encode())])
        out.write(json.dumps(line) + "\n")
        received.finished.addCallback(
            lambda how: how == "lost" and out.write(json.dumps({"t": time.time(), "markers": [], "lost": True}) + "\n"))
        return default_reply(received)

    port_ = FakeUpstream(record=False, default_reply=answer).listen(reactor, port)
    print(f"listening {port_.getHost().port}", flush=True)
    reactor.run()


# ---------------------------------------------------------------------------------------------
# The conversations


class ClaudeCode:
    """One Claude Code-shaped conversation: its history as bytes, a new session past SESSION_BYTES."""

    path = "/v1/messages?beta=true"

    def __init__(self, index: int, template, content):
        self.index, self.t, self.content = index, template, content
        self.session, self.next = 0, 0
        self.prefix, self.size = template.base, template.bytes
        self.started = False

    def body(self) -> tuple[bytes, str]:
        from sessions import marked

        a, u = self.content.turn(self.next)
        self.next += 1
        added = len(a) + len(u) + 2
        if self.started and self.size + added > SESSION_BYTES:
            self.session += 1
            self.prefix, self.size, self.started = self.t.base, self.t.bytes, False
        body = b"".join((self.t.head, self.prefix, b",", a, b",", marked(u), self.t.tail))
        self.prefix = b",".join((self.prefix, a, u))
        self.size += added
        self.started = True
        sid = str(uuid.uuid5(uuid.NAMESPACE_URL, f"cg-soak/claude/{self.index}/{self.session}"))
        return body, f"{self.t.headers}x-claude-code-session-id: {sid}\r\nx-api-key: sk-ant-soak\r\n"


class Codex:
    """One Codex-shaped conversation on the Responses API (``store: false``), grown a shell call a turn."""

    path = "/v1/responses"

    def __init__(self, index: int):
        from rewrite import Gen

        from tests.fixturedata import codex_request

        self.index = index
        self.gen = Gen(2000 + index)
        self.rng = random.Random(3000 + index)
        fixture = codex_request("first_request")
        drop = {"host", "content-length", "connection", "accept-encoding", "session-id", "thread-id"}
        self.headers = "".join(f"{k}: {v}\r\n" for k, v in fixture["headers"].items() if k.lower() not in drop)
        self.first = fixture["body"]
        self.session = -1
        self._new_session()

    def _new_session(self) -> None:
        self.session += 1
        self.doc = json.loads(json.dumps(self.first))
        self.size = len(json.dumps(self.doc))

    def body(self) -> tuple[bytes, str]:
        from openai_parity import SHELL_KINDS, codex_output, serialize, shell_turn

        rng = self.rng
        kind = rng.choices(list(SHELL_KINDS), weights=list(SHELL_KINDS.values()))[0]
        command, text, code = shell_turn(self.gen, kind)
        output = codex_output(text, code, f"{rng.getrandbits(24):06x}", rng.uniform(0, 30))
        if self.size + len(output) > SESSION_BYTES and len(self.doc["input"]) > len(self.first["input"]):
            self._new_session()
        call_id = f"call_{rng.getrandbits(96):024x}"
        items = [
            {"type": "reasoning", "id": f"rs_{rng.getrandbits(96):024x}",
             "summary": [{"type": "summary_text", "text": "Thinking about it."}], "content": None,
             "encrypted_content": "gAAAAB" + "".join(rng.choices("abcdefghijklmnopqrstuvwxyz0123456789", k=600))},
            {"type": "function_call", "status": "completed", "id": f"fc_{rng.getrandbits(96):024x}",
             "name": "exec_command", "arguments": json.dumps({"cmd": command}, separators=(",", ":")),
             "call_id": call_id},
            {"type": "function_call_output", "call_id": call_id, "output": output},
        ]
        self.doc["input"].extend(items)
        body = serialize(self.doc)
        self.size = len(body)
        sid = str(uuid.uuid5(uuid.NAMESPACE_URL, f"cg-soak/codex/{self.index}/{self.session}"))
        return body, f"{self.headers}session-id: {sid}\r\nauthorization: Bearer sk-soak\r\n"


def request_bytes(conversation, port: int, extra: str = "") -> bytes:
    body, headers = conversation.body()
    head = (f"POST {conversation.path} HTTP/1.1\r\nHost: {HOST}:{port}\r\n{headers}"
            f"x-fake-events: 6\r\nx-fake-delay-ms: 40\r\n{extra}Content-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


# ---------------------------------------------------------------------------------------------
# Streams as strict clients read them


def responses_problems(data: bytes) -> list[str]:
    """What Codex and the ``openai`` SDK would choke on in a Responses stream."""
    from cg.wire.sse import SSEParser

    problems = []
    docs = []
    for event in SSEParser().feed(data):
        if event.data:
            try:
                docs.append(json.loads(event.data))
            except ValueError:
                problems.append("an event whose data is not JSON")
    types = [d.get("type") for d in docs]
    if types.count("response.completed") != 1 or types[-1:] != ["response.completed"]:
        problems.append(f"not exactly one response.completed, last ({types.count('response.completed')})")
    added = {d.get("output_index") for d in docs if d.get("type") == "response.output_item.added"}
    done = {d.get("output_index") for d in docs if d.get("type") == "response.output_item.done"}
    if added != done:
        problems.append(f"items added but not done: {sorted(added - done, key=str)}")
    try:
        _sdk_response(data)
    except Exception as e:  # noqa: BLE001  whatever the SDK raises is the finding
        problems.append(f"the openai SDK: {type(e).__name__}: {e}"[:300])
    return problems


def _sdk_response(data: bytes) -> object:
    """The ``openai`` SDK's accumulated response of a recorded stream (raises on a bad one)."""
    import httpx2
    import openai

    def handler(request):
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=data)

    client = openai.OpenAI(api_key="k", base_url="http://cg.invalid/v1", max_retries=0,
                           http_client=httpx2.Client(transport=httpx2.MockTransport(handler)))
    with client.responses.stream(model="gpt-5", input="hi") as stream:
        return stream.get_final_response()


class BodyConn(HTTPConn):
    """overhead.py's connection, keeping the response body (already de-chunked)."""

    def request(self, data: bytes, timeout: float = 120.0):
        self.body = bytearray()
        return super().request(data, timeout)

    def _body(self, data: bytes) -> None:
        self.body += data


# ---------------------------------------------------------------------------------------------
# cg's process, measured from /proc


def proc_figures(pid: int) -> dict:
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "Threads"):
                fields[key] = int(value.split()[0])
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read().rsplit(")", 1)[1].split()
    return {"rss_kib": fields["VmRSS"], "threads": fields["Threads"], "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "cpu_s": (int(stat[11]) + int(stat[12])) / CLK_TCK}


def file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def disk_used(path: Path) -> int:
    """Bytes used on the filesystem of ``path`` (the store's, its ledger's and their WALs')."""
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def store_rows(path: Path) -> dict[str, float] | None:
    """Every original's id and last use, read-only (None: not readable now)."""
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)) as db:
            return dict(db.execute("SELECT id, last_used FROM originals"))
    except sqlite3.Error:
        return None


def store_bytes(path: Path) -> int | None:
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)) as db:
            return sum(db.execute(f"SELECT coalesce(sum(size), 0) FROM {table}").fetchone()[0]
                       for table in ("originals", "frozen"))
    except sqlite3.Error:
        return None


# ---------------------------------------------------------------------------------------------
# The run


class Soak:
    def __init__(self, args, tmp: Path):
        self.args, self.tmp = args, tmp
        self.env = _child_env()
        self.disk = tmp / "disk"
        self.disk.mkdir()
        self.mounted = self._mount()
        self.store = self.disk / "store.sqlite3"
        self.changelog = tmp / "changes.jsonl"
        self.events = tmp / "fake-events.jsonl"
        self.samples: list[dict] = []
        self.requests: list[dict] = []  # one per request: t0, t1, kind, ok, problem
        # faults whose requests may fail: (fault, start, end, the failure meant: a prefix of the problem, or "")
        self.windows: list[tuple[str, float, float, str]] = []
        self.faults: dict[str, dict] = {}
        self.checks: list[tuple[str, bool, str]] = []
        self.stopping = False
        self.cg = None
        self.cg_port = None
        self.restarts = 0
        self.fault_times: list[tuple[str, float]] = []  # (fault, seconds into the run) as played

    # -- processes ------------------------------------------------------------------------------

    def _mount(self) -> bool:
        """A tmpfs of its own for the store (root only): the disk the ENOSPC fault fills."""
        # the store and its WAL (a checkpoint every ~4 MB), the ledger's file and WAL, growing with the run
        size = self.args.store_max_mb * 3 + 16 + int(self.args.duration / 120)
        if os.geteuid() != 0:
            return False
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}m,mode=0700", "cg-soak", str(self.disk)],
                              capture_output=True)
        return done.returncode == 0

    def unmount(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.disk)], capture_output=True)

    def start_fake(self, port: int = 0) -> None:
        argv = [sys.executable, str(Path(__file__).resolve()), "--serve-fake", str(port), str(self.store),
                str(self.events)]
        for attempt in range(50):
            try:
                self.fake, self.fake_port = _start_announced(argv, self.tmp / "fake.log", self.env, "the soak's fake")
                return
            except SystemExit:
                if not port or attempt == 49:
                    raise
                time.sleep(0.1)  # the old one's port not free yet

    def cg_options(self) -> tuple[str, ...]:
        return ("--store", f"sqlite:{self.store}", "--store-max-mb", str(self.args.store_max_mb),
                "--changelog", str(self.changelog), "--memo-dir", str(self.tmp / "memo"))

    def start_cg(self) -> None:
        if self.cg_port is None:
            self.cg, self.cg_port = start_cg(self.tmp, self.env, self.fake_port, self.cg_options())
            return
        # the same port again: systemd's restart starts the new process once the old one exited
        from overhead import _cg_argv

        argv = _cg_argv(self.cg_port, f"http://{HOST}:{self.fake_port}") + list(self.cg_options())
        self.restarts += 1
        self.cg = _spawn(argv, self.tmp / f"cg-{self.restarts + 1}.log", self.env)

    def cg_stats(self) -> dict:
        try:
            return json.loads(http_get(self.cg_port, "/stats", timeout=5)[1])
        except (OSError, ValueError):
            return {}

    # -- the load -------------------------------------------------------------------------------

    async def send(self, conn: BodyConn | None, data: bytes, record: dict) -> tuple[BodyConn, int]:
        """One request as the SDKs send it: a refused connection, or a kept-alive one closed before
        any response byte (a stopping cg closes idle ones), is tried again after 0.5 s and 1 s (the
        anthropic and openai SDKs' first backoffs); a response cut once it began is not, nor is a 502."""
        from twisted.internet import reactor
        from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
        from twisted.internet.error import ConnectionRefusedError

        for attempt in range(RETRIES + 1):
            try:
                if conn is None or conn.lost:
                    conn = None
                    conn = await connectProtocol(TCP4ClientEndpoint(reactor, HOST, self.cg_port, timeout=10),
                                                 BodyConn())
                _ttfb, _total, status = await conn.request(data)
                return conn, status
            except (ResponseError, ConnectionRefusedError) as e:
                if (conn is not None and conn.body) or attempt == RETRIES:
                    raise
                record.setdefault("retried", []).append(f"{type(e).__name__}: {e}")
                if conn is not None:
                    conn.transport.abortConnection()
                conn = None
                await sleep(BACKOFF_S * 2 ** attempt)
        raise AssertionError("unreachable")

    async def converse(self, conversation, kind: str) -> None:

        from cg.stream.streamcheck import check_anthropic_stream

        rng = random.Random(hash((kind, conversation.index)))
        conn = None
        await sleep(rng.uniform(0, self.args.pace))
        while not self.stopping:
            data = request_bytes(conversation, self.cg_port)
            record = {"t0": time.time(), "kind": kind, "bytes": len(data)}
            self.requests.append(record)
            try:
                conn, status = await self.send(conn, data, record)
                body = bytes(conn.body)
                if status != 200:
                    record["problem"] = f"status {status}: {body[:200]!r}"
                elif kind == "claude":
                    problems = check_anthropic_stream(body)
                    if problems:
                        record["problem"] = "; ".join(problems)[:300]
                else:
                    problems = responses_problems(body)
                    if problems:
                        record["problem"] = "; ".join(problems)[:300]
            except Exception as e:  # noqa: BLE001  every failure is recorded and judged
                record["problem"] = f"{type(e).__name__}: {e}"[:300]
                if conn is not None:
                    conn.transport.abortConnection()
                conn = None
            record["t1"] = time.time()
            await sleep(rng.uniform(0.5, 1.5) * self.args.pace)
        if conn is not None:
            conn.transport.loseConnection()

    # -- sampling -------------------------------------------------------------------------------

    def sample(self, t0: float) -> None:
        stats = self.cg_stats()
        store = stats.get("store", {})
        row = {"t": time.time() - t0, "store_bytes": store_bytes(self.store),
               "db_bytes": file_size(self.store), "wal_bytes": file_size(Path(f"{self.store}-wal")),
               "ledger_bytes": file_size(self.disk / "store.ledger.sqlite3"), "disk_used_bytes": disk_used(self.disk),
               "evictions": self.evictions(store.get("evictions")),
               "healthy": store.get("healthy"),
               "requests": len(self.requests), "failed": sum(1 for r in self.requests if "problem" in r)}
        with contextlib.suppress(OSError, KeyError, AttributeError):
            row.update(proc_figures(self.cg.pid))
        self.samples.append(row)
        mib = 1 << 20
        print(f"{row['t']:7.0f}s  rss {row.get('rss_kib', 0) / 1024:6.1f} MiB  fds {row.get('fds', '-'):>3}  "
              f"threads {row.get('threads', '-'):>2}  store {(row['store_bytes'] or 0) / mib:5.2f}/"
              f"{self.args.store_max_mb} MiB  db {row['db_bytes'] / mib:5.2f} MiB  wal {row['wal_bytes'] / mib:5.2f} MiB"
              f"  ledger {row['ledger_bytes'] / mib:5.2f} MiB  disk {row['disk_used_bytes'] / mib:5.1f} MiB"
              f"  evictions {row['evictions']}  healthy {row['healthy']}  requests {row['requests']}"
              f"  failed {row['failed']}", flush=True)

    def evictions(self, counter: int | None) -> int:
        """Evictions since the run began: cg's counter starts again at 0 with each process."""
        last = getattr(self, "_eviction_counter", 0)
        if counter is not None:
            self._evicted = getattr(self, "_evicted", 0) + (counter - last if counter >= last else counter)
            self._eviction_counter = counter
        return getattr(self, "_evicted", 0)

    # -- faults ---------------------------------------------------------------------------------

    async def fault(self, name: str) -> None:
        print(f"-- fault: {name}", flush=True)
        self.fault_times.append((name, time.time() - self.t0))
        await getattr(self, f"fault_{name}")()

    async def fault_sighup(self) -> None:
        rotated = self.changelog.with_name("changes.jsonl.1")
        os.rename(self.changelog, rotated)
        lines_before = sum(1 for _ in rotated.open())
        self.cg.send_signal(signal.SIGHUP)
        for _ in range(100):
            await sleep(0.2)
            if self.changelog.exists() and self.changelog.stat().st_size:
                break
        torn = 0
        for line in rotated.open():
            try:
                json.loads(line)
            except ValueError:
                torn += 1
        self.faults["sighup"] = {"rotated_lines": lines_before, "torn_lines": torn,
                                 "reopened": self.changelog.exists(),
                                 "new_file_bytes": file_size(self.changelog),
                                 "ok": self.changelog.exists() and file_size(self.changelog) > 0 and torn == 0}

    async def fault_client_gone(self) -> None:
        """A client that leaves mid-stream: a long stream, cut after its first bytes; cg lives on."""
        from twisted.internet import reactor
        from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol

        before = proc_figures(self.cg.pid)["fds"]
        lost_before = sum(1 for line in self.fake_lines() if line.get("lost"))
        gone = 0
        for i in range(3):
            conversation = ClaudeCode(10_000 + i, self.template, self.content_of(10_000 + i))
            data = request_bytes(conversation, self.cg_port).replace(b"x-fake-events: 6\r\n", b"x-fake-events: 300\r\n")
            conn = await connectProtocol(TCP4ClientEndpoint(reactor, HOST, self.cg_port, timeout=10), BodyConn())
            d = conn.request(data)
            d.addErrback(lambda _: None)
            for _ in range(100):
                await sleep(0.05)
                if conn.body:
                    break
            gone += bool(conn.body)
            conn.transport.abortConnection()
        await sleep(3)
        after = proc_figures(self.cg.pid)["fds"]
        healthy = http_get(self.cg_port, "/healthz")[0] == 200
        # cg closes the upstream request of a client that left: the provider stops generating
        upstream_cut = sum(1 for line in self.fake_lines() if line.get("lost")) - lost_before
        self.faults["client_gone"] = {"left_mid_stream": gone, "upstream_requests_cut": upstream_cut,
                                      "fds_before": before, "fds_after": after, "healthz": healthy,
                                      "ok": healthy and gone == 3 and upstream_cut >= 3 and after <= before + 2}

    async def fault_enospc(self) -> None:
        if not self.mounted:
            self.faults["enospc"] = {"ok": None, "why": "not run: mounting a tmpfs needs root"}
            return
        hold = self.args.enospc_s
        filler = self.disk / "filler"
        written = 0
        # unbuffered: a buffered file's close would write its last partial chunk and raise ENOSPC again
        with filler.open("wb", buffering=0) as f:
            chunk = b"\0" * (1 << 16)
            try:
                while True:
                    written += f.write(chunk)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    filler.unlink()
                    raise
        try:
            before = self.cg_stats().get("store", {})
            await sleep(hold)
            during = self.cg_stats().get("store", {})
        finally:
            filler.unlink()
        t_free = time.time()
        wrote_again = None
        while time.time() - t_free < 120:
            await sleep(1)
            if self.cg_stats().get("store", {}).get("writes", 0) > during.get("writes", 0):
                wrote_again = time.time() - t_free
                break
        await sleep(3)  # the ledger's next batches: rows held while the disk was full go with them
        after = self.cg_stats().get("store", {})
        rows_lost = after.get("ledger_rows_lost", 0) - before.get("ledger_rows_lost", 0)
        self.faults["enospc"] = {
            "filled_mib": round(written / (1 << 20), 1), "held_s": hold,
            "write_errors": during.get("write_errors", 0) - before.get("write_errors", 0),
            "ledger_write_errors": during.get("ledger_write_errors", 0) - before.get("ledger_write_errors", 0),
            "ledger_rows_lost": rows_lost,
            "healthy_while_full": during.get("healthy"),
            "stored_again_after_s": None if wrote_again is None else round(wrote_again, 1),
            "ok": wrote_again is not None and rows_lost == 0}

    async def fault_upstream_restart(self) -> None:
        t0 = time.time()
        self.fake.terminate()
        self.fake.wait(timeout=30)
        await sleep(1)
        self.start_fake(self.fake_port)
        self.windows.append(("upstream_restart", t0, time.time() + 1, ""))
        self.faults["upstream_restart"] = {"down_s": round(time.time() - t0, 2), "ok": True}

    async def fault_graceful_restart(self) -> None:
        from twisted.internet import threads

        t0 = time.time()
        in_flight = [r for r in self.requests if "t1" not in r]
        old = self.cg
        old.terminate()
        code = await threads.deferToThread(old.wait, 60)
        log = _tail(self.tmp / (f"cg-{self.restarts + 1}.log" if self.restarts else "cg.log"), 400)
        t_exit = time.time()
        self.start_cg()
        serving = None
        while time.time() - t_exit < 30:
            await sleep(0.1)
            with contextlib.suppress(OSError):
                if http_get(self.cg_port, "/healthz", timeout=1)[0] == 200:
                    serving = time.time()
                    break
        # no cg listens from SIGTERM until the new one does: a new connection is refused, nothing else
        self.windows.append(("graceful_restart_gap", t0, (serving or time.time()) + 0.5, "ConnectionRefusedError"))
        drained = [r for r in in_flight if "problem" not in r]
        # served by the old cg after it stopped listening: requests sent on a connection it kept alive
        late = [r for r in self.requests if t0 + 0.5 < r["t0"] and r.get("t1", t_exit) < t_exit and "problem" not in r]
        self.faults["graceful_restart"] = {
            "in_flight_at_sigterm": len(in_flight), "completed": len(drained), "exit_code": code,
            "new_requests_served_while_draining": len(late),
            "drain_s": round(t_exit - t0, 2), "down_s": round((serving or time.time()) - t_exit, 2),
            "ok": code in (0, -signal.SIGTERM) and "Server Shut Down." in log and "Traceback" not in log
            and serving is not None and len(drained) == len(in_flight) and not late}
        # a request sent into the gap sees a refused connection: meant; one in flight at SIGTERM must finish
        for r in in_flight:
            r["drained"] = True

    # -- the whole run --------------------------------------------------------------------------

    def content_of(self, index: int):
        from sessions import Content

        return Content(index)

    async def run(self) -> None:
        from sessions import Template
        from twisted.internet import defer

        self.template = Template()
        self.start_fake()
        self.start_cg()
        t0 = time.time()
        self.t0 = t0
        duration = self.args.duration
        loads = [defer.ensureDeferred(self.converse(ClaudeCode(i, self.template, self.content_of(i)), "claude"))
                 for i in range(self.args.claude)]
        loads += [defer.ensureDeferred(self.converse(Codex(i), "codex")) for i in range(self.args.codex)]
        faults = defer.ensureDeferred(self.play_faults(t0))
        next_sample = t0
        while time.time() < t0 + duration or not faults.called:
            if time.time() >= next_sample:
                self.sample(t0)
                self.lru_snapshot()
                next_sample += self.args.sample
            await sleep(0.5)
        self.stopping = True
        await defer.DeferredList(loads)
        self.alive = {"cg": self.cg.poll(), "fake": self.fake.poll()}
        self.sample(t0)
        self.lru_snapshot()
        self.final_stats = self.cg_stats()

    async def play_faults(self, t0: float) -> None:
        """Each fault at its time, one after the other (one that overruns delays the next)."""
        for share, name in FAULTS:
            await sleep(max(0.0, t0 + share * self.args.duration - time.time()))
            try:
                await self.fault(name)
            except Exception as e:  # noqa: BLE001  a fault that could not be played fails its check
                self.faults[name] = {"ok": False, "why": f"{type(e).__name__}: {e}"}

    # -- checks ---------------------------------------------------------------------------------

    def lru_snapshot(self) -> None:
        """The store's originals and their last use now, against when the fake last saw each marker."""
        rows = store_rows(self.store)
        if rows is None:
            return
        seen = self.marker_sightings()
        present_seen = [rows[i] for i in seen if i in rows]
        if not present_seen:
            return
        oldest_kept = min(present_seen)
        evicted = {i: t for i, t in seen.items() if i not in rows}
        younger = [i for i, t in evicted.items() if t - TOUCH_SLACK_S > oldest_kept]
        self.lru = getattr(self, "lru", {"snapshots": 0, "evicted_seen": 0, "out_of_order": set()})
        self.lru["snapshots"] += 1
        self.lru["evicted_seen"] = max(self.lru["evicted_seen"], len(evicted))
        self.lru["out_of_order"].update(younger)

    def fake_lines(self) -> list[dict]:
        lines = []
        with contextlib.suppress(OSError):
            for line in self.events.open():
                with contextlib.suppress(ValueError):
                    lines.append(json.loads(line))
        return lines

    def marker_sightings(self) -> dict[str, float]:
        seen: dict[str, float] = {}
        for line in self.fake_lines():
            for i in line["markers"]:
                seen[i] = line["t"]
        return seen

    def meant_to_fail(self, r: dict) -> str | None:
        for name, a, b, meant in self.windows:
            if r["t0"] <= b and r.get("t1", r["t0"]) >= a and not r.get("drained") and r["problem"].startswith(meant):
                return name
        return None

    def judge(self) -> None:
        args = self.args
        check = self.checks.append
        # requests and streams
        unexpected = [r for r in self.requests if "problem" in r and not self.meant_to_fail(r)]
        meant = [r for r in self.requests if "problem" in r and self.meant_to_fail(r)]
        self.meant = {name: sum(1 for r in meant if self.meant_to_fail(r) == name) for name, *_ in self.windows}
        done = [r for r in self.requests if "t1" in r]
        check(("every request answered and its stream well-formed, but the meant failures",
               not unexpected and len(done) > 0,
               f"{len(done)} requests ({sum(r['kind'] == 'claude' for r in done)} Claude Code, "
               f"{sum(r['kind'] == 'codex' for r in done)} Codex), {len(meant)} meant to fail {self.meant}, "
               f"{len(unexpected)} unexpected" + (f": first {unexpected[0]['problem']}" if unexpected else "")
               + f"; {sum(1 for r in self.requests if 'retried' in r)} sent again after a connection error, as the SDKs do"))
        # markers
        lines = self.fake_lines()
        missing = [(line["t"], m) for line in lines for m in line.get("missing", ())]
        with_markers = sum(1 for line in lines if line["markers"])
        check(("every marker the fake received had its original in the store at that moment",
               not missing and with_markers > 0,
               f"{with_markers} requests carried markers ({sum(len(line['markers']) for line in lines)} sightings), "
               f"{len(missing)} missing" + (f", first {missing[0][1]} at +{missing[0][0] - self.t0:.0f}s"
                                             if missing else "")
               + f", {sum(1 for line in lines if line.get('unreadable'))} requests' store unreadable"))
        asked = sum(1 for line in lines if line.get("expand") == "asked")
        ok = sum(1 for line in lines if line.get("expand") == "ok")
        lost = sum(1 for line in lines if line.get("expand") == "lost")
        unverified = sum(1 for line in lines if line.get("expand") == "unverified")
        check(("every expand call answered with its original, through cg's expand path",
               lost == 0 and unverified == 0 and ok > 0,
               f"{asked} asked, {ok} continuations carried the original byte for byte, {lost} 'no longer stored', "
               f"{unverified} carried neither"))
        # the store
        cap = args.store_max_mb << 20
        sizes = [s["store_bytes"] for s in self.samples if s["store_bytes"] is not None]
        evictions = max((s["evictions"] for s in self.samples), default=0)
        lru = getattr(self, "lru", {"snapshots": 0, "evicted_seen": 0, "out_of_order": set()})
        check(("the store stays at its cap, evicting", bool(sizes) and max(sizes) <= cap and lru["evicted_seen"] > 0,
               f"largest {max(sizes, default=0) / (1 << 20):.2f} MiB of {args.store_max_mb} MiB sampled; "
               f"cg's counters {evictions} evicted (a restart loses its last ones); "
               f"{lru['evicted_seen']} originals the fake saw gone from the file"))
        check(("least recently used originals evicted first", not lru["out_of_order"] and lru["snapshots"] > 0,
               f"{lru['evicted_seen']} originals the fake saw were evicted; {len(lru['out_of_order'])} of them "
               f"last used more than {TOUCH_SLACK_S:.0f} s after an original still kept ({lru['snapshots']} snapshots)"))
        # bounded
        for key, unit, scale, ceiling, growth in (("rss_kib", "MiB", 1024, 1024, 1.3), ("fds", "", 1, 200, 1.3),
                                                   ("threads", "", 1, 64, 1.3), ("wal_bytes", "MiB", 1 << 20, 64, 2.0)):
            values = [s[key] for s in self.samples if key in s]
            if not values:
                check((f"{key} bounded", False, "no samples"))
                continue
            peak = max(values) / scale
            detail = f"first {values[0] / scale:.1f}, peak {peak:.1f}, last {values[-1] / scale:.1f} {unit}".rstrip()
            ok_ = peak <= ceiling
            if args.duration >= 600 and len(values) >= 8:
                # bounded: the last quarter's peak within ``growth`` of the second quarter's (after the warm-up)
                q = len(values) // 4
                second, last = max(values[q:2 * q]), max(values[-q:])
                ok_ = ok_ and last <= max(second * growth, second + (8 if key == "fds" else 4 * scale))
                detail += f"; second quarter's peak {second / scale:.1f}, last quarter's {last / scale:.1f}"
            check((f"{key.replace('_kib', '').replace('_bytes', '')} bounded (ceiling {ceiling} {unit})".replace("  ", " "),
                   ok_, detail))
        for name in ("sighup", "client_gone", "enospc", "upstream_restart", "graceful_restart"):
            fault = self.faults.get(name, {"ok": False, "why": "not played"})
            detail = ", ".join(f"{k} {v}" for k, v in fault.items() if k != "ok")
            check((f"fault: {name}", fault["ok"] is not False, ("skipped: " if fault["ok"] is None else "") + detail))
        alive = getattr(self, "alive", {"cg": "?", "fake": "?"})
        check(("cg and the fake still running at the end", alive == {"cg": None, "fake": None},
               f"exit status of cg {alive['cg']}, of the fake {alive['fake']} (None: running)"))

    def plot(self, path: str) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        t = [s["t"] / 60 for s in self.samples]
        panels = (("RSS (MiB)", "rss_kib", 1024), ("open fds", "fds", 1), ("threads", "threads", 1),
                  ("store: originals (MiB)", "store_bytes", 1 << 20), ("SQLite file (MiB)", "db_bytes", 1 << 20),
                  ("SQLite WAL (MiB)", "wal_bytes", 1 << 20))
        figure, axes = plt.subplots(2, 3, figsize=(15, 7), squeeze=False)
        for ax, (title, key, scale) in zip([a for row in axes for a in row], panels):
            ax.plot(t, [(s.get(key) or 0) / scale for s in self.samples], color="#2471a3", linewidth=1.5)
            if key == "store_bytes":
                ax.axhline(self.args.store_max_mb, color="#c0392b", linestyle="--", label="--store-max-mb")
                ax.legend(loc="lower right")
            for _name, at in self.fault_times:
                ax.axvline(at / 60, color="#999999", linestyle=":", linewidth=1)
            ax.set_title(title)
            ax.set_xlabel("minutes")
            ax.set_ylim(bottom=0)
        figure.suptitle(f"cg soak: {self.args.duration / 60:.0f} min; faults (dotted): "
                        + ", ".join(name for _, name in FAULTS))
        figure.tight_layout()
        figure.savefig(path, dpi=90)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=1800.0, help="seconds of load (default 1800)")
    parser.add_argument("--quick", action="store_true", help="CI's version: 60 s, every fault, smaller figures")
    parser.add_argument("--claude", type=int, default=6, help="Claude Code-shaped conversations (default 6)")
    parser.add_argument("--codex", type=int, default=3, help="Codex-shaped conversations (default 3)")
    parser.add_argument("--pace", type=float, default=3.0, help="mean seconds between a response and the next request")
    parser.add_argument("--store-max-mb", type=int, default=3, help="cg's --store-max-mb (default 3)")
    parser.add_argument("--sample", type=float, default=15.0, help="seconds between samples (default 15)")
    parser.add_argument("--enospc-s", type=float, default=60.0, help="how long the store's disk stays full")
    parser.add_argument("--plot", help="draw the samples to this PNG (the plot extra)")
    parser.add_argument("--json", help="write samples, faults and checks here")
    parser.add_argument("--keep-logs", action="store_true", help="keep cg's and the fake's logs (printed where)")
    parser.add_argument("--serve-fake", nargs=3, metavar=("PORT", "STORE", "EVENTS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_fake:
        port, store, events = args.serve_fake
        serve_fake(int(port), store, events)
        return 0
    if args.quick:
        args.duration, args.sample, args.enospc_s = 60.0, 5.0, 8.0
        args.pace, args.store_max_mb, args.claude = 1.5, 1, 8
    if args.plot:
        from cg.record.plot import HOW, available

        if not available():
            parser.error(f"--plot needs matplotlib, {HOW}: pip install 'cg[plot]'")
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="cg-soak-"))
    soak = Soak(args, tmp)
    print(f"soak: {args.duration:.0f} s, {args.claude} Claude Code + {args.codex} Codex conversations, pace "
          f"{args.pace} s, --store-max-mb {args.store_max_mb} on "
          f"{'a tmpfs of its own' if soak.mounted else 'the temporary directory (no ENOSPC: not root)'}; in {tmp}",
          file=sys.stderr, flush=True)
    from twisted.internet import defer, task

    try:
        task.react(lambda _reactor: defer.ensureDeferred(soak.run()))
    except SystemExit as e:
        if e.code:
            print(f"soak: the run stopped: {e.code}", file=sys.stderr)
            soak.checks.append(("the run completed", False, str(e.code)))
    finally:
        _kill_children()
    try:
        soak.judge()
    except Exception as e:  # noqa: BLE001  a check that cannot be made fails
        soak.checks.append(("the checks", False, f"{type(e).__name__}: {e}"))
    for name, ok, detail in soak.checks:
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}")
    failed = [name for name, ok, _ in soak.checks if not ok]
    print(f"soak: {'FAILED: ' + ', '.join(failed) if failed else 'passed'}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "args": {k: v for k, v in vars(args).items() if k != "serve_fake"}, "samples": soak.samples,
            "faults": soak.faults, "fault_times": soak.fault_times, "checks": soak.checks, "final_stats": getattr(soak, "final_stats", {}),
            "failed_requests": [r for r in soak.requests if "problem" in r]}, indent=1, default=str))
    if args.plot and soak.samples:
        soak.plot(args.plot)
    soak.unmount()
    if args.keep_logs:
        print(f"soak: logs in {tmp}", file=sys.stderr)
    else:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return 1 if failed or not soak.checks else 0


if __name__ == "__main__":
    sys.exit(main())
