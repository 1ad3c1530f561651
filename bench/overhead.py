"""Proxy overhead: the same requests direct to the fake upstream and through cg, in one run.

    python bench/overhead.py [--quick] [--json PATH]

Four processes, all on 127.0.0.1: the fake provider (``python -m cg.testing --port 0``), cg
(``twistd -n cg``, the twistd next to this interpreter, else ``python -m twisted cg``) in front
of it, ``bench/raw_relay.py`` (a do-nothing raw-Twisted relay, also in front of the fake: the
least any Twisted proxy costs), and this one, a load generator on Twisted with a raw HTTP/1.1
protocol (one keep-alive connection per client, a pre-built request, a minimal response
parser) so the client costs little and the same on every side. Every figure through cg is
paired with the same figure measured direct to the fake in the same run, in alternating
rounds, so drift on a noisy machine hits both; the direct figure includes the client's own cost.

Measured:
 1. TTFB and total time of a streamed reply of 20 text deltas 50 ms apart (sequential trials).
 2. The target: TTFB p50/p99, req/s and total time with 1, 10 and 100 closed-loop clients
    (each sends its next request as soon as its previous reply ended) asking for that same
    20-delta stream, their first requests spread evenly over one stream's length, as
    independent users are; and 100 clients that start together and stay phase-locked (every
    50 ms, 100 deltas at once).
 3. Saturation: the same closed loops on a small stream (3 deltas, no delay), and requests/s
    of small JSON (non-streaming) requests with 10 and 50 clients. The fake, cg and the client
    compete for the cores, so this measures throughput and queueing, not cg's per-request
    latency; the 1- and 100-client stream loops have the raw relay as a third side, for reference.
 4. cg's RSS idle, with 100 long streams open (and per stream), and after they closed; while
    the 100 streams are open, the TTFB of one client's small streams, direct and through cg.
    (The JSON also has the TTFBs of the 100 streams, requested at once, direct and through
    cg; they mostly measure the fake, which builds each 1000-event reply up front.)
Also the CPU each process used per request, read from /proc.

TTFB is the time from writing the request to reading the first byte after the response
headers. All subprocesses are killed on exit, whatever happens.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import os
import platform
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from twisted.internet import defer, reactor, task
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure

HOST = "127.0.0.1"
REPO = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")
clock = time.perf_counter

# ---------------------------------------------------------------------------------------------
# Subprocesses (synchronous: before and after the reactor runs)

_children: list[subprocess.Popen] = []


def _kill_children() -> None:
    """Terminate every child, then kill what is left; bounded waits."""
    for proc in _children:
        if proc.poll() is None:
            try:
                proc.terminate()
            except OSError:
                pass
    deadline = time.monotonic() + 5
    for proc in _children:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
    _children.clear()


atexit.register(_kill_children)


def _child_env() -> dict:
    env = dict(os.environ)
    try:
        import cg  # noqa: F401
    except ImportError:  # not installed: run the checkout
        sys.path.insert(0, str(REPO))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.pop("PYTHONDEVMODE", None)
    return env


def _die_with_parent() -> None:
    """In the child (Linux): get SIGTERM if the benchmark dies, even by SIGKILL."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _spawn(argv: list[str], log: Path, env: dict, stdout=None) -> subprocess.Popen:
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=stdout if stdout is not None else log.open("wb"),
        stderr=log.open("ab") if stdout is not None else subprocess.STDOUT,
        cwd=log.parent,
        env=env,
        start_new_session=True,  # a Ctrl-C on the terminal reaches only us; we stop them
        preexec_fn=_die_with_parent if sys.platform == "linux" else None,
    )
    _children.append(proc)
    return proc


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _start_announced(argv: list[str], log: Path, env: dict, what: str) -> tuple[subprocess.Popen, int]:
    """Start a server that prints ``listening N`` (its port) on stdout, then nothing else."""
    proc = _spawn(argv, log, env, stdout=subprocess.PIPE)
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + 20
    line = b""
    while time.monotonic() < deadline and proc.poll() is None:
        if sel.select(timeout=0.2):
            line = proc.stdout.readline()
            break
    sel.close()
    parts = line.split()
    if len(parts) != 2 or parts[0] != b"listening":
        raise SystemExit(f"{what} did not start (printed {line!r}):\n{_tail(log)}")
    # It prints nothing else; drop the pipe so it can never block on a full one.
    proc.stdout.close()
    return proc, int(parts[1])


def start_fake(tmp: Path, env: dict) -> tuple[subprocess.Popen, int]:
    """``python -m cg.testing --port 0``; the port is read from its ``listening N`` line."""
    argv = [sys.executable, "-m", "cg.testing", "--port", "0"]
    return _start_announced(argv, tmp / "fake.log", env, "fake upstream")


