"""The dashboard (`GET /cg/`) in a real browser: Debian's chromium, driven by selenium, against cg in
process (real sockets) and the fake provider, with traffic sent by the official anthropic SDK.

The browser and the SDK block, so each test's body runs on a thread (`on_a_thread`) while the
reactor serves cg; what it does to cg's own objects (filling the ledger) it does on the reactor. The page polls every 2 s; the tests wait on the DOM (WebDriverWait), never
sleep. Skipped where chromium or its driver is missing, but failed under CI=true: CI must run
them. With CG_SCREENSHOTS=1 they save the README's screenshots to docs/img/.
"""

import functools
import json
import os
import shutil
import time
import urllib.request
from pathlib import Path

import anthropic
import pytest
import pytest_twisted
from helpers.bodies import BASH, request_with_output
from selenium import webdriver
from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait
from twisted.internet import reactor
from twisted.internet.threads import blockingCallFromThread, deferToThread
from twisted.web.http_headers import Headers

from cg.exchange.ledger import CG_PREFIX, CLIENT_PREFIX, EXPECTED, EXPIRED, KEPT_WARM, PING, Change, Turn
from cg.stream.usage import Usage
from cg.testing import JSONReply, anthropic_message, command_output
from cg.wire.markers import marker_id

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
SHOTS = Path(__file__).resolve().parents[1] / "docs" / "img"
WAIT = 10.0  # seconds the DOM may take to show what a test waits for (the page polls every 2 s)
SHOWS_UP_WITHIN = 3.0  # a new request is on the page this soon, without a reload (issue 23)
SCRIPT = '<script>document.title = "pwned"</script><img src=x onerror="document.title=\'pwned\'">'


def on_a_thread(test):
    """The test, its body run on a thread: the reactor serves cg meanwhile."""

    @functools.wraps(test)
    @pytest_twisted.inlineCallbacks
    def run(*args, **kwargs):
        yield deferToThread(test, *args, **kwargs)

    return run


def on_the_reactor(function, *args, **kwargs):
    """`function(*args, **kwargs)` called on the reactor's thread, from a test's."""
    return blockingCallFromThread(reactor, function, *args, **kwargs)


@pytest.fixture(scope="module")
def driver():
    if CHROMIUM is None or CHROMEDRIVER is None:
        reason = "the browser tests need Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason + ": CI must run them")
        pytest.skip(reason)
    options = webdriver.ChromeOptions()
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000",
                     "--force-device-scale-factor=1", "--disable-extensions"):
        options.add_argument(argument)
    options.binary_location = CHROMIUM
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    browser = webdriver.Chrome(options=options, service=webdriver.ChromeService(CHROMEDRIVER))
    yield browser
    browser.quit()


class Page:
    """The dashboard of one cg in the browser: open a view, read and click by CSS selector."""

    def __init__(self, driver, running):
        self.driver = driver
        self.running = running
        self.driver.get_log("browser")  # what an earlier test left

    def open(self, fragment="#/overview"):
        self.driver.get(f"{self.running.url}/cg/{fragment}")

    def until(self, condition, timeout=WAIT):
        """Waits for `condition(driver)` to be truthy; its value."""
        ignored = (NoSuchElementException, StaleElementReferenceException)
        return WebDriverWait(self.driver, timeout, ignored_exceptions=ignored).until(condition)

    def text(self, css):
        return self.driver.find_element(By.CSS_SELECTOR, css).text

    def texts(self, css):
        return [e.text for e in self.driver.find_elements(By.CSS_SELECTOR, css)]

    def click(self, css):
        """Clicks the element at `css` once the page has rendered it (again, if a poll redrew it)."""
        self.until(lambda d: d.find_element(By.CSS_SELECTOR, css).click() or True)

    def shows(self, css, text, timeout=WAIT):
        """Waits until the element at `css` reads `text`."""
        self.until(lambda d: d.find_element(By.CSS_SELECTOR, css).text == text, timeout)

    def sign_in(self, key):
        """Answers the credential form (once cg's 401 has shown it) as the anthropic SDK sends its key."""
        self.until(lambda d: d.find_element(By.ID, "credential").is_displayed())
        Select(self.driver.find_element(By.ID, "credential-header")).select_by_value("authorization")
        self.driver.find_element(By.ID, "credential-key").send_keys(key)
        self.click("#credential-form button")

    def script(self, source):
        return self.driver.execute_script(source)

    def console_errors(self):
        return [e for e in self.driver.get_log("browser") if e["level"] == "SEVERE"]

    def screenshot(self, name):
        if os.environ.get("CG_SCREENSHOTS") == "1":
            SHOTS.mkdir(parents=True, exist_ok=True)
            self.driver.save_screenshot(str(SHOTS / f"dashboard-{name}.png"))


