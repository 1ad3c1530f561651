"""The compaction components, one by one, and the golden bytes they produce."""

import json
import os
import random
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from cg.compaction.components import Context, Dedup, JsonFormat, Offload, TextClean
from cg.wire.markers import marker, marker_id

GOLDEN = Path(__file__).parent / "golden"


def context(text="", tool_name="Bash", earlier=frozenset()):
    original = text.encode()
    return Context(
        tool_name=tool_name, message_index=3, block_index=0, part_index=None, original=original,
        marker_id=marker_id(original), earlier=earlier,
    )


def run(component, text, **kwargs):
    outcome = component.apply(text, context(text, **kwargs))
    return None if outcome is None else outcome.text


def check_golden(name: str, actual: str) -> None:
    """Compare with tests/golden/NAME; CG_UPDATE_GOLDEN=1 rewrites it (note the change in CHANGES.md:
    these bytes are what users' prompt caches hold)."""
    path = GOLDEN / name
    if os.environ.get("CG_UPDATE_GOLDEN"):
        path.write_bytes(actual.encode())
    assert actual == path.read_bytes().decode()


# textclean

@pytest.mark.parametrize(("text", "cleaned"), [
    ("\x1b[31mred\x1b[0m and \x1b[1;38;5;208mbold\x1b[m", "red and bold"),
    ("\x1b]0;my title\x07prompt$ ", "prompt$ "),
    ("\x1b]8;;https://example.com/x\x1b\\link\x1b]8;;\x1b\\ done", "link done"),
    ("\x1b7saved\x1b8 \x1b(Bascii\x1bM\x1b=", "saved ascii"),
    ("\x1bPq#0;2;0;0;0\x1b\\after", "after"),
    ("  0%\r 50%\r100%\ndone\n", "100%\ndone\n"),
    ("abcdef\rXY", "XYcdef"),
    ("abcdef\r\x1b[KXY", "XY"),
    ("downloading\x1b[2K\rok", "ok"),
    ("spinner |\x1b[1G\x1b[0Kspinner /\x1b[1G\x1b[0Kready", "ready"),
    ("hello\x1b[1K", "     "),
    ("\x1b[1mwarn\x1b[0m\r\nline  \r\n\r\n", "warn\r\nline  \r\n\r\n"),
    ("50%\r\x1b[32m100%\x1b[0m\r\n", "100%\r\n"),
    ("\x1b\x1b[31m[0m", "[0m"),
])
def test_textclean_shows_what_a_terminal_shows(text, cleaned):
    assert run(TextClean(), text) == cleaned


@pytest.mark.parametrize("text", ["plain\n", "crlf\r\nlines\r\n", "trailing  \n\n\nblank", "ends with cr\r", ""])
def test_textclean_leaves_clean_text_alone(text):
    assert run(TextClean(), text) is None


terminal_text = st.text(alphabet="\x1b[]();0123456789mKGHJ?\r\n\x07\\ abcXY\t é", max_size=200)


@given(terminal_text)
@settings(max_examples=500)
def test_textclean_is_idempotent_and_never_grows(text):
    cleaned = run(TextClean(), text)
    if cleaned is not None:
        assert len(cleaned) <= len(text)
        assert "\x1b" not in cleaned
        assert run(TextClean(), cleaned) is None


# jsonformat

def test_jsonformat_keeps_every_token_as_spelled():
    pretty = '{\n  "a": 1.0E+2,\n  "s": "caf\\u00e9  x\\n",\n  "a": [\n    1,\n    -0.50\n  ],\n  "t": true\n}\n'
    assert run(JsonFormat(), pretty) == '{"a":1.0E+2,"s":"caf\\u00e9  x\\n","a":[1,-0.50],"t":true}'


@pytest.mark.parametrize("text", [
    '{"a":1}',  # already compact
    '{"a": 1} trailing words',
    '{\n  "a": NaN\n}',
    '"just a string"',
    "42",
    "[1, 2,]",
    "not json at all",
    "{\n  \"a\": \"tab\there\"\n}",  # a raw control character: not strict JSON
])
def test_jsonformat_only_touches_pretty_printed_json(text):
    assert run(JsonFormat(), text) is None


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children) | st.dictionaries(st.text(), children),
    max_leaves=20,
)


