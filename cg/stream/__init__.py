"""The response side, pure: the incremental inspector, expand continuations and splicing, billed usage.

Fed events, returns bytes and decisions; no Twisted, no I/O, no clock. Imports only `cg.wire`.
"""
