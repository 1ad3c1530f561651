"""The dashboard's API (`GET /cg/api/…`): what the ledger holds, as JSON, to the viewers who may see it.

`/cg/api/summary`, `/cg/api/conversations` and `/cg/api/conversations/{id}` read the store's ledger
(`cg.store.base.ILedger`) and answer as docs/how-to/dashboard.md documents. The JSON is built by
pure functions of the ledger's rows (`summary_json`, `conversation_json`, `turn_json`, …); only
`DashboardAPI` touches Twisted.

Who sees what (`Access`, `viewer`): under `--tenant none` everyone sees everything; under
`credential` or `header:NAME` a viewer sees the tenant its headers name, exactly as the provider
requests they scope (`Forwarder.tenant_of`); the `--admin-token-file` token sees every tenant. A
credential is only hashed (`cg.web.tenant`), never kept or logged.
"""

from __future__ import annotations

import hmac
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any
from urllib.parse import unquote

import attrs
import ujson
from twisted.internet.defer import Deferred, gatherResults
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web import server
from twisted.web.http_headers import Headers

from cg.exchange.ledger import HOUR, MINUTE, ORDERS, Bucket, Change, Conversation, Totals, Turn, bucket_start
from cg.stream.usage import Usage
from cg.web.forwarder import Forwarder
from cg.web.site import CappedRequest as Request

log = Logger(namespace="cg.web.dashboard_api")

PREFIX = b"/cg/api/"
# ?window= and how far back each reaches (None: all the ledger keeps; "start": since cg started).
WINDOWS: dict[str, float | None] = {"1h": HOUR, "24h": 24 * HOUR, "7d": 7 * 24 * HOUR, "all": None, "start": None}
DEFAULT_WINDOW = "24h"
FINE_SERIES = 6 * HOUR  # a window at most this long is charted per minute, a longer one per hour
# The longest window whose chart is filled with empty buckets from its start (168 hours); a longer
# one starts at its first bucket with traffic, so that `?since=0` stays a few hundred points.
FILLED_SERIES = 7 * 24 * HOUR
DEFAULT_LIMIT = 50
MAX_LIMIT = 500


class BadQuery(ValueError):
    """A query parameter the API cannot answer: a 400 with this message."""


# ---------------------------------------------------------------------------------------------
# Who sees what


@attrs.frozen
class Access:
    """What the access rules read from the command line: `--tenant`'s spec and the admin token."""

    tenant: str = "none"
    admin_token: str | None = attrs.field(default=None, repr=False)


@attrs.frozen
class Viewer:
    """Whom an answer is for: `tenant` None sees every tenant (and `by_tenant`)."""

    tenant: str | None
    admin: bool = False

    @property
    def all_tenants(self) -> bool:
        return self.tenant is None


def read_admin_token(path: str) -> str:
    """`--admin-token-file`'s token (the file's stripped content); ValueError in one line for a file
    that cannot be read or holds nothing."""
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"cannot read {path}: {getattr(error, 'strerror', None) or error}") from None
    if not token:
        raise ValueError(f"{path} is empty")
    return token


def is_admin(headers: Headers, access: Access) -> bool:
    """Whether `Authorization: Bearer <token>` carries the admin token (compared in constant time)."""
    if access.admin_token is None:
        return False
    for value in headers.getRawHeaders(b"authorization", ()):
        scheme, _, token = value.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), access.admin_token.encode()):
            return True
    return False


def viewer(headers: Headers, access: Access, tenant_of: Callable[[Headers], str]) -> Viewer | None:
    """Who sends `headers`: None for a viewer who must prove a credential and sent none (a 401)."""
    if is_admin(headers, access):
        return Viewer(None, admin=True)
    if access.tenant == "none":
        return Viewer(None)
    if access.tenant == "credential" and not (headers.hasHeader(b"x-api-key") or headers.hasHeader(b"authorization")):
        return None
    return Viewer(tenant_of(headers))


