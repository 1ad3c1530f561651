"""The change log: records in order, off the reactor thread, private, rotatable, never failing a request."""

import os
import stat
import threading
import time

import pytest
import pytest_twisted
import ujson
from twisted.logger import LogLevel

import cg.record.changelog
from cg.record.changelog import (
    ChangeLog,
    NullChangeLog,
    compaction_record,
    open_changelog,
    usage_record,
)
from cg.record.report import tally


def compaction(seq=1, **overrides):
    fields = dict(
        time=1_714_557_600.5,
        session="sess-1",
        seq=seq,
        message=3,
        block=0,
        tool="Bash",
        component="offload",
        lossy=True,
        marker="0123456789abcdef",
        tokens_before=5000,
        tokens_after=700,
        content_hash="0123456789abcdef",
        part=None,
        step=0,
    )
    fields.update(overrides)
    return compaction_record(**fields)


def usage(seq=1, **overrides):
    fields = dict(
        time=1_714_557_601.0,
        session="sess-1",
        seq=seq,
        dialect="anthropic",
        path="/v1/messages",
        input_tokens=10,
        cache_read_tokens=20_000,
        cache_write_tokens=1_500,
        output_tokens=300,
    )
    fields.update(overrides)
    return usage_record(**fields)


def read_records(path):
    with open(path, "rb") as f:
        return [ujson.loads(line) for line in f]


@pytest.fixture
def changelog(tmp_path):
    """Make ChangeLogs (default path: tmp/changes.jsonl) and close them after the test."""
    made = []

    def make(path=None, **kwargs):
        log = ChangeLog(str(path or tmp_path / "changes.jsonl"), **kwargs)
        made.append(log)
        return log

    yield make
    for log in made:
        pytest_twisted.blockon(log.close())


@pytest.fixture
def errors_logged(logged):
    return logged("cg.record.changelog", LogLevel.error)


@pytest.fixture
def slow_disk(monkeypatch):
    """``slow_disk()``: the change log's writes wait until the returned Event is set (10 s at most)."""

    def hold() -> threading.Event:
        disk = threading.Event()
        real_write = cg.record.changelog._write_all

        def slow_write(fd, data):
            disk.wait(10)
            real_write(fd, data)

        monkeypatch.setattr(cg.record.changelog, "_write_all", slow_write)
        return disk

    return hold


@pytest.fixture
def umask():
    old = os.umask(0o022)  # a usual umask, which alone would give 0644
    yield
    os.umask(old)


# The schema


def test_compaction_record_schema():
    record = compaction(tool=None, block=None)
    assert list(record) == [
        "kind", "time", "session", "seq", "message", "block", "tool", "component", "lossy",
        "marker", "tokens_before", "tokens_after", "tokens_deleted", "hash", "part", "step",
    ]  # fmt: skip
    assert record["kind"] == "compaction"
    assert record["tokens_deleted"] == 4300
    assert record["hash"] == "0123456789abcdef"
    assert record["tool"] is None and record["block"] is None


def test_usage_record_schema():
    record = usage(expand_rounds=2)
    assert list(record) == [
        "kind", "time", "session", "seq", "dialect", "path", "input_tokens", "cache_read_tokens",
        "cache_write_tokens", "output_tokens", "expand_rounds", "model", "cache_write_1h_tokens",
    ]  # fmt: skip
    assert record["kind"] == "usage"
    assert record["expand_rounds"] == 2
    assert usage()["expand_rounds"] == 0


def test_a_line_is_compact_json():
    line = cg.record.changelog._encode(compaction(tool="mcp__fs/read ünïcode"))
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert b", " not in line and b'": ' not in line
    assert b"mcp__fs/read" in line  # slashes unescaped
    assert ujson.loads(line)["tool"] == "mcp__fs/read ünïcode"


# Writing


@pytest_twisted.ensureDeferred
async def test_records_land_in_order_on_one_worker_thread(changelog, monkeypatch):
    threads = []
    real_write = cg.record.changelog._write_all

    def recording_write(fd, data):
        threads.append(threading.get_ident())
        real_write(fd, data)

    monkeypatch.setattr(cg.record.changelog, "_write_all", recording_write)
    log = changelog()
    reactor_thread = threading.get_ident()
    for seq in range(1, 501):
        log.write(compaction(seq) if seq % 2 else usage(seq))
        if seq % 100 == 0:
            await log.flush()  # several batches
    await log.flush()

    records = read_records(log.path)
    assert [r["seq"] for r in records] == list(range(1, 501))
    assert records[0] == compaction(1) and records[1] == usage(2)
    assert threads, "nothing was written"
    assert set(threads) == {log._worker.thread.ident}
    assert reactor_thread not in threads
    assert log.errors == 0


@pytest_twisted.ensureDeferred
async def test_the_reactor_does_not_wait_for_the_disk(changelog, slow_disk):
    disk = slow_disk()
    log = changelog()
    started = time.monotonic()
    for seq in range(100):
        log.write(compaction(seq))
    assert time.monotonic() - started < 1.0  # a blocked write would have taken 10 s
    disk.set()
    await log.flush()
    assert len(read_records(log.path)) == 100


@pytest_twisted.ensureDeferred
async def test_created_private_and_appended_to(changelog, tmp_path, umask):
    path = tmp_path / "changes.jsonl"
    path.write_bytes(b'{"kind":"usage","earlier":true}\n')
    path.chmod(0o640)  # a mode the admin chose (logrotate's create): left alone
    log = changelog()
    log.write(usage())
    await log.close()
    assert read_records(path) == [{"kind": "usage", "earlier": True}, usage()]
    assert stat.S_IMODE(path.stat().st_mode) == 0o640

    fresh = tmp_path / "fresh.jsonl"
    log = changelog(fresh)
    log.write(usage())
    await log.flush()
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o600


