"""`--workers N`: N cg processes serving one set of listening sockets, for every core.

The parent (`twistd cg --workers N`) binds every `--listen` endpoint (systemd's sockets under socket
activation), never accepts on them, and starts N worker processes that adopt them: the kernel
hands each new connection to one worker. Each worker is a whole cg (its own upstream pool, memo
and store handle); originals and frozen repairs are shared through the store (SQLite in WAL mode,
or Redis), and every decision is a pure function of the request, so a conversation's bytes are
the same whichever worker serves a turn.

The parent restarts a worker that dies (after 1 s, doubling up to 30 s while workers keep dying
young), forwards SIGHUP (the change log's reopen), and on stop sends every worker SIGTERM and waits
while they drain, then SIGKILLs what is left after the drain timeout and a margin.

Metrics: the workers run in prometheus-client's multiprocess mode, so one scrape of any worker
sums them all. The directory is `PROMETHEUS_MULTIPROC_DIR` when set (emptied at start), else a
private one the parent makes and removes; a worker that ends is marked dead there.

A worker runs `python -m cg.web.workers`. What it serves (its configuration, the store's
password included, its index and the count, the socket fds it inherited) comes as one JSON line
on a pipe from the parent (fd 3), never in its environment or argv, where other processes could
read it; the same pipe's end tells the worker its parent is gone. Its sockets are fds 4….
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import attrs
from prometheus_client import multiprocess
from twisted.application import service
from twisted.internet import abstract, defer, fdesc, protocol, tcp
from twisted.internet.error import ConnectionDone, ConnectionLost, ProcessExitedAlready
from twisted.internet.interfaces import IAddress, IDelayedCall, IProcessTransport, IReactorFDSet
from twisted.logger import Logger, globalLogBeginner, textFileLogObserver
from twisted.python.failure import Failure

from cg import __version__
from cg.web import systemd
from cg.web.config import Config
from cg.web.service import CGService, SignalHandler, bind_now, endpoint, listening_url, settle_gc

log = Logger(namespace="cg.web.workers")

_PARENT_FD = 3  # a worker's pipe from its parent: what to serve, then its end when the parent dies
_FIRST_FD = 4  # a worker's sockets, in --listen order
_RESTART_DELAY = 1.0
_MAX_RESTART_DELAY = 30.0
_YOUNG = 10.0  # a worker that dies younger than this doubles the next restart's delay
_KILL_MARGIN = 10.0  # seconds past the drain timeout before a worker that has not stopped is killed
_SYSTEMD_VARIABLES = ("NOTIFY_SOCKET", "LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES")
_METRICS_DIR = "PROMETHEUS_MULTIPROC_DIR"


@attrs.frozen
class WorkerInfo:
    """Which worker this process is, and the sockets it adopts: (fd, address family) each."""

    index: int
    of: int
    sockets: tuple[tuple[int, int], ...]


def _config_from(fields: dict[str, object]) -> Config:
    """A Config from JSON (whose arrays were the Config's tuples)."""
    return Config(**{name: tuple(value) if isinstance(value, list) else value
                     for name, value in fields.items()})  # type: ignore[arg-type]


class _NeverAccepts(protocol.Factory):
    """The parent's factory: its ports stop reading before the reactor runs, so nothing is built."""

    noisy = False

    def buildProtocol(self, addr: IAddress | None) -> protocol.Protocol | None:
        return None  # refuses the connection, should one ever be accepted here


class _Worker(protocol.ProcessProtocol):
    def __init__(self, pool: WorkerPool, index: int, started: float):
        self.pool = pool
        self.index = index
        self.started = started
        self.ended: defer.Deferred[None] = defer.Deferred()
        self.process: IProcessTransport | None = None
        self.pid: int | None = None  # kept: the transport forgets it once the process is reaped

    def signal(self, name: str) -> None:
        if self.process is not None and not self.ended.called:
            try:
                self.process.signalProcess(name)
            except ProcessExitedAlready:
                pass

    def processEnded(self, reason: Failure) -> None:
        self.ended.callback(None)
        self.pool._ended(self, reason.value)


class WorkerPool(service.Service):
    """The parent of `--workers N`: binds, spawns, restarts, forwards signals, stops. See the module docstring."""

    name = "cg"  # type: ignore[assignment]  # Twisted's Service says `name = None`

    # reactor: the installed one's parts the pool uses (IReactorTime, IReactorProcess, IReactorFromThreads,
    # and IReactorTCP through the endpoints), which no one type says.
    def __init__(self, config: Config, reactor: Any = None, executable: str = sys.executable) -> None:
        if reactor is None:
            from twisted.internet import reactor
        self.config = config
        self.reactor = reactor
        self.executable = executable
        self.ports: list[tcp.Port] = []  # tcp:, unix: and systemd: endpoints' (a unix.Port is one)
        self.workers: dict[int, _Worker] = {}
        self._delay = _RESTART_DELAY
        self._pending: dict[int, IDelayedCall] = {}  # index -> the delayed restart
        self._previous_hup: SignalHandler = None
        self._metrics_dir: Path | None = None
        self._own_metrics_dir = False  # made by this pool: removed at stop

    def bind(self) -> None:
        """Bind every --listen endpoint now (a port in use: one line, as `CGService.bind`)."""
        listens: list[defer.Deferred[tcp.Port]] = [  # what tcp:, unix: and systemd: endpoints listen with
            cast("defer.Deferred[tcp.Port]", endpoint(self.reactor, d).listen(_NeverAccepts())) for d in self.config.listen
        ]
        bind_now(defer.gatherResults(listens, consumeErrors=True).addCallback(self.ports.extend),
                 self.config.listen)
        for port in self.ports:
            port.stopReading()  # the workers accept, never the parent

    def privilegedStartService(self) -> None:
        super().privilegedStartService()  # type: ignore[no-untyped-call]  # untyped in Twisted
        if not self.ports:
            self.bind()

    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]  # untyped in Twisted
        self._open_metrics_dir()
        for index in range(self.config.workers):
            self._spawn(index)
        log.info("cg {version} listening on {where} with {n} workers (pids {pids})",
                 version=__version__, n=self.config.workers,
                 where=", ".join(listening_url(d, p.getHost()) for d, p in zip(self.config.listen, self.ports)),
                 pids=", ".join(str(w.pid) for w in self.workers.values()))
        try:
            self._previous_hup = signal.signal(signal.SIGHUP, lambda *_: self.reactor.callFromThread(self._hup))
        except ValueError:  # not the main thread (tests): no signal handlers
            self._previous_hup = None
        systemd.notify(b"READY=1")

    def _spawn(self, index: int) -> None:
        self._pending.pop(index, None)
        sockets = [(_FIRST_FD + k, port.addressFamily) for k, port in enumerate(self.ports)]
        spec = {"config": attrs.asdict(self.config), "index": index, "of": self.config.workers,
                "sockets": sockets}
        env = {k: v for k, v in os.environ.items() if k not in _SYSTEMD_VARIABLES}
        if self._metrics_dir is not None:
            env[_METRICS_DIR] = str(self._metrics_dir)
        fds: dict[int, object] = {0: 0, 1: 1, 2: 2, _PARENT_FD: "w"}
        fds.update((fd, port.fileno()) for (fd, _), port in zip(sockets, self.ports))
        worker = _Worker(self, index, self.reactor.seconds())
        worker.process = self.reactor.spawnProcess(worker, self.executable, [self.executable, "-m", "cg.web.workers"],
                                                   env=env, childFDs=fds)
        worker.process.writeToChild(_PARENT_FD, json.dumps(spec).encode() + b"\n")
        worker.pid = worker.process.pid
        self.workers[index] = worker

    def _open_metrics_dir(self) -> None:
        given = os.environ.get(_METRICS_DIR)
        if given:
            self._metrics_dir = Path(given)
            self._metrics_dir.mkdir(parents=True, exist_ok=True)
            for stale in self._metrics_dir.glob("*.db"):  # an earlier run's workers
                stale.unlink()
        else:
            self._metrics_dir = Path(tempfile.mkdtemp(prefix="cg-metrics-"))
            self._own_metrics_dir = True

    def _ended(self, worker: _Worker, reason: BaseException) -> None:
        if self.workers.get(worker.index) is worker:
            del self.workers[worker.index]
        if self._metrics_dir is not None and worker.pid is not None:
            multiprocess.mark_process_dead(  # type: ignore[no-untyped-call]  # untyped in prometheus_client
                worker.pid, str(self._metrics_dir))
        if not self.running:
            return
        lived = self.reactor.seconds() - worker.started
        self._delay = min(self._delay * 2, _MAX_RESTART_DELAY) if lived < _YOUNG else _RESTART_DELAY
        log.warn("cg worker {index} ({reason}) after {lived:.1f} s; restarting it in {delay:.0f} s",
                 index=worker.index, reason=reason, lived=lived, delay=self._delay)
        self._pending[worker.index] = self.reactor.callLater(self._delay, self._spawn, worker.index)

    def _hup(self) -> None:
        for worker in list(self.workers.values()):
            worker.signal("HUP")

    def stopService(self) -> defer.Deferred[Any]:  # no one reads its result
        """Stop every worker (SIGTERM: each drains), kill what is left after the drain timeout."""
        super().stopService()  # type: ignore[no-untyped-call]  # untyped in Twisted
        systemd.notify(b"STOPPING=1")
        if self._previous_hup is not None:
            signal.signal(signal.SIGHUP, self._previous_hup)
        for delayed in self._pending.values():
            delayed.cancel()
        self._pending.clear()
        workers = list(self.workers.values())
        for worker in workers:
            worker.signal("TERM")
        kill = self.reactor.callLater(self.config.drain_timeout + _KILL_MARGIN, self._kill, workers)
        stopped = defer.DeferredList([worker.ended for worker in workers])

        def done(_: object) -> defer.Deferred[list[tuple[bool, Any]]]:
            if kill.active():
                kill.cancel()
            if self._own_metrics_dir and self._metrics_dir is not None:
                shutil.rmtree(self._metrics_dir, ignore_errors=True)
            return defer.DeferredList([defer.maybeDeferred(port.stopListening) for port in self.ports])

        return stopped.addCallback(done)

    def _kill(self, workers: list[_Worker]) -> None:
        for worker in workers:
            if not worker.ended.called:
                log.warn("cg worker {index} did not stop in time: killing it", index=worker.index)
                worker.signal("KILL")


