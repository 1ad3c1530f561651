"""The change log (``--changelog PATH``): one JSON line per compaction, per request's usage and per
keep-alive ping.

``cg-report`` (cg/report.py) reads it. The record builders below are the schema: a field is
only ever added, never renamed or removed, so old logs stay readable.

All file I/O happens on one worker thread (cg.worker): the reactor thread serializes a
record and hands the line over, and never waits for the disk. A write that fails (disk full,
directory gone) loses its records; they are counted in ``errors`` and the outage is logged
once, never raised into the reactor.

The file is opened in append mode and, when cg creates it, with mode 0600: it holds no
originals, but it does hold tool names and session ids. ``reopen()`` (SIGHUP, after
logrotate renamed the file) makes the next write go to a new file at the same path.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable

import ujson
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IReactorFromThreads
from twisted.logger import Logger

from cg.worker import Worker

log = Logger()

# Records waiting for the worker beyond which new ones are dropped (and counted as errors):
# a disk that hangs (a dead NFS mount) must not grow cg's memory without bound.
MAX_PENDING = 100_000
# Most bytes handed to one os.write: the worker batches what is queued into few syscalls.
MAX_BATCH_BYTES = 1 << 20

_OPEN_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)


def compaction_record(
    *,
    time: float,
    session: str,
    seq: int,
    message: int,
    block: int | None,
    tool: str | None,
    component: str,
    lossy: bool,
    marker: str | None,
    tokens_before: int,
    tokens_after: int,
    content_hash: str,
    part: int | None,
    step: int,
) -> dict[str, object]:
    """One component's rewrite of one tool result in one forwarded request.

    A decision replayed on a later turn is logged again: summing ``tokens_deleted`` over the
    log gives the cumulative figure, which counts every re-send. ``hash`` identifies the
    result's original content, so ``cg-report`` can count a reformat compaction (no marker)
    once. ``block`` is None for an OpenAI ``role: "tool"`` message (it has no blocks);
    ``part`` is the text part's index when the result's content is a list, else None.

    A result several components rewrote has one line per component, in order, numbered by
    ``step`` from 0: ``tokens_before`` of step 0 is the result as the client sent it, and each
    later step starts from the previous one's ``tokens_after``. Sum ``tokens_before`` over
    step-0 lines only, or a result's intermediate text is counted twice; ``tokens_deleted``
    adds up over all lines.
    """
    return {
        "kind": "compaction",
        "time": time,
        "session": session,
        "seq": seq,
        "message": message,
        "block": block,
        "tool": tool,
        "component": component,
        "lossy": lossy,
        "marker": marker,
        "tokens_before": tokens_before,
        "tokens_after": tokens_after,
        "tokens_deleted": tokens_before - tokens_after,
        "hash": content_hash,
        "part": part,
        "step": step,
    }


def usage_record(
    *,
    time: float,
    session: str,
    seq: int,
    dialect: str,
    path: str,
    input_tokens: int,
    cache_read_tokens: int,
    cache_write_tokens: int,
    output_tokens: int,
    expand_rounds: int = 0,
    model: str | None = None,
    cache_write_1h_tokens: int = 0,
) -> dict[str, object]:
    """The usage the provider billed for one request (one line per request).

    ``input_tokens`` is uncached input only (Anthropic's ``input_tokens``; for OpenAI,
    ``prompt_tokens`` minus the cached ones), so the four token counts add up to what was
    billed; ``cache_write_1h_tokens`` are those of ``cache_write_tokens`` written for an hour (priced
    2x the input, the others 1.25x). ``expand_rounds``: expand calls cg answered itself within this
    request. ``model``: the request's, so that cg-report prices the line (cg.record.pricing); None
    when it named none.
    """
    return {
        "kind": "usage",
        "time": time,
        "session": session,
        "seq": seq,
        "dialect": dialect,
        "path": path,
        "input_tokens": input_tokens,
        "cache_read_tokens": cache_read_tokens,
        "cache_write_tokens": cache_write_tokens,
        "output_tokens": output_tokens,
        "expand_rounds": expand_rounds,
        "model": model,
        "cache_write_1h_tokens": cache_write_1h_tokens,
    }


def ping_record(
    *,
    time: float,
    session: str,
    seq: int,
    model: str | None,
    input_tokens: int,
    cache_read_tokens: int,
    cache_write_tokens: int,
    output_tokens: int,
    cache_write_1h_tokens: int,
    cost_usd: float,
) -> dict[str, object]:
    """A keep-alive ping cg sent on its own (``--keepalive``) and the usage it was billed, as
    ``usage_record``'s, with its cost at list price: spending of cg's, which ``cg-report`` counts
    apart from the clients' requests. ``seq`` is the ping's own number, from the same sequence."""
    return {
        "kind": "ping",
        "time": time,
        "session": session,
        "seq": seq,
        "dialect": "anthropic",
        "model": model,
        "input_tokens": input_tokens,
        "cache_read_tokens": cache_read_tokens,
        "cache_write_tokens": cache_write_tokens,
        "output_tokens": output_tokens,
        "cache_write_1h_tokens": cache_write_1h_tokens,
        "cost_usd": cost_usd,
    }


def _encode(record: dict[str, object]) -> bytes:
    # Compact, ASCII-only (any session id or tool name survives), "/" unescaped (paths read).
    return ujson.dumps(record, ensure_ascii=True, escape_forward_slashes=False).encode("ascii") + b"\n"


def _write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` (os.write may write less than asked, e.g. as a disk fills)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class _File:
    """The thread half of ChangeLog: owns the file descriptor. Only jobs on the change log's
    worker thread touch it; everything the reactor must learn goes through ``deliver``
    (``reactor.callFromThread``)."""

    def __init__(
        self,
        path: str,
        deliver: Callable[..., None],
        failed: Callable[[int, str | None], None],
        recovered: Callable[[], None],
    ):
        self.path = path
        self.fd: int | None = None
        self.deliver = deliver
        self.failed = failed  # (records lost, error text), called through deliver
        self.recovered = recovered  # (), called through deliver
        self.failing = False
        # A failed write may have left half a line at the end of the file: start the next
        # write with a newline so that half line stays a line of its own (cg-report skips it).
        self.torn = False

    # Jobs: run on the worker thread, in the order the reactor submitted them.

    def drain(self, pending: deque[bytes]) -> None:
        """Write the lines waiting in ``pending``, in batches of few syscalls.

        Every line queued has a drain job behind it, so most find ``pending`` emptied by
        an earlier one. ChangeLog appends on the reactor thread, this pops: a deque's
        append and popleft are atomic.
        """
        while pending:
            lines, size = [], 0
            while pending and size < MAX_BATCH_BYTES:
                lines.append(pending.popleft())
                size += len(lines[-1])
            self._write(lines)

    def reopen(self) -> None:
        self.close()
        self.open()

    def open(self) -> None:
        try:
            self.fd = os.open(self.path, _OPEN_FLAGS, 0o600)
        except (OSError, ValueError) as e:  # ValueError: a path with a NUL in it
            self._fail(0, f"cannot open: {e}")

    def close(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            try:
                os.close(fd)
            except OSError as e:
                self._fail(0, f"close failed: {e}")

    def _write(self, lines: list[bytes]) -> None:
        # After an open failure, every write tries again: the directory may be back.
        if self.fd is None:
            self.open()
        fd = self.fd
        if fd is None:
            self._fail(len(lines), None)
            return
        data = b"".join(lines)
        try:
            _write_all(fd, b"\n" + data if self.torn else data)
        except Exception as e:  # noqa: BLE001 -- the thread must outlive any failure
            self.torn = True
            self._fail(len(lines), f"write failed: {e}")
            return
        self.torn = False
        if self.failing:
            self.failing = False
            self.deliver(self.recovered)

    def _fail(self, lost: int, error: str | None) -> None:
        self.failing = True
        self.deliver(self.failed, lost, error)


def _nothing() -> None:
    """A job that only waits its turn: what was submitted before it has run."""


class ChangeLog:
    """Appends records to the file at ``path`` (``~`` is expanded), off the reactor thread.

    Methods are called on the reactor thread; ``errors`` (records lost) is updated there.
    """

    enabled = True

    def __init__(self, path: str, reactor: IReactorFromThreads | None = None):
        self.path = os.path.expanduser(path)
        self.errors = 0
        self._logged = False  # the current outage has been logged
        self._lost_in_outage = 0
        self._closed = False
        # Lines not yet taken by the worker. A new deque at each reopen: the drain jobs
        # submitted before it empty the old one into the old file.
        self._pending: deque[bytes] = deque()
        self._worker = Worker("cg-changelog", reactor)
        self._file = _File(
            self.path, self._worker.reactor.callFromThread, self._failed, self._recovered
        )
        self._worker.submit_background(self._file.open)

    def write(self, record: dict[str, object]) -> None:
        """Queue one record (a dict from a builder above). Never raises, never blocks."""
        if self._closed:
            self._failed(1, "the change log is closed")
            return
        if len(self._pending) >= MAX_PENDING:
            self._failed(1, f"{MAX_PENDING} records waiting for the disk")
            return
        try:
            line = _encode(record)
        except Exception as e:  # noqa: BLE001 -- a bad record must not fail a request
            self._failed(1, f"cannot serialize a record: {e}")
            return
        self._pending.append(line)
        self._worker.submit_background(self._file.drain, self._pending)

    def flush(self) -> Deferred[None]:
        """Fires once every record written so far has been handed to the kernel (or lost)."""
        if self._closed:
            return succeed(None)
        return self._worker.submit(_nothing)

    def reopen(self) -> Deferred[None]:
        """Close the file and open ``path`` again (creating it): for logrotate, on SIGHUP.
        Records written before this call go to the old file."""
        if self._closed:
            return succeed(None)
        self._pending = deque()
        return self._worker.submit(self._file.reopen)

    def close(self) -> Deferred[None]:
        """Write what is queued, close the file and end the worker thread."""
        if not self._closed:
            self._closed = True
            self._worker.submit_background(self._file.close)
        return self._worker.stop()

    # Called on the reactor thread (from the worker, through callFromThread).

    def _failed(self, lost: int, error: str | None) -> None:
        self.errors += lost
        self._lost_in_outage += lost
        if error is not None and not self._logged:
            self._logged = True
            log.error(
                "cg change log {path}: {error}; records are lost until writing works again",
                path=self.path,
                error=error,
            )

    def _recovered(self) -> None:
        if self._logged:
            log.info(
                "cg change log {path}: writing again ({lost} records lost)",
                path=self.path,
                lost=self._lost_in_outage,
            )
        self._logged = False
        self._lost_in_outage = 0


class NullChangeLog:
    """The change log when ``--changelog`` is not given: does nothing."""

    enabled = False
    path = None
    errors = 0

    def write(self, record: dict[str, object]) -> None:
        pass

    def flush(self) -> Deferred[None]:
        return succeed(None)

    def reopen(self) -> Deferred[None]:
        return succeed(None)

    def close(self) -> Deferred[None]:
        return succeed(None)


def open_changelog(path: str | None, reactor: IReactorFromThreads | None = None) -> ChangeLog | NullChangeLog:
    """A ChangeLog for ``--changelog PATH``, or a NullChangeLog without one."""
    return NullChangeLog() if not path else ChangeLog(path, reactor)
