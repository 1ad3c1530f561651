"""The dashboard's page and assets as cg serves them: from the installed package, with their types
and the headers that keep the page to itself (the page's behaviour is test_browser.py's)."""

import re

from pytest_twisted import inlineCallbacks
from rawhttp import connect, http_request, split_response

from cg.web.dashboard import CONTENT_SECURITY_POLICY, load_assets

SHIPPED = ("index.html", "dashboard.js", "dashboard.css", "uPlot.iife.min.js", "uPlot.min.css", "uPlot.LICENSE")


def get(cg, path, method="GET"):
    client = yield connect(cg.port, http_request(method, path))
    return split_response((yield client.closed))


def test_every_asset_ships_in_the_package():
    # Under tox this is the installed wheel: a file left out of package data fails here.
    assets = load_assets()
    assert set(SHIPPED) <= set(assets)
    assert b"MIT License" in assets["uPlot.LICENSE"].body


@inlineCallbacks
def test_the_page_carries_its_policies(cg):
    status, headers, body = yield from get(cg, "/cg/")
    assert status == 200
    assert headers[b"content-type"] == [b"text/html; charset=utf-8"]
    assert headers[b"content-security-policy"] == [CONTENT_SECURITY_POLICY]
    assert headers[b"referrer-policy"] == [b"no-referrer"]
    assert headers[b"cache-control"] == [b"no-store"]
    assert headers[b"x-content-type-options"] == [b"nosniff"]
    assert body == load_assets()["index.html"].body
    # The policy forbids inline script and style: the page must have none, and load only its own.
    assert b"style=" not in body and not re.search(rb"<script(?![^>]*\bsrc=)", body) and b"<style" not in body
    assert set(re.findall(rb'(?:src|href)="(/[^"]*)"', body)) == {
        b"/cg/static/uPlot.min.css", b"/cg/static/dashboard.css", b"/cg/static/uPlot.iife.min.js",
        b"/cg/static/dashboard.js",
    }


@inlineCallbacks
def test_assets_have_their_types(cg):
    types = {"dashboard.js": b"text/javascript; charset=utf-8", "uPlot.iife.min.js": b"text/javascript; charset=utf-8",
             "dashboard.css": b"text/css; charset=utf-8", "uPlot.LICENSE": b"text/plain; charset=utf-8"}
    for name, content_type in types.items():
        status, headers, body = yield from get(cg, f"/cg/static/{name}")
        assert (status, headers[b"content-type"]) == (200, [content_type]), name
        assert headers[b"x-content-type-options"] == [b"nosniff"] and headers[b"cache-control"] == [b"no-store"]
        assert b"content-security-policy" not in headers
        assert body == load_assets()[name].body


@inlineCallbacks
def test_what_is_not_an_asset_is_not_found(cg):
    for path in ("/cg/static/nothing.js", "/cg/static/", "/cg/static/dashboard.py", "/cg/static/static/index.html"):
        status, headers, _ = yield from get(cg, path)
        assert status == 404, path
        assert headers[b"content-type"] == [b"application/json"]
    for path in ("/cg/static/../proxy.py", "/cg/static/%2e%2e/dashboard.py"):  # no request-target cg takes
        status, _, _ = yield from get(cg, path)
        assert status == 400, path
    status, headers, _ = yield from get(cg, "/cg")
    assert (status, headers[b"location"]) == (302, [b"/cg/"])
    status, _, _ = yield from get(cg, "/cg/", method="POST")  # not the dashboard's
    assert status == 404


@inlineCallbacks
def test_head_is_answered_as_get_without_a_body(cg):
    status, headers, body = yield from get(cg, "/cg/static/dashboard.js", method="HEAD")
    assert (status, body) == (200, b"")
    assert headers[b"content-type"] == [b"text/javascript; charset=utf-8"]
    assert headers[b"content-length"] == [b"%d" % len(load_assets()["dashboard.js"].body)]
