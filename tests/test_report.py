"""cg-report: the numbers on a hand-built change log, re-sends counted once in "unique"."""

import gzip
import io
import sqlite3
import sys

import pytest
import ujson

from cg.exchange.ledger import Change, Turn
from cg.record.changelog import compaction_record, usage_record
from cg.record.pricing import Tokens, prices
from cg.record.report import NOTE, render, tally
from cg.store.ledger import MemoryLedger
from cg.stream.usage import Usage
from cg.web.report import main, tally_ledger

OFFLOAD = dict(
    tool="Bash",
    component="offload",
    lossy=True,
    marker="aaaaaaaaaaaaaaaa",
    tokens_before=10_000,
    tokens_after=1_000,
    content_hash="aaaaaaaaaaaaaaaa",
)
DEDUP = dict(
    tool="Bash",
    component="dedup",
    lossy=True,
    marker="aaaaaaaaaaaaaaaa",
    tokens_before=10_000,
    tokens_after=50,
    content_hash="aaaaaaaaaaaaaaaa",
)
JSONFORMAT = dict(  # after TEXTCLEAN, on the same result: it starts from textclean's output
    tool="mcp__gh__issue",
    component="jsonformat",
    lossy=False,
    marker=None,
    tokens_before=600,
    tokens_after=300,
    content_hash="bbbbbbbbbbbbbbbb",
)
TEXTCLEAN = dict(
    tool="Bash",
    component="textclean",
    lossy=False,
    marker=None,
    tokens_before=800,
    tokens_after=600,
    content_hash="bbbbbbbbbbbbbbbb",
)
OFFLOAD_2 = dict(
    tool="Grep",
    component="offload",
    lossy=True,
    marker="cccccccccccccccc",
    tokens_before=4_000,
    tokens_after=400,
    content_hash="cccccccccccccccc",
)


def c(session, seq, fields, message=1, block=0, time=1_700_000_000.0, step=0):
    return compaction_record(
        time=time + seq, session=session, seq=seq, message=message, block=block, part=None, step=step,
        **fields,
    )


def u(session, seq, input_tokens=100, read=1_000, write=200, output=50, expand_rounds=0, write_1h=0, model=None):
    return usage_record(
        time=1_700_000_000.0 + seq,
        session=session,
        seq=seq,
        dialect="anthropic",
        path="/v1/messages",
        input_tokens=input_tokens,
        cache_read_tokens=read,
        cache_write_tokens=write,
        output_tokens=output,
        expand_rounds=expand_rounds,
        model=model,
        cache_write_1h_tokens=write_1h,
    )


def history():
    """Session s1: an offloaded result first sent on request 1 and re-sent on 2, 3 and 4; on
    request 3 a reformatted JSON result (textclean then jsonformat, same content) joins, re-sent
    on 4; on 4 an identical copy of the offloaded result is deduplicated. Session s2 (OpenAI,
    no block index) offloads another result on requests 10 and 11, and a third session's
    request logs usage only."""
    records = []
    for seq in (1, 2, 3, 4):
        records.append(c("s1", seq, OFFLOAD, message=1))
        if seq >= 3:
            records.append(c("s1", seq, TEXTCLEAN, message=5))
            records.append(c("s1", seq, JSONFORMAT, message=5, step=1))
        if seq == 4:
            records.append(c("s1", seq, DEDUP, message=7))
        records.append(u("s1", seq))
    for seq in (10, 11):
        records.append(c("s2", seq, OFFLOAD_2, block=None))
        records.append(u("s2", seq, read=0, write=3_000, expand_rounds=1))
    records.append(u("s3", 1))
    return records


def write_log(path, records, opener=open):
    with opener(path, "wt") as f:
        for record in records:
            f.write(ujson.dumps(record) + "\n")
    return str(path)


