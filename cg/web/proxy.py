"""The proxy resource: cg's own endpoints, and the routing of every other request to the forwarder.

cg's own endpoints (/healthz, /stats, /metrics, /cg/expand/ID, the dashboard at /cg/ and its API at
/cg/api/, HEAD /) are answered here. A request cg forwards is checked (its request-target, its size,
its route) and handed to the `cg.web.forwarder.Forwarder`, which runs it as one exchange
(`cg.exchange`, on Twisted by `cg.web.driver`).
"""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import unquote

import ujson
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web import resource, server
from twisted.web.http_headers import Headers

from cg.record.stats import Stats
from cg.store.base import IStore
from cg.web import metrics
from cg.web.dashboard import asset_name, load_assets, page_headers
from cg.web.dashboard_api import (
    PREFIX,
    Access,
    DashboardAPI,
    original_tenant,
    security_headers,
    unauthorized,
    viewer,
)
from cg.web.forwarder import Forwarder
from cg.web.site import CappedRequest as Request
from cg.wire import dialect, http1
from cg.wire.markers import parse_marker_ref

log = Logger(namespace="cg.web.proxy")


class ProxyResource(resource.Resource):
    """Answers cg's own endpoints and hands everything else to the forwarder."""

    isLeaf = True

    def __init__(self, forwarder: Forwarder, access: Access | None = None):
        super().__init__()  # type: ignore[no-untyped-call]  # twisted.web's Resource
        self.forwarder = forwarder
        self.access = access or Access()  # who sees what on /cg/ (--tenant, --admin-token-file)
        self.dashboard_api = DashboardAPI(forwarder, self.access)
        self.assets = load_assets()

    @property
    def stats(self) -> Stats:
        return self.forwarder.stats

    @property
    def store(self) -> IStore | None:
        return self.forwarder.store

    @property
    def tenant_of(self) -> Callable[[Headers], str]:
        return self.forwarder.tenant_of

    def render(self, request: Request) -> bytes | int:
        request.responseHeaders.removeHeader(b"server")  # cg adds no headers of its own
        path = dialect.split_path(request.uri)
        if path.startswith(PREFIX):  # never forwarded: a conversation id may hold an encoded /
            return self.dashboard_api.render(request, path)
        problem = http1.target_problem(request.uri)
        if problem is not None:
            message = f"cg does not forward this request-target: {problem}"
            return _error(request, dialect.spoken_by(request.requestHeaders), 400, message)
        if path == b"/" and request.method == b"HEAD":
            return b""  # Claude Code warms its connection with HEAD /
        if path == b"/healthz" and request.method in (b"GET", b"HEAD"):
            request.setHeader(b"content-type", b"text/plain")
            return b"ok\n"
        if path == b"/stats" and request.method == b"GET":
            request.setHeader(b"content-type", b"application/json")
            return ujson.dumps(self.stats.snapshot(), indent=2).encode() + b"\n"
        if path == b"/metrics" and request.method == b"GET":
            body, content_type = metrics.render(self.stats, (request.getHeader(b"accept") or b"").decode("latin-1"))
            request.setHeader(b"content-type", content_type.encode("latin-1"))
            return body
        if path.startswith(b"/cg/expand/") and request.method == b"GET":
            return self._show_original(request, path[len(b"/cg/expand/") :].decode("latin-1"))
        if path == b"/cg" and request.method == b"GET":
            request.redirect(b"/cg/")
            return b""
        name = asset_name(path) if request.method in (b"GET", b"HEAD") else None
        if name is not None:
            return self._show_asset(request, name)
        which = dialect.route(request.uri, request.requestHeaders.hasHeader(b"anthropic-version"))
        if which is None:
            message = dialect.not_proxied(path, _url_of_cg(request))
            return _error(request, dialect.spoken_by(request.requestHeaders), 404, message)
        if request.too_large:
            self.stats.refused_too_large(which, request.uri.decode("latin-1"), self.forwarder.metrics_tenant(request))
            return _error(request, which, 413, "request body is larger than cg's --max-body")
        self.forwarder.forward(request, which)
        return server.NOT_DONE_YET

    def _show_asset(self, request: Request, name: str) -> bytes:
        """GET /cg/ and /cg/static/NAME: the dashboard, from memory."""
        security_headers(request)
        for header, value in page_headers(name):
            request.setHeader(header, value)
        asset = self.assets.get(name)
        if asset is None:
            return _error(request, None, 404, "no such file of the dashboard")
        request.setHeader(b"content-type", asset.content_type)
        return asset.body

    def _show_original(self, request: Request, ref: str) -> bytes | int:
        """GET /cg/expand/ID[?tenant=T]: an original, to whoever may read it under --tenant (else 404);
        another tenant's (T) only with the admin token."""
        security_headers(request)
        who = viewer(request.requestHeaders, self.access, self.tenant_of)
        if who is None:
            return unauthorized(request)
        args: dict[bytes, list[bytes]] = request.args or {}
        asked = args.get(b"tenant")
        tenant = original_tenant(who, self.tenant_of(request.requestHeaders),
                                 None if not asked else asked[-1].decode("latin-1"))
        ident = parse_marker_ref(unquote(ref))
        if ident is None or self.store is None or tenant is None:
            return _error(request, None, 404, "no such original")

        gone: list[Failure] = []
        request.notifyFinish().addErrback(gone.append)

        def found(original: bytes | None) -> None:
            if gone:
                return
            if original is None:
                request.write(_error(request, None, 404, "no such original (unknown, evicted, or another tenant's)"))
            else:
                request.setHeader(b"content-type", b"text/plain; charset=utf-8")
                request.setHeader(b"content-length", b"%d" % len(original))
                request.write(original)
            request.finish()

        self.store.get(tenant, ident).addCallback(found).addErrback(
            lambda failure: log.failure("reading an original failed", failure)
        )
        return server.NOT_DONE_YET


def _url_of_cg(request: Request) -> str:
    """The base URL this client reached cg at, as its Host header says."""
    host = (request.getHeader(b"host") or b"HOST:PORT").decode("latin-1")
    return f"{'https' if request.isSecure() else 'http'}://{host}"


def _error(request: Request, which: str | None, status: int, message: str) -> bytes:
    body = dialect.error_body(which, status, message)
    request.setResponseCode(status)
    request.setHeader(b"content-type", b"application/json")
    request.setHeader(b"content-length", b"%d" % len(body))
    return body
