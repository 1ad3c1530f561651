"""Shared fixtures: a fake provider on 127.0.0.1 and cg in-process in front of it."""

import os
import subprocess
import sys

import attrs
import pytest
import pytest_twisted
from twisted.internet import defer, reactor
from twisted.internet.testing import MemoryReactorClock
from twisted.logger import formatEvent, globalLogPublisher

from cg.testing import FakeUpstream
from cg.testing.loopback import Loopback
from cg.web.config import Config
from cg.web.service import CGService

# Before a test module first imports them: the helpers' asserts explain themselves as a test's do.
pytest.register_assert_rewrite("helpers")


@pytest.fixture(autouse=True, scope="session")
def _own_state_directory(tmp_path_factory):
    """cg's default store and memo files go to a directory of the run's, not the user's
    ~/.local/state (every cg the tests start, in process or spawned, inherits this)."""
    state = tmp_path_factory.mktemp("state")
    saved = {name: os.environ.pop(name, None) for name in ("STATE_DIRECTORY", "XDG_STATE_HOME")}
    os.environ["XDG_STATE_HOME"] = str(state)
    yield state
    for name, value in saved.items():
        os.environ.pop(name, None)
        if value is not None:
            os.environ[name] = value


@attrs.define
class RunningCG:
    service: CGService

    @property
    def port(self) -> int:
        return self.service.ports[0].getHost().port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def stats(self):
        return self.service.stats

    def stop(self):
        return self.service.stopService()


def start_cg(**overrides) -> RunningCG:
    config = Config(listen=("tcp:0:interface=127.0.0.1",), **{"store": "memory:", **overrides})
    service = CGService(config, reactor)
    service.privilegedStartService()
    service.startService()
    return RunningCG(service)


def _serving():
    """A FakeUpstream on 127.0.0.1 for the test's length."""
    upstream = FakeUpstream()
    upstream.listen(reactor)
    yield upstream
    pytest_twisted.blockon(upstream.stop())


@pytest.fixture
def fake():
    yield from _serving()


@pytest.fixture
def fake_openai():
    yield from _serving()


@pytest.fixture
def attacker():
    """A server the client would like cg to send its credentials to."""
    yield from _serving()


@pytest.fixture
def make_cg():
    """Start cg with config overrides; every instance is stopped after the test."""
    started = []

    def make(**overrides) -> RunningCG:
        running = start_cg(**overrides)
        started.append(running)
        return running

    yield make
    for running in started:
        if running.service.running:
            pytest_twisted.blockon(running.stop())


@pytest.fixture
def cg(make_cg, fake, fake_openai) -> RunningCG:
    """cg with the Anthropic upstream at `fake` and the OpenAI one at `fake_openai`."""
    return make_cg(anthropic_upstream=fake.url, openai_upstream=fake_openai.url)


class LogEvents(list):
    """The events one log namespace emits during a test (at one level, if given), in order.

    A twisted.logger observer.
    """

    def __init__(self, namespace: str, level=None):
        super().__init__()
        self.namespace = namespace
        self.level = level

    def __call__(self, event):
        if event.get("log_namespace") == self.namespace and self.level in (None, event["log_level"]):
            self.append(event)

    def levels(self) -> list:
        return [event["log_level"] for event in self]

    def texts(self, level=None) -> list[str]:
        return [formatEvent(event) for event in self if level is None or event["log_level"] is level]


@pytest.fixture
def clock():
    return MemoryReactorClock()


@pytest.fixture
def net(clock):
    """What listens on `clock` and its TCP clients, connected in memory (`pump()` moves the bytes)."""
    return Loopback(clock)


@pytest.fixture
def cg_in_memory(clock, net):
    """``cg_in_memory(**config)``: cg itself (a CGService, as make_cg starts it) on the MemoryReactorClock.

    It reaches its upstreams, and its clients reach it, through `net`: its port is CG_PORT.
    """
    from helpers.clients import CG_PORT  # here: after the helpers' asserts are set to be rewritten

    started = []

    def start(**overrides):
        config = Config(listen=(f"tcp:{CG_PORT}:interface=127.0.0.1",), store="memory:", **overrides)
        service = CGService(config, clock)
        service.privilegedStartService()
        service.startService()
        started.append(service)
        net.pump()
        return service

    yield start
    for service in started:
        stopped = service.stopService()
        net.pump()
        assert stopped.called


@pytest.fixture
def logged():
    """``logged(namespace, level=None)``: a LogEvents collecting those events until the test ends."""
    observers = []

    def collect(namespace: str, level=None) -> LogEvents:
        events = LogEvents(namespace, level)
        globalLogPublisher.addObserver(events)
        observers.append(events)
        return events

    yield collect
    for events in observers:
        globalLogPublisher.removeObserver(events)


@pytest.fixture
def store_log(logged):
    """Every event cg.store logs during the test."""
    return logged("cg.store")


class LogLines(list):
    """The text of every line cg logs (namespaces cg.*), in order, as a twisted.logger observer."""

    def __init__(self):
        super().__init__()
        self._waiting: list[tuple[str, defer.Deferred]] = []

    def __call__(self, event):
        if not event.get("log_namespace", "").startswith("cg."):
            return
        text = formatEvent(event)
        self.append(text)
        for part, d in list(self._waiting):
            if part in text:
                self._waiting.remove((part, d))
                d.callback(text)

    def containing(self, part: str) -> list[str]:
        return [text for text in self if part in text]

    def wait_for(self, part: str, timeout: float = 10.0) -> defer.Deferred:
        """Fires with the first line holding `part`, logged already or later."""
        for text in self:
            if part in text:
                return defer.succeed(text)
        d = defer.Deferred()
        self._waiting.append((part, d))
        return d.addTimeout(timeout, reactor)


@pytest.fixture
def cg_log():
    lines = LogLines()
    globalLogPublisher.addObserver(lines)
    yield lines
    globalLogPublisher.removeObserver(lines)


@pytest.fixture
def redis_server(tmp_path_factory):
    """A real redis-server on 127.0.0.1 for this test (see redisserver.py), killed after it."""
    from redisserver import start_redis

    server = start_redis(tmp_path_factory)
    yield server
    server.kill()


@pytest.fixture(autouse=True)
def _no_unexpected_events():
    """A sans-io machine fed an event its state has no row for is a bug: cg counts and logs it and
    goes on (cg.web.driver); under test it fails the test that caused it."""
    unexpected: list[str] = []

    def observe(event):
        if event.get("cg_unexpected"):
            unexpected.append(formatEvent(event))

    globalLogPublisher.addObserver(observe)
    try:
        yield
    finally:
        globalLogPublisher.removeObserver(observe)
    assert not unexpected, unexpected


@pytest.fixture
def closing():
    """Close every threaded store a test opened (their threads hold the files, the connections)."""
    stores = []
    yield stores.append
    for store in stores:
        pytest_twisted.blockon(store.close())


@pytest.fixture
def spawn(tmp_path):
    """Start a process in tmp_path, output to a log file; every one is killed after the test."""
    from helpers.processes import TWISTD, WAIT
    procs = []

    def start(argv, env, name="proc"):
        assert TWISTD.exists(), f"no twistd next to {sys.executable}: is cg installed here?"
        log = tmp_path / f"{name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [str(a) for a in argv],
                cwd=tmp_path,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        proc.log = log
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=WAIT)
