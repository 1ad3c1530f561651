"""OpenAI parity: streamed chat completions and the Responses API, direct and through cg, in one run.

    python bench/openai_parity.py [--quick] [--json PATH] [--keep-logs]

The Anthropic figures of bench/inspector.py, for OpenAI's two APIs. The processes and the client
are inspector.py's (imported from it): the fake provider (``python -m cg.testing --port 0``), cg
(``twistd -n cg --store sqlite:<tmp>``, ``--expand`` on by default) and this process, a raw HTTP/1.1
client that stamps every SSE event when its blank line arrives. Every figure through cg is paired
with the same one measured direct to the fake, in alternating order, in the same run.

The requests:

- chat (``POST /v1/chat/completions``, ``stream: true``, ``stream_options: {"include_usage": true}``):
  a Codex-like conversation in chat form (the Codex fixture's developer prompt as the system
  message, its function tools as chat tools, one ``exec_command`` call and its ``role: "tool"``
  output). marker-free: the output is three lines; marker-bearing: a 56 KB test log
  (``cg.testing.command_output()``), which cg offloads behind a ``<<cg:ID>>`` marker; bypassed:
  the marker-bearing body with ``x-cg-bypass: 1`` (cg's pass-through path on the same bytes);
  usage added: the marker-bearing body without ``stream_options``, so cg adds ``include_usage``
  (to sum the rounds' usage) and hides the usage chunk; the fake then sends one more chunk and
  paces it like a delta, 50 ms later, which the total shows (the real API sends it at once).
- Responses (``POST /v1/responses``, Codex CLI's own bodies and headers from
  ``tests/fixtures/codex/``): marker-free is ``first_request`` (no tool output yet);
  marker-bearing is ``second_request_tool_output`` with its ``function_call_output`` replaced by
  a 34 KB test log in Codex's wrapper (``Chunk ID: …\nWall time: …\nProcess exited with code
  1\nOriginal token count: N\nOutput:\n…``; Codex caps outputs at about 40,000 characters).

Checked at start, per API: cg injects the expand tool, offloads the output (``GET /cg/expand/ID``
returns it) and answers an unstreamed expand call; and whether it inspects the stream. Where it
does not (yet), the rows say so instead.

Measured:
 1. A stream of 20 text deltas 50 ms apart (the fake's ``x-fake-events``/``x-fake-delay-ms``):
    time to first byte, to the first text delta fully received (chat: a chunk with non-empty
    ``delta.content``; Responses: ``response.output_text.delta``) and total; medians of 15
    trials (``--quick``: 8 deltas, 2 trials). Target: marker-bearing first text delta through cg
    <= direct + 5 ms.
 2. A spliced round trip (the fake's ``x-fake-expand: ID``): round 1 is 5 text deltas 50 ms apart
    and a ``context_guru_expand`` call for the offloaded ID; cg answers it from its store, sends
    the continuation and splices it in. Direct, the client plays the loop (round 1 to its end,
    then its own history with the assistant turn and the original as the tool output): the
    model's own two rounds, back to back. Compared: the request to the continuation's first text
    delta, and the request to the last byte. Target: the total through cg <= the two direct
    rounds + 10 ms; medians of 15.
    2b. The same unstreamed (``stream: false``, the JSON expand loop): cg's one response against
    the client's two requests back to back (the fake answers JSON at once: no model latency, so
    this is all overhead); medians of 30.
 3. In-process, pinned to one CPU: events/s of ``SSEParser`` + the OpenAI stream inspectors
    (bench/inspector.py's cases for ``ChatInspector``, and for ``ResponsesInspector`` when this cg
    has one), next to the parser alone. Target >= 50,000 events/s.
 4. In-process, no sockets: a Codex-shaped session (40 shell calls; 12 with ``--quick``: file
    reads with ``sed -n``, ``rg``, pytest logs, diffs, builds, installs; outputs from 0.2 to 40 KB,
    in Codex's wrapper and cut as Codex cuts them) replayed turn by turn through
    ``cg.compaction.rewrite.Rewriter`` (the production configuration), in both API shapes: per
    turn the bytes and estimated tokens forwarded vs sent, and the input priced with a prompt
    cache as ``cg-estimate`` prices it (``cg.record.pricing.PromptCache``: OpenAI's automatic prefix
    cache, read at the model's cached-input price, the rest uncached; OpenAI charges no cache writes).

Both subprocesses are killed on exit, whatever happens.
"""

from __future__ import annotations

import copy
import json
import os
import random
import sys
import time

from inspector import (
    Load,
    SSEConn,
    _med,
    body_of,
    in_process,
    revision,
    side_by_side_rows,
    spliced_rows,
    sse_connect,
    start_cg,
    throughput_lines,
)
from overhead import (
    HOST,
    REPO,
    ResponseError,
    Rows,
    _align,
    _child_env,
    cpu_s,
    drive,
    http_get,
    ms,
    parse_args,
    pct,
    report,
    run_dir,
    start_fake,
)

if str(REPO) not in sys.path:
    sys.path.append(str(REPO))  # tests/fixturedata.py (cg itself: the installed one, if any)

TARGET_FIRST_TEXT_MS = 5.0  # marker-bearing first text delta, cg - direct
TARGET_SPLICE_MS = 10.0  # spliced round trip's total, cg - the model's two rounds direct
CHAT, RESPONSES = "chat", "responses"
APIS = {CHAT: "/v1/chat/completions", RESPONSES: "/v1/responses"}
KINDS = ("marker-free", "marker-bearing", "bypassed", "usage added")

