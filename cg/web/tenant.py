"""Whose originals a request may store and read (`--tenant`).

- `none`: one namespace for everyone (a single user's local cg).
- `credential`: a hash of the request's `x-api-key` or `Authorization` (never the
  credential itself), so one key's model can never read another key's originals.
  Rotating a key or a refreshed OAuth token starts a new namespace: older originals
  are stranded (they are still evicted normally).
- `header:NAME`: the value of a header set by a gateway in front of cg.
"""

import hashlib
from collections.abc import Callable

from twisted.web.http_headers import Headers

TenantOf = Callable[[Headers], str]


def _first(headers: Headers, name: bytes) -> bytes | None:
    values = headers.getRawHeaders(name)
    return values[0] if values else None


def _none(headers: Headers) -> str:
    return ""


def _credential(headers: Headers) -> str:
    secret = _first(headers, b"x-api-key") or _first(headers, b"authorization") or b""
    return hashlib.sha256(b"cg-tenant\0" + secret).hexdigest()[:32]


def parse_tenant(spec: str) -> TenantOf:
    """The tenant function for a `--tenant` value; ValueError for anything else."""
    if spec == "none":
        return _none
    if spec == "credential":
        return _credential
    if spec.startswith("header:") and len(spec) > len("header:"):
        name = spec[len("header:") :].encode("latin-1").lower()
        return lambda headers: (_first(headers, name) or b"").decode("latin-1")
    raise ValueError(f"--tenant must be none, credential or header:NAME, not {spec!r}")
