"""cg.wire.dialect: which provider a client speaks to, and what cg tells it, without a reactor."""

import pytest
from twisted.web.http_headers import Headers

from cg.wire.dialect import ANTHROPIC, OPENAI, not_proxied, spoken_by


@pytest.mark.parametrize(
    "headers, dialect",
    [
        ({b"authorization": [b"Bearer sk-test"]}, OPENAI),
        ({b"authorization": [b"bearer sk-test"]}, OPENAI),  # the scheme is case-insensitive
        ({b"x-api-key": [b"sk-ant-test"]}, ANTHROPIC),
        ({b"x-api-key": [b"sk-ant-test"], b"anthropic-version": [b"2023-06-01"]}, ANTHROPIC),
        # Claude Code with an OAuth token: a Bearer token, but Anthropic's headers with it.
        ({b"authorization": [b"Bearer sk-ant-oat"], b"anthropic-version": [b"2023-06-01"]}, ANTHROPIC),
        ({b"authorization": [b"Bearer sk-ant"], b"x-api-key": [b"sk-ant"]}, ANTHROPIC),
        ({b"authorization": [b"Basic dTpw"]}, ANTHROPIC),
        ({}, ANTHROPIC),
    ],
)
def test_a_client_speaks_openai_only_with_a_bare_bearer_token(headers, dialect):
    assert spoken_by(Headers(headers)) == dialect


@pytest.mark.parametrize("path", [b"/chat/completions", b"/responses", b"/responses/resp_1", b"/embeddings", b"/models"])
def test_an_openai_path_without_v1_says_which_base_url_works(path):
    assert not_proxied(path, "http://127.0.0.1:8080") == (
        f"cg does not proxy {path.decode()}: set the OpenAI base URL to http://127.0.0.1:8080/v1"
    )


@pytest.mark.parametrize("path", [b"/elsewhere", b"/v1/elsewhere", b"/chat", b"/v1/v1/chat/completions", b"/messages"])
def test_another_path_is_only_named(path):
    assert not_proxied(path, "http://127.0.0.1:8080") == f"cg does not proxy {path.decode()}"
