"""Counters behind `GET /stats`. Fields are only ever added, never renamed or removed."""

import time
from collections import Counter, deque

import attrs


@attrs.define
class LatencyWindow:
    """The most recent samples of a latency, for percentiles without unbounded memory."""

    samples: deque = attrs.field(factory=lambda: deque(maxlen=4096))
    count: int = 0

    def add(self, seconds: float) -> None:
        self.samples.append(seconds)
        self.count += 1

    def summary(self) -> dict:
        ordered = sorted(self.samples)
        if not ordered:
            return {"count": 0, "p50_ms": None, "p99_ms": None, "avg_ms": None, "max_ms": None}

        def pct(p: float) -> float:
            return round(ordered[min(len(ordered) - 1, int(p * len(ordered)))] * 1000, 3)

        return {
            "count": self.count,
            "p50_ms": pct(0.50),
            "p99_ms": pct(0.99),
            "avg_ms": round(sum(ordered) / len(ordered) * 1000, 3),
            "max_ms": round(ordered[-1] * 1000, 3),
        }


@attrs.define
class Stats:
    """Process-wide counters; the proxy updates them, /stats reads them."""

    started: float = attrs.field(factory=time.time)
    requests: Counter = attrs.field(factory=Counter)
    statuses: Counter = attrs.field(factory=Counter)
    in_flight: int = 0
    streamed: int = 0
    upstream_errors: int = 0
    upstream_retries: int = 0
    client_disconnects: int = 0
    too_large: int = 0
    bytes_from_client: int = 0
    bytes_to_upstream: int = 0
    bytes_from_upstream: int = 0
    bytes_to_client: int = 0
    added_ttfb: LatencyWindow = attrs.field(factory=LatencyWindow)
    upstream_ttfb: LatencyWindow = attrs.field(factory=LatencyWindow)

    def snapshot(self) -> dict:
        return {
            "uptime_s": round(time.time() - self.started, 3),
            "requests": sum(self.requests.values()),
            "requests_by_dialect": dict(self.requests),
            "responses_by_status": {str(k): v for k, v in sorted(self.statuses.items())},
            "in_flight": self.in_flight,
            "streamed": self.streamed,
            "upstream_errors": self.upstream_errors,
            "upstream_retries": self.upstream_retries,
            "client_disconnects": self.client_disconnects,
            "too_large": self.too_large,
            "bytes_in": self.bytes_from_client,
            "bytes_out": self.bytes_to_client,
            "bytes_to_upstream": self.bytes_to_upstream,
            "bytes_from_upstream": self.bytes_from_upstream,
            "added_ttfb": self.added_ttfb.summary(),
            "upstream_ttfb": self.upstream_ttfb.summary(),
        }
