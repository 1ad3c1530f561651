"""The `context_guru_expand` tool: its fixed bytes, and where cg injects it.

Tool definitions come first in the provider's cache prefix, so the tool is
serialized once, with a fixed key order, and is byte-identical on every request
of every session. One rule decides where cg manages expand: the tool is appended
last to every request with a non-empty `tools` array (also when `tool_choice`
forces a tool: removing a tool would invalidate the cache), unless the client
already has a tool of that name. Exactly there cg may run lossy compaction.

The Responses API declares it as a top-level `function` tool, with `strict: false` spelled out
(the API's default is strict, which this schema does not meet), as Codex declares its own, and
only in requests that say `"store": false` (Codex CLI does). A stored response may be the
`previous_response_id` of the client's next turn, and after an expand the id the client holds
names the provider's first round, which ends with an expand call the provider never saw
answered: the next turn would fail. Other Responses requests get lossless reformat only.
Requests without a top-level `tools` array get none: among them Codex's "lite" models, which
declare their tools inside an `additional_tools` input item. How the provider answers a
function added to one of that item's namespaces is not known, so cg leaves those requests to
lossless reformat.
"""

from collections.abc import Callable

import ujson

from cg.compaction.tokens import estimate_tokens
from cg.wire import jsonbytes
from cg.wire.body import ParsedBody
from cg.wire.dialect import Shape
from cg.wire.markers import EXPAND_TOOL

DESCRIPTION = (
    "Markers of the form <<cg:ID>> stand for content that context guru elided from earlier "
    "tool results to save context. Call this tool with the ID (bare, or the whole marker) to "
    "get that content back in full."
)
_ID = {"type": "string", "description": "The ID inside a <<cg:ID>> marker, or the whole marker."}
_SCHEMA = {"type": "object", "properties": {"id": _ID}, "required": ["id"]}


def _serialize(tool: dict[str, object]) -> str:
    return ujson.dumps(tool, ensure_ascii=False, escape_forward_slashes=False)


ANTHROPIC_TOOL = _serialize({"name": EXPAND_TOOL, "description": DESCRIPTION, "input_schema": _SCHEMA})
OPENAI_TOOL = _serialize(
    {
        "type": "function",
        "function": {"name": EXPAND_TOOL, "description": DESCRIPTION, "parameters": _SCHEMA},
    }
)
RESPONSES_TOOL = _serialize(
    {"type": "function", "name": EXPAND_TOOL, "description": DESCRIPTION, "strict": False, "parameters": _SCHEMA}
)


def _anywhere(body: ParsedBody) -> bool:
    return True


def _unstored(body: ParsedBody) -> bool:
    return body.value.get("store") is False  # see the module docstring


_Injectable = tuple[str, Callable[[ParsedBody], bool]]
# Each dialect's declaration, and whether a request with tools may have it.
# The expand tool's own size, per dialect: what declaring it adds to a request (cg.record.ledger).
_TOOL_TOKENS = {tool: estimate_tokens(tool) for tool in (ANTHROPIC_TOOL, OPENAI_TOOL, RESPONSES_TOOL)}


def tool_tokens(shape: Shape) -> int:
    """The estimated tokens the expand tool's declaration adds to a request of `shape`."""
    return _TOOL_TOKENS[shape.select(ANTHROPIC_TOOL, OPENAI_TOOL, RESPONSES_TOOL)]


_ANTHROPIC: _Injectable = (ANTHROPIC_TOOL, _anywhere)
_CHAT: _Injectable = (OPENAI_TOOL, _anywhere)
_RESPONSES: _Injectable = (RESPONSES_TOOL, _unstored)


def _tool_name(tool: object) -> object:
    if not isinstance(tool, dict):
        return None
    function = tool.get("function")
    return function.get("name") if isinstance(function, dict) else tool.get("name")


def injection(body: ParsedBody, shape: Shape) -> list[tuple[jsonbytes.Span, str]] | None:
    """The edit that appends the expand tool to `tools`, or None where cg does not inject.

    None when `tools` is absent or empty (side requests such as title generation
    send `tools: []`, and are left alone) or already holds a tool of that name, and for a
    Responses request the provider may store.
    """
    declaration, injectable = shape.select(_ANTHROPIC, _CHAT, _RESPONSES)
    tools = body.value.get("tools")
    if not isinstance(tools, list) or not tools:
        return None
    if not injectable(body):
        return None
    if any(_tool_name(tool) == EXPAND_TOOL for tool in tools):
        return None
    end = body.spans[("tools",)][1] - 1  # the closing bracket
    return [((end, end), "," + declaration)]
