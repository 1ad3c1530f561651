"""The wire layer: the bytes clients and providers exchange, parsed and edited without a reactor.

JSON with spans (`jsonbytes`), server-sent events (`sse`), cg's markers, and which provider a
request speaks (`dialect`). Imports nothing from cg's other layers and nothing from Twisted.
"""