def test_numbers_on_a_hand_built_log(tmp_path):
    s = tally([write_log(tmp_path / "log", history())]).summary()
    # Cumulative: every line.  offload 4 x 9000, textclean 2 x 200, jsonformat 2 x 300,
    # dedup 9950, s2's offload 2 x 3600.
    assert s["compactions"] == 11
    assert s["cumulative_deleted_marker"] == 4 * 9_000 + 9_950 + 2 * 3_600 == 53_150
    assert s["cumulative_deleted_no_marker"] == 2 * 200 + 2 * 300 == 1_000
    assert s["cumulative_deleted_tokens"] == 54_150
    # Unique: each compaction once, however often it was re-sent.
    assert s["unique_deleted_marker"] == 9_000 + 9_950 + 3_600 == 22_550
    assert s["unique_deleted_no_marker"] == 200 + 300
    assert s["unique_deleted_tokens"] == 23_050
    assert s["compactions_unique"] == 5
    assert s["cumulative_over_unique"] == round(54_150 / 23_050, 2)
    assert s["distinct_markers"] == 2
    # Requests: (session, seq) pairs of the usage lines; sessions from every line.
    assert s["requests"] == 7 and s["requests_from"] == "usage"
    assert s["sessions"] == 3
    assert s["components"]["offload"] == {
        "lossy": True, "acted": 6, "acted_unique": 2,
        "cumulative_deleted_tokens": 4 * 9_000 + 2 * 3_600, "unique_deleted_tokens": 12_600,
    }  # fmt: skip
    assert s["components"]["textclean"] == {
        "lossy": False, "acted": 2, "acted_unique": 1,
        "cumulative_deleted_tokens": 400, "unique_deleted_tokens": 200,
    }  # fmt: skip
    assert list(s["components"]) == ["dedup", "jsonformat", "offload", "textclean"]
    assert s["usage"] == {
        "requests": 7,
        "input_tokens": 700,
        "cache_read_tokens": 5 * 1_000,
        "cache_write_tokens": 5 * 200 + 2 * 3_000,
        "cache_write_1h_tokens": 0,
        "output_tokens": 350,
        "expand_rounds": 2,
        "cache_write_read_ratio": round(7_000 / 5_000, 4),
    }
    assert (s["first_time"], s["last_time"]) == (1_700_000_001.0, 1_700_000_011.0)
    assert s["bad_lines"] == 0 and s["lines"] == len(history())
    # Per result: the message-5 result (textclean then jsonformat) counts once per request.
    assert s["results"] == 4 + 2 + 1 + 2
    assert s["results_tokens_before"] == 4 * 10_000 + 2 * 800 + 10_000 + 2 * 4_000 == 59_600
    assert s["results_tokens_after"] == 4 * 1_000 + 2 * 300 + 50 + 2 * 400 == 59_600 - 54_150
    assert s["results_savings_pct"] == round(100 * 54_150 / 59_600, 2)


def test_a_result_two_components_rewrote_counts_once(tmp_path):
    """Issue 9's output: 47,905 tokens, 33,004 after a reformat, 709 after offload: 98.5% saved
    (summing every line's before and after would say 58%)."""
    reformat = dict(TEXTCLEAN, tokens_before=47_905, tokens_after=33_004, content_hash="d" * 16)
    offload = dict(OFFLOAD, tokens_before=33_004, tokens_after=709, marker="d" * 16, content_hash="d" * 16)
    records = [c("s", 1, reformat), c("s", 1, offload, step=1)]
    s = tally([write_log(tmp_path / "log", records)]).summary()
    assert (s["results"], s["results_tokens_before"], s["results_tokens_after"]) == (1, 47_905, 709)
    assert s["results_savings_pct"] == 98.52
    assert s["cumulative_deleted_tokens"] == s["unique_deleted_tokens"] == 47_905 - 709


def test_lines_without_step_are_grouped_into_results(tmp_path):
    """A log from a cg that wrote no step: a line continues the result before it when it is at
    the same place in the same request and starts from the size that one left."""
    records = history()
    for record in records:
        record.pop("step", None)
        record.pop("part", None)
    old = tally([write_log(tmp_path / "old", records)]).summary()
    new = tally([write_log(tmp_path / "new", history())]).summary()
    for key in ("results", "results_tokens_before", "results_tokens_after", "results_savings_pct"):
        assert old[key] == new[key], key


def test_the_same_lines_twice_change_cumulative_not_unique(tmp_path):
    once = tally([write_log(tmp_path / "a", history())]).summary()
    twice = tally([write_log(tmp_path / "b", history() + history())]).summary()
    assert twice["cumulative_deleted_tokens"] == 2 * once["cumulative_deleted_tokens"]
    for key in ("unique_deleted_tokens", "unique_deleted_marker", "distinct_markers", "requests", "sessions"):
        assert twice[key] == once[key], key


def test_requests_from_compactions_without_usage_lines(tmp_path):
    records = [r for r in history() if r["kind"] == "compaction"]
    s = tally([write_log(tmp_path / "log", records)]).summary()
    assert s["requests"] == 6 and s["requests_from"] == "compactions"
    assert s["usage"]["requests"] == 0 and s["usage"]["cache_write_read_ratio"] is None


