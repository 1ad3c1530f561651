"""The request shapes real clients sent (tests/fixtures/), for tests and benchmarks alike."""

import json
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures"
CLAUDE_CODE = FIXTURES / "claude-code"


def claude_code_request(name: str) -> dict:
    """A recorded Claude Code request ({"method", "path", "headers", "body"}) by file stem."""
    return json.loads((CLAUDE_CODE / f"{name}.json").read_text())


def claude_code_body(name: str) -> dict:
    """The body of a recorded Claude Code request, by file stem."""
    return claude_code_request(name)["body"]
