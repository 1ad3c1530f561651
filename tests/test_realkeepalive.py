"""bench/realkeepalive.py: keep-alive's rules on request times alone, and a prior fitted to gaps."""

import json

from helpers.bench import ROOT, bench_module

from cg.exchange.keepalive import Policy
from cg.record.replay import Hindsight

SHAPES = ROOT / "tests" / "fixtures" / "transcripts" / "shapes"
realkeepalive = bench_module("realkeepalive")


def test_gap_only_counts_pings_and_the_breaks_they_bridge():
    # a 10-minute break, a 2-hour one, then the end
    times = [[0.0, 600.0, 600.0 + 7200]]
    hindsight = realkeepalive.pacing_net(times, Policy(**realkeepalive.UNBOUNDED, forecast=Hindsight()))
    assert hindsight == {"pings": 2, "bridged": 1, "net_prefixes": 0.95}  # 1.15 spared, 2 pings at 0.1
    bounds = realkeepalive.pacing_net(times, Policy(forecast=None))
    # the 10-minute break: 2; the 2-hour one: 6 to the 30-minute bound; the end: 6
    assert bounds == {"pings": 14, "bridged": 1, "net_prefixes": -0.25}


def test_a_prior_fitted_to_gaps_counts_them_by_band():
    fitted = realkeepalive.fit([400.0, 500.0, 1000.0, 5000.0, 100_000.0], ends=3)
    assert [(b.weight, b.low, b.high) for b in fitted.prior] == [(2.0, 270.0, 540.0), (1.0, 810.0, 1080.0),
                                                                 (1.0, 3600.0, 14_400.0)]
    assert fitted.prior_ends == 4.0  # the ends, and the gap longer than the last band
    # mostly short breaks: a first ping pays, a late one does not
    assert fitted.pays([270.0], 270.0, 300.0, 20_000, ()) and not fitted.pays([1350.0], 270.0, 300.0, 20_000, ())
    assert realkeepalive.ISSUE_25.pays([1350.0], 270.0, 300.0, 20_000, ())  # issue 25's prior still would


def test_on_transcripts(tmp_path):
    out = tmp_path / "real.json"
    assert realkeepalive.main([str(SHAPES / "split-response"), str(SHAPES / "resumed"), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    split = doc["split-response"]
    assert split["sessions"] == 1 and split["breaks_over_first_ping"] == 1 and split["fitted_prior"] is not None
    assert split["hindsight"]["all"]["pings"] == 0  # one-hour writes: a 400-second break needs no ping
    assert set(doc["all sources"]) >= {"forecast, all", "hindsight, all", "fitted, all", "alone, all"}
