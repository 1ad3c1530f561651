"""GET /cg/ and /cg/static/NAME: the dashboard page and its assets (`cg/web/static/`).

They ship inside the package (package data: nothing from a CDN, no build step) and are read once,
when cg starts, so a request never touches the disk. The page itself is static: it reads
everything it shows from `/cg/api/…` and `/stats` in the browser.
"""

from __future__ import annotations

from importlib import resources

import attrs

# The page runs only its own script and style, sends nothing anywhere but cg, and may not be framed.
CONTENT_SECURITY_POLICY = (
    b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    b"connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
PAGE = "index.html"
_CONTENT_TYPES = {
    ".html": b"text/html; charset=utf-8",
    ".js": b"text/javascript; charset=utf-8",
    ".css": b"text/css; charset=utf-8",
    ".LICENSE": b"text/plain; charset=utf-8",
}


@attrs.frozen
class Asset:
    body: bytes
    content_type: bytes


def load_assets() -> dict[str, Asset]:
    """Every file of `cg/web/static/` cg serves, by name."""
    assets = {}
    for entry in resources.files("cg.web").joinpath("static").iterdir():
        suffix = next((s for s in _CONTENT_TYPES if entry.name.endswith(s)), None)
        if suffix is not None:
            assets[entry.name] = Asset(entry.read_bytes(), _CONTENT_TYPES[suffix])
    return assets


def page_headers(name: str) -> list[tuple[bytes, bytes]]:
    """What the page (`name` PAGE) carries besides every /cg/ answer's headers
    (`cg.web.dashboard_api.security_headers`): its policies. An asset carries none."""
    if name != PAGE:
        return []
    return [(b"content-security-policy", CONTENT_SECURITY_POLICY), (b"referrer-policy", b"no-referrer")]


def asset_name(path: bytes) -> str | None:
    """Which asset a GET of `path` asks for (/cg/ is the page), or None when not the dashboard's."""
    if path == b"/cg/":
        return PAGE
    if path.startswith(b"/cg/static/"):
        return path[len(b"/cg/static/") :].decode("latin-1")
    return None
