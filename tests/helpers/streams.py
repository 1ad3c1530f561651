"""Reading the streams cg sends a client: their events and names, the text they carry, one clean
splice, the official SDKs' accumulators; and feeding upstream rounds to an Inspector, cut anywhere."""

import httpx2
import openai
import ujson
from hypothesis import strategies as st

from cg.stream.inspector import CONTINUE, DONE, EXPAND, Inspector
from cg.stream.streamcheck import check_anthropic_stream
from cg.wire.markers import EXPAND_TOOL
from cg.wire.sse import Event, SSEParser


def events(data: bytes) -> list[tuple[str | None, dict | None]]:
    parser = SSEParser()
    out = []
    for event in parser.feed(data) + parser.flush():
        try:
            doc = event.json()
        except ValueError:
            doc = None
        out.append((event.name, doc))
    return out


def without_pings(data: bytes) -> bytes:
    parser = SSEParser()
    return b"".join(e.raw for e in parser.feed(data) + parser.flush() if e.name != "ping")


def names(data: bytes) -> list[str | None]:
    return [name for name, _ in events(data)]


def text_of(data: bytes) -> str:
    return "".join(
        doc["delta"]["text"]
        for name, doc in events(data)
        if name == "content_block_delta" and doc["delta"]["type"] == "text_delta"
    )


def assert_spliced(data: bytes, text: str):
    """One clean client stream: the checker passes, no expand tool, one start/delta/stop."""
    assert check_anthropic_stream(data) == []
    assert EXPAND_TOOL.encode() not in data
    seen = names(data)
    assert seen.count("message_start") == 1 and seen[0] == "message_start"
    assert seen.count("message_delta") == 1 and seen.count("message_stop") == 1
    assert seen[-2:] == ["message_delta", "message_stop"]
    assert text_of(data) == text


def is_insertion(before: bytes, after: bytes) -> bool:
    """``after`` is ``before`` with bytes inserted at one place (every byte of ``before`` kept)."""
    common = 0
    while common < len(before) and before[common] == after[common]:
        common += 1
    return len(after) > len(before) and after.endswith(before[common:])


def sdk_completion(data: bytes):
    """What the official SDK's accumulator makes of a client stream."""

    def handler(request):
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=data)

    client = openai.OpenAI(api_key="k", base_url="http://cg.invalid/v1", max_retries=0,
                           http_client=httpx2.Client(transport=httpx2.MockTransport(handler)))
    with client.chat.completions.stream(model="gpt-5", messages=[{"role": "user", "content": "hi"}]) as s:
        return s.get_final_completion()


def docs(data: bytes) -> list[object]:
    return [ujson.loads(e.data) for e in SSEParser().feed(data) if e.data and e.data != b"[DONE]"]


def events_of(data: bytes) -> list[Event]:
    parser = SSEParser()
    return parser.feed(data) + parser.flush()


def feed_round(insp: Inspector, chunks, complete=True) -> tuple[bytes, str]:
    parser = SSEParser()
    out = []
    for chunk in chunks:
        for event in parser.feed(chunk):
            step = insp.feed(event)
            out.append(step.send)
            if step.action != CONTINUE:
                return b"".join(out), step.action
    for event in parser.flush():
        step = insp.feed(event)
        out.append(step.send)
        if step.action != CONTINUE:
            return b"".join(out), step.action
    step = insp.end(complete, parser.close())
    out.append(step.send)
    return b"".join(out), step.action


def run_rounds(insp, rounds, chunker=None, complete=True) -> tuple[bytes, str]:
    """Round 1, then each continuation while ``insp`` asks for one (the last round ended with
    ``complete``); past the given rounds the caller's failure path: release()."""
    out = []
    for n, events in enumerate(rounds):
        if n:
            insp.begin_continuation()
        data = b"".join(events)
        sent, action = feed_round(insp, chunker(data) if chunker else [data], complete or n < len(rounds) - 1)
        out.append(sent)
        if action != EXPAND:
            return b"".join(out), action
    out.append(insp.release())
    return b"".join(out), DONE


def cutting(data: st.DataObject):
    """A chunker that cuts a blob wherever hypothesis draws: how the network may split a stream."""

    def chunker(blob: bytes) -> list[bytes]:
        cuts = sorted(data.draw(st.lists(st.integers(0, len(blob)), max_size=40)))
        bounds = [0, *cuts, len(blob)]
        return [blob[a:b] for a, b in zip(bounds, bounds[1:])]

    return chunker
