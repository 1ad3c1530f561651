"""The exchange: one client request and its upstream rounds, sans-io (see `cg.exchange.machine`)."""
