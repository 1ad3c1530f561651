"""cg on a real Redis: it keeps serving when Redis is down, killed or slow and heals without a
restart; two cg sharing one Redis answer each other's markers and send the same bytes.

Claude Code-shaped requests through cg to the strict fake upstream; the fake's ``x-fake-expand``
header plays a model asking for an original.
"""

import http.client
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.bodies import history, repair_request, two_bash_body
from helpers.drive import markers, read_original, send
from helpers.stores import debug_sleep
from pytest_twisted import ensureDeferred, inlineCallbacks
from rawhttp import connect, http_request
from redisserver import RedisServer
from twisted.internet import threads

import cg.store.redis
from cg.testing import claude_code_bytes, command_output, default_reply
from cg.wire.markers import marker_id

TWISTD = Path(sys.executable).with_name("twistd")


@pytest.fixture
def on_redis(make_cg, fake, redis_server):
    """``on_redis(url=None)``: a cg whose store is the test's redis-server (or ``url``)."""
    fake.strict = True

    def make(url=None, **overrides):
        return make_cg(anthropic_upstream=fake.url, expand=True, store=url or redis_server.url, **overrides)

    return make


def continued_with(fake) -> str:
    """What cg answered the fake's expand call with, in the continuation it sent."""
    return fake.received[-1].json()["messages"][-1]["content"][0]["content"]


# --- faults ----------------------------------------------------------------------------------


@inlineCallbacks
def test_redis_down_at_start_cg_serves_and_heals_when_it_comes(on_redis, fake, tmp_path):
    server = RedisServer(tmp_path)  # not started yet
    running = on_redis(f"redis://127.0.0.1:{server.port}/0")
    bash = command_output()
    body = history(bash, "x")
    yield send(running, body)
    sent = fake.received[0]
    assert markers(sent) == []  # nothing it could not store was elided
    assert sent.json()["messages"][3]["content"][0]["content"] == bash
    store = running.stats.snapshot()["store"]
    assert store["healthy"] is False and "Connection refused" in store["unhealthy_reason"]
    assert running.stats.compaction.store_fail_open == 1

    yield threads.deferToThread(server.start)
    try:
        yield send(running, body)
        assert markers(fake.received[1]) == [marker_id(bash.encode())]
        assert running.stats.snapshot()["store"]["healthy"] is True
        assert (yield read_original(running, marker_id(bash.encode()))) == (200, bash.encode())
    finally:
        server.kill()


@inlineCallbacks
def test_redis_killed_mid_run_cg_fails_open_and_resumes(on_redis, fake, redis_server):
    running = on_redis()
    bash = command_output()
    ident = marker_id(bash.encode())
    body = history(bash, "x")

    def redis_dies_while_the_model_answers(received):
        if len(fake.received) == 1:
            redis_server.kill()
        return default_reply(received)

    fake.default_reply = redis_dies_while_the_model_answers
    yield send(running, body, [("x-fake-expand", ident)])
    assert markers(fake.received[0]) == [ident]  # stored before it went
    # The model asks for the original: the request holds it, so it is answered all the same.
    assert continued_with(fake) == bash and running.stats.expand.resolved == 1

    assert (yield read_original(running, ident))[0] == 404  # the read fails: unhealthy
    assert running.stats.store.healthy is False
    yield send(running, body)
    assert markers(fake.received[2]) == []  # no marker it could not answer

    yield threads.deferToThread(redis_server.start)  # back, empty: it kept nothing
    yield send(running, body)
    assert fake.received[-1].body == fake.received[0].body  # stored again, the same bytes as before
    assert running.stats.store.healthy is True
    assert (yield read_original(running, ident)) == (200, bash.encode())


@inlineCallbacks
def test_a_slow_redis_never_holds_up_the_reactor(on_redis, fake, redis_server, monkeypatch):
    running = on_redis(redis_server.url + "?timeout=0.2")
    first, second = command_output(), command_output().replace("PASS", "OK")
    yield send(running, history(first, "x"))
    [sleeping] = yield debug_sleep(redis_server, 3)
    try:
        yield send(running, two_bash_body(first, second))  # the new original cannot be stored
        status, _ = yield read_stats(running)
        assert status == 200
        assert not sleeping.called  # all of it while Redis slept
    finally:
        yield sleeping
    assert markers(fake.received[1]) == []
    assert running.stats.store.healthy is False and "too slow" in running.stats.store.unhealthy_reason
    monkeypatch.setattr(cg.store.redis, "RETRY_AFTER", 0.0)
    yield send(running, two_bash_body(first, second))
    assert markers(fake.received[2]) == [marker_id(first.encode()), marker_id(second.encode())]
    assert running.stats.store.healthy is True


