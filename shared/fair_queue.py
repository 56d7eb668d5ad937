"""The model's queue: priority classes, and fair share between tenants within a class,
kept entirely in Redis so every gateway and worker sees one queue
(docs/operations.md, "Priority classes and fair share").

Layout (names in ``shared/keys.py``):

- one stream per (class, tenant) of a model, every one read by the consumer group
  ``workers`` as before (pending entries, XCLAIM reaping, XACK + XDEL on finish); the
  set ``{ns}:{{model}}:queues`` lists them;
- per class, a sorted set of the streams that may hold waiting entries ("active"
  tenants), each scored by the tenant's **virtual token counter** (VTC: Sheng et al.,
  "Fairness in Serving Large Language Models", OSDI 2024; AIBrix's VTC router);
- a doorbell list that idle workers block on.

Two Lua scripts do every change, so each is atomic however many gateways and workers run:

- ``_ENQUEUE`` (gateway): admission first (given a limit, refuse the request(s), writing
  nothing, when the model's waiting entries summed over its streams plus them would
  exceed it: exact, as the check and the XADD are one step), then XADD the request(s)
  with their cost, join the tenant to its class's active set, ring the doorbell. A
  tenant that (re)joins starts at the smallest active counter of its class (VTC's lift),
  rounded up, less half a token (``JOIN_OFFSET``): it is served before the tenant holding
  that counter, not after it on a tie broken by stream name. Idling banks no credit: a
  tenant that left (nothing waiting) was the one with the smallest counter when it was
  last served, so forgetting its counter gains it at most one request's cost. A request of a class above the lowest
  is also announced on the model's arrivals channel (``arrival_message``: its class rank
  and tenant), for busy workers (``LLMEngine.note_arrival``).
- ``_PULL`` (worker): take the highest non-empty class (interactive, then default, then
  batch), in it the stream with the smallest counter, XREADGROUP one entry (no BLOCK:
  allowed in scripts), and add the entry's cost to the counter; a stream with nothing
  undelivered leaves the active set. Repeat while fewer than ``N[class]`` entries are
  taken in all, where ``N[c]`` is what the engine can admit of class ``c``
  (``num_admittable(c)``: a full engine may still take a higher class, which it preempts
  a lower one for). Then, per class, up to ``extra[class]`` more entries, each from the
  stream with the smallest counter that the worker did not exclude (a full engine's fair
  share of slots between tenants: ``worker/engine/fair_share.py``). When every class
  came up empty, nothing waits: it clears the doorbell. A placed entry taken leaves its
  owner's placed tokens and placed requests; given the requests the consumer's engine
  holds, the script writes them plus those it took (``Keys.worker_held``), so placement
  counts every pulled request in one of the two at every moment.

An entry's cost is ``PROMPT_TOKEN_WEIGHT * prompt tokens + OUTPUT_TOKEN_WEIGHT *
max_tokens`` (VTC's cost function ``w_p * input + w_q * output``; our weights make an
output token cost twice an input token, as decoding one costs more than prefilling one).
It is charged when pulled and not refunded when a request stops early: the queue never
sees how many tokens were generated.
Entries XADDed to the base stream by hand (without the script) carry no cost: they count
1 and are read after the active sets come up empty.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.exceptions import NoScriptError, ResponseError

from shared import protocol
from shared.keys import ANONYMOUS_TENANT, BASE_CLASS, CONSUMER_GROUP, STREAM_FIELD, Keys
from shared.protocol import GenerateRequest
from shared.streams import QueueDepth, as_text, parse_pending_summary

#: Priority classes, highest first; the index is the class's rank
#: (``GenerateRequest.priority``: lower is served first, as vLLM's ``priority``).
PRIORITY_CLASSES = ("interactive", "default", "batch")
#: The highest and the lowest class (``PRIORITY_CLASSES``' ends).
HIGHEST_CLASS, LOWEST_CLASS = PRIORITY_CLASSES[0], PRIORITY_CLASSES[-1]
#: Header naming a request's class (``gateway/priority.py``).
PRIORITY_HEADER = "X-Priority"
#: Class of a request that names none.
DEFAULT_CLASS = BASE_CLASS
#: Weights of a prompt token and of an output token in VTC's cost function (our choice:
#: output twice input).
PROMPT_TOKEN_WEIGHT = 1
OUTPUT_TOKEN_WEIGHT = 2
#: Stream entry field holding the entry's cost (``entry_cost``), beside ``STREAM_FIELD``.
COST_FIELD = b"c"
#: Stream entry field holding the prefill tokens the entry is expected to compute on the
#: worker that takes it (the prompt less its expected prefix-cache hit): what the pull
#: script's prefill budget counts, and what a placed entry adds to its worker's
#: ``Keys.placed_tokens`` while it waits.
PREFILL_FIELD = b"p"
#: Stream entry field of a placed entry naming the (class, tenant) stream whose virtual
#: token counter its cost is charged to when pulled (fair share counts placed requests).
CHARGE_FIELD = b"s"
#: A tenant that joins its class's active set scores ``ceil(smallest counter) -
#: JOIN_OFFSET``: just before the tenant with the smallest counter, so its first request
#: is the next one pulled, not one pull later on a tie broken by stream name. Counters
#: move in whole cost units, so a joiner never sorts before another tenant that joined at
#: the same minimum (both score ``ceil(min) - JOIN_OFFSET``), and gains at most
#: ``JOIN_OFFSET`` of credit.
JOIN_OFFSET = 0.5
#: A fair-share pull (``FairQueue.pull``'s ``extra``) looks at most at this many of a
#: class's active tenants, smallest counter first, for one not excluded.
FAIR_SHARE_SCAN_STREAMS = 16
#: The doorbell holds at most this many rings (one per enqueued entry; stale ones are
#: cleared when a pull finds the queue empty).
DOORBELL_MAX_RINGS = 64


def class_rank(priority_class: str) -> int:
    """Rank of a class name (0 interactive, 1 default, 2 batch). Raises ValueError."""
    return PRIORITY_CLASSES.index(priority_class)


def arrival_message(rank: int, tenant: str) -> str:
    """What the enqueue script publishes on the arrivals channel: ``"<class rank>:<tenant>"``."""
    return f"{rank}:{tenant}"


def parse_arrival(message: bytes | str) -> tuple[int, str]:
    """``(class rank, tenant)`` of an arrivals-channel message (``arrival_message``).

    Raises:
        ValueError: not such a message.
    """
    text = message.decode() if isinstance(message, bytes) else message
    rank, sep, tenant = text.partition(":")
    if not sep:
        raise ValueError(f"not an arrival message: {text[:40]!r}")
    return int(rank), tenant


def entry_cost(request: GenerateRequest) -> int:
    """The virtual tokens a request costs its tenant when a worker pulls it (>= 1)."""
    return max(1, PROMPT_TOKEN_WEIGHT * len(request.prompt_token_ids)
               + OUTPUT_TOKEN_WEIGHT * request.sampling.max_tokens)


@dataclass(frozen=True, slots=True)
class StealFrom:
    """A placed stream another worker may take entries from (``FairQueue.pull``): the
    owner's ``worker_id``, the stream's ``priority_class``, and the least time an entry
    must have waited there, ms (0 for a dead owner's streams)."""

    worker_id: str
    priority_class: str
    min_age_ms: int


class QueueFull(Exception):
    """The enqueue script refused requests: the model's queue would hold more than its
    limit (``FairQueue.enqueue``'s ``max_waiting``). ``num_waiting``: entries waiting then."""

    def __init__(self, num_waiting: int) -> None:
        super().__init__(f"{num_waiting} requests waiting")
        self.num_waiting = num_waiting


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one request goes and what it is expected to cost there: ``worker_id`` names
    the worker whose placed stream takes it (None: the shared (class, tenant) stream,
    for whichever worker pulls it first); ``num_prefill_tokens`` is the prompt tokens
    it is expected to compute there (the prompt less the prefix that worker caches),
    which pull budgets and the placed-tokens hash count."""

    worker_id: str | None
    num_prefill_tokens: int


def enqueue_reply(reply: Any) -> list[bytes] | None:
    """The enqueue script's reply (``_ENQUEUE``) read: the new entry ids, or None when the
    request-id key existed.

    Raises:
        QueueFull: the script refused the requests (its reply: the waiting count).
    """
    if reply is None:
        return None
    if isinstance(reply, int):
        raise QueueFull(reply)
    return list(reply)


def stream_class_tenant(keys: Keys, model: str, stream: str) -> tuple[str, str]:
    """``(class, tenant)`` of one of ``model``'s streams (inverse of ``Keys.class_stream``);
    a placed stream (``Keys.placed_stream``) names no tenant: ``(class, "")``."""
    placed = placed_owner(keys, model, stream)
    if placed is not None:
        return placed[1], ""
    base = keys.requests_stream(model)
    if stream == base:
        return BASE_CLASS, ANONYMOUS_TENANT
    priority_class, _, tenant = stream[len(base) + 1:].partition(":")
    return priority_class, tenant


def placed_owner(keys: Keys, model: str, stream: str) -> tuple[str, str] | None:
    """``(worker id, class)`` of a placed stream of ``model`` (``Keys.placed_stream``), or
    None for any other stream."""
    prefix = keys.placed_prefix(model)
    if not stream.startswith(prefix):
        return None
    worker_id, _, priority_class = stream[len(prefix):].rpartition(":")
    return worker_id, priority_class


# A Lua function of the enqueue script: the entries no worker has taken yet, over the
# model's streams (the set KEYS[set_key] and the base stream KEYS[base_key]): per stream
# XLEN less the group ARGV[1]'s pending count (not below 0; a stream without the group has
# nothing pending), as ``depths()`` sums them.
_WAITING_FN = """
local function num_waiting(set_key, base_key)
  local total, seen = 0, {}
  local function add(stream)
    if seen[stream] then return end
    seen[stream] = true
    local length = redis.call('XLEN', stream)
    if length > 0 then
      local summary = redis.pcall('XPENDING', stream, ARGV[1])
      if type(summary) == 'table' and summary.err == nil then
        length = math.max(0, length - tonumber(summary[1]))
      end
    end
    total = total + length
  end
  add(KEYS[base_key])
  for _, stream in ipairs(redis.call('SMEMBERS', KEYS[set_key])) do add(stream) end
  return total
end
"""

# KEYS: stream, class active set, model's stream set, doorbell (the model's, or the
#       placed-on worker's), base stream, placed-tokens hash, placed-requests hash,
#       stream of the entry to finish first[, request-id key]
# ARGV: group, stream field, cost field, entry id to finish first ("" none), ttl, wire id,
#       max rings, join offset (JOIN_OFFSET), arrivals channel ("" none), its message, the
#       most entries that may wait (admission's ``max_queue_len``; -1: no limit), worker
#       id placed on ("" for a shared stream), the (class, tenant) stream to charge,
#       prefill field, charge field, then (cost, prefill tokens, payload) triples.
#       Returns the new entry ids; the number of waiting entries when the new ones would
#       take it past the limit; false when the request-id key exists. Nothing is written
#       unless it returns ids. A placed entry joins no active set (its worker reads it
#       first, whatever the counters say) and adds its prefill tokens to its worker's
#       field of the placed-tokens hash, and 1 to its field of the placed-requests hash.
_ENQUEUE = _WAITING_FN + """
local max_waiting = tonumber(ARGV[11])
local first_arg = 16
if max_waiting >= 0 then
  local waiting = num_waiting(3, 5)
  if waiting + (#ARGV - first_arg + 1) / 3 > max_waiting then return waiting end
end
if #KEYS > 8 and not redis.call('SET', KEYS[9], ARGV[6], 'NX', 'EX', ARGV[5]) then
  return false
end
if ARGV[4] ~= '' then
  redis.pcall('XACK', KEYS[8], ARGV[1], ARGV[4])
  redis.call('XDEL', KEYS[8], ARGV[4])
end
if redis.call('SADD', KEYS[3], KEYS[1]) == 1 then
  redis.pcall('XGROUP', 'CREATE', KEYS[1], ARGV[1], '0', 'MKSTREAM')
end
local placed = ARGV[12] ~= ''
if not placed and not redis.call('ZSCORE', KEYS[2], KEYS[1]) then
  local low = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
  local score = 0
  if low[2] then score = math.ceil(tonumber(low[2])) - ARGV[8] end
  redis.call('ZADD', KEYS[2], score, KEYS[1])
end
local ids = {}
for i = first_arg, #ARGV, 3 do
  if placed then
    ids[#ids + 1] = redis.call('XADD', KEYS[1], '*', ARGV[2], ARGV[i + 2], ARGV[3], ARGV[i],
                               ARGV[14], ARGV[i + 1], ARGV[15], ARGV[13])
    redis.call('HINCRBY', KEYS[6], ARGV[12], ARGV[i + 1])
    redis.call('HINCRBY', KEYS[7], ARGV[12], 1)
  else
    ids[#ids + 1] = redis.call('XADD', KEYS[1], '*', ARGV[2], ARGV[i + 2], ARGV[3], ARGV[i], ARGV[14], ARGV[i + 1])
  end
  redis.call('RPUSH', KEYS[4], 1)
end
redis.call('LTRIM', KEYS[4], -tonumber(ARGV[7]), -1)
if ARGV[9] ~= '' then redis.call('PUBLISH', ARGV[9], ARGV[10]) end
return ids
"""

# KEYS: the classes' active sets (highest class first; n of them), base stream,
#       doorbell, the consumer's own placed streams (one per class, same order),
#       placed-tokens hash, the consumer's own doorbell, placed-requests hash, held
#       hash, then the steal streams (other workers' placed streams).
# ARGV: 1 group, 2 consumer, 3 cost field, 4 prefill field, 5 charge field, 6 the most
#       streams to scan for fair-share extras, 7 prefill budget (tokens; -1 none), 8 the
#       limit for the base stream's hand-made entries, 9 number of steal streams, 10 the
#       requests the consumer holds (-1: write nothing; else the script writes them plus
#       the entries it took to the consumer's field of the held hash), then
#       per class the most entries to hold in all once that class's are taken, per class
#       the fair-share extra entries, per steal stream (owner worker id, class index
#       1..n, the least age in ms of an entry it may take), then the streams excluded
#       from the extras. Returns {stream, entry id, fields} triples.
#
# Per class, highest first: the consumer's own placed stream (FIFO), then the class's
# tenants by virtual token counter, then the fair-share extras. Then the base stream's
# hand-made entries. Then, while there is room, entries of the steal streams whose
# first undelivered entry is at least its age old (Redis's clock). Every take but the
# extras counts its prefill field against the budget; the first take needs only a
# positive budget, so a prompt longer than the budget still runs.
_PULL = """
local n_steal = tonumber(ARGV[9])
local n = (#KEYS - 6 - n_steal) / 2
local base, doorbell = KEYS[n + 1], KEYS[n + 2]
local tokens_key, own_bell, requests_key = KEYS[2 * n + 3], KEYS[2 * n + 4], KEYS[2 * n + 5]
local held_key = KEYS[2 * n + 6]
local limited = tonumber(ARGV[7]) >= 0
local left = tonumber(ARGV[7])
local steal_args = 11 + 2 * n
local excluded = {}
for i = steal_args + 3 * n_steal, #ARGV do excluded[ARGV[i]] = true end
local function room() return (not limited) or left > 0 end
-- Up to ``count`` undelivered entries of ``stream``. A stream without the group gets it
-- (and is created), unless ``placed``: a placed stream exists only once the enqueue script
-- made it, group and all, and listed it; one made here would be listed nowhere and never
-- deleted (every pull reads the consumer's own three).
local function read(stream, count, placed)
  local r = redis.pcall('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', count, 'STREAMS', stream, '>')
  if type(r) == 'table' and r.err then
    if not string.find(r.err, 'NOGROUP') then error(r) end
    if placed then return {} end
    redis.call('XGROUP', 'CREATE', stream, ARGV[1], '0', 'MKSTREAM')
    r = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', count, 'STREAMS', stream, '>')
  end
  if not r then return {} end
  return r[1][2]
end
local function field(fields, name)
  for i = 1, #fields, 2 do
    if fields[i] == name then return fields[i + 1] end
  end
  return nil
end
local out = {}
local function taken(stream, entry)
  out[#out + 1] = {stream, entry[1], entry[2]}
  left = left - (tonumber(field(entry[2], ARGV[4])) or 0)
end
-- One entry of class c's shared ``stream``, its cost added to the stream's counter; a
-- stream with nothing undelivered leaves the active set. True when one was taken.
local function take(c, stream)
  local entries = read(stream, 1)
  if #entries == 0 then
    redis.call('ZREM', KEYS[c], stream)
    return false
  end
  redis.call('ZINCRBY', KEYS[c], tonumber(field(entries[1][2], ARGV[3])) or 1, stream)
  taken(stream, entries[1])
  return true
end
-- One entry of a placed stream of ``owner``: it and its prefill leave the owner's
-- waiting requests and tokens, its cost goes to its tenant's counter if that tenant is
-- active.
local function take_placed(c, stream, owner)
  local entries = read(stream, 1, true)
  if #entries == 0 then return false end
  local fields = entries[1][2]
  local prefill = tonumber(field(fields, ARGV[4])) or 0
  if prefill ~= 0 then redis.call('HINCRBY', tokens_key, owner, -prefill) end
  redis.call('HINCRBY', requests_key, owner, -1)
  local charge = field(fields, ARGV[5])
  if charge then redis.call('ZADD', KEYS[c], 'XX', 'INCR', tonumber(field(fields, ARGV[3])) or 1, charge) end
  taken(stream, entries[1])
  return true
end
-- Milliseconds (Redis's clock) since the first undelivered entry of ``stream`` was
-- added, or nil when none waits.
local now_ms = nil
local function waiting_age_ms(stream)
  local groups = redis.pcall('XINFO', 'GROUPS', stream)
  if type(groups) ~= 'table' or groups.err then return nil end
  for _, g in ipairs(groups) do
    local name, last = nil, nil
    for i = 1, #g, 2 do
      if g[i] == 'name' then name = g[i + 1] elseif g[i] == 'last-delivered-id' then last = g[i + 1] end
    end
    if name == ARGV[1] then
      local first = redis.call('XRANGE', stream, '(' .. last, '+', 'COUNT', 1)
      if #first == 0 then return nil end
      if now_ms == nil then
        local t = redis.call('TIME')
        now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
      end
      return now_ms - tonumber(string.match(first[1][1], '^(%d+)'))
    end
  end
  return nil
end
local own_empty = true
for c = 1, n do
  local want = tonumber(ARGV[10 + c])
  while #out < want and room() do
    if not take_placed(c, KEYS[n + 2 + c], ARGV[2]) then break end
  end
  if #out >= want or not room() then own_empty = false end
  while #out < want and room() do
    local top = redis.call('ZRANGE', KEYS[c], 0, 0)
    if #top == 0 then break end
    take(c, top[1])
  end
  local extra = tonumber(ARGV[10 + n + c])
  if extra > 0 then
    for _, stream in ipairs(redis.call('ZRANGE', KEYS[c], 0, tonumber(ARGV[6]) - 1)) do
      if extra == 0 then break end
      if not excluded[stream] and take(c, stream) then extra = extra - 1 end
    end
  end
end
local want = tonumber(ARGV[8])
if #out < want and room() then
  for _, e in ipairs(read(base, want - #out)) do taken(base, e) end
end
for j = 1, n_steal do
  local stream = KEYS[2 * n + 6 + j]
  local at = steal_args + 3 * (j - 1)
  local owner, c, min_age = ARGV[at], tonumber(ARGV[at + 1]), tonumber(ARGV[at + 2])
  while #out < tonumber(ARGV[10 + c]) and room() do
    local age = waiting_age_ms(stream)
    if age == nil or age < min_age then break end
    if not take_placed(c, stream, owner) then break end
  end
end
local empty = #out < want
for c = 1, n do
  if redis.call('EXISTS', KEYS[c]) == 1 then empty = false end
end
if empty then redis.call('DEL', doorbell) end
if own_empty then redis.call('DEL', own_bell) end
local held = tonumber(ARGV[10])
if held >= 0 then redis.call('HSET', held_key, ARGV[2], held + #out) end
return out
"""


class FairQueue:
    """One model's classes and tenants in Redis: enqueue (gateway), pull (worker), depth.

    ``client``: a ``redis.asyncio`` client (bytes replies).
    """

    def __init__(self, client: aioredis.Redis, keys: Keys, model: str) -> None:
        self.client = client
        self.keys = keys
        self.model = model
        self.base_stream = keys.requests_stream(model)
        self._enqueue = client.register_script(_ENQUEUE)
        self._pull = client.register_script(_PULL)
        self._active = [keys.active_streams(model, c) for c in PRIORITY_CLASSES]

    def stream(self, priority_class: str, tenant: str) -> str:
        """Stream of one (class, tenant) (``Keys.class_stream``)."""
        return self.keys.class_stream(self.model, priority_class, tenant)

    def placed_stream_of(self, stream: str, worker_id: str) -> str:
        """The placed stream of worker ``worker_id`` for the class of ``stream`` (one of
        ``stream()``'s): where ``enqueue`` puts a request placed on that worker."""
        return self.keys.placed_stream(self.model, worker_id, stream_class_tenant(self.keys, self.model, stream)[0])

    def active_set(self, priority_class: str) -> str:
        """Active-set key of a class."""
        return self._active[class_rank(priority_class)]

    async def enqueue(self, stream: str, requests: Sequence[GenerateRequest], *, request_id_key: str | None = None,
                      wire_id: str = "", ttl_s: int = 1, finish_stream: str | None = None,
                      finish_entry_id: bytes | str = "", max_waiting: int = -1,
                      placement: Placement | None = None) -> list[bytes] | None:
        """XADD ``requests`` (one (class, tenant) ``stream``'s, one of ``stream()``'s) in
        one atomic script: all or none. Without ``placement`` (or with one naming no
        worker) they go to ``stream``, which joins its class's active set; placed on a
        worker, to that worker's placed stream of the class (``Keys.placed_stream``),
        charged to ``stream``'s tenant when pulled, and each counts
        ``placement.num_prefill_tokens`` in the worker's placed tokens and one in its
        placed requests (``Keys.placed_requests``) until a worker takes it. With
        ``request_id_key``, only if that key is absent (it then holds ``wire_id`` for
        ``ttl_s`` s); returns None when it was present. ``finish_entry_id``: an entry of
        ``finish_stream`` (default: where the requests go) to XACK + XDEL first
        (failover's continuation). ``max_waiting`` >= 0 is admission's limit: the script
        writes nothing when the model's waiting entries (XLEN - pending over all of its
        streams, as ``depths()``) plus ``requests`` would exceed it. Returns the new entry
        ids, or None as above.

        Raises:
            QueueFull: over ``max_waiting`` (nothing written).
            ValueError: ``stream`` is not a stream of a known class of this model.
            redis.exceptions.RedisError, OSError: Redis unreachable or refusing the write.
        """
        keys, args = self._enqueue_call(stream, requests, request_id_key, wire_id, ttl_s, finish_stream,
                                        finish_entry_id, max_waiting, placement)
        return enqueue_reply(await self._enqueue(keys=keys, args=args))

    async def enqueue_batch(self, items: Sequence[tuple[str, GenerateRequest, Placement | None]],
                            max_waiting: int = -1,
                            after: Callable[[Pipeline], None] | None = None) -> list[list[bytes] | Exception]:
        """Enqueue lone requests, each ``(stream, request, placement)`` its own atomic
        ``enqueue`` script, in one non-transactional pipeline: one round trip. Returns,
        per item, its entry ids or its own error (``QueueFull``, a ``ResponseError`` such
        as OOM). ``after(pipe)`` may add commands to the same pipeline after the scripts
        (placement's predicted KV blocks); their replies are not read.

        redis-py sends ``SCRIPT EXISTS`` before every pipeline that runs a registered
        script, a second round trip; this pipeline calls EVALSHA itself instead. A script
        Redis does not hold (a restart, ``SCRIPT FLUSH``) fails with NOSCRIPT having done
        nothing, and those items go again once after ``SCRIPT LOAD``.

        Raises:
            ValueError: as ``enqueue``.
            redis.exceptions.RedisError, OSError: Redis unreachable (nothing can be said of
                which items were written).
        """
        calls = [self._enqueue_call(stream, [request], None, "", 1, None, "", max_waiting, placement)
                 for stream, request, placement in items]
        results: list[list[bytes] | Exception] = [ResponseError("not sent")] * len(items)
        todo = list(range(len(items)))
        for attempt in range(2):
            async with self.client.pipeline(transaction=False) as pipe:
                for i in todo:
                    keys, args = calls[i]
                    pipe.evalsha(self._enqueue.sha, len(keys), *keys, *args)
                if after is not None and attempt == 0:
                    after(pipe)
                replies = await pipe.execute(raise_on_error=False)
            missing = []
            for i, reply in zip(todo, replies, strict=False):
                if isinstance(reply, NoScriptError) and attempt == 0:
                    missing.append(i)
                elif isinstance(reply, Exception):
                    results[i] = reply
                else:
                    try:
                        ids = enqueue_reply(reply)
                        assert ids is not None, "no request-id key, so never None"
                        results[i] = ids
                    except QueueFull as exc:
                        results[i] = exc
            if not missing:
                break
            self._enqueue.sha = await self.client.script_load(_ENQUEUE)
            todo = missing
        return results

    def _enqueue_call(self, stream: str, requests: Sequence[GenerateRequest], request_id_key: str | None,
                      wire_id: str, ttl_s: int, finish_stream: str | None, finish_entry_id: bytes | str,
                      max_waiting: int, placement: Placement | None) -> tuple[list[str], list[Any]]:
        """KEYS and ARGV of one ``_ENQUEUE`` call (``enqueue``'s arguments)."""
        priority_class, tenant = stream_class_tenant(self.keys, self.model, stream)
        worker_id = placement.worker_id if placement is not None else None
        if worker_id is not None:
            target = self.keys.placed_stream(self.model, worker_id, priority_class)
            doorbell = self.keys.worker_doorbell(self.model, worker_id)
        else:
            target, doorbell = stream, self.keys.doorbell(self.model)
        keys = [target, self.active_set(priority_class), self.keys.model_streams(self.model), doorbell,
                self.base_stream, self.keys.placed_tokens(self.model), self.keys.placed_requests(self.model),
                finish_stream or target]
        if request_id_key is not None:
            keys.append(request_id_key)
        # A class above the lowest is announced on the arrivals channel, with its tenant: a
        # busy worker may stop its step or withhold a chained one for it, so that its next
        # pull takes it (worker/engine/arrivals.py).
        rank = class_rank(priority_class)
        arrivals = self.keys.arrivals_channel(self.model) if rank < len(PRIORITY_CLASSES) - 1 else ""
        args: list[Any] = [CONSUMER_GROUP, STREAM_FIELD, COST_FIELD, finish_entry_id, max(1, ttl_s), wire_id,
                           DOORBELL_MAX_RINGS, JOIN_OFFSET, arrivals, arrival_message(rank, tenant), max_waiting,
                           worker_id or "", stream, PREFILL_FIELD, CHARGE_FIELD]
        for r in requests:
            prefill = placement.num_prefill_tokens if placement is not None else len(r.prompt_token_ids)
            args += [entry_cost(r), prefill, protocol.encode(r)]
        return keys, args

    async def pull(self, consumer: str, count: int | Sequence[int], extra: Sequence[int] = (),
                   excluded: Collection[str] = (), *, prefill_budget: int = -1,
                   steal: Sequence[StealFrom] = (), num_held: int = -1) -> list[tuple[str, bytes, dict[bytes, bytes]]]:
        """Deliver waiting entries to ``consumer``: per class, highest first, its own placed
        stream (``Keys.placed_stream(model, consumer, class)``) first, then the tenant
        with the smallest virtual token counter. ``count``: the most entries in all, or per
        class rank ``c`` the most in all once class ``c``'s are taken (the engine's
        ``num_admittable(c)``, non-decreasing in ``c``); entries XADDed to the base stream
        by hand count against the ``default`` class's. ``extra`` (per class rank, default
        none): entries to take beyond that, each from the tenant with the smallest counter
        among the first ``FAIR_SHARE_SCAN_STREAMS`` of the class whose stream is not in
        ``excluded`` (a full engine's fair share of slots: ``EngineBackend.fair_share_blocked``).
        ``prefill_budget`` (tokens, -1: none): stop once the entries taken carry this many
        prefill tokens (``PREFILL_FIELD``; the first needs only a positive budget).
        ``steal``: other workers' placed streams to take from, while room is left, the
        entries that waited there at least ``StealFrom.min_age_ms``. ``num_held`` >= 0:
        the requests the consumer's engine holds; the script writes them plus the entries
        it took to the consumer's field of ``Keys.worker_held`` (placement's count, in
        the same step as the placed-requests count drops).
        Returns ``(stream, entry id, fields)`` triples in the order they were chosen.

        Raises:
            redis.exceptions.RedisError, OSError: Redis unreachable.
        """
        counts = [count] * len(PRIORITY_CLASSES) if isinstance(count, int) else list(count)
        extras = list(extra) or [0] * len(PRIORITY_CLASSES)
        assert len(counts) == len(extras) == len(PRIORITY_CLASSES), (counts, extras)
        own = [self.keys.placed_stream(self.model, consumer, c) for c in PRIORITY_CLASSES]
        keys = [*self._active, self.base_stream, self.keys.doorbell(self.model), *own,
                self.keys.placed_tokens(self.model), self.keys.worker_doorbell(self.model, consumer),
                self.keys.placed_requests(self.model), self.keys.worker_held(self.model),
                *(self.keys.placed_stream(self.model, s.worker_id, s.priority_class) for s in steal)]
        steal_args: list[Any] = []
        for s in steal:
            steal_args += [s.worker_id, class_rank(s.priority_class) + 1, s.min_age_ms]
        reply = await self._pull(keys=keys, args=[
            CONSUMER_GROUP, consumer, COST_FIELD, PREFILL_FIELD, CHARGE_FIELD, FAIR_SHARE_SCAN_STREAMS,
            prefill_budget, counts[class_rank(DEFAULT_CLASS)], len(steal), num_held, *counts, *extras, *steal_args, *excluded])
        out = []
        for stream, entry_id, flat in reply or []:
            fields = {flat[i]: flat[i + 1] for i in range(0, len(flat), 2)}
            out.append((as_text(stream), entry_id, fields))
        return out

    async def wait(self, timeout_s: float, consumer: str | None = None) -> bool:
        """Block until the model's doorbell (or ``consumer``'s own: a request placed on
        it) rings (True) or ``timeout_s`` passes (False)."""
        bells = [self.keys.doorbell(self.model)]
        if consumer is not None:
            bells.append(self.keys.worker_doorbell(self.model, consumer))
        return await self.client.blpop(bells, timeout=timeout_s) is not None

    async def ensure_base(self) -> None:
        """Create the base stream and its group (idempotent) and list it in the model's set."""
        try:
            await self.client.xgroup_create(self.base_stream, CONSUMER_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        await self.client.sadd(self.keys.model_streams(self.model), self.base_stream)

    async def streams(self) -> list[str]:
        """Every stream of the model (the base stream first, then sorted)."""
        members = {as_text(m) for m in await self.client.smembers(self.keys.model_streams(self.model))}
        members.discard(self.base_stream)
        return [self.base_stream, *sorted(members)]

    async def depths(self) -> dict[str, QueueDepth]:
        """XLEN and pending count of every stream, in one pipeline after the set read."""
        streams = await self.streams()
        async with self.client.pipeline(transaction=False) as pipe:
            for s in streams:
                pipe.xlen(s)
                pipe.xpending(s, CONSUMER_GROUP)
            replies = await pipe.execute(raise_on_error=False)
        out = {}
        for i, s in enumerate(streams):
            length, summary = replies[2 * i], replies[2 * i + 1]
            if isinstance(length, Exception):
                raise length
            if isinstance(summary, ResponseError) and "NOGROUP" in str(summary):
                out[s] = QueueDepth(length=int(length), num_pending=0, has_group=False)
                continue
            if isinstance(summary, Exception):
                raise summary
            out[s] = QueueDepth(length=int(length), num_pending=parse_pending_summary(summary), has_group=True)
        return out
