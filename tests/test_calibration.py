"""cg-estimate's calibration to the prompt sizes a transcript recorded (issue 25 §3: the simulated
direct bill near the recorded one), on tests/fixtures/transcripts/calibration/ (built by
calibration.py there: recorded prompts 1.3 times cl100k_base's count of the rebuilt ones; one copy
with a cache break of the client's own)."""

import io
import json
from pathlib import Path

import pytest

from cg.compaction.options import rewrite_config
from cg.record import estimate, transcripts
from cg.record.pricing import Segment, Tokens
from cg.record.replay import Sent, calibration, replay

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "transcripts"
SCALED, BROKEN = FIXTURES / "calibration" / "scaled", FIXTURES / "calibration" / "cache-break"


def run(*argv: str) -> dict:
    out, err = io.StringIO(), io.StringIO()
    assert estimate.main([*argv, "--json"], out, err) == 0 and err.getvalue() == ""
    return json.loads(out.getvalue())


def sent(session: transcripts.Session) -> list[Sent]:
    return [Sent(r.time, r.path, r.body, r.output_tokens, r.billed) for r in session.requests]


def test_recorded_prompts_larger_than_the_estimate_are_fitted():
    report = run(str(SCALED))
    [session], total = report["sessions"], report["total"]
    # 1.3 x cl100k's count of what the conversation adds over cg's estimate of it (which counts this filler 8.8% higher)
    assert session["calibration"] == pytest.approx(1.3 / 1.088, abs=0.01)
    assert total["simulated_vs_recorded"] == pytest.approx(1.0, abs=0.01)
    assert total["prompt_tokens_simulated"] == pytest.approx(total["prompt_tokens_recorded"], rel=0.01)
    # the raw figure, by cg's estimate alone: the envelope fitted, what the conversation adds ~1/1.2 short
    assert total["simulated_vs_recorded_raw"] < 0.9 and total["calibrated"] == 1 and total["client_breaks"] == 0
    simulated, recorded = Tokens(**session["tokens_direct"]), Tokens(**session["billed_by_transcript"])
    assert simulated.cache_write == pytest.approx(recorded.cache_write, rel=0.01)
    assert simulated.cache_read == pytest.approx(recorded.cache_read, rel=0.01)
    off = run(str(SCALED), "--calibrate", "off")
    assert off["total"]["simulated_vs_recorded"] == total["simulated_vs_recorded_raw"]
    assert off["total"]["cost_direct"] < report["total"]["cost_direct"] and off["sessions"][0]["calibration"] == 1.0


def test_the_via_cg_side_is_sized_with_the_same_scale():
    [session] = transcripts.read_claude_code(next(SCALED.glob("*.jsonl")))
    calibrated = replay(sent(session), rewrite_config(), conversation=session.id)
    raw = replay(sent(session), rewrite_config(), conversation=session.id, calibrate=False)
    assert calibrated[0].direct == raw[0].direct  # the first request is the envelope's fit: not scaled
    added, added_raw = (turns[-1].cg.prompt - turns[0].cg.prompt for turns in (calibrated, raw))
    assert added == pytest.approx(calibrated[0].scale * added_raw, rel=0.01) and calibrated[0].scale > 1.15


def test_a_cache_break_of_the_clients_own_is_priced_as_recorded_both_ways():
    report = run(str(BROKEN))
    [session], total = report["sessions"], report["total"]
    assert session["client_breaks"] == 1 and total["client_breaks"] == 1
    assert total["simulated_vs_recorded"] == pytest.approx(1.0, abs=0.01)
    assert total["simulated_vs_recorded_raw"] < 0.7  # the simulation read where the client wrote
    simulated, recorded = Tokens(**session["tokens_direct"]), Tokens(**session["billed_by_transcript"])
    assert simulated.cache_write == pytest.approx(recorded.cache_write, rel=0.01)
    # cg forwards the client's envelope as it is: the break costs a write via cg too
    scaled = run(str(SCALED))["sessions"][0]
    assert Tokens(**session["tokens_cg"]).cache_write > Tokens(**scaled["tokens_cg"]).cache_write
    [read] = transcripts.read_claude_code(next(BROKEN.glob("*.jsonl")))
    turns = replay(sent(read), rewrite_config(), conversation=read.id)
    [broken] = [i for i, t in enumerate(turns) if t.client_break]
    billed = read.requests[broken].billed
    assert billed is not None and turns[broken].direct.cache_read == turns[broken].cg.cache_read == billed.cache_read


def test_the_table_says_what_was_calibrated():
    out, err = io.StringIO(), io.StringIO()
    assert estimate.main([str(BROKEN)], out, err) == 0
    text = out.getvalue()
    assert "calibrated: to the prompt sizes the transcripts recorded, what 1 conversation(s) added scaled by x1.20" in text
    assert "sim/rec by cg's token estimate alone: 0.670" in text
    assert "client cache breaks: 1 request(s)" in text


def test_usage_that_is_not_the_prompts_size_is_not_fitted():
    # the fixtures the real CLIs wrote against the fake provider record 100 input tokens a request
    home = str(FIXTURES / "home")
    on, off = run(home), run(home, "--calibrate", "off")
    assert on["total"]["calibrated"] == 0 and on["total"]["client_breaks"] == 0
    assert on["total"]["cost_direct"] == off["total"]["cost_direct"] and on["total"]["cost_cg"] == off["total"]["cost_cg"]


def test_the_fit_is_least_squares_over_what_the_first_request_did_not_hold():
    first, a, b = Segment(b"f", 1000), Segment(b"a", 100), Segment(b"b", 300)
    scale, held = calibration([([first], 1000), ([first, a], 1120), ([first, a, b], 1480)])
    assert held == {b"f"} and scale == round((100 * 120 + 400 * 480) / (100**2 + 400**2), 4)
    assert calibration(iter([([first], 1000), ([first, a], 1120)])) == calibration([([first], 1000), ([first, a], 1120)])
    assert calibration([([first], None), ([first, a], None)])[0] is None  # nothing recorded
    assert calibration([([first], 100), ([first, a], 100)])[0] is None  # a fake provider's usage: out of bounds
    assert calibration([([first], 1200), ([first], 1200)])[0] == 1.0  # nothing added
