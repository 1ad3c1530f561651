"""Gateway: N Claude Code-shaped conversations, direct and through cg, in one run.

    python bench/gateway.py [--quick] [--json PATH] [--keep-logs] [--conversations N] [--profile DIR]

A team's traffic through one gateway (issue 12, "Numbers"). The processes, the client and the
measuring helpers are overhead.py's and inspector.py's (imported from them): the fake provider
(``python -m cg.testing --port 0``), cg (``twistd -n cg --store sqlite:<tmp>``, every feature on),
a second cg with ``--workers 2`` (its own store), and this process, a raw HTTP/1.1 client on
Twisted, one keep-alive connection per conversation and side. All on 127.0.0.1.

The conversations (default 100): Claude Code's requests (``tests/fixtures/claude-code/
p_second_request_tool_result.json``: its system prompt, 24 tools, headers), each with its own
``x-claude-code-session-id``, ``POST /v1/messages?beta=true``, streamed (10 text deltas, no delay).
Each request appends one turn to its conversation's history: an assistant message with its
tool_use blocks and the user message with their results (bench/sessions.py), from bench/rewrite.py's
generators (Read results, pytest logs, git diffs, JSON, npm and pip logs, Grep, Edit, ...: 0.1 to
60 KB, mean ~12 KB; pytest, diff and install logs are big enough to be offloaded), and re-sends
the history before it byte for byte, the ``cache_control`` mark moving to the newest result as
Claude Code moves it. A history grows from the fixture's 76 KB until the next turn would pass
565 KB; the conversation then starts a new session (a new id, a new history). Conversations
start spread over that range, so the bodies sent average about 320 KB throughout. Every side
(direct, cg, cg with 2 workers) replays the same turns, each from its own position.

Measured, each side against direct in the same run (sides in rotating order per round):
 1. Tight loop: every conversation sends its next request as soon as the response ended.
    requests/s, TTFB p50/p99 (first byte of the response body), CPU per request of the cg
    process(es) (from /proc), RSS of each cg process over time; direct, cg (1 worker) and cg
    ``--workers 2`` (the requests/s ratio of 2 workers to 1).
 2. Paced: every conversation waits 2 s after a response before its next request (a busy team's
    pace), first requests spread over 2 s. TTFB p50/p99, cg's CPU per request, its RSS at the
    end, and the memo's hit rate over the phase (``compaction.memo`` in cg's /stats).
 3. The response head: one conversation's requests with the fake's first event 100 ms after
    its head (``x-fake-first-delay-ms``), one at a time: time to the response head (end of the
    headers) and to the first body byte, direct and through cg.
 4. Restart storm: cg restarted (SIGTERM, same store), then every conversation's next request at
    once on fresh connections (cold histories of ~320 KB: the memo's decisions are read back from
    the files the stop wrote, its bodies are gone); then the same after cg is killed and its memo
    files removed (a crash, or a first start: every decision made again); then for cg
    ``--workers 2`` (restarted: both workers cold); direct: the same burst to the fake.
    TTFB p50/p99/max.
Also the bytes sent, the busy cores of other processes in each phase, and cg's /stats.

Loops stop by time and by count; every request has a timeout. ``--profile DIR``: cg (1 worker)
runs under twistd's cProfile, one file per start in DIR (the figures are then slower: run it for
the profile, not for the numbers). All subprocesses are killed on exit, whatever happens.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

from inspector import Load, revision
from overhead import (
    HOST,
    REPO,
    HTTPConn,
    ResponseError,
    Rows,
    _align,
    _child_env,
    _fmt,
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
    start_cg,
    start_fake,
)
from sessions import LIMIT, Content, Template, marked
from store import start_redis
from twisted.internet import defer, reactor, task
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol

EVENTS = 10  # text deltas per streamed response
THINK_S = 2.0  # the paced loop's wait after each response
HEAD_DELAY_MS = 100  # section 3: the fake's first event this long after its head
TARGETS = {  # the issue's, for the verdict lines
    "paced_added_p50_ms": 10.0,
    "paced_added_p99_ms": 50.0,
    "cpu_ms_per_request": 3.0,
    "rss_mib_per_worker": 300.0,
    "workers_ratio": 1.7,
    "storm_added_p99_ms": 1000.0,
}

# ---------------------------------------------------------------------------------------------
# Conversations


class Conversation:
    """One side's position in one conversation: the history sent so far, as bytes."""

    def __init__(self, index: int, content: Content, template: Template):
        self.index = index
        self.content = content
        self.t = template
        self.session = 0
        self.next = 0  # the next turn of ``content``
        self.prefix = template.base  # every message before the newest turn
        self.last: tuple[bytes, bytes] | None = None
        self.size = template.bytes
        self.conn: HTTPConn | None = None

    def advance_to(self, size: int) -> None:
        """Grow the first session to ``size`` bytes (the conversation's starting point)."""
        while self.size < size:
            self._append()

    def _append(self) -> None:
        a, u = self.content.turn(self.next)
        added = len(a) + len(u) + 2
        if self.last is not None and self.size + added > LIMIT:  # a new session
            self.session += 1
            self.prefix, self.last, self.size = self.t.base, None, self.t.bytes
        if self.last is not None:
            la, lu = self.last
            self.prefix = b",".join((self.prefix, la, lu))
        self.last = (a, u)
        self.size += added
        self.next += 1

    def session_id(self) -> str:
        return str(uuid.uuid5(uuid.NAMESPACE_URL, f"cg-bench-gateway/{self.index}/{self.session}"))

    def request(self, port: int, shape: str = "") -> bytes:
        """The next turn's request (the history plus one new turn), for ``port``."""
        self._append()
        assert self.last is not None
        a, u = self.last
        body = b"".join((self.t.head, self.prefix, b",", a, b",", marked(u), self.t.tail))
        head = (
            f"POST /v1/messages?beta=true HTTP/1.1\r\nHost: {HOST}:{port}\r\n{self.t.headers}"
            f"x-claude-code-session-id: {self.session_id()}\r\nx-api-key: sk-ant-bench\r\n"
            f"x-fake-events: {EVENTS}\r\n{shape}Content-Length: {len(body)}\r\n\r\n"
        )
        return head.encode() + body