# ---------------------------------------------------------------------------------------------
# Requests


def serialize(body: dict) -> bytes:
    """As Codex serializes a request (serde_json: no spaces, non-ASCII raw); OpenAI's SDKs alike."""
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


def codex_output(text: str, exit_code: int = 0, chunk: str = "8107ee", wall: float = 0.0) -> str:
    """A shell output as Codex sends it back (``function_call_output.output``): its header, then the
    text, cut by Codex itself to about 40,000 characters (its head and tail, the middle counted in
    tokens) when longer, as tests/fixtures/codex/big_output_truncated_followup.json shows."""
    tokens = len(text) // 4
    if len(text) > 40_000:
        lines = text.count("\n") + 1
        text = (f"Warning: truncated output (original token count: {tokens})\nTotal output lines: {lines}\n\n"
                f"{text[:20_000]}…{tokens - 10_000} tokens truncated…{text[-20_000:]}")
    return (f"Chunk ID: {chunk}\nWall time: {wall:.4f} seconds\nProcess exited with code {exit_code}\n"
            f"Original token count: {tokens}\nOutput:\n{text}")


def chat_tools(responses_tools: list[dict]) -> list[dict]:
    """Codex's function tools in chat form (its custom and built-in tools have none there)."""
    return [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}}
            for t in responses_tools if t.get("type") == "function"]


def chat_body(output: str, usage: bool = True) -> dict:
    """A Codex-like chat completion request: system prompt, the user's ask, one exec_command call and
    its output as a ``role: "tool"`` message; Codex's function tools; ``stream_options:
    {"include_usage": true}`` unless not ``usage``."""
    from tests.fixturedata import codex_body

    first = codex_body("first_request")
    system = "\n\n".join(part["text"] for item in first["input"][:2] for part in item["content"])
    call = {"id": "call_8cfadc54057756a067355f0d", "type": "function",
            "function": {"name": "exec_command", "arguments": '{"cmd":"npm test","yield_time_ms":10000}'}}
    return {
        "model": "gpt-5.5",
        "stream": True,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": "run the tests and tell me what failed"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": output},
        ],
        "tools": chat_tools(first["tools"]),
        **({"stream_options": {"include_usage": True}} if usage else {}),
    }


def responses_body(output: str | None) -> dict:
    """Codex's first request (``output`` None), or its second with ``output`` as the shell output."""
    from tests.fixturedata import codex_body

    if output is None:
        return codex_body("first_request")
    body = codex_body("second_request_tool_output")
    [item] = [i for i in body["input"] if i.get("type") == "function_call_output"]
    item["output"] = output
    return body


def continuation(api: str, body: dict, said: str, ref: str, original: str) -> dict:
    """The request after an ``x-fake-expand`` round, as a client running the loop itself sends it:
    its history, the assistant turn with the expand call, and the original as the call's output."""
    from cg.testing import FAKE_EXPAND_CALL_ID, responses_function_call, responses_message

    out = copy.deepcopy(body)
    arguments = json.dumps({"id": ref}, separators=(",", ":"))
    if api == CHAT:
        call = {"id": FAKE_EXPAND_CALL_ID, "type": "function",
                "function": {"name": "context_guru_expand", "arguments": arguments}}
        out["messages"] += [{"role": "assistant", "content": said, "tool_calls": [call]},
                            {"role": "tool", "tool_call_id": FAKE_EXPAND_CALL_ID, "content": original}]
    else:
        out["input"] += [responses_message(said),
                         responses_function_call("context_guru_expand", arguments, FAKE_EXPAND_CALL_ID, "fc_fake_expand"),
                         {"type": "function_call_output", "call_id": FAKE_EXPAND_CALL_ID, "output": original}]
    return out


_DROP = {"host", "content-length", "connection", "accept-encoding"}  # framing; and no gzip here


