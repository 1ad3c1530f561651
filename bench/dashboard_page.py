"""The dashboard page with a big ledger: how long from navigation until a person can read it
(issue 23 §7: interactive in ≤ 1 s with 1 M requests in the ledger), in Debian's headless chromium.

Runs cg in this process on a memory store (`--store memory`, the default: the in-memory reference
ledger, `cg.store.ledger.MemoryLedger`) or on a SQLite file (`--store sqlite`: the ledger's
tables written in batches before cg opens it) and fills its ledger with `--turns` requests (default 1 M) spread
over 30 days up to now: 2,000 conversations (20 at a time), 3 clients, 3 models, one change in
three turns. Then opens the page `--runs` times (a fresh navigation each) and measures, in the
page's own clock (`performance.now()`, from the navigation's start):

- overview: until the overview's figures are filled (its four summaries answered and rendered);
- conversations: until the first page of conversations is rendered;
- conversation: until the newest conversation's turns are rendered;

and each /cg/api/ call's time as the browser saw it (Resource Timing). Prints medians and maxima.

    python bench/dashboard_page.py              # 1 M turns (the fill takes a few minutes)
    python bench/dashboard_page.py --quick      # 50,000 turns
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from selenium import webdriver  # noqa: E402
from twisted.internet import reactor  # noqa: E402
from twisted.internet.threads import deferToThread  # noqa: E402
from twisted.python.failure import Failure  # noqa: E402

from cg.exchange.ledger import DEFAULT_MAX_TURNS, Change, Turn  # noqa: E402
from cg.store import SQLiteDB  # noqa: E402
from cg.stream.usage import Usage  # noqa: E402
from cg.web.config import Config  # noqa: E402
from cg.web.service import CGService  # noqa: E402

DAYS = 30
CONVERSATIONS = 2000
AT_ONCE = 20
CLIENTS = ("claude-code", "codex", "sdk")
MODELS = ("claude-sonnet-4-5", "claude-opus-4-8", "gpt-5.5")

# Resolves with performance.now() once `selector` matches an element with text in it.
WHEN_SHOWN = """
const [selector, done] = arguments;
(function check() {
  const found = document.querySelector(selector);
  if (found && found.textContent.trim()) done(performance.now()); else setTimeout(check, 2);
})();
"""
API_TIMES = """return performance.getEntriesByType("resource").filter((e) => e.name.includes("/cg/api/"))
  .map((e) => [new URL(e.name).pathname + new URL(e.name).search, e.duration]);"""


def turns(count: int, now: float):
    """(Turn, changes): `count` turns over DAYS days up to `now`, AT_ONCE conversations at a time."""
    step = DAYS * 86400.0 / count
    per = max(1, count // CONVERSATIONS)
    for k in range(count):
        conversation = f"conv-{(k // (per * AT_ONCE)) * AT_ONCE + k % AT_ONCE:05d}"
        before = 20_000 + (k * 7919) % 180_000
        after = before - (k * 104_729) % (before // 2)
        changes = [Change(k, 3, 0, "Bash", "offload", True, f"{k:016x}", 4000, 600)] if k % 3 == 0 else []
        yield Turn(
            time=now - DAYS * 86400.0 + k * step, seq=k, tenant="", conversation=conversation,
            client=CLIENTS[k % 3], model=MODELS[(k // 3) % 3], dialect="anthropic", path="/v1/messages",
            status=200, outcome="ok", tokens_before=before, tokens_after=after,
            results_before=before // 2, results_after=after // 4,
            billed=Usage(30, after - 2000, 2000, 500), cost_via_cg=after * 3e-7, cost_direct=before * 3.5e-7,
            cache_until=now - DAYS * 86400.0 + k * step + 300), changes


def fill_sqlite(path: str, count: int, now: float) -> None:
    """The turns written straight into a SQLite store's ledger tables, in batches (as its worker
    thread writes what `record()` gathers), before cg opens the file."""
    db = SQLiteDB.open(path)
    batch: list[tuple[Turn, list[Change]]] = []
    for pair in turns(count, now):
        batch.append(pair)
        if len(batch) == 2000:
            db.ledger.write(batch, DEFAULT_MAX_TURNS)
            batch = []
    db.ledger.write(batch, DEFAULT_MAX_TURNS)
    db.close()


def measure(url: str, runs: int) -> dict[str, list[float]]:
    """On a thread: the page's times, `runs` navigations each."""
    options = webdriver.ChromeOptions()
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(argument)
    options.binary_location = shutil.which("chromium") or "chromium"
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(shutil.which("chromedriver")))
    driver.set_script_timeout(60)
    times: dict[str, list[float]] = {}
    try:
        for run in range(runs + 1):  # the first warms the browser's own caches up, and is not counted
            for view, fragment, selector in (
                ("overview", "#/overview", "#overview-figures tbody tr td:nth-child(4)"),
                ("conversations", "#/conversations", "#conversations tbody td[data-column='id']"),
                ("conversation", "#/conversation/conv-01999", "article.turn"),
            ):
                driver.get("about:blank")
                driver.get(f"{url}/cg/{fragment}")
                shown = driver.execute_async_script(WHEN_SHOWN, selector)
                if run:
                    times.setdefault(view, []).append(shown)
                    for path, duration in driver.execute_script(API_TIMES):
                        times.setdefault(f"  {path.split('?')[0]}", []).append(duration)
    finally:
        driver.quit()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="50,000 turns, 3 runs")
    parser.add_argument("--store", choices=("memory", "sqlite"), default="memory",
                        help="the in-memory reference ledger, or a SQLite store's (a file in a temporary folder)")
    args = parser.parse_args()
    if args.quick:
        args.turns, args.runs = 50_000, 3
    if shutil.which("chromedriver") is None:
        sys.exit("dashboard_page.py needs Debian's chromium and chromium-driver")

    folder = tempfile.mkdtemp(prefix="cg-dashboard-bench-")
    started, now = time.perf_counter(), time.time()
    store = "memory:"
    if args.store == "sqlite":
        store = f"sqlite:{os.path.join(folder, 'store.sqlite3')}"
        fill_sqlite(store[len("sqlite:"):], args.turns, now)
    service = CGService(Config(listen=("tcp:0:interface=127.0.0.1",), store=store), reactor)
    service.privilegedStartService()
    service.startService()
    if args.store == "memory":
        for turn, changes in turns(args.turns, now):
            service.store.ledger.record(turn, changes)
    print(f"ledger: {args.turns:,} turns recorded in {time.perf_counter() - started:.0f} s ({args.store} ledger)")
    url = f"http://127.0.0.1:{service.ports[0].getHost().port}"

    def report(times: dict[str, list[float]]) -> None:
        print(f"{'ms from navigation (page) / per call (API)':<44} {'median':>8} {'max':>8}")
        for name, samples in times.items():
            print(f"{name:<44} {statistics.median(samples):8.0f} {max(samples):8.0f}")
        overview = statistics.median(times["overview"])
        print(f"verdict: overview interactive in {overview:.0f} ms: {'≤' if overview <= 1000 else '>'} 1 s")

    def done(result: object) -> None:
        if isinstance(result, Failure):
            result.printTraceback()
        service.stopService().addBoth(lambda _: reactor.stop())
        shutil.rmtree(folder, ignore_errors=True)

    deferToThread(measure, url, args.runs).addCallback(report).addBoth(done)
    reactor.run()


if __name__ == "__main__":
    main()