@given(json_values.filter(lambda value: isinstance(value, (dict, list))), st.sampled_from([1, 2, 4, "\t"]))
def test_jsonformat_matches_a_compact_dump(value, indent):
    pretty = json.dumps(value, indent=indent)
    compacted = run(JsonFormat(), pretty)
    assert (compacted or pretty) == json.dumps(value, separators=(",", ":"))


@given(st.one_of(json_values.map(lambda value: json.dumps(value, indent=2)), st.text()))
def test_jsonformat_is_idempotent_and_never_grows(text):
    compacted = run(JsonFormat(), text)
    if compacted is not None:
        assert len(compacted) < len(text)
        assert run(JsonFormat(), compacted) is None


# dedup

def test_dedup_points_to_an_earlier_identical_result():
    text = "identical output line\n" * 60
    pointer = run(Dedup(), text, earlier={marker_id(text.encode())})
    assert pointer == (
        f"[cg: identical to an earlier tool result in this conversation, <<cg:{marker_id(text.encode())}>>; "
        f'call context_guru_expand with id "{marker_id(text.encode())}" to read it here]'
    )
    outcome = Dedup().apply(text, context(text, earlier={marker_id(text.encode())}))
    assert (outcome.original, outcome.marker_id) == (text.encode(), marker_id(text.encode()))


def test_dedup_needs_an_earlier_copy_and_a_result_worth_pointing_at():
    text = "identical output line\n" * 60
    assert run(Dedup(), text, earlier={marker_id(b"something else")}) is None
    assert run(Dedup(), "ok\n", earlier={marker_id(b"ok\n")}) is None


# offload

def build_log(lines=3000, seed=5):
    """A pytest-like log with a few failures in the middle and some very long lines."""
    rnd = random.Random(seed)
    out = []
    for number in range(lines):
        if number % 250 == 125:
            out.append(f"E       AssertionError: expected {rnd.randint(0, 99)} got {rnd.randint(100, 999)}")
        elif number % 400 == 7:
            out.append("x" * 1200)
        else:
            out.append(f"tests/test_mod{number % 17}.py::test_case_{number} PASSED [{number * 100 // lines:3d}%]")
    return "\n".join(out) + "\n"


def test_offload_keeps_head_tail_and_errors_with_a_notice():
    log = build_log()
    text = run(Offload(), log)
    lines = text.split("\n")
    notice = lines[20]
    assert lines[:20] == [line if len(line) <= 500 else f"{line[:500]} [cg: {len(line) - 500} more characters]"
                          for line in log.split("\n")[:20]]
    assert lines[-10:] == log.split("\n")[-10:]
    assert notice.startswith("[cg: lines 21-2991 of 3001 elided (~")
    assert f"<<cg:{marker_id(log.encode())}>>" in notice
    assert f'call context_guru_expand with id "{marker_id(log.encode())}"' in notice
    errors = lines[21:-10]
    assert len(errors) == 12 and all(": E       AssertionError" in line for line in errors)
    assert "Error-like lines from the elided part follow" in notice  # no test-result line, no summary
    assert errors[0].startswith("126: ")
    check_golden("offload_pytest_log.txt", text)


def test_offload_keeps_at_most_the_configured_error_lines():
    log = "\n".join(["header"] * 20 + ["Error: failed to fetch"] * 3000 + ["footer"] * 10)
    text = run(Offload(), log)
    assert text.count("Error: failed to fetch") == 20


def test_offload_caps_long_lines_of_a_one_line_result():
    blob = "word " * 4000
    text = run(Offload(), blob)
    assert text.startswith("word " * 100 + " [cg: 19500 more characters]\n[cg: long lines shortened (~")