def post(port: int, path: str, raw: bytes, headers: dict, shape: dict) -> bytes:
    head = [f"POST {path} HTTP/1.1", f"Host: {HOST}:{port}"]
    head += [f"{k}: {v}" for k, v in headers.items() if k.lower() not in _DROP]
    head += [f"{k}: {v}" for k, v in shape.items()]
    head.append(f"Content-Length: {len(raw)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + raw


def _data(raw: bytes) -> object:
    lines = [line[5:].lstrip() for line in raw.split(b"\n") if line.startswith(b"data:")]
    if lines == [b"[DONE]"]:
        return "[DONE]"
    try:
        return json.loads(b"\n".join(lines))
    except ValueError:
        return None


def texts_at(api: str, events: list[tuple[float, bytes]]) -> list[float]:
    """When each text delta of the response was complete (chat: a chunk with non-empty content)."""
    out = []
    for t, raw in events:
        if api == CHAT:
            if b'"content":"' not in raw:
                continue
            doc = _data(raw)
            choices = doc.get("choices") if isinstance(doc, dict) else None
            if choices and isinstance(choices[0], dict) and (choices[0].get("delta") or {}).get("content"):
                out.append(t)
        elif b"response.output_text.delta" in raw:
            out.append(t)
    return out


def stream_problems(api: str, data: bytes) -> list[str]:
    """What a client would trip over in a spliced stream: cg's call shown, not one end, not one id."""
    from cg.wire.markers import EXPAND_TOOL

    problems = []
    if EXPAND_TOOL.encode() in data:
        problems.append(f"{EXPAND_TOOL} reached the client")
    events = [e for e in data.split(b"\n\n") if e.strip()]
    docs = [_data(e) for e in events]
    if api == CHAT:
        if docs[-1:] != ["[DONE]"] or docs.count("[DONE]") != 1:
            problems.append("not one [DONE], at the end")
        chunks = [d for d in docs if isinstance(d, dict)]
        finishes = [c["choices"][0].get("finish_reason") for c in chunks if c.get("choices")]
        if [f for f in finishes if f] != ["stop"]:
            problems.append(f"finish reasons {[f for f in finishes if f]}")
        if len({c.get("id") for c in chunks}) != 1:
            problems.append("more than one completion id")
    else:
        types = [d.get("type") for d in docs if isinstance(d, dict)]
        if types.count("response.created") != 1 or types[-1:] != ["response.completed"]:
            problems.append("not one response.created, and response.completed last")
        numbers = [d.get("sequence_number") for d in docs if isinstance(d, dict)]
        if numbers != list(range(len(numbers))):
            problems.append("sequence numbers out of order")
    return problems


# ---------------------------------------------------------------------------------------------
# 1 and 2: over sockets


class Bench:
    def __init__(self, args, fake, fake_port: int, cg, cg_port: int):
        from cg.testing import HELLO, _fake_texts, command_output
        from tests.fixturedata import codex_request

        self.quick = args.quick
        self.fake_pid, self.fake_port = fake.pid, fake_port
        self.cg_pid, self.cg_port = cg.pid, cg_port
        self.ports = {"direct": fake_port, "cg": cg_port}
        self.results: dict = {"apis": {}}
        self.splice_texts = 5
        self.deltas = 8 if self.quick else 20  # section 1's stream: the smoke run's is shorter
        said = "".join(_fake_texts(self.splice_texts))
        chat_out = command_output()
        resp_out = codex_output(command_output(550), exit_code=1)
        self.originals = {CHAT: chat_out, RESPONSES: resp_out}
        bodies = {
            CHAT: {"marker-free": chat_body("1\n2\n3\n"), "marker-bearing": chat_body(chat_out),
                   "usage added": chat_body(chat_out, usage=False)},
            RESPONSES: {"marker-free": responses_body(None), "marker-bearing": responses_body(resp_out)},
        }
        self.bodies = {api: {kind: serialize(b) for kind, b in kinds.items()} for api, kinds in bodies.items()}
        for kinds in self.bodies.values():
            kinds["bypassed"] = kinds["marker-bearing"]
        self.cont = {api: serialize(continuation(api, bodies[api]["marker-bearing"], said, self.ref(api),
                                                 self.originals[api])) for api in APIS}
        # The same marker-bearing requests unstreamed, for the JSON expand loop.
        unstreamed = {api: {k: v for k, v in bodies[api]["marker-bearing"].items() if k != "stream_options"}
                      | {"stream": False} for api in APIS}
        self.json_bodies = {api: serialize(b) for api, b in unstreamed.items()}
        self.json_cont = {api: serialize(continuation(api, b, HELLO, self.ref(api), self.originals[api]))
                          for api, b in unstreamed.items()}
        self.headers = {
            CHAT: {"authorization": "Bearer sk-bench", "content-type": "application/json",
                   "user-agent": "OpenAI/Python 1.99.0"},
            RESPONSES: codex_request("second_request_tool_output")["headers"],
        }
        self.apis: list[str] = []  # those cg injects, offloads and inspects streams on (checked)
        self.json_apis: list[str] = []  # those cg injects and offloads on, and answers JSON expand calls

    def ref(self, api: str) -> str:
        from cg.wire.markers import marker_id

        return marker_id(self.originals[api].encode())

    def say(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def req(self, api: str, side: str, kind: str, **shape) -> bytes:
        shape = {f"x-fake-{k.replace('_', '-')}": v for k, v in shape.items()}
        if kind == "bypassed":
            shape["x-cg-bypass"] = "1"  # the fake ignores it
        return post(self.ports[side], APIS[api], self.bodies[api][kind], self.headers[api], shape)

    def stats(self) -> dict:
        return json.loads(http_get(self.cg_port, "/stats")[1])

    async def run(self) -> dict:
        t0 = time.monotonic()
        for api in APIS:
            await self.check(api)
        for api in self.apis:
            await self.warmup(api)
        for api in self.apis:
            await self.side_by_side(api)
        for api in self.apis:
            await self.spliced(api)
        for api in self.json_apis:
            await self.spliced_json(api)
        stats = self.stats()
        self.results["cg_stats"] = {k: stats.get(k) for k in (
            "sse_streamed", "sse_buffered", "sse_inspected", "sse_spliced", "sse_released", "expand_rounds",
            "client_disconnects", "upstream_errors")}
        self.results["elapsed_sockets_s"] = round(time.monotonic() - t0, 1)
        return self.results

    async def check(self, api: str) -> None:
        """The setup does what it claims: the expand tool injected, the output offloaded and stored,
        nothing lossy on the marker-free body, the spliced stream one valid stream. An API where
        cg does not (yet) inject or offload is reported, not measured."""
        r = self.results["apis"].setdefault(api, {})
        conn = await sse_connect(self.cg_port)
        before = self.stats()
        await conn.request(self.req(api, "cg", "marker-free", events=3))
        after = self.stats()
        comp0, comp1 = before["compaction"], after["compaction"]
        lossy = sum(comp1["components"].get(c, {}).get("acted", 0) - comp0["components"].get(c, {}).get("acted", 0)
                    for c in ("offload", "dedup"))
        injected = comp1["requests_injected"] - comp0["requests_injected"]
        inspected = after["sse_inspected"] - before["sse_inspected"]
        await conn.request(self.req(api, "cg", "marker-bearing", events=3))
        status, original = http_get(self.cg_port, f"/cg/expand/{self.ref(api)}")
        stored = status == 200 and original == self.originals[api].encode()
        r["checks"] = {"injected": injected, "inspected": inspected, "marker_free_lossy_changes": lossy,
                       "marker_stored": stored}
        if lossy:
            raise SystemExit(f"{api}: the marker-free request was not marker-free")
        if not (injected == 1 and stored):
            conn.transport.loseConnection()
            r["skipped"] = ("cg forwards this API's requests without the expand tool or without offloading: "
                            f"injected {injected}, original stored {stored}")
            self.say(f"{api}: not measured ({r['skipped']})")
            return
        await self.check_json(api, conn)
        if not inspected:
            conn.transport.loseConnection()
            r["streams_skipped"] = "cg passes this API's streams through uninspected (no stream inspector yet)"
            self.say(f"{api}: streams not measured ({r['streams_skipped']})")
            return
        before = self.stats()
        _, _, status = await conn.request(self.req(api, "cg", "marker-bearing", events=3, expand=self.ref(api)))
        problems = stream_problems(api, body_of(conn.events))
        spliced = self.stats()["sse_spliced"] - before["sse_spliced"]
        conn.transport.loseConnection()
        if status != 200 or problems or spliced != 1:
            raise SystemExit(f"{api}: the spliced stream is wrong: status {status}, spliced {spliced}, {problems}")
        self.apis.append(api)

    async def check_json(self, api: str, conn: SSEConn) -> None:
        """An unstreamed marker-bearing request with x-fake-expand: cg answers the call, the client gets
        one response without it."""
        from cg.wire.markers import EXPAND_TOOL

        before = self.stats()["expand"]["bounces"]
        req = post(self.cg_port, APIS[api], self.json_bodies[api], self.headers[api], {"x-fake-expand": self.ref(api)})
        _, _, status = await conn.request(req)
        data = body_of(conn.events) + conn._sse
        rounds = self.stats()["expand"]["bounces"] - before
        if status != 200 or rounds != 1 or EXPAND_TOOL.encode() in data or not data:
            raise SystemExit(f"{api}: the JSON expand loop is wrong: status {status}, expand rounds {rounds}")
        self.json_apis.append(api)

    async def warmup(self, api: str) -> None:
        """Every body and the spliced request a few times each way: cg's memo, store, pools warm."""
        self.say(f"{api}: warm-up")
        conns = {side: await sse_connect(port) for side, port in self.ports.items()}
        for _ in range(2 if self.quick else 4):
            for side, conn in conns.items():
                for kind in self.bodies[api]:
                    await conn.request(self.req(api, side, kind, events=3))
                await conn.request(self.req(api, side, "marker-bearing", events=3, expand=self.ref(api)))
            await conns["direct"].request(post(self.fake_port, APIS[api], self.cont[api], self.headers[api],
                                               {"x-fake-events": 3}))
        for conn in conns.values():
            conn.transport.loseConnection()

    async def side_by_side(self, api: str) -> None:
        n = 2 if self.quick else 15
        kinds = [kind for kind in KINDS if kind in self.bodies[api]]
        k = self.deltas
        self.say(f"1. {api}: {k} text deltas 50 ms apart: {n} trials x {len(kinds)} requests x 2 sides")
        conns: dict[str, SSEConn] = {side: await sse_connect(port) for side, port in self.ports.items()}
        out = {kind: {side: {"ttfb": [], "text": [], "total": [], "cpu": 0.0} for side in self.ports} for kind in kinds}
        load = Load([None, self.fake_pid, self.cg_pid])
        for i in range(n):
            order = list(self.ports) if i % 2 == 0 else list(reversed(self.ports))
            for kind in kinds:
                for side in order:
                    cpu0 = cpu_s(self.cg_pid)
                    ttfb, total, status = await conns[side].request(self.req(api, side, kind, events=k, delay_ms=50))
                    o = out[kind][side]
                    o["cpu"] += cpu_s(self.cg_pid) - cpu0
                    if status != 200:
                        raise ResponseError(f"{api} {side} {kind}: status {status}")
                    texts = texts_at(api, conns[side].events)
                    if len(texts) != k:
                        raise ResponseError(f"{api} {side} {kind}: {len(texts)} text deltas, not {k}")
                    o["ttfb"].append(ttfb)
                    o["text"].append(texts[0])
                    o["total"].append(total)
        for conn in conns.values():
            conn.transport.loseConnection()
        self.results["apis"][api]["side_by_side"] = {
            "n": n,
            "text_deltas": k,
            "others_cores": load.others(),
            "steal_cores": load.stolen(),
            "body_bytes": {kind: len(b) for kind, b in self.bodies[api].items()},
            **{kind: {side: {
                "ttfb_p50_ms": ms(_med(o["ttfb"])),
                "first_text_p50_ms": ms(_med(o["text"])),
                "first_text_p90_ms": ms(pct(o["text"], 90)),
                "total_p50_ms": ms(_med(o["total"])),
                "cg_cpu_ms_per_request": round(o["cpu"] * 1000 / n, 2) if side == "cg" else None,
                "ttfb_ms": [ms(x) for x in o["ttfb"]],
                "first_text_ms": [ms(x) for x in o["text"]],
                "total_ms": [ms(x) for x in o["total"]],
            } for side, o in sides.items()} for kind, sides in out.items()},
        }

    async def spliced(self, api: str) -> None:
        n = 2 if self.quick else 15
        k = self.splice_texts
        self.say(f"2. {api}: spliced round trip ({k} text deltas 50 ms apart, then an expand call): "
                 f"{n} trials x 2 sides")
        conns = {side: await sse_connect(port) for side, port in self.ports.items()}
        cont = post(self.fake_port, APIS[api], self.cont[api], self.headers[api],
                    {"x-fake-events": k, "x-fake-delay-ms": 50})
        keys = ("r1_text", "r1_total", "latency", "r2_total", "loop", "cont_text", "total")
        out = {side: {key: [] for key in keys} | {"cpu": 0.0, "problems": []} for side in self.ports}
        load = Load([None, self.fake_pid, self.cg_pid])
        for i in range(n):
            order = list(self.ports) if i % 2 == 0 else list(reversed(self.ports))
            for side in order:
                conn, o = conns[side], out[side]
                req = self.req(api, side, "marker-bearing", events=k, delay_ms=50, expand=self.ref(api))
                cpu0 = cpu_s(self.cg_pid)
                _ttfb, total, status = await conn.request(req)
                if status != 200:
                    raise ResponseError(f"{api} {side} spliced: status {status}")
                texts = texts_at(api, conn.events)
                o["r1_text"].append(texts[0])
                if side == "cg":
                    o["cpu"] += cpu_s(self.cg_pid) - cpu0
                    if len(texts) != 2 * k:
                        raise ResponseError(f"{api} cg spliced: {len(texts)} text deltas, not {2 * k}")
                    o["cont_text"].append(texts[k])
                    o["total"].append(total)
                    o["problems"] += stream_problems(api, body_of(conn.events))
                else:
                    o["r1_total"].append(total)
                    _ttfb, total2, status = await conn.request(cont)
                    if status != 200:
                        raise ResponseError(f"{api} direct continuation: status {status}")
                    latency = texts_at(api, conn.events)[0]
                    o["latency"].append(latency)
                    o["r2_total"].append(total2)
                    o["loop"].append(total + latency)
                    o["total"].append(total + total2)
        for conn in conns.values():
            conn.transport.loseConnection()
        self.results["apis"][api]["spliced"] = {
            "n": n,
            "text_deltas_per_round": k,
            "others_cores": load.others(),
            "steal_cores": load.stolen(),
            "continuation_body_bytes_direct": len(self.cont[api]),
            **{side: {
                **{f"{key}_p50_ms": ms(_med(o[key])) for key in keys},
                **{f"{key}_ms": [ms(x) for x in o[key]] for key in keys},
                "cg_cpu_ms_per_request": round(o["cpu"] * 1000 / n, 2) if side == "cg" else None,
                "stream_problems": o["problems"][:5],
                "stream_problem_count": len(o["problems"]),
            } for side, o in out.items()},
        }


    async def spliced_json(self, api: str) -> None:
        """The JSON expand loop: cg's one response against the client's two requests back to back."""
        n = 3 if self.quick else 30
        self.say(f"2b. {api}: spliced round trip, unstreamed: {n} trials x 2 sides")
        conns = {side: await sse_connect(port) for side, port in self.ports.items()}
        shape = {"x-fake-expand": self.ref(api)}
        cont = post(self.fake_port, APIS[api], self.json_cont[api], self.headers[api], shape)
        for _ in range(2):  # warm
            for side, conn in conns.items():
                await conn.request(post(self.ports[side], APIS[api], self.json_bodies[api], self.headers[api], shape))
            await conns["direct"].request(cont)
        out: dict = {"direct": {"r1": [], "r2": [], "total": []}, "cg": {"total": []}}
        cpu = 0.0
        load = Load([None, self.fake_pid, self.cg_pid])
        for i in range(n):
            order = list(self.ports) if i % 2 == 0 else list(reversed(self.ports))
            for side in order:
                conn = conns[side]
                req = post(self.ports[side], APIS[api], self.json_bodies[api], self.headers[api], shape)
                cpu0 = cpu_s(self.cg_pid)
                _ttfb, total, status = await conn.request(req)
                if status != 200:
                    raise ResponseError(f"{api} {side} JSON spliced: status {status}")
                if side == "cg":
                    cpu += cpu_s(self.cg_pid) - cpu0
                    out["cg"]["total"].append(total)
                    continue
                _ttfb, total2, status = await conn.request(cont)
                if status != 200:
                    raise ResponseError(f"{api} direct JSON continuation: status {status}")
                out["direct"]["r1"].append(total)
                out["direct"]["r2"].append(total2)
                out["direct"]["total"].append(total + total2)
        for conn in conns.values():
            conn.transport.loseConnection()
        self.results["apis"][api]["spliced_json"] = {
            "n": n,
            "others_cores": load.others(),
            "steal_cores": load.stolen(),
            "body_bytes": len(self.json_bodies[api]),
            "continuation_body_bytes_direct": len(self.json_cont[api]),
            "cg_cpu_ms_per_request": round(cpu * 1000 / n, 2),
            **{side: {**{f"{key}_p50_ms": ms(_med(v)) for key, v in o.items()},
                      **{f"{key}_ms": [ms(x) for x in v] for key, v in o.items()}}
               for side, o in out.items()},
        }


# ---------------------------------------------------------------------------------------------
# 4. Savings on a Codex-shaped session (in-process)


SHELL_KINDS = {  # a turn's command: its weight in the random mix (Codex reads files with sed -n and rg)
    "sed": 24, "rg": 12, "pytest": 12, "diff": 8, "status": 8, "ls": 6, "json": 5, "npm": 3, "pip": 3, "patch": 12,
    "build": 7,
}


def shell_turn(gen, kind: str) -> tuple[str, str, int]:
    """One Codex shell call: (command, output text, exit code), from bench/rewrite.py's generators."""
    rng = gen.rng
    if kind == "sed":
        path = gen.path(rng.choice((".py", ".py", ".ts")))
        n = rng.choice((60, 120, 200, 400, 800))
        return f"sed -n '1,{n}p' {path}", "\n".join(gen.code_lines(n)), 0
    if kind == "rg":
        return f"rg -n {gen.ident()} src tests", gen.grep_result(rng.choice((4, 20, 80, 300))), 0
    if kind == "pytest":
        verbose = rng.random() < 0.4
        failures = rng.choice((0, 0, 1, 3))
        n = rng.choice((12, 40, 150, 400)) if verbose else rng.choice((50, 300, 1200))
        log = gen.pytest_log(n, color=False, verbose=verbose, failures=failures)
        return "python -m pytest" + (" -v" if verbose else " -q"), log, 1 if failures else 0
    if kind == "diff":
        return "git diff", gen.git_diff(rng.randint(1, 8), color=False), 0
    if kind == "status":
        return "git status", gen.git_status(), 0
    if kind == "ls":
        return "ls -la src", gen.ls_output(rng.randint(5, 40)), 0
    if kind == "json":
        return "gh api repos/acme/proj/pulls", gen.json_output(rng.choice((3, 15, 60)), 2), 0
    if kind == "npm":
        return "npm install", gen.npm_log(rng.choice((30, 80, 200))), 0
    if kind == "pip":
        return "pip install -e '.[test]'", gen.pip_log(rng.choice((5, 20, 40))), 0
    if kind == "patch":
        return "apply_patch", "Success. Updated the following files:\nM " + gen.path(), 0
    # build: a compiler's output, warnings then maybe errors (tsc/cargo-like)
    lines = [f"{gen.path('.ts')}({rng.randint(1, 900)},{rng.randint(1, 80)}): warning TS{rng.randint(1000, 9999)}: "
             f"{gen.sentence()}" for _ in range(rng.choice((5, 40, 200, 600)))]
    return "npm run build", "\n".join(lines), rng.choice((0, 0, 2))


def session(turns: int, seed: int = 11) -> list[tuple[str, str, int]]:
    """``turns`` shell calls of a Codex session: (command, output, exit code), each kind at least once."""
    from rewrite import Gen

    gen = Gen(seed)
    kinds = list(SHELL_KINDS)
    gen.rng.shuffle(kinds)
    while len(kinds) < turns:
        kinds.append(gen.rng.choices(list(SHELL_KINDS), weights=list(SHELL_KINDS.values()))[0])
    return [shell_turn(gen, kind) for kind in kinds[:turns]]


def session_bodies(api: str, calls: list[tuple[str, str, int]], seed: int = 12) -> list[bytes]:
    """The requests of a Codex session, one per turn, each the whole history so far plus the newest
    call and its output (Codex re-sends everything; ``store: false``). Responses: Codex's own first
    request grown with reasoning, function_call and function_call_output items (and a short
    assistant message now and then); chat: the same conversation as chat messages."""
    rng = random.Random(seed)
    base = responses_body(None) if api == RESPONSES else chat_body("")
    if api == CHAT:
        base["messages"] = base["messages"][:2]
    history = base["input"] if api == RESPONSES else base["messages"]
    out = []
    for i, (command, text, code) in enumerate(calls):
        call_id = f"call_{rng.getrandbits(96):024x}"
        arguments = json.dumps({"cmd": command, "yield_time_ms": 10000}, separators=(",", ":"))
        output = codex_output(text, code, f"{rng.getrandbits(24):06x}", rng.uniform(0, 30))
        said = "I'll check that next." if rng.random() < 0.3 else None
        if api == RESPONSES:
            history.append({"type": "reasoning", "id": f"rs_{rng.getrandbits(96):024x}",
                            "summary": [{"type": "summary_text", "text": "Thinking about it."}], "content": None,
                            "encrypted_content": "gAAAAB" + "".join(rng.choices("abcdefghijklmnopqrstuvwxyz0123456789",
                                                                                  k=rng.randint(400, 1600)))})
            if said:
                history.append({"type": "message", "role": "assistant", "id": f"msg_{rng.getrandbits(96):024x}",
                                "content": [{"type": "output_text", "text": said, "annotations": []}]})
            history.append({"type": "function_call", "status": "completed", "id": f"fc_{rng.getrandbits(96):024x}",
                            "name": "exec_command", "arguments": arguments, "call_id": call_id})
            history.append({"type": "function_call_output", "call_id": call_id, "output": output})
        else:
            history.append({"role": "assistant", "content": said, "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": "exec_command", "arguments": arguments}}]})
            history.append({"role": "tool", "tool_call_id": call_id, "content": output})
        if i % 7 == 6:  # the user chimes in now and then
            text = "Now fix the failing test." if i % 2 else "Good, carry on."
            history.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
                           if api == RESPONSES else {"role": "user", "content": text})
        out.append(serialize(base))
    return out


