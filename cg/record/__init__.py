"""What cg did, for people: the counters behind /stats, the change log, and cg-report."""
