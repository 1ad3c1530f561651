"""cg's configuration, as the command line gives it (see cg.web.tap for the options)."""

import re

import attrs

from cg.compaction.options import CACHE_TTL, COLD_POLICY
from cg.compaction.pipeline import MEMO_BYTES
from cg.exchange.keepalive import DEFAULT_BUDGET, DEFAULT_MAX_CONVERSATIONS, DEFAULT_MAX_IDLE
from cg.exchange.ledger import DEFAULT_DAYS, DEFAULT_MAX_TURNS

_SIZE = re.compile(r"^\s*(\d+)\s*([KMG]?)(?:i?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}

# Twisted's default backlog is 50: a burst of new connections past it waits a SYN retransmit or is
# reset (bench/backlog.py). Every endpoint cg listens on gets this one unless it names its own.
DEFAULT_BACKLOG = 1024
# The endpoint types whose backlog cg fills in, and the place of `backlog` among each one's
# positional fields (twisted.internet.endpoints' parsers: tcp:PORT:INTERFACE:BACKLOG, …).
_BACKLOG_AT = {"tcp": 2, "tcp6": 2, "ssl": 5, "unix": 2}


def endpoint_fields(description: str) -> list[str]:
    """A strports description's fields: split at each colon a backslash does not escape."""
    fields, field, escaped = [], "", False
    for char in description:
        if escaped or char not in "\\:":
            field, escaped = field + char, False
        elif char == "\\":
            field, escaped = field + char, True
        else:
            fields.append(field)
            field = ""
    return [*fields, field]


def with_backlog(description: str) -> str:
    """`description` (a --listen endpoint) with cg's backlog, unless it names one or has none to name
    (systemd: sockets come bound, with the socket unit's Backlog=)."""
    kind, *fields = endpoint_fields(description)
    at = _BACKLOG_AT.get(kind)
    positional = [field for field in fields if "=" not in field.replace("\\=", "")]
    if at is None or len(positional) > at or any(field.startswith("backlog=") for field in fields):
        return description
    return f"{description}:backlog={DEFAULT_BACKLOG}"


def parse_size(text: str) -> int:
    """Bytes from '1048576', '64M', '64MiB' or '2G' (binary units)."""
    match = _SIZE.match(str(text))
    if not match:
        raise ValueError(f"not a size: {text!r} (try 64MiB)")
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def format_size(size: int) -> str:
    """`size` as a person types it, in the largest binary unit that holds it whole (64MiB): what
    `parse_size` reads back to the same number."""
    for unit in "GMK":
        if size and size % _UNITS[unit] == 0:
            return f"{size // _UNITS[unit]}{unit}iB"
    return str(size)


@attrs.frozen
class Config:
    listen: tuple[str, ...] = (f"tcp:8080:interface=127.0.0.1:backlog={DEFAULT_BACKLOG}",)
    anthropic_upstream: str = "https://api.anthropic.com"
    openai_upstream: str = "https://api.openai.com"
    max_body: int = 64 << 20
    upstream_ca: str | None = None
    connect_timeout: float = 10.0
    header_timeout: float = 600.0
    idle_timeout: float = 60.0
    drain_timeout: float = 30.0
    request_head_timeout: float = 30.0
    store: str | None = None  # None: cg.store.default_store_url()
    store_max_mb: int = 1024
    ledger_days: float = DEFAULT_DAYS  # the ledger's rollups and conversation summaries (cg.store.base.ILedger)
    ledger_max_turns: int = DEFAULT_MAX_TURNS  # and its requests, one by one: the newest
    # A Redis store's password, from --store-password-file or $CG_STORE_PASSWORD (cg.store.store_password);
    # None: the URL's, if any. Never shown.
    store_password: str | None = attrs.field(default=None, repr=False)
    tenant: str = "none"
    # The dashboard's operator token, from --admin-token-file (cg.web.dashboard_api); None: no operator
    # view across tenants. Never shown.
    admin_token: str | None = attrs.field(default=None, repr=False)
    expand: bool = True
    observe: bool = False
    offload_min_tokens: int = 2000
    keep_tools: tuple[str, ...] = ("Read",)
    disabled_components: tuple[str, ...] = ()
    cold_policy: bool = COLD_POLICY[1] == "on"  # the cache-aware policy (cg.compaction.cold)
    changelog: str | None = None
    max_expand_rounds: int = 3
    max_held: int = 16 << 20
    memo_mb: int = MEMO_BYTES >> 20  # text the conversation memo keeps (cg.compaction.pipeline.Memo.sized)
    memo_dir: str | None = None  # its decisions across a restart; None: beside the store (cg.web.memofile)
    workers: int = 1  # processes serving the --listen sockets (cg.web.workers)
    metrics_tenants: bool = False  # /metrics labels requests and billed tokens by tenant
    keepalive: bool = False  # ping Anthropic conversations' prompt caches before they expire (cg.web.keepalive)
    keepalive_max_idle: float = DEFAULT_MAX_IDLE
    keepalive_budget: int = DEFAULT_BUDGET
    keepalive_max_conversations: int = DEFAULT_MAX_CONVERSATIONS
    cache_ttl: str = CACHE_TTL[1]  # the lifetime Messages breakpoints ask for (cg.wire.cache.CACHE_TTLS)
