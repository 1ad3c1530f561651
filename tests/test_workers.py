"""`--workers N`: real processes. The parent binds, N workers accept on the same socket, share the
SQLite store, and a dead one is replaced; SIGTERM drains every worker.

Which worker accepts a connection is the kernel's choice: a test picks one by stopping the other
(SIGSTOP: a stopped process accepts nothing) and reads the answer's `/stats` `worker.pid`.
"""

import http.client
import json
import os
import re
import signal
import socket
import sys
import time
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
)
from twisted.python import usage

from cg.testing import command_output
from cg.web.tap import Options
from cg.wire.markers import marker_id

BIG = command_output() * 3
TOOLS = [{"name": "Bash", "input_schema": {"type": "object"}}]
HISTORY = [
    {"role": "user", "content": "run it"},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Bash", "input": {}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": BIG}]},
]


def _request(port: int, method: str, path: str, body: bytes | None = None, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def _worker_pid(port: int) -> int:
    status, body = _request(port, "GET", "/stats")
    assert status == 200
    worker = json.loads(body)["worker"]
    assert worker["of"] == 2
    return worker["pid"]


def _wait_for(proc, pattern: str, count: int = 1) -> list[str]:
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline and proc.poll() is None:
        found = re.findall(pattern, output_of(proc))
        if len(found) >= count:
            return found
        time.sleep(0.05)
    pytest.fail(f"never logged {pattern!r} ×{count}:\n{output_of(proc)}")


class Only:
    """Stop every worker but one for the duration (SIGSTOP, then SIGCONT)."""

    def __init__(self, serving: int, pids: list[int]):
        self.stopped = [pid for pid in pids if pid != serving]

    def __enter__(self):
        for pid in self.stopped:
            os.kill(pid, signal.SIGSTOP)

    def __exit__(self, *exc):
        for pid in self.stopped:
            os.kill(pid, signal.SIGCONT)


@pytest.fixture
def fake_provider(spawn):  # noqa: F811
    """cg.testing's fake provider in its own process; its URL."""
    proc = spawn([sys.executable, "-m", "cg.testing", "--port", "0"], env_without_systemd(), name="fake")
    (port,) = _wait_for(proc, r"listening (\d+)")
    return f"http://127.0.0.1:{port}"


def _start(spawn, upstream: str, tmp_path):  # noqa: F811
    proc = spawn([TWISTD, "--nodaemon", "--pidfile=", "cg", "--workers", "2",
                  "--listen", "tcp:0:interface=127.0.0.1", f"--anthropic-upstream={upstream}",
                  f"--store=sqlite:{tmp_path / 'store.sqlite3'}", "--drain-timeout=5"], env_without_systemd(), name="twistd")
    (pids,) = _wait_for(proc, r"with 2 workers \(pids (\d+), (\d+)\)")
    _wait_for(proc, r"worker \d/2 listening on", count=2)
    # Both stores open (its first line, or a later one, counts the originals): a worker stopped
    # while it creates the SQLite file would hold its write lock through the test.
    _wait_for(proc, r"\d+ originals", count=2)
    return proc, announced_port(proc), [int(pid) for pid in pids]


@linux_only
def test_workers_share_the_socket_and_a_dead_one_is_replaced(spawn, fake_provider, tmp_path):  # noqa: F811
    proc, port, pids = _start(spawn, fake_provider, tmp_path)
    for pid in pids:
        with Only(pid, pids):
            assert _worker_pid(port) == pid
        # What a worker serves (the store's password too) never sits in its environment.
        assert b"store.sqlite3" not in (Path("/proc") / str(pid) / "environ").read_bytes()
    # The workers share the parent's stdout (the journal, a terminal): they leave it blocking.
    flags = int(re.search(r"flags:\s+(\d+)", (Path("/proc") / str(proc.pid) / "fdinfo" / "1").read_text())[1], 8)
    assert not flags & os.O_NONBLOCK

    first, second = pids
    os.kill(first, signal.SIGKILL)
    assert _worker_pid(port) == second  # the other one serves on
    _wait_for(proc, r"worker \d/2 listening on", count=3)  # its replacement
    os.kill(second, signal.SIGSTOP)  # only the replacement can answer
    try:
        replacement = _worker_pid(port)
    finally:
        os.kill(second, signal.SIGCONT)
    assert replacement not in pids
    assert "cg worker 0 (" in output_of(proc) or "cg worker 1 (" in output_of(proc)

    proc.send_signal(signal.SIGTERM)
    assert_clean_stop(proc)
    for pid in (second, replacement):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@linux_only
def test_an_original_stored_through_one_worker_is_read_through_the_other(spawn, fake_provider, tmp_path):  # noqa: F811
    proc, port, (first, second) = _start(spawn, fake_provider, tmp_path)
    body = json.dumps({"model": "m", "max_tokens": 5, "tools": TOOLS, "messages": HISTORY}).encode()
    headers = {"content-type": "application/json", "anthropic-version": "2023-06-01", "x-api-key": "k"}
    with Only(first, [first, second]):
        status, _ = _request(port, "POST", "/v1/messages", body, headers)
        assert status == 200
    # Offloaded, so stored before it went: a store that could not write (once: another worker's
    # ledger transaction held its lock) sends the original whole, and the read below finds nothing.
    _wait_for(proc, r"POST /v1/messages 200 .* markers=1 ")
    with Only(second, [first, second]):
        status, original = _request(port, "GET", f"/cg/expand/{marker_id(BIG.encode())}")
    assert (status, original) == (200, BIG.encode())
    proc.send_signal(signal.SIGTERM)
    assert_clean_stop(proc)

    # Each worker wrote its decisions as it stopped; each reads both when it starts again.
    written = sorted(path.name for path in (tmp_path / "store.memo").iterdir())
    assert written == ["worker-0.json", "worker-1.json"]
    proc, _, _ = _start(spawn, fake_provider, tmp_path)
    assert len(_wait_for(proc, r"cg memo: [1-9]\d* decisions from", count=2)) == 2
    proc.send_signal(signal.SIGTERM)
    assert_clean_stop(proc)


@linux_only
def test_sigterm_lets_every_worker_finish_its_stream(spawn, fake_provider, tmp_path):  # noqa: F811
    proc, port, pids = _start(spawn, fake_provider, tmp_path)
    conns = []
    for pid in pids:  # one stream on each worker, 8 events 150 ms apart
        with Only(pid, pids):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT)
            conn.request("POST", "/v1/messages", body=json.dumps(
                {"model": "m", "max_tokens": 5, "stream": True, "messages": [{"role": "user", "content": "hi"}]}),
                headers={"content-type": "application/json", "anthropic-version": "2023-06-01", "x-api-key": "k",
                         "x-fake-events": "8", "x-fake-delay-ms": "150"})
            response = conn.getresponse()
            assert response.status == 200
            conns.append((conn, response))
    proc.send_signal(signal.SIGTERM)
    for conn, response in conns:
        body = response.read()  # http.client raises IncompleteRead on a cut chunked body
        conn.close()
        assert body.count(b"event: content_block_delta") == 8 and b"message_stop" in body
    assert_clean_stop(proc)


