"""Start-up as a person meets it: refusals that name the option, the listen backlog, the start-up line."""

import inspect
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from pytest_twisted import inlineCallbacks
from twisted.copyright import version as twisted_version
from twisted.internet import reactor
from twisted.internet.protocol import Factory
from twisted.internet.testing import MemoryReactor
from twisted.python import usage

from cg import __version__
from cg.store import SQLiteStore
from cg.web.config import DEFAULT_BACKLOG, Config, format_size, parse_size, with_backlog
from cg.web.service import CGService, endpoint
from cg.web.tap import DEFAULT_LISTEN, Options
from cg.web.workers import WorkerPool

TWISTD = str(Path(sys.executable).with_name("twistd"))


# --- the listen backlog -----------------------------------------------------------------------


def test_default_listen_has_a_backlog_of_1024():
    """Twisted's default, 50, resets a burst of new connections before any answer."""
    options = Options()
    options.parseOptions([])
    assert options.config().listen == (DEFAULT_LISTEN,)
    memory = MemoryReactor()
    endpoint(memory, DEFAULT_LISTEN).listen(Factory())
    [(port, _factory, backlog, interface)] = memory.tcpServers
    assert (port, backlog, interface) == (8080, 1024, "127.0.0.1")
    assert "backlog=1024" in str(Options())  # --help says so
    assert "without backlog= gets 1024" in " ".join(str(Options()).split())


@pytest.mark.parametrize(
    ("description", "listened"),
    [
        ("tcp:9000", "tcp:9000:backlog=1024"),
        ("tcp:port=9000:interface=127.0.0.1", "tcp:port=9000:interface=127.0.0.1:backlog=1024"),
        ("tcp6:9000:interface=\\:\\:1", "tcp6:9000:interface=\\:\\:1:backlog=1024"),
        ("ssl:9443:privateKey=k.pem", "ssl:9443:privateKey=k.pem:backlog=1024"),
        ("unix:/run/cg.sock", "unix:/run/cg.sock:backlog=1024"),
        ("unix:/run/a\\:backlog=5", "unix:/run/a\\:backlog=5:backlog=1024"),  # an escaped colon is the path's
        ("tcp:9000:backlog=16", "tcp:9000:backlog=16"),  # the user's own
        ("tcp:9000:127.0.0.1:100", "tcp:9000:127.0.0.1:100"),  # the user's own, by its place
        ("ssl:9443:k.pem:c.pem:TLSv1_2_METHOD:127.0.0.1:64", "ssl:9443:k.pem:c.pem:TLSv1_2_METHOD:127.0.0.1:64"),
        ("unix:/run/cg.sock:backlog=4096:mode=660", "unix:/run/cg.sock:backlog=4096:mode=660"),
        ("systemd:domain=INET:index=0", "systemd:domain=INET:index=0"),  # bound by systemd, with its Backlog=
    ],
)
def test_every_listen_gets_cgs_backlog_unless_it_names_one(description, listened):
    assert with_backlog(description) == listened


@pytest.mark.parametrize(
    ("description", "servers"),
    [("tcp:9000", "tcpServers"), ("tcp:9000:backlog=7", "tcpServers"), ("unix:/run/cg.sock", "unixServers")],
)
def test_the_endpoint_cg_builds_has_the_backlog(description, servers):
    memory = MemoryReactor()
    endpoint(memory, description).listen(Factory())
    [listened] = getattr(memory, servers)
    assert listened[2] == (7 if "backlog=7" in description else DEFAULT_BACKLOG)


def _kernel_backlog(port: int) -> int:
    """A listening TCP socket's backlog as the kernel keeps it: `ss -ltn`'s Send-Q."""
    [line] = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True,
                            check=True).stdout.splitlines()
    return int(line.split()[2])


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
def test_a_listen_without_backlog_listens_with_cgs(make_cg, tmp_path):
    """One process, and the parent of --workers that binds for its workers."""
    expected = min(DEFAULT_BACKLOG, int(Path("/proc/sys/net/core/somaxconn").read_text()))
    assert expected > 50  # Twisted's own default: else this test could not tell them apart
    running = make_cg()  # --listen tcp:0:interface=127.0.0.1
    assert _kernel_backlog(running.port) == expected
    pool = WorkerPool(Config(listen=("tcp:0:interface=127.0.0.1",), workers=2,
                             store=f"sqlite:{tmp_path / 'store.sqlite3'}"), reactor)
    pool.bind()
    try:
        assert _kernel_backlog(pool.ports[0].getHost().port) == expected
    finally:
        for port in pool.ports:
            port.stopListening()


