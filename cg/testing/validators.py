"""Validators: why the real APIs would reject a request (an empty list if they would not).

What cg can break in a request it forwards: ``anthropic_request_problems`` (tool_use answered in
order, signed thinking blocks unaltered, at most 4 cache_control blocks),
``openai_request_problems`` (chat tool calls answered) and ``responses_request_problems``
(Responses call outputs answering calls, tools well formed). The fake's ``strict`` mode answers
400 with them; a test can call them on any body.
"""

from __future__ import annotations

from typing import Any


def _cache_marks(body: dict[str, Any]) -> int:
    """How many blocks carry ``cache_control``: tools, system blocks, message blocks and their parts."""
    def marked(items: object) -> list[dict[str, Any]]:
        return [item for item in items if isinstance(item, dict)] if isinstance(items, list) else []

    blocks = marked(body.get("tools")) + marked(body.get("system"))
    for message in marked(body.get("messages")):
        for block in marked(message.get("content")):
            blocks += [block, *marked(block.get("content"))]
    return sum(block.get("cache_control") is not None for block in blocks)


def anthropic_request_problems(
    body: object, thinking: dict[str, object] | None = None, redacted: set[str] | frozenset[str] = frozenset()
) -> list[str]:
    """Why the Messages API would reject ``body`` (empty if it would not), for what cg can break.

    Each assistant message's ``tool_use`` ids must be answered, in order, by the ``tool_result``
    blocks of the next message (a user message; ``role: "system"`` entries are skipped), and a
    ``tool_result`` must answer the message before; at most 4 ``cache_control`` blocks; a thinking
    block must carry a signature in ``thinking`` (signature -> text, what the fake sent) with its
    text unaltered, a redacted_thinking block ``data`` in ``redacted``.
    """
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
        return ["messages: Field required"]
    thinking = thinking or {}
    problems = []
    expected: list[object] = []  # the tool_use ids the next message must answer
    previous = None
    for i, message in enumerate(body["messages"]):
        if not isinstance(message, dict) or message.get("role") == "system":
            continue
        role = message.get("role")
        content = message.get("content")
        blocks = [b for b in content if isinstance(b, dict)] if isinstance(content, list) else []
        results = [b.get("tool_use_id") for b in blocks if b.get("type") == "tool_result"]
        if results != expected:
            problems.append(
                f"messages.{i}: tool_result ids {results} do not answer the tool_use ids {expected} "
                f"of messages.{previous}, in order: each `tool_use` block must have a corresponding "
                "`tool_result` block in the next message"
            )
        expected = [b.get("id") for b in blocks if b.get("type") == "tool_use"] if role == "assistant" else []
        previous = i
        for j, block in enumerate(blocks if role == "assistant" else ()):
            where = f"messages.{i}.content.{j}"
            if block.get("type") == "thinking":
                signature = block.get("signature")
                if signature not in thinking:
                    problems.append(f"{where}: Invalid `signature` in `thinking` block")
                elif thinking[signature] != block.get("thinking"):
                    problems.append(f"{where}: `thinking` block altered since the model produced it")
            elif block.get("type") == "redacted_thinking" and block.get("data") not in redacted:
                problems.append(f"{where}: Invalid `data` in `redacted_thinking` block")
    if expected:
        problems.append(
            f"messages.{previous}: `tool_use` ids were found without `tool_result` blocks "
            f"immediately after: {', '.join(map(str, expected))}"
        )
    marks = _cache_marks(body)
    if marks > 4:
        problems.append(f"A maximum of 4 blocks with cache_control may be provided. Found {marks}.")
    return problems


def openai_request_problems(body: object) -> list[str]:
    """Why chat.completions would reject ``body``: every assistant ``tool_calls`` id answered by a
    ``role: "tool"`` message before the next other message, and no tool message answering none."""
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
        return ["messages: Field required"]
    problems = []
    pending: list[object] = []
    previous = None
    for i, message in enumerate(body["messages"]):
        if not isinstance(message, dict):
            continue
        if message.get("role") == "tool":
            if message.get("tool_call_id") in pending:
                pending.remove(message.get("tool_call_id"))
            else:
                problems.append(
                    f"messages.{i}: messages with role 'tool' must be a response to a preceding "
                    f"message with 'tool_calls' ({message.get('tool_call_id')!r} is not pending)"
                )
            continue
        if pending:
            problems.append(
                f"messages.{previous}: an assistant message with 'tool_calls' must be followed by tool "
                f"messages responding to each 'tool_call_id'; missing before messages.{i}: {pending}"
            )
        calls = message.get("tool_calls") if message.get("role") == "assistant" else None
        pending = [c.get("id") for c in calls if isinstance(c, dict)] if isinstance(calls, list) else []
        previous = i
    if pending:
        problems.append(
            f"messages.{previous}: an assistant message with 'tool_calls' must be followed by tool "
            f"messages responding to each 'tool_call_id'; missing: {pending}"
        )
    return problems


_CALLS = {"function_call_output": "function_call", "custom_tool_call_output": "custom_tool_call"}


def responses_request_problems(body: object) -> list[str]:
    """Why the Responses API would reject ``body`` (empty if it would not), for what cg can break:
    ``input`` a string or a list of objects; each call output answering a call earlier in ``input``
    and each call answered (the API's own messages for function calls); ``tools`` a list of objects
    with a ``type``, function tools named."""
    if not isinstance(body, dict) or not isinstance(body.get("input"), (str, list)):
        return ["input: a string or a list of items is required"]
    problems = []
    calls: dict[object, str] = {}  # call_id -> the call's type, for those not answered yet
    for i, item in enumerate(body["input"] if isinstance(body["input"], list) else ()):
        if not isinstance(item, dict):
            problems.append(f"input[{i}]: an item must be an object")
        elif item.get("type") in _CALLS.values():
            calls[item.get("call_id")] = item["type"]
        elif item.get("type") in _CALLS and calls.pop(item.get("call_id"), None) != _CALLS[item["type"]]:
            kind = item["type"].replace("_", " ")
            problems.append(f"input[{i}]: No tool call found for {kind} with call_id {item.get('call_id')}.")
    problems += [f"No tool output found for {kind.replace('_', ' ')} {call_id}." for call_id, kind in calls.items()]
    tools = body.get("tools", [])
    if not isinstance(tools, list):
        return [*problems, "tools: must be a list"]
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
            problems.append(f"Missing required parameter: 'tools[{i}].type'.")
        elif tool["type"] == "function" and not isinstance(tool.get("name"), str):
            problems.append(f"Missing required parameter: 'tools[{i}].name'.")
    return problems
