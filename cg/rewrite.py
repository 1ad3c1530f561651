"""The request side of cg: one parse of the body, then compact and inject, then one splice.

Pure: bytes in, bytes out. Lossy compaction runs exactly where the expand tool is
injected (the model can ask for the original back); elsewhere only the reformat
components run. Anything unexpected forwards the client's bytes unchanged.
"""

import attrs

from cg import expand
from cg.compact import Change, CompactConfig, Memo, ParsedBody, plan
from cg.dialect import ANTHROPIC, OPENAI, split_path

# Paths whose bodies cg rewrites, and whether what it stashes there matters
# (count_tokens is read-only: it sizes the request cg would send, nothing more).
_PATHS = {
    b"/v1/messages": (ANTHROPIC, True),
    b"/v1/messages/count_tokens": (ANTHROPIC, False),
    b"/v1/chat/completions": (OPENAI, True),
}


@attrs.frozen
class RewriteConfig:
    compact: CompactConfig = attrs.Factory(CompactConfig)
    expand: bool = True


@attrs.frozen
class Rewrite:
    """What to forward. `originals` must be stored before `body` is sent."""

    body: bytes
    originals: dict[str, bytes]
    changes: list[Change]
    injected: bool
    stash: bool
    parsed: dict  # the body as parsed (session keys, later stages)
    runs: dict = attrs.Factory(dict)  # component -> tool results it ran on
    reverted: dict = attrs.Factory(dict)  # component -> rewrites the contract undid


class Rewriter:
    """Rewrites request bodies with a memo shared across requests (a re-sent history is cheap)."""

    def __init__(self, config: RewriteConfig, memo: Memo | None = None):
        self.config = config
        self.memo = memo if memo is not None else Memo()

    def rewrite(self, raw: bytes, uri: bytes, lossy: bool = True) -> Rewrite | None:
        """The rewrite of a request to `uri`, or None where cg leaves the body alone.

        `lossy=False` forbids lossy compaction (the store could not keep an original).
        """
        route = _PATHS.get(split_path(uri))
        if route is None or not raw:
            return None
        dialect, stash = route
        body = ParsedBody.parse(raw)
        if body is None:
            return None
        injection = self._injection(body, dialect)
        compaction = plan(body, dialect, self.config.compact, lossy and injection is not None, self.memo)
        edits = compaction.edits + (injection or [])
        return Rewrite(
            body=body.apply(edits),
            originals=compaction.originals if stash else {},
            changes=compaction.changes,
            injected=injection is not None,
            stash=stash,
            parsed=body.value,
            runs=compaction.runs,
            reverted=compaction.reverted,
        )

    def _injection(self, body: ParsedBody, dialect: str):
        if not self.config.expand:
            return None
        if dialect == OPENAI and body.value.get("stream") is True:
            return None  # no expand interception on OpenAI streams yet: an unknown tool call breaks clients
        return expand.injection(body, dialect)
