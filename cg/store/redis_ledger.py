"""The ledger (`cg.store.base.ILedger`) in the Redis store: shared by every cg on that Redis, so every
instance's dashboard shows the fleet's traffic. Used synchronously, on the store's worker thread, over
the store's client (`cg.store.redis.RedisDB.ledger`). Keys, under the store's prefix (``cg:``)::

    l:b:WIDTH:START    a rollup bucket: a hash, (tenant, client, model) as JSON -> its totals, packed
    l:s:WIDTH:START    the same bucket per tenant: TENANT -> packed totals (what `totals` sums)
    l:bk:WIDTH         sorted set: the buckets' WIDTH:START, scored by START (for ranges and trim)
    l:c:TENANT:ID      a conversation's summary: a hash (client, model, first, last, packed totals
                       ``t``, ``until``, ``warm``)
    l:o:ORDER[:TENANT] sorted sets of TENANT:ID, scored by each of ORDERS, for all and per tenant
    l:tenants          a set: every TENANT with a conversation (a trim drops a tenant with its last one,
                       so opening a conversation by id alone asks only the tenants there are)
    l:ct:TENANT:ID     a conversation's turns: a hash, turn id -> the turn and its changes (JSON)
    l:tq               sorted set: every turn kept as ID:TIME:TENANT:CONVERSATION, scored by ID
    l:seq              the turn ids: one counter for the fleet, so no two instances' turns collide

TENANT is percent-encoded. A batch is one Lua script, so instances sharing the Redis add to the same
rows whole. A bucket's totals are one packed string per (tenant, client, model) in a hash per minute
(the flattened `Totals`, comma-separated) rather than a hash field per number (HINCRBY): a minute's
few dozen packed fields stay one small listpack, where as many thousand numbers a minute would not,
and a query reads a minute in one reply. Every script names keys it builds from the prefix: a single
Redis (or a replicated one), not a Redis Cluster.
"""

from __future__ import annotations

import contextlib
import json
import urllib.parse
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

from cg.exchange.ledger import HOUR, MINUTE, ORDERS, Bucket, Change, Conversation, Totals, Turn
from cg.store.ledger import Batch, Op, dump_turn, flatten, load_turn, spans, unpack

if TYPE_CHECKING:
    import redis as redis_client

# Turns `turns` reads per round trip (a pipeline): 100,000 turns in 100 replies, none of them huge.
TURNS_BATCH = 1000

_ADD = """
local function add(key, field, delta)
  local old, sum = {}, {}
  for v in string.gmatch(redis.call('HGET', key, field) or '', '[^,]+') do old[#old + 1] = tonumber(v) end
  -- a sum packed before FLAT's later fields has none of them: they start at 0
  for j = 1, math.max(#old, #delta) do sum[j] = string.format('%.14g', (old[j] or 0) + (delta[j] or 0)) end
  local packed = table.concat(sum, ',')
  redis.call('HSET', key, field, packed)
  return sum
end
"""