def start_relay(tmp: Path, env: dict, upstream_port: int) -> tuple[subprocess.Popen, int]:
    """``bench/raw_relay.py 0 UPSTREAM_PORT``, the reference relay in front of the fake."""
    argv = [sys.executable, str(Path(__file__).with_name("raw_relay.py")), "0", str(upstream_port)]
    return _start_announced(argv, tmp / "relay.log", env, "raw relay")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _cg_argv(port: int, upstream: str, twistd_options: tuple[str, ...] = ()) -> list[str]:
    """cg's command line; ``twistd_options`` (e.g. ``--profile``) need twistd next to this
    interpreter (``python -m twisted`` runs ``twist``, which has none)."""
    twistd = Path(sys.executable).with_name("twistd")
    if twistd.exists():
        head = [sys.executable, str(twistd), "-n", "--pidfile=", *twistd_options, "cg"]
    elif twistd_options:
        raise SystemExit(f"{' '.join(twistd_options)}: needs {twistd}")
    else:
        head = [sys.executable, "-m", "twisted", "cg"]
    return head + [
        "--listen",
        f"tcp:{port}:interface={HOST}",
        "--anthropic-upstream",
        upstream,
        "--openai-upstream",
        upstream,
    ]


def http_get(port: int, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """A blocking GET with Connection: close (only outside measurements)."""
    with socket.create_connection((HOST, port), timeout=timeout) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(None, 2)[1])
    if b"transfer-encoding: chunked" in head.lower():
        body = _dechunk(body)
    return status, body


def _dechunk(data: bytes) -> bytes:
    out, pos = [], 0
    while True:
        eol = data.index(b"\r\n", pos)
        size = int(data[pos:eol].split(b";")[0], 16)
        if not size:
            return b"".join(out)
        out.append(data[eol + 2 : eol + 2 + size])
        pos = eol + 4 + size


def start_cg(
    tmp: Path,
    env: dict,
    upstream_port: int,
    extra: tuple[str, ...] = (),
    log_name: str = "cg.log",
    twistd_options: tuple[str, ...] = (),
) -> tuple[subprocess.Popen, int]:
    """cg on a free port (picked here: ``tcp:0`` would not tell us which), with ``extra``
    options after cg's own; waits for /healthz."""
    log = tmp / log_name
    for _attempt in range(3):
        port = _free_port()
        argv = _cg_argv(port, f"http://{HOST}:{upstream_port}", twistd_options) + list(extra)
        proc = _spawn(argv, log, env)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if http_get(port, "/healthz", timeout=1)[0] == 200:
                    return proc, port
            except OSError:
                pass
            time.sleep(0.05)
        if proc.poll() is None:
            break
    raise SystemExit(f"cg did not answer /healthz:\n{_tail(log)}")


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def cpu_s(pid: int | None) -> float:
    """User+system CPU seconds of a process (``None``: this one)."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def busy_s() -> float:
    """CPU seconds the whole machine spent busy (all cores), from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / CLK_TCK


def tcp_counters() -> dict[str, int]:
    """Machine-wide TCP counters: a listen queue overflow drops a SYN, retried a second later."""
    lines = Path("/proc/net/netstat").read_text().splitlines()
    for names, values in zip(lines[::2], lines[1::2]):
        if names.startswith("TcpExt:"):
            table = dict(zip(names.split()[1:], values.split()[1:]))
            return {k: int(table.get(k, 0)) for k in ("ListenOverflows", "TCPSynRetrans")}
    return {}


def time_wait_pairs(port: int) -> set[tuple[str, str]]:
    """TCP connections to or from ``port`` in TIME_WAIT: left behind by each closed connection."""
    hexport = f"{port:04X}"
    pairs = set()
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            fields = line.split()
            if fields[3] == "06" and hexport in (fields[1][-4:], fields[2][-4:]):
                pairs.add((fields[1], fields[2]))
    return pairs


# ---------------------------------------------------------------------------------------------
# The client: raw HTTP/1.1 on Twisted


class ResponseError(Exception):
    pass


class HTTPConn(Protocol):
    """One keep-alive HTTP/1.1 connection, one request at a time, timestamps on the way."""

    def __init__(self):
        self._d = None
        self._timer = None
        self.lost = False

    def connectionMade(self):
        self.transport.setTcpNoDelay(True)

    def request(self, data: bytes, timeout: float = 30.0) -> defer.Deferred:
        """Fires with (ttfb_s, total_s, status) once the whole response arrived."""
        if self.lost:
            return defer.fail(ResponseError("connection closed"))
        self._d = defer.Deferred()
        self._buf = b""
        self._in_head = True
        self._status = 0
        self._t_first = None
        self._need = 0
        self._chunked = False
        self._last = False
        self._timer = reactor.callLater(timeout, self._expire)
        self._t0 = clock()
        self.transport.write(data)
        return self._d

    def _expire(self):
        self._timer = None
        self._fail(ResponseError("response timed out"))
        self.transport.abortConnection()

    def _fail(self, exc):
        d, self._d = self._d, None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if d is not None:
            d.errback(Failure(exc))

    def dataReceived(self, data):
        now = clock()
        if self._d is None:
            return
        if self._in_head:
            data = self._buf + data
            end = data.find(b"\r\n\r\n")
            if end < 0:
                self._buf = data
                return
            head, data = data[:end].lower(), data[end + 4 :]
            self._buf = b""
            self._in_head = False
            self._status = int(head[9:12])
            self._chunked = b"transfer-encoding: chunked" in head
            if not self._chunked:
                at = head.find(b"content-length:")
                if at < 0:
                    self._fail(ResponseError("neither chunked nor content-length"))
                    return
                eol = head.find(b"\r\n", at)
                self._need = int(head[at + 15 : eol if eol >= 0 else len(head)])
                self._last = True
            if not data and (self._need or self._chunked):
                return
        if self._t_first is None:
            self._t_first = now
        if self._feed(data):
            d, self._d = self._d, None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            d.callback((self._t_first - self._t0, now - self._t0, self._status))

    def _feed(self, data: bytes) -> bool:
        """Consume body bytes (each piece of payload to ``_body`` too); True once the response is complete."""
        if not self._chunked:
            self._body(data[: max(0, self._need)])
            self._need -= len(data)
            return self._need <= 0
        if self._buf:
            data = self._buf + data
            self._buf = b""
        pos, n = 0, len(data)
        while True:
            if self._need:
                take = min(self._need, n - pos)
                self._body(data[pos : pos + min(take, max(0, self._need - 2))])
                self._need -= take
                pos += take
                if self._need:
                    return False
                if self._last:
                    return True
            eol = data.find(b"\r\n", pos)
            if eol < 0:
                self._buf = data[pos:]
                return False
            size = int(data[pos:eol].split(b";", 1)[0], 16)
            pos = eol + 2
            self._last = size == 0
            self._need = size + 2  # the data and its CRLF (the final one, for the last chunk)

    def _body(self, data: bytes) -> None:
        """A piece of the response's payload; this client only counts bytes, subclasses read it."""

    def connectionLost(self, reason=None):
        self.lost = True
        self._fail(ResponseError("connection lost"))


