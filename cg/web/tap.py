"""`twistd cg`: the command line, documented by `twistd cg --help`."""

import math
import os
from collections.abc import Callable
from typing import NoReturn

import attrs
from twisted.copyright import version as twisted_version
from twisted.internet.interfaces import IStreamServerEndpointStringParser
from twisted.plugin import getPlugins
from twisted.python import usage

from cg import __version__
from cg.compaction import options
from cg.exchange import keepalive
from cg.store import PASSWORD_ENV, default_store_url, store_password, usable_store_url
from cg.web.config import DEFAULT_BACKLOG, Config, endpoint_fields, format_size, parse_size
from cg.web.dashboard_api import read_admin_token
from cg.web.service import CGService, endpoint, settle_gc
from cg.web.tenant import parse_tenant
from cg.web.upstream import load_trust_root, split_base
from cg.web.workers import WorkerPool
from cg.wire.cache import CACHE_TTLS

_DEFAULTS = Config()
DEFAULT_LISTEN = _DEFAULTS.listen[0]



def _number(text: str) -> float:
    number = float(text)
    if not 0 <= number < math.inf:  # also refuses nan
        raise ValueError(f"not a finite number, 0 or more: {number}")
    return number


@attrs.frozen
class _Kind:
    """What a typed option's value must be: its reader, and how its refusal says so."""

    read: Callable[[str], object]
    what: str


_COUNT = _Kind(options.count, "an integer, 0 or more")
_NUMBER = _Kind(_number, "a number, 0 or more")
_SIZE = _Kind(parse_size, "a size such as 64MiB")


def _naming(name: str, kind: _Kind) -> Callable[[str], object]:
    """`kind`'s reader, refusing a value in one line that names the option: Twisted's own refusal says
    only "Parameter type enforcement failed: invalid literal for int() with base 10: 'x'"."""
    def typed(text: str) -> object:
        try:
            return kind.read(text)
        except ValueError as error:
            raise usage.UsageError(f"--{name} must be {kind.what}, not {text!r}") from error

    return typed


def _typed(name: str, default: object, text: str, kind: _Kind) -> list[object]:
    """A typed option as optParameters lists it, its refusal naming it."""
    return [name, None, default, text, _naming(name, kind)]


def _option(spec: tuple[str, object, str], kind: _Kind | None = None) -> list[object]:
    """A shared option (cg.compaction.options: name, default, help) as optParameters lists it."""
    name, default, text = spec
    return [name, None, default, text] if kind is None else _typed(name, default, text, kind)


def _writable_file(path: str) -> None:
    """Raises ValueError unless `path` names a file cg can create or append to (--changelog)."""
    path = os.path.expanduser(path)
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"{path} is a directory")
    if not os.path.isdir(folder):
        raise ValueError(f"no directory {folder}")
    if not os.access(path if os.path.exists(path) else folder, os.W_OK):
        raise ValueError(f"cannot write {path if os.path.exists(path) else 'in ' + folder}")


def _check_listen(description: str) -> None:
    """Raises unless `description` is an endpoint cg can parse before the reactor runs.

    Twisted's own parsers (tcp, tcp6, ssl, unix; and their errors: a bad port, a missing key) use no
    reactor until the endpoint listens, so they are run with none. systemd: sockets are looked up as cg
    binds, and an endpoint plugin from another package (txtorcon's onion:, …) may need the reactor to
    parse: those are left to the bind (`cg.web.service.bind_now`), which refuses a failure in one line
    before twistd goes on, as an address in use.
    """
    kind = endpoint_fields(description)[0]
    if kind == "systemd" or kind in _plugin_endpoint_types():
        return
    endpoint(None, description)


def _plugin_endpoint_types() -> set[str]:
    """The endpoint types other packages add through Twisted's plugins (a parser Twisted ships is
    written in one of its own modules; another package's, in that package or in its plugin module)."""
    return {parser.prefix for parser in getPlugins(IStreamServerEndpointStringParser)
            if not type(parser).__module__.startswith("twisted.")
            or type(parser).__module__.startswith("twisted.plugins.")}


