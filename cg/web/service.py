"""The cg service: listening ports, the proxy, and a graceful stop that drains streams."""

import os
import signal

from twisted.application import service
from twisted.internet import defer, task
from twisted.internet.endpoints import serverFromString
from twisted.logger import Logger

from cg import __version__
from cg.compaction.components import DEFAULT_COMPONENTS
from cg.compaction.pipeline import CompactConfig
from cg.compaction.rewrite import RewriteConfig, Rewriter
from cg.record.changelog import open_changelog
from cg.record.stats import Stats
from cg.store import default_store_url, store_from_url, store_label
from cg.web import systemd
from cg.web.config import Config
from cg.web.proxy import ProxyResource
from cg.web.site import Connections, ProxySite
from cg.web.tenant import parse_tenant
from cg.web.upstream import Upstream, load_trust_root, split_base

log = Logger(namespace="cg.web.service")


def _install_sighup(reopen):
    """SIGHUP calls `reopen` (the change log's, for logrotate); returns the previous handler.

    Only the main thread may set signal handlers: elsewhere nothing changes.
    """
    try:
        return signal.signal(signal.SIGHUP, lambda signum, frame: reopen())
    except ValueError:
        return None


def _restore_sighup(previous):
    if previous is not None:
        try:
            signal.signal(signal.SIGHUP, previous)
        except ValueError:
            pass


def rewrite_config(config: Config) -> RewriteConfig:
    components = tuple(c for c in DEFAULT_COMPONENTS if c.name not in config.disabled_components)
    return RewriteConfig(
        compact=CompactConfig(
            components=components,
            # Its converter, frozenset, makes mypy's attrs plugin type this parameter Iterable[_T_co]
            # with _T_co unbound, which nothing matches (python/mypy#8625).
            keep_tools=frozenset(config.keep_tools),
            offload_min_tokens=config.offload_min_tokens,
        ),
        expand=config.expand,
    )


def _why_not_listening(description: str, failure) -> str:
    """"address already in use", not the CannotListenError's repr."""
    error = getattr(failure.value, "socketError", None)
    if isinstance(error, OSError) and error.strerror:
        return error.strerror[0].lower() + error.strerror[1:]
    if description.startswith("systemd:") and failure.check(IndexError, KeyError):
        return "systemd passed no such socket (is cg started by cg.socket?)"
    return failure.getErrorMessage()


def _url(description: str, address) -> str:
    """A listening address as a client is pointed at it: http://127.0.0.1:8080."""
    host = getattr(address, "host", None)
    if host is None:
        return f"unix:{os.fsdecode(address.name)}"
    scheme = "https" if description.startswith("ssl:") else "http"
    return f"{scheme}://[{host}]:{address.port}" if ":" in host else f"{scheme}://{host}:{address.port}"