def test_offload_leaves_small_results_kept_tools_and_thin_savings_alone():
    assert run(Offload(), "short output\n" * 50) is None
    assert run(Offload(), build_log(), tool_name="Read") is None
    assert run(Offload(keep_tools=frozenset({"Bash"})), build_log()) is None
    barely = "\n".join(f"line {n} " + "lorem ipsum dolor sit amet " * 16 for n in range(32))
    assert run(Offload(), barely) is None


def test_offload_lossy_outcome_carries_the_exact_original():
    log = build_log() + "caf\u00e9 \u2014 \U0001f600"
    outcome = Offload().apply(log, context(log))
    assert outcome.original == log.encode("utf-8")
    assert outcome.marker_id == marker_id(log.encode("utf-8"))


# offload: what the elided part holds, said in a line or kept (issue 13, section 3)

def build_diff(files=14, seed=3):
    """A `git diff` of `files` files (one renamed, one binary), each with a hunk or two."""
    rnd = random.Random(seed)
    out = []
    for number in range(files):
        path = f"src/pkg/module_{number}.py"
        if number == 5:
            out += ["diff --git a/docs/old_name.md b/docs/new_name.md", "similarity index 100%",
                    "rename from docs/old_name.md", "rename to docs/new_name.md"]
            continue
        if number == 8:
            out += ["diff --git a/assets/logo.png b/assets/logo.png", "index 3f2a1c0..9b8e7d6 100644",
                    "Binary files a/assets/logo.png and b/assets/logo.png differ"]
            continue
        out += [f"diff --git a/{path} b/{path}", f"index {number:07x}..{number + 1:07x} 100644", f"--- a/{path}",
                f"+++ b/{path}"]
        for hunk in range(1 + number % 2):
            out.append(f"@@ -{40 * hunk + 1},24 +{40 * hunk + 1},25 @@ def function_{hunk}(values):")
            for line in range(24):
                roll = rnd.random()
                sign = "-" if roll < 0.15 else "+" if roll < 0.3 else " "
                out.append(f"{sign}    value_{line} = compute(value_{line - 1}, {rnd.randint(0, 99)})  # error if None")
    return "\n".join(out) + "\n"


def build_project_paths(seed=4):
    """A project's files: (directory, file names) in the order `find` walks them."""
    rnd = random.Random(seed)
    sizes = {"": 4, "src/cg": 60, "src/cg/web": 45, "tests": 70, "tests/golden": 12, "docs": 9,
             "node_modules/lodash": 160, "node_modules/react/cjs": 90}
    return [(directory, [f"{'_'.join(rnd.sample(WORDS, 2))}_{n}.{rnd.choice(('py', 'js', 'md'))}" for n in range(count)])
            for directory, count in sizes.items()]


WORDS = "value cache token marker store stream header parse encode proxy session splice".split()


def test_offload_names_the_files_of_a_diffs_elided_part():
    diff = build_diff()
    text = run(Offload(), diff)
    summary = text.split("\n")[21]
    assert summary.startswith("[cg: the elided part holds 13 of the diff's 14 files (lines added, removed): "
                              "src/pkg/module_1.py +3 -8, ")  # module_0's header is in the head
    assert ", docs/old_name.md -> docs/new_name.md, " in summary and ", assets/logo.png, " in summary
    assert "Error-like" not in text  # a diff's lines mentioning errors are code, not failures
    check_golden("offload_git_diff.txt", text)


def test_offload_counts_a_files_lines_added_and_removed():
    diff = build_diff(files=3) + "".join(
        f"diff --git a/big_{n}.py b/big_{n}.py\n--- a/big_{n}.py\n+++ b/big_{n}.py\n@@ -1,3 +1,4 @@\n"
        + "-gone\n" * 100 + "+new\n" * (200 + n) + " same\n" * 100 for n in range(3))
    text = run(Offload(head_lines=5), diff)
    assert "big_0.py +200 -100, big_1.py +201 -100, big_2.py +202 -100]" in text