class _ParentWatch(abstract.FileDescriptor):
    """The read end of the parent's pipe: its end (the parent died) stops the worker. Only this
    pipe is made non-blocking: stdout is the parent's too (the journal's socket, a terminal)."""

    def __init__(self, fd: int, stop: Callable[[str], object], reactor: IReactorFDSet) -> None:
        super().__init__(reactor)
        self.fd = fd
        self.stop = stop
        fdesc.setNonBlocking(fd)

    def fileno(self) -> int:
        return self.fd

    def doRead(self) -> ConnectionLost | ConnectionDone | None:
        lost: ConnectionLost | ConnectionDone | None = fdesc.readFromFD(self.fd, lambda data: None)
        return lost

    def connectionLost(self, reason: Failure | None = None) -> None:
        super().connectionLost(reason)  # type: ignore[no-untyped-call]  # untyped in Twisted
        self.stop("its parent is gone")


def _read_spec(fd: int) -> dict[str, object]:
    """The parent's JSON line: blocking, before the reactor runs."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            raise SystemExit("cg worker: its parent was gone before it said what to serve")
        data += chunk
    spec = json.loads(data)
    if not isinstance(spec, dict):
        raise SystemExit("cg worker: its parent sent no configuration")
    return spec


def main() -> None:
    """A worker process: the CGService its parent describes on fd 3, on the sockets it inherited.

    It stops (draining, as `twistd cg` does) on the first SIGTERM or SIGINT (systemd and a
    terminal send them to every process, the parent forwards them too: later ones are no news) or
    when its parent is gone.
    """
    spec: Any = _read_spec(_PARENT_FD)
    from twisted.internet import reactor as installed

    reactor: Any = installed  # the running reactor's type: mypy knows only its interfaces

    globalLogBeginner.beginLoggingTo([textFileLogObserver(sys.stdout)], redirectStandardIO=False)
    info = WorkerInfo(spec["index"], spec["of"], tuple((fd, socket.AddressFamily(family))
                                                       for fd, family in spec["sockets"]))
    cg = CGService(_config_from(spec["config"]), reactor, worker=info)
    settle_gc()
    stopping: list[str] = []

    def stop(why: str) -> None:
        if not stopping:
            stopping.append(why)
            log.info("cg worker {index} stopping: {why}", index=info.index, why=why)
            reactor.stop()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda number, frame: reactor.callFromThread(stop, signal.Signals(number).name))
    cg.privilegedStartService()
    reactor.callWhenRunning(cg.startService)
    reactor.callWhenRunning(
        lambda: _ParentWatch(_PARENT_FD, stop, reactor).startReading()  # type: ignore[no-untyped-call]  # Twisted's
    )
    reactor.addSystemEventTrigger("before", "shutdown", cg.stopService)
    reactor.run(installSignalHandlers=False)


if __name__ == "__main__":
    main()
