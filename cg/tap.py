"""`twistd cg`: the command line, documented by `twistd cg --help`."""

from twisted.python import usage

from cg.config import Config, parse_size
from cg.service import CGService

_DEFAULTS = Config()
DEFAULT_LISTEN = _DEFAULTS.listen[0]


class Options(usage.Options):
    synopsis = "[options]"
    longdesc = (
        "cg (context guru) sits between a coding agent and the Anthropic or OpenAI API. "
        "Point Claude Code at it with ANTHROPIC_BASE_URL=http://127.0.0.1:8080, an OpenAI "
        "client with OPENAI_BASE_URL=http://127.0.0.1:8080/v1. GET /stats shows its counters."
    )

    optParameters = [
        ["anthropic-upstream", None, _DEFAULTS.anthropic_upstream, "Base URL of the Anthropic API."],
        ["openai-upstream", None, _DEFAULTS.openai_upstream, "Base URL of the OpenAI API."],
        ["max-body", None, "64MiB", "Largest request body accepted; larger ones get a 413.", parse_size],
        [
            "upstream-ca",
            None,
            None,
            "PEM bundle of the CA(s) to trust for HTTPS upstreams instead of the system's "
            "(a corporate gateway's private CA).",
        ],
        ["connect-timeout", None, _DEFAULTS.connect_timeout, "Seconds to connect upstream.", float],
        [
            "header-timeout",
            None,
            _DEFAULTS.header_timeout,
            "Seconds to wait for the upstream's response headers (long non-streaming "
            "generations need minutes); a live stream has no read timeout.",
            float,
        ],
        [
            "idle-timeout",
            None,
            _DEFAULTS.idle_timeout,
            "Seconds an idle pooled upstream connection is kept open.",
            float,
        ],
        [
            "drain-timeout",
            None,
            _DEFAULTS.drain_timeout,
            "On SIGTERM, seconds to let in-flight responses finish before cutting them.",
            float,
        ],
    ]

    def __init__(self):
        super().__init__()
        self["listen"] = []

    def opt_listen(self, description):
        """Endpoint to listen on (strports description); repeatable. [default: tcp:8080:interface=127.0.0.1] Under systemd socket activation: systemd:domain=INET:index=0"""
        self["listen"].append(description)

    def postOptions(self):
        if not self["listen"]:
            self["listen"] = [DEFAULT_LISTEN]

    def config(self) -> Config:
        return Config(
            listen=tuple(self["listen"]),
            anthropic_upstream=self["anthropic-upstream"],
            openai_upstream=self["openai-upstream"],
            max_body=parse_size(self["max-body"]),
            upstream_ca=self["upstream-ca"],
            connect_timeout=self["connect-timeout"],
            header_timeout=self["header-timeout"],
            idle_timeout=self["idle-timeout"],
            drain_timeout=self["drain-timeout"],
        )


def makeService(options: Options) -> CGService:
    return CGService(options.config())