def test_offload_names_the_files_of_a_unified_diff_without_git_headers():
    pairs = "".join(f"--- orig/src/file_{n}.c\t2026-11-30 10:00:00\n+++ new/src/file_{n}.c\t2026-12-01 09:00:00\n"
                    f"@@ -1,40 +1,40 @@\n" + "".join(f"-old line {k} of {n}\n+new line {k} of {n}\n" for k in range(40))
                    for n in range(6))
    text = run(Offload(), "diff -ru orig new\n" + pairs)
    assert "[cg: the elided part holds 5 of the diff's 6 files (lines added, removed): new/src/file_1.c +40 -40, " in text


def test_offload_keeps_a_diffs_old_excerpt_when_no_file_header_is_elided():
    one_file = build_diff(files=1) + "".join(f"+    added_{n} = {n}\n" for n in range(600))
    text = run(Offload(), one_file)
    assert "files (lines added, removed)" not in text and "[cg: lines 21-" in text


def test_offload_summarizes_a_find_listing():
    listing = "\n".join(f"./{d}/{name}" if d else f"./{name}" for d, names in build_project_paths() for name in names)
    text = run(Offload(), listing)
    assert text.split("\n")[21] == (
        "[cg: the output lists 450 paths in 8 directories under ./; most under: node_modules/ (250), src/ (105), "
        "tests/ (82), docs/ (9), (top level) (4)]")
    assert "Error-like" not in text
    check_golden("offload_find_listing.txt", text)


def test_offload_summarizes_git_ls_files_and_absolute_paths():
    paths = sorted(f"{d}/{name}" if d else name for d, names in build_project_paths() for name in names)
    text = run(Offload(), "\n".join(paths))
    assert "[cg: the output lists 446 paths in 7 directories; most under: node_modules/ (250), src/ (105), " in text
    absolute = "\n".join(f"/home/dev/proj/{path}" for path in paths if "/" in path)
    assert "paths in 7 directories under /home/dev/proj/; most under: node_modules/ (250)" in run(Offload(), absolute)


def test_offload_summarizes_ls_r():
    tree = dict(build_project_paths())
    subdirectories = {"": ["docs", "node_modules", "src", "tests"], "node_modules": ["lodash", "react"],
                      "node_modules/react": ["cjs"], "src": ["cg"], "src/cg": ["web"], "tests": ["golden"]}
    blocks = []
    for directory in sorted(set(tree) | set(subdirectories)):
        entries = sorted(tree.get(directory, []) + subdirectories.get(directory, []))
        blocks.append("\n".join([f"./{directory}:" if directory else ".:", *entries]))
    text = run(Offload(), "\n\n".join(blocks) + "\n")
    assert ("[cg: the output lists 460 paths in 11 directories under ./; most under: node_modules/ (253), "
            "src/ (107), tests/ (83), docs/ (9), (top level) (8)]") in text  # a directory's entries: files, subdirectories
    check_golden("offload_ls_r.txt", text)


def test_offload_keeps_the_summary_and_failures_of_test_runs_in_the_elided_part():
    """tox's two pytest runs: the first run's summary and FAILED lines fall in the elided part,
    past the 20 error-like lines its failure reports hold."""
    def pytest_run(env, failures):
        out = [f"{env}: commands[0]> pytest -q", *(f"tests/test_mod{n}.py " + "." * 50 + f" [{n * 3:3d}%]"
                                                  for n in range(30))]
        for n in range(failures):
            out += [f"___ test_case_{n} ___", f"    def test_case_{n}():", ">       assert compute(1) == 2",
                    "E       assert 3 == 2", "E        +  where 3 = compute(1)", "",
                    f"tests/test_mod{n}.py:{10 + n}: AssertionError"]
        out += ["=== short test summary info ==="]
        out += [f"FAILED tests/test_mod{n}.py::test_case_{n} - assert 3 == 2" for n in range(failures)]
        out.append(f"{failures} failed, {1500 - failures} passed in 12.{failures}1s")
        return out + [f"{env}: exit 1 (12.40 seconds) /home/dev/proj> pytest -q pid=4242"]
    log = pytest_run("py310", 9) + pytest_run("py311", 9) + [
        "  py310: FAIL code 1 (12.40 seconds)", "  py311: FAIL code 1 (12.51 seconds)",
        "  evaluation failed :( (25.02 seconds)"]
    text = run(Offload(), "\n".join(log))
    assert "Test-result and error-like lines from the elided part follow" in text
    for n in range(9):
        assert f": FAILED tests/test_mod{n}.py::test_case_{n} - assert 3 == 2" in text
    assert ": 9 failed, 1491 passed in 12.91s" in text
    check_golden("offload_tox_pytest.txt", text)