class CGService(service.Service):
    """Listens on every --listen endpoint; on stop, stops accepting and drains in-flight responses."""

    # Twisted's Service says `name = None`, unannotated, so mypy takes its type to be None
    # (IService documents a str or None).
    name = "cg"  # type: ignore[assignment]

    def __init__(self, config: Config, reactor=None):
        if reactor is None:
            from twisted.internet import reactor
        self.config = config
        self.reactor = reactor
        self.stats = Stats()

        def count_retry():
            self.stats.upstream_retries += 1

        trust_root = load_trust_root(config.upstream_ca) if config.upstream_ca else None
        self.upstream = Upstream(
            reactor,
            connect_timeout=config.connect_timeout,
            header_timeout=config.header_timeout,
            idle_timeout=config.idle_timeout,
            trust_root=trust_root,
            on_retry=count_retry,
        )
        store_url = config.store or default_store_url()
        self.store_url = store_label(store_url)  # ~ expanded, no password
        self.store = store_from_url(
            store_url, reactor, max_bytes=config.store_max_mb << 20, password=config.store_password
        )
        self.stats.store = self.store.stats
        self.changelog = open_changelog(config.changelog, reactor)
        self.stats.changelog = self.changelog
        self._store_info = task.LoopingCall(self._refresh_store_info)
        self._store_info.clock = reactor
        self._store_untold = False  # the start-up line said "opening": say the count once known
        self._previous_hup = None
        self.resource = ProxyResource(
            self.upstream,
            self.stats,
            {"anthropic": split_base(config.anthropic_upstream), "openai": split_base(config.openai_upstream)},
            rewriter=Rewriter(rewrite_config(config)),
            store=self.store,
            tenant_of=parse_tenant(config.tenant),
            observe=config.observe,
            changelog=self.changelog,
            max_expand_rounds=config.max_expand_rounds,
            max_held=config.max_held,
            continuation_timeout=config.header_timeout,
            reactor=reactor,
        )
        self.site = ProxySite(
            self.resource, config.max_body, request_head_timeout=config.request_head_timeout, reactor=reactor
        )
        self.site.noisy = False
        self.connections = Connections(self.site)
        self.connections.noisy = False
        self.ports: list = []
        self._listening: defer.Deferred | None = None  # binding the --listen endpoints, until stopService

    def bind(self):
        """Bind every --listen endpoint now; one that cannot be bound exits with one line.

        `twistd cg` binds from makeService, before twistd starts its log or daemonizes: the
        line goes to the terminal (or the journal), with no traceback, no pid file left
        behind, and no daemonizing parent left waiting for a child that died.
        """
        failures = []
        self._listen().addErrback(failures.append)
        if failures:
            first = failures[0].value  # a FirstError: which endpoint, and why
            description = self.config.listen[first.index]
            raise SystemExit(f"cg: cannot listen on {description}: {_why_not_listening(description, first.subFailure)}")

    def privilegedStartService(self):
        super().privilegedStartService()
        self.bind()

    def startService(self):
        super().startService()
        self._store_info.start(10.0, now=True)  # first: a store that answers at once is in the line
        self._listen().addCallback(self._ready)
        self._previous_hup = _install_sighup(lambda: self.reactor.callFromThread(self._reopen_changelog))

    def _ready(self, _):
        """Say where cg listens and what it does, then tell systemd it is ready."""
        config = self.config
        info = self.stats.store_info
        self._store_untold = info is None
        log.info(
            "cg {version} listening on {where} \N{RIGHTWARDS ARROW} Anthropic {anthropic}, OpenAI {openai}; "
            "store {store} ({originals}); expand {expand}; mode {mode}",
            version=__version__,
            where=", ".join(_url(d, p.getHost()) for d, p in zip(config.listen, self.ports)),
            anthropic=config.anthropic_upstream,
            openai=config.openai_upstream,
            store=self.store_url,
            originals="opening" if info is None else f"{info.entries} originals",
            expand="on" if config.expand else "off",
            mode="observe" if config.observe else "forward",
        )
        systemd.notify(b"READY=1")

    def _refresh_store_info(self):
        def keep(info):
            self.stats.store_info, self.stats.store_info_as_of = info, self.reactor.seconds()
            if self._store_untold:
                self._store_untold = False
                log.info("cg store {store}: {originals} originals", store=self.store_url, originals=info.entries)

        return self.store.info().addCallbacks(keep, lambda failure: None)  # the store logs its errors

    def _reopen_changelog(self):
        if self.changelog.path is None:
            log.info("cg got SIGHUP: no --changelog to reopen")
            return
        reopened = self.changelog.reopen()
        reopened.addCallback(lambda _: log.info("cg reopened the change log {path} (SIGHUP)", path=self.changelog.path))

    def _listen(self) -> defer.Deferred:
        if self._listening is None:
            # maybeDeferred: a description that does not parse raises before any Deferred exists.
            listens = [defer.maybeDeferred(self._listen_on, d) for d in self.config.listen]
            self._listening = defer.gatherResults(listens, consumeErrors=True)
            self._listening.addCallback(self.ports.extend)
        return self._listening

    def _listen_on(self, description: str) -> defer.Deferred:
        return serverFromString(self.reactor, description).listen(self.connections)

    def stopService(self):
        """Stop accepting, let in-flight responses finish (up to drain_timeout), then cut them."""
        super().stopService()
        systemd.notify(b"STOPPING=1")
        if self._store_info.running:
            self._store_info.stop()
        _restore_sighup(self._previous_hup)
        stopped = [defer.maybeDeferred(port.stopListening) for port in self.ports]
        del self.ports[:]
        self._listening = None
        in_flight = self.stats.in_flight
        if in_flight:
            log.info("cg draining {n} in-flight requests", n=in_flight)
        timer = self.reactor.callLater(self.config.drain_timeout, self._cut)

        def closed(_):
            if timer.active():
                timer.cancel()
            return defer.gatherResults([self.upstream.close(), self.store.close(), self.changelog.close()])

        drain = self.resource.drained()
        drain.addCallback(lambda _: self.connections.close_all())
        drain.addCallback(closed)
        return defer.gatherResults([*stopped, drain])

    def _cut(self):
        """The drain timeout ran out: cut what is still open."""
        self.resource.abort_all()
        self.connections.abort_all()
