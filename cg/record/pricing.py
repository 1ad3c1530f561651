"""What a token costs, and what a provider's prompt cache makes of a request: one module that
``cg-report`` (billed usage from the change log) and ``cg-estimate`` (requests replayed from a
transcript) both price with, so they agree on what a token costs.

Pure: no I/O but reading the prices table (``prices.json``, package data) once.

- ``Tokens``: a request's (or a sum of requests') tokens by how they are billed: uncached input,
  cache reads, cache writes for the 5-minute and the 1-hour lifetime, output.
- ``PriceTable`` / ``Price``: USD per million tokens of each kind, per model; a model not in the
  table is priced by the longest name it starts with, else by its provider's default, and
  ``Price.note`` says so.
- ``PromptCache``: one provider cache, fed a session's requests in order as ``Segment`` lists
  (the prompt in the provider's order: tools, system, messages), with their times. Anthropic
  (``explicit=True``) caches only at ``cache_control`` breakpoints, with a 20-block lookback, a
  minimum cacheable prefix, a 5-minute or 1-hour lifetime refreshed by each hit, and charges
  for writes; OpenAI (``explicit=False``) caches every prefix of 1,024 tokens or more
  automatically, in 128-token steps, for ``ttl`` seconds, and charges nothing to write.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from importlib import resources
from typing import Any

import attrs

from cg.wire.cache import TTL_1H as TTL_1H
from cg.wire.cache import TTL_5M as TTL_5M

ANTHROPIC, OPENAI = "anthropic", "openai"
LOOKBACK_BLOCKS = 20  # Anthropic checks for a hit this many blocks back from each breakpoint
OPENAI_STEP = 128  # OpenAI's cache hits grow in steps of this many tokens


@attrs.frozen
class Tokens:
    """Tokens by how they are billed. ``input`` is uncached input only; the five add up."""

    input: int = 0
    cache_read: int = 0
    cache_write_5m: int = 0
    cache_write_1h: int = 0
    output: int = 0

    def __add__(self, other: Tokens) -> Tokens:
        return Tokens(self.input + other.input, self.cache_read + other.cache_read,
                      self.cache_write_5m + other.cache_write_5m, self.cache_write_1h + other.cache_write_1h,
                      self.output + other.output)

    @property
    def prompt(self) -> int:
        """Every prompt token, however billed."""
        return self.input + self.cache_read + self.cache_write_5m + self.cache_write_1h

    @property
    def cache_write(self) -> int:
        return self.cache_write_5m + self.cache_write_1h

    @classmethod
    def billed(cls, input: int, cache_read: int, cache_write: int, cache_write_1h: int, output: int) -> Tokens:
        """Anthropic's counts: cache writes in all, and of them those written for an hour (at
        most all of them)."""
        hour = max(0, min(cache_write_1h, cache_write))
        return cls(input, cache_read, max(0, cache_write - hour), hour, output)


@attrs.frozen
class Price:
    """USD per million tokens of each kind, for ``model`` as priced by table entry ``key``."""

    model: str
    key: str
    provider: str
    date: str
    input: float
    output: float
    cache_read: float
    cache_write_5m: float
    cache_write_1h: float
    min_cache_tokens: int
    cache_ttl: float  # seconds an unused cache entry lives by default
    note: str | None = None  # how a model not in the table was priced

    def cost(self, tokens: Tokens) -> float:
        """USD for ``tokens`` at these prices."""
        return (tokens.input * self.input + tokens.cache_read * self.cache_read
                + tokens.cache_write_5m * self.cache_write_5m + tokens.cache_write_1h * self.cache_write_1h
                + tokens.output * self.output) / 1e6

    @property
    def explicit_cache(self) -> bool:
        """Anthropic's cache_control breakpoints, rather than OpenAI's automatic prefixes."""
        return self.provider == ANTHROPIC


def _number(entry: dict[str, Any], key: str, default: float | None = None) -> float:
    value = entry.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"prices: {key} must be a non-negative number, not {value!r}")
    return float(value)


class PriceTable:
    """The prices table (``prices.json`` in this package unless another document is given)."""

    def __init__(self, document: dict[str, Any] | None = None):
        if document is None:
            document = json.loads(resources.files("cg.record").joinpath("prices.json").read_text("utf-8"))
        self.providers: dict[str, dict[str, Any]] = dict(document["providers"])
        self.models: dict[str, dict[str, Any]] = dict(document["models"])
        self._cache: dict[tuple[str, str], Price] = {}
        for provider in self.providers.values():
            if provider["default"] not in self.models:
                raise ValueError(f"prices: default {provider['default']!r} is not in the table")

    def sources(self) -> dict[str, str]:
        return {name: str(p.get("source", "")) for name, p in self.providers.items()}

    def price(self, model: str | None, provider: str) -> Price:
        """What ``model`` costs; ``provider`` (anthropic or openai: the API the request went to)
        picks the default for a model the table does not know."""
        name = model or ""
        key = (name, provider)
        if key not in self._cache:
            self._cache[key] = self._price(name, provider)
        return self._cache[key]

    def _price(self, model: str, provider: str) -> Price:
        note = None
        if model in self.models:
            entry_key = model
        else:
            known = [k for k in self.models if model.startswith(k) and self.models[k]["provider"] == provider]
            if known:
                entry_key = max(known, key=len)
                how = "its family's latest" if self.models[entry_key].get("family") else "the longest name it starts with"
                note = f"{model} is not in the prices table: priced as {entry_key} ({how})"
            else:
                entry_key = self.providers[provider]["default"]
                note = f"{model or 'a request without a model'} is not in the prices table: priced as {entry_key}"
        entry = self.models[entry_key]
        entry_provider = str(entry["provider"])
        rules = self.providers[entry_provider]
        inp = _number(entry, "input")
        return Price(
            model=model,
            key=entry_key,
            provider=entry_provider,
            date=str(entry.get("date", "")),
            input=inp,
            output=_number(entry, "output"),
            cache_read=_number(entry, "cache_read"),
            # OpenAI charges nothing to write: a written token costs what uncached input does.
            cache_write_5m=_number(entry, "cache_write_5m", inp),
            cache_write_1h=_number(entry, "cache_write_1h", inp),
            min_cache_tokens=int(_number(entry, "min_cache_tokens", 1024)),
            cache_ttl=_number(rules, "cache_ttl_seconds", TTL_5M),
            note=note,
        )


_TABLE: PriceTable | None = None


def prices() -> PriceTable:
    """The package's prices table, read once."""
    global _TABLE
    if _TABLE is None:
        _TABLE = PriceTable()
    return _TABLE


