"""Request bodies as the clients send them: Claude Code histories (on tests/fixtures/' shapes),
tool turns, expand calls and repairs, chat messages, and the JSON styles other clients write."""

import copy
import json

from fixturedata import claude_code_body

from cg.testing import command_output
from cg.wire.body import ParsedBody
from cg.wire.markers import EXPAND_TOOL, marker_id


def history(bash_output: str, read_output: str) -> dict:
    """The fixture's Bash turn with a big output, then a Read turn of the same size."""
    body = copy.deepcopy(claude_code_body("p_second_request_tool_result"))
    body["messages"][3]["content"][0]["content"] = bash_output
    body["messages"] += [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_read1", "name": "Read",
                                            "input": {"file_path": "/repo/big.ts"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_read1",
                                      "content": read_output}]},
    ]
    return body


def superseded_view() -> list[dict]:
    """A big Read of a file, then an Edit of it: what a cache-aware epoch offloads (cold.VIEW_TOOLS:
    a view is kept whole at first sight)."""
    return [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_read", "name": "Read",
                                           "input": {"file_path": "/src/a.py"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_read",
                                      "content": command_output(900)}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_edit", "name": "Edit",
                                           "input": {"file_path": "/src/a.py", "old_string": "a",
                                                     "new_string": "b"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_edit", "content": "ok"}]},
    ]


def bash_body(bash=None) -> dict:
    """A streaming Claude Code request whose Bash output cg offloads behind a marker."""
    return history(command_output() if bash is None else bash, "x")


def two_bash_body(first: str, second: str) -> dict:
    body = history(first, "x")
    body["messages"] += [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_bash2", "name": "Bash",
                                           "input": {"command": "npm test -- --second"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_bash2", "content": second}]},
    ]
    return body


def ident_of(text: str) -> str:
    return marker_id(text.encode())


def log(i: int, lines: int = 140) -> str:
    """A test log of ~1,700 tokens: kept whole at first sight (offloaded above 2,000 tokens),
    offloaded by an epoch (above 500 or 1,000: its excerpt elides about 1,000)."""
    return "\n".join(f"ok test_{i}_{n:03d} in 0.{n % 97:02d}s" for n in range(lines))


def conversation(turns: list[list[dict]]) -> dict:
    """Claude Code's fixture with these tool turns after its own, cache_control on the newest block."""
    body = copy.deepcopy(claude_code_body("p_second_request_tool_result"))
    for message in body["messages"]:
        for block in message["content"] if isinstance(message["content"], list) else ():
            block.pop("cache_control", None)
    for turn in turns:
        body["messages"] += copy.deepcopy(turn)
    body["messages"][-1]["content"][-1]["cache_control"] = {"type": "ephemeral"}
    return body


def bash_turns(n: int) -> list[list[dict]]:
    return [tool_turn(f"toolu_{i:03d}", "Bash", log(i)) for i in range(n)]


def messages_bytes(forwarded: bytes, count: int) -> bytes:
    """The first `count` messages of a forwarded body, as bytes."""
    body = ParsedBody.parse(forwarded)
    assert body is not None
    start, end = body.spans[("messages", 0)][0], body.spans[("messages", count - 1)][1]
    return forwarded[start:end]


def tool_turn(tool_id: str, name: str, result, tool_input=None) -> list[dict]:
    """An assistant tool_use and the user message answering it."""
    return [
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": tool_id, "name": name, "input": tool_input or {"command": "pytest"}}]},
        {"role": "user", "content": [{"tool_use_id": tool_id, "type": "tool_result", "content": result}]},
    ]


BASH = {"name": "Bash", "description": "Run a command", "input_schema": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}


NO_SUCH_TOOL = "<tool_use_error>Error: No such tool available: context_guru_expand</tool_use_error>"


def request_with_output(output: str, **extra) -> dict:
    return {
        "model": "claude-opus-4-8",
        "max_tokens": 1024,
        "tools": [BASH],
        "messages": [
            {"role": "user", "content": "run the tests"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_bash", "name": "Bash",
                                                "input": {"command": "pytest"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_bash", "content": output}]},
        ],
        **extra,
    }


def expand_use(ref: str, id: str = "toolu_x1") -> dict:
    return {"type": "tool_use", "id": id, "name": EXPAND_TOOL, "input": {"id": ref}}


def repair_request(ref: str, extra_results=()) -> dict:
    return {
        "model": "claude-opus-4-8", "max_tokens": 1024, "tools": [BASH],
        "messages": [
            {"role": "user", "content": "what failed?"},
            {"role": "assistant", "content": [expand_use(ref, "toolu_leak")]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_leak", "is_error": True, "content": NO_SUCH_TOOL},
                *extra_results,
                {"type": "text", "text": "go on"},
            ]},
        ],
    }


def coloured_output() -> str:
    """A long coloured test log: textclean strips its colours, then offload shortens what is left."""
    return "\n".join(f"\x1b[32m{line}\x1b[0m" for line in command_output().split("\n"))


TOOLS = [{"type": "function", "function": {"name": "shell", "parameters": {"type": "object"}}}]


def messages(output: str) -> list[dict]:
    return [
        {"role": "user", "content": "run it"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "shell", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": output},
    ]


def js_style(body) -> bytes:
    """JSON.stringify: compact, non-ASCII raw, nothing else escaped."""
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


def python_style(body) -> bytes:
    """json.dumps defaults, as the Python SDKs send: spaces, non-ASCII escaped."""
    return json.dumps(body).encode()


def go_style(body, upper_hex=False) -> bytes:
    """encoding/json: compact, and <, > and & escaped (outside strings JSON has none of them)."""
    escapes = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026"}
    text = json.dumps(body, separators=(",", ":"), ensure_ascii=False)
    for char, escape in escapes.items():
        text = text.replace(char, escape.upper().replace("\\U", "\\u") if upper_hex else escape)
    return text.encode()


def slash_style(body) -> bytes:
    """PHP's json_encode: "/" escaped (and non-ASCII too)."""
    return json.dumps(body, separators=(",", ":")).replace("/", "\\/").encode()