class Options(usage.Options):
    synopsis = "[options]"
    longdesc = (
        "cg (context guru) sits between a coding agent and the Anthropic or OpenAI API. "
        "Point Claude Code at it with ANTHROPIC_BASE_URL=http://127.0.0.1:8080, an OpenAI "
        "client with OPENAI_BASE_URL=http://127.0.0.1:8080/v1. GET /stats shows its counters, "
        "GET /metrics the same for Prometheus."
    )

    optParameters: list[list[object]] = [
        [
            "anthropic-upstream",
            None,
            _DEFAULTS.anthropic_upstream,
            "Base URL of the Anthropic API: http(s)://host[:port], optionally with a path prefix.",
        ],
        [
            "openai-upstream",
            None,
            _DEFAULTS.openai_upstream,
            "Base URL of the OpenAI API: http(s)://host[:port], optionally with a path prefix.",
        ],
        _typed("max-body", format_size(_DEFAULTS.max_body), "Largest request body accepted (bytes, or 64MiB, 2G); larger ones get a "
               "413.", _SIZE),
        [
            "upstream-ca",
            None,
            None,
            "PEM bundle of the CA(s) to trust for HTTPS upstreams instead of the system's "
            "(a corporate gateway's private CA).",
        ],
        _typed("connect-timeout", _DEFAULTS.connect_timeout, "Seconds to connect upstream.", _NUMBER),
        _typed(
            "header-timeout",
            _DEFAULTS.header_timeout,
            "Seconds to wait for the upstream's response headers (long non-streaming "
            "generations need minutes); a live stream has no read timeout.",
            _NUMBER,
        ),
        _typed(
            "idle-timeout",
            _DEFAULTS.idle_timeout,
            "Seconds an idle pooled upstream connection is kept open (closed by the next sweep, at most half as long again).",
            _NUMBER,
        ),
        _typed(
            "request-head-timeout",
            _DEFAULTS.request_head_timeout,
            "Seconds a client has to send a complete request head (request line and headers), from "
            "its connection's start or, on a kept-alive connection, from the request's first byte, "
            "however slowly it trickles; past it the connection is closed. Bodies and responses "
            "(live streams) are not timed by it.",
            _NUMBER,
        ),
        _typed(
            "drain-timeout",
            _DEFAULTS.drain_timeout,
            "On SIGTERM, seconds to let in-flight responses finish before cutting them.",
            _NUMBER,
        ),
        [
            "store",
            None,
            None,
            "Where originals live: sqlite:PATH; redis://[user:password@]host:port/db, rediss://... (TLS) "
            "or unix:///path/to/socket?db=N, a Redis several cg share (the redis extra); memory: "
            "(tests). A bare path is refused, write sqlite:PATH. [default: sqlite: under "
            "$STATE_DIRECTORY, else ~/.local/state/cg/store.sqlite3]",
        ],
        [
            "store-password-file",
            None,
            None,
            f"Read a Redis store's password from this file (read once, at start), so that it is not "
            f"on the command line; without it, ${PASSWORD_ENV} is used when the URL has none.",
        ],
        _typed("store-max-mb", _DEFAULTS.store_max_mb, "Store size; least recently used out first.", _COUNT),
        _typed(
            "ledger-days",
            _DEFAULTS.ledger_days,
            "Days the store keeps the dashboard's history: per-minute and per-hour totals, and each "
            "conversation's summary (from its last request).",
            _NUMBER,
        ),
        _typed(
            "ledger-max-turns",
            _DEFAULTS.ledger_max_turns,
            "Requests the store keeps one by one for the dashboard (the newest), each with what cg changed "
            "in it; also none older than --ledger-days.",
            _COUNT,
        ),
        _typed(
            "memo-mb",
            _DEFAULTS.memo_mb,
            "Text the conversation memo keeps per process (each conversation's last body, and decisions), "
            "which makes a re-sent history cheap; the process holds ~1.5 times it. 0: none.",
            _COUNT,
        ),
        [
            "memo-dir",
            None,
            None,
            "Where each process keeps the memo's decisions across a restart: written every 10 minutes "
            "while it makes new ones and when it stops, all read when one starts, so that the first "
            "requests after a restart cost less. none: nowhere. [default: beside an sqlite: store (store.memo for store.sqlite3); "
            "memo under the state directory for redis:; none for memory:]",
        ],
        [
            "tenant",
            None,
            _DEFAULTS.tenant,
            "Who may read whose originals: none, credential (a hash of the API key) or "
            "header:NAME (set by a gateway in front of cg).",
        ],
        [
            "admin-token-file",
            None,
            None,
            "Read the dashboard's operator token from this file (read once, at start): a viewer sending "
            "Authorization: Bearer TOKEN sees every tenant's traffic on /cg/ and /cg/api/, and may read "
            "any tenant's original (/cg/expand/ID?tenant=T).",
        ],
        _option(options.EXPAND),
        [
            "mode",
            None,
            "forward",
            "forward: send the rewritten request. observe: decide everything and record what "
            "would be saved, but forward the original bytes.",
        ],
        _option(options.OFFLOAD_MIN_TOKENS, _COUNT),
        _option(options.COLD_POLICY),
        _option(options.CACHE_TTL),
        _typed(
            "max-expand-rounds",
            _DEFAULTS.max_expand_rounds,
            "Continuations cg runs per client request when the model calls context_guru_expand; "
            "at the cap the last response goes to the client as it is.",
            _COUNT,
        ),
        _typed(
            "max-held",
            format_size(_DEFAULTS.max_held),
            "Most bytes of a stream cg holds back while it decides on an expand call (bytes, or 16MiB); "
            "past it, it releases them as they came.",
            _SIZE,
        ),
        _typed(
            "workers",
            _DEFAULTS.workers,
            "Processes serving the --listen sockets (one per core): the parent binds, the workers "
            "accept; originals are shared through the store.",
            _COUNT,
        ),
        [
            "changelog",
            None,
            None,
            "Append one JSON line per compaction and per request's billed usage to this file "
            "(read it with cg-report); reopened on SIGHUP, for logrotate.",
        ],
        _option(options.KEEP_TOOLS),
        _option(keepalive.MAX_IDLE, _NUMBER),
        _option(keepalive.BUDGET, _COUNT),
        _option(keepalive.MAX_CONVERSATIONS, _COUNT),
    ]

    optFlags = [
        [
            "metrics-tenants",
            None,
            "Label /metrics' request and billed-token counters by tenant (--tenant): one series per "
            "tenant, so only for a bounded set of them.",
        ],
        ["keepalive", None, keepalive.KEEPALIVE_HELP + " Off by default; Anthropic Messages requests with a "
         "cache_control breakpoint and a session id only (docs/how-to/keep-the-cache-warm.md)."],
    ]

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # untyped in Twisted
        self["listen"] = []
        self["disable"] = []
        self.store_password: str | None = None  # postOptions: from --store-password-file or the environment
        self.admin_token: str | None = None  # postOptions: from --admin-token-file

    def opt_listen(self, description: str) -> None:
        self["listen"].append(description)

    opt_listen.__doc__ = (
        f"Endpoint to listen on (strports description: tcp:8080:interface=127.0.0.1, "
        "tcp6:8080:interface=\\:\\:1, unix:/run/cg/cg.sock, ssl:8443:privateKey=key.pem); repeatable. "
        f"[default: {DEFAULT_LISTEN}] "
        "backlog= is how many connections may wait to be accepted (the kernel caps it at "
        f"net.core.somaxconn); a tcp:, tcp6:, ssl: or unix: endpoint without backlog= gets {DEFAULT_BACKLOG}, "
        "not Twisted's 50. Under systemd socket activation: systemd:domain=INET:index=0 (the "
        "socket unit's Backlog=)"
    )

    def opt_version(self) -> NoReturn:
        """Print cg's version and exit."""
        print(f"cg {__version__} (Twisted {twisted_version})")
        raise SystemExit(0)

    def opt_disable(self, component: str) -> None:
        try:
            self["disable"].append(options.check_disable(component))
        except ValueError as error:
            raise usage.UsageError(str(error)) from error

    opt_disable.__doc__ = options.DISABLE_HELP

    def postOptions(self) -> None:
        if not self["listen"]:
            self["listen"] = [DEFAULT_LISTEN]
        for parameter in self.optParameters:  # a typed option not given: its default as --help shows it (64MiB)
            name, typed = str(parameter[0]), parameter[4] if len(parameter) > 4 else None
            if callable(typed) and isinstance(self[name], str):
                self[name] = typed(self[name])
        for option, allowed in (("expand", ("on", "off")), ("cold-policy", ("on", "off")),
                                ("mode", ("forward", "observe")), ("cache-ttl", tuple(CACHE_TTLS))):
            if self[option] not in allowed:
                raise usage.UsageError(f"--{option} must be one of {', '.join(allowed)}")
        try:
            parse_tenant(self["tenant"])  # its message names --tenant
        except ValueError as error:
            raise usage.UsageError(str(error)) from error
        checks: list[tuple[str, Callable[[str], object]]] = [
            ("anthropic-upstream", split_base), ("openai-upstream", split_base), ("keep-tools", options.keep_tools),
        ]
        checks += [(option, check) for option, check in (("store", usable_store_url), ("upstream-ca", load_trust_root),
                                                          ("changelog", _writable_file))
                   if self[option] is not None]
        for option, check in checks:
            try:
                check(self[option])
            except ValueError as error:
                raise usage.UsageError(f"--{option}: {error}") from error
        if self["workers"] < 1:
            raise usage.UsageError("--workers must be 1 or more")
        if self["workers"] > 1 and str(self["store"] or "").startswith("memory:"):
            raise usage.UsageError("--workers: a memory: store is one process's; use sqlite: or redis:")
        if self["workers"] > 1:
            # A worker adopts the bound socket as it is: the parent's TLS wrapping would not follow.
            for description in self["listen"]:
                if description.split(":", 1)[0] not in ("tcp", "unix", "systemd"):
                    raise usage.UsageError(f"--workers: --listen {description}: only tcp:, unix: and "
                                           "systemd: endpoints can be shared by workers")
        for description in self["listen"]:
            try:
                _check_listen(description)
            except Exception as error:  # what a description's parser raises: ValueError, TypeError, OSError, OpenSSL's
                raise usage.UsageError(f"--listen {description}: {error}") from error
        try:
            self.store_password = store_password(
                self["store"] or default_store_url(), self["store-password-file"], os.environ
            )
        except ValueError as error:
            raise usage.UsageError(f"--store-password-file: {error}") from error
        if self["admin-token-file"] is not None:
            try:
                self.admin_token = read_admin_token(self["admin-token-file"])
            except ValueError as error:
                raise usage.UsageError(f"--admin-token-file: {error}") from error
        memo_dir = self["memo-dir"]
        if memo_dir is not None and (not memo_dir or os.path.exists(os.path.expanduser(memo_dir))
                                     and not os.path.isdir(os.path.expanduser(memo_dir))):
            raise usage.UsageError(f"--memo-dir {memo_dir!r}: not a directory (none: no memo files)")
        for option in ("ledger-days", "connect-timeout", "header-timeout", "request-head-timeout"):
            if not self[option] > 0:
                raise usage.UsageError(f"--{option} must be more than 0")
        if self["store-max-mb"] < 1:
            raise usage.UsageError("--store-max-mb must be 1 or more")
        try:
            keepalive.check_policy(self["keepalive-max-idle"], self["keepalive-budget"],
                                   self["keepalive-max-conversations"])
        except ValueError as error:
            raise usage.UsageError(str(error)) from error

    def config(self) -> Config:
        return Config(
            listen=tuple(self["listen"]),
            anthropic_upstream=self["anthropic-upstream"],
            openai_upstream=self["openai-upstream"],
            max_body=self["max-body"],
            upstream_ca=self["upstream-ca"],
            connect_timeout=self["connect-timeout"],
            header_timeout=self["header-timeout"],
            idle_timeout=self["idle-timeout"],
            drain_timeout=self["drain-timeout"],
            request_head_timeout=self["request-head-timeout"],
            store=self["store"],
            store_max_mb=self["store-max-mb"],
            ledger_days=self["ledger-days"],
            ledger_max_turns=self["ledger-max-turns"],
            store_password=self.store_password,
            tenant=self["tenant"],
            admin_token=self.admin_token,
            expand=self["expand"] == "on",
            observe=self["mode"] == "observe",
            offload_min_tokens=self["offload-min-tokens"],
            keep_tools=options.keep_tools(self["keep-tools"]),
            disabled_components=tuple(self["disable"]),
            cold_policy=self["cold-policy"] == "on",
            changelog=self["changelog"],
            max_expand_rounds=self["max-expand-rounds"],
            max_held=self["max-held"],
            memo_mb=self["memo-mb"],
            memo_dir=self["memo-dir"],
            workers=self["workers"],
            metrics_tenants=bool(self["metrics-tenants"]),
            keepalive=bool(self["keepalive"]),
            keepalive_max_idle=self["keepalive-max-idle"],
            keepalive_budget=self["keepalive-budget"],
            keepalive_max_conversations=self["keepalive-max-conversations"],
            cache_ttl=self["cache-ttl"],
        )


def makeService(options: Options) -> CGService | WorkerPool:
    config = options.config()
    service = CGService(config) if config.workers == 1 else WorkerPool(config)
    service.bind()  # see bind_now: a port in use is one line, before twistd goes on
    settle_gc()
    return service
