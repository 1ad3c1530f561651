"""cg-estimate's and cg-report's progress bars: on a real pseudo-terminal they show; piped, or
with --json, nothing but the report."""

import fcntl
import io
import os
import pty
import struct
import termios
from pathlib import Path

import ujson

from cg.exchange.ledger import Turn
from cg.record import estimate
from cg.record.changelog import usage_record
from cg.store.ledger import MemoryLedger
from cg.web import report

HOME = Path(__file__).parent / "fixtures" / "transcripts" / "home"
END = "<end of what the command wrote>"


def on_terminal(run):
    """(exit status, stdout, what reached the terminal) of `run(stdout, stderr)` with its stderr a
    pseudo-terminal 120 columns wide, as a person's shell gives it."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    stdout = io.StringIO()
    with os.fdopen(slave, "w") as terminal:
        code = run(stdout, terminal)
        terminal.write(END)
        terminal.flush()
        seen = b""
        while END.encode() not in seen:
            seen += os.read(master, 65536)
    os.close(master)
    return code, stdout.getvalue(), seen.decode().removesuffix(END)


def piped(run):
    stdout, stderr = io.StringIO(), io.StringIO()
    return run(stdout, stderr), stdout.getvalue(), stderr.getvalue()


def change_logs(tmp_path, count):
    paths = []
    for n in range(count):
        path = tmp_path / f"changes.{n}.jsonl"
        record = usage_record(time=1_700_000_000.0 + n, session="s", seq=n, dialect="anthropic", path="/v1/messages",
                              input_tokens=10, cache_read_tokens=1000, cache_write_tokens=0, output_tokens=5)
        path.write_text(ujson.dumps(record) + "\n")
        paths.append(str(path))
    return paths


def test_cg_estimate_shows_a_bar_on_a_terminal_only():
    code, out, terminal = on_terminal(lambda out, err: estimate.main([str(HOME)], out, err))
    assert code == 0 and out.splitlines()[0].startswith("client")
    assert "0/2 [" in terminal and "transcript/s]" in terminal  # two transcripts to read
    assert terminal.endswith("\r")  # and erased when done: the report is what stays
    code, out, terminal = on_terminal(lambda out, err: estimate.main([str(HOME), "--json"], out, err))
    assert code == 0 and ujson.loads(out)["total"]["sessions"] == 2 and terminal == ""
    code, out, err = piped(lambda out, err: estimate.main([str(HOME)], out, err))
    assert code == 0 and out.startswith("client") and err == ""


def test_cg_report_shows_a_bar_on_a_terminal_only(tmp_path):
    paths = change_logs(tmp_path, 3)
    code, out, terminal = on_terminal(lambda out, err: report.main(paths, out, err))
    assert code == 0 and out.startswith("3 file(s), 3 lines")
    assert "0/3 [" in terminal and "file/s]" in terminal and terminal.endswith("\r")
    code, out, terminal = on_terminal(lambda out, err: report.main([*paths, "--json"], out, err))
    assert code == 0 and ujson.loads(out)["files"] == 3 and terminal == ""
    code, out, err = piped(lambda out, err: report.main(paths, out, err))
    assert code == 0 and out.startswith("3 file(s)") and err == ""


def test_reading_a_ledger_shows_a_bar_on_a_terminal_only():
    ledger = MemoryLedger()

    def tallied(quiet):
        def run(out, err):
            result = []
            report.tally_ledger(ledger, "sqlite:x", err, quiet).addCallback(result.append)
            return result[0].rows

        return run

    for n in range(4):
        ledger.record(Turn(time=1_700_000_000.0 + n, seq=n, tenant="", conversation="c", client="sdk", model=None,
                           dialect="anthropic", path="/v1/messages", status=200, outcome="ok", tokens_before=0,
                           tokens_after=0, results_before=0, results_after=0, billed=None, cost_via_cg=None,
                           cost_direct=None), [])
    rows, _, terminal = on_terminal(tallied(quiet=False))
    assert rows == 4 and "0/4 [" in terminal and "request/s]" in terminal
    rows, _, terminal = on_terminal(tallied(quiet=True))
    assert rows == 4 and terminal == ""
