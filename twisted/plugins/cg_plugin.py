"""twistd plugin: ``twistd -n cg``. Kept import-light; the real work is in cg.web.tap."""

from twisted.application.service import ServiceMaker

cg = ServiceMaker(
    "cg",
    "cg.web.tap",
    "context guru: a streaming proxy that makes coding-agent requests cheaper",
    "cg",
)
