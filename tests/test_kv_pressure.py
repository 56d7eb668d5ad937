"""The inferq engine when its KV cache is short (real SmolLM2, float32, CPU, 9 blocks of
16 tokens, prefill chunks of 64 tokens): preemption with prefix caching on, two requests
computing the same prefix at once, a request that needs more blocks than exist, and an
engine step that raises while a worker holds requests (the worker's 500 path,
``Worker._fail_all``, with the real engine behind it).

Engine runs here are bounded in steps, so a scheduler that stops making progress fails
the test instead of hanging it.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import redis.asyncio as aioredis

from shared import protocol
from shared.keys import STREAM_FIELD, Keys
from shared.protocol import ErrorMessage, GenerateRequest, TokenOutput
from shared.sampling import SamplingParams
from shared.settings import EngineSettings, ModelSettings
from shared.streams import read_depth
from tests.test_worker_paths import Reply, is_last, split_reply
from worker.backends.inferq import InferqBackend
from worker.engine.block_manager import BlockManager
from worker.engine.request import Request
from worker.engine.scheduler import Scheduler
from worker.service import Worker

pytestmark = pytest.mark.timeout(600)

BLOCK_SIZE = 16
NUM_BLOCKS = 9
CHUNK_TOKENS = 64
NUM_OUTPUT = 32
GREEDY = SamplingParams(max_tokens=NUM_OUTPUT, temperature=0.0, ignore_eos=True)
#: 19 and 83 tokens: each fits alone (3 and 8 blocks with its outputs); together the
#: cache runs out while both decode, and the longer one, admitted last, is preempted
#: after 14 outputs and resumes from 80 cached tokens for its last 18.
STORY = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
PROSE = ("The old lighthouse keeper climbed the spiral stairs every evening, carrying a brass lantern and a "
         "notebook full of strange observations. Over forty years he had recorded storms, shipwrecks, migrating "
         "whales and once a green light that hovered above the waves for three nights before vanishing. The "
         "villagers laughed at his notes, but the young schoolteacher who arrived that autumn read every page. "
         "She noticed that the dates of the green light matched")
ITEMS = " ".join(f"Item {i}: a short description of thing number {i}." for i in range(9))
CAPITAL = "The capital of France is"
KEYS = Keys("tkv")
MODEL = "SmolLM2-135M-Instruct"
STREAM = KEYS.requests_stream(MODEL)
CHANNEL = KEYS.gateway_channel("g1")
_ids = itertools.count()


@pytest.fixture(scope="module")
def engine(smollm_source) -> InferqBackend:
    return InferqBackend(smollm_source, ModelSettings(dtype="float32", device="cpu", max_model_len=512),
                         EngineSettings(block_size=BLOCK_SIZE, num_kv_blocks=NUM_BLOCKS,
                                        max_num_batched_tokens=CHUNK_TOKENS, max_num_seqs=8))


@pytest.fixture()
def idle(engine: InferqBackend) -> Iterator[InferqBackend]:
    """The shared engine with an empty prefix cache, checked to hold no block afterwards."""
    engine.scheduler.block_manager.reset_prefix_cache()
    yield engine
    for request_id in list(engine.scheduler.requests):  # left by a failed test
        engine.abort(request_id)
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_free_blocks) == (0, 0, NUM_BLOCKS)


def generate(engine: Any, prompts: list[list[int]], params: SamplingParams = GREEDY,
             max_steps: int = 400) -> tuple[list[list[int]], list[int]]:
    """Run ``prompts`` together to their end; returns each one's output ids and its
    cached prompt tokens (as the first output reports them).

    Raises:
        AssertionError: not finished after ``max_steps`` engine steps (the requests are
            aborted first), or a token index out of order.
    """
    ids = [f"g{next(_ids)}" for _ in prompts]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, prompt, params)
    outs: dict[str, list[int]] = {r: [] for r in ids}
    cached: dict[str, int] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return [outs[r] for r in ids], [cached[r] for r in ids]
        for out in engine.step():
            assert out.first_index == len(outs[out.request_id])
            outs[out.request_id] += out.new_token_ids
            cached.setdefault(out.request_id, out.num_cached_tokens)
    stuck = [(r.request_id, r.status.name, len(r.block_table), r.num_computed_tokens)
             for r in engine.scheduler.requests.values()]
    for request_id in ids:
        engine.abort(request_id)
    raise AssertionError(f"not finished after {max_steps} steps: {stuck}, {engine.stats()}")


def alone(engine: InferqBackend, prompt: list[int]) -> list[int]:
    """``prompt``'s greedy output run by itself from an empty prefix cache."""
    engine.scheduler.block_manager.reset_prefix_cache()
    before = engine.stats().num_preemptions
    (out,), _ = generate(engine, [prompt])
    assert engine.stats().num_preemptions == before  # no pressure: it fits alone
    return out


# -- preemption with prefix caching on -------------------------------------------------------