def get_json(running, path, headers=None):
    request = urllib.request.Request(running.url + path, headers=headers or {})
    with urllib.request.urlopen(request, timeout=WAIT) as response:
        return json.load(response)


def send(running, output="hello", session="s-1", key="sk-one", **extra):
    """One request through cg with the anthropic SDK, as Claude Code's session `session`."""
    client = anthropic.Anthropic(base_url=running.url, api_key=key, max_retries=0, timeout=WAIT)
    return client.messages.create(**request_with_output(output, **extra),
                                  extra_headers={"x-claude-code-session-id": session})


def figure(n):
    return f"{n:,}"


def before_after(before, after):
    return f"{before:,} → {after:,} (−{100 * (before - after) / before:.1f}%)" if before else f"{before:,} → {after:,}"


OVERVIEW = "#overview-figures tbody tr[data-row='{row}'] td:nth-child({column})"
SINCE_START, TODAY, WEEK = 2, 3, 4


@on_a_thread
def test_overview_equals_the_api_and_stats_and_follows_new_requests(driver, make_cg, fake):
    running = make_cg(anthropic_upstream=fake.url, expand=True)
    send(running, command_output(), session="s-overview")
    send(running, "short", session="s-overview")
    page = Page(driver, running)
    page.open("#/overview")
    page.shows(OVERVIEW.format(row=0, column=SINCE_START), "2")

    stats = get_json(running, "/stats")
    for column, window in ((SINCE_START, "window=start"), (WEEK, "window=7d")):
        summary = get_json(running, f"/cg/api/summary?{window}")
        assert summary["requests"] == stats["requests"] == 2
        assert page.text(OVERVIEW.format(row=0, column=column)) == figure(summary["requests"])
        assert page.text(OVERVIEW.format(row=1, column=column)) == before_after(summary["results_before"],
                                                                               summary["results_after"])
        assert page.text(OVERVIEW.format(row=2, column=column)) == before_after(summary["tokens_before"],
                                                                               summary["tokens_after"])
        assert page.text(OVERVIEW.format(row=4, column=column)) == figure(summary["billed"]["cache_read"])
        assert page.text(OVERVIEW.format(row=7, column=column)) == figure(summary["billed"]["output"])
    assert summary["billed"]["cache_read"] == stats["usage"]["cache_read_tokens"]
    assert summary["billed"]["output"] == stats["usage"]["output_tokens"]
    assert summary["results_before"] == stats["compaction"]["tokens_before"] > summary["results_after"]
    by_client = get_json(running, "/cg/api/summary?window=24h")["by_client"]
    assert page.texts("#by-client tbody td:first-child") == [row["client"] for row in by_client]

    send(running, "one more", session="s-overview")
    page.shows(OVERVIEW.format(row=0, column=SINCE_START), "3", timeout=SHOWS_UP_WITHIN)
    assert page.script("return performance.getEntriesByType('navigation').length") == 1  # no reload

    page.open("#/health")
    page.shows("#health .card:nth-child(2) tr:nth-child(1) td", figure(get_json(running, "/stats")["requests"]))
    assert page.text("#health .card:nth-child(1) tr:nth-child(1) td") == "memory"
    page.screenshot("health")
    assert page.console_errors() == []