def test_gzip_and_plain_files_together(tmp_path):
    records = history()
    plain = write_log(tmp_path / "changes.jsonl", records[:9])
    rotated = write_log(tmp_path / "changes.jsonl.1.gz", records[9:], opener=gzip.open)
    # told apart by content, not by name
    renamed = write_log(tmp_path / "changes.jsonl.2", records[9:], opener=gzip.open)
    whole = tally([write_log(tmp_path / "all", records)]).summary()
    assert tally([plain, rotated]).summary() == {**whole, "files": 2}
    assert tally([plain, renamed]).summary() == {**whole, "files": 2}


def test_bad_lines_are_skipped_and_counted(tmp_path):
    path = tmp_path / "log"
    good = [ujson.dumps(r) for r in history()]
    bad = [
        '{"kind":"compaction","time":1700000001,"sess',  # torn by a failed write
        "not json",
        "[1, 2]",
        '{"kind":"compaction","session":"s1","seq":1,"component":"offload","marker":null,"hash":null,"tokens_deleted":5}',
        '{"kind":"compaction","session":"s1","seq":1,"component":"offload","marker":"x","tokens_deleted":"5"}',
        '{"kind":"usage","session":"s1","seq":"1"}',
        '{"kind":"usage","session":"s1","seq":1,"input_tokens":true}',
    ]
    path.write_text("\n".join(bad[:3] + good + bad[3:]) + '\n\n{"kind":"expand","session":"s1"}\n')
    s = tally([str(path)]).summary()
    assert s["bad_lines"] == 7
    assert s["other_lines"] == 1  # a kind this cg-report does not know: not an error
    assert s["cumulative_deleted_tokens"] == 54_150
    assert s["lines"] == len(good) + 8  # the blank line is not a line


