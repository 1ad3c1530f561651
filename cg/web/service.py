"""The cg service: listening ports, the proxy, and a graceful stop that drains streams."""

from __future__ import annotations

import gc
import os
import signal
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any, TypeVar, cast

from twisted.application import service
from twisted.internet import defer, task, tcp
from twisted.internet.address import IPv4Address, IPv6Address, UNIXAddress
from twisted.internet.endpoints import serverFromString
from twisted.internet.interfaces import IAddress, IListeningPort, IStreamServerEndpoint
from twisted.logger import Logger
from twisted.python.failure import Failure

from cg import __version__
from cg.compaction import options
from cg.compaction.pipeline import Memo
from cg.compaction.rewrite import RewriteConfig, Rewriter
from cg.exchange.keepalive import Policy
from cg.record.changelog import open_changelog
from cg.record.metrics import Metrics
from cg.record.stats import Stats
from cg.store import default_store_url, parse_store_url, store_from_url, store_label
from cg.store.base import ILedger, StoreInfo
from cg.web import memofile, systemd
from cg.web.config import Config, with_backlog
from cg.web.dashboard_api import Access
from cg.web.forwarder import Forwarder
from cg.web.keepalive import IDLE_TIMEOUT, KeepAlive
from cg.web.metrics import MeteredStore
from cg.web.proxy import ProxyResource
from cg.web.site import Connections, ProxySite
from cg.web.tenant import parse_tenant
from cg.web.upstream import Upstream, load_trust_root, split_base

if TYPE_CHECKING:
    from cg.web.workers import WorkerInfo

log = Logger(namespace="cg.web.service")
# Seconds between trims of the ledger (ILedger.trim): its retention is counted in days.
LEDGER_TRIM_EVERY = 3600.0

# The cyclic garbage collector's young-generation threshold (CPython's default: 700; 2,000 since
# 3.13, which the measurements below did not run on). A request allocates thousands of objects that
# reference counting frees; at 700, those of the requests in flight outlive two young collections,
# and their arrival in the old generation sets off a full collection, a walk of every object the
# memo holds, every ~2 s in a tight loop.
_GC_YOUNG = 10_000

_T = TypeVar("_T")

# What signal.signal takes and returns (typeshed's own alias is private).
SignalHandler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


