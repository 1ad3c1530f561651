"""The Twisted edge: the client leg (site, proxy resource), the upstream leg (HTTP/1.1 client),
the service and the `twistd cg` command line. The only layer that listens, connects or times."""