def test_offload_keeps_a_go_test_runs_failed_packages():
    packages = []
    for n in range(150):
        if n in (40, 90):
            packages += [f"--- FAIL: TestThing{n} (0.01s)", f"    thing_test.go:{n}: expected 1, got 2", "FAIL",
                         f"FAIL\tgithub.com/acme/proj/internal/pkg{n}\t0.0{n % 10}2s"]
        else:
            packages.append(f"ok  \tgithub.com/acme/proj/internal/pkg{n}\t0.{n:03d}s")
    text = run(Offload(), "\n".join(packages + ["FAIL"]))
    lines = text.split("\n")
    assert lines[21] == "[cg: 103 more test-result lines in the elided part are not shown]"
    assert lines[22:25] == ["41: --- FAIL: TestThing40 (0.01s)", "43: FAIL",
                            "44: FAIL\tgithub.com/acme/proj/internal/pkg40\t0.002s"]
    assert "\n97: FAIL\tgithub.com/acme/proj/internal/pkg90\t0.002s\n" in text  # failures before ok lines
    check_golden("offload_go_test.txt", text)


def test_offload_keeps_jest_and_cargo_results():
    jest = ["PASS src/lib/a.test.ts"] + [f"    \u2713 works for case {n} ({n % 9} ms)" for n in range(600)]
    jest[300:300] = ["FAIL src/lib/b.test.ts", "  \u25cf parser \u203a rejects bad input", "",
                     "    Expected: 1", "    Received: 2"]
    jest += ["", "Test Suites: 1 failed, 1 passed, 2 total", "Tests:       1 failed, 600 passed, 601 total",
             "Snapshots:   0 total", "Time:        4.2 s", "Ran all test suites."] + ["done"] * 20
    text = run(Offload(), "\n".join(jest))
    assert "301: FAIL src/lib/b.test.ts\n302:   \u25cf parser \u203a rejects bad input\n" in text
    assert "\n609: Tests:       1 failed, 600 passed, 601 total\n" in text
    cargo = []
    for binary in range(4):
        cargo += ["", f"     Running tests/suite_{binary}.rs (target/debug/deps/suite_{binary}-0123)", "",
                  "running 120 tests"] + [f"test case_{n} ... {'FAILED' if (binary, n) == (1, 7) else 'ok'}"
                                          for n in range(120)]
        failed = 1 if binary == 1 else 0
        cargo += ["", f"test result: {'FAILED' if failed else 'ok'}. {120 - failed} passed; {failed} failed; "
                  "0 ignored; 0 measured; 0 filtered out; finished in 0.21s"]
    text = run(Offload(), "\n".join(cargo))
    assert ": test result: FAILED. 119 passed; 1 failed;" in text and ": test case_7 ... FAILED" in text
    assert text.count(": test result: ok. 120 passed;") == 2  # the third is in the tail


def test_offload_keeps_a_test_runs_totals_however_many_failures():
    reason = "AssertionError: assert parse_header(value) == expected_header_for_this_case"
    failures = [f"FAILED tests/test_mod.py::test_case_{n} - {reason}" for n in range(60)]
    log = [f"tests/test_mod.py::test_case_{n} FAILED" for n in range(60)] + failures
    log += ["=== 60 failed, 3 passed in 1.50s ===", *(f"cleanup step {n}" for n in range(30))]
    text = run(Offload(), "\n".join(log))
    assert "[cg: 41 more test-result lines in the elided part are not shown]" in text  # of 61
    assert f"\n61: FAILED tests/test_mod.py::test_case_0 - {reason}\n" in text  # the first, after error-like lines
    assert f"\n79: FAILED tests/test_mod.py::test_case_18 - {reason}\n121: === 60 failed, 3 passed in 1.50s ===\n" in text


