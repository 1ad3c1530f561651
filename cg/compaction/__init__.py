"""The request side, pure: one parse of a body, then repair, compact and inject, then one splice.

Bytes in, bytes out; no Twisted, no I/O. Imports `cg.wire` and, for the expand answers that repair
replays, `cg.stream`.
"""