def original_tenant(who: Viewer, own: str, asked: str | None) -> str | None:
    """The tenant whose original `GET /cg/expand/ID?tenant=T` reads: the viewer's own, or T when the
    viewer holds the admin token or T is its own; None when T is another's (a 404, as unknown)."""
    if asked is None or asked == own or who.admin:
        return own if asked is None else asked
    return None


# ---------------------------------------------------------------------------------------------
# Queries


def _single(args: dict[bytes, list[bytes]], allowed: Iterable[str]) -> dict[str, str]:
    """Each parameter's one value; BadQuery for one cg does not know or one given twice."""
    allowed = tuple(allowed)
    params: dict[str, str] = {}
    for raw, values in args.items():
        name = raw.decode("latin-1")
        if name not in allowed:
            raise BadQuery(f"unknown parameter {name!r}: this endpoint takes {', '.join(allowed) or 'none'}")
        if len(values) != 1:
            raise BadQuery(f"{name} given {len(values)} times")
        params[name] = values[0].decode("latin-1")
    return params


def summary_window(args: dict[bytes, list[bytes]], now: float, started: float) -> tuple[str, float | None]:
    """(window name, since) for `?window=` or `?since=UNIX` (window "since"); BadQuery otherwise."""
    params = _single(args, ("window", "since"))
    if "since" in params:
        if "window" in params:
            raise BadQuery("give window or since, not both")
        try:
            since = float(params["since"])
        except ValueError:
            since = math.nan
        if not math.isfinite(since) or since < 0:
            raise BadQuery("since must be a Unix time in seconds (a number, 0 or more)")
        return "since", since
    window = params.get("window", DEFAULT_WINDOW)
    if window not in WINDOWS:
        raise BadQuery(f"window must be one of {', '.join(WINDOWS)}")
    if window == "start":
        return window, started
    span = WINDOWS[window]
    return window, None if span is None else now - span


def conversations_query(args: dict[bytes, list[bytes]]) -> tuple[int, int, str]:
    """(offset, limit capped at MAX_LIMIT, order) of `?offset=&limit=&order=`; BadQuery otherwise."""
    params = _single(args, ("offset", "limit", "order"))
    offset = _count(params, "offset", 0, 0)
    limit = min(_count(params, "limit", DEFAULT_LIMIT, 1), MAX_LIMIT)
    order = params.get("order", "last")
    if order not in ORDERS:
        raise BadQuery(f"order must be one of {', '.join(ORDERS)}")
    return offset, limit, order


def _count(params: dict[str, str], name: str, default: int, least: int) -> int:
    text = params.get(name)
    if text is None:
        return default
    if not (text.isascii() and text.isdigit() and len(text) <= 15) or int(text) < least:  # "²" is a digit
        raise BadQuery(f"{name} must be a whole number, {least} or more")
    return int(text)


# ---------------------------------------------------------------------------------------------
# JSON, from the ledger's rows


def billed_json(usage: Usage) -> dict[str, int]:
    """Billed tokens by kind: `cache_write` includes `cache_write_1h` (5-minute writes: the difference)."""
    return {"input": usage.input_tokens, "cache_read": usage.cache_read_tokens,
            "cache_write": usage.cache_write_tokens, "cache_write_1h": usage.cache_write_1h_tokens,
            "output": usage.output_tokens}


class _Figures:
    """What a chart point and a breakdown row show: their buckets' figures, summed as they come
    (plain numbers: a rollup of a week's hours is thousands of buckets)."""

    __slots__ = ("requests", "tokens_before", "tokens_after", "cost_via_cg", "cost_direct")

    def __init__(self) -> None:
        self.requests = self.tokens_before = self.tokens_after = 0
        self.cost_via_cg = self.cost_direct = 0.0

    def add(self, totals: Totals) -> None:
        self.requests += totals.requests
        self.tokens_before += totals.tokens_before
        self.tokens_after += totals.tokens_after
        self.cost_via_cg += totals.cost_via_cg
        self.cost_direct += totals.cost_direct

    def json(self) -> dict[str, Any]:
        return {"requests": self.requests, "tokens_before": self.tokens_before, "tokens_after": self.tokens_after,
                "cost_via_cg": self.cost_via_cg, "cost_direct": self.cost_direct}


