"""cg's one log line per request, as a person reads it: outcome words that match the status, and
what compaction and the expand loop did. Lines are captured as twisted.logger events."""

import json
import re

from helpers.bodies import expand_use, request_with_output
from helpers.replies import tool_turn
from pytest_twisted import inlineCallbacks
from rawhttp import connect, http_request

from cg.testing import JSONReply, anthropic_message, command_output
from cg.wire.markers import marker_id

PROXIED = re.compile(
    r"(?P<method>\S+) (?P<path>\S+) (?P<status>\S+) (?P<outcome>\S+) upstream_ms=\d+\.\d ttfb_ms=\d+\.\d "
    r"in=(?P<bytes_in>\d+) out=(?P<bytes_out>\d+) tokens=(?P<tokens>-|(?P<before>\d+)->(?P<after>\d+)) "
    r"markers=(?P<markers>\d+) expand_rounds=(?P<rounds>\d+)"
)
SMALL = json.dumps({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}).encode()


def post(cg, body: bytes, path: str = "/v1/messages"):
    return connect(cg.port, http_request("POST", path, body, [("content-type", "application/json")]))


def the_line(cg_log, start: str) -> re.Match:
    [line] = cg_log.containing(start)  # one line: the site does not log what the proxy logs
    match = PROXIED.fullmatch(line)
    assert match, line
    return match


@inlineCallbacks
def test_a_success_is_ok(cg_log, cg, fake):
    fake.enqueue(JSONReply(anthropic_message("hello")))
    client = yield post(cg, SMALL)
    raw = yield client.closed
    line = the_line(cg_log, "POST /v1/messages")
    assert (line["status"], line["outcome"], line["tokens"], line["markers"], line["rounds"]) == ("200", "ok", "-", "0", "0")
    assert int(line["bytes_in"]) == len(SMALL) and 0 < int(line["bytes_out"]) < len(raw)


@inlineCallbacks
def test_an_upstream_error_status_is_not_ok(cg_log, cg, fake):
    fake.enqueue(JSONReply({"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}, status=529))
    client = yield post(cg, SMALL)
    yield client.closed
    line = the_line(cg_log, "POST /v1/messages")
    assert (line["status"], line["outcome"]) == ("529", "upstream_error_status")


@inlineCallbacks
def test_compaction_and_expand_rounds_are_in_the_line(cg_log, make_cg, fake):
    cg = make_cg(anthropic_upstream=fake.url, expand=True)
    output = command_output()
    fake.enqueue(tool_turn(expand_use(marker_id(output.encode()))), JSONReply(anthropic_message("found it")))
    client = yield post(cg, json.dumps(request_with_output(output)).encode())
    yield client.closed
    line = the_line(cg_log, "POST /v1/messages")
    assert (line["status"], line["outcome"], line["markers"], line["rounds"]) == ("200", "ok", "1", "1")
    before, after = int(line["before"]), int(line["after"])
    compaction = cg.stats.compaction
    assert before > after > 0
    assert (before, after) == (compaction.tokens_before, compaction.tokens_before - compaction.saved)


@inlineCallbacks
def test_cgs_own_answers_and_refusals_are_logged_once(cg_log, make_cg, fake):
    cg = make_cg(anthropic_upstream=fake.url, max_body=100)
    answers = {}
    for method, path, body in [("GET", "/healthz", b""), ("GET", "/stats", b""), ("GET", "/nowhere", b""),
                               ("GET", "/cg/expand/0123456789abcdef", b""), ("POST", "/v1/messages", b"x" * 200)]:
        client = yield connect(cg.port, http_request(method, path, body))
        answers[path] = (yield client.closed).partition(b"\r\n\r\n")[2]
    assert cg_log.containing(" in=") == [
        f"GET /healthz 200 ok in=0 out={len(answers['/healthz'])}",
        f"GET /stats 200 ok in=0 out={len(answers['/stats'])}",
        f"GET /nowhere 404 refused in=0 out={len(answers['/nowhere'])}",
        f"GET /cg/expand/0123456789abcdef 404 refused in=0 out={len(answers['/cg/expand/0123456789abcdef'])}",
        f"POST /v1/messages 413 refused in=200 out={len(answers['/v1/messages'])}",
    ]

