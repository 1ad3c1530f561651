"""The recorded Codex CLI requests in tests/fixtures/codex/ are what their README says they are."""

import json

import pytest
from fixturedata import CODEX, codex_body, codex_request


def serde(body: object) -> bytes:
    """A body as Codex (Rust serde_json) writes it: compact, non-ASCII raw, '/' not escaped."""
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


CODEX_NAMES = sorted(p.stem for p in CODEX.glob("*.json"))


@pytest.mark.parametrize("name", CODEX_NAMES)
def test_codex_fixtures_serialize_back_compactly(name):
    """Tests send these bodies as Codex would; that only holds if the README's serialization rule does."""
    request = codex_request(name)
    assert request["path"] == "/v1/responses"
    body = request["body"]
    if request["method"] == "GET":  # the WebSocket upgrade attempt carries no body
        assert body is None
        return
    assert list(body)[:3] == ["model", "stream", "input"]
    # The metadata string is serde's own output, kept verbatim: the rule must reproduce it exactly.
    metadata = body["client_metadata"]["x-codex-turn-metadata"]
    assert serde(json.loads(metadata)).decode() == metadata == request["headers"]["x-codex-turn-metadata"]
    # Only the prose was replaced (by ASCII filler): the size stays just under the original's.
    assert 0 <= int(request["headers"]["content-length"]) - len(serde(body)) < 200


@pytest.mark.parametrize(
    ("first", "later"),
    [("first_request", "second_request_tool_output"), ("codemode_first_request", "codemode_custom_tool_output")],
)
def test_codex_resends_its_history_as_a_byte_prefix(first, later):
    """Codex re-sends the whole history, earlier items byte-identical: the cache prefix cg must keep."""
    earlier = codex_body(first)
    assert codex_body(later)["prompt_cache_key"] == earlier["prompt_cache_key"]
    head = serde({key: earlier[key] for key in ("model", "stream", "input")})[: -len(b"]}")]
    assert serde(codex_body(later)).startswith(head)
    assert len(codex_body(later)["input"]) > len(earlier["input"])
