"""The serial worker: jobs in order on one real thread, results on the reactor thread, a
failing job never ends the thread, and a stop that waits for what was submitted."""

import threading

import pytest
import pytest_twisted
from twisted.internet import reactor
from twisted.logger import LogLevel

from cg.worker import Worker, WorkerStopped

WAIT = 5.0  # seconds before a test gives up on an Event (it is not a measurement)


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def workers():
    """Make Workers; every one still running is stopped after the test."""
    made = []

    def make(**kwargs):
        worker = Worker("test-worker", reactor, **kwargs)
        made.append(worker)
        return worker

    yield make
    for worker in made:
        pytest_twisted.blockon(worker.stop().addTimeout(WAIT, reactor))


@pytest.fixture
def failures_logged(logged):
    return logged("cg.worker", LogLevel.critical)


@pytest_twisted.ensureDeferred
async def test_jobs_run_in_order_on_one_thread_and_answer_on_the_reactor(workers):
    worker = workers()
    ran = []

    def job(n):
        ran.append((n, threading.get_ident()))
        return n * 10

    answered = []
    results = [
        worker.submit(job, n).addCallback(lambda r: answered.append(threading.get_ident()) or r)
        for n in range(100)
    ]
    assert [await d for d in results] == [n * 10 for n in range(100)]
    assert [n for n, _ in ran] == list(range(100))
    assert {thread for _, thread in ran} == {worker.thread.ident}
    assert worker.thread.ident != threading.get_ident()
    assert set(answered) == {threading.get_ident()}


@pytest_twisted.ensureDeferred
async def test_a_job_that_raises_fails_its_deferred_and_the_next_job_runs(workers):
    worker = workers()

    def boom():
        raise KeyError("gone")

    with pytest.raises(KeyError, match="gone"):
        await worker.submit(boom)
    assert await worker.submit(lambda: "still here").addTimeout(WAIT, reactor) == "still here"


@pytest_twisted.ensureDeferred
async def test_a_background_job_that_raises_is_reported_and_the_thread_goes_on(workers):
    reported = []
    worker = workers(on_error=lambda failure: reported.append((failure, threading.get_ident())))
    ran = []
    worker.submit_background(ran.append, 1)
    worker.submit_background(lambda: {}["missing"])
    worker.submit_background(ran.append, 2)
    assert await worker.submit(lambda: "alive").addTimeout(WAIT, reactor) == "alive"
    assert ran == [1, 2]
    [(failure, thread)] = reported
    assert failure.check(KeyError) and thread == threading.get_ident()


@pytest_twisted.ensureDeferred
async def test_without_on_error_a_background_failure_is_logged(workers, failures_logged):
    worker = workers()
    worker.submit_background(lambda: 1 / 0)
    await worker.submit(lambda: None).addTimeout(WAIT, reactor)
    [event] = failures_logged
    assert event["log_failure"].check(ZeroDivisionError)


def test_the_tick_runs_while_idle(workers):
    ticked = threading.Event()
    workers(tick=ticked.set, interval=0.01)
    assert ticked.wait(WAIT)


@pytest_twisted.ensureDeferred
async def test_the_tick_runs_between_jobs_once_due(workers):
    clock = FakeClock()
    order = []
    worker = workers(tick=lambda: order.append("tick"), interval=10, clock=clock)

    def job(name, advance=0.0):
        clock.now += advance
        order.append(name)

    for d in [
        worker.submit(job, "a", 9.0),  # not due yet
        worker.submit(job, "b", 1.0),  # due now: the tick follows this job
        worker.submit(job, "c", 5.0),
        worker.submit(job, "d", 5.0),  # due again
        worker.submit(job, "e"),  # d's answer may come before its tick; e's cannot
    ]:
        await d
    assert order == ["a", "b", "tick", "c", "d", "tick", "e"]


@pytest_twisted.ensureDeferred
async def test_a_tick_that_raises_is_reported_and_ticks_again(workers):
    clock = FakeClock()
    reported = []
    ticks = []

    def tick():
        ticks.append(clock.now)
        raise OSError("disk")

    def advance():
        clock.now += 1

    worker = workers(tick=tick, interval=1, clock=clock, on_error=reported.append)
    await worker.submit(advance)
    await worker.submit(advance).addTimeout(WAIT, reactor)
    await worker.submit(lambda: None).addTimeout(WAIT, reactor)  # the errors come before this answer
    assert ticks == [1, 2]
    assert [f.check(OSError) for f in reported] == [OSError, OSError]


def test_a_tick_needs_an_interval():
    with pytest.raises(ValueError):
        Worker("test-worker", reactor, tick=lambda: None, interval=0)


@pytest_twisted.ensureDeferred
async def test_stop_fires_after_every_job_submitted_before(workers):
    worker = workers()
    gate = threading.Event()
    ran = []
    worker.submit_background(gate.wait, WAIT)
    for n in range(10):
        worker.submit_background(ran.append, n)
    stopped = worker.stop()
    again = worker.stop()
    assert not stopped.called and ran == []
    gate.set()
    await stopped
    await again
    assert ran == list(range(10))
    worker.thread.join(WAIT)
    assert not worker.thread.is_alive()
    await worker.stop()  # once stopped, at once


@pytest_twisted.ensureDeferred
async def test_submit_after_stop_fails_clearly(workers):
    worker = workers()
    stopped = worker.stop()
    with pytest.raises(WorkerStopped, match="test-worker"):
        await worker.submit(lambda: None)
    with pytest.raises(WorkerStopped):
        worker.submit_background(lambda: None)
    await stopped
    with pytest.raises(WorkerStopped):
        await worker.submit(lambda: None)
