"""The dashboard's API (`GET /cg/api/…`, cg.web.dashboard_api) and its access rules.

First its JSON, built by pure functions from constructed ledger rows (no reactor); then cg's
resource and site on a MemoryReactorClock over in-memory transports, its store a MemoryStore whose
ledger the test fills: every endpoint, every access case (--tenant none, credential, header:NAME,
the admin token), the headers, bad parameters, a client that goes away, and no credential in a log.
"""

import json

import pytest
from helpers.clients import PEER, Client
from rawhttp import http_request, split_response
from twisted.internet.defer import Deferred, fail
from twisted.internet.error import ConnectionDone
from twisted.internet.testing import MemoryReactorClock
from twisted.logger import formatEvent, globalLogPublisher
from twisted.python import usage
from twisted.python.failure import Failure
from twisted.web.http_headers import Headers

from cg.exchange.ledger import HOUR, MINUTE, Bucket, Change, Conversation, Totals, Turn
from cg.record.stats import Stats
from cg.store.memory import MemoryStore
from cg.stream.usage import Usage
from cg.testing import MemoryUpstream
from cg.web import dashboard_api as api
from cg.web.forwarder import Forwarder
from cg.web.proxy import ProxyResource
from cg.web.site import ProxySite
from cg.web.tap import Options
from cg.web.tenant import parse_tenant
from cg.web.upstream import split_base

T0 = 1_699_999_200.0  # a whole hour (UTC)
ADMIN = "admin-7f3c9e"


def totals(requests=1, before=1000, after=400, via=0.01, direct=0.02, **over) -> Totals:
    return Totals(requests=requests, tokens_before=before, tokens_after=after, cost_via_cg=via, cost_direct=direct,
                  **over)


def turn(at: float, conversation="c1", tenant="", seq=1, **over) -> Turn:
    fields = dict(time=at, seq=seq, tenant=tenant, conversation=conversation, client="claude-code",
                  model="claude-sonnet-4-5", dialect="anthropic", path="/v1/messages", status=200, outcome="ok",
                  tokens_before=1000, tokens_after=400, results_before=800, results_after=200,
                  billed=Usage(input_tokens=10, cache_read_tokens=300, cache_write_tokens=90, output_tokens=50,
                               cache_write_1h_tokens=40),
                  cost_via_cg=0.01, cost_direct=0.02)
    return Turn(**{**fields, **over})


def change(seq: int, marker="0123456789abcdef") -> Change:
    return Change(seq=seq, message=2, block=0, tool="Bash", component="offload", lossy=True, marker=marker,
                  tokens_before=800, tokens_after=200)


# ---------------------------------------------------------------------------------------------
# The JSON, from rows


def summary(window, since, now, buckets, all_tenants):
    """The summary of `buckets`, its headline their sum (as the ledger's totals would be)."""
    return api.summary_json(window, since, now, sum((b.totals for b in buckets), Totals()), buckets, all_tenants)


def test_a_summary_names_every_figure_of_its_buckets():
    buckets = [
        Bucket(T0, MINUTE, "a", "claude-code", "m1",
               totals(2, results_before=900, results_after=100, expand_rounds=1, repairs=1,
                      billed=Usage(1, 2, 30, 4, 10))),
        Bucket(T0 + 120, MINUTE, "b", "codex", None, totals(1, 500, 500, 0.5, 0.25, billed=Usage(5, 6, 7, 8, 0))),
    ]
    doc = summary("1h", T0 - 600, T0 + 150, buckets, all_tenants=True)
    assert {k: doc[k] for k in ("window", "since", "now", "requests", "tokens_before", "tokens_after",
                                "results_before", "results_after", "expand_rounds", "repairs")} == {
        "window": "1h", "since": T0 - 600, "now": T0 + 150, "requests": 3, "tokens_before": 1500,
        "tokens_after": 900, "results_before": 900, "results_after": 100, "expand_rounds": 1, "repairs": 1}
    assert doc["billed"] == {"input": 6, "cache_read": 8, "cache_write": 37, "cache_write_1h": 10, "output": 12}
    assert doc["cost_usd"] == pytest.approx({"via_cg": 0.51, "direct": 0.27, "ratio": 0.51 / 0.27})
    assert doc["by_client"] == [
        {"client": "claude-code", "requests": 2, "tokens_before": 1000, "tokens_after": 400,
         "cost_via_cg": 0.01, "cost_direct": 0.02},
        {"client": "codex", "requests": 1, "tokens_before": 500, "tokens_after": 500,
         "cost_via_cg": 0.5, "cost_direct": 0.25}]
    assert [(row["model"], row["requests"]) for row in doc["by_model"]] == [("m1", 2), (None, 1)]
    assert [(row["tenant"], row["requests"]) for row in doc["by_tenant"]] == [("a", 2), ("b", 1)]
    assert "by_tenant" not in summary("1h", T0 - 600, T0 + 150, buckets, all_tenants=False)
    json.dumps(doc, allow_nan=False)  # plain JSON


