"""Plumbing shared by cg's test modules (no test module imports another; tests/test_kit.py checks it).

What a library user would want is in ``cg.testing`` (the fake provider, its replies, the builders,
the request validators, ``MemoryUpstream``); the fixtures are in tests/conftest.py; what is here
serves only cg's own tests:

- ``helpers.bodies``: request bodies as clients send them (Claude Code histories on
  tests/fixtures/' shapes, tool turns, expand calls, chat messages, other clients' JSON styles).
- ``helpers.replies``: what the fake is scripted to answer in expand-loop tests (Anthropic and
  chat rounds).
- ``helpers.streams``: reading the streams cg sends (events, names, text, a clean splice, the
  SDKs' accumulators); feeding rounds to an Inspector.
- ``helpers.drive``: a running cg over real sockets (POST, raw streams, /stats, /metrics, ``until``).
- ``helpers.clients``: ``Client`` (cg's channel over a StringTransport), ``Body`` (a response
  body collected), ``CG_PORT`` (where conftest's ``cg_in_memory`` listens).
- ``helpers.stores``: a wall clock a test moves, waits on a store, damaged store files, a busy Redis.
- ``helpers.processes``: cg run as ``twistd`` processes: environment, output, exit.
"""