@pytest_twisted.ensureDeferred
async def test_reopen_after_rotation_writes_a_new_file(changelog, tmp_path, umask):
    path = tmp_path / "changes.jsonl"
    log = changelog()
    log.write(compaction(1))
    await log.flush()
    os.rename(path, tmp_path / "changes.jsonl.1")  # logrotate
    log.write(compaction(2))  # still the old file: the service has not been told yet
    await log.reopen()
    log.write(compaction(3))
    await log.close()

    assert [r["seq"] for r in read_records(tmp_path / "changes.jsonl.1")] == [1, 2]
    assert [r["seq"] for r in read_records(path)] == [3]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert log.errors == 0


@pytest_twisted.ensureDeferred
async def test_reopen_splits_the_lines_still_waiting_for_the_disk(changelog, tmp_path, slow_disk):
    path = tmp_path / "changes.jsonl"
    log = changelog()
    log.write(compaction(0))
    await log.flush()
    disk = slow_disk()
    log.write(compaction(1))  # the worker takes it, and waits for the disk
    os.rename(path, tmp_path / "changes.jsonl.1")
    log.write(compaction(2))
    reopened = log.reopen()
    log.write(compaction(3))
    disk.set()
    await reopened
    await log.close()

    assert [r["seq"] for r in read_records(tmp_path / "changes.jsonl.1")] == [0, 1, 2]
    assert [r["seq"] for r in read_records(path)] == [3]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest_twisted.ensureDeferred
async def test_disk_full_is_counted_and_logged_once(changelog, errors_logged):
    log = changelog("/dev/full")  # every write fails with ENOSPC
    for seq in range(3):
        log.write(compaction(seq))  # must not raise
        await log.flush()
    log.write(usage())
    await log.flush()
    assert log.errors == 4
    assert len(errors_logged) == 1
    assert "No space left" in errors_logged[0]["error"]


@pytest_twisted.ensureDeferred
async def test_directory_gone_then_back(changelog, tmp_path, errors_logged):
    directory = tmp_path / "logs"
    directory.mkdir()
    path = directory / "changes.jsonl"
    log = changelog(path)
    log.write(compaction(1))
    await log.flush()
    path.unlink()
    directory.rmdir()
    await log.reopen()  # cannot open: logged, not raised
    log.write(compaction(2))
    log.write(compaction(3))
    await log.flush()
    assert log.errors == 2
    assert len(errors_logged) == 1

    directory.mkdir()  # every write tries to open again
    log.write(compaction(4))
    await log.flush()
    assert [r["seq"] for r in read_records(path)] == [4]
    assert log.errors == 2
    # A new outage is logged again.
    path.unlink()
    directory.rmdir()
    await log.reopen()
    log.write(compaction(5))
    await log.flush()
    assert log.errors == 3
    assert len(errors_logged) == 2


@pytest_twisted.ensureDeferred
async def test_a_torn_write_leaves_one_bad_line(changelog, monkeypatch):
    real_write = cg.record.changelog._write_all
    failures = [True]

    def tearing_write(fd, data):
        if failures and failures.pop():
            os.write(fd, data[: len(data) // 2])
            raise OSError(28, "No space left on device")
        real_write(fd, data)

    monkeypatch.setattr(cg.record.changelog, "_write_all", tearing_write)
    log = changelog()
    log.write(compaction(1))
    await log.flush()
    log.write(compaction(2))
    await log.flush()
    assert log.errors == 1

    result = tally([log.path])
    assert result.bad_lines == 1  # the half line, on its own
    assert result.compactions == 1  # record 2 is intact


@pytest_twisted.ensureDeferred
async def test_records_that_cannot_be_written_are_counted(changelog, monkeypatch):
    log = changelog()
    log.write({"kind": "usage", "bad": object()})  # not serializable
    assert log.errors == 1
    await log.close()
    log.write(usage())  # after close
    assert log.errors == 2
    assert read_records(log.path) == []


@pytest_twisted.ensureDeferred
async def test_a_hung_disk_does_not_grow_memory_without_bound(changelog, slow_disk, monkeypatch):
    disk = slow_disk()
    monkeypatch.setattr(cg.record.changelog, "MAX_PENDING", 10)
    log = changelog()
    log.write(usage(0))
    while log._pending:  # the worker has taken the first line, and hangs
        time.sleep(0.001)
    for seq in range(1, 21):
        log.write(usage(seq))
    assert log.errors == 10
    disk.set()
    await log.flush()
    assert [r["seq"] for r in read_records(log.path)] == list(range(11))


@pytest_twisted.ensureDeferred
async def test_close_writes_what_is_queued_and_ends_the_thread(changelog):
    log = changelog()
    for seq in range(50):
        log.write(usage(seq))
    await log.close()
    assert len(read_records(log.path)) == 50
    log._worker.thread.join(5)
    assert not log._worker.thread.is_alive()
    await log.close()  # twice is fine
    await log.reopen()


@pytest_twisted.ensureDeferred
async def test_null_changelog(tmp_path):
    null = open_changelog(None)
    assert isinstance(null, NullChangeLog) and not null.enabled
    null.write(usage())
    await null.reopen()
    await null.flush()
    await null.close()
    assert null.errors == 0

    real = open_changelog(str(tmp_path / "c.jsonl"))
    try:
        assert isinstance(real, ChangeLog) and real.enabled
    finally:
        await real.close()