def test_keepalive_pings_are_in_the_summary_and_no_breakdown_row_of_their_own():
    buckets = [Bucket(T0, MINUTE, "", "claude-code", "m1", totals(2, pings=1, cost_pings=0.001)),
               Bucket(T0 + 300, MINUTE, "", "sdk", "m2", totals(0, 0, 0, 0.0, 0.0, pings=2, cost_pings=0.002))]
    doc = summary("1h", T0 - 600, T0 + 400, buckets, all_tenants=True)
    assert doc["requests"] == 2 and doc["pings"] == {"count": 3, "cost_usd": pytest.approx(0.003)}
    assert [row["client"] for row in doc["by_client"]] == ["claude-code"]  # the sdk had pings only
    assert [row["model"] for row in doc["by_model"]] == ["m1"]


def test_a_ratio_is_null_when_nothing_would_have_cost_anything():
    doc = summary("1h", T0, T0 + 60, [Bucket(T0, MINUTE, "", "sdk", "m", totals(via=0.0, direct=0.0))],
                           all_tenants=True)
    assert doc["cost_usd"] == {"via_cg": 0.0, "direct": 0.0, "ratio": None}
    empty = summary("24h", T0, T0 + 60, [], all_tenants=True)
    assert empty["requests"] == 0 and empty["cost_usd"]["ratio"] is None and empty["by_client"] == []


def test_the_series_is_per_minute_up_to_six_hours_filled_from_the_windows_start():
    buckets = [Bucket(T0 + 60, MINUTE, "", "sdk", "m", totals(2)), Bucket(T0 + 60, MINUTE, "", "codex", "m",
                                                                        totals(1))]
    series = summary("1h", T0 - 30, T0 + 150, buckets, all_tenants=True)["series"]
    assert series["width"] == 60
    assert [(p["t"], p["requests"]) for p in series["points"]] == [
        (T0 - 60, 0), (T0, 0), (T0 + 60, 3), (T0 + 120, 0)]
    assert series["points"][2] == pytest.approx({"t": T0 + 60, "requests": 3, "tokens_before": 2000,
                                                 "tokens_after": 800, "cost_via_cg": 0.02, "cost_direct": 0.04})
    assert summary("6h", T0 + 150 - 6 * HOUR, T0 + 150, buckets, True)["series"]["width"] == 60
    assert summary("x", T0 + 149 - 6 * HOUR, T0 + 150, buckets, True)["series"]["width"] == 3600