# --- options refused at start -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--anthropic-upstream", "127.0.0.1:18901"], "--anthropic-upstream: not an absolute http(s)://"),
        (["--anthropic-upstream", "localhost:18901"], "--anthropic-upstream: not an absolute http(s)://"),
        (["--openai-upstream", "ftp://example.com"], "--openai-upstream: not an absolute http(s)://"),
        (["--openai-upstream", "https://"], "--openai-upstream: not an absolute http(s)://"),
        (["--openai-upstream", "https://key:secret@example.com"], "--openai-upstream: not an absolute"),
        (["--anthropic-upstream", "https://example.com/v1?x=1"], "--anthropic-upstream: not an absolute"),
        (["--anthropic-upstream", "https://example.com:99999"], "--anthropic-upstream: Port out of range"),
        (["--store", "/var/lib/cg/store.sqlite3"], "--store: unknown store URL"),
        (["--store", "postgres://db/cg"], "--store: unknown store URL"),
        (["--request-head-timeout", "0"], "--request-head-timeout must be more than 0"),
        (["--memo-mb", "-1"], "--memo-mb must be an integer, 0 or more, not '-1'"),
        (["--ledger-days", "0"], "--ledger-days must be more than 0"),
        (["--ledger-days", "nan"], "--ledger-days must be a number, 0 or more, not 'nan'"),
        (["--idle-timeout", "inf"], "--idle-timeout must be a number, 0 or more, not 'inf'"),
        (["--ledger-max-turns", "-1"], "--ledger-max-turns must be an integer, 0 or more, not '-1'"),
        (["--max-expand-rounds", "x"], "--max-expand-rounds must be an integer, 0 or more, not 'x'"),
        (["--max-body", "64 apples"], "--max-body must be a size such as 64MiB, not '64 apples'"),
        (["--connect-timeout", "0"], "--connect-timeout must be more than 0"),
        (["--header-timeout", "0"], "--header-timeout must be more than 0"),
        (["--store-max-mb", "0"], "--store-max-mb must be 1 or more"),
        (["--upstream-ca", "/etc/hostname"], "--upstream-ca: no PEM certificate in /etc/hostname"),
        (["--upstream-ca", "/nonexistent/ca.pem"], "--upstream-ca: cannot read /nonexistent/ca.pem: No such file"),
        (["--changelog", "/"], "--changelog: / is a directory"),
        (["--changelog", "/nonexistent/cg.jsonl"], "--changelog: no directory /nonexistent"),
        (["--keep-tools", "Read,Web Search"], "--keep-tools: 'Web Search' is not a tool name"),
        (["--listen", "tcp:9000:interface=127.0.0.1:bakclog=5"], "--listen tcp:9000:interface=127.0.0.1:bakclog=5: "),
        (["--listen", "ssl:9443:privateKey=/nonexistent/key.pem"], "--listen ssl:9443:privateKey=/nonexistent/key.pem: "),
        (["--listen", "unix:/run/cg.sock:mode=rw"], "--listen unix:/run/cg.sock:mode=rw: invalid literal"),
    ],
)
def test_bad_options_are_refused_naming_the_option(argv, message):
    with pytest.raises(usage.UsageError) as refused:
        Options().parseOptions(argv)
    assert str(refused.value).startswith(message)
    assert "\n" not in str(refused.value)


# An endpoint plugin from outside Twisted whose parser needs the reactor (as txtorcon's onion: does):
# a real plugin module, found by Twisted's plugin lookup.
_PLUGIN = """
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.internet.interfaces import IStreamServerEndpointStringParser
from twisted.plugin import IPlugin
from zope.interface import implementer


@implementer(IPlugin, IStreamServerEndpointStringParser)
class _Parser:
    prefix = "cgtestonion"

    def parseStreamServer(self, reactor, port, **kwargs):
        reactor.callWhenRunning(lambda: None)  # what a parser that starts a daemon does first
        return TCP4ServerEndpoint(reactor, int(port), interface="127.0.0.1")


parser = _Parser()
"""


@pytest.fixture
def endpoint_plugin(tmp_path, monkeypatch):
    import twisted.plugins

    folder = tmp_path / "plugins"
    folder.mkdir()
    (folder / "cg_test_endpoint.py").write_text(_PLUGIN)
    monkeypatch.setattr(twisted.plugins, "__path__", [*twisted.plugins.__path__, str(folder)])
    return "cgtestonion"


def test_a_plugin_endpoint_that_needs_the_reactor_to_parse_is_taken(endpoint_plugin):
    """Not refused for the reactor a check without one lacks: it is parsed, and may fail, as cg binds."""
    options = Options()
    options.parseOptions(["--listen", f"{endpoint_plugin}:0", "--store", "memory:"])
    assert options.config().listen == (f"{endpoint_plugin}:0",)
    listening = endpoint(MemoryReactor(), f"{endpoint_plugin}:0")
    assert listening._interface == "127.0.0.1"