# ARGV: the prefix, the batch (JSON), max turns. Orders' scores: FLAT's positions in the packed totals.
_WRITE = "#!lua\n" + _ADD + """
local p, d, max = ARGV[1], cjson.decode(ARGV[2]), tonumber(ARGV[3])
for _, b in ipairs(d.b) do
  local name = b.w .. ':' .. b.s
  add(p .. 'l:b:' .. name, b.k, b.v)
  add(p .. 'l:s:' .. name, b.t, b.v)
  redis.call('ZADD', p .. 'l:bk:' .. b.w, b.s, name)
end
for _, c in ipairs(d.c) do
  local member = c.t .. ':' .. c.id
  local key = p .. 'l:c:' .. member
  local known = redis.call('EXISTS', key) == 1
  if c.client then
    if known then
      local first, last = unpack(redis.call('HMGET', key, 'first', 'last'))
      redis.call('HSET', key, 'first', math.min(tonumber(first), c.first), 'last', math.max(tonumber(last), c.last))
    else
      redis.call('HSET', key, 'client', c.client, 'first', c.first, 'last', c.last)
      redis.call('SADD', p .. 'l:tenants', c.t)
    end
    if c.model then redis.call('HSET', key, 'model', c.model) end
  end
  if c.client or known then
    add(key, 't', c.v)
    if c['until'] then
      local before = redis.call('HGET', key, 'until')
      if not before or tonumber(before) < c['until'] then redis.call('HSET', key, 'until', c['until']) end
    end
    redis.call('HSET', key, 'warm', c.warm)
    local first, last, packed = unpack(redis.call('HMGET', key, 'first', 'last', 't'))
    local t = {}
    for v in string.gmatch(packed, '[^,]+') do t[#t + 1] = v end
    local scores = {last = last, first = first, requests = t[1], tokens_before = t[2], tokens_after = t[3],
                    cost = t[11]}
    for order, score in pairs(scores) do
      redis.call('ZADD', p .. 'l:o:' .. order, score, member)
      redis.call('ZADD', p .. 'l:o:' .. order .. ':' .. c.t, score, member)
    end
  end
end
local n = redis.call('INCRBY', p .. 'l:seq', #d.r)
for i, r in ipairs(d.r) do
  local id = n - #d.r + i
  redis.call('HSET', p .. 'l:ct:' .. r.c, id, r.row)
  redis.call('ZADD', p .. 'l:tq', id, id .. ':' .. r.time .. ':' .. r.c)
end
local over = redis.call('ZCARD', p .. 'l:tq') - max
if over > 0 then
  for _, m in ipairs(redis.call('ZRANGE', p .. 'l:tq', 0, over - 1)) do
    local id, _, c = string.match(m, '^(%d+):([^:]+):(.*)$')
    redis.call('HDEL', p .. 'l:ct:' .. c, id)
  end
  redis.call('ZREMRANGEBYRANK', p .. 'l:tq', 0, over - 1)
end
"""

# ARGV: the prefix, the tenant ('' and ARGV[3] '0': every tenant), the minutes' first start (or
# 'none'), the hours' first start. -> the packed sum of the buckets in those spans.
_TOTALS = """#!lua flags=no-writes
local p, tenant, everyone, minutes, hours = ARGV[1], ARGV[2], ARGV[3] == '1', ARGV[4], ARGV[5]
local sum = {}
local function add(packed)
  local i = 1
  for v in string.gmatch(packed, '[^,]+') do
    sum[i] = (sum[i] or 0) + tonumber(v)
    i = i + 1
  end
end
local function span(width, from, to)
  for _, name in ipairs(redis.call('ZRANGEBYSCORE', p .. 'l:bk:' .. width, from, to)) do
    if everyone then
      for _, packed in ipairs(redis.call('HVALS', p .. 'l:s:' .. name)) do add(packed) end
    else
      local packed = redis.call('HGET', p .. 'l:s:' .. name, tenant)
      if packed then add(packed) end
    end
  end
end
span(ARGV[6], hours, '+inf')
if minutes ~= 'none' then span(ARGV[7], minutes, '(' .. hours) end
for i = 1, #sum do sum[i] = string.format('%.17g', sum[i]) end
return table.concat(sum, ',')
"""

# ARGV: the prefix, the width, the first start (exclusive). -> {name, its fields, name, ...}: each bucket's
# fields as lines of "(tenant, client, model) TAB packed" (one reply per bucket, not two per field: the
# client parses a few hundred replies for 6 h of minutes, not ~14,000). The JSON of a field holds no
# raw tab or newline.
_BUCKETS = """#!lua flags=no-writes
local p, width, from = ARGV[1], ARGV[2], ARGV[3]
local found = {}
for _, name in ipairs(redis.call('ZRANGEBYSCORE', p .. 'l:bk:' .. width, '(' .. from, '+inf')) do
  local fields = redis.call('HGETALL', p .. 'l:b:' .. name)
  local lines = {}
  for i = 1, #fields, 2 do lines[#lines + 1] = fields[i] .. '\\t' .. fields[i + 1] end
  found[#found + 1] = name
  found[#found + 1] = table.concat(lines, '\\n')
end
return found
"""

