"""Each exchange's ledger rows (`cg.exchange.ledger`): a `Turn` and its `Change`s, from what the
request side reported (`cg.exchange.prepare.Report`) and what the exchange recorded
(`cg.exchange.record.ExchangeRecord`), priced at list price (`cg.record.pricing`).

Two figures are estimates, and say so where they are shown:

- **Whole-request tokens.** After: the prompt tokens the provider billed (every round of the
  response). Before: those plus what compaction removed (cg's estimate, result by result) less the
  expand tool cg declared. Nothing here re-reads a body: a turn costs O(its changes).
- **Cost without cg** (`cost_direct`): the measured bill, with each token cg removed billed the way
  the provider's cache rules (the ones `cg.record.pricing.PromptCache` models for cg-estimate) would
  have billed it had it been sent: a result sent for the first time in this conversation is written
  to the cache when the turn wrote anything (else it is uncached input); one sent before is read
  when the turn read anything (else written, else input); the expand tool's tokens come off the
  same way. Re-simulating the whole prompt, as cg-estimate does offline, costs O(prompt) per
  request: milliseconds on a long conversation, against a budget of 0.1 ms.
"""

from __future__ import annotations

from collections import OrderedDict

import attrs

from cg.compaction.expand import tool_tokens
from cg.compaction.pipeline import Change as Compaction
from cg.compaction.pipeline import result_sizes
from cg.exchange import ledger
from cg.exchange.keepalive import MESSAGES_PATH
from cg.exchange.prepare import Report
from cg.exchange.record import ExchangeRecord
from cg.exchange.verdict import judge
from cg.record.pricing import PriceTable, Tokens, prices
from cg.stream.usage import Usage
from cg.wire.dialect import SHAPES

# Conversations whose sent results are remembered (least recently used first out); one beyond
# that counts its results as new, which prices a result sent before as a write, not a read (the
# estimate without cg comes out higher for that turn).
MAX_CONVERSATIONS = 512
# Results remembered per conversation; past it, the conversation's are cleared at once (its next
# turns price them as new, as above). Bounds the memory: at most ~1 M content ids in all.
MAX_RESULTS = 2000


def client_of(user_agent: str | None) -> str:
    """Which of `cg.exchange.ledger.CLIENTS` sent a request, by its user-agent."""
    agent = (user_agent or "").lower()
    if agent.startswith("claude-cli/") or "claude-code" in agent:
        return "claude-code"
    if agent.startswith(("codex_", "codex/", "codex-")):
        return "codex"
    if agent.startswith(("anthropic/", "openai/")):  # the official SDKs: Anthropic/Python 0.x, OpenAI/JS 4.x …
        return "sdk"
    return "other"


@attrs.frozen
class Sent:
    """What the ledger needs of the client's request, beyond the report and the record."""

    time: float  # Unix time it arrived
    tenant: str
    model: str | None
    user_agent: str | None
    lifetime: float | None = None  # the prompt cache's, as the request asked (None: not known)


