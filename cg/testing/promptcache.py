"""The fake provider's prompt cache: usage billed as the provider would bill it.

``FakePromptCache`` keeps one ``cg.record.pricing.PromptCache`` per (credential, model), the model
cg-estimate prices with, fed each request's prompt as ``cg.record.replay.segments`` cuts it (the
provider's order, Anthropic's ``cache_control`` breakpoints and lifetimes, OpenAI's automatic
prefixes from the model's minimum), at the time of the fake's clock. ``usage`` answers the
``usage`` object of the response as the API words it: Anthropic's ``cache_read_input_tokens`` and
``cache_creation_input_tokens`` (with ``cache_creation``'s 5-minute and 1-hour split), chat
completions' ``prompt_tokens_details.cached_tokens``, the Responses API's
``input_tokens_details.cached_tokens``. Token counts are cg's estimator's, not the provider's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from attrs import define, field

from cg.record.pricing import PromptCache, Tokens, prices
from cg.record.replay import segments
from cg.wire.dialect import CHAT_SHAPE, MESSAGES_SHAPE, RESPONSES_SHAPE, Shape

OUTPUT_TOKENS = 5  # what the fake's replies write

_SHAPES: dict[bytes, Shape] = {b"/v1/messages": MESSAGES_SHAPE, b"/v1/chat/completions": CHAT_SHAPE,
                               b"/v1/responses": RESPONSES_SHAPE}


@define
class FakePromptCache:
    """Prompt caches per (credential, model), on `clock` (seconds)."""

    clock: Callable[[], float]
    _caches: dict[tuple[bytes, str], PromptCache] = field(factory=dict, init=False)

    def usage(self, path: bytes, credential: bytes, body: object) -> dict[str, Any] | None:
        """The usage of a request to `path` (its request-target's path) with `body` (parsed), as
        the provider bills it; None for a path or body the provider would not cache."""
        shape = _SHAPES.get(path)
        if shape is None or not isinstance(body, dict):
            return None
        model = body.get("model")
        model = model if isinstance(model, str) else ""
        key = (credential, model)
        cache = self._caches.get(key)
        if cache is None:
            price = prices().price(model, shape.route)
            cache = self._caches[key] = PromptCache(price.explicit_cache, price.min_cache_tokens, price.cache_ttl)
        tokens = cache.bill(self.clock(), segments(body, shape))
        return shape.select(_anthropic, _chat, _responses)(tokens)


def _anthropic(tokens: Tokens) -> dict[str, Any]:
    return {"input_tokens": tokens.input, "cache_creation_input_tokens": tokens.cache_write,
            "cache_read_input_tokens": tokens.cache_read,
            "cache_creation": {"ephemeral_5m_input_tokens": tokens.cache_write_5m,
                               "ephemeral_1h_input_tokens": tokens.cache_write_1h},
            "output_tokens": OUTPUT_TOKENS}


def _chat(tokens: Tokens) -> dict[str, Any]:
    return {"prompt_tokens": tokens.prompt, "completion_tokens": OUTPUT_TOKENS,
            "total_tokens": tokens.prompt + OUTPUT_TOKENS, "prompt_tokens_details": {"cached_tokens": tokens.cache_read}}


def _responses(tokens: Tokens) -> dict[str, Any]:
    return {"input_tokens": tokens.prompt, "input_tokens_details": {"cached_tokens": tokens.cache_read},
            "output_tokens": OUTPUT_TOKENS, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": tokens.prompt + OUTPUT_TOKENS}