@pytest.mark.parametrize("argv, message", [
    (["--workers", "0"], "--workers must be 1 or more"),
    (["--workers", "2", "--store", "memory:"], "a memory: store is one process's"),
    (["--workers", "2", "--listen", "ssl:8443:privateKey=k.pem"], "only tcp:, unix: and systemd:"),
])
def test_a_bad_workers_option_is_refused(argv, message):
    with pytest.raises(usage.UsageError, match=message):
        Options().parseOptions(argv)


@linux_only
def test_one_scrape_counts_every_workers_requests(spawn, fake_provider, tmp_path):  # noqa: F811
    proc, port, pids = _start(spawn, fake_provider, tmp_path)
    body = json.dumps({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}).encode()
    headers = {"content-type": "application/json", "anthropic-version": "2023-06-01", "x-api-key": "k"}
    for pid in pids:  # one request on each worker
        with Only(pid, pids):
            assert _request(port, "POST", "/v1/messages", body, headers)[0] == 200
    for pid in pids:  # either worker's scrape counts both
        with Only(pid, pids):
            status, text = _request(port, "GET", "/metrics")
        assert status == 200
        counted = re.search(rb'cg_requests_total\{dialect="anthropic",path="/v1/messages",status="200"\} (\S+)', text)
        assert counted is not None and float(counted[1]) == 2.0, text.decode()
    proc.send_signal(signal.SIGTERM)
    assert_clean_stop(proc)


def test_a_workers_port_accepts_one_connection_each_time_it_is_ready():
    """Workers sharing a socket take turns: each takes one connection when the socket is ready,
    so an idle one gets the next instead of the first awake taking a whole burst."""
    from twisted.internet import protocol, reactor

    from cg.web.service import take_turns

    listening = socket.create_server(("127.0.0.1", 0))
    listening.setblocking(False)
    clients = [socket.create_connection(listening.getsockname()) for _ in range(3)]
    built: list[object] = []
    factory = protocol.Factory.forProtocol(protocol.Protocol)
    factory.buildProtocol = lambda addr: built.append(addr) or protocol.Protocol()  # type: ignore[method-assign]
    port = take_turns(reactor.adoptStreamPort(listening.fileno(), socket.AF_INET, factory))
    try:
        for taken in (1, 2, 3):
            port.doRead()  # what the reactor calls when the socket is ready
            assert len(built) == taken
    finally:
        port.stopListening()
        listening.close()
        for client in clients:
            client.close()