def connect(port: int) -> defer.Deferred:
    return connectProtocol(TCP4ClientEndpoint(reactor, HOST, port, timeout=10), HTTPConn())


def make_request(port: int, *, stream: bool, events: int = 3, delay_ms: int = 0) -> bytes:
    body = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 256,
        "messages": [{"role": "user", "content": "Say hello."}],
    }
    if stream:
        body["stream"] = True
    raw = json.dumps(body, separators=(",", ":")).encode()
    head = [
        "POST /v1/messages HTTP/1.1",
        f"Host: {HOST}:{port}",
        "Content-Type: application/json",
        "Accept: application/json",
        "anthropic-version: 2023-06-01",
        "x-api-key: sk-ant-bench",
        f"Content-Length: {len(raw)}",
    ]
    if stream:
        head += [f"x-fake-events: {events}", f"x-fake-delay-ms: {delay_ms}"]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + raw


SSE_20 = {"stream": True, "events": 20, "delay_ms": 50}  # the stream
STREAM_S = 1.3  # about how long one lasts: 26 events (20 of them deltas), 25 gaps of 50 ms, timer slack
SIDES = {"direct": "direct", "relay": "via raw relay", "cg": "via cg"}  # labels in the output


def _clients(label: str) -> str:
    """ "100 phase-locked" -> "100 clients, phase-locked"."""
    n, _, how = label.partition(" ")
    return f"{n} client{'' if n == '1' else 's'}" + (f", {how}" if how else "")


def sleep(seconds: float) -> defer.Deferred:
    return task.deferLater(reactor, seconds, lambda: None)


# ---------------------------------------------------------------------------------------------
# Statistics


def pct(values: list[float], p: float) -> float | None:
    """Linear-interpolated percentile (``p`` in 0..100) of unsorted ``values``."""
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 4)


# ---------------------------------------------------------------------------------------------
# The measurements


class _Pooled:
    """One side's samples over the rounds of a ``paired_loops``."""

    def __init__(self):
        self.ttfb, self.total, self.errors, self.rps = [], [], [], []
        self.n_per_round, self.others, self.churn = [], [], []
        self.cpu_s: dict[str, float] = {}
        self.tcp: dict[str, int] = {}

    def add(self, res: dict, churn: float | None) -> None:
        self.ttfb += res["ttfb"]
        self.total += res["total"]
        self.errors += res["errors"]
        self.rps.append(res["rps"])
        self.n_per_round.append(len(res["ttfb"]))
        self.others.append(round(res["others_cores"], 3))
        if churn is not None:
            self.churn.append(churn)
        for k, v in res["cpu_s"].items():
            self.cpu_s[k] = self.cpu_s.get(k, 0.0) + v
        for k, v in res["tcp"].items():
            self.tcp[k] = self.tcp.get(k, 0) + v

    def summary(self) -> dict:
        n = len(self.ttfb)
        return {
            "n": n,
            "errors": len(self.errors),
            "error_samples": self.errors[:5],
            "ttfb_p50_ms": ms(pct(self.ttfb, 50)),
            "ttfb_p90_ms": ms(pct(self.ttfb, 90)),
            "ttfb_p99_ms": ms(pct(self.ttfb, 99)),
            "total_p50_ms": ms(pct(self.total, 50)),
            "rps_median": round(pct(self.rps, 50), 1),
            "rps_per_round": [round(x, 1) for x in self.rps],
            "n_per_round": self.n_per_round,
            "cpu_ms_per_request": {k: round(v * 1000 / max(1, n), 4) for k, v in self.cpu_s.items()},
            "other_processes_cores": self.others,
            "tcp_counters_machine_wide": self.tcp,
            # For a proxy side: upstream connections closed per request (cg's pool discarding them).
            "upstream_conns_closed_per_request": round(pct(self.churn, 50), 4) if self.churn else None,
            "ttfb_ms": [ms(x) for x in self.ttfb],
        }