def ledger_turn(conversation, time_, seq, tenant="", model="claude-opus-4-8", client="claude-code", cost=0.01,
                verdict=None, detail="", tool_tokens=(0, 0), billed=None, **extra):
    """A turn as cg would record it, for a ledger the test fills itself."""
    results_before, results_after = tool_tokens
    return Turn(time=time_, seq=seq, tenant=tenant, conversation=conversation, client=client, model=model,
                dialect="anthropic", path="/v1/messages", status=200, outcome="ok",
                tokens_before=20_000 + results_before, tokens_after=20_000 + results_after,
                results_before=results_before, results_after=results_after,
                billed=billed or Usage(input_tokens=40, cache_read_tokens=18_000, cache_write_tokens=2_000,
                                       output_tokens=300),
                cost_via_cg=cost, cost_direct=cost * 2, verdict=verdict, verdict_detail=detail,
                cache_until=time_ + 300, **extra)


def fill_ledger(running, conversations, now):
    """`conversations` conversations over the last 6 hours, of three turns each, with growing costs."""
    ledger = running.service.store.ledger
    seq = 0
    for n in range(conversations):
        for turn in range(3):
            seq += 1
            at = now - 6 * 3600 + n * (6 * 3600 / conversations) + turn * 60
            on_the_reactor(ledger.record, ledger_turn(f"session-{n:03d}", at, seq, cost=0.01 * ((n * 7) % conversations + 1),
                                      model=("claude-opus-4-8", "claude-sonnet-4-5")[n % 2],
                                      client=("claude-code", "sdk")[n % 3 == 0],
                                      tool_tokens=(9_000 + 100 * n, 1_200)), ())


@on_a_thread
def test_conversations_sort_newest_first_and_page(driver, make_cg, fake):
    running = make_cg(anthropic_upstream=fake.url, expand=True)
    fill_ledger(running, 60, time.time())
    page = Page(driver, running)
    page.open("#/conversations")
    page.shows("#page-position", "1–50 of 60")
    rows = "#conversations tbody tr"
    ids = lambda: page.script(f"return [...document.querySelectorAll('{rows}')].map(r => r.dataset.id)")  # noqa: E731
    assert ids() == [f"session-{n:03d}" for n in range(59, 9, -1)]  # newest first
    assert page.script("return document.getElementById('page-previous').disabled") is True
    page.screenshot("conversations")

    page.click("button[data-order='cost']")
    by_cost = [c["id"] for c in get_json(running, "/cg/api/conversations?order=cost&limit=50")["conversations"]]
    page.until(lambda d: ids() == by_cost)
    costs = [float(t.lstrip("$")) for t in page.texts(f"{rows} td[data-column='cost']")]
    assert costs == sorted(costs, reverse=True) and costs[0] > costs[-1]

    page.click("#page-next")
    page.shows("#page-position", "51–60 of 60")
    rest = [c["id"] for c in get_json(running, "/cg/api/conversations?order=cost&offset=50")["conversations"]]
    page.until(lambda d: ids() == rest)
    assert page.script("return document.getElementById('page-next').disabled") is True
    assert set(rest).isdisjoint(by_cost)

    usage = {"input_tokens": 40, "cache_read_input_tokens": 9_000, "cache_creation_input_tokens": 1_500,
             "output_tokens": 300}  # as a provider bills a conversation's next turn
    fake.enqueue(*(JSONReply(anthropic_message(usage=usage)) for _ in range(3)))
    for output in (command_output(), "short", command_output(700)):  # and some since this cg started
        send(running, output, session="s-now")
    page.open("#/overview")
    page.shows(OVERVIEW.format(row=0, column=WEEK), "183")
    assert page.text(OVERVIEW.format(row=0, column=SINCE_START)) == "3"
    page.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#chart-tokens canvas")) == 1)
    page.screenshot("overview")
    assert page.console_errors() == []