def settle_gc() -> None:
    """Tune the garbage collector for a long-running proxy, once the service is built.

    What exists by then (modules, the service) lives as long as the process: frozen out of every
    later collection. And the young generation collects every 10,000 allocations. In the
    gateway's tight loop (docs/performance.md, Gateway) the collector's share of cg's CPU went
    from 11% to 7%, and full collections from 16 to 1 in 30 s (each ~100 ms with the reactor
    stopped).
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(_GC_YOUNG, 10, 10)


def _install_sighup(reopen: Callable[[], object]) -> SignalHandler:
    """SIGHUP calls `reopen` (the change log's, for logrotate); returns the previous handler.

    Only the main thread may set signal handlers: elsewhere nothing changes.
    """
    try:
        return signal.signal(signal.SIGHUP, lambda signum, frame: reopen())
    except ValueError:
        return None


def _restore_sighup(previous: SignalHandler) -> None:
    if previous is not None:
        try:
            signal.signal(signal.SIGHUP, previous)
        except ValueError:
            pass


def rewrite_config(config: Config) -> RewriteConfig:
    return options.rewrite_config(config.expand, config.offload_min_tokens, config.keep_tools,
                                  config.disabled_components, config.cold_policy)


def _why_not_listening(description: str, failure: Failure) -> str:
    """"address already in use", not the CannotListenError's repr."""
    error = getattr(failure.value, "socketError", None)
    if isinstance(error, OSError) and error.strerror:
        return error.strerror[0].lower() + error.strerror[1:]
    if description.startswith("systemd:") and failure.check(IndexError, KeyError):
        return "systemd passed no such socket (is cg started by cg.socket?)"
    message: str = failure.getErrorMessage()  # untyped in Twisted
    return message


def listening_url(description: str, address: IAddress) -> str:
    """A listening address as a client is pointed at it: http://127.0.0.1:8080."""
    host = getattr(address, "host", None)
    if host is None:
        name = cast(UNIXAddress, address).name
        assert name is not None  # a listening socket's path
        return f"unix:{os.fsdecode(name)}"
    port = cast("IPv4Address | IPv6Address", address).port
    scheme = "https" if description.startswith("ssl:") else "http"
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def endpoint(reactor: Any, description: str) -> IStreamServerEndpoint:
    """A --listen description's endpoint, with cg's backlog unless it names one (`with_backlog`)."""
    server: IStreamServerEndpoint = serverFromString(reactor, with_backlog(description))
    return server


def take_turns(port: tcp.Port) -> tcp.Port:
    """A listening port that accepts one connection each time its socket is ready, not a burst.

    Workers share one listening socket; Twisted's port accepts up to 100 connections at a time
    (more when it took them all), so after a restart the first worker awake took every client's
    new connection and kept it, and a busy one took as many as an idle one. One at a time, an
    idle worker takes the next: it is back at the socket first.
    """
    accept_ready: Callable[[], None] = port.doRead

    def accept_one() -> None:
        port.numberAccepts = 1
        return accept_ready()

    port.doRead = accept_one  # type: ignore[method-assign]
    return port


def bind_now(listening: defer.Deferred[_T], descriptions: tuple[str, ...]) -> None:
    """Exit with one line if `listening` (every endpoint's, gathered) has failed already.

    `twistd cg` binds from makeService, before twistd starts its log or daemonizes: the
    line goes to the terminal (or the journal), with no traceback, no pid file left
    behind, and no daemonizing parent left waiting for a child that died.
    """
    failures: list[Failure] = []
    listening.addErrback(failures.append)
    if failures:
        first = cast(defer.FirstError, failures[0].value)  # which endpoint, and why
        description = descriptions[first.index]
        raise SystemExit(f"cg: cannot listen on {description}: {_why_not_listening(description, first.subFailure)}")


class CGService(service.Service):
    """Listens on every --listen endpoint; on stop, stops accepting and drains in-flight responses."""

    # Twisted's Service says `name = None`, unannotated, so mypy takes its type to be None
    # (IService documents a str or None).
    name = "cg"  # type: ignore[assignment]

    # reactor: the installed one's parts cg uses (IReactorTime, IReactorFromThreads, IReactorSocket, and
    # IReactorTCP through the endpoints), which no one type says.
    def __init__(self, config: Config, reactor: Any = None, worker: WorkerInfo | None = None) -> None:
        if reactor is None:
            from twisted.internet import reactor
        self.config = config
        self.reactor = reactor
        self.worker = worker  # one of --workers N: adopt the parent's sockets
        self.stats = Stats(metrics=Metrics(tenants=config.metrics_tenants))
        if worker is not None:
            self.stats.worker = {"index": worker.index, "of": worker.of, "pid": os.getpid()}

        def count_retry() -> None:
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
            store_url, reactor, max_bytes=config.store_max_mb << 20, password=config.store_password,
            ledger_days=config.ledger_days, ledger_max_turns=config.ledger_max_turns,
        )
        self.stats.store = self.store.stats
        self.stats.store_kind, self.stats.store_max_bytes = parse_store_url(store_url)[0], config.store_max_mb << 20
        # What the proxy and the size refresh call: the same store, its calls timed for /metrics.
        self.metered_store = MeteredStore(self.store, self.stats.metrics.store_operation)
        self.changelog = open_changelog(config.changelog, reactor)
        self.stats.changelog = self.changelog
        # The store's size every 10 s, and /metrics brought up to /stats (with --workers, every
        # worker's, so that a scrape served by another shows them).
        self._store_info = task.LoopingCall(self._refresh_store_info)
        self._store_info.clock = reactor
        self._store_untold = False  # the start-up line said "opening": say the count once known
        # The ledger's rows past --ledger-days (and --ledger-max-turns) go once an hour.
        self._ledger_trim = task.LoopingCall(self._trim_ledger)
        self._ledger_trim.clock = reactor
        self._previous_hup: SignalHandler = None
        rewriter = Rewriter(rewrite_config(config), Memo.sized(config.memo_mb << 20))
        self.stats.memo = self.memo = rewriter.memo
        # Decided before this start: read now, before cg listens; written again as cg goes (cg.web.memofile).
        directory = memofile.memo_dir(config.memo_dir, store_url) if config.memo_mb else None
        self.memo_file: memofile.MemoFile | None = None
        if directory is not None:
            code = memofile.code_fingerprint()
            memofile.load(self.memo, directory, code)
            name = memofile.file_name(None if worker is None else worker.index)
            self.memo_file = memofile.MemoFile(self.memo, directory, name, code, reactor)
        self.keepalive: KeepAlive | None = None
        if config.keepalive:
            policy = Policy(config.keepalive_max_idle, config.keepalive_budget, config.keepalive_max_conversations)
            self.keepalive = KeepAlive(self.upstream, reactor, split_base(config.anthropic_upstream), policy,
                                       self.stats.keepalive)
        self.forwarder = Forwarder(
            self.upstream,
            self.stats,
            {"anthropic": split_base(config.anthropic_upstream), "openai": split_base(config.openai_upstream)},
            rewriter=rewriter,
            store=self.metered_store,
            ledger=self.store.ledger,
            tenant_of=parse_tenant(config.tenant),
            observe=config.observe,
            changelog=self.changelog,
            max_expand_rounds=config.max_expand_rounds,
            max_held=config.max_held,
            continuation_timeout=config.header_timeout,
            reactor=reactor,
            keepalive=self.keepalive,
            cache_ttl=config.cache_ttl,
            # another process may write hidden-turn records to the same store (cg.stream.hidden.Seen)
            shared_store=config.workers > 1 or self.stats.store_kind == "redis",
        )
        self.resource = ProxyResource(self.forwarder, Access(config.tenant, config.admin_token))
        self.site = ProxySite(
            self.resource, config.max_body, request_head_timeout=config.request_head_timeout, reactor=reactor,
            **({"timeout": IDLE_TIMEOUT} if config.keepalive else {}),  # cg.web.keepalive: a client's leaving seen
        )
        self.site.noisy = False
        self.connections = Connections(self.site)
        self.connections.noisy = False
        self.ports: list[IListeningPort] = []
        # binding the --listen endpoints, until stopService
        self._listening: defer.Deferred[list[IListeningPort]] | None = None

    def bind(self) -> None:
        """Bind every --listen endpoint now (a worker: adopt its sockets); see `bind_now`."""
        bind_now(self._listen(), self.config.listen)

    def privilegedStartService(self) -> None:
        super().privilegedStartService()  # type: ignore[no-untyped-call]  # untyped in Twisted
        self.bind()

    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]  # untyped in Twisted
        self._store_info.start(10.0, now=True)  # first: a store that answers at once is in the line
        self._ledger_trim.start(LEDGER_TRIM_EVERY, now=True)
        if self.memo_file is not None:
            self.memo_file.start()
        self._listen().addCallback(self._ready)
        self._previous_hup = _install_sighup(lambda: self.reactor.callFromThread(self._reopen_changelog))

    def _ready(self, _: list[IListeningPort]) -> None:
        """Say where cg listens and what it does, then tell systemd it is ready."""
        config = self.config
        info = cast("StoreInfo | None", self.stats.store_info)  # as _refresh_store_info keeps it
        self._store_untold = info is None
        log.info(
            "cg {version}{worker} listening on {where} \N{RIGHTWARDS ARROW} Anthropic {anthropic}, OpenAI {openai}; "
            "store {store} ({originals}); expand {expand}; mode {mode}{keepalive}",
            version=__version__,
            worker="" if self.worker is None else f" worker {self.worker.index + 1}/{self.worker.of}",
            where=", ".join(listening_url(d, p.getHost()) for d, p in zip(config.listen, self.ports)),
            anthropic=config.anthropic_upstream,
            openai=config.openai_upstream,
            store=self.store_url,
            originals="opening" if info is None else f"{info.entries} originals",
            expand="on" if config.expand else "off",
            mode="observe" if config.observe else "forward",
            keepalive="" if self.keepalive is None else
            f"; keep-alive up to {config.keepalive_max_idle:g} s idle, {config.keepalive_budget} pings",
        )
        systemd.notify(b"READY=1")

    def _refresh_store_info(self) -> defer.Deferred[None]:
        def keep(info: StoreInfo) -> None:
            self.stats.store_info, self.stats.store_info_as_of = info, self.reactor.seconds()
            if self._store_untold:
                self._store_untold = False
                log.info("cg store {store}: {originals} originals", store=self.store_url, originals=info.entries)

        refreshed = self.metered_store.info().addCallbacks(keep, lambda failure: None)  # the store logs its errors
        return refreshed.addCallback(lambda _: self.stats.sync())

    def _trim_ledger(self) -> defer.Deferred[None]:
        def failed(failure: Failure) -> None:  # logged, and tried again in an hour
            log.warn("cg could not trim the ledger: {error}", error=failure.value)

        ledger: ILedger = self.store.ledger  # an Attribute of IStore: untyped
        return ledger.trim(self.reactor.seconds()).addCallbacks(lambda _: None, failed)

    def _reopen_changelog(self) -> None:
        if self.changelog.path is None:
            log.info("cg got SIGHUP: no --changelog to reopen")
            return
        reopened = self.changelog.reopen()
        reopened.addCallback(lambda _: log.info("cg reopened the change log {path} (SIGHUP)", path=self.changelog.path))

    def _listen(self) -> defer.Deferred[list[IListeningPort]]:
        if self._listening is None:
            # maybeDeferred: a description that does not parse raises before any Deferred exists.
            listens: list[defer.Deferred[IListeningPort]]
            if self.worker is not None:
                listens = [defer.maybeDeferred(self._adopt, fd, family) for fd, family in self.worker.sockets]
            else:
                listens = [defer.maybeDeferred(self._listen_on, d) for d in self.config.listen]
            self._listening = defer.gatherResults(listens, consumeErrors=True)
            self._listening.addCallback(self.ports.extend)
        return self._listening

    def _listen_on(self, description: str) -> defer.Deferred[IListeningPort]:
        listening: defer.Deferred[IListeningPort] = endpoint(self.reactor, description).listen(self.connections)
        return listening

    def _adopt(self, fd: int, family: int) -> IListeningPort:
        """A socket the parent of --workers bound: the reactor keeps its own copy of it."""
        # adoptStreamPort makes a tcp.Port (or a unix.Port, one of them): take_turns reaches into it.
        port = take_turns(cast(tcp.Port, self.reactor.adoptStreamPort(fd, family, self.connections)))
        os.close(fd)
        return port

    def stopService(self) -> defer.Deferred[list[Any]]:  # no one reads the list
        """Stop accepting, let in-flight responses finish (up to drain_timeout), then cut them."""
        super().stopService()  # type: ignore[no-untyped-call]  # untyped in Twisted
        systemd.notify(b"STOPPING=1")
        if self._store_info.running:
            self._store_info.stop()
        if self._ledger_trim.running:
            self._ledger_trim.stop()
        _restore_sighup(self._previous_hup)
        if self.keepalive is not None:
            self.keepalive.stop()  # no ping goes out while in-flight requests drain
        stopped = [defer.maybeDeferred(port.stopListening) for port in self.ports]
        del self.ports[:]
        self._listening = None
        self.connections.stop_reuse()
        in_flight = self.stats.in_flight
        if in_flight:
            log.info("cg draining {n} in-flight requests", n=in_flight)
        timer = self.reactor.callLater(self.config.drain_timeout, self._cut)

        def closed(_: object) -> defer.Deferred[list[Any]]:
            if timer.active():
                timer.cancel()
            closing: list[defer.Deferred[Any]] = [
                self.upstream.close(), self.store.close(), self.changelog.close()
            ]
            if self.memo_file is not None:
                closing.append(self.memo_file.stop())
            return defer.gatherResults(closing)

        drain = self.forwarder.drained()
        drain.addCallback(lambda _: self.connections.close_all())
        drain.addCallback(closed)
        return defer.gatherResults([*stopped, drain])

    def _cut(self) -> None:
        """The drain timeout ran out: cut what is still open."""
        self.forwarder.abort_all()
        self.connections.abort_all()