class HeadConn(HTTPConn):
    """overhead.py's connection, also stamping when the response head (its blank line) arrived."""

    def request(self, data: bytes, timeout: float = 60.0) -> defer.Deferred:
        self.t_head = None
        return super().request(data, timeout)

    def dataReceived(self, data):
        self._now = clock()
        in_head = self._d is not None and self._in_head
        super().dataReceived(data)
        if in_head and not self._in_head and self.t_head is None:
            self.t_head = self._now - self._t0

    def _feed(self, data: bytes) -> bool:
        if self.t_head is None:  # the head and body bytes in one read: before the reply fires
            self.t_head = self._now - self._t0
        return super()._feed(data)


def connect(port: int) -> defer.Deferred:
    return connectProtocol(TCP4ClientEndpoint(reactor, HOST, port, timeout=10), HeadConn())


# ---------------------------------------------------------------------------------------------
# Processes


def children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


class CG:
    """A cg under test: its process (the parent, with ``--workers``), its port, its store."""

    def __init__(self, tmp: Path, env: dict, fake_port: int, name: str, workers: int, profile: Path | None,
                 store: str | None = None):
        self.tmp, self.env, self.fake_port = tmp, env, fake_port
        self.store = store or f"sqlite:{tmp / f'{name}.sqlite3'}"
        self.name, self.workers, self.profile = name, workers, profile
        self.starts = 0
        self.start()

    def start(self) -> None:
        self.starts += 1
        extra = ("--store", self.store, "--memo-dir", str(self.memo_dir))
        if self.workers > 1:
            extra += ("--workers", str(self.workers))
        opts: tuple[str, ...] = ()
        if self.profile is not None:
            opts = (f"--profile={self.profile / f'{self.name}-{self.starts}.prof'}", "--profiler=cprofile",
                    "--savestats")
        self.proc, self.port = start_cg(self.tmp, self.env, self.fake_port, extra, f"{self.name}.log", opts)
        deadline = time.monotonic() + 20
        while self.workers > 1 and len(children(self.proc.pid)) < self.workers:
            if time.monotonic() > deadline:
                raise SystemExit(f"{self.name}: {self.workers} workers did not start")
            time.sleep(0.05)

    def poll(self) -> int | None:
        """The current process's (``drive`` checks it at the end)."""
        return self.proc.poll()

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    @property
    def memo_dir(self) -> Path:
        """Where it keeps its decisions across a restart (its own: the storms remove it)."""
        return self.tmp / f"{self.name}.memo"

    def kill(self) -> None:
        """A crash: SIGKILL, nothing written at a stop."""
        self.proc.kill()
        self.proc.wait(timeout=5)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)

    def pids(self) -> list[int]:
        """The processes that serve: the workers, or cg itself."""
        return children(self.proc.pid) if self.workers > 1 else [self.proc.pid]

    def all_pids(self) -> list[int]:
        return [self.proc.pid, *(children(self.proc.pid) if self.workers > 1 else [])]

    def cpu(self) -> float:
        total = 0.0
        for pid in self.all_pids():
            try:
                total += cpu_s(pid)
            except OSError:
                pass
        return total

    def stats(self) -> dict:
        return json.loads(http_get(self.port, "/stats")[1])

    def worker_stats(self) -> dict[int, dict]:
        """/stats of every worker (each answers for itself), by pid: asked until each answered."""
        out: dict[int, dict] = {}
        for _ in range(60):
            doc = self.stats()
            out[doc.get("worker", {}).get("pid", self.proc.pid)] = doc
            if len(out) >= self.workers:
                break
        return out


# ---------------------------------------------------------------------------------------------
# The run


def _memo(doc: dict) -> dict:
    return doc.get("compaction", {}).get("memo", {})


