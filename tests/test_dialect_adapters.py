"""Dialects are adapters: what differs between Anthropic Messages, chat completions and the
Responses API is reached through a `cg.wire.dialect.Shape` (and, for the exchange, a
`cg.exchange.dialects.Dialect`), never by comparing dialect names."""

import ast
import copy
import pickle
from pathlib import Path

import pytest

from cg.exchange import dialects
from cg.record.pricing import prices
from cg.wire import dialect
from cg.wire.dialect import ANTHROPIC, CHAT_SHAPE, MESSAGES_SHAPE, OPENAI, RESPONSES, RESPONSES_SHAPE, SHAPES

CG = Path(dialect.__file__).resolve().parents[1]

# Where dialect names may be compared: the adapters themselves.
ADAPTER_MODULES = {"wire/dialect.py", "exchange/dialects.py"}
# What names a dialect (or a shape) in cg's code.
DIALECT_NAMES = {"ANTHROPIC", "OPENAI", "RESPONSES", "MESSAGES_SHAPE", "CHAT_SHAPE", "RESPONSES_SHAPE"}
DIALECT_STRINGS = {ANTHROPIC, OPENAI, RESPONSES, "chat"}
# The comparisons kept outside the adapters, each with why it is not a dialect branch.
ALLOWED = {
    ("record/pricing.py", "self.provider == ANTHROPIC"):
        "a price table entry's provider (prices.json), not a request's dialect: whose cache rules "
        "(explicit breakpoints or automatic prefixes) price the model; chat and Responses share OpenAI's",
    ("web/service.py", '{"anthropic": split_base(config.anthropic_upstream), "openai": split_base(config.openai_upstream)}'):
        "configuration, not a branch: the upstream the operator gave each route (--anthropic-upstream, "
        "--openai-upstream), which cg.web.driver looks up by the route's name",
}


def _names_a_dialect(node: ast.AST) -> bool:
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_dialect(element) for element in node.elts)
    if isinstance(node, ast.Name):
        return node.id in DIALECT_NAMES
    if isinstance(node, ast.Attribute):
        return node.attr in DIALECT_NAMES
    return isinstance(node, ast.Constant) and node.value in DIALECT_STRINGS


def dialect_branches(source: str) -> list[str]:
    """The comparisons against a dialect, and the tables keyed by one, in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(map(_names_a_dialect, [node.left, *node.comparators])):
            found.append(ast.get_source_segment(source, node) or "")
        elif isinstance(node, ast.Dict) and any(key is not None and _names_a_dialect(key) for key in node.keys):
            found.append(ast.get_source_segment(source, node) or "")
    return found


def test_no_dialect_branch_outside_the_adapters():
    found = {}
    for path in sorted(CG.rglob("*.py")):
        name = path.relative_to(CG).as_posix()
        if name in ADAPTER_MODULES:
            continue
        branches = [b for b in dialect_branches(path.read_text("utf-8")) if (name, b) not in ALLOWED]
        if branches:
            found[name] = branches
    assert found == {}, "a dialect branch outside cg.wire.dialect and cg.exchange.dialects: add a method to the adapter"


def test_the_allowed_comparisons_are_still_there():
    """An entry of ALLOWED whose comparison went away goes too."""
    for name, branch in ALLOWED:
        assert branch in dialect_branches((CG / name).read_text("utf-8")), (name, branch)


@pytest.mark.parametrize("source, branch", [
    ("if dialect == ANTHROPIC:\n    pass", "dialect == ANTHROPIC"),
    ("x = shape is CHAT_SHAPE", "shape is CHAT_SHAPE"),
    ("y = 'input' if d.name == 'responses' else 'messages'", "d.name == 'responses'"),
    ("z = dialect in (OPENAI, RESPONSES)", "dialect in (OPENAI, RESPONSES)"),
    ("TABLE = {ANTHROPIC: 1, OPENAI: 2}", "{ANTHROPIC: 1, OPENAI: 2}"),
    ("w = d.dialect != dialect.RESPONSES", "d.dialect != dialect.RESPONSES"),
])
def test_the_guard_sees_a_branch(source, branch):
    assert dialect_branches(source) == [branch]


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