@pytest.mark.slow
def test_preemption_with_prefix_caching_equals_an_unpressured_run(idle, smollm_tokenizer) -> None:
    prompts = [smollm_tokenizer.encode(STORY), smollm_tokenizer.encode(PROSE)]
    assert [len(p) for p in prompts] == [19, 83]
    expected = [alone(idle, p) for p in prompts]
    idle.scheduler.block_manager.reset_prefix_cache()
    before = idle.stats()
    got, _ = generate(idle, prompts)
    after = idle.stats()
    assert got == expected
    assert all(len(o) == NUM_OUTPUT for o in got)
    assert after.num_preemptions > before.num_preemptions
    # The prompts share no block: every hit is a preempted request resuming from the
    # blocks it had filled before (freed, still cached).
    assert after.prefix_cache_hits > before.prefix_cache_hits


def _run_to_end(scheduler: Scheduler, max_steps: int) -> None:
    """Step ``scheduler`` with made-up tokens until it holds no request."""
    for _ in range(max_steps):
        if not scheduler.requests:
            return
        out = scheduler.schedule()
        scheduler.update(out, [7 if item.samples else None for item in out.scheduled])
    stuck = [(r.request_id, r.status.name, len(r.block_table)) for r in scheduler.requests.values()]
    raise AssertionError(f"not finished after {max_steps} steps: {stuck}, "
                         f"{scheduler.block_manager.num_free_blocks} blocks free")


def test_preempted_requests_do_not_deadlock_holding_cached_prefixes() -> None:
    """The scheduling of the test above alone (made-up tokens, no model). A waiting
    request once kept the cached prefix it was given on a failed admission: here the
    preempted one, back at the head of the queue, then held blocks that the running one
    needed, which preempted itself and did the same, and with every block held and
    nothing running each later step came back empty."""
    scheduler = Scheduler(BlockManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=True), 8, CHUNK_TOKENS)
    for i, n in enumerate((19, 83)):
        params = SamplingParams(max_tokens=NUM_OUTPUT, ignore_eos=True)
        scheduler.add(Request(f"r{i}", [1000 * i + j for j in range(1, n + 1)], params))
    _run_to_end(scheduler, max_steps=500)
    assert scheduler.num_preemptions > 0 and scheduler.block_manager.num_prefix_hits > 0
    assert scheduler.block_manager.num_free_blocks == NUM_BLOCKS


# -- the same prefix, computed by two requests at once ---------------------------------------

#: The 24-token prompt's output alone, computed once for both variants below.
_SHARED_PREFIX_EXPECTED: list[list[int]] = []


@pytest.mark.slow
@pytest.mark.parametrize("chunk_tokens, num_cached_b", [(2048, 16), (16, 16)], ids=["same-step", "chunked"])
def test_two_requests_computing_one_prefix(idle, smollm_tokenizer, monkeypatch, chunk_tokens: int,
                                           num_cached_b: int) -> None:
    # same-step: A computes all 24 prompt tokens in one step while B waits for A's first
    # block (in-batch prefix caching, Scheduler._defer) and starts from it the step after;
    # chunked (16 tokens a step): A's first chunk (a full block) is cached when B is
    # admitted in the next step, and B starts from it. Either way 8 of the 9 blocks
    # suffice: no preemption.
    prompt = smollm_tokenizer.encode(PROSE)[:24]
    if not _SHARED_PREFIX_EXPECTED:
        _SHARED_PREFIX_EXPECTED.append(alone(idle, prompt))
    (expected,) = _SHARED_PREFIX_EXPECTED
    idle.scheduler.block_manager.reset_prefix_cache()
    monkeypatch.setattr(idle.scheduler, "max_num_batched_tokens", chunk_tokens)
    before = idle.stats().num_preemptions
    (a, b), cached = generate(idle, [prompt, prompt])
    assert a == expected and b == expected
    assert cached == [0, num_cached_b]
    stats = idle.stats()
    assert stats.num_preemptions == before  # sharing, not pressure, is under test
    assert (stats.num_free_blocks, stats.kv_usage) == (NUM_BLOCKS, 0.0)  # no leak, no double free
    # The prompt's full block stays cached: a third request finds it.
    (c,), (cached_c,) = generate(idle, [prompt], SamplingParams(max_tokens=1, temperature=0.0))
    assert cached_c == 16 and c == expected[:1]


# -- through a worker: the paths a client sees -----------------------------------------------

@asynccontextmanager
async def serving(client: aioredis.Redis, engine: InferqBackend) -> AsyncIterator[tuple[Worker, Any]]:
    """A worker around ``engine`` and a subscription to its replies. On exit the worker
    is cancelled and whatever it left in the engine is aborted, on the engine's thread
    (after a step still running there)."""
    worker = Worker(client, KEYS, MODEL, "w1", engine)
    pubsub = client.pubsub()
    await pubsub.subscribe(CHANNEL)
    task = asyncio.create_task(worker.run())
    try:
        yield worker, pubsub
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await worker.engine_thread.run(lambda: [engine.abort(r) for r in list(engine.scheduler.requests)])
        worker.engine_thread.close()
        await pubsub.aclose()


