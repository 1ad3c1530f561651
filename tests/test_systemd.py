"""cg under systemd: sd_notify, socket activation, and the shipped unit files.

The process tests run the installed `twistd` (next to sys.executable) in a scratch cwd, so
they test the installed plugin, not the checkout's twisted/plugins. Tools that are missing
(systemd-socket-activate, systemd-analyze; Debian package `systemd`) skip their tests.
"""

import http.client
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from helpers.processes import (
    TWISTD,
    WAIT,
    announced_port,
    assert_clean_stop,
    env_without_systemd,
    linux_only,
    output_of,
    wait_exit,
)

from cg.web import systemd
from cg.web.config import Config

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
SERVICE = DEPLOY / "cg.service"
SOCKET = DEPLOY / "cg.socket"
DROPIN = DEPLOY / "cg.service.d" / "socket-activation.conf"
INSTALLED_TWISTD = "/opt/cg/bin/twistd"


# --- helpers -------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(port: int, path: str = "/healthz") -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


class NotifyListener:
    """The systemd side of sd_notify: an AF_UNIX datagram socket that records senders' pids."""

    def __init__(self, address: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(address)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.messages: list[tuple[int | None, bytes]] = []

    def close(self):
        self.sock.close()

    def receive(self, timeout: float) -> bool:
        self.sock.settimeout(timeout)
        try:
            data, ancdata, _flags, _addr = self.sock.recvmsg(4096, socket.CMSG_SPACE(12))
        except (TimeoutError, BlockingIOError):
            return False
        pid = None
        for level, kind, cdata in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                pid = int.from_bytes(cdata[:4], sys.byteorder)
        self.messages.append((pid, data))
        return True

    def wait_for(self, line: bytes, proc) -> int | None:
        """Receive until a datagram holds `line`; the sender's pid."""
        deadline = time.monotonic() + WAIT
        while True:
            for pid, data in self.messages:
                if line in data.split(b"\n"):
                    return pid
            left = deadline - time.monotonic()
            if left <= 0:
                pytest.fail(f"no {line!r} within {WAIT}s (got {self.messages}):\n{output_of(proc)}")
            self.receive(min(left, 0.2))

    def drain(self):
        while self.receive(0.05):
            pass

    def lines(self) -> list[bytes]:
        return [line for _pid, data in self.messages for line in data.split(b"\n") if line]


@pytest.fixture
def notify_socket(tmp_path):
    """A bound NotifyListener on a path short enough for sun_path (108 bytes)."""
    path = tmp_path / "notify.sock"
    scratch = None
    if len(str(path)) > 100:
        scratch = tempfile.mkdtemp(prefix="cg-sd-")
        path = Path(scratch) / "notify.sock"
    listener = NotifyListener(str(path))
    yield listener, str(path)
    listener.close()
    if scratch:
        shutil.rmtree(scratch, ignore_errors=True)


# --- sd_notify -------------------------------------------------------------------------------


def test_notify_without_notify_socket_is_a_no_op(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert systemd.notify(b"READY=1") is False


@linux_only
def test_notify_path_socket(monkeypatch, notify_socket):
    listener, path = notify_socket
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    assert systemd.notify(b"READY=1") is True
    listener.receive(WAIT)
    assert listener.messages == [(os.getpid(), b"READY=1")]


@linux_only
def test_notify_abstract_namespace_socket(monkeypatch):
    """NOTIFY_SOCKET=@name means the abstract socket "\\0name", not a file called @name."""
    name = f"cg-test-{uuid.uuid4().hex}"
    listener = NotifyListener("\0" + name)
    try:
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert systemd.notify(b"STOPPING=1") is True
        listener.receive(WAIT)
        assert listener.messages == [(os.getpid(), b"STOPPING=1")]
    finally:
        listener.close()


@linux_only
def test_twistd_sends_ready_once_bound_and_stopping_on_sigterm(spawn, notify_socket):
    listener, path = notify_socket
    proc = spawn(
        [
            TWISTD,
            "-n",
            "--pidfile=",
            "cg",
            "--listen",
            "tcp:0:interface=127.0.0.1",
            "--drain-timeout=5",
        ],
        env_without_systemd(NOTIFY_SOCKET=path),
        name="twistd",
    )
    sender = listener.wait_for(b"READY=1", proc)
    # Type=notify with NotifyAccess=main: only the main process's messages count.
    assert sender == proc.pid
    # READY=1 means the port is bound (and announced, the log is written synchronously):
    # no waiting, the very first request must be served.
    port = announced_port(proc)
    assert _get(port) == (200, b"ok\n")
    assert b"STOPPING=1" not in listener.lines()

    proc.send_signal(signal.SIGTERM)
    assert listener.wait_for(b"STOPPING=1", proc) == proc.pid
    assert_clean_stop(proc)
    listener.drain()
    lines = listener.lines()
    assert lines.count(b"READY=1") == 1
    assert lines.index(b"READY=1") < lines.index(b"STOPPING=1")


@linux_only
def test_twistd_that_cannot_bind_fails_without_ready(spawn, notify_socket):
    """systemd must see a failed start (non-zero exit, no READY=1), so Restart=on-failure acts;
    the person reading the journal gets one line, not a traceback."""
    listener, path = notify_socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = spawn(
            [TWISTD, "-n", "--pidfile=", "cg", "--store", "memory:", "--listen", f"tcp:{port}:interface=127.0.0.1"],
            env_without_systemd(NOTIFY_SOCKET=path),
            name="twistd",
        )
        assert wait_exit(proc) == 1, output_of(proc)
    assert output_of(proc) == f"cg: cannot listen on tcp:{port}:interface=127.0.0.1: address already in use\n"
    listener.drain()
    assert b"READY=1" not in listener.lines()


@linux_only
def test_daemonizing_twistd_that_cannot_bind_says_so_and_exits(spawn, tmp_path):
    """Without -n twistd forks and its parent waits for the child's word: a port in use must
    still be one line and a non-zero exit, with no pid file left behind and no parent hanging."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = spawn(
            [TWISTD, "cg", "--store", "memory:", "--listen", f"tcp:{port}:interface=127.0.0.1"], env_without_systemd(), name="daemon"
        )
        assert wait_exit(proc) == 1, output_of(proc)
    assert output_of(proc) == f"cg: cannot listen on tcp:{port}:interface=127.0.0.1: address already in use\n"
    assert not (tmp_path / "twistd.pid").exists()


# --- graceful stop (what systemctl stop does: SIGTERM, then SIGKILL after TimeoutStopSec) --------

STREAM_BODY = (
    b'{"model":"claude-test","max_tokens":16,"stream":true,'
    b'"messages":[{"role":"user","content":"hi"}]}'
)


# A provider that streams `x-fake-events` deltas `x-fake-delay-ms` apart and then closes its
# connection, as a provider may: cg's pool then has no idle connection left to close, so
# nothing but the drain itself stands between the last stream's end and cg's exit.
FAKE_UPSTREAM = """
import http.server, time

class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def chunk(self, data):
        self.wfile.write(b"%x\\r\\n%s\\r\\n" % (len(data), data))
        self.wfile.flush()

    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        events = int(self.headers.get("x-fake-events", "3"))
        delay = int(self.headers.get("x-fake-delay-ms", "0")) / 1000
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.send_header("connection", "close")
        self.end_headers()
        self.chunk(b'event: message_start\\ndata: {"type":"message_start"}\\n\\n')
        for i in range(events):
            time.sleep(delay)
            self.chunk(b'event: content_block_delta\\ndata: {"type":"content_block_delta"}\\n\\n')
        self.chunk(b'event: message_stop\\ndata: {"type":"message_stop"}\\n\\n')
        self.wfile.write(b"0\\r\\n\\r\\n")
        self.wfile.flush()
        self.close_connection = True

server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
server.daemon_threads = True
print("listening", server.server_address[1], flush=True)
server.serve_forever()
"""


@pytest.fixture
def fake_upstream(spawn, tmp_path):
    """FAKE_UPSTREAM in its own process; its URL."""
    script = tmp_path / "fake_upstream.py"
    script.write_text(FAKE_UPSTREAM)
    proc = spawn([sys.executable, script], env_without_systemd(), name="fake")
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline and proc.poll() is None:
        match = re.search(r"listening (\d+)", output_of(proc))
        if match:
            return f"http://127.0.0.1:{match.group(1)}"
        time.sleep(0.05)
    pytest.fail(f"the fake upstream did not start:\n{output_of(proc)}")


def _start_cg(spawn, notify_socket, upstream: str, drain: float):
    listener, path = notify_socket
    proc = spawn(
        [
            TWISTD,
            "--nodaemon",
            "--pidfile=",
            "cg",
            "--listen",
            "tcp:0:interface=127.0.0.1",
            f"--anthropic-upstream={upstream}",
            f"--drain-timeout={drain}",
        ],
        env_without_systemd(NOTIFY_SOCKET=path),
        name="twistd",
    )
    listener.wait_for(b"READY=1", proc)
    return proc, announced_port(proc)


def _open_stream(port: int, events: int, delay_ms: int):
    """POST a streaming /v1/messages; the response once its first event has arrived."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT)
    headers = {
        "content-type": "application/json",
        "anthropic-version": "2023-06-01",
        "x-api-key": "test",
        "x-fake-events": str(events),
        "x-fake-delay-ms": str(delay_ms),
    }
    conn.request("POST", "/v1/messages", body=STREAM_BODY, headers=headers)
    response = conn.getresponse()
    assert response.status == 200
    first = response.read1(65536)
    assert b"message_start" in first
    return conn, response, first


def _wait_refused(port: int):
    """After SIGTERM cg stops accepting at once, while it drains."""
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except (ConnectionRefusedError, ConnectionResetError):
            # Reset: the connect raced the listening socket's close (its queue is dropped).
            return
        time.sleep(0.05)
    pytest.fail("cg still accepts connections after SIGTERM")


@linux_only
def test_sigterm_drains_in_flight_stream(spawn, notify_socket, fake_upstream):
    proc, port = _start_cg(spawn, notify_socket, fake_upstream, drain=WAIT)
    conn, response, first = _open_stream(port, events=8, delay_ms=200)
    try:
        stopped_at = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _wait_refused(port)
        assert proc.poll() is None, "cg exited without draining its in-flight stream"
        # The stream goes on to its end: all its events and a proper end of the chunked body
        # (http.client raises IncompleteRead on a cut one).
        body = first + response.read()
    finally:
        conn.close()
    assert_clean_stop(proc)
    assert body.count(b"event: content_block_delta") == 8, body
    assert body.rstrip().endswith(b'{"type":"message_stop"}'), body
    assert time.monotonic() - stopped_at >= 1.0  # it waited for the stream (~1.4 s left)


@linux_only
def test_sigterm_cuts_streams_after_drain_timeout(spawn, notify_socket, fake_upstream):
    proc, port = _start_cg(spawn, notify_socket, fake_upstream, drain=1)
    conn, response, _first = _open_stream(port, events=200, delay_ms=100)  # a 20 s stream
    try:
        stopped_at = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _wait_refused(port)
        # Cut, not ended cleanly: the client must be able to tell the stream is incomplete.
        with pytest.raises((http.client.IncompleteRead, ConnectionError)):
            response.read()
    finally:
        conn.close()
    elapsed = time.monotonic() - stopped_at
    assert 0.9 <= elapsed < 5, elapsed  # the 1 s drain timeout, not the 20 s stream
    assert_clean_stop(proc)


# --- socket activation ------------------------------------------------------------------------

SOCKET_ACTIVATE = shutil.which("systemd-socket-activate")


@pytest.mark.skipif(
    SOCKET_ACTIVATE is None, reason="needs systemd-socket-activate (apt-get install systemd)"
)
@pytest.mark.parametrize("workers", [1, 2])
def test_socket_activation(spawn, workers):
    """systemd-socket-activate holds the socket and execs twistd on the first connection; with
    --workers the parent takes the socket and its workers accept on it."""
    env = env_without_systemd()
    passed = [f"--setenv={name}" for name in ("PATH", "PYTHONPATH", "HOME", "LANG", "XDG_STATE_HOME") if name in env]
    for _attempt in range(3):  # the free port may be taken before the tool binds it
        port = _free_port()
        proc = spawn(
            [
                SOCKET_ACTIVATE,
                f"--listen=127.0.0.1:{port}",
                "--fdname=cg",  # sets LISTEN_FDNAMES, as real systemd (FileDescriptorName=) does
                *passed,
                TWISTD,
                "--nodaemon",
                "--pidfile=",
                "cg",
                "--listen",
                "systemd:domain=INET:index=0",
                f"--workers={workers}",
            ],
            env,
            name=f"activate-{port}",
        )
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline and proc.poll() is None:
            if f"Listening on 127.0.0.1:{port}" in output_of(proc):
                break
            time.sleep(0.05)
        if proc.poll() is None:
            break
    else:
        pytest.fail(f"systemd-socket-activate never listened:\n{output_of(proc)}")

    # The first connection starts twistd; it must answer on the inherited socket, twice.
    assert _get(port) == (200, b"ok\n"), output_of(proc)
    assert _get(port) == (200, b"ok\n"), output_of(proc)
    output = output_of(proc)
    assert "Execing" in output and f"listening on http://127.0.0.1:{port} " in output, output

    proc.send_signal(signal.SIGTERM)  # the tool exec'd twistd in place: same pid
    assert_clean_stop(proc)


# --- the unit files ---------------------------------------------------------------------------


def parse_unit(path: Path) -> list[tuple[str, str, str]]:
    """(section, key, value) in file order; handles comments and backslash continuations."""
    entries = []
    section = None
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line[0] in "#;"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, sep, value = line.partition("=")
        assert sep and section, f"{path}: not a unit file line: {raw!r}"
        entries.append((section, key.strip(), value.strip()))
    return entries


def values(entries, section: str, key: str) -> list[str]:
    return [v for s, k, v in entries if s == section and k == key]


def exec_start(entries) -> list[str]:
    """The effective ExecStart argv: an empty assignment clears the ones before it."""
    commands = []
    for value in values(entries, "Service", "ExecStart"):
        commands = [value] if value else []
    assert len(commands) == 1, f"want exactly one ExecStart, got {commands}"
    argv = shlex.split(commands[0])
    argv[0] = argv[0].lstrip("-@:+!")
    return argv


def check_twistd_command(argv: list[str]) -> list[str]:
    """Assert the twistd options systemd needs; return cg's own options."""
    assert argv[0] == INSTALLED_TWISTD
    assert "cg" in argv, argv
    split = argv.index("cg")
    twistd_options, cg_options = argv[1:split], argv[split + 1 :]
    assert "--nodaemon" in twistd_options or "-n" in twistd_options, argv
    assert "--pidfile=" in twistd_options, argv  # empty: no pid file
    return cg_options


def seconds(text: str) -> float:
    """A systemd time span: "45", "45s", "1min 30s", "2m"."""
    units = {"": 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", text)
    assert parts and re.fullmatch(r"(\s*\d+(\.\d+)?\s*[a-z]*)+\s*", text), text
    return sum(float(number) * units[unit] for number, unit in parts)


def test_service_unit_runs_twistd_in_the_foreground_without_pidfile():
    entries = parse_unit(SERVICE)
    cg_options = check_twistd_command(exec_start(entries))
    assert not any(option.startswith("--listen") for option in cg_options)  # the default

    assert values(entries, "Service", "Type") == ["notify"]
    assert values(entries, "Service", "Restart") == ["on-failure"]
    assert values(entries, "Service", "StateDirectory") == ["cg"]
    assert values(entries, "Service", "StateDirectoryMode") == ["0700"]
    assert values(entries, "Service", "DynamicUser") == ["yes"]
    assert values(entries, "Service", "User") not in (["root"], ["0"])
    assert "-/etc/default/cg" in values(entries, "Service", "EnvironmentFile")
    assert values(entries, "Service", "ExecReload") == ["/bin/kill -HUP $MAINPID"]  # reopens the change log

    # TimeoutStopSec must leave room for the drain, or systemd SIGKILLs live streams.
    drain = Config().drain_timeout
    for option in cg_options:
        if option.startswith("--drain-timeout="):
            drain = float(option.partition("=")[2])
    (timeout,) = values(entries, "Service", "TimeoutStopSec")
    assert seconds(timeout) > max(30.0, drain)


def test_socket_unit_and_drop_in_agree():
    socket_entries = parse_unit(SOCKET)
    assert values(socket_entries, "Socket", "ListenStream") == ["127.0.0.1:8080"]
    assert values(socket_entries, "Socket", "Backlog") == ["1024"]  # as cg's own --listen default
    (fdname,) = values(socket_entries, "Socket", "FileDescriptorName")
    assert re.fullmatch(r"[A-Za-z0-9_.-]+", fdname)

    dropin = parse_unit(DROPIN)
    assert values(dropin, "Service", "ExecStart")[0] == ""  # resets cg.service's
    assert "cg.socket" in values(dropin, "Unit", "Requires")
    cg_options = check_twistd_command(exec_start(dropin))
    listens = [cg_options[i + 1] for i, o in enumerate(cg_options) if o == "--listen"]
    listens += [o.partition("=")[2] for o in cg_options if o.startswith("--listen=")]
    assert listens in (["systemd:domain=INET:index=0"], [f"systemd:domain=INET:name={fdname}"])
    # Everything else stays as cg.service has it.
    assert exec_start(dropin)[-1] == exec_start(parse_unit(SERVICE))[-1] == "$CG_OPTS"


SYSTEMD_ANALYZE = shutil.which("systemd-analyze")


def _verify(directory: Path, names=("cg.service", "cg.socket")) -> str:
    """Problems `systemd-analyze verify` reports about our files (it exits 0 on most)."""
    result = subprocess.run(
        [SYSTEMD_ANALYZE, "verify", "--man=no", *(str(directory / n) for n in names)],
        check=False,  # verify exits 0 on most problems: the output says
        capture_output=True,
        text=True,
        timeout=60,
    )
    ours = re.compile(r"cg\.service|cg\.socket|socket-activation\.conf")
    problems = [line for line in (result.stdout + result.stderr).splitlines() if ours.search(line)]
    if result.returncode:
        problems.insert(0, f"exit status {result.returncode}")
    return "\n".join(problems)


def _install_units(target: Path, dropin: bool) -> Path:
    """Copy the units to `target` with ExecStart's /opt/cg/bin/twistd pointed at a real twistd
    (verify checks that the command exists; /opt/cg is the production install)."""
    target.mkdir()
    for source in (SERVICE, SOCKET, *([DROPIN] if dropin else [])):
        destination = target / source.relative_to(DEPLOY)
        destination.parent.mkdir(exist_ok=True)
        text = source.read_text()
        destination.write_text(text.replace(INSTALLED_TWISTD, str(TWISTD)))
    return target


@pytest.mark.skipif(
    SYSTEMD_ANALYZE is None, reason="needs systemd-analyze (apt-get install systemd)"
)
def test_systemd_analyze_verify(tmp_path):
    plain = _install_units(tmp_path / "plain", dropin=False)
    assert _verify(plain) == ""
    activated = _install_units(tmp_path / "activated", dropin=True)
    assert _verify(activated) == ""

    # ... and verify does catch a bad line here (so the checks above are not vacuous).
    broken = _install_units(tmp_path / "broken", dropin=True)
    conf = broken / "cg.service.d" / "socket-activation.conf"
    conf.write_text(conf.read_text() + "Type=notfy\n")
    assert "notfy" in _verify(broken)
