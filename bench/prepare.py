"""The request side's preparation in process, per request, against another commit's in the same run.

    python bench/prepare.py [--quick] [--against REV] [--json PATH]

No sockets: bench/gateway.py's conversations (as bench/pipeline.py builds them: Claude Code's
envelope, histories from 76 to 565 KB, each request the history plus one new turn, round robin)
go through ``cg.exchange.prepare.Preparation`` with cg's defaults (the cache-aware policy on), its
store commands answered at once from dicts, as a store that answers from memory would. That is
the request side's whole CPU: parse, the cache-aware policy's bookkeeping, the rewrite, and the
facts the cache verdict needs (``Report.cache``). Measured with ``time.process_time`` of this one
thread over every conversation's requests after its first two (warm).

``--against REV`` (default: the parent of HEAD) measures that commit's preparation too, from a
temporary ``git worktree`` of it: each side runs in a child process of its own, alternately
(``--rounds`` times each, default 5), so the machine's drift hits both alike; the report gives
each side's median and minimum (the least disturbed run, on a shared machine) and their ratios.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
URI = b"/v1/messages?beta=true"
ROUNDS = 5  # child processes per side, alternated


def measure(quick: bool) -> float:
    """CPU milliseconds per warm request of the preparation of whichever cg `import cg` finds."""
    import gc

    from pipeline import requests

    from cg.compaction import cold
    from cg.compaction.options import rewrite_config
    from cg.compaction.rewrite import Rewriter
    from cg.exchange import prepare

    conversations, rounds = (20, 6) if quick else (50, 10)
    sent = requests(conversations, rounds)
    rewriter, known = Rewriter(rewrite_config(cold=True)), cold.Known()
    expiry: dict[str, float] = {}
    frozen: dict[str, bytes] = {}
    held: set[str] = set()

    class Index:
        healthy = True

        def known(self, tenant: str, ids: object) -> set[str]:
            return {i for i in ids if i in held}  # type: ignore[attr-defined]

    def answer(command: object) -> object:
        if isinstance(command, prepare.RecordCache):
            before = expiry.get(command.key)
            expiry[command.key] = max(before or 0.0, command.until)
            return before
        if isinstance(command, prepare.ReadFrozen):
            return frozen.get(command.key)
        if isinstance(command, prepare.Freeze):
            return frozen.setdefault(command.key, command.text)
        if isinstance(command, prepare.PutOriginals):
            held.update(command.originals)
            return set(command.originals)
        return None

    now = [1_700_000_000.0]

    def one(item: tuple[str, bytes]) -> None:
        conversation, raw = item
        now[0] += 2.0
        request = prepare.Request(raw, URI, 1, "", conversation.encode(), {"x-claude-code-session-id": conversation}.get)
        machine = prepare.Preparation(request, rewriter=rewriter, known=known, index=Index(), now=now[0])
        pending = machine.start()
        while pending:
            command = pending.pop(0)
            if isinstance(command, prepare.Ready):
                return
            if not isinstance(command, prepare.Touch):
                pending += machine.feed(prepare.Answered(command, answer(command)))

    warmup, measured = sent[:2 * conversations], sent[2 * conversations:]
    for item in warmup:
        one(item)
    gc.collect()
    start = time.process_time()
    for item in measured:
        one(item)
    return (time.process_time() - start) * 1000 / len(measured)


def child(tree: Path, quick: bool) -> float:
    """`measure` in a fresh interpreter importing cg from `tree`."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(REPO / "bench")]))
    out = subprocess.run([sys.executable, __file__, "--child", *(["--quick"] if quick else [])], env=env,
                         check=True, capture_output=True, text=True).stdout
    return float(out.split()[-1])


def run(quick: bool, against: str, rounds: int = ROUNDS) -> dict:
    revision = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", against], check=True,
                              capture_output=True, text=True).stdout.strip()
    result: dict = {"against": revision, "this": [], "that": []}
    with tempfile.TemporaryDirectory() as scratch:
        other = Path(scratch) / "tree"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "--quiet", str(other), revision],
                       check=True)
        try:
            for _ in range(rounds):
                result["that"].append(child(other, quick))
                result["this"].append(child(REPO, quick))
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(other)], check=True)
    for side in ("this", "that"):
        result[f"{side}_median"] = statistics.median(result[side])
        result[f"{side}_min"] = min(result[side])
    result["ratio"] = result["this_median"] / result["that_median"]
    result["ratio_min"] = result["this_min"] / result["that_min"]
    return result


def report(result: dict) -> str:
    def row(name: str, side: str) -> str:
        samples = ", ".join(f"{s:.3f}" for s in result[side])
        return f"{name:28} {result[f'{side}_median']:8.3f} {result[f'{side}_min']:8.3f}   ({samples})"

    return "\n".join([
        f"{'preparation, warm: CPU ms/request':34} {'median':>8} {'min':>8}   (each run)",
        row("this checkout", "this"),
        row(f"at {result['against']}", "that"),
        f"ratio {result['ratio']:.3f} (median), {result['ratio_min']:.3f} (min); added "
        f"{result['this_median'] - result['that_median']:+.3f} / {result['this_min'] - result['that_min']:+.3f} ms/request",
    ])


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="20 conversations, 6 rounds")
    parser.add_argument("--against", default="HEAD~1", help="the commit to compare with [default: HEAD~1]")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"runs per side [default: {ROUNDS}]")
    parser.add_argument("--json", metavar="PATH", help="write every figure to PATH")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(f"{measure(args.quick):.6f}")
        return 0
    result = run(args.quick, args.against, args.rounds)
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
