"""One serial worker thread for blocking I/O (the store's SQLite, the change log's file).

The reactor thread must never wait for a disk, so such work runs here instead. Serial, not a
pool: a SQLite connection is bound to its thread and its writes are serialized anyway, and a
file's lines must land in the order they were written. Jobs run one at a time, in submission
order; what they return (or raise) comes back on the reactor thread, through
``reactor.callFromThread``, so the caller's state is only ever touched there.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

from twisted.internet.defer import Deferred, fail
from twisted.internet.interfaces import IReactorFromThreads
from twisted.logger import Logger
from twisted.python.failure import Failure

log = Logger()

T = TypeVar("T")

# (function, arguments, the Deferred waiting for it or None); None alone ends the thread.
_Job = tuple[Callable[..., object], tuple[object, ...], Deferred[Any] | None]


class WorkerStopped(Exception):
    """A job was submitted after ``stop()``: it would never run."""


class Worker:
    """A thread (started at once, a daemon) that runs the jobs submitted, one at a time.

    ``tick``, if given, runs on the thread every ``interval`` seconds of ``clock``, between
    jobs (for work batched until then, e.g. the store's last-use times). A background job
    (``submit_background``) or a tick that raises is handed to ``on_error`` on the reactor
    thread (logged, without one); the thread goes on with the next job either way.
    """

    def __init__(
        self,
        name: str,
        reactor: IReactorFromThreads | None = None,
        *,
        on_error: Callable[[Failure], object] | None = None,
        tick: Callable[[], object] | None = None,
        interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if tick is not None and interval <= 0:
            raise ValueError(f"a tick needs an interval > 0, not {interval}")
        if reactor is None:
            from twisted.internet import reactor as installed

            reactor = cast(IReactorFromThreads, installed)
        self.reactor = reactor  # answers and reports come back on its thread
        self._on_error = on_error
        self._tick = tick
        self._interval = interval
        self._clock = clock
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._stopping = False
        self._stopped = False
        self._waiting: list[Deferred[None]] = []  # stop()'s callers, until the thread ends
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def submit(self, fn: Callable[..., T], *args: object) -> Deferred[T]:
        """Run ``fn(*args)`` on the thread; the Deferred fires with its result or exception."""
        if self._stopping:
            return fail(WorkerStopped(f"{self.thread.name} is stopped"))
        d: Deferred[T] = Deferred()
        self._queue.put((fn, args, d))
        return d

    def submit_background(self, fn: Callable[..., object], *args: object) -> None:
        """Run ``fn(*args)`` on the thread, nobody waiting: an exception goes to ``on_error``.

        Raises WorkerStopped after ``stop()``.
        """
        if self._stopping:
            raise WorkerStopped(f"{self.thread.name} is stopped")
        self._queue.put((fn, args, None))

    def stop(self) -> Deferred[None]:
        """Fires once every job submitted before has run and the thread has ended.

        Later submits fail with WorkerStopped. Calling it again is fine.
        """
        d: Deferred[None] = Deferred()
        if self._stopped:
            d.callback(None)
            return d
        self._waiting.append(d)
        if not self._stopping:
            self._stopping = True
            self._queue.put(None)
        return d

    def _ended(self) -> None:
        self._stopped = True
        waiting, self._waiting = self._waiting, []
        for d in waiting:
            d.callback(None)

    def _report(self, failure: Failure) -> None:
        if self._on_error is not None:
            self._on_error(failure)
        else:
            log.failure("{name}: a background job failed", failure, name=self.thread.name)

    # On the thread.

    def _run(self) -> None:
        next_tick = self._clock() + self._interval
        while True:
            timeout = None if self._tick is None else max(0.0, next_tick - self._clock())
            try:
                job = self._queue.get(timeout=timeout)
            except queue.Empty:
                pass
            else:
                if job is None:
                    self.reactor.callFromThread(self._ended)
                    return
                self._do(*job)
            if self._tick is not None and self._clock() >= next_tick:
                next_tick = self._clock() + self._interval
                self._do(self._tick, (), None)

    def _do(self, fn: Callable[..., object], args: tuple[object, ...], d: Deferred[Any] | None) -> None:
        try:
            result = fn(*args)
        except Exception:  # noqa: BLE001 -- the thread must outlive any job
            failure = Failure()
            if d is None:
                self.reactor.callFromThread(self._report, failure)
            else:
                self.reactor.callFromThread(d.errback, failure)
        else:
            if d is not None:
                self.reactor.callFromThread(d.callback, result)