def test_a_longer_window_is_charted_per_hour_and_all_from_its_first_traffic():
    buckets = [Bucket(T0 + 60, MINUTE, "", "sdk", "m", totals(2)), Bucket(T0 + 3000, MINUTE, "", "sdk", "m",
                                                                        totals(1))]
    now = T0 + 2 * HOUR + 5
    day = summary("24h", now - 24 * HOUR, now, buckets, True)["series"]
    assert day["width"] == 3600 and len(day["points"]) == 25  # the hour holding `since`, to now's
    assert [(p["t"], p["requests"]) for p in day["points"][-3:]] == [(T0, 3), (T0 + HOUR, 0), (T0 + 2 * HOUR, 0)]
    hourly = [Bucket(T0, HOUR, "", "sdk", "m", totals(3, 3000, 1200, 0.03, 0.06))]
    everything = summary("all", None, now, hourly, True)["series"]
    assert everything == {"width": 3600, "points": [
        {"t": T0 + i * HOUR, **({"requests": 3, "tokens_before": 3000, "tokens_after": 1200, "cost_via_cg": 0.03,
                                 "cost_direct": 0.06} if i == 0 else
                                {"requests": 0, "tokens_before": 0, "tokens_after": 0, "cost_via_cg": 0.0,
                                 "cost_direct": 0.0})} for i in range(3)]}
    assert summary("all", None, now, [], True)["series"] == {"width": 3600, "points": []}
    assert len(summary("since", 0.0, now, hourly, True)["series"]["points"]) == 3  # not since 1970


@pytest.mark.parametrize(("until", "kept", "state"), [
    (None, False, "unknown"), (T0 - 1, False, "expired"), (T0, True, "expired"), (T0 + 300, False, "warm"),
    (T0 + 300, True, "kept_warm")])
def test_a_conversations_cache_state_now(until, kept, state):
    row = Conversation("s1", "t", "codex", None, T0 - 600, T0 - 60, totals(), cache_until=until, kept_warm=kept)
    assert api.cache_json(row, T0) == {"state": state, "until": until}


def test_a_conversation_row_names_every_figure_and_its_tenant_only_to_who_sees_all():
    row = Conversation("s1", "tenant-a", "codex", "gpt-5", T0, T0 + 60,
                       totals(3, 3000, 1200, 0.03, 0.06, expand_rounds=2, repairs=1, pings=4, cost_pings=0.004),
                       cache_until=T0 + 400)
    assert api.conversation_json(row, T0 + 100, all_tenants=True) == {
        "id": "s1", "tenant": "tenant-a", "client": "codex", "model": "gpt-5", "first_seen": T0,
        "last_seen": T0 + 60, "requests": 3, "tokens_before": 3000, "tokens_after": 1200, "cost_usd": 0.03,
        "cost_direct_usd": 0.06, "expand_rounds": 2, "repairs": 1, "pings": {"count": 4, "cost_usd": 0.004},
        "cache": {"state": "warm", "until": T0 + 400}}
    assert "tenant" not in api.conversation_json(row, T0 + 100, all_tenants=False)
    page = api.conversations_json([row], 7, 5, 1, "cost", T0, all_tenants=False)
    assert (page["total"], page["offset"], page["limit"], page["order"]) == (7, 5, 1, "cost")
    assert [c["id"] for c in page["conversations"]] == ["s1"]


def test_a_turn_names_every_figure_and_its_own_changes():
    first = turn(T0, seq=1, verdict="expired", verdict_detail="idle 7m12s", added_ms=1.5, epoch=True,
                 expand_rounds=1, repairs=2)
    second = turn(T0 + 60, seq=2, billed=None, cost_via_cg=None, cost_direct=None, status=None, outcome="cut")
    row = Conversation("c1", "", "claude-code", "claude-sonnet-4-5", T0, T0 + 60, totals(2))
    doc = api.conversation_detail_json(row, [first, second], [change(1), change(1, None), change(2, "fedcba9876543210")],
                                       T0 + 100, all_tenants=True)
    assert doc["conversation"]["id"] == "c1"
    one, two = doc["turns"]
    assert one == {
        "seq": 1, "kind": "request", "time": T0, "client": "claude-code", "model": "claude-sonnet-4-5", "dialect": "anthropic",
        "path": "/v1/messages", "status": 200, "outcome": "ok", "tokens_before": 1000, "tokens_after": 400,
        "results_before": 800, "results_after": 200,
        "billed": {"input": 10, "cache_read": 300, "cache_write": 90, "cache_write_1h": 40, "output": 50},
        "cost_usd": {"via_cg": 0.01, "direct": 0.02}, "expand_rounds": 1, "repairs": 2, "epoch": True,
        "added_ms": 1.5, "cache_verdict": {"verdict": "expired", "detail": "idle 7m12s"},
        "changes": [
            {"message": 2, "block": 0, "tool": "Bash", "component": "offload", "lossy": True,
             "marker": "0123456789abcdef", "tokens_before": 800, "tokens_after": 200},
            {"message": 2, "block": 0, "tool": "Bash", "component": "offload", "lossy": True,
             "marker": None, "tokens_before": 800, "tokens_after": 200}]}
    assert (two["billed"], two["cost_usd"], two["cache_verdict"], two["status"], two["added_ms"]) == (
        None, {"via_cg": None, "direct": None}, None, None, None)
    assert [c["marker"] for c in two["changes"]] == ["fedcba9876543210"]


