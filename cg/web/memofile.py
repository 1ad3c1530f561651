"""The memo's decisions kept on disk across a restart (--memo-dir; cg.compaction.snapshot).

Each process writes its own file every 10 minutes while it makes new decisions and when it stops
gracefully (after its requests drained), on a thread of its own (`MemoFile`); at start, before
it listens, it reads every file in the directory: with --workers a conversation may land on any
worker, and a decision is the same whichever made it. A file of other code is ignored
(`code_fingerprint`), one that cannot be read is logged and ignored: the memo only saves work, so
nothing is lost without it. A process that is killed loses the decisions of its last minutes.

The files hold the rewritten texts of tool results (heads and tails of outputs): they are
written readable by cg's user only, like the store.
"""

from __future__ import annotations

import hashlib
import os
import sys
import unicodedata
from pathlib import Path
from typing import cast

from twisted.internet import task
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IReactorFromThreads, IReactorTime
from twisted.logger import Logger

from cg import __version__
from cg.compaction import snapshot
from cg.compaction.pipeline import Memo, _Decision, _DecisionKey
from cg.store import default_store_url, parse_store_url
from cg.worker import Worker

log = Logger(namespace="cg.web.memofile")

OFF = "none"
CHECKPOINT_INTERVAL = 600.0  # seconds: what a killed process's next start misses at most


def memo_dir(option: str | None, store_url: str | None) -> str | None:
    """Where the decisions are kept: --memo-dir as given (`none`: nowhere), else beside the
    store (sqlite:PATH: PATH's name with `.memo`; Redis: `memo` in the state directory; memory:
    nowhere, a memory store does not outlive the process either)."""
    if option is not None:
        return None if option == OFF else os.path.expanduser(option)
    scheme, where = parse_store_url(store_url or default_store_url())
    if scheme == "memory":
        return None
    if scheme == "redis":
        where = parse_store_url(default_store_url())[1]
        return os.path.join(os.path.dirname(where), "memo")
    return os.path.splitext(where)[0] + ".memo"


def code_fingerprint() -> str:
    """What made a decision: cg's version, the source of the layers decisions come from, and the
    Python whose `re` and `json` they use (its version and Unicode tables). Computed at start:
    at a stop the files on disk may be an upgrade's, not the running code."""
    from cg import compaction, wire

    digest = hashlib.sha256(f"{__version__}\0{sys.version_info[:2]}\0{unicodedata.unidata_version}".encode())
    for package in (compaction, wire):
        root = Path(package.__file__ or "").parent
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def file_name(worker_index: int | None) -> str:
    return "cg.json" if worker_index is None else f"worker-{worker_index}.json"


def load(memo: Memo, directory: str, code: str) -> int:
    """Read every snapshot of `code` in `directory` into `memo`, oldest first: the decisions read.

    Blocking: called at start, before cg listens. A file that cannot be read is skipped.
    """
    dated = []
    for path in Path(directory).glob("*.json"):  # nothing when there is no directory yet
        try:
            dated.append((path.stat().st_mtime, path))
        except OSError:
            continue  # gone meanwhile
    read = 0
    for _, path in sorted(dated):
        try:
            read += snapshot.restore(memo, path.read_bytes(), code)
        except Exception as error:  # noqa: BLE001 -- whatever is wrong with a file, cg starts without it
            log.warn("cg memo: cannot read {path}, starting without it: {error}", path=str(path), error=error)
    if read:
        log.info("cg memo: {n} decisions from {directory}", n=read, directory=directory)
    return read


class MemoFile:
    """A process's own file of decisions: rewritten every `interval` seconds while the memo
    makes new ones (`start`), and a last time at `stop`.

    The checkpoints are for a process that is killed, which writes nothing at its end: its next
    start reads decisions at most `interval` seconds old. Every write runs on one thread of its
    own, in order (the last is the stop's); the reactor thread only copies the table's entries.
    """

    def __init__(self, memo: Memo, directory: str, name: str, code: str,
                 reactor: IReactorFromThreads | None = None, interval: float = CHECKPOINT_INTERVAL,
                 clock: IReactorTime | None = None) -> None:
        if reactor is None:
            from twisted.internet import reactor as installed

            reactor = cast(IReactorFromThreads, installed)
        self.memo, self.directory, self.name, self.code = memo, directory, name, code
        self.reactor = reactor  # the writes' thread answers through it
        self._worker: Worker | None = None  # started at the first write, once the reactor runs
        self._checkpoints = task.LoopingCall(self.checkpoint)
        # Without a clock of its own, the reactor keeps the time too.
        self._checkpoints.clock = clock if clock is not None else cast(IReactorTime, reactor)
        self._interval = interval
        self._written = memo.decisions.misses  # a new decision is a miss first

    def start(self) -> None:
        self._checkpoints.start(self._interval, now=False)

    def checkpoint(self) -> Deferred[None]:
        """Write the file if the memo has made decisions since the last write (never fails: a
        failure would stop the checkpoints)."""
        if self.memo.decisions.misses == self._written:
            return succeed(None)
        try:
            return self._save()
        except Exception:  # noqa: BLE001 -- e.g. no thread to be had: the next checkpoint tries again
            log.failure("cg memo: cannot write {name} in {directory}", name=self.name, directory=self.directory)
            return succeed(None)

    def stop(self) -> Deferred[None]:
        """The last write (whatever changed), then the thread ends."""
        if self._checkpoints.running:
            self._checkpoints.stop()
        saved = self._save()
        saved.addBoth(lambda _: self._worker.stop() if self._worker is not None else None)
        return saved

    def _save(self) -> Deferred[None]:
        """Fires when written (or failed to be: logged, never an error, since a stop must go on)."""
        self._written = self.memo.decisions.misses
        items = self.memo.decisions.items()
        if self._worker is None:
            self._worker = Worker("cg-memo", self.reactor)
        written = self._worker.submit(_write, Path(self.directory), self.name, items, self.code)
        written.addErrback(lambda failure: log.failure("cg memo: cannot write {name} in {directory}", failure,
                                                       name=self.name, directory=self.directory))
        return written


def _write(directory: Path, name: str, items: list[tuple[_DecisionKey, _Decision]], code: str) -> None:
    """Encode and write atomically: a reader sees the last file whole, or this one."""
    data = snapshot.dump(items, code)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    partial = directory / f".{name}.{os.getpid()}"
    for left in directory.glob(f".{name}.*"):  # a process killed while it wrote left its part
        if left != partial:
            left.unlink(missing_ok=True)
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.replace(partial, directory / name)
