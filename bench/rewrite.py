"""Request rewrite: cg's rewrite of a ~1 MB Claude Code-shaped body, cold and warm, in one run.

    python bench/rewrite.py [--quick] [--json PATH]

In-process and pure: no sockets, no store. The body starts from
``tests/fixtures/claude-code/p_second_request_tool_result.json`` (its system prompt, its 24
tools and its first turns), and its history is grown, deterministically, with the turns a
coding session piles up until it serializes to about 1 MB: Bash outputs of various sizes
(pytest logs, npm and pip logs with progress-bar ``\\r`` redraws, git diffs; some with ANSI
colour codes), Read results, pretty-printed JSON outputs, Grep/Glob/Edit results, an Agent
result made of text blocks, two duplicate results (a re-run and a re-read), and assistant
text, thinking and tool_use blocks. It is serialized as Claude Code does
(``JSON.stringify``: no spaces, non-ASCII raw).

The rewrite is ``cg.compaction.rewrite.Rewriter.rewrite`` with the production configuration
(``cg.web.service.rewrite_config(Config(expand=True))``: all components, expand injected).
Measured, in interleaved rounds so drift on a shared machine hits every row alike:

- cold: a fresh Rewriter (empty memo) per sample;
- warm: the same Rewriter, the same body again (a re-sent history, every decision memoized);
- warm + 1 new turn: the history plus one assistant tool_use and its new result, never seen
  before (a fresh result each sample; ``cache_control`` moves to it, as Claude Code moves it):
  a small ``git status`` and a ~40 KB coloured pytest log that gets offloaded;
- baselines on the same bytes: ``ujson.loads`` + ``ujson.dumps`` and ``json.loads`` +
  ``json.dumps`` (outputs encoded to bytes, as cg's are), and each ``loads`` alone;
- the warm rewrite by phase (parse, expand injection, compaction plan, splice + encode);
- the ujson round trip and the warm rewrite each many times in a row (caches hot: a bound,
  not what a proxy sees between requests).

Times are time.perf_counter with the garbage collector off while timing (collected before
each batch); medians and p90. Also the body's size before and after, and how many tool
results each component changed. ``--json PATH`` writes every sample.
"""

from __future__ import annotations

import argparse
import base64
import gc
import hashlib
import json
import os
import platform
import random
import statistics
import sys
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import ujson

REPO = Path(__file__).resolve().parent.parent
try:
    import cg  # noqa: F401
except ImportError:  # not installed: use this checkout
    sys.path.insert(0, str(REPO))

import cg  # noqa: E402
from cg.compaction import expand  # noqa: E402
from cg.compaction.pipeline import plan  # noqa: E402
from cg.compaction.rewrite import Rewriter  # noqa: E402
from cg.compaction.tokens import estimate_tokens  # noqa: E402
from cg.web.config import Config  # noqa: E402
from cg.web.service import rewrite_config  # noqa: E402
from cg.wire.body import ParsedBody  # noqa: E402
from cg.wire.dialect import MESSAGES_SHAPE  # noqa: E402

clock = time.perf_counter
URI = b"/v1/messages?beta=true"
TARGET_BYTES = 1 << 20
SEED = 3
FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "claude-code" / "p_second_request_tool_result.json"
CLK_TCK = os.sysconf("SC_CLK_TCK")


def serialize(body: dict) -> bytes:
    """As Claude Code serializes a request (JSON.stringify: no spaces, non-ASCII raw)."""
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


# ---------------------------------------------------------------------------------------------
# Content: what a coding session's tool results look like

WORDS = (
    "the a to of and in is it for on with that this as be by are from at or not when then if "
    "request body cache token result value config store marker session history client proxy "
    "upstream response stream header buffer parse decode encode splice offset span index memo "
    "decision component output line error file path module test check update return build"
).split()
PKGS = (
    "lodash react react-dom typescript eslint prettier webpack babel-loader jest ts-node chalk "
    "commander yargs axios express debug semver glob minimatch rimraf uuid dotenv zod vite esbuild "
    "rollup postcss tailwindcss autoprefixer @types/node @babel/core @babel/preset-env"
).split()
PYPKGS = "numpy pandas requests urllib3 certifi idna charset-normalizer twisted attrs ujson hypothesis".split()
DIRS = ("src/cg", "src/cg/util", "tests", "tests/e2e", "lib", "app/models", "app/views", "scripts")
ESC = "\x1b"
BAR = "\u2501"  # rich's progress bar
TICK, CROSS = "\u2713", "\u2715"  # jest's passed and failed tests


