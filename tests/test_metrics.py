"""GET /metrics: a real scrape of a running cg says what /stats says, in Prometheus' format; the
shipped dashboard and alert rules use only what it exposes; multiprocess mode sums processes."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from helpers.bodies import coloured_output, history
from helpers.drive import get_stats, post, samples, scrape, value
from prometheus_client.parser import text_string_to_metric_families
from pytest_twisted import inlineCallbacks
from rawhttp import connect, http_request, split_response

from cg import __version__
from cg.record.metrics import path_label
from cg.testing import claude_code_bytes
from cg.web.tap import Options

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana-dashboard.json"
ALERTS = ROOT / "deploy" / "prometheus-alerts.yml"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is missing (Debian package prometheus; .ci/run installs it)"
)


def exposed_names(text: str) -> set[str]:
    """Every series name a scrape can show, also for a labelled family with no series yet."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(family.name + suffix for suffix in suffixes.get(family.type, ()))
        names.update(s.name for s in family.samples)
    return names


@inlineCallbacks
def test_a_scrape_says_what_stats_says(make_cg, fake):
    cg = make_cg(anthropic_upstream=fake.url, expand=True)
    raw = claude_code_bytes(history(coloured_output(), "x"))
    for _ in range(2):  # the same history re-sent: the second is planned from the first (the bodies table)
        client = yield post(cg.port, raw)
        yield client.closed
    stats = yield from get_stats(cg.port)
    head, text = yield from scrape(cg.port)
    assert head[b"content-type"][0].startswith(b"text/plain; version=")

    assert value(text, "cg_requests_total", dialect="anthropic", path="/v1/messages", status="200") == 2
    compaction = stats["compaction"]
    assert value(text, "cg_compaction_tokens_before_total") == compaction["tokens_before"] > 0
    assert value(text, "cg_compaction_tokens_after_total") == compaction["tokens_after"]
    for name, component in compaction["components"].items():
        assert value(text, "cg_compaction_component_saved_tokens_total", component=name) == component["saved_tokens"]
        assert value(text, "cg_compaction_component_runs_total", component=name) == component["runs"]
    assert value(text, "cg_store_writes_total") == stats["store"]["writes"] == 1
    assert value(text, "cg_store_healthy") == 1
    usage = stats["usage"]
    assert value(text, "cg_billed_tokens_total", dialect="anthropic", kind="output") == usage["output_tokens"] > 0
    assert value(text, "cg_added_ttfb_seconds_count", dialect="anthropic") == stats["added_ttfb"]["count"] == 2
    assert value(text, "cg_upstream_ttfb_seconds_count", dialect="anthropic") == 2
    assert value(text, "cg_store_operation_seconds_count", operation="put") == 1  # the second was known

    memo = compaction["memo"]
    assert memo["misses"] >= 1
    assert memo["hit_rate"] == round(memo["hits"] / (memo["hits"] + memo["misses"]), 4)
    assert memo["entries"] > 0 and memo["chars"] > 0 and memo["bodies"]["hits"] >= 1
    assert value(text, "cg_memo_hits_total", table="decisions") == memo["hits"]
    assert value(text, "cg_memo_misses_total", table="decisions") == memo["misses"]
    assert value(text, "cg_memo_entries", table="decisions") == memo["entries"]
    assert value(text, "cg_memo_hits_total", table="bodies") == memo["bodies"]["hits"]
    assert value(text, "cg_build_info", version=__version__) == 1


@inlineCallbacks
def test_each_cg_has_its_own_registry(make_cg, fake):
    first, second = make_cg(anthropic_upstream=fake.url), make_cg(anthropic_upstream=fake.url)
    client = yield post(first.port, claude_code_bytes(history("x", "x")))
    yield client.closed
    _, text = yield from scrape(second.port)
    assert value(text, "cg_requests_total", dialect="anthropic", path="/v1/messages", status="200") == 0


@inlineCallbacks
def test_labels_stay_bounded(make_cg, fake, fake_openai):
    """No ID becomes a label: unknown paths are "other"; 413s count; a tenant only when asked."""
    cg = make_cg(anthropic_upstream=fake.url, openai_upstream=fake_openai.url, max_body=4096)
    client = yield connect(cg.port, http_request("GET", "/v1/models/claude-x-1234?x=1",
                                                 headers=[("anthropic-version", "2023-06-01")]))
    yield client.closed
    client = yield post(cg.port, b"{" + b" " * 8000 + b"}")
    assert split_response((yield client.closed))[0] == 413
    _, text = yield from scrape(cg.port)
    requests = {dict(labels)["path"] for (name, labels) in samples(text) if name == "cg_requests_total"}
    assert requests == {"other", "/v1/messages"}
    assert value(text, "cg_requests_total", dialect="anthropic", path="/v1/messages", status="413") == 1
    assert not any("tenant" in dict(labels) for _, labels in samples(text))

    teams = make_cg(anthropic_upstream=fake.url, tenant="header:x-team", metrics_tenants=True)
    client = yield post(teams.port, claude_code_bytes(history("x", "x")), [("x-team", "blue")])
    yield client.closed
    _, text = yield from scrape(teams.port)
    assert value(text, "cg_requests_total", dialect="anthropic", path="/v1/messages", status="200",
                 tenant="blue") == 1


