"""The request shapes real clients sent (tests/fixtures/), for tests and benchmarks alike."""

import json
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures"
CLAUDE_CODE = FIXTURES / "claude-code"
CODEX = FIXTURES / "codex"


def _request(directory: Path, name: str) -> dict:
    return json.loads((directory / f"{name}.json").read_text())


def claude_code_request(name: str) -> dict:
    """A recorded Claude Code request ({"method", "path", "headers", "body"}) by file stem."""
    return _request(CLAUDE_CODE, name)


def claude_code_body(name: str) -> dict:
    """The body of a recorded Claude Code request, by file stem."""
    return claude_code_request(name)["body"]


def codex_request(name: str) -> dict:
    """A recorded Codex CLI request ({"method", "path", "headers", "body"}) by file stem."""
    return _request(CODEX, name)


def codex_body(name: str) -> dict:
    """The body of a recorded Codex CLI request, by file stem (None for the WebSocket GET)."""
    return codex_request(name)["body"]


FEATURES = FIXTURES / "features"


def feature_names() -> list[str]:
    """The shapes of the providers' newer features (tests/fixtures/features/), by file stem."""
    return sorted(path.stem for path in FEATURES.glob("*.json"))


def feature(name: str) -> dict:
    """One feature's shapes: {"source", "path", "headers", "request", "response"}, and "stream" (the
    raw SSE bytes, when the feature streams)."""
    shape = _request(FEATURES, name)
    stream = FEATURES / f"{name}.sse"
    shape["stream"] = stream.read_bytes() if stream.exists() else None
    return shape
