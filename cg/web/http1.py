"""The upstream leg's HTTP/1.1 wire format is `cg.wire.http1` (pure: it needs no reactor).

This module keeps the name for what cg.web imports from it (`cg.web.proxy` checks
request-targets with `target_problem`).
"""

from cg.wire.http1 import ProtocolError, target_problem

__all__ = ["ProtocolError", "target_problem"]