# ARGV: the prefix, the horizon, the batch size. -> entries deleted (run again until it says 0)
_TRIM = """#!lua
local p, horizon, limit = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local orders = {'last', 'first', 'requests', 'tokens_before', 'tokens_after', 'cost'}
local count = 0
for _, width in ipairs({ARGV[4], ARGV[5]}) do
  local index = p .. 'l:bk:' .. width
  for _, name in ipairs(redis.call('ZRANGEBYSCORE', index, '-inf', horizon - tonumber(width), 'LIMIT', 0, limit)) do
    redis.call('DEL', p .. 'l:b:' .. name, p .. 'l:s:' .. name)
    redis.call('ZREM', index, name)
    count = count + 1
  end
end
for _, member in ipairs(redis.call('ZRANGEBYSCORE', p .. 'l:o:last', '-inf', '(' .. horizon, 'LIMIT', 0, limit)) do
  local tenant = string.match(member, '^([^:]*):')
  redis.call('DEL', p .. 'l:c:' .. member, p .. 'l:ct:' .. member)
  for _, order in ipairs(orders) do
    redis.call('ZREM', p .. 'l:o:' .. order, member)
    redis.call('ZREM', p .. 'l:o:' .. order .. ':' .. tenant, member)
  end
  if redis.call('ZCARD', p .. 'l:o:last:' .. tenant) == 0 then redis.call('SREM', p .. 'l:tenants', tenant) end
  count = count + 1
end
for _, m in ipairs(redis.call('ZRANGE', p .. 'l:tq', 0, limit - 1)) do
  local id, time, c = string.match(m, '^(%d+):([^:]+):(.*)$')
  if tonumber(time) >= horizon then break end
  redis.call('HDEL', p .. 'l:ct:' .. c, id)
  redis.call('ZREM', p .. 'l:tq', m)
  count = count + 1
end
return count
"""


