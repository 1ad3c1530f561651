"""The compaction options of the command line, defined once: ``twistd cg`` (cg.web.tap) and
``cg-estimate`` (cg.record.estimate) both take them, with these names, defaults, help texts and
checks, and build the rewrite's configuration with ``rewrite_config``."""

import re
from collections.abc import Iterable

from cg.compaction.cold import ColdPolicy
from cg.compaction.components import DEFAULT_COMPONENTS, Offload
from cg.compaction.pipeline import CompactConfig
from cg.compaction.rewrite import RewriteConfig

COMPONENTS = tuple(c.name for c in DEFAULT_COMPONENTS)
_OFFLOAD = Offload()

# (name, default, help) of the options that take a value; --disable is repeatable (below).
EXPAND = (
    "expand",
    "on",
    "on: add the context_guru_expand tool to requests that declare tools, and only there "
    "run lossy compaction (offload, dedup). off: reformat only.",
)
OFFLOAD_MIN_TOKENS = (
    "offload-min-tokens",
    _OFFLOAD.min_tokens,
    "Offload tool results larger than this (estimated tokens).",
)
KEEP_TOOLS = (
    "keep-tools",
    ",".join(sorted(_OFFLOAD.keep_tools)),
    "Comma-separated tools whose results are never offloaded.",
)
COLD_POLICY = (
    "cold-policy",
    "on",
    "on: when a conversation's prompt cache has expired (no request for longer than its lifetime), "
    "offload its older tool results more (file views a later edit or read superseded), then replay "
    "those decisions on every later turn; kept in the store. off: first-sight decisions only.",
)
CACHE_TTL = (
    "cache-ttl",
    "keep",
    "The lifetime the cache_control breakpoints of an Anthropic Messages request ask for. keep: the "
    "client's, byte for byte. 5m, 1h: every breakpoint that one. auto: the client's until the "
    "conversation's cache first expires (that request writes the whole prompt anyway), an hour from then "
    "on; the choice is kept in the store, so every later turn sends the same bytes. cg-estimate "
    "--cache-ttl prices each on your own transcripts.",
)
DISABLE_HELP = (
    "Switch off a compaction component; repeatable. Components, in order: "
    + ", ".join(COMPONENTS)
    + " (textclean and jsonformat reformat losslessly; dedup and offload are lossy, "
    "resolvable through context_guru_expand)."
)


def check_disable(component: str) -> str:
    """``component`` if --disable takes it; else ValueError with the message to show."""
    if component not in COMPONENTS:
        raise ValueError(f"--disable takes one of {', '.join(COMPONENTS)}")
    return component


def check_expand(value: str) -> bool:
    return check_on_off("expand", value)


def check_on_off(option: str, value: str) -> bool:
    """``value`` of an on/off option as a bool; else ValueError with the message to show."""
    if value not in ("on", "off"):
        raise ValueError(f"--{option} must be one of on, off")
    return value == "on"


# A tool's name as both providers take it (Anthropic's tool name rule; OpenAI's function name rule).
_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


def count(text: str) -> int:
    """An integer, 0 or more (ValueError otherwise): --offload-min-tokens and the other counts."""
    value = int(text)
    if value < 0:
        raise ValueError(f"negative: {value}")
    return value


def keep_tools(value: str) -> tuple[str, ...]:
    """--keep-tools' names. Raises ValueError, in one line, for one that no tool can have."""
    names = tuple(t for t in value.split(",") if t)
    for name in names:
        if not _TOOL_NAME.fullmatch(name):
            raise ValueError(f"{name!r} is not a tool name (letters, digits, _ and -, up to 64)")
    return names


def rewrite_config(expand: bool = True, offload_min_tokens: int = _OFFLOAD.min_tokens,
                   keep: Iterable[str] = _OFFLOAD.keep_tools, disabled: Iterable[str] = (),
                   cold: bool = COLD_POLICY[1] == "on") -> RewriteConfig:
    """The rewrite cg runs with these options."""
    off = set(disabled)
    return RewriteConfig(
        compact=CompactConfig(
            components=tuple(c for c in DEFAULT_COMPONENTS if c.name not in off),
            # Its converter, frozenset, makes mypy's attrs plugin type this parameter Iterable[_T_co]
            # with _T_co unbound, which nothing matches (python/mypy#8625).
            keep_tools=frozenset(keep),
            offload_min_tokens=offload_min_tokens,
        ),
        expand=expand,
        cold=ColdPolicy() if cold else None,
    )