@inlineCallbacks
def read_stats(running):
    from rawhttp import split_response

    client = yield connect(running.port, http_request("GET", "/stats"))
    status, _, data = split_response((yield client.closed))
    return status, data


# --- two cg, one Redis -----------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
@inlineCallbacks
def test_a_marker_written_through_one_is_expanded_through_the_other(on_redis, fake, stream):
    one, two = on_redis(), on_redis()
    bash = command_output()
    ident = marker_id(bash.encode())
    yield send(one, history(bash, "x"))
    assert markers(fake.received[0]) == [ident]

    # Later, through the other: the request no longer holds the original, and the model asks for it.
    later = {**history("short output", "x"), "stream": stream}
    yield send(two, later, [("x-fake-expand", ident)])
    assert continued_with(fake) == bash
    assert (two.stats.expand.resolved, two.stats.store.hits) == (1, 1)
    assert fake.rejections == []


@inlineCallbacks
def test_either_cg_sends_the_same_bytes_for_a_conversation(on_redis, fake):
    one, two = on_redis(), on_redis()
    first, second = command_output(), command_output().replace("PASS", "OK")
    for running in (one, two):
        yield send(running, history(first, "x"))
    for running in (two, one):
        yield send(running, two_bash_body(first, second))
    a, b, c, d = (received.body for received in fake.received)
    assert a == b and c == d
    assert markers(fake.received[2]) == [marker_id(first.encode()), marker_id(second.encode())]
    assert two.stats.store.writes == 1 and one.stats.store.writes == 1  # each original written once


@inlineCallbacks
def test_a_repair_frozen_by_one_replays_identical_bytes_on_the_other(on_redis, fake, redis_server):
    one, two = on_redis(), on_redis()
    output = command_output()
    ref = marker_id(output.encode())
    yield one.service.store.put("", {ref: output.encode()})
    raw = json.dumps(repair_request(ref), separators=(",", ":")).encode()
    headers = [("content-type", "application/json")]
    client = yield connect(one.port, http_request("POST", "/v1/messages", raw, headers))
    yield client.closed
    assert fake.received[0].json()["messages"][2]["content"][0]["content"] == output

    redis_server.admin.delete(f"cg:t::o:{ref}")  # the original is evicted meanwhile
    client = yield connect(two.port, http_request("POST", "/v1/messages", raw, headers))
    yield client.closed
    assert fake.received[1].body == fake.received[0].body  # the frozen text, not "no longer stored"
    assert fake.rejections == []


@pytest.mark.skipif(not TWISTD.exists(), reason=f"no twistd next to {sys.executable}")
@ensureDeferred
async def test_two_twistd_processes_share_one_redis(fake, redis_server, tmp_path):
    """Two real `twistd -n cg` on one Redis (behind a password, read from a file)."""
    redis_server.admin.execute_command("ACL", "SETUSER", "cg", "on", ">s3cret", "~*", "&*", "+@all")
    (tmp_path / "password").write_text("s3cret\n")
    fake.strict = True
    procs = []
    try:
        for name in ("one", "two"):
            log = open(tmp_path / f"{name}.log", "wb")
            procs.append(subprocess.Popen(
                [str(TWISTD), "-n", "--pidfile=", "cg", "--listen", "tcp:0:interface=127.0.0.1",
                 "--anthropic-upstream", fake.url, "--store", f"redis://cg@127.0.0.1:{redis_server.port}/0",
                 "--store-password-file", str(tmp_path / "password")],
                cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            ))
            log.close()
        ports = [await threads.deferToThread(_announced_port, tmp_path / f"{name}.log") for name in ("one", "two")]
        bash = command_output()
        ident = marker_id(bash.encode())
        assert await threads.deferToThread(_post, ports[0], history(bash, "x"), {}) == 200
        assert markers(fake.received[0]) == [ident]
        assert await threads.deferToThread(_post, ports[1], history("short", "x"), {"x-fake-expand": ident}) == 200
        assert continued_with(fake) == bash
        assert await threads.deferToThread(_post, ports[1], history(bash, "x"), {}) == 200
        assert fake.received[-1].body == fake.received[0].body
        for name in ("one", "two"):
            assert "s3cret" not in (tmp_path / f"{name}.log").read_text()
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)


def _announced_port(log: Path) -> int:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        match = re.search(r"listening on http://127\.0\.0\.1:(\d+) ", log.read_text(errors="replace"))
        if match:
            return int(match.group(1))
        time.sleep(0.05)
    raise AssertionError(f"cg did not say where it listens:\n{log.read_text(errors='replace')}")


def _post(port: int, body: dict, headers: dict) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/v1/messages?beta=true", claude_code_bytes(body),
                     {"content-type": "application/json", "anthropic-version": "2023-06-01", **headers})
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()
