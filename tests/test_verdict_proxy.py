"""The cache verdicts end to end: Claude Code-shaped turns through a real cg (in memory, on a
MemoryReactorClock) to the fake provider billing from its prompt cache on the same clock; each
turn's verdict as the ledger keeps it."""

import json

from helpers.bodies import superseded_view
from helpers.clients import CG_PORT
from rawhttp import RawClient, http_request
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol

from cg.exchange.ledger import CLIENT_PREFIX, EXPECTED, EXPIRED, KEPT_WARM, PING, REQUEST
from cg.testing import FakeUpstream, command_output
from cg.testing.loopback import result_of

PORT = 8003  # where the fake listens on the clock
START = 1_800_000_000.0
SESSION = "s-verdict"
MODEL = "claude-sonnet-4-5"
BREAKPOINT = {"type": "ephemeral"}
SYSTEM = [{"type": "text", "text": "You are Claude Code. " + command_output(60), "cache_control": BREAKPOINT}]
BASH = {"name": "Bash", "description": "run a command", "input_schema": {"type": "object"}}


def rounds(n: int, view: bool = False, big: int = 0) -> list[dict]:
    """`n` Bash rounds after the first prompt (after a superseded file view, with `view`; the last
    one's output `big` lines long, with `big`), the breakpoint on the newest block (Claude Code's)."""
    messages: list[dict] = [{"role": "user", "content": [{"type": "text", "text": "run the tests"}]}]
    messages += superseded_view() if view else []
    for i in range(n):
        output = command_output(big) if big and i == n - 1 else f"{i} passed"
        messages += [
            {"role": "assistant", "content": [{"type": "tool_use", "id": f"toolu_{i}", "name": "Bash",
                                               "input": {"command": f"pytest -k {i}"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": output}]},
        ]
    messages = json.loads(json.dumps(messages))
    messages[-1]["content"][-1]["cache_control"] = BREAKPOINT
    return messages


def claude_code(n: int, system: list[dict] = SYSTEM, **shape) -> bytes:
    return json.dumps({"model": MODEL, "messages": rounds(n, **shape), "system": system, "tools": [BASH],
                       "max_tokens": 1024}).encode()


class Session:
    """One conversation through cg, turn by turn, on the clock."""

    def __init__(self, clock, net, cg_in_memory, **config):
        clock.advance(START)
        self.clock, self.net = clock, net
        self.fake = FakeUpstream(prompt_cache=True)
        self.fake.listen(clock, PORT)
        self.cg = cg_in_memory(anthropic_upstream=self.fake.url, **config)
        self.cg.forwarder.now = clock.seconds  # the wall clock the cache expiries are kept on

    def turn(self, body: bytes, after: int = 20) -> None:
        for _ in range(after):  # a second at a time: a timer due meanwhile (a keep-alive ping) runs on time
            self.clock.advance(1)
            self.net.pump()
        headers = [("anthropic-version", "2023-06-01"), ("x-api-key", "k"), ("content-type", "application/json"),
                   ("x-claude-code-session-id", SESSION), ("user-agent", "claude-cli/2.1.3 (external, cli)")]
        client = RawClient(http_request("POST", "/v1/messages", body, headers=headers))
        connectProtocol(TCP4ClientEndpoint(self.clock, "127.0.0.1", CG_PORT), client)
        self.net.pump()
        assert client.closed.called and client.data.startswith(b"HTTP/1.1 200"), client.data[:200]

    def turns(self):
        found = result_of(self.cg.store.ledger.conversation(None, SESSION))
        assert found is not None
        return sorted(found[1], key=lambda t: t.seq)

    def verdicts(self) -> list[tuple[str | None, str]]:
        """Of the requests (a keep-alive ping's row has none)."""
        return [(turn.verdict, turn.verdict_detail) for turn in self.turns() if turn.kind == REQUEST]

    def billed(self) -> list[tuple[int, int]]:
        return [(r.usage["cache_creation_input_tokens"], r.usage["cache_read_input_tokens"])
                for r in self.fake.received]


def test_first_turn_then_new_content_then_idle_past_the_lifetime(clock, net, cg_in_memory):
    session = Session(clock, net, cg_in_memory)
    session.turn(claude_code(1))
    session.turn(claude_code(2))
    session.turn(claude_code(3), after=432)
    (write, read), (_, read_warm), (write_late, read_late) = session.billed()
    assert write > 1024 and read == 0 and read_warm > 0 and read_late == 0 and write_late > write
    assert session.verdicts() == [(EXPECTED, "first turn"), (None, ""), (EXPIRED, "idle 7m12s > 5m")]


def test_a_client_that_edits_its_system_prompt(clock, net, cg_in_memory):
    session = Session(clock, net, cg_in_memory)
    session.turn(claude_code(1))
    session.turn(claude_code(2, [dict(SYSTEM[0], text=SYSTEM[0]["text"] + " Be brief.")]))
    assert session.verdicts() == [(EXPECTED, "first turn"), (CLIENT_PREFIX, "system")]


def test_a_keep_alive_ping_bridges_the_gap(clock, net, cg_in_memory):
    session = Session(clock, net, cg_in_memory, keepalive=True)
    session.turn(claude_code(1))
    session.turn(claude_code(2), after=432)  # the ping went out before the cache expired
    pings = [r for r in session.fake.received if r.json()["max_tokens"] == 1]
    assert len(pings) >= 1 and pings[0].usage["cache_read_input_tokens"] > 0
    assert session.verdicts() == [(EXPECTED, "first turn"), (KEPT_WARM, "idle 7m12s > 5m, read back")]
    assert [turn.kind for turn in session.turns()] == [REQUEST] + [PING] * len(pings) + [REQUEST]


def test_a_turn_whose_new_content_outweighs_what_it_read(clock, net, cg_in_memory):
    session = Session(clock, net, cg_in_memory, offload_min_tokens=100_000)  # the big output goes as it is
    session.turn(claude_code(1))
    session.turn(claude_code(2, big=300))
    assert session.verdicts() == [(EXPECTED, "first turn"), (EXPECTED, "new content only")]


def test_a_cold_turn_where_cg_opens_an_epoch(clock, net, cg_in_memory):
    session = Session(clock, net, cg_in_memory)
    session.turn(claude_code(2, view=True))
    session.turn(claude_code(3, view=True), after=3600)
    session.turn(claude_code(4, view=True))
    first, cold, _ = (r.body.count(b"<<cg:") for r in session.fake.received)
    assert cold > first  # the view offloaded (the expand tool's description names a marker too)
    assert session.verdicts() == [(EXPECTED, "first turn"),
                                  (EXPIRED, "idle 1h > 5m; cg re-decided the history then (epoch)"), (None, "")]
