"""What the fake is scripted to answer, for the tests of the expand loop: Anthropic rounds
(``stream``, ``continuation``, ``tool_turn``) and chat.completion.chunk rounds (``turn``, ``chunk``,
``expanding``, ``opening_call``), built on cg.testing's builders."""

from cg.testing import JSONReply, anthropic_message, anthropic_stream_events, anthropic_text_block, sse_event
from cg.wire.markers import EXPAND_TOOL


def stream(blocks, stop_reason="tool_use", **kw) -> list[bytes]:
    return anthropic_stream_events(blocks=blocks, stop_reason=stop_reason, **kw)


def continuation(texts, **kw) -> list[bytes]:
    return anthropic_stream_events(blocks=[anthropic_text_block(0, texts)], id="msg_cont", **kw)


USAGE = {"input_tokens": 100, "cache_read_input_tokens": 5000, "cache_creation_input_tokens": 50, "output_tokens": 10}


def tool_turn(*content, usage=USAGE, id="msg_round") -> JSONReply:
    return JSONReply(anthropic_message(content=list(content), stop_reason="tool_use", usage=usage, id=id))


REF = "0123456789abcdef"


HEAD = {"id": "chatcmpl-a", "created": 1700000000, "model": "gpt-5"}


LATER = {"id": "chatcmpl-b", "created": 1700000099, "model": "gpt-5-2026"}


DONE_EVENT = sse_event(None, "[DONE]")


def chunk(delta: dict, finish: str | None = None, head: dict = HEAD, **choice) -> bytes:
    return sse_event(None, {**head, "object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None, **choice}], "usage": None})


def usage_chunk(prompt: int, completion: int, head: dict = HEAD) -> bytes:
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    return sse_event(None, {**head, "object": "chat.completion.chunk", "choices": [], "usage": usage})


def start(index: int, call_id: str, name: str = EXPAND_TOOL, args: str = "") -> dict:
    return {"tool_calls": [{"index": index, "id": call_id, "type": "function",
                            "function": {"name": name, "arguments": args}}]}


def frag(index: int, args: str) -> dict:
    return {"tool_calls": [{"index": index, "function": {"arguments": args}}]}


def turn(*deltas: dict, finish: str, head: dict = HEAD, prompt: int = 100, completion: int = 7) -> list[bytes]:
    """role, the deltas, the finish chunk, the usage chunk, [DONE]: a whole round as OpenAI streams it."""
    return [chunk({"role": "assistant", "content": ""}, head=head), *(chunk(d, head=head) for d in deltas),
            chunk({}, finish, head=head), usage_chunk(prompt, completion, head), DONE_EVENT]


def expanding(index: int = 0, call_id: str = "call_x", ref: str = REF) -> list[dict]:
    args = '{"id":"' + ref + '"}'
    return [start(index, call_id), frag(index, args[:7]), frag(index, args[7:])]


def opening_call(call_id: str = "call_x", ref: str = REF) -> list[bytes]:
    """A turn that starts with the call: role, content null and its first fragment in one chunk, as OpenAI."""
    first = chunk({"role": "assistant", "content": None, **start(0, call_id)})
    args = '{"id":"' + ref + '"}'
    return [first, chunk(frag(0, args)), chunk({}, "tool_calls"), usage_chunk(100, 7), DONE_EVENT]