def args(**params) -> dict[bytes, list[bytes]]:
    return {k.encode(): [v.encode()] for k, v in params.items()}


def test_a_summarys_window():
    now, started = T0 + 1000, T0 - 50
    assert api.summary_window({}, now, started) == ("24h", now - 24 * HOUR)
    assert api.summary_window(args(window="1h"), now, started) == ("1h", now - HOUR)
    assert api.summary_window(args(window="7d"), now, started) == ("7d", now - 7 * 24 * HOUR)
    assert api.summary_window(args(window="all"), now, started) == ("all", None)
    assert api.summary_window(args(window="start"), now, started) == ("start", started)
    assert api.summary_window(args(since="1700000000.5"), now, started) == ("since", 1700000000.5)


@pytest.mark.parametrize(("query", "message"), [
    ({b"window": [b"2h"]}, "window must be one of 1h, 24h, 7d, all, start"),
    ({b"window": [b"1h"], b"since": [b"5"]}, "give window or since, not both"),
    ({b"since": [b"yesterday"]}, "since must be a Unix time in seconds (a number, 0 or more)"),
    ({b"since": [b"nan"]}, "since must be a Unix time in seconds (a number, 0 or more)"),
    ({b"since": [b"-1"]}, "since must be a Unix time in seconds (a number, 0 or more)"),
    ({b"window": [b"1h", b"24h"]}, "window given 2 times"),
    ({b"windw": [b"1h"]}, "unknown parameter 'windw': this endpoint takes window, since"),
])
def test_a_summarys_bad_window_is_refused_by_name(query, message):
    with pytest.raises(api.BadQuery) as refused:
        api.summary_window(query, T0, T0)
    assert str(refused.value) == message


def test_a_conversations_page():
    assert api.conversations_query({}) == (0, 50, "last")
    assert api.conversations_query(args(offset="100", limit="20", order="cost")) == (100, 20, "cost")
    assert api.conversations_query(args(limit="100000")) == (0, 500, "last")  # capped


@pytest.mark.parametrize(("query", "message"), [
    (args(limit="0"), "limit must be a whole number, 1 or more"),
    (args(limit="ten"), "limit must be a whole number, 1 or more"),
    ({b"limit": ["²".encode("latin-1")]}, "limit must be a whole number, 1 or more"),
    (args(offset="9" * 16), "offset must be a whole number, 0 or more"),
    (args(offset="-1"), "offset must be a whole number, 0 or more"),
    (args(order="oldest"), "order must be one of last, first, requests, tokens_before, tokens_after, cost"),
])
def test_a_conversations_bad_page_is_refused_by_name(query, message):
    with pytest.raises(api.BadQuery) as refused:
        api.conversations_query(query)
    assert str(refused.value) == message


