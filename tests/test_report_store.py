"""cg-report --store on real stores (SQLite, and a real redis-server), run as the process an
operator runs: it opens the store, runs a reactor until the ledger is read, and exits."""

import json
import subprocess
import sys

import pytest
import pytest_twisted
from twisted.internet.threads import deferToThread

from cg.exchange.ledger import Change, Turn
from cg.store import RedisStore, SQLiteDB, SQLiteStore
from cg.stream.usage import Usage

T0 = 1_700_000_000.0


def cg_report(*argv):
    result = subprocess.run([sys.executable, "-m", "cg.web.report", *argv], capture_output=True, text=True,
                            timeout=60)
    return result.returncode, result.stdout, result.stderr


def turn(at, seq, conversation, tenant=""):
    return Turn(time=at, seq=seq, tenant=tenant, conversation=conversation, client="claude-code",
                model="claude-sonnet-4-5", dialect="anthropic", path="/v1/messages", status=200, outcome="ok",
                tokens_before=12_000, tokens_after=3_000, results_before=10_000, results_after=1_000,
                billed=Usage(10, 2_000, 1_000, 50), cost_via_cg=0.01, cost_direct=0.03)


# The same offloaded result sent on two turns of one conversation (counted twice cumulative, once
# unique), and a request of another tenant with no conversation and no compaction.
OFFLOAD = Change(1, 1, 0, "Bash", "offload", True, "0123456789abcdef", 10_000, 1_000,
                 content_id="0123456789abcdef", step=0)
ROWS = [(turn(T0, 1, "s1"), [OFFLOAD]), (turn(T0 + 30, 2, "s1"), [OFFLOAD]), (turn(T0 + 60, 3, "-", "b"), [])]


@pytest.fixture(params=["sqlite", "redis"])
def store_url(request, tmp_path):
    if request.param == "redis":
        server = request.getfixturevalue("redis_server")
        return server.url, lambda: RedisStore(server.url)
    path = tmp_path / "store.sqlite3"
    return f"sqlite:{path}", lambda: SQLiteStore(str(path))


@pytest_twisted.ensureDeferred
async def test_the_report_of_a_stores_ledger(store_url):
    url, open_store = store_url
    store = open_store()
    for row in ROWS:
        store.ledger.record(*row)
    await store.close()
    code, out, err = await deferToThread(cg_report, "--store", url, "--json")
    assert (code, err) == (0, "")
    summary = json.loads(out)
    assert (summary["store"], summary["rows"], summary["rows_counted"]) == (url, 3, 3)
    assert (summary["requests"], summary["sessions"], summary["compactions"]) == (3, 2, 2)
    assert (summary["cumulative_deleted_tokens"], summary["unique_deleted_tokens"]) == (18_000, 9_000)
    assert summary["usage"]["cache_read_tokens"] == 6_000 and summary["cost"]["usd"] > 0
    code, out, err = await deferToThread(cg_report, "--store", url)
    assert (code, err) == (0, "")
    assert out.startswith(f"{url}: the ledger's 3 request(s) from 2023-11-14 22:13 UTC to 2023-11-14 22:14 UTC\n")


def test_a_store_with_nothing_to_report_is_one_line_and_status_1(tmp_path):
    path = tmp_path / "store.sqlite3"
    SQLiteDB.open(str(path)).close()
    code, out, err = cg_report("--store", f"sqlite:{path}")
    assert (code, out) == (1, "")
    assert err == f"cg-report: the ledger of sqlite:{path} holds no request (is it the store cg runs with?)\n"


def test_a_redis_that_does_not_answer_is_one_line_and_status_1():
    code, out, err = cg_report("--store", "redis://127.0.0.1:1/0")
    assert (code, out) == (1, "") and err.startswith("cg-report: redis://127.0.0.1:1/0: ") and err.count("\n") == 1, err
