"""What one exchange did, written once when it ends: /stats, the change log's usage line and the
request's log line read this, never the exchange itself."""

from __future__ import annotations

import attrs

from cg.stream.inspector import ReleaseReason
from cg.stream.usage import Usage


@attrs.frozen
class Compacted:
    """What compaction did to the request body: estimated tokens of the tool results it changed,
    before and after, and how many markers the forwarded body carries."""

    tokens_before: int
    tokens_after: int
    markers: int


@attrs.frozen
class Inspected:
    """The stream inspector's counters, for a stream it read."""

    spliced: bool  # a continuation was spliced in
    held_events: int
    released: ReleaseReason | None  # why the hold was released, if it was


@attrs.frozen
class ExchangeRecord:
    """One client request, from its arrival to its end. Times come from the exchange's clock
    (seconds, any origin); None where the moment never came."""

    method: str
    target: str  # the request-target, as the client sent it
    dialect: str  # the API the route speaks
    session: str
    seq: int
    status: int | None  # sent to the client; None when it never got a head
    outcome: str  # ok, upstream_error_status, upstream_error, upstream_broke, client_gone, aborted
    t_received: float
    t_sent: float | None  # the request went upstream
    t_headers: float | None  # the upstream's head came
    t_client_first: float | None  # the client's first byte went
    t_ended: float
    added_ttfb: float | None  # cg's own share of the client's time to first byte
    bytes_in: int  # the client's request body
    bytes_out: int  # the client's response body, as cg wrote it
    stream: bool  # the response is an event stream
    expand_rounds: int  # continuations cg ran upstream for this response
    continuation_failed: str | None  # why the expand loop gave up, when it did
    usage: Usage | None  # billed over every round; None when unreadable
    compacted: Compacted | None  # None when compaction changed nothing
    inspected: Inspected | None  # None when the inspector did not read the response