def test_who_sees_what():
    named = parse_tenant("credential")
    key = Headers({b"x-api-key": [b"sk-one"]})
    assert api.viewer(key, api.Access("none"), parse_tenant("none")) == api.Viewer(None)
    assert api.viewer(key, api.Access("credential"), named) == api.Viewer(named(key))
    assert api.viewer(Headers(), api.Access("credential"), named) is None
    gateway = parse_tenant("header:x-team")
    assert api.viewer(Headers({b"x-team": [b"blue"]}), api.Access("header:x-team"), gateway) == api.Viewer("blue")
    admin = Headers({b"authorization": [f"Bearer {ADMIN}".encode()]})
    assert api.viewer(admin, api.Access("credential", ADMIN), named) == api.Viewer(None, admin=True)
    assert api.viewer(admin, api.Access("credential"), named) == api.Viewer(named(admin))  # no admin configured
    wrong = Headers({b"authorization": [b"Bearer admin-7f3c9f"]})
    assert api.viewer(wrong, api.Access("credential", ADMIN), named) == api.Viewer(named(wrong))


def test_which_tenants_original_a_viewer_reads():
    assert api.original_tenant(api.Viewer("a"), "a", None) == "a"
    assert api.original_tenant(api.Viewer("a"), "a", "a") == "a"
    assert api.original_tenant(api.Viewer("a"), "a", "b") is None
    assert api.original_tenant(api.Viewer(None, admin=True), "h", "b") == "b"
    assert api.original_tenant(api.Viewer(None), "", "b") is None  # --tenant none: "" is everyone's


# ---------------------------------------------------------------------------------------------
# cg's resource, in memory


class Dash:
    """cg's resource and site on a MemoryReactorClock, its store a MemoryStore whose ledger the test fills."""

    def __init__(self, tenant="none", admin_token=None, store=True, now=T0 + 3600):
        self.clock = MemoryReactorClock()
        self.store = MemoryStore() if store else None
        self.ledger = None if self.store is None else self.store.ledger
        self.stats = Stats()
        self.stats.started = T0 - 7 * 24 * HOUR
        self.now = now
        self.forwarder = Forwarder(
            MemoryUpstream(self.clock), self.stats,
            {"anthropic": split_base("http://anthropic.test"), "openai": split_base("http://openai.test")},
            store=self.store, ledger=self.ledger, tenant_of=parse_tenant(tenant), reactor=self.clock,
            now=lambda: self.now)
        self.resource = ProxyResource(self.forwarder, api.Access(tenant, admin_token))
        self.site = ProxySite(self.resource, 1 << 20, reactor=self.clock)

    def send(self, method: str, path: str, headers=()) -> Client:
        client = Client(self.site.buildProtocol(PEER))
        client.channel.dataReceived(http_request(method, path, headers=headers))
        return client

    def get(self, path: str, *headers: tuple[str, str]) -> tuple[int, dict, object]:
        status, head, body = split_response(self.send("GET", path, headers).transport.value())
        return status, head, json.loads(body) if head.get(b"content-type") == [b"application/json"] else body


def key(secret: str) -> tuple[str, str]:
    return ("x-api-key", secret)


def bearer(token: str) -> tuple[str, str]:
    return ("authorization", f"Bearer {token}")


def test_every_endpoint_answers_json_nobody_caches_or_sniffs():
    dash = Dash()
    dash.ledger.record(turn(T0 + 5, seq=1, cache_until=T0 + 305), [change(1)])
    dash.ledger.record(turn(T0 + 70, seq=2, cache_until=T0 + 370), [])
    for path in ("/cg/api/summary", "/cg/api/conversations", "/cg/api/conversations/c1", "/cg/api/nothing",
                 "/cg/api/summary?window=2h"):
        status, head, _ = dash.get(path)
        assert head[b"content-type"] == [b"application/json"], path
        assert head[b"cache-control"] == [b"no-store"] and head[b"x-content-type-options"] == [b"nosniff"], path
    status, _, doc = dash.get("/cg/api/summary?window=start")
    assert status == 200
    assert (doc["window"], doc["since"], doc["now"], doc["requests"]) == ("start", dash.stats.started, dash.now, 2)
    assert doc["billed"]["cache_write"] == 180 and doc["by_tenant"][0]["tenant"] == ""
    status, _, doc = dash.get("/cg/api/conversations")
    assert status == 200 and doc["total"] == 1
    row = doc["conversations"][0]
    assert (row["id"], row["tenant"], row["requests"], row["cache"]) == ("c1", "", 2, {"state": "expired",
                                                                                       "until": T0 + 370})
    status, _, doc = dash.get("/cg/api/conversations/c1")
    assert status == 200
    assert [(t["seq"], [c["marker"] for c in t["changes"]]) for t in doc["turns"]] == [(1, ["0123456789abcdef"]),
                                                                                       (2, [])]