class Gen:
    """Deterministic generators of realistic tool output (one random.Random)."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def words(self, n: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(n))

    def sentence(self) -> str:
        text = self.words(self.rng.randint(6, 18))
        return text[0].upper() + text[1:] + "."

    def ident(self) -> str:
        parts = [self.rng.choice(WORDS) for _ in range(self.rng.randint(1, 3))]
        return "_".join(parts)

    def path(self, ext: str = ".py") -> str:
        return f"{self.rng.choice(DIRS)}/{self.ident()}{ext}"

    def tool_id(self) -> str:
        alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
        return "toolu_01" + "".join(self.rng.choice(alphabet) for _ in range(22))

    def code_lines(self, n: int) -> list[str]:
        rng = self.rng
        out = [f'"""{self.sentence()}"""', "", "import json", "import re", "from pathlib import Path", ""]
        templates = (
            "    {a} = {b}.get({q}{c}{q}, {n})",
            "    if {a} is None:",
            "        return {b}",
            "    for {a} in {b}:",
            "        {a}.append({b}[{n}:{m}])",
            "    # {words}",
            "    {a} = json.loads({b}.decode({q}utf-8{q}))",
            "    raise ValueError(f{q}{words}: {{{a}!r}}{q})",
            "    return {{{q}{a}{q}: {b}, {q}{c}{q}: {n}}}",
            "    {a} += len({b}) * {n}",
        )
        while len(out) < n:
            out += [f"def {self.ident()}({self.ident()}: str, {self.ident()}: int = {rng.randint(0, 99)}) -> dict:",
                    f'    """{self.sentence()}"""']
            for _ in range(rng.randint(3, 14)):
                out.append(rng.choice(templates).format(
                    a=self.ident(), b=self.ident(), c=self.ident(), n=rng.randint(0, 512),
                    m=rng.randint(512, 4096), q=rng.choice("\"'"), words=self.words(rng.randint(3, 9))))
            out.append("")
            if rng.random() < 0.2:
                out += ["", f"class {self.ident().title().replace('_', '')}:", f'    """{self.sentence()}"""', ""]
        return out[:n]

    # -- Claude Code's own tools

    def read_result(self, n_lines: int, lines: list[str] | None = None) -> str:
        """Read: `cat -n`-style lines with Claude Code's arrow, and its system reminder."""
        lines = lines if lines is not None else self.code_lines(n_lines)
        body = "\n".join(f"{i:>6}\u2192{line}" for i, line in enumerate(lines, 1))
        return body + (
            "\n\n<system-reminder>\nWhenever you read a file, you should consider whether it would be "
            "considered malware. You CAN and SHOULD provide analysis of malware, what it is doing. But you "
            "MUST refuse to improve or augment the code.\n</system-reminder>\n"
        )

    def edit_result(self, path: str) -> str:
        start = self.rng.randint(1, 400)
        lines = self.code_lines(12)
        snippet = "\n".join(f"{start + i:>6}\u2192{line}" for i, line in enumerate(lines))
        return (f"The file /home/dev/proj/{path} has been updated. Here's the result of running `cat -n` "
                f"on a snippet of the edited file:\n{snippet}")

    def grep_result(self, n: int) -> str:
        rng = self.rng
        return "\n".join(f"{self.path()}:{rng.randint(1, 900)}:    {self.ident()} = {self.ident()}({self.ident()})"
                         for _ in range(n))

    def glob_result(self, n: int) -> str:
        return "\n".join(f"/home/dev/proj/{self.path(self.rng.choice(('.py', '.ts', '.md')))}" for _ in range(n))

    # -- Bash outputs

    def pytest_log(self, n_tests: int, *, color: bool, verbose: bool, failures: int) -> str:
        rng = self.rng

        def paint(text: str, code: str) -> str:
            return f"{ESC}[{code}m{text}{ESC}[0m" if color else text

        out = [paint("=" * 29 + " test session starts " + "=" * 30, "1"),
               "platform linux -- Python 3.11.7, pytest-8.3.2, pluggy-1.5.0",
               "rootdir: /home/dev/proj", "configfile: pyproject.toml",
               "plugins: hypothesis-6.108.5, cov-5.0.0, twisted-1.14.3",
               paint(f"collected {n_tests} items", "1"), ""]
        failed = set(rng.sample(range(n_tests), min(failures, n_tests)))
        names = []
        done = 0
        while done < n_tests:
            path = f"tests/test_{self.ident()}.py"
            count = min(n_tests - done, rng.randint(5, 60))
            if verbose:
                for i in range(done, done + count):
                    name = f"{path}::test_{self.ident()}" + (f"[case{rng.randint(0, 9)}]" if rng.random() < 0.3 else "")
                    names.append(name)
                    status = paint("FAILED", "31") if i in failed else paint("PASSED", "32")
                    pct = f"[{100 * (i + 1) // n_tests:>3}%]"
                    out.append(f"{name} {status}".ljust(72) + " " + paint(pct, "32"))
            else:
                marks = "".join(paint("F", "31") if i in failed else paint(".", "32") for i in range(done, done + count))
                out.append(f"{path} {marks}".ljust(60) + paint(f" [{100 * (done + count) // n_tests:>3}%]", "32"))
                names += [f"{path}::test_{self.ident()}" for _ in range(count)]
            done += count
        if failed:
            out += ["", paint("=" * 35 + " FAILURES " + "=" * 35, "1")]
            for i in sorted(failed):
                test = names[i].split("::")[-1]
                code = self.code_lines(rng.randint(6, 16))[6:]
                out += [paint(f"{'_' * 20} {test} {'_' * 20}", "1;31"), ""]
                out += [f"    {line}" for line in code]
                out += [f">       assert {self.ident()}({self.ident()}) == {rng.randint(0, 99)}",
                        paint(f"E       assert {rng.randint(100, 999)} == {rng.randint(0, 99)}", "1;31"),
                        paint(f"E        +  where {rng.randint(100, 999)} = {self.ident()}('{self.ident()}')", "1;31"),
                        "", f"{names[i].split('::')[0]}:{rng.randint(10, 700)}: AssertionError"]
            out += [paint("=" * 29 + " short test summary info " + "=" * 26, "36")]
            out += [f"{paint('FAILED', '31')} {names[i]} - AssertionError: assert {rng.randint(100, 999)} == 0"
                    for i in sorted(failed)]
        summary = f"{len(failed)} failed, {n_tests - len(failed)} passed" if failed else f"{n_tests} passed"
        out.append(paint(f"{'=' * 20} {summary} in {rng.uniform(0.5, 90):.2f}s {'=' * 20}", "31" if failed else "32"))
        return "\n".join(out)

    def npm_log(self, n_packages: int) -> str:
        """npm install with its spinner redrawn in place (\\r + erase line), then the summary."""
        rng = self.rng
        spin = "\u280b\u2819\u2839\u2838\u283c\u2834\u2826\u2827\u2807\u280f"
        redraws = []
        for i in range(n_packages):
            pkg = rng.choice(PKGS)
            bar = "#" * (20 * i // n_packages)
            redraws.append(f"\r{ESC}[K\u2e28{bar:<20}\u2e29 {spin[i % 10]} reify:{pkg}: timing reifyNode:"
                           f"node_modules/{pkg} Completed in {rng.randint(1, 900)}ms")
        out = ["".join(redraws) + f"\r{ESC}[K"]
        out += [f"npm {ESC}[33mWARN{ESC}[39m deprecated {rng.choice(PKGS)}@{rng.randint(1, 9)}.{rng.randint(0, 20)}.0: "
                f"{self.sentence()}" for _ in range(rng.randint(2, 8))]
        out += ["", f"added {n_packages * 7} packages, and audited {n_packages * 7 + 1} packages in {rng.randint(3, 90)}s",
                "", f"{n_packages // 4} packages are looking for funding", "  run `npm fund` for details", "",
                f"found {ESC}[32m{ESC}[1m0{ESC}[22m{ESC}[39m vulnerabilities"]
        return "\n".join(out)

    def pip_log(self, n_packages: int) -> str:
        """pip install with rich progress bars: each redrawn a few times with \\r, in colour."""
        rng = self.rng
        out = []
        for _ in range(n_packages):
            pkg = rng.choice(PYPKGS)
            version = f"{rng.randint(1, 30)}.{rng.randint(0, 12)}.{rng.randint(0, 9)}"
            size = rng.uniform(0.1, 20)
            out.append(f"Collecting {pkg}=={version}")
            frames = []
            for step in range(1, 6):
                filled = 40 * step // 5
                frames.append(f"\r   {ESC}[38;2;249;38;114m{BAR * filled}{ESC}[0m{ESC}[38;5;237m{BAR * (40 - filled)}"
                              f"{ESC}[0m {ESC}[32m{size * step / 5:.1f}/{size:.1f} MB{ESC}[0m {ESC}[31m"
                              f"{rng.uniform(1, 40):.1f} MB/s{ESC}[0m eta {ESC}[36m0:00:0{5 - step}{ESC}[0m")
            out.append(f"  Downloading {pkg}-{version}-py3-none-any.whl ({size:.1f} MB)")
            out.append("".join(frames))
        out.append("Installing collected packages: " + ", ".join(rng.sample(PYPKGS, 5)))
        out.append("Successfully installed " + " ".join(f"{p}-{rng.randint(1, 9)}.0" for p in rng.sample(PYPKGS, 5)))
        return "\n".join(out)

    def git_diff(self, n_files: int, *, color: bool) -> str:
        rng = self.rng

        def paint(text: str, code: str) -> str:
            return f"{ESC}[{code}m{text}{ESC}[m" if color else text

        out = []
        for _ in range(n_files):
            path = self.path()
            out += [paint(f"diff --git a/{path} b/{path}", "1"),
                    paint(f"index {rng.getrandbits(28):07x}..{rng.getrandbits(28):07x} 100644", "1"),
                    paint(f"--- a/{path}", "1"), paint(f"+++ b/{path}", "1")]
            for _ in range(rng.randint(1, 5)):
                start = rng.randint(1, 600)
                lines = self.code_lines(rng.randint(8, 30))[6:]
                out.append(paint(f"@@ -{start},{len(lines)} +{start},{len(lines) + 1} @@ def {self.ident()}(", "36"))
                for line in lines:
                    roll = rng.random()
                    if roll < 0.15:
                        out.append(paint(f"-{line}", "31"))
                    elif roll < 0.3:
                        out.append(paint(f"+{line}", "32"))
                    else:
                        out.append(f" {line}")
        return "\n".join(out)

    def json_output(self, n_items: int, indent: int) -> str:
        """`gh api`-style pretty-printed JSON: a list of nested objects."""
        rng = self.rng
        items = []
        for i in range(n_items):
            items.append({
                "id": rng.randint(10**8, 10**9), "number": i + 1, "state": rng.choice(["open", "closed"]),
                "title": self.sentence(), "user": {"login": self.ident(), "id": rng.randint(1, 10**7),
                                                    "site_admin": False, "type": "User"},
                "labels": [{"name": rng.choice(WORDS), "color": f"{rng.getrandbits(24):06x}"}
                           for _ in range(rng.randint(0, 3))],
                "created_at": f"2026-{rng.randint(1, 11):02d}-{rng.randint(1, 28):02d}T{rng.randint(0, 23):02d}:"
                              f"{rng.randint(0, 59):02d}:00Z",
                "body": self.sentence() + " Caf\u00e9 \u2014 " + self.sentence(),
                "draft": rng.random() < 0.2, "comments": rng.randint(0, 40), "score": round(rng.uniform(0, 1), 4),
                "url": f"https://api.github.com/repos/acme/proj/pulls/{i + 1}",
            })
        return json.dumps(items, indent=indent, ensure_ascii=False)

    def git_status(self) -> str:
        changed = "\n".join(f"\tmodified:   {self.path()}" for _ in range(self.rng.randint(1, 6)))
        return ("On branch main\nYour branch is up to date with 'origin/main'.\n\nChanges not staged for commit:\n"
                '  (use "git add <file>..." to update what will be committed)\n'
                f"{changed}\n\nno changes added to commit (use \"git add\" and/or \"git commit -a\")")

    def ls_output(self, n: int) -> str:
        rng = self.rng
        return f"total {n * 4}\n" + "\n".join(
            f"-rw-r--r-- 1 dev dev {rng.randint(100, 90000):>6} Nov {rng.randint(1, 29):>2} 1{rng.randint(0, 9)}:"
            f"{rng.randint(10, 59)} {self.ident()}.py" for _ in range(n))

    # -- Listings: find, git ls-files, ls -R

    def project_tree(self, n_files: int, *, javascript: bool) -> dict[str, list[str]]:
        """A project's directories ("" is its root) and the files in each, about ``n_files`` in all:
        a package with subpackages, tests, docs, scripts and CI; a JavaScript project also has
        ``node_modules``, most of its files in a few of its packages."""
        rng = self.rng
        if javascript:
            tops = ["src/components", "src/hooks", "src/lib", "src/pages", "src/pages/api", "tests", "public",
                    "scripts", ".github/workflows"]
            tops += [f"node_modules/{pkg}/{sub}" for pkg in rng.sample(PKGS, 12) for sub in ("", "lib", "dist")]
            root = ["package.json", "package-lock.json", "tsconfig.json", "README.md", ".gitignore"]
            exts = (".ts", ".tsx", ".js", ".json", ".d.ts", ".md")
        else:
            package = f"src/{self.ident().split('_')[0]}"
            tops = [package] + [f"{package}/{self.ident()}" for _ in range(rng.randint(2, 6))]
            tops += ["tests", "tests/unit", "tests/integration", "tests/fixtures", "docs", "docs/how-to", "scripts",
                     ".github/workflows", "bench"]
            root = ["pyproject.toml", "README.md", "LICENSE", ".gitignore", "tox.ini"]
            exts = (".py", ".py", ".py", ".json", ".md", ".txt", ".yml")
        directories = sorted(set(tops))
        weights = [rng.expovariate(1.0) * (4 if d.startswith(("node_modules", "src")) else 1) for d in directories]
        tree: dict[str, list[str]] = {"": root}
        for directory in rng.choices(directories, weights=weights, k=max(0, n_files - len(root))):
            names = tree.setdefault(directory, [])
            names.append(f"{self.ident()}{rng.choice(exts)}")
        for directory in list(tree):  # every parent directory exists, if empty of files
            while "/" in directory:
                directory = directory.rsplit("/", 1)[0]
                tree.setdefault(directory, [])
            tree.setdefault(directory, [])
        return {d: sorted(set(names)) for d, names in sorted(tree.items())}

    def listing(self, n_files: int, style: str) -> str:
        """A project's files as ``find . -type f`` (readdir order), ``git ls-files`` (sorted, no
        node_modules) or ``ls -R`` (a header per directory, its entries sorted) lists them."""
        rng = self.rng
        tree = self.project_tree(n_files, javascript=rng.random() < 0.4)
        children: dict[str, list[str]] = {d: [] for d in tree}
        for directory in tree:
            if directory:
                parent = directory.rsplit("/", 1)[0] if "/" in directory else ""
                children[parent].append(directory)
        if style == "git ls-files":
            return "\n".join(sorted(f"{d}/{n}" if d else n for d, names in tree.items() for n in names
                                    if not d.startswith("node_modules")))
        if style == "ls -R":
            out: list[str] = []

            def walk_sorted(directory: str) -> None:
                subdirs = sorted(children[directory])
                entries = sorted(tree[directory] + [d.rsplit("/", 1)[-1] for d in subdirs])
                out.extend(["" if out else None, f"./{directory}:" if directory else ".:", *entries])
                for subdir in subdirs:
                    walk_sorted(subdir)

            walk_sorted("")
            return "\n".join(line for line in out if line is not None)
        paths: list[str] = []

        def walk(directory: str) -> None:  # find: each directory's entries in readdir order
            entries = [(False, n) for n in tree[directory]] + [(True, d) for d in children[directory]]
            rng.shuffle(entries)
            for is_directory, name in entries:
                if is_directory:
                    walk(name)
                else:
                    paths.append(f"./{directory}/{name}" if directory else f"./{name}")

        walk("")
        return "\n".join(paths)

    # -- Test runs besides pytest's: jest, go test, cargo test

    def jest_log(self, n_suites: int, failures: int, *, verbose: bool) -> str:
        """``npx jest``: a PASS/FAIL line per suite, each failure's report under its suite, the totals."""
        rng = self.rng
        failing = set(rng.sample(range(n_suites), min(failures, n_suites)))
        out: list[str] = []
        counts = {"suites failed": 0, "tests failed": 0, "tests": 0}
        for index in range(n_suites):
            path = f"src/{rng.choice(('components', 'hooks', 'lib', 'utils', 'pages'))}/{self.ident()}.test.ts"
            names = [self.words(rng.randint(2, 6)) for _ in range(rng.randint(2, 14))]
            failed = rng.randint(1, min(3, len(names))) if index in failing else 0
            counts["suites failed"] += bool(failed)
            counts["tests failed"] += failed
            counts["tests"] += len(names)
            timing = f" ({rng.uniform(1, 9):.3f} s)" if rng.random() < 0.3 else ""
            out.append(f"{'FAIL' if failed else 'PASS'} {path}{timing}")
            describe = self.ident()
            if verbose:
                out.append(f"  {describe}")
                out += [f"    {CROSS if k < failed else TICK} {name} ({rng.randint(1, 40)} ms)"
                        for k, name in enumerate(names)]
            for k in range(failed):
                line = rng.randint(10, 200)
                out += ["", f"  \u25cf {describe} \u203a {names[k]}", "",
                        "    expect(received).toBe(expected) // Object.is equality", "",
                        f"    Expected: {rng.randint(0, 99)}", f"    Received: {rng.randint(100, 999)}", "",
                        f"      {line - 1} |   const {self.ident()} = {self.ident()}({self.ident()});",
                        f"    > {line} |   expect({self.ident()}).toBe({rng.randint(0, 99)});",
                        f"      {' ' * len(str(line))} |                  ^", "",
                        f"      at Object.<anonymous> ({path}:{line}:{rng.randint(5, 40)})", ""]
        suites = (f"{counts['suites failed']} failed, " if counts["suites failed"] else "") + \
            f"{n_suites - counts['suites failed']} passed, {n_suites} total"
        tests = (f"{counts['tests failed']} failed, " if counts["tests failed"] else "") + \
            f"{counts['tests'] - counts['tests failed']} passed, {counts['tests']} total"
        out += ["", f"Test Suites: {suites}", f"Tests:       {tests}", "Snapshots:   0 total",
                f"Time:        {rng.uniform(2, 60):.3f} s", "Ran all test suites."]
        return "\n".join(out)

    def go_test_log(self, n_packages: int, failures: int, *, verbose: bool) -> str:
        """``go test ./...`` (``-v``: each test's RUN and PASS lines): a line per package, each failed
        test's report before its package's FAIL line."""
        rng = self.rng
        module = "github.com/acme/proj"
        failing = set(rng.sample(range(n_packages), min(failures, n_packages)))
        out: list[str] = []
        for index in range(n_packages):
            package = f"{module}/{rng.choice(('internal', 'pkg', 'cmd'))}/{self.ident().replace('_', '')}"
            if rng.random() < 0.1 and index not in failing:
                out.append(f"?   \t{package}\t[no test files]")
                continue
            tests = [f"Test{self.ident().title().replace('_', '')}" for _ in range(rng.randint(2, 12))]
            failed = set(rng.sample(tests, rng.randint(1, 2))) if index in failing else set()
            for test in tests:
                if verbose:
                    out.append(f"=== RUN   {test}")
                if test in failed:
                    out += [f"--- FAIL: {test} ({rng.uniform(0, 0.5):.2f}s)",
                            f"    {self.ident()}_test.go:{rng.randint(10, 400)}: expected {rng.randint(0, 99)}, "
                            f"got {rng.randint(100, 999)}"]
                elif verbose:
                    out.append(f"--- PASS: {test} ({rng.uniform(0, 0.5):.2f}s)")
            if failed:
                out += ["FAIL", f"FAIL\t{package}\t{rng.uniform(0.01, 3):.3f}s"]
            else:
                out += (["PASS"] if verbose else []) + [
                    f"ok  \t{package}\t" + ("(cached)" if rng.random() < 0.3 else f"{rng.uniform(0.01, 3):.3f}s")]
        if failing:
            out.append("FAIL")
        return "\n".join(out)

    def cargo_test_log(self, n_binaries: int, failures: int, *, fail_fast: bool) -> str:
        """``cargo test``: the build, then per test binary its tests and its ``test result:`` line; a
        failing binary's panics and names. It stops after the first failing binary unless
        ``--no-fail-fast``."""
        rng = self.rng
        crate = self.ident().split("_")[0]
        out = [f"   Compiling {self.ident().replace('_', '-')} v0.{rng.randint(1, 9)}.{rng.randint(0, 9)}"
               for _ in range(rng.randint(3, 20))]
        out += [f"   Compiling {crate} v0.1.0 (/home/dev/proj)",
                f"    Finished `test` profile [unoptimized + debuginfo] target(s) in {rng.uniform(2, 90):.2f}s"]
        failing = set(rng.sample(range(n_binaries), min(failures, n_binaries)))
        for index in range(n_binaries):
            source = "src/lib.rs" if index == 0 else f"tests/{self.ident()}.rs"
            kind = "unittests " if index == 0 else ""
            out += [f"     Running {kind}{source} (target/debug/deps/{crate}-{rng.getrandbits(64):016x})", ""]
            tests = [f"{self.ident()}::{self.ident()}" for _ in range(rng.randint(3, 60))]
            failed = rng.sample(tests, rng.randint(1, 3)) if index in failing else []
            out.append(f"running {len(tests)} tests")
            out += [f"test {t} ... {'FAILED' if t in failed else 'ok'}" for t in tests]
            out.append("")
            if failed:
                out += ["failures:", ""]
                for t in failed:
                    out += [f"---- {t} stdout ----",
                            f"thread '{t}' panicked at src/{t.split('::')[0]}.rs:{rng.randint(5, 400)}:{rng.randint(5, 40)}:",
                            "assertion `left == right` failed", f"  left: {rng.randint(0, 99)}",
                            f" right: {rng.randint(100, 999)}",
                            "note: run with `RUST_BACKTRACE=1` environment variable to display a backtrace", ""]
                out += ["", "failures:"] + [f"    {t}" for t in failed] + [""]
            result = "FAILED" if failed else "ok"
            out += [f"test result: {result}. {len(tests) - len(failed)} passed; {len(failed)} failed; 0 ignored; "
                    f"0 measured; 0 filtered out; finished in {rng.uniform(0, 5):.2f}s", ""]
            if failed:
                out.append(f"error: test failed, to rerun pass `--{'lib' if index == 0 else 'test'}`")
                if fail_fast:
                    break
        return "\n".join(out)

    def thinking(self) -> dict:
        sig = base64.b64encode(self.rng.randbytes(self.rng.randint(300, 700))).decode()
        return {"type": "thinking", "thinking": " ".join(self.sentence() for _ in range(self.rng.randint(2, 10))),
                "signature": sig}


# ---------------------------------------------------------------------------------------------
# The body


def tool_use(gen: Gen, name: str, tool_input: dict) -> dict:
    return {"type": "tool_use", "id": gen.tool_id(), "name": name, "input": tool_input}


def tool_result(use: dict, content, is_error: bool = False) -> dict:
    return {"tool_use_id": use["id"], "type": "tool_result", "content": content, "is_error": is_error}


def turn(gen: Gen, calls: list[tuple[str, dict, object, bool]]) -> list[dict]:
    """One assistant message (maybe thinking, maybe text, the tool_use blocks) and its results."""
    rng = gen.rng
    content = []
    if rng.random() < 0.25:
        content.append(gen.thinking())
    if rng.random() < 0.7:
        content.append({"type": "text", "text": " ".join(gen.sentence() for _ in range(rng.randint(1, 4)))})
    uses = [tool_use(gen, name, tool_input) for name, tool_input, _, _ in calls]
    results = [tool_result(use, result, is_error) for use, (_, _, result, is_error) in zip(uses, calls)]
    return [{"role": "assistant", "content": content + uses}, {"role": "user", "content": results}]


def bash(command: str, output: str, description: str, exit_code: int = 0) -> tuple[str, dict, str, bool]:
    if exit_code:
        output = f"Exit code {exit_code}\n{output}"
    return ("Bash", {"command": command, "description": description}, output, bool(exit_code))


KINDS = {  # a turn's kind: its weight in the random mix
    "read": 22, "pytest": 16, "diff": 10, "json": 7, "npm": 3, "pip": 3, "grep": 8, "edit": 12,
    "small": 10, "parallel": 7, "agent": 2,
}
# Kinds calls_of also makes, outside KINDS' mix (bench/sweep.py adds them to its sessions): a
# project's file listing, and test runs with more failures and other runners than KINDS' pytest.
MORE_KINDS = {"listing": 5, "test runs": 8}


def calls_of(gen: Gen, kind: str, files: dict[str, list[str]]) -> list[tuple[str, dict, object, bool]]:
    """One turn's tool calls of a kind (sizes vary widely, as in a coding session)."""
    rng = gen.rng
    if kind == "read":
        path = gen.path(rng.choice((".py", ".py", ".ts")))
        lines = gen.code_lines(rng.choice((40, 120, 300, 600, 900)))
        files[path] = lines
        return [("Read", {"file_path": f"/home/dev/proj/{path}"}, gen.read_result(0, lines), False)]
    if kind == "pytest":
        verbose = rng.random() < 0.5
        n = rng.choice((12, 40, 150, 400)) if verbose else rng.choice((50, 300, 1200))
        failures = rng.choice((0, 0, 1, 3))
        log = gen.pytest_log(n, color=rng.random() < 0.4, verbose=verbose, failures=failures)
        return [bash("python -m pytest" + (" -v" if verbose else " -q") + " --color=auto", log,
                     "Run the test suite", 1 if failures else 0)]
    if kind == "diff":
        return [bash("git diff" + (" --color=always" if rng.random() < 0.4 else ""),
                     gen.git_diff(rng.randint(1, 8), color=rng.random() < 0.4), "Show the working tree diff")]
    if kind == "json":
        return [bash("gh api repos/acme/proj/pulls", gen.json_output(rng.choice((3, 15, 60)), rng.choice((2, 2, 4))),
                     "List open pull requests")]
    if kind == "npm":
        return [bash("npm install", gen.npm_log(rng.choice((30, 80, 200))), "Install dependencies")]
    if kind == "pip":
        return [bash("pip install -e '.[test]'", gen.pip_log(rng.choice((5, 20, 40))), "Install the package")]
    if kind == "grep":
        return [("Grep", {"pattern": gen.ident(), "output_mode": "content", "-n": True},
                 gen.grep_result(rng.choice((3, 20, 80))), False)]
    if kind == "edit":
        path = gen.path()
        old, new = gen.code_lines(rng.randint(7, 15))[6:], gen.code_lines(rng.randint(7, 18))[6:]
        return [("Edit", {"file_path": f"/home/dev/proj/{path}", "old_string": "\n".join(old),
                          "new_string": "\n".join(new)}, gen.edit_result(path), False)]
    if kind == "small":
        return [rng.choice((bash("git status", gen.git_status(), "Show working tree status"),
                            bash("ls -la src/cg", gen.ls_output(rng.randint(5, 30)), "List the package"),
                            bash("echo done", "done", "Print done")))]
    if kind == "parallel":  # three calls in one assistant message, three results in one user message
        return [("Glob", {"pattern": "**/*.py"}, gen.glob_result(rng.randint(5, 60)), False),
                ("Grep", {"pattern": gen.ident(), "output_mode": "files_with_matches"}, gen.glob_result(rng.randint(1, 9)), False),
                bash("git log --oneline -20", "\n".join(f"{rng.getrandbits(28):07x} {gen.sentence()}" for _ in range(20)),
                     "Show recent commits")]
    if kind == "listing":
        style = rng.choice(("find", "git ls-files", "ls -R"))
        command = {"find": "find . -type f", "git ls-files": "git ls-files", "ls -R": "ls -R"}[style]
        return [bash(command, gen.listing(rng.choice((120, 300, 700, 1500)), style), "List the project's files")]
    if kind == "test runs":  # pytest with many failures, jest, go test, cargo test
        runner = rng.choice(("pytest", "jest", "go", "cargo"))
        failures = rng.choice((0, 1, 3, 8, 20))
        if runner == "pytest":
            log = gen.pytest_log(rng.choice((300, 1200)), color=False, verbose=rng.random() < 0.5, failures=failures)
            return [bash("python -m pytest", log, "Run the test suite", 1 if failures else 0)]
        if runner == "jest":
            log = gen.jest_log(rng.choice((20, 60, 150)), failures, verbose=rng.random() < 0.5)
            return [bash("npx jest", log, "Run the test suite", 1 if failures else 0)]
        if runner == "go":
            log = gen.go_test_log(rng.choice((15, 40, 100)), failures, verbose=rng.random() < 0.5)
            return [bash("go test" + (" -v" if "=== RUN" in log else "") + " ./...", log, "Run the tests",
                         1 if failures else 0)]
        fail_fast = rng.random() < 0.6
        log = gen.cargo_test_log(rng.choice((3, 8, 15)), min(failures, 3), fail_fast=fail_fast)
        return [bash("cargo test" + ("" if fail_fast else " --no-fail-fast"), log, "Run the tests",
                     101 if "test result: FAILED" in log else 0)]
    # agent: a subagent's report, as a list of text blocks
    report = [{"type": "text", "text": "\n\n".join(gen.sentence() * rng.randint(1, 3) for _ in range(rng.randint(4, 20)))},
              {"type": "text", "text": f"agentId: {rng.getrandbits(64):016x}"}]
    return [("Agent", {"description": "Survey the code", "prompt": gen.sentence(), "subagent_type": "general-purpose"},
             report, False)]


def build_body(fixture: dict, target: int = TARGET_BYTES) -> tuple[dict, dict]:
    """The fixture's body with its history grown to about `target` bytes; also what went in.

    Every kind of turn comes at least once (in a shuffled order), then they come at random by
    weight; at fixed points a pytest run is repeated with the same output and a file is read again.
    """
    gen = Gen(SEED)
    rng = gen.rng
    body = json.loads(json.dumps(fixture["body"]))
    messages = body["messages"]
    for message in messages:  # Claude Code marks only the newest message; it is re-marked at the end
        for block in message["content"] if isinstance(message["content"], list) else ():
            block.pop("cache_control", None)
    kinds: dict[str, list[int]] = {}  # kind -> [turns, bytes]
    files: dict[str, list[str]] = {}
    first = rng.sample(sorted(KINDS), len(KINDS))
    size = len(serialize(body))
    rerun = None
    reread = False
    while size < target:
        if rerun is None and size > target * 0.3:  # a pytest run; it is repeated later, same output
            kind = "pytest (repeated later)"
            rerun = bash("python -m pytest tests/test_store.py -v",
                         gen.pytest_log(60, color=False, verbose=True, failures=1), "Run the store tests", 1)
            calls = [rerun]
        elif rerun not in (None, "done") and size > target * 0.55:
            kind, calls, rerun = "duplicate: the same pytest output", [rerun], "done"
        elif not reread and size > target * 0.7:  # a file read again, unchanged
            path = sorted(files)[0]
            kind, reread = "duplicate: a file read again", True
            calls = [("Read", {"file_path": f"/home/dev/proj/{path}"}, gen.read_result(0, files[path]), False)]
        else:
            kind = first.pop() if first else rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
            calls = calls_of(gen, kind, files)
        new = turn(gen, calls)
        messages += new
        added = sum(len(serialize(m)) + 1 for m in new)
        size += added
        counts = kinds.setdefault(kind, [0, 0])
        counts[0] += 1
        counts[1] += added
    messages[-1]["content"][-1]["cache_control"] = {"type": "ephemeral"}
    return body, kinds


def with_new_turn(body: dict, gen: Gen, big: bool) -> bytes:
    """body plus one never-seen turn, `cache_control` moved to it as Claude Code moves it."""
    if big:
        calls = [bash("python -m pytest -v --color=yes", gen.pytest_log(260, color=True, verbose=True, failures=2),
                      "Run the test suite", 1)]
    else:
        calls = [bash("git status", gen.git_status(), "Show working tree status")]
    new = turn(gen, calls)
    new[-1]["content"][-1]["cache_control"] = {"type": "ephemeral"}
    last = dict(body["messages"][-1])
    last["content"] = [dict(block) for block in last["content"]]
    last["content"][-1].pop("cache_control", None)
    return serialize({**body, "messages": body["messages"][:-1] + [last] + new})


# ---------------------------------------------------------------------------------------------
# Measuring


@contextmanager
def no_gc():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def timed(fn, *args) -> float:
    start = clock()
    fn(*args)
    return clock() - start


def p90(samples: list[float]) -> float:
    return statistics.quantiles(samples, n=10, method="inclusive")[8] if len(samples) > 1 else samples[0]


def cpu_busy() -> tuple[int, int]:
    """Machine-wide busy and steal jiffies, from /proc/stat (0, 0 where there is none)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    steal = fields[7] if len(fields) > 7 else 0
    return sum(fields[:8]) - idle - steal, steal


def machine() -> dict:
    model = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"nproc": os.cpu_count(), "cpu": model, "python": platform.python_version(),
            "implementation": platform.python_implementation(), "ujson": ujson.__version__,
            "cg": str(Path(cg.__file__).resolve().parent)}


def describe(raw: bytes, result) -> dict:
    """Sizes before and after, and per component: results changed and estimated tokens saved."""
    changed: dict[str, set] = {}
    saved: Counter = Counter()
    for change in result.changes:
        where = (change.message_index, change.block_index, change.part_index)
        changed.setdefault(change.component, set()).add(where)
        saved[change.component] += change.tokens_before - change.tokens_after
    results = 0
    for message in json.loads(raw)["messages"]:
        if message.get("role") == "user" and isinstance(message.get("content"), list):
            results += sum(1 for block in message["content"] if isinstance(block, dict)
                           and block.get("type") == "tool_result")
    return {
        "bytes_before": len(raw), "bytes_after": len(result.body),
        "tokens_before": estimate_tokens(raw.decode()), "tokens_after": estimate_tokens(result.body.decode()),
        "tool_results": results, "results_changed": len({w for ws in changed.values() for w in ws}),
        "originals": len(result.originals), "original_bytes": sum(map(len, result.originals.values())),
        "components": {name: {"results": len(where), "tokens_saved": saved[name]} for name, where in changed.items()},
        "injected": result.injected,
    }


def run(quick: bool) -> dict:
    if not FIXTURE.is_file():
        raise SystemExit(f"no fixture at {FIXTURE}: run from a checkout of cg")
    fixture = json.loads(FIXTURE.read_text())
    body, kinds = build_body(fixture)
    raw = serialize(body)
    config = rewrite_config(Config(expand=True))
    # rounds (one cold sample each) x cycles (one sample of each other row each)
    rounds, cycles, turn_n = (4, 6, 2) if quick else (25, 16, 4)

    # Sanity: the rewrite is deterministic, the memo does not change it, and the result is JSON.
    first = Rewriter(config).rewrite(raw, URI)
    warm_rewriter = Rewriter(config)
    again = [warm_rewriter.rewrite(raw, URI) for _ in range(3)][-1]
    assert first is not None and first.body == again.body, "the warm rewrite differs from the cold one"
    json.loads(first.body)

    samples: dict[str, list[float]] = {key: [] for key in (
        "cold", "warm", "turn_small", "turn_big", "ujson", "json", "ujson_loads", "json_loads",
        "warm_in_a_row", "ujson_in_a_row",
        "phase_parse", "phase_inject", "phase_plan", "phase_apply")}
    gen = Gen(SEED + 1)
    turn_sizes: dict[str, list[int]] = {"turn_small": [], "turn_big": []}

    def ujson_round_trip(data: bytes):
        ujson.dumps(ujson.loads(data), ensure_ascii=False, escape_forward_slashes=False).encode("utf-8")

    def json_round_trip(data: bytes):
        json.dumps(json.loads(data), separators=(",", ":"), ensure_ascii=False).encode("utf-8")

    def phases(data: bytes):  # what Rewriter.rewrite does, phase by phase
        start = clock()
        parsed = ParsedBody.parse(data)
        parsed_at = clock()
        edits = expand.injection(parsed, MESSAGES_SHAPE)
        injected_at = clock()
        planned = plan(parsed, MESSAGES_SHAPE, config.compact, True, warm_rewriter.memo)
        planned_at = clock()
        parsed.apply(planned.edits + edits)
        applied_at = clock()
        samples["phase_parse"].append(parsed_at - start)
        samples["phase_inject"].append(injected_at - parsed_at)
        samples["phase_plan"].append(planned_at - injected_at)
        samples["phase_apply"].append(applied_at - planned_at)

    busy0, steal0, own0, wall0 = *cpu_busy(), os.times(), clock()
    for _ in range(rounds):
        # Bodies with a new turn are built first (each 1 MB): building one between samples would
        # evict the caches before some rows and not others.
        turns = [(with_new_turn(body, gen, False), with_new_turn(body, gen, True)) for _ in range(turn_n)]
        for small, big in turns:
            turn_sizes["turn_small"].append(len(small) - len(raw))
            turn_sizes["turn_big"].append(len(big) - len(raw))
        with no_gc():
            samples["cold"].append(timed(Rewriter(config).rewrite, raw, URI))
            for cycle in range(cycles):  # every row in turn, so drift hits them all alike
                samples["ujson"].append(timed(ujson_round_trip, raw))
                samples["json"].append(timed(json_round_trip, raw))
                samples["ujson_loads"].append(timed(ujson.loads, raw))
                samples["json_loads"].append(timed(json.loads, raw))
                samples["warm"].append(timed(warm_rewriter.rewrite, raw, URI))
                if cycle < turn_n:
                    samples["turn_small"].append(timed(warm_rewriter.rewrite, turns[cycle][0], URI))
                    samples["turn_big"].append(timed(warm_rewriter.rewrite, turns[cycle][1], URI))
                phases(raw)
            # The same two, each many times in a row: caches hot, as no proxy sees them.
            samples["ujson_in_a_row"] += [timed(ujson_round_trip, raw) for _ in range(cycles)]
            samples["warm_in_a_row"] += [timed(warm_rewriter.rewrite, raw, URI) for _ in range(cycles)]
        del turns
    busy1, steal1, own1, wall1 = *cpu_busy(), os.times(), clock()
    own_jiffies = ((own1.user + own1.system) - (own0.user + own0.system)) * CLK_TCK
    wall = wall1 - wall0
    return {
        "quick": quick, "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "rounds": rounds, "cycles": cycles, "new_turns_per_round": turn_n,
        "body_sha256": hashlib.sha256(raw).hexdigest(), "messages": len(body["messages"]),
        "turns": {kind: {"turns": n, "bytes": size} for kind, (n, size) in kinds.items()},
        "size": describe(raw, first),
        "turn_added_bytes": {key: statistics.median(sizes) for key, sizes in turn_sizes.items()},
        "samples_ms": {key: [s * 1000 for s in values] for key, values in samples.items()},
        "run_seconds": wall,
        "other_cores_busy": max(0.0, (busy1 - busy0 - own_jiffies) / CLK_TCK / wall) if busy1 else None,
        "steal_cores": (steal1 - steal0) / CLK_TCK / wall if busy1 else None,
    }


# ---------------------------------------------------------------------------------------------
# Report


def report(result: dict) -> str:
    s = result["samples_ms"]
    base = statistics.median(s["ujson"])
    size = result["size"]
    lines = [
        f"cg request rewrite: {size['bytes_before']:,}-byte Claude Code-shaped body, {result['messages']} messages, "
        f"{size['tool_results']} tool results ({'quick' if result['quick'] else 'full'} run)",
        f"{'':62}{'n':>5} {'median ms':>10} {'p90 ms':>9} {'/ ujson':>8}",
    ]

    def row(label: str, key: str, indent: str = "  ", base: float = base):
        values = s[key]
        median = statistics.median(values)
        lines.append(f"{indent}{label:<{60 - len(indent) + 2}}{len(values):>5} {median:>10.2f} {p90(values):>9.2f} "
                     f"{median / base:>7.2f}x")

    lines.append("baselines, the same bytes")
    row("ujson.loads + ujson.dumps (+ encode)", "ujson")
    row("json.loads + json.dumps (+ encode)", "json")
    row("ujson.loads alone", "ujson_loads")
    row("json.loads alone", "json_loads")
    lines.append("cg Rewriter.rewrite (production config: all components, expand injected)")
    row("cold: fresh Rewriter, empty memo", "cold")
    row("warm: same Rewriter, same body again", "warm")
    added = result["turn_added_bytes"]
    row(f"warm + 1 new turn: git status (+{added['turn_small'] / 1000:.1f} KB)", "turn_small")
    row(f"warm + 1 new turn: coloured pytest -v log (+{added['turn_big'] / 1000:.1f} KB)", "turn_big")
    lines.append("warm rewrite by phase")
    row("ParsedBody.parse (decode + parse, spans of messages)", "phase_parse", "    ")
    row("expand.injection", "phase_inject", "    ")
    row("compact.plan (find results, hash, memo, re-encode)", "phase_plan", "    ")
    row("ParsedBody.apply (splice + encode)", "phase_apply", "    ")
    lines.append(f"in a row ({len(s['warm_in_a_row']) // len(s['cold'])} times each; / ujson here: ujson in a row)")
    row("ujson.loads + ujson.dumps (+ encode)", "ujson_in_a_row", base=statistics.median(s["ujson_in_a_row"]))
    row("warm rewrite", "warm_in_a_row", base=statistics.median(s["ujson_in_a_row"]))

    lines.append(
        f"size: {size['bytes_before']:,} -> {size['bytes_after']:,} bytes "
        f"({100 * (1 - size['bytes_after'] / size['bytes_before']):.1f}% less); estimated tokens "
        f"{size['tokens_before']:,} -> {size['tokens_after']:,} "
        f"({100 * (1 - size['tokens_after'] / size['tokens_before']):.1f}% less)")
    lines.append(f"tool results changed: {size['results_changed']} of {size['tool_results']}; originals to store: "
                 f"{size['originals']} ({size['original_bytes']:,} bytes); expand tool injected: {size['injected']}")
    for name, figures in size["components"].items():
        lines.append(f"  {name:<11} {figures['results']:>4} results, {figures['tokens_saved']:>8,} tokens saved")
    lines.append("turns added to the fixture's history (turns, KB): " + ", ".join(
        f"{kind} {figures['turns']} / {figures['bytes'] / 1000:.0f}" for kind, figures in
        sorted(result["turns"].items(), key=lambda item: -item[1]["bytes"])))
    verdicts = []
    for label, key in (("warm", "warm"), ("warm + git status", "turn_small"), ("warm + pytest log", "turn_big")):
        median = statistics.median(s[key])
        verdicts.append(f"{label} {median:.2f} ms {'met' if median <= 10 else 'NOT met'}")
    lines.append("target warm <= 10 ms (median): " + "; ".join(verdicts))
    m = result["machine"]
    lines.append(f"machine: nproc {m['nproc']}, {m['cpu']}, {m['implementation']} {m['python']}, ujson {m['ujson']}; "
                 f"cg from {m['cg']}")
    if result["other_cores_busy"] is not None:
        lines.append(f"other processes during the run: {result['other_cores_busy']:.2f} cores busy on average "
                     f"(of {m['nproc']}), steal {result['steal_cores']:.2f}; run {result['run_seconds']:.1f} s; "
                     f"{result['date']}; body sha256 {result['body_sha256'][:16]}")
    return "\n".join(lines)


def bench_main(argv: list[str] | None, doc: str, run, report, quick_help: str,
               sessions: int | None = None) -> int:
    """The command line the in-process benches share: --quick, --json PATH and, for those that
    replay generated sessions (`sessions`: how many by default), --sessions N; then run, report."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=quick_help)
    if sessions is not None:
        parser.add_argument("--sessions", type=int, help=f"generated sessions [default: {sessions}, 3 with --quick]")
    parser.add_argument("--json", metavar="PATH", help="write every figure to PATH")
    args = parser.parse_args(argv)
    if sessions is None:
        result = run(args.quick)
    else:
        result = run(args.quick, args.sessions or (3 if args.quick else sessions))
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, __doc__, run, report, "fewer samples (a smoke run, a few seconds)")


if __name__ == "__main__":
    sys.exit(main())
