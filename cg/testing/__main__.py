"""``python -m cg.testing``: the fake provider on a port, for benchmarks and trying cg offline."""

from cg.testing import main

main()
