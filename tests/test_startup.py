"""Start-up as a person meets it: the listen backlog."""

from twisted.internet.endpoints import serverFromString
from twisted.internet.protocol import Factory
from twisted.internet.testing import MemoryReactor

from cg.tap import DEFAULT_LISTEN, Options

# --- the listen backlog -----------------------------------------------------------------------


def test_default_listen_has_a_backlog_of_1024():
    """Twisted's default, 50, resets a burst of new connections before any answer."""
    options = Options()
    options.parseOptions([])
    assert options.config().listen == (DEFAULT_LISTEN,)
    memory = MemoryReactor()
    serverFromString(memory, DEFAULT_LISTEN).listen(Factory())
    [(port, _factory, backlog, interface)] = memory.tcpServers
    assert (port, backlog, interface) == (8080, 1024, "127.0.0.1")
    assert "backlog=1024" in str(Options())  # --help says so