def test_an_unknown_endpoint_type_is_still_refused(endpoint_plugin):
    with pytest.raises(usage.UsageError) as refused:
        Options().parseOptions(["--listen", "cgtestonoin:0"])
    assert str(refused.value) == "--listen cgtestonoin:0: Unknown endpoint type: 'cgtestonoin'"


@pytest.mark.parametrize(("option", "given", "value"), [("max-body", None, 64 << 20), ("max-body", "2MiB", 2 << 20),
                                                        ("max-held", None, 16 << 20), ("max-held", "1024", 1024)])
def test_a_size_is_read_once_given_or_not(option, given, value):
    """The option's value is the size, in bytes, as Config takes it: given, its reader read it; not
    given, it is Config's default (not a text to read again)."""
    options = Options()
    options.parseOptions(["--store", "memory:"] + ([f"--{option}", given] if given else []))
    assert options[option] == value
    assert getattr(options.config(), option.replace("-", "_")) == value


def test_help_shows_a_sizes_default_as_a_person_types_it():
    """--max-body's help says "bytes, or 64MiB": its default reads 64MiB too, not 67108864."""
    shown = " ".join(str(Options()).split())
    assert "[default: 64MiB]" in shown and "[default: 16MiB]" in shown
    assert "67108864" not in shown and "16777216" not in shown
    assert [format_size(size) for size in (0, 1000, 1024, 3 << 20, 2 << 30, (1 << 30) + 1)] == [
        "0", "1000", "1KiB", "3MiB", "2GiB", str((1 << 30) + 1)]
    assert all(parse_size(format_size(size)) == size for size in (1000, 1024, 3 << 20, 2 << 30))


def _options_taking_a_value() -> list[str]:
    """Every option `twistd cg --help` lists that takes a value: optParameters, and opt_ methods with one."""
    methods = [name[4:].replace("_", "-") for name, method in vars(Options).items()
               if name.startswith("opt_") and len(inspect.signature(method).parameters) == 2]
    return [spec[0] for spec in Options.optParameters] + methods


_TYPED = {spec[0] for spec in Options.optParameters if len(spec) > 4}  # given "x", each says what it must be

# A value cg cannot use, for every option that takes one: a new option needs its own here.
_UNUSABLE = {
    **{name: "x" for name in _TYPED},
    "anthropic-upstream": "api.anthropic.com", "openai-upstream": "https://", "upstream-ca": "/nonexistent/ca.pem",
    "store": "postgres://db/cg", "store-password-file": "/nonexistent/password", "memo-dir": "/etc/hostname",
    "tenant": "everyone", "admin-token-file": "/nonexistent/token", "expand": "yes", "mode": "proxy",
    "cold-policy": "yes", "cache-ttl": "2h", "changelog": "/nonexistent/cg.jsonl", "keep-tools": "Read,Web Search",
    "listen": "tpc:8080", "disable": "everything",
}


def test_every_option_taking_a_value_has_an_unusable_one_below():
    assert sorted(_UNUSABLE) == sorted(_options_taking_a_value())
    assert len(_TYPED) > 15  # the walk below covers the typed ones too


@pytest.mark.parametrize("option", _options_taking_a_value())
def test_every_option_refuses_an_unusable_value_in_one_line_naming_itself(option):
    with pytest.raises(usage.UsageError) as refused:
        Options().parseOptions([f"--{option}", _UNUSABLE[option]])
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"--{option} ") or message.startswith(f"--{option}:"), message
    assert "Parameter type enforcement failed" not in message
    if option in _TYPED:
        assert message.endswith(" must be an integer, 0 or more, not 'x'") or message.endswith(
            " must be a number, 0 or more, not 'x'") or message.endswith(" must be a size such as 64MiB, not 'x'")


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/0", "rediss://cache.example:6380/1", "unix:///run/redis.sock"])
def test_a_redis_store_without_the_redis_extra_is_refused_naming_it(monkeypatch, url):
    """Not a ModuleNotFoundError logged once a Redis store opens, and a cg without offload for good."""
    monkeypatch.setitem(sys.modules, "redis", None)  # what `import redis` meets when it is not installed
    with pytest.raises(usage.UsageError) as refused:
        Options().parseOptions(["--store", url])
    assert str(refused.value).startswith("--store: a Redis store needs the redis extra: pip install 'cg[redis]' (")
    assert "\n" not in str(refused.value)


def test_a_missing_extra_is_refused_by_twistd_in_one_line(tmp_path):
    """`import redis` fails in a real twistd: a package of that name that cannot be imported comes first."""
    shadow = tmp_path / "shadow" / "redis"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text('raise ModuleNotFoundError("No module named \'redis\'", name="redis")\n')
    result = subprocess.run(
        [TWISTD, "-n", "--pidfile=", "cg", "--store", "redis://127.0.0.1:6379/0"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow.parent), os.environ.get("PYTHONPATH", "")])},
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stdout + result.stderr
    assert result.stdout.splitlines()[-1].endswith(
        ": --store: a Redis store needs the redis extra: pip install 'cg[redis]' (No module named 'redis')"
    )


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:18901", "https://api.anthropic.com/", "https://gw.corp.example/anthropic", "http://[::1]:8080"]
)
def test_upstreams_with_a_scheme_and_a_host_are_taken(url):
    options = Options()
    options.parseOptions(["--anthropic-upstream", url, "--store", "sqlite:~/cg.sqlite3"])
    assert options.config().anthropic_upstream == url