class Bench:
    def __init__(self, args, fake, fake_port: int, cgs: dict[str, CG]):
        self.args = args
        self.quick = args.quick
        self.n = args.conversations or (20 if args.quick else 100)
        self.fake_pid, self.fake_port = fake.pid, fake_port
        self.cgs = cgs  # "cg": 1 worker; "cg2": --workers 2
        self.stopped: dict[str, CG] = {}  # those stopped for a phase, by name
        self.template = Template()
        self.contents = [Content(i) for i in range(self.n)]
        self.convs: dict[str, list[Conversation]] = {}
        self.rss: list[tuple[float, str, str, int, int]] = []  # (s, phase, cg, pid, KiB)
        self.phase = "start"
        self.t0 = clock()
        self.sent_bytes: list[int] = []
        self.results: dict = {}

    def say(self, text: str) -> None:
        print(f"[{clock() - self.t0:6.1f}s] {text}", file=sys.stderr, flush=True)

    def port(self, side: str) -> int:
        return self.fake_port if side == "direct" else self.cgs[side].port

    def sample_rss(self) -> None:
        now = round(clock() - self.t0, 2)
        for name, cg in self.cgs.items():
            for pid in cg.pids():
                try:
                    self.rss.append((now, self.phase, name, pid, rss_kib(pid)))
                except (OSError, RuntimeError):
                    pass

    def load(self) -> Load:
        pids: list[int | None] = [None, self.fake_pid]
        for cg in self.cgs.values():
            pids += cg.all_pids()
        return Load(pids)

    def prepare(self) -> None:
        """Every side's conversations, spread over the range of sizes; turns generated ahead."""
        t = clock()
        span = LIMIT - self.template.bytes
        for side in ("direct", *self.cgs):
            self.convs[side] = []
            for i, content in enumerate(self.contents):
                conv = Conversation(i, content, self.template)
                conv.advance_to(self.template.bytes + span * i // self.n)
                self.convs[side].append(conv)
        ahead = 30 if self.quick else 110
        for conv, content in zip(self.convs["direct"], self.contents):
            content.turn(conv.next + ahead)
        turns = sum(len(c.turns) for c in self.contents)
        kib = sum(len(a) + len(u) for c in self.contents for a, u in c.turns) / 1024
        self.results["content"] = {"turns_generated_ahead": turns, "mib": round(kib / 1024, 1),
                                   "seconds": round(clock() - t, 1)}
        self.say(f"{self.n} conversations; {turns} turns generated ({kib / 1024:.0f} MiB) in {clock() - t:.1f} s")

    async def run(self) -> dict:
        sampler = task.LoopingCall(self.sample_rss)
        sampler.start(0.5)
        try:
            await self.warmup()
            await self.tight()
            await self.paced()
            await self.head()
            await self.storms()
        finally:
            sampler.stop()
        self.phase = "end"
        self.sample_rss()
        self.results["rss_samples"] = self.rss
        self.results["conversations"] = self.n
        self.results["sent_bytes"] = {
            "n": len(self.sent_bytes),
            "mean_kb": round(statistics.mean(self.sent_bytes) / 1000, 1),
            "min_kb": round(min(self.sent_bytes) / 1000, 1),
            "max_kb": round(max(self.sent_bytes) / 1000, 1),
            "p50_kb": round(pct(self.sent_bytes, 50) / 1000, 1),
        }
        sizes = [len(a) + len(u) + 2 for c in self.contents for a, u in c.turns]
        self.results["turn_bytes"] = {"mean_kb": round(statistics.mean(sizes) / 1000, 1),
                                      "p50_kb": round(pct(sizes, 50) / 1000, 1),
                                      "max_kb": round(max(sizes) / 1000, 1)}
        self.results["cg_stats_end"] = {name: cg.worker_stats() for name, cg in self.cgs.items()}
        return self.results

    # the client ----------------------------------------------------------------------------
    async def send(self, side: str, conv: Conversation, shape: str = "", timeout: float = 60.0):
        """One request of ``conv`` on its connection (opened if need be): a sample dict."""
        port = self.port(side)
        if conv.conn is None or conv.conn.lost:
            conv.conn = await connect(port)
        req = conv.request(port, shape)
        self.sent_bytes.append(len(req))
        started = clock()
        ttfb, total, status = await conv.conn.request(req, timeout)
        if status != 200:
            raise ResponseError(f"{side}: status {status}")
        return {"t": started, "ttfb": ttfb, "total": total, "head": conv.conn.t_head, "bytes": len(req)}

    def close(self, side: str) -> None:
        for conv in self.convs[side]:
            if conv.conn is not None:
                conv.conn.transport.loseConnection()
                conv.conn = None

    async def loop(self, side: str, duration: float, warm: float, think: float = 0.0,
                   stagger: float = 0.0, cap: int = 10_000) -> dict:
        """Every conversation in a loop for ``warm`` + ``duration`` s (or ``cap`` requests each),
        ``think`` s between a response and the next request, the first spread over ``stagger`` s.
        Samples: the requests sent in the window after ``warm``; CPU over the same window."""
        samples: list[dict] = []
        ended: list[float] = []
        errors: list[str] = []
        start = clock()
        window, end = start + warm, start + warm + duration
        cg = self.cgs.get(side)

        async def client(conv: Conversation, offset: float):
            if offset:
                await sleep(offset)
            for _ in range(cap):
                if clock() >= end:
                    return
                try:
                    s = await self.send(side, conv)
                except Exception as e:  # noqa: BLE001 - counted and reported
                    errors.append(f"{type(e).__name__}: {e}")
                    conv.conn = None
                    await sleep(0.5)
                    continue
                ended.append(s["t"] + s["total"])
                if s["t"] >= window:
                    samples.append(s)
                if think:
                    await sleep(think)

        runs = [defer.Deferred.fromCoroutine(client(c, stagger * i / self.n)) for i, c in enumerate(self.convs[side])]
        await sleep(warm)
        cpu0, load = (cg.cpu() if cg else 0.0), self.load()
        fake0, client0 = cpu_s(self.fake_pid), cpu_s(None)
        await defer.gatherResults(runs, consumeErrors=True)
        elapsed = clock() - window
        cpu = (cg.cpu() - cpu0) if cg else None
        cores = {"cg": round(cpu / elapsed, 3) if cpu is not None else None,
                 "fake": round((cpu_s(self.fake_pid) - fake0) / elapsed, 3),
                 "client": round((cpu_s(None) - client0) / elapsed, 3)}
        ttfb = [s["ttfb"] for s in samples]
        return {
            "n": len(samples),
            "errors": len(errors),
            "error_samples": errors[:5],
            # Responses that ended inside the window, whenever their request was sent.
            "rps": round(sum(window <= t <= end for t in ended) / duration, 1),
            "ttfb_p50_ms": ms(pct(ttfb, 50)),
            "ttfb_p99_ms": ms(pct(ttfb, 99)),
            "total_p50_ms": ms(pct([s["total"] for s in samples], 50)),
            "cg_cpu_ms_per_request": round(cpu * 1000 / len(samples), 3) if cpu is not None and samples else None,
            "cores": cores,  # busy, from the window's start until the last response
            "mean_kb": round(statistics.mean(s["bytes"] for s in samples) / 1000, 1) if samples else None,
            "others_cores": load.others(),
            "steal_cores": load.stolen(),
            "ttfb_ms": [ms(x) for x in ttfb],
        }

    async def rounds(self, phase: str, sides: list[str], rounds: int, duration: float, warm: float,
                     **kw) -> dict:
        """``loop`` for each side in turn, the order rotated every round; the samples pooled."""
        out: dict[str, list[dict]] = {side: [] for side in sides}
        for r in range(rounds):
            shift = r % len(sides)
            for side in sides[shift:] + sides[:shift]:
                self.phase = f"{phase} {side}"
                self.say(f"{phase}: {side}, round {r + 1}/{rounds}, {warm:g} + {duration:g} s")
                gc.collect()
                res = await self.loop(side, duration, warm, **kw)
                if side in self.cgs:
                    res["workers"] = {pid: rss_kib(pid) for pid in self.cgs[side].pids()}
                out[side].append(res)
                self.close(side)
                await sleep(0.3)
        return {side: pool(v) for side, v in out.items()}

    # phases --------------------------------------------------------------------------------
    async def warmup(self) -> None:
        """Each side: every conversation's first requests (cold histories for cg); not recorded."""
        self.phase = "warm-up"
        for side in ("direct", *self.cgs):
            self.say(f"warm-up: {side}")
            await self.loop(side, 0.5 if self.quick else 2.0, 0.0)
            self.close(side)

    async def tight(self) -> None:
        rounds, duration, warm = (1, 3.0, 1.0) if self.quick else (3, 8.0, 1.5)
        before = {name: cg.worker_stats() for name, cg in self.cgs.items()}
        self.results["tight"] = await self.rounds("tight", ["direct", "cg", "cg2"], rounds, duration, warm)
        after = {name: cg.worker_stats() for name, cg in self.cgs.items()}
        self.results["tight_requests_by_worker"] = {
            name: {pid: doc.get("requests", 0) - before[name].get(pid, {}).get("requests", 0)
                   for pid, doc in after[name].items()}
            for name in self.cgs
        }
        self.results["memo_after_tight"] = {name: {pid: _memo(d) for pid, d in docs.items()}
                                            for name, docs in after.items()}

    async def paced(self) -> None:
        rounds, duration = (1, 5.0) if self.quick else (2, 12.0)
        cg = self.cgs["cg"]
        before = _memo(cg.stats())
        # --workers 2 idles until the storms: stop it, so that it takes nothing from the rest.
        self.stopped["cg2"] = self.cgs.pop("cg2")
        self.stopped["cg2"].stop()
        sides = ["direct", "cg", *(["cg-redis"] if "cg-redis" in self.cgs else [])]
        self.results["paced"] = await self.rounds("paced", sides, rounds, duration, THINK_S + 1.0,
                                                  think=THINK_S, stagger=THINK_S)
        gc.collect()
        await sleep(0.5)
        after = _memo(cg.stats())

        def over_phase(table_after: dict, table_before: dict) -> dict:
            hits = table_after.get("hits", 0) - table_before.get("hits", 0)
            misses = table_after.get("misses", 0) - table_before.get("misses", 0)
            return {"hits": hits, "misses": misses,
                    "hit_rate": round(hits / (hits + misses), 4) if hits + misses else None}

        self.results["paced_memo"] = {**over_phase(after, before),
                                      "bodies": over_phase(after.get("bodies", {}), before.get("bodies", {})),
                                      "cumulative": after}
        self.results["paced_rss_end_kib"] = rss_kib(cg.proc.pid)

    async def head(self) -> None:
        n = 3 if self.quick else 15
        self.phase = "head"
        self.say(f"response head: {n} requests per side, the fake's first event {HEAD_DELAY_MS} ms after its head")
        out: dict[str, dict[str, list]] = {side: {"head": [], "ttfb": []} for side in ("direct", "cg")}
        shape = f"x-fake-first-delay-ms: {HEAD_DELAY_MS}\r\n"
        for i in range(n):
            for side in ("direct", "cg") if i % 2 == 0 else ("cg", "direct"):
                s = await self.send(side, self.convs[side][0], shape)
                out[side]["head"].append(s["head"])
                out[side]["ttfb"].append(s["ttfb"])
        for side in out:
            self.close(side)
        self.results["head"] = {
            side: {"n": n, "head_p50_ms": ms(pct(v["head"], 50)), "head_max_ms": ms(max(v["head"])),
                   "ttfb_p50_ms": ms(pct(v["ttfb"], 50)), "head_ms": [ms(x) for x in v["head"]]}
            for side, v in out.items()
        }

    async def storm(self, side: str) -> dict:
        """Every conversation's next request at once, on connections opened before."""
        port = self.port(side)
        convs = self.convs[side]
        for conv in convs:
            conv.conn = await connect(port)
        reqs = [conv.request(port) for conv in convs]
        self.sent_bytes += [len(r) for r in reqs]
        cg = self.cgs.get(side)
        cpu0, load = (cg.cpu() if cg else 0.0), self.load()
        gc.collect()
        t = clock()
        results = await defer.gatherResults([c.conn.request(r, 60.0) for c, r in zip(convs, reqs)],
                                            consumeErrors=True)
        elapsed = clock() - t
        self.close(side)
        bad = [status for _, _, status in results if status != 200]
        if bad:
            raise ResponseError(f"restart storm, {side}: statuses {bad[:5]}")
        return {"ttfb": [x[0] for x in results], "seconds": elapsed, "others_cores": load.others(),
                "cg_cpu_s": round(cg.cpu() - cpu0, 3) if cg else None,
                "mean_kb": round(statistics.mean(len(r) for r in reqs) / 1000, 1)}

    async def storms(self) -> None:
        rounds = 1 if self.quick else 3
        out: dict[str, list[dict]] = {"direct": [], "cg": [], "cg-cold": [], "cg2": []}
        self.cgs["cg2"] = self.stopped.pop("cg2")
        self.cgs["cg2"].start()  # idle until its storm (the process counts as cg's, not as others')
        for r in range(rounds):
            self.phase = "storm"
            self.say(f"restart storm {r + 1}/{rounds}: direct, then cg restarted (SIGTERM), then cg killed "
                     "with its memo files removed, then cg --workers 2 restarted")
            out["direct"].append(await self.storm("direct"))
            await sleep(0.5)
            # "cg-cold": cg's next turns after a crash with no memo file from a graceful stop (a
            # first start): every decision made again, as before --memo-dir.
            for side, name in (("cg", "cg"), ("cg", "cg-cold"), ("cg2", "cg2")):
                cg = self.cgs[side]
                if name == "cg-cold":
                    cg.kill()
                    if cg.memo_dir.exists():
                        shutil.rmtree(cg.memo_dir)
                else:
                    cg.stop()
                cg.start()
                self.phase = "storm (restarted)"
                await sleep(0.5)
                out[name].append(await self.storm(side))
                self.phase = "storm"
                await sleep(0.5)
        self.results["storm"] = {
            side: {
                "n": sum(len(x["ttfb"]) for x in v),
                "rounds": len(v),
                "ttfb_p50_ms": ms(pct([t for x in v for t in x["ttfb"]], 50)),
                "ttfb_p99_ms": ms(pct([t for x in v for t in x["ttfb"]], 99)),
                "ttfb_max_ms": ms(max(t for x in v for t in x["ttfb"])),
                "seconds_to_answer_all": [round(x["seconds"], 3) for x in v],
                "cg_cpu_ms_per_request": (round(sum(x["cg_cpu_s"] for x in v) * 1000 / sum(len(x["ttfb"]) for x in v), 2)
                                          if side != "direct" else None),
                "mean_kb": [x["mean_kb"] for x in v],
                "others_cores": [x["others_cores"] for x in v],
                "ttfb_ms": [[ms(t) for t in x["ttfb"]] for x in v],
            }
            for side, v in out.items()
        }


def pool(rounds: list[dict]) -> dict:
    """One side's rounds: samples pooled, requests/s the median round's."""
    ttfb = [t for r in rounds for t in r["ttfb_ms"]]
    n = sum(r["n"] for r in rounds)
    cpu = [r["cg_cpu_ms_per_request"] for r in rounds if r["cg_cpu_ms_per_request"] is not None]
    return {
        "n": n,
        "errors": sum(r["errors"] for r in rounds),
        "rps": pct([r["rps"] for r in rounds], 50),
        "ttfb_p50_ms": pct(ttfb, 50),
        "ttfb_p99_ms": pct(ttfb, 99),
        "cg_cpu_ms_per_request": round(statistics.median(cpu), 3) if cpu else None,
        "others_cores": [r["others_cores"] for r in rounds],
        "steal_cores": [r["steal_cores"] for r in rounds],
        "cores": {k: statistics.median(r["cores"][k] for r in rounds) if rounds[0]["cores"][k] is not None else None
                  for k in ("cg", "fake", "client")},
        "mean_kb": statistics.mean(r["mean_kb"] for r in rounds if r["mean_kb"]),
        "rounds": rounds,
    }


# ---------------------------------------------------------------------------------------------
# The table


def _rss_by(r: dict, name: str, phases: tuple[str, ...] | None = None) -> dict[int, list[tuple[float, int]]]:
    out: dict[int, list[tuple[float, int]]] = {}
    for t, phase, cg, pid, kib in r["rss_samples"]:
        if cg == name and (phases is None or phase.split(" ")[0] in phases):
            out.setdefault(pid, []).append((t, kib))
    return out


def _mib(kib) -> str:
    return "-" if kib is None else f"{kib / 1024:.0f}"


def verdicts(r: dict) -> list[tuple[str, bool | None, str]]:
    """(target, met, figure) for each of the issue's targets that this run measures."""
    t, p = r["tight"], r["paced"]
    out = []
    added50 = p["cg"]["ttfb_p50_ms"] - p["direct"]["ttfb_p50_ms"]
    added99 = p["cg"]["ttfb_p99_ms"] - p["direct"]["ttfb_p99_ms"]
    out.append((f"paced: added TTFB p50 <= {TARGETS['paced_added_p50_ms']:g} ms",
                added50 <= TARGETS["paced_added_p50_ms"], f"{added50:+.1f} ms"))
    out.append((f"paced: added TTFB p99 <= {TARGETS['paced_added_p99_ms']:g} ms",
                added99 <= TARGETS["paced_added_p99_ms"], f"{added99:+.1f} ms"))
    cpu = t["cg"]["cg_cpu_ms_per_request"]
    out.append((f"CPU per request, ~{t['cg']['mean_kb']:.0f} KB histories, <= {TARGETS['cpu_ms_per_request']:g} ms "
                "(tight loop)", cpu <= TARGETS["cpu_ms_per_request"], f"{cpu:.2f} ms"))
    rss_max = max(kib for _, kib in sum(_rss_by(r, "cg").values(), []))
    rss2 = max((kib for _, kib in sum(_rss_by(r, "cg2").values(), [])), default=None)
    worst = max(x for x in (rss_max, rss2) if x is not None)
    out.append((f"RSS per worker <= {TARGETS['rss_mib_per_worker']:g} MiB at {r['conversations']} conversations",
                worst / 1024 <= TARGETS["rss_mib_per_worker"],
                f"max {_mib(rss_max)} MiB (1 worker), {_mib(rss2)} MiB (a worker of 2)"))
    ratio = t["cg2"]["rps"] / t["cg"]["rps"] if t["cg"]["rps"] else 0.0
    one, two = (t[side]["rps"] / t[side]["cores"]["cg"] if t[side]["cores"]["cg"] else None for side in ("cg", "cg2"))
    # What the ratio can be here: the fake and this client share the machine's cores with cg.
    per_core = (f" (per busy core of cg: {two:.0f} against {one:.0f} requests/s, {two / one:.2f}x; the fake and "
                f"this client took {t['cg2']['cores']['fake'] + t['cg2']['cores']['client']:.2f} of "
                f"{os.cpu_count()} cores)" if one and two else "")
    out.append((f"tight loop: 2 workers >= {TARGETS['workers_ratio']:g}x the requests/s of 1",
                ratio >= TARGETS["workers_ratio"], f"{ratio:.2f}x{per_core}"))
    s = r["storm"]
    for side, label in (("cg", "1 worker"), ("cg-cold", "1 worker, no memo file: a crash or a first start"),
                        ("cg2", "--workers 2")):
        storm = s[side]["ttfb_p99_ms"] - s["direct"]["ttfb_p99_ms"]
        out.append((f"restart storm: added TTFB p99 <= {TARGETS['storm_added_p99_ms']:g} ms ({label})",
                    storm <= TARGETS["storm_added_p99_ms"], f"{storm:+.0f} ms"))
    if "cg-redis" in p:
        gap = p["cg-redis"]["ttfb_p50_ms"] - p["cg"]["ttfb_p50_ms"]
        out.append(("paced: the Redis store's added TTFB p50 within 1 ms of SQLite's", gap <= 1.0,
                    f"{gap:+.2f} ms"))
    h = r["head"]
    head = h["cg"]["head_p50_ms"] - h["direct"]["head_p50_ms"]
    out.append((f"the response head as soon as upstream's (cg's p50 within 10 ms of direct's; the first event "
                f"comes {HEAD_DELAY_MS} ms after it)", head <= 10.0, f"{head:+.2f} ms"))
    return out


def table(r: dict) -> str:
    m = r["machine"]
    quick = "; --quick" if r["quick"] else ""
    sb, tb = r["sent_bytes"], r["turn_bytes"]
    out = [f"{m['date']}; {m['nproc']} cores ({m['cpu']}); Python {m['python']}, Twisted {m['twisted']}{quick}",
           r["revision"],
           f"{r['conversations']} Claude Code-shaped conversations; bodies sent {sb['min_kb']:.0f}-{sb['max_kb']:.0f} KB, "
           f"mean {sb['mean_kb']:.0f} KB ({sb['n']} requests); a turn adds mean {tb['mean_kb']:.1f} KB "
           f"(median {tb['p50_kb']:.1f}, max {tb['max_kb']:.0f}); streamed replies of {EVENTS} deltas",
           ""]
    rows = Rows()
    row, head = rows.row, rows.head

    t = r["tight"]
    d, c, c2 = t["direct"], t["cg"], t["cg2"]
    rounds = len(d["rounds"])
    head(f"1. tight loop: {r['conversations']} conversations back to back, {rounds} round(s) per side "
         f"(n = {d['n']} / {c['n']} / {c2['n']})")
    row("   requests/s (1 worker)", d["rps"], c["rps"], ".0f")
    row("   TTFB p50 ms (1 worker)", d["ttfb_p50_ms"], c["ttfb_p50_ms"], ".1f")
    row("   TTFB p99 ms (1 worker)", d["ttfb_p99_ms"], c["ttfb_p99_ms"], ".1f")
    row("   cg CPU ms per request (1 worker)", None, c["cg_cpu_ms_per_request"])
    row("   requests/s (--workers 2)", d["rps"], c2["rps"], ".0f")
    row("   TTFB p50 ms (--workers 2)", d["ttfb_p50_ms"], c2["ttfb_p50_ms"], ".1f")
    row("   TTFB p99 ms (--workers 2)", d["ttfb_p99_ms"], c2["ttfb_p99_ms"], ".1f")
    row("   cg CPU ms per request (--workers 2, all processes)", None, c2["cg_cpu_ms_per_request"])
    p = r["paced"]
    d, c = p["direct"], p["cg"]
    head(f"2. paced: {THINK_S:g} s between a response and the next request (n = {d['n']} / {c['n']})")
    row("   requests/s", d["rps"], c["rps"], ".1f")
    row("   TTFB p50 ms", d["ttfb_p50_ms"], c["ttfb_p50_ms"])
    row("   TTFB p99 ms", d["ttfb_p99_ms"], c["ttfb_p99_ms"])
    row("   cg CPU ms per request", None, c["cg_cpu_ms_per_request"])
    if "cg-redis" in p:
        x = p["cg-redis"]
        row("   TTFB p50 ms (--store redis://)", d["ttfb_p50_ms"], x["ttfb_p50_ms"])
        row("   TTFB p99 ms (--store redis://)", d["ttfb_p99_ms"], x["ttfb_p99_ms"])
    h = r["head"]
    head(f"3. the response head, the fake's first event {HEAD_DELAY_MS} ms after its head (median of {h['cg']['n']})")
    row("   time to the response head ms", h["direct"]["head_p50_ms"], h["cg"]["head_p50_ms"])
    row("   time to the first body byte ms", h["direct"]["ttfb_p50_ms"], h["cg"]["ttfb_p50_ms"])
    s = r["storm"]
    head(f"4. restart storm: {r['conversations']} requests at once, cg just restarted "
         f"({s['cg']['rounds']} round(s), n = {s['direct']['n']} / {s['cg']['n']})")
    row("   TTFB p50 ms", s["direct"]["ttfb_p50_ms"], s["cg"]["ttfb_p50_ms"], ".0f")
    row("   TTFB p99 ms", s["direct"]["ttfb_p99_ms"], s["cg"]["ttfb_p99_ms"], ".0f")
    row("   TTFB max ms", s["direct"]["ttfb_max_ms"], s["cg"]["ttfb_max_ms"], ".0f")
    row("   cg CPU ms per (cold) request", None, s["cg"]["cg_cpu_ms_per_request"], ".1f")
    row("   TTFB p99 ms (killed, no memo file)", s["direct"]["ttfb_p99_ms"], s["cg-cold"]["ttfb_p99_ms"], ".0f")
    row("   cg CPU ms per (cold) request (killed, no memo file)", None, s["cg-cold"]["cg_cpu_ms_per_request"], ".1f")
    row("   TTFB p50 ms (--workers 2)", s["direct"]["ttfb_p50_ms"], s["cg2"]["ttfb_p50_ms"], ".0f")
    row("   TTFB p99 ms (--workers 2)", s["direct"]["ttfb_p99_ms"], s["cg2"]["ttfb_p99_ms"], ".0f")
    row("   cg CPU ms per (cold) request (--workers 2, all processes)", None, s["cg2"]["cg_cpu_ms_per_request"], ".1f")
    out += _align(rows)
    out.append("tight loop, cores busy (cg / the fake / this client), median round: " + "; ".join(
        f"{label} " + " / ".join(_fmt(x["cores"][k], ".2f") for k in ("cg", "fake", "client"))
        for label, x in (("direct", t["direct"]), ("1 worker", t["cg"]), ("2 workers", t["cg2"]))))
    out.append("")
    out.append("targets (issue 12):")
    for what, met, fig in verdicts(r):
        out.append(f"  {what}: {fig}, {'met' if met else 'MISSED'}")
    out.append("")
    out.append("cg RSS MiB over time (s since start: MiB), per process:")
    for name, label in (("cg", "1 worker"), ("cg2", "--workers 2")):
        for pid, samples in _rss_by(r, name).items():
            step = max(1, len(samples) // 12)
            picks = samples[::step] + ([samples[-1]] if (len(samples) - 1) % step else [])
            out.append(f"  {label}, pid {pid}: " + ", ".join(f"{t:.0f}: {kib / 1024:.0f}" for t, kib in picks)
                       + f" (max {max(k for _, k in samples) / 1024:.0f})")
    out.append(f"  1 worker at the end of the paced loop: {_mib(r['paced_rss_end_kib'])} MiB")
    pm = r["paced_memo"]
    cum = pm["cumulative"]
    bodies, held = pm.get("bodies", {}), cum.get("bodies", {})
    out.append(f"memo (cg's /stats compaction.memo), paced phase: a turn parsed and planned against its "
               f"conversation's last body {bodies.get('hit_rate')} ({bodies.get('hits')} of "
               f"{(bodies.get('hits') or 0) + (bodies.get('misses') or 0)}); decision lookups of new or changed "
               f"messages {pm['hit_rate']} ({pm['hits']} hits, {pm['misses']} misses). At the end: "
               f"{held.get('entries')} bodies ({(held.get('chars') or 0) / 2**20:.1f} MiB), "
               f"{cum.get('entries')} decisions ({(cum.get('chars') or 0) / 2**20:.1f} Mi characters)")
    by_worker = r["tight_requests_by_worker"]["cg2"]
    out.append("--workers 2, tight-loop requests by worker: " + ", ".join(f"pid {k}: {v}" for k, v in by_worker.items()))
    errors = sum(x["errors"] for ph in ("tight", "paced") for x in r[ph].values())
    out.append(f"client errors: {errors}")
    others = [x for ph in ("tight", "paced") for v in r[ph].values() for x in v["others_cores"]]
    storm_others = [x for v in s.values() for x in v["others_cores"]]
    out.append(
        f"other processes on the machine (busy cores, of {os.cpu_count()}): load phases median "
        f"{pct(others, 50):.2f}, max {max(others):.2f}; storms max {max(storm_others):.2f}"
    )
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------


def _more(parser) -> None:
    parser.add_argument("--conversations", type=int, metavar="N", help="conversations (default 100; --quick 20)")
    parser.add_argument("--redis", action="store_true",
                        help="also run the paced loop through a cg on --store redis:// (starts a redis-server)")
    parser.add_argument("--profile", metavar="DIR",
                        help="run cg (1 worker) under twistd's cProfile; one .prof file per start in DIR")


def main(argv=None) -> int:
    args = parse_args(argv, __doc__.split("\n\n")[0], "a smoke run (< 60 s; full run ~4 min)",
                      "keep the fake's and cg's logs", _more)
    started = time.monotonic()
    env = _child_env()
    import cg

    root = str(Path(cg.__file__).resolve().parents[1])
    if root == str(REPO) and root not in env.get("PYTHONPATH", "").split(os.pathsep):
        # rewrite.py, imported above, put the checkout on sys.path (cg is not installed): the
        # children need it too.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    rev = revision()
    profile = Path(args.profile).resolve() if args.profile else None
    if profile is not None:
        profile.mkdir(parents=True, exist_ok=True)
    with run_dir("cg-bench-gateway-", args.keep_logs) as tmp:
        fake, fake_port = start_fake(tmp, env)
        cgs = {"cg": CG(tmp, env, fake_port, "cg", 1, profile), "cg2": CG(tmp, env, fake_port, "cg2", 2, None)}
        if args.redis:
            redis, redis_port = start_redis(str(tmp))
            atexit.register(redis.kill)
            cgs["cg-redis"] = CG(tmp, env, fake_port, "cg-redis", 1, None, f"redis://127.0.0.1:{redis_port}/0")
        print(f"fake upstream pid {fake.pid} port {fake_port}; "
              + "; ".join(f"{n} pids {c.all_pids()} port {c.port}" for n, c in cgs.items()), file=sys.stderr)
        bench = Bench(args, fake, fake_port, cgs)
        bench.prepare()
        results, code = drive(bench.run, 120 if args.quick else 900, tmp, fake, cgs["cg"])
        if results is None:
            return code
        results["revision"] = rev
        results["fake_rss_kib_end"] = rss_kib(fake.pid)
        return report(results, args, started, table)


if __name__ == "__main__":
    sys.exit(main())