def offloaded(running, fake, output, key="sk-one", session="s-1"):
    """Sends `output` as a tool result cg offloads; the marker cg put in its place."""
    send(running, output, session=session, key=key)
    ident = marker_id(output.encode())
    assert f"<<cg:{ident}>>" in fake.received[-1].body.decode()
    return ident


@on_a_thread
def test_a_conversation_shows_its_offloads_verdicts_and_originals_as_text(driver, make_cg, fake):
    running = make_cg(anthropic_upstream=fake.url, expand=True)
    output = command_output().replace("FAIL src/broken.test.ts", "FAIL " + SCRIPT)
    ident = offloaded(running, fake, output)
    now = time.time() - 600
    verdicts = [(EXPECTED, "first turn"), (EXPIRED, "idle 7m12s > 5m"), (CLIENT_PREFIX, "system"),
                (CG_PREFIX, "epoch"), (KEPT_WARM, "idle 12m > 5m, read back")]
    ledger = running.service.store.ledger
    first = 1_796_000_000_000_001  # seqs are process-wide request numbers; the page numbers the turns 1, 2, …
    for seq, (verdict, detail) in enumerate(verdicts, first):
        changes = [Change(seq, 2, 0, "Bash", "offload", True, ident, 19_000, 700)] if seq == first else []
        on_the_reactor(ledger.record, ledger_turn("s-verdicts", now + 60 * (seq - first), seq, verdict=verdict, detail=detail,
                                  tool_tokens=(19_000, 700) if seq == first else (0, 0), epoch=verdict == CG_PREFIX,
                                  billed=Usage(40, 0, 20_000, 300) if verdict in (EXPIRED, CLIENT_PREFIX, CG_PREFIX)
                                  else None),
                      changes)
    page = Page(driver, running)
    page.open("#/conversation/s-verdicts")
    page.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "article.turn")) == 5)
    assert [h.split(" · ")[0] for h in page.texts("article.turn h4")] == [f"Turn {n}" for n in range(1, 6)]
    badges = page.texts(".verdict .badge")
    assert badges == ["expected", "expired", "client changed the prefix", "cg changed the prefix", "kept warm"]
    assert "(idle 7m12s > 5m)" in page.text(f"article.turn[data-seq='{first + 1}'] .verdict")
    assert "(system)" in page.text(f"article.turn[data-seq='{first + 2}'] .verdict")
    change = page.texts(f"article.turn[data-seq='{first}'] tr.change td")
    assert change == ["messages[2].content[0]", "Bash", "offloaded: head, tail and a summary, the rest behind the marker",
                      "19,000 → 700 (−96.3%)",
                      f"<<cg:{ident}>>"]
    shown = page.text("#view-conversation")
    assert "NaN" not in shown and "Invalid Date" not in shown  # every time the page shows is one
    page.screenshot("conversation")

    page.open("#/conversation/s-1")  # the request sent through cg: cg's own record of its offload
    page.click(f"button.marker[data-marker='{ident}']")
    page.until(lambda d: "src/module_0000" in d.find_element(By.ID, "original-text").text)
    shown = page.text("#original-text")
    assert "FAIL " + SCRIPT in shown  # the markup as text
    assert page.script("return document.querySelectorAll('#original-text *').length") == 0
    assert page.script("return document.title") != "pwned"
    assert page.console_errors() == []


PINGS_ROW = 13  # "Keep-alive pings, cost (list price)": after the requests' own figures