def test_bad_upstream_is_refused_by_twistd_without_a_traceback(tmp_path):
    result = subprocess.run(
        [TWISTD, "-n", "--pidfile=", "cg", "--anthropic-upstream", "127.0.0.1:18901"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stdout + result.stderr
    assert result.stdout.splitlines()[-1].endswith(
        ": --anthropic-upstream: not an absolute http(s)://host[:port][/path] URL: '127.0.0.1:18901'"
    )


def test_twistd_cg_settles_the_garbage_collector(tmp_path):
    """makeService (what `twistd cg` runs) freezes what it built out of later collections and
    raises the young generation's threshold: the collector's full walks of the memo are rare."""
    script = ("import gc; from cg.web.tap import Options, makeService; options = Options(); "
              "options.parseOptions(['--listen', 'tcp:0:interface=127.0.0.1', '--store', 'memory:']); "
              "makeService(options); print(gc.get_threshold()[0], gc.get_freeze_count() > 10_000)")
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                            timeout=60, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert result.stdout.split() == ["10000", "True"], result.stderr  # CPython's default: 700 (2,000 in 3.13)


def test_version(capsys, tmp_path):
    with pytest.raises(SystemExit) as exited:
        Options().parseOptions(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"cg {__version__} (Twisted {twisted_version})\n"
    result = subprocess.run([TWISTD, "cg", "--version"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.stdout == f"cg {__version__} (Twisted {twisted_version})\n"


@pytest.mark.parametrize(
    ("description", "why"),
    [
        ("systemd:domain=INET:index=0", "systemd passed no such socket (is cg started by cg.socket?)"),
        ("systemd:domain=INET:name=cg", "systemd passed no such socket (is cg started by cg.socket?)"),
        ("tcp:8080:interface=192.0.2.1", "cannot assign requested address"),
        ("tpc:8080", "Unknown endpoint type: 'tpc'"),
    ],
)
def test_an_endpoint_that_cannot_listen_is_one_line(monkeypatch, description, why):
    for name in ("LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES"):
        monkeypatch.delenv(name, raising=False)
    service = CGService(Config(listen=(description,), store="memory:"), reactor)
    with pytest.raises(SystemExit) as exited:
        service.bind()
    assert exited.value.code == f"cg: cannot listen on {description}: {why}"


# --- what cg says once it listens -------------------------------------------------------------


def test_the_start_up_line(cg_log, make_cg, fake, fake_openai):
    cg = make_cg(anthropic_upstream=fake.url, openai_upstream=fake_openai.url)
    assert cg_log.containing("listening on") == [
        f"cg {__version__} listening on {cg.url} \N{RIGHTWARDS ARROW} Anthropic {fake.url}, OpenAI {fake_openai.url}; "
        "store memory: (0 originals); expand on; mode forward"
    ]


@inlineCallbacks
def test_a_store_that_opens_in_the_background_says_its_count_when_known(cg_log, make_cg, tmp_path):
    path = tmp_path / "store.sqlite3"
    earlier = SQLiteStore(str(path), reactor=reactor)
    yield earlier.put("", {"0123456789abcdef": b"one", "fedcba9876543210": b"two"})
    yield earlier.close()

    cg = make_cg(store=f"sqlite:{path}", expand=False, observe=True)
    [line] = cg_log.containing("listening on")
    assert line.endswith(f"; store sqlite:{path} (opening); expand off; mode observe")
    assert (yield cg_log.wait_for("cg store ")) == f"cg store sqlite:{path}: 2 originals"
    yield cg.service.store.info()  # the store's worker has answered everything before this
    assert len(cg_log.containing("cg store ")) == 1


@inlineCallbacks
def test_sighup_says_it_reopened_the_change_log(cg_log, make_cg, tmp_path):
    path = tmp_path / "changes.jsonl"
    make_cg(changelog=str(path))
    os.kill(os.getpid(), signal.SIGHUP)
    assert (yield cg_log.wait_for("SIGHUP")) == f"cg reopened the change log {path} (SIGHUP)"


@inlineCallbacks
def test_sighup_without_a_change_log_says_so(cg_log, make_cg):
    make_cg()
    os.kill(os.getpid(), signal.SIGHUP)
    assert (yield cg_log.wait_for("SIGHUP")) == "cg got SIGHUP: no --changelog to reopen"