def test_a_long_windows_figures_count_whole_minutes_and_its_chart_whole_hours():
    dash = Dash(now=T0 + 24 * HOUR + 1800)  # the day's window starts half-way through T0's hour
    dash.ledger.record(turn(T0 + 600, seq=1), [])  # before the window, in the hour that holds its start
    dash.ledger.record(turn(T0 + 2400, seq=2), [])
    doc = dash.get("/cg/api/summary?window=24h")[2]
    assert doc["since"] == T0 + 1800 and doc["requests"] == 1
    assert doc["series"]["width"] == 3600 and doc["series"]["points"][0] == pytest.approx(
        {"t": T0, "requests": 2, "tokens_before": 2000, "tokens_after": 800, "cost_via_cg": 0.02,
         "cost_direct": 0.04})
    assert [row["requests"] for row in doc["by_client"]] == [2]
    hour = dash.get("/cg/api/summary?window=1h")[2]
    assert hour["requests"] == 0 and hour["series"]["width"] == 60 and len(hour["series"]["points"]) == 61


def test_a_conversation_id_is_percent_decoded():
    dash = Dash()
    dash.ledger.record(turn(T0, conversation="a/b c?d"), [])
    status, _, doc = dash.get("/cg/api/conversations/a%2Fb%20c%3Fd")
    assert status == 200 and doc["conversation"]["id"] == "a/b c?d"


@pytest.mark.parametrize(("path", "status", "message"), [
    ("/cg/api/summary?window=2h", 400, "window must be one of 1h, 24h, 7d, all, start"),
    ("/cg/api/conversations?limit=0", 400, "limit must be a whole number, 1 or more"),
    ("/cg/api/conversations/c1?x=1", 400, "unknown parameter 'x': this endpoint takes none"),
    ("/cg/api/conversations/nobody", 404, "no such conversation"),
    ("/cg/api/conversations/", 404, "no such endpoint: the dashboard's API has /cg/api/summary, "
                                    "/cg/api/conversations and /cg/api/conversations/ID"),
])
def test_what_the_api_cannot_answer_it_says(path, status, message):
    dash = Dash()
    dash.ledger.record(turn(T0), [])
    got, _, doc = dash.get(path)
    assert (got, doc) == (status, {"error": {"message": message}})


def test_only_get_and_head_are_answered():
    dash = Dash()
    status, head, body = split_response(dash.send("HEAD", "/cg/api/summary").transport.value())
    assert (status, head[b"content-type"], body) == (200, [b"application/json"], b"")
    status, head, body = split_response(dash.send("POST", "/cg/api/summary").transport.value())
    assert (status, head[b"allow"]) == (405, [b"GET, HEAD"])
    assert json.loads(body) == {"error": {"message": "the dashboard's API answers GET only"}}


def test_without_a_store_the_api_says_it_keeps_no_ledger():
    status, _, doc = Dash(store=False).get("/cg/api/summary")
    assert (status, doc) == (503, {"error": {"message": "cg keeps no ledger: it has no store, or one without a "
                                                        "ledger"}})


def filled(dash: Dash, tenants: dict[str, str]) -> None:
    """A conversation per tenant (`tenants`: conversation id -> tenant), each with an original."""
    for seq, (conversation, tenant) in enumerate(tenants.items(), 1):
        dash.ledger.record(turn(T0 + seq, conversation=conversation, tenant=tenant, seq=seq), [])
        dash.store.put(tenant, {f"{seq:016x}": f"{conversation}'s original".encode()})