@on_a_thread
def test_keepalive_pings_show_apart_from_the_requests(driver, make_cg, fake):
    running = make_cg(anthropic_upstream=fake.url)
    ledger = running.service.store.ledger
    now = time.time() - 1200
    on_the_reactor(ledger.record, ledger_turn("s-warm", now, 1, cost=0.5), ())
    for seq, at in ((2, now + 270), (3, now + 540)):
        on_the_reactor(ledger.record, ledger_turn("s-warm", at, seq, cost=0.0625, kind=PING,
                                                  billed=Usage(3, 19_000, 0, 1)), ())
    on_the_reactor(ledger.record, ledger_turn("s-warm", now + 700, 4, cost=0.25, verdict=KEPT_WARM), ())
    page = Page(driver, running)
    page.open("#/overview")
    page.shows(OVERVIEW.format(row=0, column=WEEK), "2")  # the two requests, not the pings
    assert page.text(f"#overview-figures tbody tr[data-row='{PINGS_ROW}'] th") == "Keep-alive pings, cost (list price)"
    assert page.text(OVERVIEW.format(row=PINGS_ROW, column=WEEK)) == "2 · $0.13"
    assert page.text(OVERVIEW.format(row=8, column=WEEK)) == "$0.75"  # cost via cg: the requests'

    page.open("#/conversation/s-warm")
    page.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "article.turn")) == 4)
    assert [h.split(" · ")[0] for h in page.texts("article.turn h4")] == [
        "Turn 1", "Keep-alive ping", "Keep-alive ping", "Turn 2"]
    assert "cache read 19,000" in page.text("article.turn.ping[data-seq='2']")
    facts = dict(zip(page.texts("#conversation-summary th"), page.texts("#conversation-summary td")))
    assert (facts["Turns"], facts["Keep-alive pings, cost"]) == ("2", "2 · $0.13")
    assert page.console_errors() == []


@on_a_thread
def test_a_viewer_sees_only_its_tenant_and_its_originals(driver, make_cg, fake):
    running = make_cg(anthropic_upstream=fake.url, expand=True, tenant="credential")
    mine = offloaded(running, fake, command_output(), key="sk-alice", session="s-alice")
    theirs = offloaded(running, fake, command_output(901), key="sk-bob", session="s-bob")
    tenant_of = running.service.forwarder.tenant_of
    # The anthropic SDK sends its key as a bearer token: so does the viewer, to prove the same tenant.
    alice, bob = (tenant_of(Headers({b"authorization": [b"Bearer " + key]})) for key in (b"sk-alice", b"sk-bob"))
    ledger = running.service.store.ledger
    now = time.time()
    # Alice's page names her original and, as if it had leaked into her turn, Bob's.
    on_the_reactor(ledger.record, ledger_turn("s-alice", now, 1, tenant=alice), [
        Change(1, 2, 0, "Bash", "offload", True, mine, 19_000, 700),
        Change(1, 4, 0, "Bash", "offload", True, theirs, 19_000, 700),
    ])
    on_the_reactor(ledger.record, ledger_turn("s-bob", now, 2, tenant=bob), [])

    page = Page(driver, running)
    page.open("#/conversations")
    page.sign_in("sk-alice")
    page.shows("#conversations tbody tr a", "s-alice")
    assert len(page.texts("#conversations tbody tr")) == 1
    assert page.script("return sessionStorage.getItem('cg-credential')") is not None
    assert "sk-alice" not in page.script("return document.body.innerText")  # never shown

    page.click("#conversations tbody tr a")
    page.click(f"button.marker[data-marker='{mine}']")
    page.until(lambda d: "src/module_0000" in d.find_element(By.ID, "original-text").text)
    page.click("#original-close")
    page.click(f"button.marker[data-marker='{theirs}']")
    page.shows("#original-text", "cg has no such original for you: unknown, evicted, or another tenant's.")

    page.open("#/conversation/s-bob")  # Bob's conversation is not Alice's to see
    page.shows("#status", "no such conversation")
    assert page.script("return document.getElementById('view-conversation').hidden") is True
    page.open("#/health")  # the whole process's figures, every tenant's: not Alice's to see
    page.until(lambda d: d.find_element(By.ID, "health-hidden").is_displayed())
    assert page.texts("#health .card") == []
    # The browser logs the answers cg refused (the 401 before the form, the 404s) and nothing else.
    errors = page.console_errors()
    assert errors and all(e["source"] == "network" and (" 401 " in e["message"] or " 404 " in e["message"])
                          for e in errors), errors


