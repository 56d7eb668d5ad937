"""Placement: which worker's stream a request goes to, chosen at enqueue by where its
prompt's prefix is cached and how much work each worker has queued
(docs/architecture.md, "Placement").

Inputs, all in Redis:

- each live worker's KV index ``Keys.kv_index`` (the 16-byte block hashes its prefix
  cache holds, from its KV events, plus those of prompts placed on it: the prediction
  that SGLang's cache-aware router makes by inserting a routed prompt into that worker's
  tree, shared here by every gateway);
- each worker's prefill tokens waiting in its placed streams (``Keys.placed_tokens``,
  kept exact by the enqueue and pull scripts), the prompt tokens it holds uncomputed
  (``Keys.worker_load``, which it writes in every step's publish pipeline when the figure
  changed; its heartbeat's ``num_waiting_prefill_tokens`` as a fallback: a second old
  figure made follow-ups leave the worker that holds their history) and, from its
  heartbeat, its step budget (``max_num_batched_tokens``);
- each worker's requests waiting in its placed streams (``Keys.placed_requests``, kept
  by the same scripts) and those it holds, running or waiting (``Keys.worker_held``,
  which its pull script writes; its heartbeat's ``num_running + num_waiting`` as a
  fallback), and from its heartbeat its decode slots (``max_num_seqs``) and the mean
  output tokens of the requests it finished (``mean_num_output_tokens``).

A worker's queue figure (``Candidate.num_queued_tokens``, prefill tokens; the costs below
and the near set use it, saturation only its prefill part) is its queued prefill plus the
wait of a new request for a decode slot (``slot_wait_tokens``)::

    slot_wait(w) = B_w x D_w x floor(R_w / S_w)

with R_w the requests it holds, those placed on it and not pulled, and those placed on it
earlier in the same group commit; S_w its ``max_num_seqs``, B_w its
``max_num_batched_tokens``, D_w its mean output tokens per request
(``DEFAULT_OUTPUT_TOKENS`` before one finished). Behind R_w requests a new one waits for
floor(R_w / S_w) waves of outputs, D_w decode steps each, and a step is worth B_w prefill
tokens: a burst's view. In a steady stream slots free one by one and the wait is shorter;
the per-request form (B_w x D_w / S_w per request past the slots) was tried and moved
every prompt whose prefix holder had one request more than another worker: 8 sim workers
of 8 slots, shared-prefix hit rate 0.57 of one worker's against 0.64 in waves, at 929
against 1,032 tok/s (2026-11-29; bench/results/placement/sim_cpu_50ms_slots*.json). Where
decode slots set the
pace, requests waiting for one are the load, and the prefill figure misses them once their
prompt is computed or cached (sim workers of 8 slots: docs/benchmarks.md, "Scale-out");
NVIDIA Dynamo's router counts the decode blocks of active sequences and llm-d's queue
scorer the waiting requests for the same reason. With fewer requests than slots
(R_w < S_w, the common case on GPUs at ``max_num_seqs`` 256) the term is 0 and placement
is by prefill alone, as without it.

A worker that holds at least ``MIN_CACHED_TOKENS`` of the prompt gets one wave of its
slot wait back (``Placer._choose_each``): a prefix stays with its holder until the holder
is two waves behind, not one. In a burst every worker crosses each multiple of its
slots in turn, and without the slack whichever holder crossed first lost its group's
next prompt, which computed the prefix again elsewhere. What the slack leaves unbalanced,
idle workers take from the holder's stream once entries waited ``steal_after_ms``. 8 sim
workers of 8 slots, 2026-11-29: 64 groups of 8 prompts, hit rate 0.54-0.56 -> 0.74-0.75
(one worker's: 0.82) at 1,060-1,063 -> 1,104-1,112 tok/s; 256 conversations, follow-up
hit rate 0.855 -> 0.950, rounds 15% faster; 16 groups (two per worker, so a worker that
got three keeps a third wave until stealing starts), 0.50-0.52 -> 0.67-0.72 at 1,014-1,021
-> 858-926 tok/s with stealing after 2 s, 0.62-0.65 at 965-1,018 tok/s after today's
500 ms (docs/benchmarks.md, "Scale-out").

One Lua script call per group commit (``_READ``, ``Placer.place``: one round trip)
finds, for each request and candidate worker, the cached overlap (the prompt's lookup
hashes, one every ``PLACEMENT_TOKENS`` tokens, from the first up to the first one the
worker lacks: what its block manager's lookup will find, to ``PLACEMENT_TOKENS``) and
each worker's placed tokens and load. The policies (``DispatchPolicy``):

- ``cache_aware`` (default): cost(w) = ``UNCACHED_WEIGHT`` (2) x uncached prefill tokens
  on w + the queue figure of w (Dynamo's KV router: prefill blocks to compute plus the worker's load; llm-d weighs a
  prefix scorer against queue and KV scorers); the lowest cost wins. A worker whose
  queued prefill exceeds ``max_queued_steps`` of its steps' prefill is saturated: a
  request goes to the shared stream, for whichever worker frees first, unless its
  cached part on the best worker is larger than its uncached part (Preble's rule:
  compute follows the cache when the cache dominates).
- ``load``: the lowest queue figure, no cache term; saturated: shared stream.
- ``random``: a uniformly random live worker (the baseline every paper compares with).

Session affinity (``session``): a session id (``X-Session-ID``, or the body's ``user``,
by ``GatewaySettings.session_affinity``) maps to one live worker by rendezvous hashing,
so every gateway agrees without shared state and only the sessions of a worker that
leaves move; that worker is used unless it is saturated.

For a worker without per-step figures (an older build), what this gateway placed on it
since its last heartbeat counts in its queue figure (the heartbeat cannot show it yet,
and the placed hashes forget an entry once it is pulled), so a burst spreads however
fresh the heartbeats are; equal costs are broken by running requests, then at random.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from starlette.requests import Request

from shared.block_hashes import HASH_BYTES, sampled_block_hashes, sampled_prefix_lengths
from shared.fair_queue import Placement
from shared.keys import HEARTBEAT_INTERVAL_S, Keys
from shared.liveness import ready_workers
from shared.protocol import WorkerStatus
from shared.settings import DISPATCH_POLICIES, GatewaySettings

log = logging.getLogger(__name__)

#: One of ``shared.settings.DISPATCH_POLICIES``.
DispatchPolicy = Literal["cache_aware", "load", "random"]

#: Weight of a request's uncached prefill tokens against queued ones in ``cache_aware``'s
#: cost: they delay the request itself and then everything queued after it on that
#: worker, where queued tokens only delay the request. With weight 1 the second prompt
#: of a new system prompt found the first one's prefill queued on its worker and went to
#: the other, computing the prefix twice (48 of 64 groups in a burst on 2 x H200,
#: 2026-11-28); llm-d likewise weighs its prefix scorer 3 against its queue scorer 2.
UNCACHED_WEIGHT = 2

#: A cached overlap shorter than this many tokens counts as none in ``cache_aware``'s
#: choice (the placement still books it as cached): saving under 128 prefill tokens is
#: worth less than spreading load. Counting them, a burst of short chats that shared only
#: the chat template's first blocks all went to the worker that held those blocks.
MIN_CACHED_TOKENS = 128

#: Placement looks a prompt up every ``PLACEMENT_TOKENS`` tokens (every
#: ``placement_stride(block_size)``-th block hash), then block by block after the last
#: of those: the cached overlap it sees is exact to that many tokens, and hashing a
#: 4,000-token prompt costs one SHA-256 pass plus 32 finalizations instead of 249
#: (bench/placement_cost.py). Every gateway must use the
#: same figure, since one gateway's predictions are what another looks up.
PLACEMENT_TOKENS = 128


#: A worker's mean output tokens per request (D_w of ``wave_tokens``) before it finished
#: any (``WorkerStatus.mean_num_output_tokens`` 0): the order of a chat answer (ShareGPT's
#: average ~200 tokens). On fresh workers it only has to make a wave outweigh the prefill
#: a cached prefix saves, so that a burst that fills a worker's slots goes on to the others.
DEFAULT_OUTPUT_TOKENS = 128


def wave_tokens(max_num_batched_tokens: int, mean_num_output_tokens: float) -> int:
    """One wave of outputs in prefill tokens: ``mean_num_output_tokens`` decode steps
    (``DEFAULT_OUTPUT_TOKENS`` when 0), each worth ``max_num_batched_tokens``."""
    return round(max_num_batched_tokens * (mean_num_output_tokens or DEFAULT_OUTPUT_TOKENS))


def slot_wait_tokens(num_requests: int, max_num_seqs: int, wave: int) -> int:
    """How long a new request waits for a decode slot on a worker that holds (or has
    queued) ``num_requests`` requests, in prefill tokens (module docstring):
    ``num_requests // max_num_seqs`` waves of ``wave`` tokens (``wave_tokens``); 0 while
    a slot is free."""
    return num_requests // max(1, max_num_seqs) * wave


def _prefix_key(q: PlacementQuery) -> str:
    """The name ``choose`` gives a new prefix: the hash of the prompt's first
    ``MIN_CACHED_TOKENS`` tokens, "" for a shorter prompt (placed by load: a key from a
    chat template's first block would send every short chat to one worker)."""
    if q.prefix_lengths and q.prefix_lengths[0] >= MIN_CACHED_TOKENS:
        return q.hashes[0].hex()
    return ""


def placement_stride(block_size: int) -> int:
    """Block hashes per placement lookup step: ``PLACEMENT_TOKENS // block_size``, at least 1."""
    return max(1, PLACEMENT_TOKENS // block_size)


#: Outcomes counted per worker in ``inferq:placements`` (``PlacementDecision.reason``).
REASONS = ("cache", "load", "session", "random", "shared")

# KEYS: the candidate workers' KV indexes, then the placed-tokens hash, the load hash,
#       the placed-requests hash, the held hash.
# ARGV: the workers' ids (one per index, same order), the hash width, then per request
#       its sampled block hashes concatenated (HASH_BYTES each: one argument per request,
#       so the client packs one string per request and one command per group commit).
# Returns {placed tokens per worker..., load per worker (-1: none)..., placed requests
# per worker..., held requests per worker (-1: none)..., then per request the overlap
# per worker...}: overlap = how many of the request's hashes, from the first, the index
# holds before its first miss.
_READ = """
local n = #KEYS - 4
local width = tonumber(ARGV[n + 1])
local ids = {}
for w = 1, n do ids[w] = ARGV[w] end
local out = {}
for h = 1, 4 do  -- an absent placed count is 0; an absent per-step figure (2nd, 4th) -1
  local absent = 0
  if h % 2 == 0 then absent = -1 end
  local values = redis.call('HMGET', KEYS[n + h], unpack(ids))
  for w = 1, n do out[(h - 1) * n + w] = tonumber(values[w]) or absent end
end
for r = n + 2, #ARGV do
  local blob = ARGV[r]
  local num_blocks = math.floor(#blob / width)
  for w = 1, n do
    local k = 0
    while k < num_blocks do
      if redis.call('SISMEMBER', KEYS[w], string.sub(blob, k * width + 1, (k + 1) * width)) == 0 then break end
      k = k + 1
    end
    out[#out + 1] = k
  end
end
return out
"""

# KEYS: one worker's KV index. ARGV: block hashes concatenated, then their width.
# SADDs them all (the prediction of a placement), in slices that Lua's unpack takes.
_PREDICT = """
local blob, width = ARGV[1], tonumber(ARGV[2])
local batch = {}
for k = 0, math.floor(#blob / width) - 1 do
  batch[#batch + 1] = string.sub(blob, k * width + 1, (k + 1) * width)
  if #batch == 1000 then redis.call('SADD', KEYS[1], unpack(batch)); batch = {} end
end
if #batch > 0 then redis.call('SADD', KEYS[1], unpack(batch)) end
return 0
"""


@dataclass(slots=True)
class PlacementQuery:
    """One request to place: the hashes of every ``placement_stride``-th block of its
    prompt and of each full block after the last of those (``sampled_block_hashes``;
    only the blocks a worker's lookup may take: at most ``num_prompt_tokens - 1``
    tokens), its prompt length (tokens) and its session id ("" none). ``hashes[k]``
    names the prompt's first ``prefix_lengths[k]`` tokens."""

    hashes: list[bytes]
    num_prompt_tokens: int
    session: str = ""
    prefix_lengths: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class PlacementDecision:
    """A placement and why: ``reason`` is one of ``REASONS``; ``num_cached_tokens`` the
    prefix expected cached on the chosen worker (0 on the shared stream)."""

    placement: Placement
    reason: str
    num_cached_tokens: int


@dataclass(frozen=True, slots=True)
class Candidate:
    """One worker as scored for one request: ``num_cached_tokens`` expected cached there,
    ``num_queued_tokens`` its queue figure (prefill tokens queued there plus
    ``slot_wait_tokens``, counting what was placed on it earlier in the same group
    commit, and for a worker without per-step figures what this gateway placed on it
    since its last heartbeat), ``num_running`` requests it
    runs (from its heartbeat: the tie-break between equal costs, before a random one).
    ``num_shared_queued_tokens``: what every gateway reads from Redis plus what this
    group commit placed so far (None: ``num_queued_tokens``), without this gateway's
    earlier placements that only it counts; gateways judge on it which workers are near
    the cheapest for a prompt cached nowhere, so that concurrent gateways agree.
    ``num_slot_wait_tokens``: the part of ``num_queued_tokens`` that is
    ``slot_wait_tokens``, which saturation leaves out."""

    worker_id: str
    num_cached_tokens: int
    num_queued_tokens: int
    max_queued_tokens: int
    num_running: int = 0
    num_shared_queued_tokens: int | None = None
    num_slot_wait_tokens: int = 0

    @property
    def shared_queued_tokens(self) -> int:
        """``num_shared_queued_tokens``, or ``num_queued_tokens`` when not given."""
        return self.num_queued_tokens if self.num_shared_queued_tokens is None else self.num_shared_queued_tokens

    @property
    def saturated(self) -> bool:
        """More prefill queued than ``max_queued_tokens``. A wait for a decode slot does
        not saturate: sent to the shared stream instead, the prompts of a new prefix lost
        their worker and computed it wherever they landed (8 sim workers of 8 slots, in a
        run whose JSON was not kept)."""
        return self.num_queued_tokens - self.num_slot_wait_tokens > self.max_queued_tokens


def rendezvous(session: str, worker_ids: Sequence[str]) -> str:
    """The worker of ``session`` by rendezvous (highest random weight) hashing: the id
    with the largest BLAKE2b(session, id). Thaler and Ravishankar, "Using name-based
    mappings to increase hit rates" (1998)."""
    return max(worker_ids, key=lambda w: hashlib.blake2b(f"{session}\0{w}".encode(), digest_size=8).digest())


def choose(policy: DispatchPolicy, num_prompt_tokens: int, candidates: Sequence[Candidate], session: str = "",
           rng: random.Random | None = None, prefix_key: str = "", margin_tokens: int = 0) -> PlacementDecision:
    """Place one request among ``candidates`` (non-empty) by ``policy`` (module docstring).

    ``prefix_key`` names the prompt's first block (its hash, as text; "" none): under
    ``cache_aware``, a prompt cached nowhere goes to the worker that rendezvous hashing
    picks for it among the unsaturated ones whose queue, as every gateway sees it
    (``Candidate.shared_queued_tokens``), is within ``margin_tokens`` of the shortest, so
    gateways that place prompts of one new prefix at the same moment, before any of them
    sees the others' predictions, pick the same worker. (Judged on each gateway's own
    view, which also counts what it alone placed since the last heartbeats, two gateways
    in a burst split 48 of 64 new prefixes between two workers: 2 x H200, 2026-11-28.)

    Raises:
        ValueError: no candidates, or an unknown policy.
    """
    if not candidates:
        raise ValueError("no candidate workers")
    pick_one = (rng or random).choice
    if policy == "random":
        pick = pick_one(list(candidates))
        return PlacementDecision(Placement(pick.worker_id, num_prompt_tokens - pick.num_cached_tokens), "random",
                                 pick.num_cached_tokens)
    if session:
        sticky_id = rendezvous(session, [c.worker_id for c in candidates])
        sticky = next(c for c in candidates if c.worker_id == sticky_id)
        if not sticky.saturated:
            cached = sticky.num_cached_tokens if policy == "cache_aware" else 0
            return PlacementDecision(Placement(sticky.worker_id, num_prompt_tokens - cached), "session", cached)
    if policy == "load":
        best = _least(candidates, lambda c: (c.num_queued_tokens, c.num_running), pick_one)
        if best.saturated:
            return PlacementDecision(Placement(None, num_prompt_tokens), "shared", 0)
        return PlacementDecision(Placement(best.worker_id, num_prompt_tokens), "load", 0)
    if policy != "cache_aware":
        raise ValueError(f"unknown dispatch policy {policy!r}")
    def cached(c: Candidate) -> int:  # what the choice counts (``MIN_CACHED_TOKENS``)
        return c.num_cached_tokens if c.num_cached_tokens >= MIN_CACHED_TOKENS else 0

    def rank(c: Candidate) -> tuple[int, int, int]:  # the cost, then more cached, then fewer running
        counted = cached(c)
        return UNCACHED_WEIGHT * (num_prompt_tokens - counted) + c.num_queued_tokens, -counted, c.num_running

    best = _least(candidates, rank, pick_one)
    if prefix_key and cached(best) == 0 and not any(cached(c) for c in candidates):
        open_ = [c for c in candidates if not c.saturated] or candidates
        floor = min(c.shared_queued_tokens for c in open_)
        near = [c for c in open_ if c.shared_queued_tokens <= floor + margin_tokens]
        pick_id = rendezvous(prefix_key, [c.worker_id for c in near])
        best = next(c for c in near if c.worker_id == pick_id)
    uncached = num_prompt_tokens - best.num_cached_tokens
    if best.saturated and best.num_cached_tokens <= uncached:
        return PlacementDecision(Placement(None, num_prompt_tokens), "shared", 0)
    return PlacementDecision(Placement(best.worker_id, uncached), "cache" if cached(best) else "load",
                             best.num_cached_tokens)


def _least(candidates: Sequence[Candidate], key: Callable[[Candidate], tuple[int, ...]],
           pick_one: Callable[[list[Candidate]], Candidate]) -> Candidate:
    """The candidate of lowest ``key``; of several, ``pick_one``'s (at random). Equal costs are
    common (idle workers, a burst's first requests): ties are never broken by id or
    order, which would pile work on one worker."""
    keys = [key(c) for c in candidates]
    low = min(keys)
    ties = [c for c, k in zip(candidates, keys, strict=True) if k == low]
    return ties[0] if len(ties) == 1 else pick_one(ties)


@dataclass(slots=True)
class WorkerView:
    """The ready workers of the model (from their heartbeats, refreshed every
    ``HEARTBEAT_INTERVAL_S`` by ``refresh_loop``) and the block size they agree on
    (None when none is ready or two disagree: nothing can be placed then)."""

    workers: list[WorkerStatus] = field(default_factory=list)
    block_size: int | None = None
    disagreement: str = ""

    def update(self, workers: list[WorkerStatus]) -> None:
        """Take a new list of ready workers; log when their block sizes start to disagree."""
        sizes = {w.block_size for w in workers}
        self.workers = workers
        if len(sizes) > 1:
            text = ", ".join(f"{w.worker_id}: {w.block_size}" for w in workers)
            if text != self.disagreement:
                log.error("workers disagree on the KV block size (%s): placement is off until they agree", text)
            self.disagreement, self.block_size = text, None
        else:
            self.disagreement = ""
            self.block_size = next(iter(sizes)) if sizes else None


@dataclass(frozen=True, slots=True)
class _Layout:
    """What ``Placer.place`` derives from one list of ready workers, kept while the view
    holds that list: the read script's keys and leading arguments (encoded once), each
    worker's index by id, saturation limit (tokens), one wave of its outputs in prefill
    tokens (``wave_tokens`` of its step budget, at least a block, as a status from a
    build without it says 0) and the near-set margin (tokens)."""

    workers: list[WorkerStatus]
    index: dict[str, int]
    read_keys: list[bytes]
    read_args: list[bytes]
    limits: list[int]
    wave_tokens: list[int]
    margin_tokens: int

    @classmethod
    def of(cls, workers: list[WorkerStatus], keys: Keys, model: str, max_queued_steps: float) -> _Layout:
        ids = [w.worker_id for w in workers]
        block_size = workers[0].block_size
        read_keys = [*(keys.kv_index(model, w) for w in ids), keys.placed_tokens(model), keys.worker_load(model),
                     keys.placed_requests(model), keys.worker_held(model)]
        step_tokens = [max(w.max_num_batched_tokens, block_size) for w in workers]
        return cls(workers, {w: j for j, w in enumerate(ids)}, [k.encode() for k in read_keys],
                   [*(w.encode() for w in ids), str(HASH_BYTES).encode()],
                   [int(max_queued_steps * b) for b in step_tokens],
                   [wave_tokens(b, w.mean_num_output_tokens) for b, w in zip(step_tokens, workers, strict=True)],
                   max(w.max_num_batched_tokens for w in workers))

    def candidate(self, j: int, queue: _Queue) -> Candidate:
        """Worker ``j`` with ``queue``, holding none of the prompt: its queue figure is
        the prefill queued plus ``slot_wait_tokens``, on every gateway's view
        (``num_shared_queued_tokens``) and with this gateway's own recent placements."""
        w = self.workers[j]
        slots, wave = w.max_num_seqs, self.wave_tokens[j]
        num_requests = queue.num_requests
        shared = queue.num_tokens + slot_wait_tokens(num_requests, slots, wave)
        own_wait = slot_wait_tokens(num_requests + queue.num_recent_requests, slots, wave)
        own = queue.num_tokens + queue.num_recent_tokens + own_wait
        return Candidate(w.worker_id, 0, own, self.limits[j], w.num_running, shared, own_wait)


@dataclass(slots=True)
class _Queue:
    """One worker's queue during one group commit: the prefill tokens and the requests
    queued or held there as every gateway reads them from Redis, plus those this commit
    placed there (``num_tokens``, ``num_requests``); and what only this gateway counts,
    for a worker without per-step figures (``num_recent_*``: ``Placer._recent``)."""

    num_tokens: int
    num_requests: int
    num_recent_tokens: int = 0
    num_recent_requests: int = 0


class Placer:
    """Places requests for one model (``choose`` over the live workers' overlap and load).

    ``policy``: a ``DispatchPolicy``; ``max_queued_steps``: steps of a worker's
    ``max_num_batched_tokens`` of queued prefill past which it counts as saturated.
    """

    def __init__(self, client: aioredis.Redis, keys: Keys, model: str, policy: DispatchPolicy,
                 max_queued_steps: float, rng: random.Random | None = None) -> None:
        if policy not in DISPATCH_POLICIES:
            raise ValueError(f"unknown dispatch policy {policy!r}")
        self.client = client
        self.keys = keys
        self.model = model
        self.policy = policy
        self.max_queued_steps = max_queued_steps
        self.view = WorkerView()
        #: Called with the ready workers after each refresh (the per-worker gauges).
        self.on_refresh: Callable[[list[WorkerStatus]], None] | None = None
        self._read = client.register_script(_READ)
        self._predict = client.register_script(_PREDICT)
        self._predict_loaded = False
        #: Per worker: (its heartbeat's ``updated_unix_s``, prefill tokens and requests
        #: placed on it since).
        self._since_heartbeat: dict[str, tuple[float, int, int]] = {}
        self._rng = rng or random.Random()
        self._layout: _Layout | None = None

    async def refresh(self) -> None:
        """Read the ready workers now (and hand them to ``on_refresh``, if set).

        Raises:
            redis.exceptions.RedisError, OSError: Redis unreachable.
        """
        self.view.update(await ready_workers(self.client, self.keys, self.model))
        if self.on_refresh is not None:
            self.on_refresh(self.view.workers)

    async def refresh_loop(self) -> None:
        """``refresh`` every ``HEARTBEAT_INTERVAL_S`` forever; Redis errors keep the last view."""
        while True:
            try:
                await self.refresh()
            except Exception as exc:  # noqa: BLE001 - Redis down: the relay and enqueue report it
                log.debug("worker view not refreshed: %r", exc)
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    def query(self, prompt_token_ids: Sequence[int], session: str = "") -> PlacementQuery | None:
        """The placement query of a prompt, or None when nothing can be placed (no ready
        worker, or workers that disagree on the block size): the request then goes to
        the shared stream. Hashes only under ``cache_aware`` (the other policies need no
        overlap), and only every ``placement_stride(block_size)``-th block and the few
        full ones after the last of those: CPU cost one pass of SHA-256 over the prompt
        plus one finalization per ``PLACEMENT_TOKENS`` (a ``TokenIds`` prompt, as the
        gateway queues it, is hashed as it is; a list is packed into int32 bytes first)."""
        block_size = self.view.block_size
        if block_size is None:
            return None
        if self.policy != "cache_aware":
            return PlacementQuery([], len(prompt_token_ids), session)
        stride = placement_stride(block_size)
        # A worker's lookup takes at most num_tokens - 1 tokens (one is computed for logits).
        # Every block after the last sampled one too: a prompt shorter than
        # PLACEMENT_TOKENS (a chat's second turn) is looked up block by block, and the
        # overlap of a long one is exact to a block once its sampled hashes all hit. The
        # last token ends a full block only when the prompt is whole blocks: only then
        # does leaving it out drop a block.
        num_prompt_tokens = len(prompt_token_ids)
        usable = num_prompt_tokens - 1 if num_prompt_tokens % block_size == 0 else num_prompt_tokens
        return PlacementQuery(sampled_block_hashes(prompt_token_ids, block_size, stride, with_tail=True,
                                                   num_tokens=usable),
                              num_prompt_tokens, session,
                              sampled_prefix_lengths(usable, block_size, stride, with_tail=True))

    async def place(self, queries: Sequence[PlacementQuery | None]) -> list[tuple[PlacementDecision | None,
                                                                                    list[bytes]]]:
        """Place every query, in order, in one round trip: per query its decision (None
        for a None query: the shared stream) and the block hashes to add to the chosen
        worker's KV index (the prediction; empty unless placed by ``cache_aware``).

        Raises:
            redis.exceptions.RedisError, OSError: Redis unreachable.
        """
        todo = [q for q in queries if q is not None]
        if not todo or not self.view.workers:
            return [(None, []) for _ in queries]
        layout = self._layout_of(self.view.workers)
        workers, n = layout.workers, len(layout.workers)
        # One EVALSHA for the whole commit (redis-py loads the script on NOSCRIPT).
        reply = await self._read(keys=layout.read_keys,
                                 args=[*layout.read_args, *(b"".join(q.hashes) for q in todo)])
        if not self._predict_loaded:  # add_predictions runs EVALSHA inside another pipeline
            self._predict.sha = await self.client.script_load(_PREDICT)
            self._predict_loaded = True
        # Per worker, its queue as every gateway reads it (held + placed, tokens and
        # requests), and for a worker without a per-step figure, what this gateway placed
        # since its heartbeat (_recent).
        queues = []
        for j, w in enumerate(workers):
            load, held = reply[n + j], reply[3 * n + j]
            recent_tokens, recent_requests = self._recent(w)
            queues.append(_Queue(_held(w, load) + reply[j], _held_requests(w, held) + reply[2 * n + j],
                                 recent_tokens if load < 0 else 0, recent_requests if held < 0 else 0))
        decided = iter(self._choose_each(todo, reply, queues, layout))
        return [(None, []) if q is None else next(decided) for q in queries]

    def _choose_each(self, todo: list[PlacementQuery], reply: list[int], queues: list[_Queue],
                     layout: _Layout) -> list[tuple[PlacementDecision, list[bytes]]]:
        """``choose`` for each query of ``todo`` in turn, from the read script's ``reply``
        and the workers' ``queues`` (``place``), each placement counted for the queries
        after it: its prefill and one request in its worker's queue (``base``, changed
        for that worker only), its hashes in that worker's predicted blocks."""
        n = len(queues)
        # Per worker, the candidate that holds none of the prompt.
        base = [layout.candidate(j, queue) for j, queue in enumerate(queues)]
        # The blocks this call predicted on each worker: the read script ran before any of
        # them, so a burst of prompts sharing a prefix would otherwise place its first
        # few on different workers, each computing the prefix.
        predicted_here: list[set[bytes]] = [set() for _ in range(n)]
        out = []
        for k, q in enumerate(todo):
            candidates = list(base)
            for j, overlap in enumerate(reply[(4 + k) * n:(5 + k) * n]):
                held = predicted_here[j]
                # Predicted blocks can only lengthen the overlap if they hold its next hash.
                if held and overlap < len(q.hashes) and q.hashes[overlap] in held:
                    overlap = max(overlap, _overlap(q.hashes, held))
                if overlap:
                    c, num_cached = base[j], q.prefix_lengths[overlap - 1]
                    # A worker that holds the prefix keeps its requests a wave longer.
                    slack = min(c.num_slot_wait_tokens, layout.wave_tokens[j]) if num_cached >= MIN_CACHED_TOKENS else 0
                    candidates[j] = Candidate(c.worker_id, num_cached, c.num_queued_tokens - slack,
                                              c.max_queued_tokens, c.num_running, c.num_shared_queued_tokens,
                                              c.num_slot_wait_tokens - slack)
            decision = choose(self.policy, q.num_prompt_tokens, candidates, q.session, self._rng,
                              prefix_key=_prefix_key(q), margin_tokens=layout.margin_tokens)
            target = decision.placement.worker_id
            predicted: list[bytes] = []
            if target is not None:
                j = layout.index[target]
                tokens = decision.placement.num_prefill_tokens
                status = layout.workers[j]
                recent_tokens, recent_requests = self._recent(status)
                self._since_heartbeat[target] = (status.updated_unix_s, recent_tokens + tokens, recent_requests + 1)
                queue = queues[j]
                queue.num_tokens += tokens
                queue.num_requests += 1
                base[j] = layout.candidate(j, queue)
                if self.policy == "cache_aware":
                    predicted = q.hashes
                    predicted_here[j].update(predicted)
            out.append((decision, predicted))
        return out

    def _layout_of(self, workers: list[WorkerStatus]) -> _Layout:
        """``workers``' ``_Layout``, built once per worker view (``WorkerView.update``
        replaces its list, never changes it in place)."""
        if self._layout is None or self._layout.workers is not workers:
            self._layout = _Layout.of(workers, self.keys, self.model, self.max_queued_steps)
        return self._layout

    def _recent(self, status: WorkerStatus) -> tuple[int, int]:
        """Prefill tokens and requests this gateway placed on the worker of ``status``
        since that heartbeat was written (this call's included): its
        ``num_waiting_prefill_tokens`` and ``num_running + num_waiting`` cannot show them
        yet, and the placed hashes stop counting them once the worker pulls them. Each
        counted only for a worker without the per-step figure (load, held requests), whose
        own comes from its heartbeat, up to a second old; the per-step figures show them
        to every gateway alike. (Compared by the heartbeat's own timestamp, so no clock
        skew between hosts enters.)"""
        stamp, tokens, requests = self._since_heartbeat.get(status.worker_id, (0.0, 0, 0))
        return (tokens, requests) if stamp >= status.updated_unix_s else (0, 0)

    def add_predictions(self, pipe: Pipeline, predictions: Sequence[tuple[str, list[bytes]]]) -> None:
        """Add to ``pipe`` the SADD of each ``(worker id, block hashes)`` into that
        worker's KV index (one script call each, the hashes as one string): the prefix of
        a prompt placed there, before the worker has computed it. A NOSCRIPT reply (Redis
        restarted since ``place`` loaded the script) only loses the prediction."""
        for worker_id, hashes in predictions:
            pipe.evalsha(self._predict.sha, 1, self.keys.kv_index(self.model, worker_id), b"".join(hashes), HASH_BYTES)


def _overlap(hashes: Sequence[bytes], held: set[bytes]) -> int:
    """How many of ``hashes``, from the first, ``held`` holds before its first miss."""
    for k, h in enumerate(hashes):
        if h not in held:
            return k
    return len(hashes)


def _held(status: WorkerStatus, load: int) -> int:
    """The prompt tokens a worker holds uncomputed: from the load hash (written each step,
    -1 when absent), else from its heartbeat (up to ``HEARTBEAT_INTERVAL_S`` old)."""
    return load if load >= 0 else status.num_waiting_prefill_tokens


def _held_requests(status: WorkerStatus, held: int) -> int:
    """The requests a worker holds, running or waiting: from the held hash (written by
    its pulls, -1 when absent), else from its heartbeat."""
    return held if held >= 0 else status.num_running + status.num_waiting


#: Header that names a request's session (``GatewaySettings.session_affinity``).
SESSION_HEADER = "X-Session-ID"


def session_of(request: Request, body_user: str | None, settings: GatewaySettings) -> str:
    """The request's session id for affinity, by ``settings.session_affinity``: the
    ``X-Session-ID`` header (``header``), the body's ``user`` (``user``), the header
    else the user (``header_or_user``), or "" (``off``, or none given)."""
    source = settings.session_affinity
    if source == "off":
        return ""
    if source in ("header", "header_or_user"):
        value = request.headers.get(SESSION_HEADER, "")
        if value or source == "header":
            return value
    return body_user or ""
