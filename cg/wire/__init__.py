"""The wire layer: the bytes clients and providers exchange, parsed and edited without a reactor.

JSON with spans (`jsonbytes`), server-sent events (`sse`), cg's markers, which provider a
request speaks (`dialect`), and HTTP/1.1 on the upstream leg (`http1`: request heads, and a
response parser turning a connection's bytes into events). Imports nothing from cg's other layers and nothing from Twisted.
"""
