"""cg, context guru: a streaming proxy that makes coding-agent requests cheaper."""

__version__ = "0.1.0.dev0"