def test_under_tenant_none_everyone_sees_everything():
    dash = Dash("none")
    filled(dash, {"c1": "", "c2": ""})
    status, _, doc = dash.get("/cg/api/conversations", key("sk-anyone"))
    assert status == 200 and doc["total"] == 2 and "tenant" in doc["conversations"][0]
    assert "by_tenant" in dash.get("/cg/api/summary")[2]


def test_under_tenant_credential_a_viewer_sees_only_its_own():
    dash = Dash("credential")
    mine, theirs = parse_tenant("credential")(Headers({b"x-api-key": [b"sk-mine"]})), "someone-else"
    filled(dash, {"c-mine": mine, "c-theirs": theirs})
    status, _, doc = dash.get("/cg/api/conversations", key("sk-mine"))
    assert status == 200 and [c["id"] for c in doc["conversations"]] == ["c-mine"] and doc["total"] == 1
    assert "tenant" not in doc["conversations"][0]
    summary = dash.get("/cg/api/summary?window=all", key("sk-mine"))[2]
    assert summary["requests"] == 1 and "by_tenant" not in summary
    assert dash.get("/cg/api/conversations/c-mine", key("sk-mine"))[0] == 200
    assert dash.get("/cg/api/conversations/c-theirs", key("sk-mine"))[:3:2] == (
        404, {"error": {"message": "no such conversation"}})
    assert dash.get("/cg/expand/0000000000000001", key("sk-mine"))[2] == b"c-mine's original"
    assert dash.get("/cg/expand/0000000000000002", key("sk-mine"))[0] == 404
    assert dash.get(f"/cg/expand/0000000000000002?tenant={theirs}", key("sk-mine"))[0] == 404


@pytest.mark.parametrize("path", ["/cg/api/summary", "/cg/api/conversations", "/cg/api/conversations/c1",
                                  "/cg/expand/0000000000000001"])
def test_under_tenant_credential_no_credential_is_a_401(path):
    dash = Dash("credential")
    filled(dash, {"c1": parse_tenant("credential")(Headers())})
    status, head, doc = dash.get(path)
    assert status == 401 and head[b"www-authenticate"] == [b'Bearer realm="cg"']
    assert head[b"cache-control"] == [b"no-store"] and head[b"x-content-type-options"] == [b"nosniff"]
    assert doc == {"error": {"message": "send your API key the way your client sends it "
                                        "(x-api-key: KEY, or Authorization: Bearer KEY)"}}


def test_under_a_gateways_header_the_header_names_the_tenant():
    dash = Dash("header:x-team")
    filled(dash, {"c-blue": "blue", "c-red": "red"})
    doc = dash.get("/cg/api/conversations", ("x-team", "blue"))[2]
    assert [c["id"] for c in doc["conversations"]] == ["c-blue"]
    assert dash.get("/cg/api/conversations/c-red", ("x-team", "blue"))[0] == 404
    assert dash.get("/cg/api/conversations")[2]["total"] == 0  # no header: tenant "", as its requests


def test_the_admin_token_sees_every_tenant_and_reads_their_originals():
    dash = Dash("credential", admin_token=ADMIN)
    mine = parse_tenant("credential")(Headers({b"x-api-key": [b"sk-mine"]}))
    filled(dash, {"c-mine": mine, "c-theirs": "someone-else"})
    status, _, doc = dash.get("/cg/api/conversations?order=first", bearer(ADMIN))
    assert status == 200 and [(c["id"], c["tenant"]) for c in doc["conversations"]] == [
        ("c-theirs", "someone-else"), ("c-mine", mine)]
    summary = dash.get("/cg/api/summary?window=all", bearer(ADMIN))[2]
    assert sorted(row["tenant"] for row in summary["by_tenant"]) == sorted([mine, "someone-else"])
    assert dash.get("/cg/api/conversations/c-theirs", bearer(ADMIN))[2]["conversation"]["tenant"] == "someone-else"
    assert dash.get("/cg/expand/0000000000000002?tenant=someone-else", bearer(ADMIN))[2] == b"c-theirs's original"
    # The wrong token is a plain credential: its own (empty) tenant, and nobody else's originals.
    assert dash.get("/cg/api/conversations", bearer(ADMIN + "x"))[2]["total"] == 0
    assert "by_tenant" not in dash.get("/cg/api/summary", bearer(ADMIN + "x"))[2]
    assert dash.get("/cg/expand/0000000000000002?tenant=someone-else", bearer(ADMIN + "x"))[0] == 404


