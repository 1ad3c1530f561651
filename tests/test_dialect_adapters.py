"""Dialects are adapters: what differs between Anthropic Messages, chat completions and the
Responses API is reached through a `cg.wire.dialect.Shape` (and, for the exchange, a
`cg.exchange.dialects.Dialect`), never by comparing dialect names."""

import copy
import pickle

from cg.exchange import dialects
from cg.record.pricing import prices
from cg.wire.dialect import ANTHROPIC, CHAT_SHAPE, MESSAGES_SHAPE, OPENAI, RESPONSES, RESPONSES_SHAPE, SHAPES

# ---------------------------------------------------------------------------------------------
# The shapes


def test_each_shape_selects_its_own_part():
    parts = ("messages part", "chat part", "responses part")
    assert [shape.select(*parts) for shape in (MESSAGES_SHAPE, CHAT_SHAPE, RESPONSES_SHAPE)] == list(parts)


def test_a_shape_names_its_dialect_its_route_and_its_conversation():
    assert {name: (shape.name, shape.route, shape.items) for name, shape in SHAPES.items()} == {
        ANTHROPIC: (ANTHROPIC, ANTHROPIC, "messages"),
        OPENAI: (OPENAI, OPENAI, "messages"),
        RESPONSES: (RESPONSES, OPENAI, "input"),  # routed as OpenAI's, with input items
    }


def test_a_shape_is_one_instance_through_copy_and_pickle():
    for shape in SHAPES.values():
        assert copy.copy(shape) is copy.deepcopy(shape) is pickle.loads(pickle.dumps(shape)) is shape


def test_every_route_is_a_priced_provider():
    assert {shape.route for shape in SHAPES.values()} <= set(prices().providers)


def test_the_exchange_adapter_of_a_shape_is_its_names():
    for shape in SHAPES.values():
        adapter = dialects.for_dialect(shape)
        assert adapter is dialects.for_dialect(shape.name) and adapter.shape is shape and adapter.name == shape.name