def series_width(since: float | None, now: float) -> float:
    """A minute for a window of at most FINE_SERIES, else an hour (and for all the ledger keeps)."""
    return MINUTE if since is not None and now - since <= FINE_SERIES else HOUR


def summary_json(window: str, since: float | None, now: float, totals: Totals, buckets: Sequence[Bucket],
                 all_tenants: bool) -> dict[str, Any]:
    """`GET /cg/api/summary`: the window's `totals` (`ILedger.totals`, whole minutes), and its chart
    and breakdowns from its `buckets` of `series_width` (`ILedger.buckets`)."""
    width = series_width(since, now)
    doc: dict[str, Any] = {
        "window": window, "since": since, "now": now,
        "requests": totals.requests, "tokens_before": totals.tokens_before, "tokens_after": totals.tokens_after,
        "results_before": totals.results_before, "results_after": totals.results_after,
        "billed": billed_json(totals.billed),
        "cost_usd": {"via_cg": totals.cost_via_cg, "direct": totals.cost_direct,
                     "ratio": totals.cost_via_cg / totals.cost_direct if totals.cost_direct else None},
        "expand_rounds": totals.expand_rounds, "repairs": totals.repairs,
        "pings": pings_json(totals),
        "series": {"width": int(width), "points": _points(buckets, since, now, width)},
        "by_client": _breakdown(buckets, "client", lambda b: b.client),
        "by_model": _breakdown(buckets, "model", lambda b: b.model),
    }
    if all_tenants:
        doc["by_tenant"] = _breakdown(buckets, "tenant", lambda b: b.tenant)
    return doc


def _points(buckets: Sequence[Bucket], since: float | None, now: float, width: float) -> list[dict[str, Any]]:
    """The chart: one point per `width` from the window's start (or its first traffic) to now, oldest
    first, empty buckets included."""
    sums: dict[float, _Figures] = defaultdict(_Figures)
    for bucket in buckets:
        sums[bucket_start(bucket.start, width)].add(bucket.totals)
    if since is not None and now - since <= FILLED_SERIES:
        first = bucket_start(since, width)
    elif sums:
        first = min(sums)
    else:
        return []
    last = max(bucket_start(now, width), *sums) if sums else bucket_start(now, width)
    count = int(round((last - first) / width)) + 1
    return [{"t": t, **(sums[t] if t in sums else _Figures()).json()}
            for t in (first + i * width for i in range(count))]


def _breakdown(buckets: Sequence[Bucket], name: str, key: Callable[[Bucket], str | None]) -> list[dict[str, Any]]:
    """The figures per client, model or tenant that sent requests (not only had keep-alive pings), the
    most requests first."""
    sums: dict[str | None, _Figures] = defaultdict(_Figures)
    for bucket in buckets:
        sums[key(bucket)].add(bucket.totals)
    rows = sorted(((value, figures) for value, figures in sums.items() if figures.requests),
                  key=lambda item: (-item[1].requests, item[0] or ""))
    return [{name: value, **figures.json()} for value, figures in rows]


def pings_json(totals: Totals) -> dict[str, Any]:
    """The keep-alive pings cg sent on its own (--keepalive) and their cost: not in the requests' figures."""
    return {"count": totals.pings, "cost_usd": totals.cost_pings}


def cache_json(conversation: Conversation, now: float) -> dict[str, Any]:
    """The conversation's prompt cache now: warm (or kept warm by a ping) until when, expired, or
    unknown (cg never learned its lifetime)."""
    until = conversation.cache_until
    if until is None:
        state = "unknown"
    elif until <= now:
        state = "expired"
    else:
        state = "kept_warm" if conversation.kept_warm else "warm"
    return {"state": state, "until": until}