def test_path_labels():
    assert path_label("/v1/messages?beta=true") == "/v1/messages"
    assert path_label("/v1/messages/count_tokens") == "/v1/messages/count_tokens"
    assert path_label("/v1/chat/completions") == "/v1/chat/completions"
    assert path_label("/v1/models/gpt-4o") == "other"
    assert path_label("/v1/messages/batches/msgbatch_01") == "other"


@inlineCallbacks
def test_openmetrics_when_asked(make_cg, fake):
    cg = make_cg(anthropic_upstream=fake.url)
    head, text = yield from scrape(cg.port, "application/openmetrics-text; version=1.0.0")
    assert head[b"content-type"][0].startswith(b"application/openmetrics-text") and text.endswith("# EOF\n")


@needs_promtool
@inlineCallbacks
def test_promtool_passes_a_real_scrape(make_cg, fake):
    cg = make_cg(anthropic_upstream=fake.url, expand=True)
    client = yield post(cg.port, claude_code_bytes(history(coloured_output(), "x")))
    yield client.closed
    _, text = yield from scrape(cg.port)
    checked = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout + checked.stderr == ""  # not even a lint warning


@needs_promtool
def test_promtool_passes_the_alert_rules():
    checked = subprocess.run([PROMTOOL, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS" in checked.stdout


def _referenced(expression: str) -> set[str]:
    return set(re.findall(r"\b(?:cg|process)_[a-z0-9_]+\b", expression))


@inlineCallbacks
def test_the_dashboard_and_the_alerts_use_only_exposed_metrics(make_cg, fake):
    cg = make_cg(anthropic_upstream=fake.url)
    _, text = yield from scrape(cg.port)
    exposed = exposed_names(text)

    dashboard = json.loads(DASHBOARD.read_text())
    expressions = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    expressions += [variable["definition"] for variable in dashboard["templating"]["list"] if "definition" in variable]
    used = set().union(*map(_referenced, expressions))
    assert used - exposed == set()
    for needed in ("cg_requests_total", "cg_added_ttfb_seconds_bucket", "cg_compaction_tokens_before_total",
                   "cg_expand_rounds_total", "cg_store_healthy", "cg_store_errors_total", "cg_memo_hits_total"):
        assert needed in used

    rules = [line for line in ALERTS.read_text().splitlines() if not line.lstrip().startswith("#")]
    used = _referenced("\n".join(rules)) - {"cg_build_info"}
    assert {"cg_store_healthy", "cg_upstream_errors_total", "cg_added_ttfb_seconds_bucket",
            "cg_expand_continuations_failed_total", "cg_store_fail_open_total", "cg_changelog_errors_total"} <= used
    assert used - exposed == set()


# --- prometheus-client's multiprocess mode: one scrape, every process ------------------------

TWISTD = Path(sys.executable).with_name("twistd")


def _get(port: int, path: str, body: bytes | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body,
                                     headers={"anthropic-version": "2023-06-01"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def test_multiprocess_mode_sums_every_process(tmp_path):
    """What `--workers` will rely on: two cg processes writing one PROMETHEUS_MULTIPROC_DIR; a
    scrape of either shows both."""
    assert TWISTD.exists(), f"no twistd next to {sys.executable}"
    directory = tmp_path / "metrics"
    directory.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(directory)}
    procs, ports = [], []
    try:
        for name in ("a", "b"):
            log = open(tmp_path / f"{name}.log", "wb")  # noqa: SIM115 -- closed with the process
            procs.append(subprocess.Popen(
                [str(TWISTD), "-n", "--pidfile=", "cg", "--listen", "tcp:0:interface=127.0.0.1",
                 "--store", "memory:", "--anthropic-upstream", "http://127.0.0.1:9", "--max-body", "64"],
                cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT))
            deadline = time.monotonic() + 20
            while True:
                found = re.search(r"listening on http://127\.0\.0\.1:(\d+) ", (tmp_path / f"{name}.log").read_text())
                if found:
                    ports.append(int(found.group(1)))
                    break
                assert procs[-1].poll() is None and time.monotonic() < deadline, (tmp_path / f"{name}.log").read_text()
                time.sleep(0.05)
        for port in ports:
            assert _get(port, "/v1/messages", b"{" + b" " * 100 + b"}")[0] == 413
        assert _get(ports[0], "/v1/messages", b"{}")[0] == 502  # nothing listens upstream
        for port in ports:
            status, body = _get(port, "/metrics")
            assert status == 200
            text = body.decode()
            assert value(text, "cg_requests_total", dialect="anthropic", path="/v1/messages", status="413") == 2
            assert value(text, "cg_upstream_errors_total", dialect="anthropic", outcome="upstream_error") == 1
            assert value(text, "cg_added_ttfb_seconds_count", dialect="anthropic") == 1
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=20)


def test_metrics_tenants_is_a_flag():
    options = Options()
    options.parseOptions([])
    assert options.config().metrics_tenants is False
    options = Options()
    options.parseOptions(["--metrics-tenants", "--tenant", "credential"])
    assert options.config().metrics_tenants is True