@on_a_thread
def test_the_operator_sees_every_tenant_and_reads_their_originals(driver, make_cg, fake):
    running = make_cg(anthropic_upstream=fake.url, expand=True, tenant="credential", admin_token="operator-token")
    theirs = offloaded(running, fake, command_output(), key="sk-bob", session="s-bob")
    bob = running.service.forwarder.tenant_of(Headers({b"authorization": [b"Bearer sk-bob"]}))
    on_the_reactor(running.service.store.ledger.record, ledger_turn("s-bob", time.time(), 1, tenant=bob),
                   [Change(1, 2, 0, "Bash", "offload", True, theirs, 19_000, 700)])

    page = Page(driver, running)
    page.open("#/conversations")
    page.sign_in("operator-token")
    page.shows("#conversations td[data-column='tenant']", bob)  # a column only the operator sees
    page.click("#conversations tbody tr a")
    page.click(f"button.marker[data-marker='{theirs}']")
    page.until(lambda d: "src/module_0000" in d.find_element(By.ID, "original-text").text)
    page.open("#/health")  # the operator sees the process's health
    page.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#health .card h3"))
    assert page.script("return document.getElementById('health-hidden').hidden") is True

    page.click("#forget")  # the key leaves the tab: the form again
    page.until(lambda d: d.find_element(By.ID, "credential").is_displayed())
    assert page.script("return sessionStorage.getItem('cg-credential')") is None
    errors = page.console_errors()  # the 401s before the form, and nothing else
    assert errors and all(e["source"] == "network" and " 401 " in e["message"] for e in errors), errors


@on_a_thread
def test_a_malformed_conversation_link_opens_the_overview(driver, make_cg, fake):
    running = make_cg(anthropic_upstream=fake.url)
    page = Page(driver, running)
    page.open("#/conversation/%E0")  # not UTF-8 once decoded: decodeURIComponent throws
    page.until(lambda d: d.find_element(By.ID, "view-overview").is_displayed())
    assert page.script("return document.getElementById('view-conversation').hidden") is True
    assert page.console_errors() == []


@on_a_thread
def test_a_client_that_edits_its_system_prompt_sees_why_the_bill_moved(driver, make_cg, fake):
    fake.prompt_cache = True  # billed from a prompt cache, as the provider bills
    running = make_cg(anthropic_upstream=fake.url)
    breakpoint_ = {"type": "ephemeral"}
    system = "You are Claude Code. " + command_output(60)
    client = anthropic.Anthropic(base_url=running.url, api_key="sk-one", max_retries=0, timeout=WAIT)
    for n, prompt in enumerate((system, system + " Be brief."), 1):
        messages = [{"role": "user", "content": [{"type": "text", "text": f"run the tests, take {n}",
                                                  "cache_control": breakpoint_}]}]
        client.messages.create(model="claude-sonnet-4-5", max_tokens=64, messages=messages, tools=[BASH],
                               system=[{"type": "text", "text": prompt, "cache_control": breakpoint_}],
                               extra_headers={"x-claude-code-session-id": "s-edited"})
    page = Page(driver, running)
    page.open("#/conversation/s-edited")
    page.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".verdict")) == 2)
    assert page.texts(".verdict .badge") == ["expected", "client changed the prefix"]
    assert page.text(".verdict.expected .detail") == "(first turn)"
    assert page.text(".verdict.client_prefix .detail") == "(system)"
    assert page.console_errors() == []