def conversation_json(conversation: Conversation, now: float, all_tenants: bool) -> dict[str, Any]:
    """A conversation's row (`tenant` only for a viewer who sees every tenant)."""
    totals = conversation.totals
    doc: dict[str, Any] = {"id": conversation.id}
    if all_tenants:
        doc["tenant"] = conversation.tenant
    doc.update({
        "client": conversation.client, "model": conversation.model,
        "first_seen": conversation.first, "last_seen": conversation.last,
        "requests": totals.requests, "tokens_before": totals.tokens_before, "tokens_after": totals.tokens_after,
        "cost_usd": totals.cost_via_cg, "cost_direct_usd": totals.cost_direct,
        "expand_rounds": totals.expand_rounds, "repairs": totals.repairs,
        "pings": pings_json(totals), "cache": cache_json(conversation, now),
    })
    return doc


def conversations_json(rows: Sequence[Conversation], total: int, offset: int, limit: int, order: str,
                       now: float, all_tenants: bool) -> dict[str, Any]:
    """`GET /cg/api/conversations`: a page of rows, and how many there are in all."""
    return {"conversations": [conversation_json(c, now, all_tenants) for c in rows],
            "total": total, "offset": offset, "limit": limit, "order": order}


def change_json(change: Change) -> dict[str, Any]:
    return {"message": change.message, "block": change.block, "tool": change.tool, "component": change.component,
            "lossy": change.lossy, "marker": change.marker, "tokens_before": change.tokens_before,
            "tokens_after": change.tokens_after}


def turn_json(turn: Turn, changes: Sequence[Change]) -> dict[str, Any]:
    """One request of a conversation (or a keep-alive ping: ``kind``), with what compaction changed in it."""
    return {
        "seq": turn.seq, "kind": turn.kind, "time": turn.time, "client": turn.client, "model": turn.model, "dialect": turn.dialect,
        "path": turn.path, "status": turn.status, "outcome": turn.outcome,
        "tokens_before": turn.tokens_before, "tokens_after": turn.tokens_after,
        "results_before": turn.results_before, "results_after": turn.results_after,
        "billed": None if turn.billed is None else billed_json(turn.billed),
        "cost_usd": {"via_cg": turn.cost_via_cg, "direct": turn.cost_direct},
        "expand_rounds": turn.expand_rounds, "repairs": turn.repairs, "epoch": turn.epoch,
        "added_ms": turn.added_ms,
        "cache_verdict": None if turn.verdict is None else {"verdict": turn.verdict, "detail": turn.verdict_detail},
        "changes": [change_json(c) for c in changes],
    }


def conversation_detail_json(conversation: Conversation, turns: Sequence[Turn], changes: Sequence[Change],
                             now: float, all_tenants: bool) -> dict[str, Any]:
    """`GET /cg/api/conversations/{id}`: its row, and its turns oldest first, each with its changes."""
    by_seq: dict[int, list[Change]] = defaultdict(list)
    for change in changes:
        by_seq[change.seq].append(change)
    return {"conversation": conversation_json(conversation, now, all_tenants),
            "turns": [turn_json(turn, by_seq.get(turn.seq, ())) for turn in turns]}


# ---------------------------------------------------------------------------------------------
# The resource's part


def security_headers(request: Request) -> None:
    """What every `/cg/` answer carries: nothing cached (it may be a tenant's), nothing sniffed."""
    request.setHeader(b"cache-control", b"no-store")
    request.setHeader(b"x-content-type-options", b"nosniff")


