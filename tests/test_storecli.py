"""cg-store on real files: what an operator sees, and what it must never do to a store."""

import os
import subprocess
import sys
import time

import pytest

from cg.store import RedisAddress, RedisDB, SQLiteDB
from cg.store.cli import main

DAY = 86400.0


@pytest.fixture
def store(tmp_path):
    """A store with an original and a frozen repair last used 10 days ago, and a fresh one."""
    path = tmp_path / "store.sqlite3"
    old = SQLiteDB.open(str(path), clock=lambda: time.time() - 10 * DAY)
    old.put("", {"old": b"o" * 1000})
    old.freeze("", "toolu_1", b"repair")
    old.close()
    new = SQLiteDB.open(str(path))
    new.put("t", {"new": b"n" * 2000})
    new.close()
    return path


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_info(store, capsys):
    code, out, err = run(capsys, "--store", f"sqlite:{store}", "info")
    assert (code, err) == (0, "")
    assert f"store:   {store}\n" in out
    assert "entries: 2 (3000 bytes, 2.9 KiB)\n" in out
    assert "frozen:  1 (6 bytes)\n" in out
    assert out.endswith(" (10.0 days ago)\nfrozen:  1 (6 bytes)\n")  # the oldest last use


def test_purge_older_than(store, capsys):
    code, out, _ = run(capsys, "--store", f"sqlite:{store}", "purge", "--older-than", "5")
    assert code == 0
    assert out == f"purged 2 entries from {store}\n"
    db = SQLiteDB.open(str(store), create=False)
    assert (db.get("", "old"), db.frozen("", "toolu_1")) == (None, None)
    assert db.get("t", "new") == b"n" * 2000
    db.close()


def test_purge_everything_gives_the_space_back(tmp_path, capsys):
    path = tmp_path / "store.sqlite3"
    db = SQLiteDB.open(str(path))
    for i in range(20):
        db.put("", {str(i): os.urandom(100_000)})
    db.close()
    assert path.stat().st_size > 2_000_000
    code, out, _ = run(capsys, "--store", f"sqlite:{path}", "purge")
    assert (code, out) == (0, f"purged 20 entries from {path}\n")
    assert path.stat().st_size < 200_000
    assert "entries: 0 (0 bytes)" in run(capsys, "--store", f"sqlite:{path}", "info")[1]


def test_default_store_is_cg_s(store, monkeypatch, capsys):
    state = store.parent / "cg"
    state.mkdir()
    store.rename(state / "store.sqlite3")
    monkeypatch.delenv("STATE_DIRECTORY", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(store.parent))
    code, out, _ = run(capsys, "info")
    assert code == 0
    assert "entries: 2 " in out


def test_a_missing_store_is_not_created(tmp_path, capsys):
    path = tmp_path / "nothing" / "store.sqlite3"
    code, out, err = run(capsys, "--store", f"sqlite:{path}", "info")
    assert (code, out) == (1, "")
    assert f"no store at {path}" in err
    assert not path.parent.exists()


def test_a_corrupt_store_is_an_error_not_a_traceback(tmp_path, capsys):
    path = tmp_path / "store.sqlite3"
    path.write_bytes(b"garbage" * 1000)
    code, out, err = run(capsys, "--store", f"sqlite:{path}", "purge")
    assert (code, out) == (1, "")
    assert err.startswith("cg-store: cannot open store") and "Traceback" not in err
    assert path.read_bytes() == b"garbage" * 1000


@pytest.mark.parametrize(
    "argv",
    [
        ["--store", "memory:", "info"],
        ["--store", "redis://", "info"],
        ["--store", "redis://h/0", "--store-password-file", "/nonexistent/pw", "info"],
        ["purge", "--older-than", "-1"],
        ["purge", "--older-than", "nan"],
        [],
    ],
)
def test_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2
    assert "usage: cg-store" in capsys.readouterr().err


def test_a_redis_store_without_the_redis_extra_says_which_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "redis", None)  # what `import redis` meets when it is not installed
    with pytest.raises(SystemExit) as exit:
        main(["--store", "redis://127.0.0.1:6379/0", "info"])
    assert exit.value.code == 2
    assert "cg-store: error: a Redis store needs the redis extra: pip install 'cg[redis]'" in capsys.readouterr().err


def test_runs_as_a_program(store):
    result = subprocess.run(
        [sys.executable, "-m", "cg.store.cli", "--store", f"sqlite:{store}", "info"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "entries: 2 " in result.stdout


def test_store_option_after_the_command(store, capsys):
    code, out, err = run(capsys, "info", "--store", f"sqlite:{store}")
    assert (code, err) == (0, "")
    assert f"store:   {store}\n" in out
    code, out, _ = run(capsys, "purge", "--store", f"sqlite:{store}", "--older-than", "5")
    assert (code, out) == (0, f"purged 2 entries from {store}\n")


# --- on a Redis --------------------------------------------------------------------------------


@pytest.fixture
def redis_store(redis_server):
    """The same store on a real redis-server (behind a password, as a shared one should be)."""
    redis_server.admin.execute_command("ACL", "SETUSER", "cg", "on", ">s3cret", "~*", "&*", "+@all")
    address = RedisAddress.parse(f"redis://cg:s3cret@127.0.0.1:{redis_server.port}/0")
    old = RedisDB(address, clock=lambda: time.time() - 10 * DAY)
    old.put("", {"old": b"o" * 1000})
    old.freeze("", "toolu_1", b"repair")
    old.close()
    new = RedisDB(address)
    new.put("t", {"new": b"n" * 2000})
    new.close()
    return redis_server


def test_redis_info_and_purge(redis_store, tmp_path, monkeypatch, capsys):
    url = f"redis://cg@127.0.0.1:{redis_store.port}/0"
    secret = tmp_path / "password"
    secret.write_text("s3cret\n")
    code, out, err = run(capsys, "info", "--store", url, "--store-password-file", str(secret))
    assert (code, err) == (0, "")
    assert out.startswith(f"store:   {url}\nentries: 2 (3000 bytes, 2.9 KiB)\noldest:  ")
    assert out.endswith(" (10.0 days ago)\nfrozen:  1 (6 bytes)\n")

    monkeypatch.setenv("CG_STORE_PASSWORD", "s3cret")  # the password from the environment
    code, out, _ = run(capsys, "--store", url, "purge", "--older-than", "5")
    assert (code, out) == (0, f"purged 2 entries from {url}\n")
    db = RedisDB(RedisAddress.parse(url), password="s3cret")
    assert (db.get("", "old"), db.frozen("", "toolu_1"), db.get("t", "new")) == (None, None, b"n" * 2000)
    assert db.info().bytes == 2000
    db.close()
    assert run(capsys, "--store", url, "purge")[1] == f"purged 1 entries from {url}\n"
    assert "entries: 0 (0 bytes)" in run(capsys, "--store", url, "info")[1]


def test_redis_errors_are_one_line(redis_store, capsys):
    code, out, err = run(capsys, "--store", f"redis://cg:wrong@127.0.0.1:{redis_store.port}/0", "info")
    assert (code, out) == (1, "")
    assert err.startswith(f"cg-store: redis://cg@127.0.0.1:{redis_store.port}/0: AuthenticationError: ")
    assert ":wrong" not in err and "Traceback" not in err
    redis_store.kill()
    code, _, err = run(capsys, "--store", f"redis://127.0.0.1:{redis_store.port}/0", "purge")
    assert code == 1 and "Connection refused" in err and err.count("\n") == 1