def savings(quick: bool) -> dict:
    """Section 4: each API's session replayed through one Rewriter (production config), turn by turn."""
    from cg.compaction.rewrite import Rewriter
    from cg.compaction.tokens import estimate_tokens
    from cg.record.pricing import PromptCache, prices
    from cg.record.replay import segments
    from cg.web.config import Config
    from cg.web.service import rewrite_config
    from cg.wire.dialect import CHAT_SHAPE, RESPONSES_SHAPE

    price = prices().price("gpt-5.5", "openai")
    read = price.cache_read / price.input  # a cached token, in uncached-input-token units

    turns = 12 if quick else 40
    calls = session(turns)
    result: dict = {"turns": turns, "output_chars": [len(codex_output(t)) for _, t, _ in calls], "apis": {}}
    for api in APIS:
        rewriter = Rewriter(rewrite_config(Config(expand=True)))
        rows = []
        # The provider's prompt cache, as cg-estimate prices it (cg.record.pricing); one per side.
        caches = {side: PromptCache(False, price.min_cache_tokens, price.cache_ttl) for side in ("direct", "cg")}
        for turn, raw in enumerate(session_bodies(api, calls)):
            rewrite = rewriter.rewrite(raw, APIS[api].encode())
            sent = {"direct": raw, "cg": rewrite.body if rewrite is not None else raw}
            changes = rewrite.changes if rewrite is not None else []
            row = {"injected": bool(rewrite and rewrite.injected),
                   "changed": len({(c.message_index, c.block_index, c.part_index) for c in changes}),
                   "offloaded": len({c.marker_id for c in changes if c.lossy and c.marker_id})}
            for side, body in sent.items():
                billed = caches[side].bill(turn * 30.0, segments(json.loads(body), CHAT_SHAPE if api == CHAT else RESPONSES_SHAPE))
                total = estimate_tokens(body.decode())
                cached = min(billed.cache_read, total)
                row[side] = {"bytes": len(body), "tokens": total, "cached": cached,
                             "cost": (total - cached) + cached * read}
            rows.append(row)
        totals = {side: {key: sum(r[side][key] for r in rows) for key in ("bytes", "tokens", "cached", "cost")}
                  for side in ("direct", "cg")}
        result["apis"][api] = {"rows": rows, "totals": totals,
                               "lossy": any(r["injected"] for r in rows),
                               "cost_ratio": round(totals["cg"]["cost"] / totals["direct"]["cost"], 4)}
    return result