# ---------------------------------------------------------------------------------------------
# The prompt cache


@attrs.frozen
class Segment:
    """One block of a prompt, in the provider's order: its content's digest, its size, and (for
    Anthropic) the lifetime its ``cache_control`` breakpoint asks for, if it has one."""

    digest: bytes
    tokens: int
    breakpoint: float | None = None  # seconds: TTL_5M or TTL_1H


def digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


@attrs.define
class _Entry:
    expires: float
    ttl: float


class PromptCache:
    """One provider's prompt cache over a sequence of requests (times in seconds, increasing).

    ``bill(now, segments)`` says how the request's prompt is billed (``Tokens`` without output)
    and updates the cache as the provider would. Entries are keyed by the digest of the whole
    prefix up to a block boundary.
    """

    def __init__(self, explicit: bool, min_tokens: int = 1024, ttl: float = TTL_5M):
        self.explicit = explicit
        self.min_tokens = min_tokens
        self.ttl = ttl
        self._entries: dict[bytes, _Entry] = {}

    def _live(self, key: bytes, now: float) -> _Entry | None:
        entry = self._entries.get(key)
        return entry if entry is not None and entry.expires >= now else None

    def bill(self, now: float, segments: Sequence[Segment]) -> Tokens:
        prefixes = [b""]  # prefixes[k]: the digest of segments[:k]
        totals = [0]  # totals[k]: their tokens
        for segment in segments:
            prefixes.append(digest(prefixes[-1], segment.digest))
            totals.append(totals[-1] + segment.tokens)
        return self._explicit(now, segments, prefixes, totals) if self.explicit else self._automatic(now, prefixes, totals)

    def _automatic(self, now: float, prefixes: list[bytes], totals: list[int]) -> Tokens:
        total = totals[-1]
        hit = max((k for k in range(1, len(prefixes)) if self._live(prefixes[k], now)), default=0)
        cached = totals[hit] // OPENAI_STEP * OPENAI_STEP if totals[hit] >= self.min_tokens else 0
        for k in range(1, len(prefixes)):
            if totals[k] >= self.min_tokens:
                self._entries[prefixes[k]] = _Entry(now + self.ttl, self.ttl)
        return Tokens(input=total - cached, cache_read=cached)

    def _explicit(self, now: float, segments: Sequence[Segment], prefixes: list[bytes], totals: list[int]) -> Tokens:
        total = totals[-1]
        # Breakpoints whose prefix is big enough to be cached: (k, ttl), the prefix being segments[:k].
        points = [(i + 1, s.breakpoint) for i, s in enumerate(segments)
                  if s.breakpoint is not None and totals[i + 1] >= self.min_tokens]
        if not points:
            return Tokens(input=total)
        hit = 0
        for k, _ in points:
            for j in range(k, max(0, k - LOOKBACK_BLOCKS) - 1, -1):
                if j > hit and self._live(prefixes[j], now):
                    hit = j
                    break
        last = points[-1][0]
        written_5m = written_1h = 0
        start = hit
        for k, ttl in points:
            if k > start:
                if ttl == TTL_1H:
                    written_1h += totals[k] - totals[start]
                else:
                    written_5m += totals[k] - totals[start]
                start = k
        read = totals[hit]
        if hit:
            entry = self._entries[prefixes[hit]]
            entry.expires = max(entry.expires, now + entry.ttl)  # a hit refreshes the lifetime
        for k, ttl in points:
            lifetime = TTL_1H if ttl == TTL_1H else self.ttl
            live = self._live(prefixes[k], now)
            if live is None:
                self._entries[prefixes[k]] = _Entry(now + lifetime, lifetime)
            else:
                live.expires = max(live.expires, now + lifetime)
        return Tokens(input=total - totals[last], cache_read=read, cache_write_5m=written_5m, cache_write_1h=written_1h)
