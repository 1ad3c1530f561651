"""cg-report --store on a real store, run as the process an operator runs (it runs a reactor)."""

import subprocess
import sys

from cg.store import SQLiteDB


def cg_report(*argv):
    result = subprocess.run([sys.executable, "-m", "cg.web.report", *argv], capture_output=True, text=True,
                            timeout=60)
    return result.returncode, result.stdout, result.stderr


def test_a_store_with_nothing_to_report_is_one_line_and_status_1(tmp_path):
    path = tmp_path / "store.sqlite3"
    SQLiteDB.open(str(path)).close()
    code, out, err = cg_report("--store", f"sqlite:{path}")
    assert (code, out) == (1, "")
    assert err == f"cg-report: the ledger of sqlite:{path} holds no request (is it the store cg runs with?)\n"