def test_unreadable_and_truncated_files(tmp_path, capsys):
    records = history()
    data = gzip.compress("".join(ujson.dumps(r) + "\n" for r in records).encode())
    (tmp_path / "cut.gz").write_bytes(data[: len(data) // 2])  # still being compressed
    code = main([str(tmp_path / "missing"), str(tmp_path / "cut.gz"), "--json"])
    out, err = capsys.readouterr()
    s = ujson.loads(out)
    assert code == 1
    assert len(s["unreadable_files"]) == 2
    assert "missing" in err and "cut.gz" in err
    assert 0 < s["lines"] < len(records)  # what was read before the cut still counts


JSON_KEYS = [
    "files", "lines", "bad_lines", "other_lines", "unreadable_files", "first_time", "last_time",
    "compactions", "compactions_unique", "cumulative_deleted_tokens", "cumulative_deleted_marker",
    "cumulative_deleted_no_marker", "unique_deleted_tokens", "unique_deleted_marker",
    "unique_deleted_no_marker", "cumulative_over_unique", "distinct_markers", "requests",
    "requests_from", "sessions", "results", "results_tokens_before", "results_tokens_after",
    "results_savings_pct", "components", "usage", "note", "cost", "store", "rows", "rows_counted", "pings",
]  # fmt: skip


def test_json_output_keys(tmp_path, capsys):
    assert main([write_log(tmp_path / "log", history()), "--json"]) == 0
    s = ujson.loads(capsys.readouterr().out)
    assert list(s) == JSON_KEYS
    assert list(s["usage"]) == [
        "requests", "input_tokens", "cache_read_tokens", "cache_write_tokens", "output_tokens",
        "expand_rounds", "cache_write_1h_tokens", "cache_write_read_ratio",
    ]  # fmt: skip
    assert list(s["components"]["dedup"]) == [
        "lossy", "acted", "acted_unique", "cumulative_deleted_tokens", "unique_deleted_tokens",
    ]  # fmt: skip
    assert s["unique_deleted_tokens"] == 23_050
    assert s["note"] == NOTE


def test_json_keys_are_there_on_an_empty_log(tmp_path, capsys):
    (tmp_path / "empty").write_text("")
    assert main([str(tmp_path / "empty"), "--json"]) == 0
    s = ujson.loads(capsys.readouterr().out)
    assert list(s) == JSON_KEYS
    assert s["unique_deleted_tokens"] == 0 and s["cumulative_over_unique"] is None


def test_text_table(tmp_path, capsys):
    assert main([write_log(tmp_path / "log", history())]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert any(line.split() == ["total", "54,150", "23,050"] for line in lines)
    assert any(line.split() == ["behind", "a", "marker", "(lossy)", "53,150", "22,550"] for line in lines)
    assert any(line.split() == ["no", "marker", "(reformat)", "1,000", "500"] for line in lines)
    assert any(line.split() == ["Distinct", "marker", "ids", "2"] for line in lines)
    assert any(line.split() == ["Requests", "7"] for line in lines)
    assert any(line.split() == ["Sessions", "3"] for line in lines)
    assert any(line.split()[:4] == ["Tool", "results", "rewritten", "9"] for line in lines)
    assert any(line.split() == ["tokens", "as", "sent", "59,600"] for line in lines)
    assert any(line.split() == ["tokens", "as", "forwarded", "5,450", "(90.9%", "less)"] for line in lines)
    assert any(line.split()[:3] == ["offload", "lossy", "6"] for line in lines)
    assert "Cache write:read  1:0.7 (1.4)" in lines
    assert "use unique" in out and "unique" in lines[-1]


def test_standard_input(capsys):
    data = "".join(ujson.dumps(r) + "\n" for r in history()).encode()
    s = tally(["-"], stdin=io.BufferedReader(io.BytesIO(gzip.compress(data)))).summary()
    assert s["cumulative_deleted_tokens"] == 54_150


def test_no_arguments_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2


def test_float_counts_are_counts(tmp_path):
    path = tmp_path / "log"
    path.write_text(
        '{"kind":"compaction","session":"s","seq":1,"component":"offload","lossy":true,'
        '"marker":"m","hash":"m","tokens_deleted":1500.0}\n'
    )
    assert tally([str(path)]).summary()["unique_deleted_tokens"] == 1500


def test_a_missing_file_alone_prints_the_error_alone(tmp_path, capsys):
    for extra in ([], ["--json"]):
        assert main([str(tmp_path / "missing"), *extra]) == 1
        out, err = capsys.readouterr()
        assert out == ""
        assert err.startswith(f"cg-report: could not read {tmp_path / 'missing'}")
        assert err.count("\n") == 1


OPUS = "claude-opus-4-8"


def test_cache_writes_for_an_hour_are_priced_as_such(tmp_path):
    price = prices().price(OPUS, "anthropic")
    path = write_log(tmp_path / "log", [u("s", 1, write=1_000, write_1h=600, model=OPUS), u("s", 2, write=500, model=OPUS)])
    s = tally([path]).summary()
    assert s["usage"]["cache_write_1h_tokens"] == 600
    billed = Tokens(input=200, cache_read=2_000, cache_write_5m=900, cache_write_1h=600, output=100)
    assert s["cost"]["usd"] == pytest.approx(price.cost(billed))
    # a line from before the split, or one that claims more than was written: 5-minute writes at most
    path = write_log(tmp_path / "old", [{k: v for k, v in u("s", 1, write=1_000, model=OPUS).items() if "1h" not in k},
                                        u("s", 2, write=100, write_1h=400, model=OPUS)])
    capped = tally([path]).summary()
    assert capped["cost"]["usd"] == pytest.approx(price.cost(
        Tokens(input=200, cache_read=2_000, cache_write_5m=1_000, cache_write_1h=100, output=100)))
    assert capped["usage"]["cache_write_1h_tokens"] == 100


# cg-report --store: the ledger's rows (cg.exchange.ledger) counted as the change log's lines


def ledger_of(records, **options):
    """A MemoryLedger holding the requests `records` (a change log) describe: a Turn per
    (session, seq), a Change per compaction line."""
    ledger = MemoryLedger(**options)
    requests: dict[tuple[str, int], dict] = {}
    for r in records:
        request = requests.setdefault((r["session"], r["seq"]), {"time": r["time"], "changes": [], "usage": None})
        if r["kind"] == "usage":
            request["usage"] = r
        else:
            request["changes"].append(Change(
                r["seq"], r["message"], r["block"], r["tool"], r["component"], r["lossy"], r["marker"],
                r["tokens_before"], r["tokens_after"], content_id=r["hash"], part=r["part"], step=r["step"]))
    for (session, seq), request in requests.items():
        used = request["usage"]
        billed = None if used is None else Usage(used["input_tokens"], used["cache_read_tokens"],
                                                 used["cache_write_tokens"], used["output_tokens"],
                                                 used["cache_write_1h_tokens"])
        ledger.record(Turn(
            time=request["time"], seq=seq, tenant="", conversation=session, client="claude-code",
            model=None if used is None else used["model"], dialect="anthropic", path="/v1/messages", status=200,
            outcome="ok", tokens_before=0, tokens_after=0, results_before=0, results_after=0, billed=billed,
            cost_via_cg=None, cost_direct=None, expand_rounds=0 if used is None else used["expand_rounds"]),
            request["changes"])
    return ledger


def fired(d):
    box = []
    d.addBoth(box.append)
    assert box, "the Deferred has not fired"
    return box[0]


# What only a change log has (its files and lines), or only a ledger (its store and rows).
SOURCE_KEYS = {"files", "lines", "bad_lines", "other_lines", "unreadable_files", "store", "rows", "rows_counted"}


def test_a_ledger_reports_what_the_change_log_of_the_same_requests_does(tmp_path):
    records = [*history(), u("s1", 5, model=OPUS)]
    from_log = tally([write_log(tmp_path / "log", records)]).summary()
    from_ledger = fired(tally_ledger(ledger_of(records), "sqlite:/var/lib/cg/store.sqlite3")).summary()
    assert from_ledger["unique_deleted_tokens"] == 23_050 and from_ledger["cost"]["usd"] > 0
    assert {k: v for k, v in from_ledger.items() if k not in SOURCE_KEYS} == {
        k: v for k, v in from_log.items() if k not in SOURCE_KEYS}
    assert (from_ledger["store"], from_ledger["rows"], from_ledger["rows_counted"]) == (
        "sqlite:/var/lib/cg/store.sqlite3", 8, 8)
    text = render(from_ledger)
    assert text.startswith("sqlite:/var/lib/cg/store.sqlite3: the ledger's 8 request(s) from 2023-11-14 22:13 UTC")
    assert "rollups" not in text  # every request it counted, it kept
    assert render(from_log).split("\n", 2)[2] == text.split("\n", 2)[2]  # the same table below


def test_a_ledger_that_kept_fewer_rows_than_it_counted_says_so():
    summary = fired(tally_ledger(ledger_of(history(), max_turns=3), "redis://cache:6379/0")).summary()
    assert (summary["rows"], summary["rows_counted"]) == (3, 7)
    assert "(its rollups count 7 requests; it keeps the rows of the newest 3, and these figures are theirs)" in (
        render(summary))


def test_a_change_without_a_marker_or_content_id_is_skipped_and_said():
    ledger = ledger_of(history())
    ledger.record(Turn(time=1_700_000_100.0, seq=99, tenant="", conversation="s9", client="sdk", model=None,
                       dialect="openai", path="/v1/chat/completions", status=200, outcome="ok", tokens_before=0,
                       tokens_after=0, results_before=0, results_after=0, billed=None, cost_via_cg=None,
                       cost_direct=None), [Change(99, 1, None, "Bash", "textclean", False, None, 100, 50)])
    summary = fired(tally_ledger(ledger, "sqlite:x")).summary()
    assert summary["bad_lines"] == 1 and summary["rows"] == 8
    assert "skipped 1 unreadable change(s) kept without a marker or content id" in render(summary)


def test_store_options_are_refused_in_one_line(tmp_path, capsys):
    for argv, code, said in (
        (["--store", "memory:"], 2, "cg-report: a memory: store dies with its cg: give sqlite:PATH or a Redis URL"),
        (["--store", "nosuch:x"], 2, "cg-report: unknown store URL 'nosuch:x'"),
        (["--store", f"sqlite:{tmp_path / 'none.sqlite3'}"], 1, f"cg-report: no store at {tmp_path / 'none.sqlite3'}"),
        (["--store", "sqlite:x", "--store-password-file", "pw"], 2, "cg-report: a password file is for a Redis store"),
    ):
        assert main(argv) == code
        out, err = capsys.readouterr()
        assert out == "" and err.startswith(said) and err.count("\n") == 1, err
    assert not (tmp_path / "none.sqlite3").exists()
    sqlite3.connect(tmp_path / "store.sqlite3").close()  # a store, but no ledger beside it
    assert main(["--store", f"sqlite:{tmp_path / 'store.sqlite3'}"]) == 1
    assert "has no ledger" in capsys.readouterr().err
    assert not (tmp_path / "store.ledger.sqlite3").exists()  # not made by a report (run as root, cg could not open it)
    for argv in ([], ["log", "--store", "sqlite:x"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2


def test_a_redis_store_without_the_redis_extra_says_which_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "redis", None)  # what `import redis` meets when it is not installed
    assert main(["--store", "redis://127.0.0.1:6379/0"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("cg-report: a Redis store needs the redis extra: pip install 'cg[redis]'")
