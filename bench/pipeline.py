"""The gateway's request path in process: the rewrite alone, warm and cold, per request.

    python bench/pipeline.py [--quick] [--json PATH]

No sockets, no store: bench/gateway.py's conversations (bench/sessions.py's turns in Claude Code's
envelope, histories from 76 to 565 KB, each request the history plus one new turn) go through
``Rewriter.parse`` + ``Rewriter.finish`` with cg's defaults, round robin, as one cg process sees a
team's traffic. What the gateway's "CPU per request" is made of, measured where the shared
machine's noise is smallest (``time.process_time`` of this one thread):

- warm: every conversation's requests after its first two, with the memo at its default size (all
  conversations' last bodies held) and, for comparison, with a memo that holds no body (every turn
  parsed and planned from scratch, its decisions from the decision memo);
- cold: each conversation's next request through a fresh Rewriter (a restart: nothing memoized);
- the baseline, in the same run: ``json.loads`` of the same request bodies (what any proxy that
  reads a body at all pays), and the bodies' ``bytes.decode``.

Reported per request and as ratios to the baseline. The figures move with the machine's load;
compare rows of one run.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time

from gateway import Conversation
from rewrite import bench_main, machine
from sessions import LIMIT, Content, Template

from cg.compaction.pipeline import Memo
from cg.compaction.rewrite import RewriteConfig, Rewriter

URI = b"/v1/messages?beta=true"


def requests(conversations: int, rounds: int) -> list[tuple[str, bytes]]:
    """(session id, body) of `rounds` requests per conversation, round robin, starting spread over
    the range of history sizes as bench/gateway.py starts them."""
    template = Template()
    span = LIMIT - template.bytes
    convs = []
    for index in range(conversations):
        conv = Conversation(index, Content(index), template)
        conv.advance_to(template.bytes + span * index // conversations)
        convs.append(conv)
    out = []
    for _ in range(rounds):
        for conv in convs:
            out.append((conv.session_id(), conv.request(8080).split(b"\r\n\r\n", 1)[1]))
    return out


def cpu_ms(fn, items) -> float:
    """CPU milliseconds per item of fn(item) over items, garbage collected before."""
    gc.collect()
    start = time.process_time()
    for item in items:
        fn(item)
    return (time.process_time() - start) * 1000 / len(items)


def run(quick: bool) -> dict:
    conversations, rounds = (20, 6) if quick else (100, 12)
    sent = requests(conversations, rounds)
    warmup, measured = sent[:2 * conversations], sent[2 * conversations:]
    result: dict = {"machine": machine(), "conversations": conversations, "requests": len(measured),
                    "mean_kb": round(statistics.mean(len(b) for _, b in measured) / 1000, 1)}

    def through(rewriter: Rewriter):
        def one(item):
            conversation, raw = item
            rewriter.finish(rewriter.parse(raw, URI, conversation))
        return one

    for name, memo in (("warm", Memo()), ("warm, no body memo", Memo(max_body_bytes=0))):
        rewriter = Rewriter(RewriteConfig(), memo)
        for item in warmup:
            through(rewriter)(item)
        hits, misses = memo.bodies.hits, memo.bodies.misses
        result[name] = cpu_ms(through(rewriter), measured)
        hits, misses = memo.bodies.hits - hits, memo.bodies.misses - misses
        result[f"{name}: bodies hit rate"] = round(hits / max(1, hits + misses), 3)
    cold = sent[-conversations:]  # each conversation's last request, to a cg that just started
    result["cold"] = cpu_ms(lambda item: through(Rewriter(RewriteConfig()))(item), cold)
    result["json.loads"] = cpu_ms(lambda item: json.loads(item[1]), measured)
    result["bytes.decode"] = cpu_ms(lambda item: item[1].decode(), measured)
    return result


def report(result: dict) -> str:
    base = result["json.loads"]
    m = result["machine"]
    lines = [f"{result['conversations']} conversations, {result['requests']} requests, bodies mean "
             f"{result['mean_kb']} KB; {m['nproc']} cores ({m['cpu']}), Python {m['python']}", "",
             f"{'':38} {'CPU ms/request':>14} {'x json.loads':>12}"]
    for name in ("warm", "warm, no body memo", "cold", "json.loads", "bytes.decode"):
        lines.append(f"{name:38} {result[name]:14.2f} {result[name] / base:12.2f}")
    lines.append(f"bodies hit rate: warm {result['warm: bodies hit rate']}, "
                 f"no body memo {result['warm, no body memo: bodies hit rate']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, __doc__, run, report, "20 conversations, 6 rounds")


if __name__ == "__main__":
    sys.exit(main())