async def submit(client: aioredis.Redis, request_id: str, prompt: list[int], params: SamplingParams) -> None:
    message = GenerateRequest(request_id=request_id, model=MODEL, prompt_token_ids=prompt, sampling=params,
                              reply_channel=CHANNEL, deadline_unix_s=time.time() + 300)
    await client.xadd(STREAM, {STREAM_FIELD: protocol.encode(message)})


async def until_finished(worker: Worker, pubsub: Any, request_ids: set[str], max_steps: int = 300
                         ) -> dict[str, list[Reply]]:
    """Replies until each of ``request_ids`` got its last one (error or finish).

    Raises:
        AssertionError: the worker ran ``max_steps`` engine steps without that.
    """
    out: dict[str, list[Reply]] = {r: [] for r in request_ids}
    open_ids = set(request_ids)
    first_step = worker.num_steps
    while open_ids:
        assert worker.num_steps - first_step < max_steps, f"no answer for {open_ids} after {max_steps} steps"
        item = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2)
        if item is None:
            continue
        for reply in split_reply(item["data"]):
            out.setdefault(reply.request_id, []).append(reply)
            if is_last(reply):
                open_ids.discard(reply.request_id)
    return out


def tokens(messages: list[Reply]) -> list[int]:
    assert all(isinstance(m, TokenOutput) for m in messages), messages
    return [t for m in messages for t in m.token_ids]


async def settled(client: aioredis.Redis, worker: Worker) -> None:
    """Wait (bounded) for the last publish's XACK + XDEL; then nothing is left anywhere."""
    for _ in range(250):
        depth = await read_depth(client, STREAM)
        if not worker.inflight and (depth.length, depth.num_pending) == (0, 0):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"entries left: {depth}, in flight {list(worker.inflight)}")


#: (prompt tokens, max_tokens, prefill chunk): the 9 blocks hold 144 tokens.
_TOO_BIG = [
    pytest.param(200, 4, 2048, id="prompt-in-one-chunk"),
    pytest.param(120, 40, CHUNK_TOKENS, id="prompt-and-outputs"),  # the prompt fits, with its outputs it does not
]


@pytest.mark.slow
@pytest.mark.parametrize("num_prompt_tokens, max_tokens, chunk_tokens", _TOO_BIG)
async def test_a_request_larger_than_the_kv_cache_gets_an_error(idle, client, smollm_tokenizer, monkeypatch,
                                                                num_prompt_tokens: int, max_tokens: int,
                                                                chunk_tokens: int) -> None:
    assert -(-(num_prompt_tokens + max_tokens) // BLOCK_SIZE) > NUM_BLOCKS
    monkeypatch.setattr(idle.scheduler, "max_num_batched_tokens", chunk_tokens)
    prompt = (smollm_tokenizer.encode(ITEMS) * 2)[:num_prompt_tokens]
    capital = smollm_tokenizer.encode(CAPITAL)
    async with serving(client, idle) as (worker, pubsub):
        await submit(client, "big", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        # Refused before it runs (400, no tokens), naming the cause; nothing else fails.
        (error,) = (await until_finished(worker, pubsub, {"big"}))["big"]
        assert isinstance(error, ErrorMessage) and error.status == 400, error
        assert f"this worker's cache has {NUM_BLOCKS}" in error.message
        # The worker goes on serving.
        await submit(client, "next", capital, SamplingParams(max_tokens=4, temperature=0.0))
        assert len(tokens((await until_finished(worker, pubsub, {"next"}))["next"])) == 4
        await settled(client, worker)


@pytest.mark.slow
async def test_engine_error_fails_held_requests_frees_their_blocks_and_serving_goes_on(
        idle, client, smollm_tokenizer, monkeypatch) -> None:
    capital, fib = smollm_tokenizer.encode(CAPITAL), smollm_tokenizer.encode("def fibonacci(n):")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    (expected,), _ = generate(idle, [capital], params)
    execute = idle.runner.execute
    calls = itertools.count(1)

    def execute_failing_third(*args: Any, **kwargs: Any) -> Any:
        if next(calls) == 3:  # both requests have 2 tokens; the scheduler allocated this step's blocks
            raise RuntimeError("injected fault")
        return execute(*args, **kwargs)

    monkeypatch.setattr(idle.runner, "execute", execute_failing_third)
    # Queued before the worker starts: both in its first step.
    await submit(client, "a", capital, SamplingParams(max_tokens=50, ignore_eos=True))
    await submit(client, "b", fib, SamplingParams(max_tokens=50, ignore_eos=True))
    async with serving(client, idle) as (worker, pubsub):
        failed = await until_finished(worker, pubsub, {"a", "b"})
        for request_id in ("a", "b"):
            *token_messages, error = failed[request_id]
            assert len(tokens(token_messages)) == 2
            assert isinstance(error, ErrorMessage)
            assert (error.status, error.message) == (500, "engine error: RuntimeError: injected fault")
        await settled(client, worker)
        stats = await worker.engine_thread.run(idle.stats)
        assert (stats.num_running, stats.num_waiting, stats.num_free_blocks) == (0, 0, NUM_BLOCKS)
        await submit(client, "c", capital, params)
        assert tokens((await until_finished(worker, pubsub, {"c"}))["c"]) == expected
        await settled(client, worker)
