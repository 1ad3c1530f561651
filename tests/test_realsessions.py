"""bench/realsessions.py, issue 25's statistics of a set of transcripts, on the transcript shapes."""

import json

from helpers.bench import ROOT, bench_module

SHAPES = ROOT / "tests" / "fixtures" / "transcripts" / "shapes"
realsessions = bench_module("realsessions")


def test_gaps_and_what_the_first_request_after_one_costs(tmp_path, capsys):
    out = tmp_path / "stats.json"
    assert realsessions.main([str(SHAPES / "split-response"), str(SHAPES / "resumed"), "--json", str(out)]) == 0
    split, resumed, both = (json.loads(out.read_text())[name] for name in ("split-response", "resumed", "all paths"))
    # split-response: one 400-second gap, its next request reading (one-hour writes); resumed: two
    # files, two sessions, the hour between them no gap of either
    assert (split["sessions"], split["requests"], split["breaks"], split["sessions_one_hour"]) == (1, 3, 1, 1)
    assert split["break_writes_share"] < 0.01
    assert (resumed["sessions"], resumed["breaks"], resumed["breaks_30_240"]) == (2, 0, 0)  # a file each
    assert both["requests"] == 6 and both["sessions_with_breaks"] == 1
    # of split-response's idle periods past 4.5 min (its break, its end), the break came back within 4.5 more
    assert split["returns"]["4.5"] == 0.5 and resumed["returns"]["4.5"] == 0.0
    table = capsys.readouterr().out
    assert "| gaps over 5 min | 1 | 0 | 1 | 151 |" in table and "issue 25's prior" in table
    assert "| 22.5 min | 0.0% | 0.0% | 0.0% | 9.8% |" in table  # issue 25's prior, as performance.md shows it