def json_answer(request: Request, status: int, doc: object) -> bytes:
    """`doc` as the JSON body of a `status` answer (headers set, body returned)."""
    body = ujson.dumps(doc, escape_forward_slashes=False).encode() + b"\n"
    request.setResponseCode(status)
    security_headers(request)
    request.setHeader(b"content-type", b"application/json")
    request.setHeader(b"content-length", b"%d" % len(body))
    return body


def error_answer(request: Request, status: int, message: str) -> bytes:
    return json_answer(request, status, {"error": {"message": message}})


def unauthorized(request: Request) -> bytes:
    request.setHeader(b"www-authenticate", b'Bearer realm="cg"')
    return error_answer(request, 401, "send your API key the way your client sends it "
                                      "(x-api-key: KEY, or Authorization: Bearer KEY)")


class DashboardAPI:
    """Answers `GET /cg/api/…` from the forwarder's ledger (the store's), on the forwarder's clock."""

    def __init__(self, forwarder: Forwarder, access: Access):
        self.forwarder = forwarder
        self.access = access

    def render(self, request: Request, path: bytes) -> bytes | int:
        """`path` is the request's path without its query."""
        if request.method not in (b"GET", b"HEAD"):
            request.setHeader(b"allow", b"GET, HEAD")
            return error_answer(request, 405, "the dashboard's API answers GET only")
        who = viewer(request.requestHeaders, self.access, self.forwarder.tenant_of)
        if who is None:
            return unauthorized(request)
        ledger = self.forwarder.ledger
        if ledger is None:
            return error_answer(request, 503, "cg keeps no ledger: it has no store, or one without a ledger")
        endpoint = path[len(PREFIX):]
        now = self.forwarder.now()
        args: dict[bytes, list[bytes]] = request.args or {}
        try:
            if endpoint == b"summary":
                window, since = summary_window(args, now, self.forwarder.stats.started)
                asked: list[Deferred[Any]] = [ledger.totals(who.tenant, since), ledger.buckets(
                    who.tenant, 0.0 if since is None else since, series_width(since, now))]
                rows = gatherResults(asked, consumeErrors=True)
                return self._answer(request, rows, lambda found: summary_json(window, since, now, found[0], found[1],
                                                                              who.all_tenants))
            if endpoint == b"conversations":
                offset, limit, order = conversations_query(args)
                return self._answer(request, ledger.conversations(who.tenant, offset, limit, order),
                                    lambda found: conversations_json(found[0], found[1], offset, limit, order, now,
                                                                     who.all_tenants))
            if endpoint.startswith(b"conversations/") and len(endpoint) > len(b"conversations/"):
                _single(args, ())
                ident = unquote(endpoint[len(b"conversations/"):].decode("latin-1"))
                return self._answer(request, ledger.conversation(who.tenant, ident),
                                    lambda found: None if found is None else conversation_detail_json(
                                        found[0], found[1], found[2], now, who.all_tenants))
        except BadQuery as error:
            return error_answer(request, 400, str(error))
        return error_answer(request, 404, "no such endpoint: the dashboard's API has /cg/api/summary, "
                                          "/cg/api/conversations and /cg/api/conversations/ID")

    def _answer(self, request: Request, answer: Deferred[Any], build: Callable[[Any], object]) -> int:
        """Answer with `build` of what the ledger's Deferred fires with (None: a 404), unless the
        client went away first."""
        gone: list[Failure] = []
        request.notifyFinish().addErrback(gone.append)

        def done(rows: object) -> None:
            doc = build(rows)
            body = error_answer(request, 404, "no such conversation") if doc is None else json_answer(request, 200, doc)
            finish(body)

        def failed(failure: Failure) -> None:
            log.failure("the dashboard's API could not read the ledger", failure)
            finish(error_answer(request, 500, "cg could not read its ledger (see its log)"))

        def finish(body: bytes) -> None:
            if gone:
                return
            request.write(body)  # a HEAD's is dropped by twisted.web
            request.finish()

        answer.addCallback(done).addErrback(failed)
        return server.NOT_DONE_YET