@pytest.mark.parametrize("name", ["prose", "code with paths", "grep output", "a markdown table of paths"])
def test_offload_finds_no_diff_listing_or_test_run_where_there_is_none(name):
    rnd = random.Random(9)
    texts = {
        "prose": "\n".join(" ".join(rnd.choice(WORDS + ["and/or", "src/cg", "a", "the"]) for _ in range(14))
                           for _ in range(600)),
        "code with paths": "\n".join(f'    path_{n} = Path("src/cg/{rnd.choice(WORDS)}_{n}.py")  # ok in {n}s'
                                     for n in range(500)),
        "grep output": "\n".join(f"src/cg/{rnd.choice(WORDS)}.py:{n}:    return {rnd.choice(WORDS)}(value)"
                                 for n in range(500)),
        "a markdown table of paths": "| path | size |\n|---|---|\n" + "\n".join(
            f"| src/{rnd.choice(WORDS)}/{n}.py | {n} |" for n in range(700)),
    }
    text = run(Offload(), texts[name])
    assert text.count("[cg:") == 1 and "Test-result" not in text


result_lines = st.lists(st.one_of(
    st.sampled_from(["diff --git a/x.py b/x.py", "diff --git a/x b/y", "--- a/x.py", "+++ b/x.py", "@@ -1,2 +1,2 @@",
                     "+added", "-removed", "FAILED tests/t.py::x - boom", "=== 1 failed, 2 passed in 0.1s ===",
                     "ok  \tpkg\t0.1s", "--- FAIL: TestX (0.0s)", "./src/a.py", "src/b/c.js", "/abs/d/e.md", ".:",
                     "./src:", "src:", "", "E   assert 1", "error: bad", "Tests: 1 failed, 1 total"]),
    st.text(alphabet="ab /.:-+=\t\u25cf", max_size=30)), max_size=300)


@given(result_lines)
@settings(max_examples=300, deadline=None)
def test_offload_is_a_pure_function_that_keeps_its_contract(lines):
    text = "\n".join(lines)
    offload = Offload(min_tokens=40, head_lines=3, tail_lines=2, max_line_chars=20)
    outcome = offload.apply(text, context(text))
    assert outcome == offload.apply(text, context(text))
    if outcome is not None:
        assert marker(marker_id(text.encode())) in outcome.text.split("\n")[min(3, len(lines))]
        assert (outcome.original, outcome.marker_id) == (text.encode(), marker_id(text.encode()))


def test_golden_textclean_and_jsonformat():
    progress = "".join(f"\r\x1b[2K\x1b[36m[{'#' * n:<20}]\x1b[0m {n * 5}%" for n in range(21)) + "\r\nok\r\n"
    pretty = json.dumps({"name": "cg", "deps": {"ujson": ">=5.8", "attrs": ">=23.1"}, "n": [1, 2.5]}, indent=2)
    check_golden("textclean_progress.txt", run(TextClean(), progress))
    check_golden("jsonformat_package.txt", run(JsonFormat(), pretty))


_LOG_PIECES = st.sampled_from(["E", "E ", "\n", " ", "\r", "\t", "x", "error", "Errors", "xError", "ERROR", "failed",
                               "failures!", "panicked", "Traceback", "KeyException", "exception", "errored", "_fail",
                               "fatal:", "ok", "K", "ſ", "İ", "\x1c"])


@settings(max_examples=1500, deadline=None)
@example(text="E\nerror: the line a match of E and a line break covers")
@example(text="E\nE\nE\nerror: a hint of E and a line break must not hide the next line's")
@given(text=st.lists(_LOG_PIECES, max_size=40).map("".join))
def test_error_lines_are_found_as_the_pattern_finds_them(text):
    """The fast search decides which lines an excerpt keeps: it must find what the pattern does."""
    from cg.compaction.components import _ERROR_LINE, _error_line_matches

    assert [m.span() for m in _error_line_matches(text)] == [m.span() for m in _ERROR_LINE.finditer(text)]