# ---------------------------------------------------------------------------------------------
# The table

WHAT = {
    CHAT: {"marker-free": "a 3-line tool output; cg injects the tool, nothing offloaded",
           "marker-bearing": "a 56 KB tool output offloaded: the forwarded body has a marker",
           "bypassed": "the marker-bearing body with x-cg-bypass: 1: cg's pass-through path",
           "usage added": "marker-bearing, no stream_options: cg adds include_usage"},
    RESPONSES: {"marker-free": "Codex's first request, no tool output",
                "marker-bearing": "a 34 KB shell output offloaded: the forwarded body has a marker",
                "bypassed": "the marker-bearing body with x-cg-bypass: 1: cg's pass-through path"},
}


def table(r: dict) -> str:
    m = r["machine"]
    out = [f"{m['date']}; {m['nproc']} cores ({m['cpu']}); Python {m['python']}, Twisted {m['twisted']}"
           f"{'; --quick' if r['quick'] else ''}", r["revision"], ""]
    rows = Rows()
    row, head = rows.row, rows.head

    targets = []
    names = {CHAT: "chat completions (/v1/chat/completions, stream: true)",
             RESPONSES: "Responses (/v1/responses, Codex CLI's bodies)"}
    for api, a in r["apis"].items():
        if "skipped" in a:
            out.append(f"{names[api]}: not measured: {a['skipped']}")
            continue
        if "streams_skipped" in a:
            out.append(f"{names[api]}: streams not measured: {a['streams_skipped']}")
        else:
            s = a["side_by_side"]
            head(f"1. {names[api]}: {s['text_deltas']} text deltas 50 ms apart, median of {s['n']} trials")
            side_by_side_rows(rows, s, [(kind, WHAT[api][kind]) for kind in KINDS if kind in s])
            p = a["spliced"]
            d, c = p["direct"], p["cg"]
            spliced_rows(rows, p, f"2. {api} spliced round trip: {p['text_deltas_per_round']} text deltas 50 ms "
                                  f"apart + an expand call, median of {p['n']}", "end",
                         "request -> last byte ms (direct: both rounds)")
            mb = s["marker-bearing"]
            first = mb["cg"]["first_text_p50_ms"] - mb["direct"]["first_text_p50_ms"]
            splice = c["total_p50_ms"] - d["total_p50_ms"]
            targets.append(f"{api}: marker-bearing first text delta within {TARGET_FIRST_TEXT_MS:.0f} ms of direct: "
                           f"{first:+.2f} ms, {'met' if first <= TARGET_FIRST_TEXT_MS else 'NOT met'}")
            targets.append(f"{api}: spliced stream within {TARGET_SPLICE_MS:.0f} ms of the model's two rounds: "
                           f"{splice:+.2f} ms, {'met' if splice <= TARGET_SPLICE_MS else 'NOT met'} (to the "
                           f"continuation's first text {c['cont_text_p50_ms'] - d['loop_p50_ms']:+.2f} ms; spliced "
                           f"stream problems {c['stream_problem_count']}); cg CPU ms per request: marker-bearing "
                           f"{mb['cg']['cg_cpu_ms_per_request']}, spliced {c['cg_cpu_ms_per_request']}")
        j = a.get("spliced_json")
        if j:
            d, c = j["direct"], j["cg"]
            head(f"2b. {api} spliced round trip, unstreamed ({j['body_bytes'] / 1000:.0f} KB request), "
                 f"median of {j['n']}")
            row("   round 1 ms", d["r1_p50_ms"], None)
            row("   round 2 (the client's continuation) ms", d["r2_p50_ms"], None)
            row("   request -> response ms (direct: both rounds)", d["total_p50_ms"], c["total_p50_ms"])
            splice = c["total_p50_ms"] - d["total_p50_ms"]
            targets.append(f"{api}: unstreamed spliced round trip within {TARGET_SPLICE_MS:.0f} ms of the model's two "
                           f"rounds: {splice:+.2f} ms, {'met' if splice <= TARGET_SPLICE_MS else 'NOT met'}; cg CPU ms "
                           f"per request {j['cg_cpu_ms_per_request']}")
    if len(rows) > 1:
        out += _align(rows)
    out += ["", *targets]

    ip = r["in_process"]
    out.append("")
    out.append(f"3. in-process, pinned to CPU {ip['cpu']}: events/s, {ip['throughput']['cases'][0]['reps']} reps "
               f"interleaved, gc off while timing")
    out += throughput_lines(ip["throughput"])
    if not any(c["family"] == RESPONSES for c in ip["throughput"]["cases"]):
        out.append("   (no ResponsesInspector in this cg: its cases are not measured)")

    sv = r["savings"]
    out.append("")
    out.append(f"4. a Codex-shaped session, {sv['turns']} shell calls (outputs {min(sv['output_chars']):,} to "
               f"{max(sv['output_chars']):,} chars, median {int(_med(sv['output_chars'])):,}), replayed turn by turn "
               "through cg's rewrite")
    for api, a in sv["apis"].items():
        t = a["totals"]
        lossy = "" if a["lossy"] else " (cg injects no expand tool here: lossless components only)"
        out.append(f"   {names[api]}{lossy}")
        lines = [("     turn", "KB direct", "KB cg", "tokens direct", "tokens cg", "cached direct", "cached cg",
                  "cost direct", "cost cg", "cg / direct")]
        for i, x in enumerate(a["rows"], 1):
            d, c = x["direct"], x["cg"]
            lines.append((f"     {i}", f"{d['bytes'] / 1000:.1f}", f"{c['bytes'] / 1000:.1f}", f"{d['tokens']:,}",
                          f"{c['tokens']:,}", f"{d['cached']:,}", f"{c['cached']:,}", f"{d['cost']:,.0f}",
                          f"{c['cost']:,.0f}", f"{c['cost'] / d['cost']:.2f}x"))
        d, c = t["direct"], t["cg"]
        lines.append(("     total", f"{d['bytes'] / 1000:.0f}", f"{c['bytes'] / 1000:.0f}", f"{d['tokens']:,}",
                      f"{c['tokens']:,}", f"{d['cached']:,}", f"{c['cached']:,}", f"{d['cost']:,.0f}",
                      f"{c['cost']:,.0f}", f"{a['cost_ratio']:.2f}x"))
        out += _align(lines)
        out.append(f"     forwarded: {c['bytes'] / d['bytes']:.2f}x the bytes, {c['tokens'] / d['tokens']:.2f}x the tokens; "
                   f"cache-priced input cost {a['cost_ratio']:.2f}x direct")
    out.append("   (tokens: cg's estimator; cached: OpenAI's automatic prefix cache as cg-estimate prices it "
               "(cg.record.pricing: prompt blocks, tools first, >= 1,024 tokens, in 128-token steps, turns 30 s apart); "
               "cost in uncached-input-token units: cached x the model's read price / input price + the rest x 1)")

    st = r["cg_stats"]
    out.append("")
    out.append(f"cg /stats: sse_streamed {st['sse_streamed']}, sse_inspected {st['sse_inspected']}, sse_spliced "
               f"{st['sse_spliced']}, sse_released {st['sse_released']}, expand_rounds {st['expand_rounds']}")
    loads = [f"{api} {section} {a[key]['others_cores']:.2f} ({a[key]['steal_cores']:.2f})"
             for api, a in r["apis"].items()
             for section, key in (("1.", "side_by_side"), ("2.", "spliced"), ("2b.", "spliced_json")) if key in a]
    out.append(f"other processes on the machine (busy cores, of {os.cpu_count()}; of which steal): "
               + "; ".join(loads + [f"3. {ip['others_cores']:.2f} ({ip['steal_cores']:.2f})"]))
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = parse_args(argv, __doc__.split("\n\n")[0], "few trials, a short session: a smoke run (< 40 s)",
                      "keep the fake's and cg's logs")
    started = time.monotonic()
    env = _child_env()
    # Import cg's modules now, so the in-process figures use the code cg's process starts with.
    import cg.stream.chat_inspector  # noqa: F401
    import cg.testing  # noqa: F401

    rev = revision()
    with run_dir("cg-bench-openai-", args.keep_logs) as tmp:
        fake, fake_port = start_fake(tmp, env)
        cg, cg_port = start_cg(tmp, env, fake_port)
        print(f"fake upstream pid {fake.pid} port {fake_port}; cg pid {cg.pid} port {cg_port}", file=sys.stderr)
        bench = Bench(args, fake, fake_port, cg, cg_port)
        results, code = drive(bench.run, 120 if args.quick else 900, tmp, fake, cg)
        if results is None:
            return code
    print("3. in-process: throughput", file=sys.stderr, flush=True)
    results["in_process"] = in_process(args.quick, families=(CHAT, RESPONSES))
    print("4. in-process: a Codex-shaped session through the rewrite", file=sys.stderr, flush=True)
    results["savings"] = savings(args.quick)
    results["revision"] = rev
    return report(results, args, started, table)


if __name__ == "__main__":
    sys.exit(main())