class RedisLedger:
    """The ledger's keys in one Redis (see the module's doc). ``talking`` wraps every exchange with
    Redis (`cg.store.redis.RedisDB._talking`: its failures become StoreError)."""

    def __init__(self, client: redis_client.Redis, prefix: str, talking: Callable[[], contextlib.AbstractContextManager[None]]):
        self.client = client
        self.prefix = prefix
        self._talking = talking
        self._write, self._totals, self._buckets, self._trim = (
            client.register_script(s) for s in (_WRITE, _TOTALS, _BUCKETS, _TRIM))

    def write(self, ops: Sequence[Op], max_turns: int) -> None:
        batch = Batch.of(ops)
        payload = {
            "b": [{"w": repr(width), "s": repr(start), "t": _quote(tenant), "k": _combo(tenant, client, model),
                   "v": flatten(totals)} for (start, width, tenant, client, model), totals in batch.buckets.items()],
            "c": [{"t": _quote(s.tenant), "id": s.id, "warm": int(s.kept_warm), "v": flatten(s.totals),
                   **({"client": s.client, "first": s.first, "last": s.last} if s.client is not None else {}),
                   **({"model": s.model} if s.model is not None else {}),
                   **({"until": s.cache_until} if s.cache_until is not None else {})}
                  for s in batch.conversations.values()],
            "r": [{"c": f"{_quote(turn.tenant)}:{turn.conversation}", "time": repr(turn.time),
                   "row": dump_turn(turn, changes)} for turn, changes in batch.turns],
        }
        with self._talking():
            self._write(args=[self.prefix, json.dumps(payload), max_turns])

    def totals(self, tenant: str | None, since: float | None) -> Totals:
        minutes, hours = spans(since)
        with self._talking():
            packed = cast(bytes, self._totals(args=[
                self.prefix, _quote(tenant or ""), "1" if tenant is None else "0",
                "none" if minutes is None else repr(minutes), "-inf" if hours == float("-inf") else repr(hours),
                repr(HOUR), repr(MINUTE)]))
        return unpack(packed) if packed else Totals()

    def buckets(self, tenant: str | None, since: float, width: float) -> list[Bucket]:
        with self._talking():
            reply = cast(list[bytes], self._buckets(args=[self.prefix, repr(float(width)), repr(since - width)]))
        found = []
        combos: dict[bytes, tuple[str, str, str | None]] = {}  # a few dozen, in every bucket
        for name, lines in zip(reply[::2], reply[1::2]):
            start = float(name.split(b":", 1)[1])
            for line in lines.split(b"\n") if lines else ():
                combo, packed = line.split(b"\t")
                if combo not in combos:
                    combos[combo] = tuple(json.loads(combo))
                t, client, model = combos[combo]
                if tenant is None or t == tenant:
                    found.append(Bucket(start, width, t, client, model, unpack(packed)))
        found.sort(key=lambda b: (b.start, b.tenant, b.client, b.model or ""))
        return found

    def conversations(self, tenant: str | None, offset: int, limit: int,
                      order: str) -> tuple[list[Conversation], int]:
        if order not in ORDERS:
            raise ValueError(f"unknown order {order!r}")
        index = f"{self.prefix}l:o:{order}" + ("" if tenant is None else f":{_quote(tenant)}")
        with self._talking():
            members = cast(list[bytes], self.client.zrevrange(index, offset, offset + limit - 1)) if limit > 0 else []
            pipe = self.client.pipeline(transaction=False)
            pipe.zcard(index)
            for member in members:
                pipe.hgetall(f"{self.prefix}l:c:{member.decode()}")
            count, *hashes = pipe.execute()
        return [_conversation(member.decode(), fields) for member, fields in zip(members, hashes) if fields], count

    def conversation(self, tenant: str | None, id_: str) -> tuple[Conversation, list[Turn], list[Change]] | None:
        with self._talking():
            if tenant is None:
                tenants = sorted(cast(set[bytes], self.client.smembers(f"{self.prefix}l:tenants")))
                pipe = self.client.pipeline(transaction=False)
                for t in tenants:
                    pipe.hget(f"{self.prefix}l:c:{t.decode()}:{id_}", "last")
                lasts = [(float(last), t.decode()) for t, last in zip(tenants, pipe.execute()) if last is not None]
                if not lasts:
                    return None
                member = f"{max(lasts)[1]}:{id_}"
            else:
                member = f"{_quote(tenant)}:{id_}"
            fields = cast(dict[bytes, bytes], self.client.hgetall(f"{self.prefix}l:c:{member}"))
            rows = cast(list[bytes], self.client.hvals(f"{self.prefix}l:ct:{member}")) if fields else []
        if not fields:
            return None
        turns = sorted((load_turn(row) for row in rows), key=lambda pair: (pair[0].time, pair[0].seq))
        return _conversation(member, fields), [t for t, _ in turns], [c for _, changes in turns for c in changes]

    def turns(self) -> list[tuple[Turn, Sequence[Change]]]:
        wanted = []
        with self._talking():
            for member in cast(list[bytes], self.client.zrange(f"{self.prefix}l:tq", 0, -1)):
                id_, _, where = member.decode().split(":", 2)  # where: TENANT:CONVERSATION, as l:ct's
                wanted.append((id_, where))
            rows: list[bytes | None] = []
            for start in range(0, len(wanted), TURNS_BATCH):
                pipe = self.client.pipeline(transaction=False)
                for id_, where in wanted[start:start + TURNS_BATCH]:
                    pipe.hget(f"{self.prefix}l:ct:{where}", id_)
                rows += pipe.execute()
        found: list[tuple[Turn, Sequence[Change]]] = [load_turn(row) for row in rows if row is not None]
        found.sort(key=lambda pair: (pair[0].time, pair[0].seq))
        return found

    def trim(self, now: float, days: float, limit: int) -> int:
        """Delete at most `limit` entries of each kind past retention, in one script run: one batch
        of a trim (a long script would stall Redis for its other clients)."""
        with self._talking():
            return int(cast(int, self._trim(args=[self.prefix, repr(now - days * 86400.0), limit,
                                                  repr(MINUTE), repr(HOUR)])))


def _quote(tenant: str) -> str:
    return urllib.parse.quote(tenant, safe="")


def _combo(tenant: str, client: str, model: str | None) -> str:
    return json.dumps([tenant, client, model], separators=(",", ":"))


def _conversation(member: str, fields: dict[bytes, bytes]) -> Conversation:
    tenant, id_ = member.split(":", 1)
    until = fields.get(b"until")
    model = fields.get(b"model")
    return Conversation(id_, urllib.parse.unquote(tenant), fields[b"client"].decode(),
                        None if model is None else model.decode(), float(fields[b"first"]), float(fields[b"last"]),
                        unpack(fields[b"t"]), None if until is None else float(until),
                        fields.get(b"warm") == b"1")