class Bench:
    def __init__(self, args, pids: dict[str, int], ports: dict[str, int]):
        """``pids`` and ``ports`` by process: "fake", "cg", "relay"."""
        self.args = args
        self.quick = args.quick
        self.fake_pid, self.fake_port = pids["fake"], ports["fake"]
        self.cg_pid, self.cg_port = pids["cg"], ports["cg"]
        self.pids = {"client": None, **pids}  # whose CPU each loop reads; None: this process
        self.targets = {"direct": self.fake_port, "cg": self.cg_port}
        # The saturation reference: the relay between direct and cg in the alternating rounds.
        self.with_relay = {"direct": self.fake_port, "relay": ports["relay"], "cg": self.cg_port}
        self.results: dict = {}

    def cpu(self) -> dict:
        return {
            **{name: cpu_s(pid) for name, pid in self.pids.items()},
            "all": busy_s(),
            **tcp_counters(),
        }

    def say(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    async def run(self) -> dict:
        t0 = time.monotonic()
        self.results["rss_kib"] = {"idle_start": rss_kib(self.cg_pid)}
        await self.warmup()
        # Streams first: after the load phases, RSS sits at their high-water mark and would hide
        # what the streams cost.
        await self.open_streams()
        await self.sse_trials()
        await self.target_loops()
        await self.saturation_loops()
        gc.collect()
        await sleep(1.0)
        self.results["rss_kib"]["idle_after_load"] = rss_kib(self.cg_pid)
        self.results["cg_stats"] = json.loads(http_get(self.cg_port, "/stats")[1])
        self.results["fake_rss_kib_end"] = rss_kib(self.fake_pid)
        self.results["elapsed_s"] = round(time.monotonic() - t0, 1)
        return self.results

    async def warmup(self) -> None:
        """Fill cg's and the relay's upstream pools and every side's caches; nothing recorded."""
        for port in self.with_relay.values():
            for stream in (True, False):
                await self.loop(port, make_request(port, stream=stream), 10, 0.3 if self.quick else 1.0)

    # 1 ---------------------------------------------------------------------------------------
    async def sse_trials(self) -> None:
        n = 2 if self.quick else 15
        self.say(f"1. 20-delta stream, 50 ms apart: {n} trials each side")
        conns = {name: await connect(port) for name, port in self.targets.items()}
        samples: dict = {name: {"ttfb": [], "total": []} for name in self.targets}
        for i in range(n):
            order = list(self.targets) if i % 2 == 0 else list(reversed(self.targets))
            for name in order:
                req = make_request(self.targets[name], **SSE_20)
                ttfb, total, status = await conns[name].request(req)
                if status != 200:
                    raise ResponseError(f"{name}: status {status}")
                samples[name]["ttfb"].append(ttfb)
                samples[name]["total"].append(total)
        for conn in conns.values():
            conn.transport.loseConnection()
        self.results["sse_20x50ms"] = {
            name: {
                "n": n,
                "ttfb_p50_ms": ms(pct(s["ttfb"], 50)),
                "total_p50_ms": ms(pct(s["total"], 50)),
                "ttfb_ms": [ms(x) for x in s["ttfb"]],
                "total_ms": [ms(x) for x in s["total"]],
            }
            for name, s in samples.items()
        }

    # closed loop -----------------------------------------------------------------------------
    async def loop(
        self,
        port: int,
        req: bytes,
        concurrency: int,
        duration: float,
        warm: float = 0.0,
        stagger: float = 0.0,
    ):
        """``concurrency`` clients, each back to back on its own connection, for ``warm`` +
        ``duration`` seconds; samples are the requests sent after the warm-up. Client ``i``
        starts ``stagger * i / concurrency`` seconds in (pass ``warm`` >= ``stagger``). Req/s
        counts each reply by the share of its time that fell in the measured window."""
        conns = await defer.gatherResults([connect(port) for _ in range(concurrency)], consumeErrors=True)
        ttfbs: list[float] = []
        totals: list[float] = []
        errors: list[str] = []
        in_window = 0.0  # replies, each counted by the share of its time inside the window
        n_all = 0
        start = clock()
        window = start + warm
        end = window + duration

        async def client(conn: HTTPConn, offset: float):
            nonlocal in_window, n_all
            if offset:
                await sleep(offset)
            while True:
                t = clock()
                if t >= end:
                    return
                try:
                    ttfb, total, status = await conn.request(req)
                except Exception as e:  # noqa: BLE001 - counted and reported
                    errors.append(str(e))
                    return
                n_all += 1
                if status != 200:
                    errors.append(f"status {status}")
                if t >= window:
                    ttfbs.append(ttfb)
                    totals.append(total)
                # Throughput: a count of the replies that ended in the window would jump by
                # ``concurrency`` with phase-locked clients, whose replies all end at once.
                in_window += max(0.0, min(end, t + total) - max(window, t)) / max(total, 1e-9)

        gc.collect()
        gc.disable()  # no collector pauses in the client while it measures
        cpu0 = None
        wait_cpu = sleep(warm).addCallback(lambda _: self.cpu())
        try:
            runs = [
                defer.Deferred.fromCoroutine(client(c, stagger * i / concurrency))
                for i, c in enumerate(conns)
            ]
            cpu0 = await wait_cpu
            await defer.gatherResults(runs, consumeErrors=True)
            cpu1 = self.cpu()
            elapsed = clock() - window
        finally:
            gc.enable()
            for c in conns:
                c.transport.loseConnection()
        await sleep(0.1 if self.quick else 0.3)  # let the closes finish and the servers settle
        cpu = {k: cpu1[k] - cpu0[k] for k in cpu1}
        tcp = {k: cpu.pop(k) for k in ("ListenOverflows", "TCPSynRetrans") if k in cpu}
        # Busy CPU of everything else on the machine (other users' work is noise here).
        others = cpu.pop("all") - sum(cpu[name] for name in self.pids)
        return {
            "n_all": n_all,
            "tcp": tcp,
            "others_cores": max(0.0, others / elapsed),
            "ttfb": ttfbs,
            "total": totals,
            "errors": errors,
            "rps": in_window / duration,
            "cpu_s": cpu,
            "cpu_elapsed_s": elapsed,
        }

    async def paired_loops(
        self,
        req_kw: dict,
        concurrency: int,
        rounds: int,
        duration: float,
        warm: float,
        stagger: float = 0.0,
        targets: dict[str, int] | None = None,
    ) -> dict:
        """Run the sides (``targets``, by default direct and cg) in turn, rotating their order
        every round so that none always runs first; pool samples per side."""
        targets = targets or self.targets
        names = list(targets)
        out = {name: _Pooled() for name in names}
        for r in range(rounds):
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                port = targets[name]
                # Through a proxy: its upstream connections closed during the phase (its pool
                # discarding them) leave connections to the fake in TIME_WAIT.
                proxied = name != "direct"
                tw0 = time_wait_pairs(self.fake_port) if proxied else set()
                res = await self.loop(
                    port, make_request(port, **req_kw), concurrency, duration, warm, stagger
                )
                closed = len(time_wait_pairs(self.fake_port) - tw0) if proxied else 0
                out[name].add(res, closed / max(1, res["n_all"]) if proxied else None)
        return {name: o.summary() for name, o in out.items()}

    async def closed_loops(
        self, key: str, what: str, req_kw: dict, cases: list[tuple], timing: tuple
    ) -> None:
        """One ``paired_loops`` per case (label, clients, stagger, targets) into ``results[key]``."""
        rounds, duration, warm = timing
        self.results[key] = {}
        for label, concurrency, stagger, targets in cases:
            sides = "/".join(targets or self.targets)
            self.say(f"{what}, {_clients(label)}: {rounds} x {duration}s per side ({sides})")
            self.results[key][label] = await self.paired_loops(
                req_kw, concurrency, rounds, duration, warm, stagger, targets
            )

    # 2 ---------------------------------------------------------------------------------------
    async def target_loops(self) -> None:
        """The issue's target: closed loops on its 20-delta stream. Client starts are spread
        over one stream's length (independent users are not phase-locked); one more set of 100
        clients starts together, so that every 50 ms 100 deltas arrive at once."""
        timing = (1, 2.5, STREAM_S + 0.2) if self.quick else (3, 5.0, STREAM_S + 0.2)
        cases = [(str(c), c, STREAM_S, None) for c in (1, 10, 100)] + [("100 phase-locked", 100, 0.0, None)]
        await self.closed_loops(
            "closed_loop_sse_20x50ms", "2. closed loop, 20x50ms streams", SSE_20, cases, timing
        )

    # 3 ---------------------------------------------------------------------------------------
    async def saturation_loops(self) -> None:
        """Back-to-back small requests: the fake and cg compete for the cores, so these
        measure throughput and queueing; the raw relay shows what any Twisted proxy would."""
        timing = (1, 0.6, 0.15) if self.quick else (5, 2.0, 0.3)
        cases = [("1", 1, 0.0, self.with_relay), ("10", 10, 0.0, None), ("100", 100, 0.0, self.with_relay)]
        stream3 = {"stream": True, "events": 3}
        await self.closed_loops(
            "closed_loop_stream3", "3. saturation, 3-delta streams", stream3, cases, timing
        )
        cases = [(str(c), c, 0.0, None) for c in (10, 50)]
        await self.closed_loops("closed_loop_json", "3. saturation, JSON", {"stream": False}, cases, timing)

    # 4 ---------------------------------------------------------------------------------------
    async def open_burst(self, port: int, n: int) -> tuple[list, list[float], float]:
        """``n`` long streams (1000 deltas, 100 ms apart) requested at once on ready connections;
        fires once each has its first body byte, with every stream's TTFB."""
        conns = await defer.gatherResults([connect(port) for _ in range(n)], consumeErrors=True)
        req = make_request(port, stream=True, events=1000, delay_ms=100)
        first_bytes = []
        # These requests end only when we cut them: wrap dataReceived to see the first byte.
        for conn in conns:
            got = defer.Deferred()
            first_bytes.append(got)
            orig = conn.dataReceived

            def seen(data, orig=orig, got=got, conn=conn):
                orig(data)
                if not got.called and conn._t_first is not None:
                    got.callback(conn._t_first - conn._t0)

            conn.dataReceived = seen
        opened = clock()
        for conn in conns:
            conn.request(req, timeout=300).addErrback(lambda _: None)
        ttfbs = await _with_timeout(defer.gatherResults(first_bytes), 30)
        return conns, ttfbs, clock() - opened

    async def open_streams(self) -> None:
        n_streams = 100
        hold = 1.0 if self.quick else 3.0
        probes = 30 if self.quick else 200
        self.say(f"4. {n_streams} long streams opened at once, held; RSS; {probes} probes per side")
        rss = self.results["rss_kib"]
        bursts = {}
        direct, ttfbs, seconds = await self.open_burst(self.fake_port, n_streams)
        bursts["direct"] = (ttfbs, seconds)
        for conn in direct:
            conn.transport.abortConnection()
        await sleep(0.5 if self.quick else 1.0)
        rss["idle_before_streams"] = rss_kib(self.cg_pid)
        conns, ttfbs, seconds = await self.open_burst(self.cg_port, n_streams)
        bursts["cg"] = (ttfbs, seconds)
        self.results["burst_open_100_streams"] = {
            name: {
                "n": len(t),
                "ttfb_p50_ms": ms(pct(t, 50)),
                "ttfb_max_ms": ms(max(t)),
                "seconds_to_open_all": round(sec, 4),
                "ttfb_ms": [ms(x) for x in t],
            }
            for name, (t, sec) in bursts.items()
        }
        await sleep(0.5)
        samples = []
        probe_out = {name: [] for name in self.targets}
        probe_conns = {name: await connect(port) for name, port in self.targets.items()}
        reqs = {name: make_request(port, stream=True, events=3) for name, port in self.targets.items()}
        t_hold = clock()
        i = 0
        while i < probes or clock() - t_hold < hold:
            if i % max(1, probes // 10) == 0:
                samples.append(rss_kib(self.cg_pid))
            if i < probes:
                for name in self.targets if i % 2 == 0 else reversed(list(self.targets)):
                    ttfb, _total, _status = await probe_conns[name].request(reqs[name])
                    probe_out[name].append(ttfb)
                await sleep(0.005)  # probes, not load: leave the 100 streams most of the time
            else:
                await sleep(0.1)
            i += 1
        samples.append(rss_kib(self.cg_pid))
        stats = json.loads(http_get(self.cg_port, "/stats")[1])
        for c in probe_conns.values():
            c.transport.loseConnection()
        for conn in conns:
            conn.transport.abortConnection()
        closed = clock()
        in_flight = stats.get("in_flight")
        while clock() - closed < 10:
            await sleep(0.1)
            in_flight = json.loads(http_get(self.cg_port, "/stats")[1]).get("in_flight")
            if in_flight == 0:
                break
        drained_s = clock() - closed
        await sleep(0.5)
        rss["with_streams_samples"] = samples
        rss["with_streams"] = int(pct(samples, 50))
        rss["with_streams_max"] = max(samples)
        rss["per_stream"] = round((rss["with_streams"] - rss["idle_before_streams"]) / n_streams, 1)
        rss["after_streams_closed"] = rss_kib(self.cg_pid)
        rss["streams"] = n_streams
        rss["in_flight_seen_by_cg"] = stats.get("in_flight")
        rss["in_flight_after_close"] = in_flight
        rss["seconds_to_drain_after_close"] = round(drained_s, 3)
        self.results["probe_with_100_streams"] = {
            name: {
                "n": len(v),
                "ttfb_p50_ms": ms(pct(v, 50)),
                "ttfb_p99_ms": ms(pct(v, 99)),
                "ttfb_ms": [ms(x) for x in v],
            }
            for name, v in probe_out.items()
        }


async def _with_timeout(d: defer.Deferred, seconds: float):
    d.addTimeout(seconds, reactor)
    return await d


# ---------------------------------------------------------------------------------------------
# The table


def _fmt(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def _ratio(a, b) -> str:
    return "-" if a is None or b in (None, 0) else f"{a / b:.2f}x"


LOOPS = (  # the closed loops: result key, name in the output
    ("closed_loop_sse_20x50ms", "2. 20x50ms streams"),
    ("closed_loop_stream3", "3. 3-delta streams"),
    ("closed_loop_json", "3. JSON"),
)
TARGET_MS = 2.0  # the issue's: added TTFB p50 with 100 clients


def _loops(r: dict):
    """Every closed loop run: (loop name, clients label, {side: summary})."""
    for key, name in LOOPS:
        for label, v in r[key].items():
            yield name, label, v


def _by_loop(r: dict, figure) -> str:
    """``figure(sides)`` for every loop, grouped by loop: "2. 20x50ms streams: 1: x, 10: y; 3. ..."."""
    return "; ".join(
        f"{name}: " + ", ".join(f"{label}: {figure(v)}" for label, v in r[key].items()) for key, name in LOOPS
    )


def _align(rows: list[tuple]) -> list[str]:
    """The first column left-aligned, the others right-aligned, each as wide as its widest
    cell; a row of one cell is a heading, as long as it likes."""
    full = [x for x in rows if len(x) > 1]
    widths = [max(len(x[i]) for x in full) for i in range(len(full[0]))]
    return [
        "  ".join([x[0].ljust(widths[0])] + [x[i].rjust(widths[i]) for i in range(1, len(x))]).rstrip()
        if len(x) > 1
        else x[0]
        for x in rows
    ]


class Rows(list):
    """A table's rows for ``_align``: direct and via cg side by side, with the difference and
    the ratio (``row``), and headings (``head``)."""

    def __init__(self):
        super().__init__([("", "direct", "via cg", "cg - direct", "cg / direct")])

    def row(self, label, d, c, spec=".2f") -> None:
        delta = "-" if d is None or c is None else f"{c - d:+{spec}}"
        self.append((label, _fmt(d, spec), _fmt(c, spec), delta, _ratio(c, d)))

    def head(self, label) -> None:
        self.append((label,))


def main_rows(r: dict) -> list[tuple]:
    """Sections 1 to 4: direct and via cg side by side."""
    rows = Rows()
    row, head = rows.row, rows.head

    def loop_rows(label, v, what="", total=True):
        d, g = v["direct"], v["cg"]
        head(f"   {what}{_clients(label)} (n = {d['n']} / {g['n']})")
        row("     TTFB p50 ms", d["ttfb_p50_ms"], g["ttfb_p50_ms"])
        row("     TTFB p99 ms", d["ttfb_p99_ms"], g["ttfb_p99_ms"])
        row("     req/s", d["rps_median"], g["rps_median"], ".0f")
        if total:
            row("     total p50 ms", d["total_p50_ms"], g["total_p50_ms"], ".1f")

    s = r["sse_20x50ms"]
    head(f"1. stream of 20 deltas 50 ms apart, median of {s['direct']['n']} trials")
    row("   TTFB ms", s["direct"]["ttfb_p50_ms"], s["cg"]["ttfb_p50_ms"])
    row("   total ms", s["direct"]["total_p50_ms"], s["cg"]["total_p50_ms"], ".1f")
    head("2. the target: closed loop, 20 deltas 50 ms apart, client starts spread over one stream")
    for label, v in r["closed_loop_sse_20x50ms"].items():
        loop_rows(label, v)
    head("3. saturation: closed loop, no delay; the fake and cg compete for the cores (throughput, queueing)")
    for label, v in r["closed_loop_stream3"].items():
        loop_rows(label, v, "3-delta streams, ", total=False)
    for c, v in r["closed_loop_json"].items():
        d, g = v["direct"], v["cg"]
        row(f"   JSON, {c} clients: req/s", d["rps_median"], g["rps_median"], ".0f")
        row(f"   JSON, {c} clients: p50 ms", d["total_p50_ms"], g["total_p50_ms"])
    rss = r["rss_kib"]
    p = r["probe_with_100_streams"]
    head(
        f"4. while {rss['streams']} long streams flow through cg: 1 client, 3-delta streams (n = {p['direct']['n']})"
    )
    row("   probe TTFB p50 ms", p["direct"]["ttfb_p50_ms"], p["cg"]["ttfb_p50_ms"])
    row("   probe TTFB p99 ms", p["direct"]["ttfb_p99_ms"], p["cg"]["ttfb_p99_ms"])
    return rows


def target_line(r: dict) -> str:
    """The verdict on the issue's target, from the 100-client row of section 2."""
    v = r["closed_loop_sse_20x50ms"]["100"]
    d, g = v["direct"]["ttfb_p50_ms"], v["cg"]["ttfb_p50_ms"]
    if d is None or g is None:
        return f"target: added TTFB p50 with 100 clients <= {TARGET_MS:g} ms: missed (no samples)"
    verdict = "met" if g - d <= TARGET_MS else "missed"
    return f"target: added TTFB p50 with 100 clients <= {TARGET_MS:g} ms: {verdict} ({g - d:+.2f} ms)"


def reference_rows(r: dict) -> list[tuple]:
    """The 3-delta loops run with three sides (1 and 100 clients): what a do-nothing Twisted
    relay costs, alone and saturated."""
    loops = {label: v for label, v in r["closed_loop_stream3"].items() if "relay" in v}
    rows = [("", *(SIDES[side] for side in next(iter(loops.values()))))]
    for label, v in loops.items():
        rows.append((f"  {_clients(label)}",))
        for what, key, spec in (
            ("TTFB p50 ms", "ttfb_p50_ms", ".2f"),
            ("TTFB p99 ms", "ttfb_p99_ms", ".2f"),
            ("req/s", "rps_median", ".0f"),
        ):
            rows.append((f"    {what}", *(_fmt(x[key], spec) for x in v.values())))
        cpu = [
            _fmt(x["cpu_ms_per_request"].get(side) if side != "direct" else None, ".3f") for side, x in v.items()
        ]
        rows.append(("    CPU ms per request of the relay / cg process", *cpu))
    return rows


def cpu_rows(r: dict) -> list[tuple]:
    """CPU per request of every process, for every loop and side."""
    rows = [("CPU ms per request (user+system, from /proc)", "client", "fake", "cg/relay")]
    for name, label, v in _loops(r):
        for side, x in v.items():
            cpu = x["cpu_ms_per_request"]
            proxy = cpu.get(side) if side != "direct" else None
            rows.append(
                (
                    f"  {name}, {_clients(label)}, {SIDES[side]}",
                    *(_fmt(c, ".3f") for c in (cpu["client"], cpu["fake"], proxy)),
                )
            )
    return rows


def table(r: dict) -> str:
    m = r["machine"]
    quick = "; --quick" if r["quick"] else ""
    out = [
        f"{m['date']}; {m['nproc']} cores ({m['cpu']}); Python {m['python']}, Twisted {m['twisted']}{quick}",
        "",
    ]
    out += _align(main_rows(r))
    out += [target_line(r), "", "reference, 3-delta streams: direct / raw relay / cg"]
    out += _align(reference_rows(r))
    rss = r["rss_kib"]
    mib = 1024
    out.append("")
    out.append(
        "cg RSS MiB: at start {:.1f}; after warm-up {:.1f}; {} streams open {:.1f} (max {:.1f}), "
        "{:.1f} KiB per stream; after they closed {:.1f}; idle after all load {:.1f}".format(
            rss["idle_start"] / mib,
            rss["idle_before_streams"] / mib,
            rss["streams"],
            rss["with_streams"] / mib,
            rss["with_streams_max"] / mib,
            rss["per_stream"],
            rss["after_streams_closed"] / mib,
            rss["idle_after_load"] / mib,
        )
    )
    out.append("")
    out += _align(cpu_rows(r))
    out.append(
        f"cg's in-flight count: {rss['in_flight_seen_by_cg']} with the {rss['streams']} streams open, "
        f"{rss['in_flight_after_close']} {rss['seconds_to_drain_after_close']} s after the clients cut them"
    )
    out.append(
        "upstream connections closed per request via cg (raw relay/cg where the relay ran), by loop and clients: "
        + _by_loop(
            r,
            lambda v: "/".join(
                str(x["upstream_conns_closed_per_request"]) for s, x in v.items() if s != "direct"
            ),
        )
    )
    out.append(
        "SYN retransmits (machine-wide) during the measured windows, direct/via cg (direct/raw relay/cg), "
        "by loop and clients: "
        + _by_loop(
            r,
            lambda v: "/".join(str(x["tcp_counters_machine_wide"].get("TCPSynRetrans")) for x in v.values()),
        )
    )
    errors = sum(x["errors"] for _, _, v in _loops(r) for x in v.values())
    out.append(
        f"client errors: {errors}; cg's own added_ttfb (its /stats): {r['cg_stats'].get('added_ttfb')}"
    )
    others = [c for _, _, v in _loops(r) for x in v.values() for c in x["other_processes_cores"]]
    out.append(
        f"other processes on the machine during load phases: median {pct(others, 50):.2f}, "
        f"max {max(others):.2f} cores busy (of {os.cpu_count()})"
    )
    return "\n".join(out)


def machine() -> dict:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import twisted

    return {
        "nproc": os.cpu_count(),
        "cpu": model,
        "python": platform.python_version(),
        "twisted": twisted.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


# ---------------------------------------------------------------------------------------------


def drive(run, timeout: float, tmp: Path, fake, cg, **others):
    """Run the coroutine function ``run`` on the reactor: (its result, 0), or (None, exit code).
    ``fake``, ``cg`` and ``others`` (by name) are the subprocesses to check afterwards."""
    outcome: list = []

    def go():
        d = defer.Deferred.fromCoroutine(run())
        d.addTimeout(timeout, reactor)
        d.addBoth(outcome.append)
        d.addBoth(lambda _: reactor.stop())

    reactor.callWhenRunning(go)
    reactor.run()
    if not outcome:
        print("interrupted", file=sys.stderr)
        return None, 130
    if isinstance(outcome[0], Failure):
        outcome[0].printTraceback(file=sys.stderr)
        print(f"--- cg log tail:\n{_tail(tmp / 'cg.log')}", file=sys.stderr)
        return None, 1
    for name, proc in {"fake": fake, "cg": cg, **others}.items():
        if proc.poll() is not None:
            print(f"warning: {name} exited early ({proc.returncode})", file=sys.stderr)
    return outcome[0], 0


def parse_args(argv, description: str, quick_help: str, logs_help: str, more=None) -> argparse.Namespace:
    """The flags every benchmark here takes; ``more(parser)`` adds a benchmark's own."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--json", metavar="PATH", help="write the raw numbers (every sample) here")
    parser.add_argument("--keep-logs", action="store_true", help=logs_help)
    if more is not None:
        more(parser)
    return parser.parse_args(argv)


@contextmanager
def run_dir(prefix: str, keep_logs: bool):
    """A temporary directory for the subprocesses' logs; on exit, whatever happened, every
    subprocess is stopped and the directory removed (unless kept). SIGTERM exits cleanly."""

    def on_term(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield tmp
    finally:
        _kill_children()
        if keep_logs:
            print(f"logs kept in {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def report(results: dict, args, started: float, table) -> int:
    """Print ``table(results)`` and write the JSON (with the machine and the run's length)."""
    results["machine"] = machine()
    results["quick"] = args.quick
    results["wall_s"] = round(time.monotonic() - started, 1)
    print(table(results))
    print(f"\n{'quick' if args.quick else 'full'} run: {results['wall_s']} s", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


def main(argv=None) -> int:
    args = parse_args(
        argv,
        __doc__.split("\n\n")[0],
        "few trials: a smoke run (~70 s; full run ~7 min)",
        "keep the fake's, cg's and the relay's logs",
    )
    started = time.monotonic()
    env = _child_env()
    with run_dir("cg-bench-", args.keep_logs) as tmp:
        fake, fake_port = start_fake(tmp, env)
        cg, cg_port = start_cg(tmp, env, fake_port)
        relay, relay_port = start_relay(tmp, env, fake_port)
        print(
            f"fake upstream pid {fake.pid} port {fake_port}; cg pid {cg.pid} port {cg_port}; "
            f"raw relay pid {relay.pid} port {relay_port}",
            file=sys.stderr,
        )
        pids = {"fake": fake.pid, "cg": cg.pid, "relay": relay.pid}
        bench = Bench(args, pids, {"fake": fake_port, "cg": cg_port, "relay": relay_port})
        results, code = drive(bench.run, 180 if args.quick else 900, tmp, fake, cg, relay=relay)
        if results is None:
            return code
        return report(results, args, started, table)


if __name__ == "__main__":
    sys.exit(main())