class Book:
    """Builds ledger rows. Keeps, per conversation, which results it has sent (bounded), so that a
    result's removed tokens are priced as the first send's write or a later send's read."""

    def __init__(self, table: PriceTable | None = None):
        self._table = table or prices()
        self._sent: OrderedDict[tuple[str, str], set[str]] = OrderedDict()

    def turn(self, sent: Sent, report: Report, record: ExchangeRecord) -> tuple[ledger.Turn, list[ledger.Change]]:
        rewrite = report.rewrite
        compactions = rewrite.changes if rewrite is not None else []
        removed_new, removed_old = self._removed(sent.tenant, record.session, compactions)
        injected = tool_tokens(SHAPES[record.dialect]) if rewrite is not None and rewrite.injected else 0
        billed = record.usage
        route = SHAPES[record.dialect].route
        results_before, results_after = result_sizes(compactions)
        tokens_after = billed.prompt_tokens if billed is not None else 0
        direct = None if billed is None else _direct(billed, removed_new, removed_old, injected)
        verdict, detail = judge(report.cache, billed)
        turn = ledger.Turn(
            time=sent.time,
            seq=record.seq,
            tenant=sent.tenant,
            conversation=record.session,
            client=client_of(sent.user_agent),
            model=sent.model,
            dialect=record.dialect,
            path=record.target.split("?", 1)[0],
            status=record.status,
            outcome=record.outcome,
            tokens_before=0 if direct is None else direct.prompt,
            tokens_after=tokens_after,
            results_before=results_before,
            results_after=results_after,
            billed=billed,
            cost_via_cg=None if billed is None else self.cost(sent.model, route, billed),
            cost_direct=None if direct is None else self._table.price(sent.model, route).cost(direct),
            expand_rounds=record.expand_rounds,
            repairs=rewrite.repaired if rewrite is not None else 0,
            epoch=report.cold.applied > 0,
            verdict=verdict,
            verdict_detail=detail,
            added_ms=None if record.added_ttfb is None else record.added_ttfb * 1000.0,
            cache_until=None if billed is None or sent.lifetime is None else sent.time + sent.lifetime,
        )
        changes = [ledger.Change(record.seq, c.message_index, c.block_index, c.tool_name, c.component, c.lossy,
                                 c.marker_id, c.tokens_before, c.tokens_after, content_id=c.content_id,
                                 part=c.part_index, step=c.step) for c in compactions]
        return turn, changes

    def ping(self, sent: Sent, conversation: str, seq: int, usage: Usage) -> ledger.Turn:
        """A keep-alive ping's row (``sent``: its conversation's last request, at the ping's time):
        what it was billed, at list price; no direct cost, as without cg there is no ping."""
        return ledger.Turn(
            time=sent.time, seq=seq, tenant=sent.tenant, conversation=conversation, client=client_of(sent.user_agent),
            model=sent.model, dialect="anthropic", path=MESSAGES_PATH, status=200, outcome="ok", tokens_before=0,
            tokens_after=usage.prompt_tokens, results_before=0, results_after=0, billed=usage,
            cost_via_cg=self.cost(sent.model, "anthropic", usage), cost_direct=None,
            cache_until=None if sent.lifetime is None else sent.time + sent.lifetime, kind=ledger.PING)

    def cost(self, model: str | None, route: str, usage: Usage) -> float:
        """`usage` at `model`'s list price (`route`: the API it was billed on, for an unknown model)."""
        return self._table.price(model, route).cost(_tokens(usage))

    def _removed(self, tenant: str, conversation: str, compactions: list[Compaction]) -> tuple[int, int]:
        """Tokens compaction removed from results sent for the first time, and from those sent before."""
        if not compactions:
            return 0, 0
        key = (tenant, conversation)
        seen = self._sent.pop(key, None)
        if seen is None or conversation == "-":
            seen = set()
        new = old = 0
        for change in compactions:
            removed = change.tokens_before - change.tokens_after
            if change.content_id in seen:
                old += removed
            else:
                new += removed
        if len(seen) > MAX_RESULTS:
            seen.clear()
        seen.update(c.content_id for c in compactions)
        if conversation != "-":
            self._sent[key] = seen
            while len(self._sent) > MAX_CONVERSATIONS:
                self._sent.popitem(last=False)
        return new, old


def _tokens(usage: Usage) -> Tokens:
    return Tokens.billed(usage.input_tokens, usage.cache_read_tokens, usage.cache_write_tokens,
                         usage.cache_write_1h_tokens, usage.output_tokens)


def _direct(billed: Usage, removed_new: int, removed_old: int, injected: int) -> Tokens:
    """The bill had the client's request gone up as sent (see the module docstring)."""
    tokens = _tokens(billed)
    read, write_5m, write_1h, uncached = tokens.cache_read, tokens.cache_write_5m, tokens.cache_write_1h, tokens.input
    wrote, hour = write_5m + write_1h > 0, write_1h > write_5m

    def add(n: int, kinds: str) -> None:
        """`n` tokens more (or fewer, when negative) of the first of `kinds` this turn billed any of."""
        nonlocal read, write_5m, write_1h, uncached
        for kind in kinds:
            if kind == "r" and tokens.cache_read > 0:
                read = max(0, read + n)
                return
            if kind == "w" and wrote:
                if hour:
                    write_1h = max(0, write_1h + n)
                else:
                    write_5m = max(0, write_5m + n)
                return
        uncached = max(0, uncached + n)

    add(removed_new, "w")
    add(removed_old, "rw")
    if tokens.prompt > injected:  # else the provider counted less than cg's estimate of its own tool: leave it
        add(-injected, "rw")
    return Tokens(uncached, read, write_5m, write_1h, tokens.output)