def test_an_original_carries_the_headers_too():
    dash = Dash()
    filled(dash, {"c1": ""})
    status, head, body = dash.get("/cg/expand/0000000000000001")
    assert (status, body) == (200, b"c1's original")
    assert head[b"cache-control"] == [b"no-store"] and head[b"x-content-type-options"] == [b"nosniff"]


@pytest.fixture
def events():
    seen: list[dict] = []
    globalLogPublisher.addObserver(seen.append)
    yield seen
    globalLogPublisher.removeObserver(seen.append)


class Pending:
    """A ledger whose answers wait for the test."""

    def __init__(self):
        self.answers: list[Deferred] = []

    def conversations(self, tenant, offset, limit, order="last"):
        self.answers.append(Deferred())
        return self.answers[-1]


def test_a_client_that_goes_away_before_the_ledger_answers_gets_nothing(events):
    dash = Dash()
    dash.forwarder.ledger = pending = Pending()
    client = dash.send("GET", "/cg/api/conversations")
    client.channel.connectionLost(Failure(ConnectionDone()))
    pending.answers[0].callback(([], 0))  # nothing to write to, and no error
    assert client.transport.value() == b""
    assert not [event for event in events if "log_failure" in event]


def test_a_ledger_that_fails_is_a_500_and_a_logged_failure():
    dash = Dash()
    dash.forwarder.ledger = failing = Pending()
    failing.conversations = lambda *a: fail(RuntimeError("disk on fire"))
    status, _, doc = dash.get("/cg/api/conversations")
    assert (status, doc) == (500, {"error": {"message": "cg could not read its ledger (see its log)"}})


def test_no_credential_lands_in_a_log(events):
    dash = Dash("credential", admin_token=ADMIN)
    filled(dash, {"c1": parse_tenant("credential")(Headers({b"x-api-key": [b"sk-secret-1"]}))})
    for path in ("/cg/api/summary", "/cg/api/conversations/c1", "/cg/expand/0000000000000001", "/cg/api/nothing"):
        for header in (key("sk-secret-1"), bearer("sk-secret-2"), bearer(ADMIN)):
            dash.get(path, header)
    lines = [formatEvent(event) for event in events]
    assert any("GET /cg/api/summary 200" in line for line in lines)  # cg's own line for each
    assert not [line for line in lines if "sk-secret" in line or ADMIN in line]


# ---------------------------------------------------------------------------------------------
# --admin-token-file


def test_the_admin_token_file_is_read_once_stripped(tmp_path):
    path = tmp_path / "token"
    path.write_text(f"  {ADMIN}\n")
    options = Options()
    options.parseOptions(["--admin-token-file", str(path)])
    assert options.config().admin_token == ADMIN
    assert ADMIN not in repr(options.config())


@pytest.mark.parametrize(("content", "message"), [
    (None, "--admin-token-file: cannot read {path}: No such file or directory"),
    ("\n \n", "--admin-token-file: {path} is empty"),
    (b"\xff\xfe", "--admin-token-file: cannot read {path}: 'utf-8' codec can't decode byte 0xff in position 0: "
                  "invalid start byte"),
])
def test_a_bad_admin_token_file_is_refused_in_one_line(tmp_path, content, message):
    path = tmp_path / "token"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(usage.UsageError) as refused:
        Options().parseOptions(["--admin-token-file", str(path)])
    assert str(refused.value) == message.format(path=path)
