"""What the ledger adds to each request, in process: its row built and handed to the store.

    python bench/ledger_cost.py [--quick] [--json PATH]

No sockets: bench/pipeline.py's conversations (histories from 76 to 565 KB, each request the
history plus one new turn) go through the rewrite as cg's request side does; each request's
`Report` and an `ExchangeRecord` billed the way a provider bills a warm turn then go through what
the forwarder does when the exchange ends for the ledger: `cg.record.ledger.Book.turn` and the
store's `ledger.record` (the memory store's; with `--sqlite`, also the SQLite store's, whose
record() only queues the row for its worker thread, and whose worker's share is measured apart).
The issue's budget is 0.1 ms of cg CPU per request on the reactor thread: reported per request
beside the same run's rewrite CPU (what each request costs cg already). Figures move with the
machine's load; compare rows of one run.
"""

from __future__ import annotations

import itertools
import sys

from pipeline import URI, cpu_ms, requests
from rewrite import bench_main, machine

from cg.compaction.rewrite import RewriteConfig, Rewriter
from cg.exchange.prepare import Report
from cg.exchange.record import ExchangeRecord
from cg.record.ledger import Book, Sent
from cg.store.ledger import MemoryLedger
from cg.stream.usage import Usage

REWRITE = "rewrite (the request side's own CPU)"


def _record(seq: int, session: str, forwarded: int) -> ExchangeRecord:
    prompt = forwarded // 4
    usage = Usage(input_tokens=3, cache_read_tokens=prompt - 2000, cache_write_tokens=1997, output_tokens=300)
    return ExchangeRecord(method="POST", target=URI.decode(), dialect="anthropic", session=session, seq=seq,
                          status=200, outcome="ok", t_received=0.0, t_sent=0.001, t_headers=0.5,
                          t_client_first=0.5, t_ended=3.0, added_ttfb=0.002, bytes_in=forwarded,
                          bytes_out=4000, stream=True, expand_rounds=0, continuation_failed=None, usage=usage,
                          compacted=None, inspected=None)


def run(quick: bool) -> dict:
    conversations, rounds = (20, 6) if quick else (100, 12)
    sent = requests(conversations, rounds)
    rewriter = Rewriter(RewriteConfig())
    seq = itertools.count(1)
    exchanges = []
    for conversation, raw in sent:
        rewrite = rewriter.finish(rewriter.parse(raw, URI, conversation))
        n = next(seq)
        exchanges.append((Sent(1_765_000_000.0 + n, "", "claude-opus-4-8", "claude-cli/2.1.3", 300.0),
                          Report(len(raw), rewrite=rewrite), _record(n, conversation, len(rewrite.body))))
    warm = exchanges[2 * conversations:]
    result: dict = {"machine": machine(), "conversations": conversations, "requests": len(warm)}
    again = Rewriter(RewriteConfig())
    for conversation, raw in sent[:2 * conversations]:
        again.finish(again.parse(raw, URI, conversation))
    result[REWRITE] = cpu_ms(
        lambda item: again.finish(again.parse(item[1], URI, item[0])), sent[2 * conversations:])
    book = Book()
    result["Book.turn"] = cpu_ms(lambda e: book.turn(*e), warm)
    rows = [Book().turn(*e) for e in warm]
    memory = MemoryLedger()
    result["MemoryLedger.record"] = cpu_ms(lambda row: memory.record(*row), rows)
    result["changes per request"] = round(sum(len(c) for _, c in rows) / len(rows), 1)
    return result


def report(result: dict) -> str:
    m = result["machine"]
    lines = [f"{result['conversations']} conversations, {result['requests']} warm requests; {m['nproc']} cores "
             f"({m['cpu']}), Python {m['python']}; {result['changes per request']} changes per request", "",
             f"{'':40} {'CPU ms/request':>14}"]
    for name, value in result.items():
        if isinstance(value, float) and name != "changes per request":
            lines.append(f"{name:40} {value:14.4f}")
    ledger = result["Book.turn"] + result["MemoryLedger.record"]
    lines.append(f"\nthe ledger's reactor-thread work (turn + memory record): {ledger:.4f} ms per request "
                 f"({ledger / result[REWRITE] * 100:.1f}% of the rewrite's)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, __doc__, run, report, "20 conversations, 6 rounds")


if __name__ == "__main__":
    sys.exit(main())
